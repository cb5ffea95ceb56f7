"""Helpers for lesson 09_attention_fast_paths: ragged batches, masked attention in float64, encoders
built from a seed, and which kernels actually ran.

Two boolean mask conventions meet in this lesson, and they are opposite:

* ``F.scaled_dot_product_attention``'s boolean ``attn_mask``: ``True`` means *attend*;
* ``nn.MultiheadAttention``'s and ``nn.TransformerEncoder``'s ``key_padding_mask``: ``True`` means
  *ignore* (a padded key).

Masked attention itself (a float64 reference and the naive baseline) answers the lesson's first
exercise, so it is the grader's alone: :mod:`course.references.fastpath`.

Facts the lesson relies on differ between the PyTorch releases the course supports, so the lesson
measures them where it runs instead of stating one answer (``tests/test_lesson_claims.py`` checks
every one on each release):

* SDPA given both ``attn_mask`` and ``is_causal=True`` combined them on torch 2.4 to 2.13 and raises
  "Explicit attn_mask should not be set when is_causal=True" from 2.14: fold the causal mask into
  ``attn_mask`` yourself (:func:`causal_mask`).
* A query row whose keys are all masked gives NaN on torch 2.4 and zeros on 2.13 and later.
* ``nn.TransformerEncoder`` under CPU autocast takes its fast path, which ignores autocast: without
  a padding mask it returns bfloat16 (torch 2.13 to 2.15) or raises (2.4); with a padding mask and
  nested tensors (the default) it raises "expected scalar type Float but found BFloat16" on every
  supported release (PyTorch issue 107663).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import nn

from course.data import device_generator
from course.devices import pick_device
from course.guard import reference
from course.remote import factory, recipe

__all__ = ["FAST_OP", "causal_mask", "encoder", "encoder_config", "encoder_layer", "fast_path_taken", "ops_that_ran",
           "masked_attention_inputs", "padded_token_mlp", "ragged_batch", "slow_path", "split_heads", "token_mlp",
           "valid_tokens"]

#: The op ``nn.TransformerEncoderLayer`` runs when it takes its fast path (one fused layer).
FAST_OP = "aten::_transformer_encoder_layer_fwd"


@factory
def ragged_batch(seed: int, *, device: str = "cpu", batch: int = 4, length: int = 32, dim: int = 16,
                 valid: float = 0.6, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, key_padding_mask)``: ``x`` of shape ``(batch, length, dim)``, right-padded sequences
    whose lengths average about ``valid * length`` (at least 1, at most ``length``; one of them the
    whole length, so the padded width is honest), padded positions zero; ``key_padding_mask``
    ``(batch, length)``, ``True`` at padded positions (the ``nn.MultiheadAttention`` convention)."""
    g = torch.Generator().manual_seed(seed)  # the lengths: a handful of integers, drawn alike everywhere
    spread = max(1, round(length * min(valid, 1 - valid)))
    centre = round(valid * length)
    lengths = torch.randint(max(1, centre - spread), min(length, centre + spread) + 1, (batch,), generator=g)
    lengths[int(torch.randint(batch, (1,), generator=g))] = length
    dev = pick_device(device)
    pad = torch.arange(length, device=dev)[None, :] >= lengths.to(dev)[:, None]
    x = torch.randn(batch, length, dim, generator=device_generator(seed, device), device=dev, dtype=dtype)
    return x.masked_fill(pad[..., None], 0.0), pad


def valid_tokens(x: torch.Tensor, key_padding_mask: torch.Tensor) -> torch.Tensor:
    """The rows of ``x`` (``(batch, length, ...)``) at unpadded positions, ``(tokens, ...)``: what two
    answers must agree on (the fast path leaves zeros at padded positions, the slow path does not)."""
    return x[~key_padding_mask.bool()]


def causal_mask(length: int, keys: int | None = None, *, device: Any = None) -> torch.Tensor:
    """SDPA's boolean causal mask, ``True`` where query ``i`` may attend key ``j`` (``j <= i``,
    aligned to the top left like ``is_causal=True``)."""
    return torch.ones(length, length if keys is None else keys, dtype=torch.bool, device=device).tril()


@factory
def masked_attention_inputs(seed: int, *, device: str = "cpu", batch: int = 4, heads: int = 8, length: int = 256,
                            dim: int = 64, valid: float = 0.6) -> tuple[torch.Tensor, ...]:
    """``(q, k, v, key_padding_mask)``: float32 ``(batch, heads, length, dim)`` standard normal inputs
    and a right-padded ``(batch, length)`` mask (``True`` = padded key) from :func:`ragged_batch`."""
    g = device_generator(seed, device)
    dev = pick_device(device)
    q, k, v = (torch.randn(batch, heads, length, dim, generator=g, device=dev) for _ in range(3))
    _, pad = ragged_batch(seed, device=device, batch=batch, length=length, dim=1, valid=valid)
    return q, k, v, pad


#: An encoder that takes the fast path (eval mode, no gradients): every field a plain value, so a
#: configuration crosses to the learner's process as data. Each field the lesson varies.
BASE_CONFIG = dict(d_model=16, nhead=2, dim_feedforward=32, layers=2, dropout=0.0, activation="relu",
                   norm_first=False, batch_first=True, bias=True, dtype="float32", training=False, grad=False,
                   padding_mask=False, nested=True)


def encoder_config(**changes: Any) -> dict:
    """:data:`BASE_CONFIG` with ``changes``; unknown fields are an error (a typo would test nothing)."""
    unknown = set(changes) - set(BASE_CONFIG)
    if unknown:
        raise KeyError(f"unknown encoder settings {sorted(unknown)}; the settings are {sorted(BASE_CONFIG)}")
    return {**BASE_CONFIG, **changes}


@recipe
def encoder(seed: int = 0, d_model: int = 16, nhead: int = 2, dim_feedforward: int = 32, layers: int = 2,
            dropout: float = 0.0, activation: str = "relu", norm_first: bool = False, batch_first: bool = True,
            bias: bool = True, dtype: str = "float32", training: bool = False, nested: bool = True,
            device: str = "cpu") -> nn.TransformerEncoder:
    """An ``nn.TransformerEncoder`` of ``layers`` identical-shaped layers, weights drawn from ``seed``,
    in eval mode unless ``training``; ``nested`` is its ``enable_nested_tensor``."""
    with torch.random.fork_rng(devices=[]):  # nn.Linear draws from the global generator: seeded here, then given back
        torch.manual_seed(seed)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout=dropout, activation=activation,
                                           norm_first=norm_first, batch_first=batch_first, bias=bias)
        with warnings.catch_warnings():  # "enable_nested_tensor is True, but self.use_nested_tensor is False
            warnings.simplefilter("ignore")  # because ...": the lesson asks why, by experiment
            enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=nested)
    return enc.to(device=pick_device(device), dtype=getattr(torch, dtype)).train(training)


@recipe
def encoder_layer(seed: int = 0, d_model: int = 16, nhead: int = 2, dim_feedforward: int = 32,
                  norm_first: bool = False, dtype: str = "float64", device: str = "cpu") -> nn.TransformerEncoderLayer:
    """One ``nn.TransformerEncoderLayer`` (batch first, ReLU, no dropout), weights drawn from ``seed``
    (biases and LayerNorm parameters too: zeros and ones would hide a bias left out), in eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout=0.0, norm_first=norm_first,
                                           batch_first=True)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                if p.dim() == 1:
                    p.copy_(torch.randn_like(p) * 0.5 + (1.0 if name.endswith("norm1.weight") or
                                                         name.endswith("norm2.weight") else 0.0))
    return layer.to(device=pick_device(device), dtype=getattr(torch, dtype)).eval()


def ops_that_ran(fn: Callable[[], Any]) -> set[str]:
    """The names of the ops the profiler saw while ``fn()`` ran (CPU side)."""
    from course.quiet import quiet_kineto

    quiet_kineto()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@reference
def run_config(config: dict, seed: int = 0) -> tuple[torch.Tensor, bool]:
    """Run the encoder ``config`` describes on a ragged batch: ``(output, whether the fast path ran)``."""
    c = encoder_config(**config)
    enc = encoder(seed, **{k: c[k] for k in ("d_model", "nhead", "dim_feedforward", "layers", "dropout", "activation",
                                             "norm_first", "batch_first", "bias", "dtype", "training", "nested")})
    x, pad = ragged_batch(seed + 1, batch=3, length=6, dim=c["d_model"], dtype=getattr(torch, c["dtype"]))
    if not c["batch_first"]:
        x = x.transpose(0, 1)
    kwargs = dict(src_key_padding_mask=pad) if c["padding_mask"] else {}
    out: list = []

    def forward():
        with torch.set_grad_enabled(c["grad"]), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "The PyTorch API of nested tensors is in prototype stage"
            out.append(enc(x, **kwargs))

    ran = ops_that_ran(forward)
    return out[0], FAST_OP in ran


@reference
def fast_path_taken(config: dict, seed: int = 0) -> bool:
    """Whether ``nn.TransformerEncoder`` as ``config`` describes took its fast path: measured, by the
    op that ran, on the PyTorch installed here."""
    return run_config(config, seed)[1]


# -- a token MLP on ragged batches -------------------------------------------------------------------

@recipe
def token_mlp(seed: int = 0, dim: int = 16, hidden: int = 64, device: str = "cpu") -> nn.Sequential:
    """A transformer's feed-forward block, ``Linear(dim, hidden) -> GELU -> Linear(hidden, dim)``,
    weights drawn from ``seed``, in eval mode: it acts on each token alone, so padding is pure waste."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
    return mlp.to(pick_device(device)).eval()


def padded_token_mlp(x: torch.Tensor, key_padding_mask: torch.Tensor, mlp: nn.Module) -> torch.Tensor:
    """The baseline: the MLP on every position, padding included, padded positions then zeroed."""
    with torch.no_grad():
        return mlp(x).masked_fill(key_padding_mask[..., None], 0.0)


def split_heads(x: torch.Tensor, heads: int, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``(B, L, D)`` as attention's ``(B, heads, L, D / heads)``; with a ``key_padding_mask``, the
    real tokens only, as one jagged nested tensor ``(B, heads, j, D / heads)`` (no copy per sample)."""
    b, n, d = x.shape
    if key_padding_mask is None:
        return x.reshape(b, n, heads, d // heads).transpose(1, 2)
    real = ~key_padding_mask
    offsets = torch.cat([real.new_zeros(1, dtype=torch.long), real.sum(1).cumsum(0)])
    return torch.nested.nested_tensor_from_jagged(x[real].reshape(-1, heads, d // heads), offsets).transpose(1, 2)


def slow_path(enc: nn.Module, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``enc(x, src_key_padding_mask=...)`` with the fast path switched off
    (``torch.backends.mha.set_fastpath_enabled(False)``) for this call only."""
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        return enc(x, src_key_padding_mask=key_padding_mask)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)

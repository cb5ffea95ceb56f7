"""Checks for lesson 09_attention_fast_paths: attention with causal and key-padding masks by hand
(two opposite boolean conventions), the same through ``F.scaled_dot_product_attention`` written to
run on every supported release, predictions of when ``nn.TransformerEncoder`` takes its fast path,
and a guard against the fast path's autocast bug (PyTorch issue 107663).

Every check is ``SERVED``: under the grader it runs in the judge and calls the learner's functions
across the boundary on inputs it drew from a seed. Numbers are always compared here, with the
course's float64 references. What only the learner's process can see (how its function called
SDPA, what it did under autocast) is asked of the course's own probes running there; their word
can only add a failure, never replace a comparison made here. The answers whose structure is graded
(masked attention by hand, SDPA once, the encoder layer rebuilt, the autocast guard) are then read by
the judge and run again in the program host (:func:`course.hand.hosted`), where the same probes watch
a program that cannot name what would blind them. The jagged MLP is lent by the judge
(:class:`LentMLP`): what it was given (one jagged tensor of the batch's tokens) is the judge's record. Truth about the fast path is
measured, by the op that ran, on the PyTorch installed (:func:`course.fastpath.fast_path_taken`),
so a prediction is graded against the release it runs on.
"""

from __future__ import annotations

import random
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F

from course.checks.common import (TorchCalls, call, expect_no_loop_by_clock, grader_references, name_mistake,
                                  names_with, ok, probed_names, record, served_speedup, stored_answers)
from course.checks.sdpa_watch import SDPACalls, every_sdpa_call, watched
from course.checks.witnesses import DispatcherOps, alone
from course.data import generator
from course.devices import pick_device
from course.hand import again
from course.fastpath import (BASE_CONFIG, encoder, encoder_config, encoder_layer, fast_path_taken, masked_attention_inputs,
                             padded_token_mlp, ragged_batch, token_mlp, valid_tokens)
from course.numerics import assert_close, describe
from course.remote import is_remote, lend, probe, prober

__all__ = ["check_autocast_guard", "check_fast_path_predictions", "check_jagged_mlp", "check_jagged_speed",
           "check_masked_attention", "check_sdpa_attention", "check_sdpa_encoder_layer", "check_sdpa_speed"]

SERVED = ("check_masked_attention", "check_sdpa_attention", "check_sdpa_speed", "check_fast_path_predictions",
          "check_autocast_guard", "check_jagged_mlp", "check_jagged_speed", "check_sdpa_encoder_layer")

F64 = torch.float64
TIGHT = dict(rtol=1e-7, atol=1e-9)


def reference_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
    """:func:`course.references.fastpath.reference_attention`, reached through ``grader_references``
    where a check runs (the judge, or the tests): the module answers an exercise, so the learner's
    process never has it, and a learner's copy compares with stored data instead."""
    refs = grader_references("fastpath")
    if refs is None:
        raise RuntimeError("the reference attention is the grader's: a learner's copy of the course compares "
                           f"with the answers stored in course/reference_data/{DATA_FILE}.")
    return refs.reference_attention(*args, **kwargs)


#: What the visible checks compare with in a learner's copy (``python -m course.references`` writes it).
DATA_FILE = "09_masked_attention.pt"


def reference_data(seed: int = 0) -> dict:
    """The float64 answers (and the known misreadings' results) of the mask checks' cases on
    ``seed``, computed by the grader's reference: ``{"seed", "cases": {label: answer},
    "variants": {label: {mistake: result}}, "float32": answer}``."""
    reference = reference_attention
    cpu = torch.device("cpu")
    cases, variants = {}, {}
    for label, (q, k, v), masks in _cases(seed, cpu):
        cases[label] = reference(q, k, v, **masks)
        variants[label] = _mask_variants(q, k, v, masks)
    q, k, v, pad = _float32_case(seed, cpu)
    return {"seed": seed, "cases": cases, "variants": variants,
            "float32": reference(q, k, v, key_padding_mask=pad, is_causal=True)}


# -- 1 and 2. masked attention ---------------------------------------------------------------------

def _cases(seed: int, device: torch.device, attn_masks: bool = True) -> list[tuple[str, tuple, dict]]:
    """``(label, (q, k, v), masks)``: every combination of a boolean ``attn_mask``, a key-padding mask
    and ``is_causal`` on ragged right-padded batches, in float64. Key 0 is always visible (never
    padded, never masked), so no query is left without keys: every answer is well defined."""
    g = generator(seed)
    out = []
    for i, (b, h, length, d) in enumerate([(2, 2, 7, 8), (3, 1, 12, 4), (1, 3, 5, 16)]):
        q, k, v = (torch.randn(b, h, length, d, generator=g, dtype=F64).to(device) for _ in range(3))
        _, pad = ragged_batch(seed * 7 + i, batch=b, length=length, dim=1, valid=0.6)
        pad[:, 0] = False
        attend = torch.rand(length, length, generator=g) > 0.35
        attend[:, 0] = True
        for masks in (dict(key_padding_mask=pad), dict(attn_mask=attend), dict(is_causal=True),
                      dict(key_padding_mask=pad, is_causal=True), dict(attn_mask=attend, key_padding_mask=pad),
                      {}):
            if "attn_mask" in masks and not attn_masks:
                continue
            masks = {key: (m.to(device) if isinstance(m, torch.Tensor) else m) for key, m in masks.items()}
            label = ", ".join(["q (%d, %d, %d, %d)" % tuple(q.shape)]
                              + [f"{key}={'True' if m is True else tuple(m.shape)}" for key, m in masks.items()])
            out.append((label, (q, k, v), masks))
    return out


def _same_but_nan(a: Any, b: Any) -> bool:
    """Equal, counting a query left with no keys as all zeros whether it came out NaN (torch 2.4,
    or a hand-written softmax) or zeros (SDPA on torch 2.13 and later): how a mistake's result is recognised."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
        return False
    return torch.allclose(torch.nan_to_num(a.detach().double(), nan=0.0), torch.nan_to_num(b.double(), nan=0.0),
                          rtol=1e-6, atol=1e-8)


def _mask_variants(q, k, v, masks: dict) -> dict[str, torch.Tensor]:
    """What known misreadings of the masks give on these inputs."""
    pad, attend, causal = masks.get("key_padding_mask"), masks.get("attn_mask"), masks.get("is_causal", False)
    ref = lambda **m: reference_attention(q, k, v, **{**masks, **m})  # noqa: E731
    out = {"the scores were not divided by sqrt(d)": reference_attention(q * q.shape[-1] ** 0.5, k, v, **masks)}
    if pad is not None:
        out["key_padding_mask was read as SDPA's convention; there True means ignore this key, so invert it "
            "(~key_padding_mask) before using it as a boolean attn_mask"] = ref(key_padding_mask=~pad)
        rows = pad[:, None, :, None].expand(-1, 1, -1, pad.shape[1])  # queries hidden, not keys
        out["the padding mask hid padded queries (rows) instead of padded keys (columns); it should broadcast "
            "as (B, 1, 1, Lk)"] = ref(key_padding_mask=None, attn_mask=_and(attend, ~rows))
        out["key_padding_mask was ignored"] = ref(key_padding_mask=None)
    if attend is not None:
        out["attn_mask was read as True = ignore; for SDPA's boolean attn_mask True means attend"] = ref(attn_mask=~attend)
        out["attn_mask was ignored"] = ref(attn_mask=None)
    n = q.shape[-2]
    if causal:
        out["is_causal was ignored"] = ref(is_causal=False)
        out["the causal mask was flipped: each query attended the keys after it, not before"] = ref(
            is_causal=False, attn_mask=_and(attend, torch.ones(n, n, dtype=torch.bool, device=q.device).triu()))
    else:
        out["a causal mask was applied though is_causal=False"] = ref(is_causal=True)
    return out


def _and(mask: torch.Tensor | None, other: torch.Tensor) -> torch.Tensor:
    return other if mask is None else mask & other


def _float32_case(seed: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    q, k, v = (torch.randn(2, 2, 9, 8, generator=generator(seed + 1)).to(device) for _ in range(3))
    _, pad = ragged_batch(seed + 2, batch=2, length=9, dim=1)
    pad[:, 0] = False
    return q, k, v, pad.to(device)


def _check_masks(fn: Callable, name: str, seed: int, device, hint: str, attn_masks: bool = True) -> int:
    """Compare ``fn`` with the grader's float64 reference on every case, naming a known misreading
    of the masks; in a learner's copy (no grader references), with the stored answers for seed 0."""
    dev = pick_device(device)
    stored = None if grader_references("fastpath") is not None else stored_answers(DATA_FILE, seed=seed)
    cases = _cases(seed, dev, attn_masks)
    for label, (q, k, v), masks in cases:
        want = reference_attention(q, k, v, **masks) if stored is None else stored["cases"][label].to(dev)
        ins = [t.clone() for t in (q, k, v)]
        got = call(fn, *ins, **masks, name=name)
        title = f"{name}({label})"
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
            raise AssertionError(f"{title} should be a tensor of shape {tuple(want.shape)} (like q), "
                                 f"got {describe(got)}.")
        if not _same_but_nan(got, want):
            variants = (_mask_variants(q, k, v, masks) if stored is None
                        else {m: t.to(dev) for m, t in stored["variants"][label].items()})
            name_mistake(title, got, want, variants, same=_same_but_nan)
        assert_close(got, want, name=title, hint=hint, **TIGHT)
    q, k, v, pad = _float32_case(seed, dev)
    got = call(fn, q, k, v, key_padding_mask=pad, is_causal=True, name=name)
    if isinstance(got, torch.Tensor) and got.dtype != torch.float32:
        raise AssertionError(f"{name} on float32 inputs returned {got.dtype}; keep the inputs' dtype.")
    want = (reference_attention(q, k, v, key_padding_mask=pad, is_causal=True) if stored is None
            else stored["float32"].to(dev))
    assert_close(got, want, name=f"{name} in float32", rtol=1e-4, atol=1e-5, check_dtype=False, hint=hint)
    return len(cases) + 1


@prober
def attention_ops(masked_attention: Callable, q, k, v, key_padding_mask) -> list[str]:
    """The learner's side of the "by hand" check: ``masked_attention`` once, causal and padded, and
    the torch functions and ops it called whose names say attention (SDPA, its fused kernels,
    ``multi_head_attention_forward``), seen by the course's watcher and its witnesses
    (:func:`course.checks.witnesses.alone`): that process's word; the values are the judge's."""
    def run() -> list[str]:
        with torch.no_grad(), TorchCalls("masked_attention") as seen:
            call(masked_attention, q, k, v, key_padding_mask=key_padding_mask, is_causal=True, name="masked_attention")
        return names_with(seen.names, ("attention",))

    return alone(run, label="masked_attention")


def check_masked_attention(masked_attention: Callable, *, seed: int = 0, device=None) -> None:
    """``masked_attention(q, k, v, attn_mask=None, key_padding_mask=None, is_causal=False)`` by hand:
    ``softmax(q k^T / sqrt(d)) v`` on ``(B, H, L, D)`` inputs, where a boolean ``attn_mask``
    (``True`` = attend, broadcastable to ``(B, H, L, L)``), a ``key_padding_mask`` ``(B, L)``
    (``True`` = ignore that key) and ``is_causal`` (query ``i`` sees keys ``j <= i``) may each be given."""
    hint = ("scores = q @ k.transpose(-2, -1) / sqrt(d); masked_fill the scores with -inf where a key must not be "
            "seen: ~attn_mask, key_padding_mask[:, None, None, :], and above the diagonal when is_causal; then "
            "softmax over the last dimension and multiply by v.")
    n = _check_masks(masked_attention, "masked_attention", seed, device, hint)
    q, k, v, pad = _float32_case(seed, pick_device(device))
    used = probed_names(masked_attention, attention_ops, q, k, v, pad, label="masked_attention")
    if used:
        raise AssertionError(f"masked_attention gives the right numbers, but it calls {', '.join(used)[:200]}: this "
                             "exercise writes attention by hand (scores, masks, softmax, then v), so that you see what "
                             "the fused kernel saves; F.scaled_dot_product_attention is Exercise 2's.")

    def by_hand(program: Callable, label: str) -> None:
        _check_masks(program, label, seed, device, hint)
        if probed_names(program, attention_ops, q, k, v, pad, label=label):
            raise AssertionError(f"{label} calls an attention op: this exercise writes attention by hand.")

    again(masked_attention, "masked_attention", by_hand, forbidden=("attention",),
          helpers=("course.fastpath.causal_mask",))
    ok(f"masked_attention equals the float64 reference on {n} combinations of masks (seed {seed})")


# -- SDPA, portably ---------------------------------------------------------------------------------

@prober
def sdpa_calls(sdpa_attention: Callable, q, k, v, key_padding_mask, is_causal: bool) -> list[dict]:
    """The learner's side: run ``sdpa_attention`` once and report how it called SDPA (the mode's
    view of each call, and the dispatcher's count of them)."""
    return watched(sdpa_attention, "sdpa_attention", q, k, v, key_padding_mask=key_padding_mask,
                   is_causal=is_causal)[1]


def _sdpa_once(sdpa_attention: Callable, label: str, seed: int, dev: torch.device, hint: str) -> None:
    """Causal and not, on a padded batch: ``sdpa_attention`` called SDPA once, with a boolean mask or none
    (as the probe watching it reports: the learner's process's word, or the program host's for the program)."""
    g = generator(seed + 3)
    for causal in (False, True):
        q, k, v = (torch.randn(2, 2, 6, 8, generator=g, dtype=F64).to(dev) for _ in range(3))
        _, pad = ragged_batch(seed + 4, batch=2, length=6, dim=1)
        pad[:, 0] = False
        calls = probe(sdpa_attention, sdpa_calls, q, k, v, pad.to(dev), causal)
        if not isinstance(calls, list):
            raise AssertionError(f"{label} could not be watched (got {describe(calls)}).")
        if len(calls) != 1:
            raise AssertionError(f"{label} called F.scaled_dot_product_attention {len(calls)} times for one "
                                 "batch; call it exactly once (the fused kernel does the whole batch). " + hint)
        call_ = calls[0]
        if not isinstance(call_, dict):
            raise AssertionError(f"{label} could not be watched (got {describe(call_)}).")
        if call_.get("mask") == "unseen":
            raise AssertionError(f"{label} called F.scaled_dot_product_attention where the course's watcher could "
                                 "not see it (inside another torch function's arguments); call it plainly, once.")
        if call_.get("mask") not in (None, "bool"):
            raise AssertionError(f"{label} passed SDPA an attn_mask of dtype {call_.get('mask')}; "
                                 "pass a boolean mask (True = attend): SDPA then needs no -inf arithmetic.")
        if call_.get("shapes") != [list(q.shape)] * 3 or call_.get("result") is not True:
            raise AssertionError(f"{label} called SDPA on {call_.get('shapes')} and returned "
                                 f"{'its output' if call_.get('result') is True else 'something else'}: call it once "
                                 f"on the whole batch, q, k and v as given ({list(q.shape)}), and return what it "
                                 "returns. " + hint)


SDPA_HINT = ("SDPA's boolean attn_mask means True = attend: pass ~key_padding_mask[:, None, None, :]; with "
             "is_causal as well, combine it with the causal mask (torch.ones(L, L, dtype=torch.bool).tril()) "
             "into that one mask; without a padding mask, pass is_causal to SDPA.")


def check_sdpa_attention(sdpa_attention: Callable, *, seed: int = 0, device=None) -> None:
    """``sdpa_attention(q, k, v, key_padding_mask=None, is_causal=False)``: the same attention through
    one call of ``F.scaled_dot_product_attention``, written to run on every supported PyTorch: an
    ``attn_mask`` together with ``is_causal=True`` is combined on torch 2.4-2.13 and an error from 2.14,
    so a causal padded batch folds both into one boolean mask."""
    hint = SDPA_HINT
    _sdpa_once(sdpa_attention, "sdpa_attention", seed, pick_device(device), hint)
    n = _check_masks(sdpa_attention, "sdpa_attention", seed, device, hint, attn_masks=False)

    def sdpa_once(program: Callable, label: str) -> None:
        _sdpa_once(program, label, seed, pick_device(device), hint)
        _check_masks(program, label, seed, device, hint, attn_masks=False)

    again(sdpa_attention, "sdpa_attention", sdpa_once, helpers=("course.fastpath.causal_mask",))
    ok(f"sdpa_attention equals the float64 reference on {n} masked batches, calling SDPA once, portably "
       f"(seed {seed})")


def check_sdpa_speed(sdpa_attention: Callable, masked_attention: Callable | None = None, *, bars, batch: int,
                     heads: int, length: int, dim: int, valid: float = 0.6, causal: bool = True,
                     num_threads: int | None = None, rounds: int = 7, min_run_time: float = 0.2, attempts: int = 3,
                     device=None):
    """``sdpa_attention(q, k, v, key_padding_mask, is_causal)`` at least ``bars[device]`` times as fast
    as the naive masked attention, side by side on fresh padded batches, every output checked. The
    baseline is the grader's own naive attention, never the learner's; in a learner's copy of the
    course (no grader references) it is the learner's ``masked_attention``, as in lesson 1. What it
    times must be what Exercise 2 asks, SDPA called once (red team, 2026-12-05: attention written by hand,
    a loop over the samples that dropped each one's padded keys, beat the naive attention by the 1.2x
    asked on a CPU without calling SDPA): checked as Exercise 2 checks it, before any timing."""
    refs = grader_references("fastpath")
    if refs is not None:
        baseline = refs.naive_masked_attention
    elif masked_attention is None:
        raise AssertionError("check_sdpa_speed needs your masked_attention as the baseline here (the grader "
                             "uses its own): check_sdpa_speed(sdpa_attention, masked_attention, ...).")
    else:
        def baseline(q, k, v, key_padding_mask, is_causal):
            return masked_attention(q, k, v, key_padding_mask=key_padding_mask, is_causal=is_causal)

    dev = pick_device(device)
    small = masked_attention_inputs(0, device=str(dev), batch=1, heads=1, length=8, dim=4)
    call(sdpa_attention, *small, causal, name="sdpa_attention")  # a stub or a crash, named before any timing
    _sdpa_once(sdpa_attention, "sdpa_attention", 0, dev, SDPA_HINT)
    again(sdpa_attention, "sdpa_attention", lambda program, label: _sdpa_once(program, label, 0, dev, SDPA_HINT),
          helpers=("course.fastpath.causal_mask",))
    if refs is None:
        call(masked_attention, *small[:3], key_padding_mask=small[3], is_causal=causal, name="masked_attention")
    return served_speedup(("naive", baseline), ("sdpa", sdpa_attention), factory=masked_attention_inputs,
                          sizes=dict(batch=batch, heads=heads, length=length, dim=dim, valid=valid),
                          constants=(causal,), bars=bars, num_threads=num_threads, device=dev, rounds=rounds,
                          min_run_time=min_run_time, attempts=attempts, rtol=1e-3,
                          explain="course.references.explain.sdpa_attention",
                          hint="one call of F.scaled_dot_product_attention with one boolean mask (True = attend) runs a "
                               "fused kernel that never builds the (B, H, L, L) score matrix.")


# -- 3. when the fast path runs ---------------------------------------------------------------------

#: One setting away from the fast path each, and what each is called in a message.
_CHANGES = [dict(training=True), dict(grad=True), dict(nhead=1, d_model=15), dict(nhead=3, d_model=18),
            dict(norm_first=True), dict(activation="gelu"), dict(batch_first=False), dict(bias=False),
            dict(dtype="float64"), dict(dropout=0.1), dict(padding_mask=True), dict(padding_mask=True, nested=False),
            dict(nhead=4, d_model=32), {}]


def _configs(seed: int, n: int) -> list[dict]:
    """Every single change from :data:`course.fastpath.BASE_CONFIG` in :data:`_CHANGES`, and ``n``
    random combinations of two or three of them, drawn from ``seed``, in a drawn order."""
    rng = random.Random(seed)
    out = [encoder_config(**c) for c in _CHANGES]
    for _ in range(n):
        merged: dict = {}
        for c in rng.sample(_CHANGES[:-1], rng.choice((2, 3))):
            merged.update(c)
        out.append(encoder_config(**merged))
    rng.shuffle(out)
    return out


def _describe_config(c: dict) -> str:
    changed = {k: v for k, v in c.items() if BASE_CONFIG[k] != v}
    return "the base encoder" + (" with " + ", ".join(f"{k}={v!r}" for k, v in changed.items()) if changed else "")


def check_fast_path_predictions(predict_fast_path: Callable, *, seed: int = 0, n: int = 8) -> None:
    """``predict_fast_path(config) -> bool``: whether ``nn.TransformerEncoder`` built and run as
    ``config`` describes (:func:`course.fastpath.encoder_config`) takes its fast path, on every
    single change from the base encoder and ``n`` drawn combinations. The truth is measured here by
    the op that ran; every wrong prediction is listed."""
    wrong = []
    configs = _configs(seed, n)
    for c in configs:
        got = call(predict_fast_path, dict(c), name="predict_fast_path")
        if not isinstance(got, bool):
            raise AssertionError(f"predict_fast_path({_describe_config(c)}) returned {describe(got)}; return True "
                                 "or False.")
        truth = fast_path_taken(c, seed=seed)
        if got != truth:
            wrong.append(f"{_describe_config(c)}: you said {got}, it {'took' if truth else 'did not take'} the "
                         "fast path")
    if wrong:
        raise AssertionError(f"predict_fast_path is wrong on {len(wrong)} of {len(configs)} encoders:\n  "
                             + "\n  ".join(wrong[:6])
                             + "\n  Hint: the conditions are in nn.TransformerEncoderLayer.forward, where it sets "
                               "why_not_sparsity_fast_path; run each one under torch.profiler and look for "
                               "aten::_transformer_encoder_layer_fwd.")
    record(len(wrong), 0, "wrong fast-path predictions")
    ok(f"predict_fast_path is right on all {len(configs)} encoders (seed {seed}), on torch {torch.__version__}")


# -- 4. the autocast guard ----------------------------------------------------------------------------

@prober
def under_autocast(guarded_forward: Callable, enc, x, key_padding_mask, autocast: bool) -> torch.Tensor:
    """The learner's side: ``guarded_forward(enc, x, key_padding_mask)`` inside ``torch.autocast("cpu",
    dtype=torch.bfloat16)`` (or not), without gradients: where the bug lives."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return call(guarded_forward, enc, x, key_padding_mask, name="guarded_forward")


@prober
def fast_path_kept(guarded_forward: Callable, enc, x, key_padding_mask) -> bool:
    """The learner's side: whether ``guarded_forward`` still runs the fast path without autocast."""
    from course.fastpath import FAST_OP, ops_that_ran

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FAST_OP in ops_that_ran(lambda: call(guarded_forward, enc, x, key_padding_mask, name="guarded_forward"))


def check_autocast_guard(guarded_forward: Callable, *, seed: int = 0) -> None:
    """``guarded_forward(encoder, x, key_padding_mask)``: ``encoder(x, src_key_padding_mask=...)``
    that survives CPU autocast (PyTorch issue 107663). Under ``torch.autocast("cpu")`` it returns
    float32, equal on every unpadded token to the encoder run without autocast, with or without a
    padding mask and nested tensors; without autocast it keeps the fast path."""
    hint = ("the fast path ignores CPU autocast (it asks torch.is_autocast_enabled() without a device, which "
            "means CUDA). When torch.is_autocast_enabled('cpu') is true, run the encoder inside "
            "torch.autocast('cpu', enabled=False) on x.float(); otherwise call it as it is.")
    count = _guard_cases(guarded_forward, "guarded_forward", seed, hint)
    again(guarded_forward, "guarded_forward", lambda program, label: _guard_cases(program, label, seed, hint))
    ok(f"guarded_forward survives CPU autocast in all {count} cases (float32, equal to the encoder without "
       f"autocast) and keeps the fast path without it (seed {seed})")


def _guard_cases(guarded_forward: Callable, name: str, seed: int, hint: str) -> int:
    """Every case of :func:`check_autocast_guard` (nested tensors or not, a padding mask or not, under
    autocast or not) on ``guarded_forward``; how many were compared."""
    count = 0
    for nested in (True, False):
        enc = encoder(seed, nested=nested)
        x, pad = ragged_batch(seed + 11 + nested, batch=3, length=10, dim=16)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            refs = {True: enc(x, src_key_padding_mask=pad), False: enc(x)}
        for masked in (True, False):
            mask = pad if masked else None
            for autocast in (True, False):
                label = (f"{name}(nested={nested}, padding mask {'given' if masked else 'None'}"
                         f"{', under CPU autocast' if autocast else ''})")
                got = probe(guarded_forward, under_autocast, enc, x.clone(), None if mask is None else mask.clone(),
                            autocast)
                if isinstance(got, torch.Tensor) and got.dtype != torch.float32:
                    raise AssertionError(f"{label} returned {got.dtype}; the encoder's result should be float32, as "
                                         f"without autocast.\n  Hint: {hint}")
                if not isinstance(got, torch.Tensor) or got.shape != x.shape:
                    raise AssertionError(f"{label} should return a tensor shaped like x {tuple(x.shape)}, got "
                                         f"{describe(got)}.")
                keep = pad if masked else torch.zeros_like(pad)
                assert_close(valid_tokens(got, keep), valid_tokens(refs[masked], keep), name=f"{label} on unpadded tokens",
                             rtol=1e-5, atol=1e-5, hint=hint)
                count += 1
        if not probe(guarded_forward, fast_path_kept, enc, x, pad):
            raise AssertionError(f"{name}(nested={nested}) no longer takes the fast path without autocast; "
                                 "guard only the autocast case (the fast path is the point of this lesson).")
    return count


# -- 5. a token MLP on a jagged batch ------------------------------------------------------------------

def secret_mlp(seed: int, dim: int, hidden: int) -> torch.nn.Module:
    """A token MLP whose weights come from the class's secret key (:func:`course.checks.secret_seed`):
    lent, it never leaves the judge; the instructor's run and every submission get the same one, and
    nothing the learner's process sees (the check's seed, the batch) tells its weights."""
    from course.checks import secret_seed

    return token_mlp(secret_seed("fastpath.jagged_mlp", seed), dim=dim, hidden=hidden)


class LentMLP:
    """The token MLP a check gives ``jagged_token_mlp``, as a function that notes what it was given
    (``seen``) before it runs. Under the grader it is lent (:func:`course.remote.lend`): it runs in the
    judge, whose record it is, and the learner's code holds a stand-in that sends its argument across
    (a jagged nested tensor as its values and offsets, checked there: :mod:`course.wire`); the
    learner's process never holds the MLP's weights (:func:`secret_mlp`: from the class's secret key,
    not the check's seed alone). It runs only on what a batch of ``tokens`` real tokens of width
    ``dim`` and the batch's ``dtype`` could give it (it sends back what it computes); anything else is
    noted as what it was, and refused."""

    __name__ = "mlp"

    def __init__(self, mlp: torch.nn.Module, tokens: int, dim: int, dtype: torch.dtype = torch.float32):
        self.mlp, self.tokens, self.dim, self.dtype = mlp, tokens, dim, dtype
        self.seen: list[str] = []
        self.given: list[torch.Tensor] = []

    def __call__(self, t):
        if isinstance(t, torch.Tensor) and t.is_nested and t.layout == torch.jagged \
                and getattr(t, "_lengths", None) is None:
            kind, rows = "jagged", t.values()
        elif isinstance(t, torch.Tensor) and not t.is_nested:
            kind, rows = "dense", t
        else:  # a strided nested tensor, a jagged one with holes (each crosses as a description)
            kind = ("a strided nested tensor" if isinstance(t, torch.Tensor) and t.is_nested and t.layout != torch.jagged
                    else "a jagged tensor with holes" if isinstance(t, torch.Tensor) else getattr(t, "type_name", None)
                    or type(t).__name__)
            self.seen.append(kind)
            raise TypeError(f"the MLP here takes one jagged nested tensor of the batch's tokens (layout=torch.jagged, "
                            f"no holes: the values are the tokens) or a dense one; it was given {kind}")
        if rows.dtype != self.dtype or rows.dim() < 1 or rows.shape[-1] != self.dim \
                or rows.numel() > self.tokens * self.dim:
            self.seen.append(f"{kind} {describe(rows)}")
            raise TypeError(f"the MLP takes the batch's tokens, width {self.dim}, "
                            f"{str(self.dtype).replace('torch.', '')}; it was given {describe(rows)}")
        self.seen.append(kind)
        self.given.append(t)
        with torch.no_grad():
            return self.mlp(t)


def _jagged_input_right(lent: LentMLP, x: torch.Tensor, pad: torch.Tensor, label: str, hint: str) -> None:
    """The one tensor the MLP was given is the batch's real tokens, in order, cut per sequence."""
    if lent.seen != ["jagged"] or len(lent.given) != 1:
        raise AssertionError(f"{label}: the MLP was given {lent.seen or 'nothing'}; give it the batch as one jagged "
                             "nested tensor (layout=torch.jagged, no holes), once, and nothing else.\n  Hint: " + hint)
    nt = lent.given[0]
    keep = ~pad
    offsets = torch.cat([keep.new_zeros(1, dtype=torch.long), keep.sum(1).cumsum(0)])
    values = nt.values()
    if not (torch.equal(nt.offsets().cpu().long(), offsets.cpu()) and values.dtype == x.dtype
            and torch.equal(values.cpu(), x[keep].cpu())):
        raise AssertionError(f"{label}: the jagged tensor the MLP was given is not the batch's real tokens, in order, "
                             "one sequence after another (its values x[~key_padding_mask], its offsets 0 and the "
                             "running sum of the lengths).\n  Hint: " + hint)


def check_jagged_mlp(jagged_token_mlp: Callable, *, seed: int = 0) -> None:
    """``jagged_token_mlp(x, key_padding_mask, mlp)``: ``mlp`` on the unpadded tokens of a right-padded
    batch ``x`` ``(B, L, D)`` through one jagged nested tensor (``layout=torch.jagged``), back as
    ``(B, L, D)`` with zeros at padded positions: equal to the MLP on the padded batch, padding zeroed.
    The MLP is a :class:`LentMLP`: under the grader what it was given is the judge's record."""
    hint = ("values = x[~key_padding_mask] (the tokens, in order); offsets = 0 and the running sum of the lengths; "
            "nt = torch.nested.nested_tensor_from_jagged(values, offsets); y = mlp(nt); then scatter y.values() "
            "back into zeros of shape (B, L, D) at ~key_padding_mask.")
    count = 0
    for i, (batch, length, valid) in enumerate([(4, 12, 0.6), (3, 9, 0.3), (5, 7, 0.9), (1, 6, 0.5)]):
        x, pad = ragged_batch(seed + 20 + i, batch=batch, length=length, dim=16, valid=valid)
        mlp = secret_mlp(seed + i, dim=16, hidden=32)
        label = f"jagged_token_mlp on a ({batch}, {length}, 16) batch, {int((~pad).sum())} tokens"
        lent = LentMLP(mlp, batch * length, 16, x.dtype)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the nested tensors' prototype warning, on older releases
            got = call(jagged_token_mlp, x.clone(), pad.clone(), lend(lent), name="jagged_token_mlp")
        want = padded_token_mlp(x, pad, mlp)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            raise AssertionError(f"{label} should return a tensor of shape {tuple(want.shape)}, got {describe(got)}.")
        if got.is_nested:
            raise AssertionError(f"{label} returned a nested tensor; convert it back to a padded (B, L, D) tensor.")
        assert_close(got, want, name=label, rtol=1e-5, atol=1e-6, hint=hint)
        _jagged_input_right(lent, x, pad, label, hint)
        count += 1
    clocked = f"; {jagged_clock(jagged_token_mlp)}" if is_remote(jagged_token_mlp) else ""
    ok(f"jagged_token_mlp equals the MLP on the padded batch on {count} ragged batches, through one jagged nested "
       f"tensor{clocked} (seed {seed})")


#: The judge's clock on ``jagged_token_mlp`` (red team, 2026-12-05: an answer that gave the structure
#: check's lent MLP one jagged tensor and looped over the sequences whenever it was handed a real module,
#: as the speed cell hands it, earned both cells; a plain loop over the 8 sequences of the CPU's speed cell
#: still beat the padded batch by the 1.2x asked): 2,048 short sequences (8 positions, about 60% real) of
#: the lesson's MLP, a real module as in the speed cell, timed as blocks against the leanest loop we know,
#: the MLP once per sequence (``course.references.fastpath.jagged_loop``: about 67 ms on one thread). On a
#: 2-core AMD EPYC, one thread (2026-12-05), a jagged answer reads 0.07 of it, the tokens packed into one
#: plain tensor 0.05, the padded batch 0.1: only a loop over the sequences reads about 1.
JAGGED_CLOCK = dict(batch=2048, length=8, dim=16, valid=0.6)
JAGGED_CLOCK_HIDDEN = 64
JAGGED_NO_LOOP = 0.25


def jagged_clock(fn: Callable, label: str = "jagged_token_mlp") -> str:
    """Across the boundary: ``fn`` takes at most :data:`JAGGED_NO_LOOP` of the course's loop over
    :data:`JAGGED_CLOCK`'s sequences, given a real MLP (the module, after the batch: ``fn(x, pad, mlp)``)."""
    def setup() -> dict:
        mlp = token_mlp(11, dim=JAGGED_CLOCK["dim"], hidden=JAGGED_CLOCK_HIDDEN)
        return dict(make=None, loop=grader_references("fastpath").jagged_loop, factory=ragged_batch,
                    sizes=JAGGED_CLOCK, constants=(mlp,), lead=False, rtol=1e-4)

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the nested tensors' prototype warning, on older releases
        return expect_no_loop_by_clock(fn, label, setup, count=JAGGED_CLOCK["batch"], unit="sequence",
                                       key=(label,), no_loop=JAGGED_NO_LOOP,
                                       hint="one jagged nested tensor of every real token, one call of the MLP, "
                                            "whatever the MLP is; no loop over the sequences.")


def check_jagged_speed(jagged_token_mlp: Callable, *, bars, batch: int, length: int, dim: int, hidden: int,
                       valid: float, num_threads: int | None = None, rounds: int = 7, min_run_time: float = 0.2,
                       attempts: int = 3, device=None):
    """``jagged_token_mlp`` at least ``bars[device]`` times as fast as the MLP on the padded batch,
    side by side on fresh ragged batches (about ``valid`` of the positions real tokens), every output
    checked."""
    dev = pick_device(device)
    mlp = token_mlp(7, dim=dim, hidden=hidden, device=str(dev))
    call(jagged_token_mlp, *ragged_batch(0, device=str(dev), batch=2, length=6, dim=dim, valid=valid), mlp,
         name="jagged_token_mlp")  # a stub or a crash, named before any timing
    if is_remote(jagged_token_mlp):  # a loop over the sequences earns no speed: the judge's clock says which
        jagged_clock(jagged_token_mlp)
    return served_speedup(("padded", padded_token_mlp), ("jagged", jagged_token_mlp), factory=ragged_batch,
                          sizes=dict(batch=batch, length=length, dim=dim, valid=valid), constants=(mlp,), bars=bars,
                          num_threads=num_threads, device=dev, rounds=rounds, min_run_time=min_run_time,
                          attempts=attempts, rtol=1e-4, explain="course.references.explain.jagged_token_mlp",
                          hint=f"a jagged batch computes only the real tokens (about {valid:.0%} of the positions): "
                               "build it from x[~key_padding_mask] with nested_tensor_from_jagged, no copies per "
                               "sample, no Python loop over the batch.")


# -- 6. the modern block ---------------------------------------------------------------------------------

@prober
def layer_by_hand(sdpa_encoder_layer: Callable, layer, x, key_padding_mask) -> tuple[torch.Tensor, dict]:
    """The learner's side: the answer's result, how it called SDPA, and which of the layer's modules it
    called (``nn.MultiheadAttention`` or the layer itself would be the answer, not its rebuilding)."""
    called: list[str] = []
    handles = [m.register_forward_pre_hook(lambda m, a, name=name: called.append(name))
               for name, m in (("the layer itself", layer), ("layer.self_attn (nn.MultiheadAttention)", layer.self_attn))]
    try:
        with DispatcherOps() as ops, SDPACalls("sdpa_encoder_layer") as calls, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = call(sdpa_encoder_layer, layer, x, key_padding_mask, name="sdpa_encoder_layer")
    finally:
        for h in handles:
            h.remove()
    every = every_sdpa_call(calls, ops, "sdpa_encoder_layer")
    return out, {"sdpa": len(every), "modules": sorted(set(called)), "shapes": every[0].get("shapes") if every else None,
                 "attention": calls.outputs[0].detach() if len(calls.outputs) == 1 and isinstance(calls.outputs[0], torch.Tensor)
                 else None}


def check_sdpa_encoder_layer(sdpa_encoder_layer: Callable, *, seed: int = 0) -> None:
    """``sdpa_encoder_layer(layer, x, key_padding_mask)``: what ``layer(x, src_key_padding_mask=...)``
    computes, for an ``nn.TransformerEncoderLayer`` (batch first, ReLU, no dropout, post-norm or
    ``norm_first``), rebuilt from its weights with ``F.linear``, one call of SDPA and ``F.layer_norm``:
    equal on every unpadded token in float64."""
    hint = ("q, k, v = F.linear(x, in_proj_weight, in_proj_bias).chunk(3, -1), each reshaped to (B, L, heads, d) and "
            "transposed to (B, heads, L, d); SDPA with attn_mask ~key_padding_mask[:, None, None, :]; back to (B, L, "
            "D), out_proj; then the residual and norm1, linear1, ReLU, linear2, the residual and norm2 (with "
            "norm_first, each norm comes before its block instead).")
    count = _layer_cases(sdpa_encoder_layer, "sdpa_encoder_layer", seed, hint)
    again(sdpa_encoder_layer, "sdpa_encoder_layer", lambda program, label: _layer_cases(program, label, seed, hint))
    with torch.no_grad():
        layer = encoder_layer(seed + 1)
        x, pad = ragged_batch(seed + 40, batch=2, length=9, dim=16, dtype=F64)
        got = call(sdpa_encoder_layer, layer, x, pad, name="sdpa_encoder_layer")
        want = layer(x, src_key_padding_mask=pad)
    assert_close(valid_tokens(got, pad), valid_tokens(want, pad), name="sdpa_encoder_layer on another layer",
                 hint=hint, **TIGHT)
    ok(f"sdpa_encoder_layer equals nn.TransformerEncoderLayer on every unpadded token, post-norm and norm_first, "
       f"with one SDPA call (seed {seed})")


def _layer_attention(layer, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """What a rebuilt layer's one SDPA call returns: the attention of every head, before ``out_proj``
    ``(B, heads, L, D / heads)``, computed here in float64 from the layer's weights."""
    attn = layer.self_attn
    b, n, d = x.shape
    heads = attn.num_heads
    with torch.no_grad():
        z = layer.norm1(x) if layer.norm_first else x
        q, k, v = (t.reshape(b, n, heads, d // heads).transpose(1, 2).to(F64)
                   for t in F.linear(z, attn.in_proj_weight, attn.in_proj_bias).chunk(3, dim=-1))
        scores = (q @ k.transpose(-2, -1) / (d // heads) ** 0.5).masked_fill(pad[:, None, None, :], float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


def _layer_cases(sdpa_encoder_layer: Callable, name: str, seed: int, hint: str) -> int:
    """Post-norm and ``norm_first``: ``sdpa_encoder_layer`` called neither the layer nor its attention
    module, called SDPA once, and equals the layer on every unpadded token; how many were compared."""
    count = 0
    for norm_first in (False, True):
        layer = encoder_layer(seed, norm_first=norm_first)
        x, pad = ragged_batch(seed + 30 + norm_first, batch=3, length=7, dim=16, dtype=F64)
        label = f"{name}({'norm_first' if norm_first else 'post-norm'} layer, x {tuple(x.shape)})"
        got, seen = probe(sdpa_encoder_layer, layer_by_hand, layer, x.clone(), pad.clone())
        if not isinstance(seen, dict):
            raise AssertionError(f"{label} could not be watched (got {describe(seen)}).")
        if seen.get("modules"):
            raise AssertionError(f"{label} called {', '.join(map(str, seen['modules']))}; rebuild the layer from its "
                                 "weights (layer.self_attn.in_proj_weight, ...) with F.linear and one SDPA call.")
        if seen.get("sdpa") != 1:
            raise AssertionError(f"{label} called F.scaled_dot_product_attention {seen.get('sdpa')} times; call it "
                                 "once, on all heads and the whole batch.\n  Hint: " + hint)
        attention = _layer_attention(layer, x, pad)
        if seen.get("shapes") != [list(attention.shape)] * 3 or not isinstance(seen.get("attention"), torch.Tensor):
            raise AssertionError(f"{label} called SDPA on {seen.get('shapes')}; call it once on all heads and the "
                                 f"whole batch, q, k and v of shape {list(attention.shape)}.\n  Hint: " + hint)
        assert_close(seen["attention"], attention, name=f"{label}: what its SDPA call returned (the layer's attention "
                     "before out_proj)", hint=hint, **TIGHT)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = layer(x, src_key_padding_mask=pad)
        if not isinstance(got, torch.Tensor) or got.shape != x.shape:
            raise AssertionError(f"{label} should return a tensor shaped like x {tuple(x.shape)}, got {describe(got)}.")
        assert_close(valid_tokens(got, pad), valid_tokens(want, pad), name=f"{label} on unpadded tokens",
                     hint=hint, **TIGHT)
        count += 1
    return count

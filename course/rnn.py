"""Lesson 1's shared pieces: weights of ``nn.LSTM`` as plain tensors, inputs for the timed
calls, and a look inside what TorchScript and ``torch.compile`` made of a function. (The
references that reproduce exercises are the grader's: :mod:`course.references.rnn`.)

Gate order everywhere is PyTorch's: input, forget, cell (``g``), output. Weights are laid out
as ``nn.LSTM`` has them: ``w_ih`` is ``(4H, I)``, ``w_hh`` is ``(4H, H)``, biases ``(4H,)``.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
from torch import Tensor

from course.data import device_generator
from course.devices import pick_device
from course.remote import factory

__all__ = ["LSTMWeights", "compiled_kernels", "layer_norm_params",
           "lstm_weights", "make_lstm", "masked_rnn_layer", "torchscript_ops"]


class LSTMWeights(NamedTuple):
    w_ih: Tensor
    w_hh: Tensor
    b_ih: Tensor
    b_hh: Tensor


def make_lstm(input_size: int, hidden_size: int, num_layers: int = 1, *, seed: int, device=None,
              dtype: torch.dtype = torch.float32) -> torch.nn.LSTM:
    """A seeded ``nn.LSTM`` (time-major, no dropout)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lstm = torch.nn.LSTM(input_size, hidden_size, num_layers=num_layers)
    return lstm.to(pick_device(device), dtype)


def lstm_weights(lstm: torch.nn.LSTM, layer: int = 0) -> LSTMWeights:
    """The weights of one layer of ``lstm`` (the same tensors, so gradients flow back to it)."""
    if not isinstance(lstm, torch.nn.LSTM):
        raise TypeError(f"lstm_weights takes an nn.LSTM, got {type(lstm).__name__}.")
    if not 0 <= layer < lstm.num_layers:
        raise IndexError(f"This LSTM has {lstm.num_layers} layer(s); layer {layer} does not exist.")
    if lstm.bidirectional or lstm.proj_size:
        raise ValueError("The course's LSTMs are one-directional and without projections.")
    get = lambda n: getattr(lstm, f"{n}_l{layer}")  # noqa: E731
    return LSTMWeights(get("weight_ih"), get("weight_hh"), get("bias_ih"), get("bias_hh"))


def layer_norm_params(input_size: int, hidden_size: int, *, seed: int, device=None,
                      dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Parameters of a LayerNorm LSTM cell, with non-trivial LayerNorm scales and shifts so that
    a cell which forgets one of them is caught."""
    g = torch.Generator().manual_seed(seed)
    H4, k = 4 * hidden_size, hidden_size ** -0.5

    def u(*shape, lo=-k, hi=k):
        return torch.rand(*shape, generator=g, dtype=torch.float64) * (hi - lo) + lo

    p = {
        "w_ih": u(H4, input_size), "w_hh": u(H4, hidden_size),
        "ln_ih_weight": u(H4, lo=0.5, hi=1.5), "ln_ih_bias": u(H4, lo=-0.5, hi=0.5),
        "ln_hh_weight": u(H4, lo=0.5, hi=1.5), "ln_hh_bias": u(H4, lo=-0.5, hi=0.5),
        "ln_c_weight": u(hidden_size, lo=0.5, hi=1.5), "ln_c_bias": u(hidden_size, lo=-0.5, hi=0.5),
    }
    dev = pick_device(device)
    return {k_: v.to(dev, dtype) for k_, v in p.items()}


def masked_rnn_layer(x: Tensor, lengths: Tensor, h0: Tensor, w_ih: Tensor, w_hh: Tensor,
                     b: Tensor) -> tuple[Tensor, Tensor]:
    """A plain (Elman) RNN layer over a padded batch, masked as lesson 1's LSTM layer is:
    ``h' = tanh(x_t W_ih^T + b + h W_hh^T)`` where ``t < lengths``, the old ``h`` kept (and 0 in
    ``out``) past each sequence's end. ``x`` is ``(T, B, I)``; returns ``(out (T, B, H), h_n)``.
    Lesson 1's serving check compiles it (it is not an answer to any exercise: the learner's
    ``serve_bucketed`` must work with any masked layer)."""
    h = h0
    projected = x @ w_ih.t() + b
    outs = []
    for t in range(x.shape[0]):
        new = torch.tanh(projected[t] + h @ w_hh.t())
        alive = (t < lengths)[:, None]
        h = torch.where(alive, new, h)
        outs.append(torch.where(alive, new, torch.zeros_like(new)))
    return torch.stack(outs), h


@factory
def timing_inputs(seed: int, *, device: str, seq_len: int, batch: int, input_size: int,
                  hidden_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Fresh ``(x, h0, c0)`` for one timed call of lesson 1's speed check, drawn on ``device``
    from ``seed`` (the judge and the learner's process draw the same values)."""
    g = device_generator(seed, device)
    x = torch.randn(seq_len, batch, input_size, generator=g, device=device)
    h = torch.randn(batch, hidden_size, generator=g, device=device) * 0.5
    c = torch.randn(batch, hidden_size, generator=g, device=device) * 0.5
    return x, h, c


def torchscript_ops(scripted, *args, runs: int = 3) -> list[str]:
    """Run a scripted function a few times (the profiling executor optimises after it has seen
    the inputs) and return the op kinds of the graph it last executed."""
    with torch.no_grad():
        for _ in range(runs):
            scripted(*args)
    graph = torch.jit.last_executed_optimized_graph()
    return [n.kind() for n in graph.nodes()]


class KernelReport(NamedTuple):
    fused: list[str]      # kernels the compiler generated (each fuses one or more ops)
    library: list[str]    # calls into vendor libraries (matrix products: MKL/oneDNN, cuBLAS)
    code: str             # the generated source, to read

    def __str__(self) -> str:
        lines = [f"{len(self.fused)} generated kernel(s), {len(self.library)} library call(s):"]
        lines += [f"  generated: {k}" for k in self.fused] + [f"  library:   {k}" for k in self.library]
        return "\n".join(lines)


def compiled_kernels(fn, *args) -> KernelReport:
    """Compile ``fn`` afresh, run it once on ``args`` and list the kernels Inductor wrote."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    with torch.no_grad():
        _, codes = run_and_get_code(torch.compile(fn), *args)
    code = "\n".join(codes)
    fused = sorted(set(re.findall(r"\b((?:cpp|triton)_(?:poi|red|per|tem)?_?fused_\w+)", code)))
    library = re.findall(r"extern_kernels\.(\w+)\(", code)
    return KernelReport(fused, library, code)

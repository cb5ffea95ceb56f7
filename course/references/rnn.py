"""Lesson 1's references that reproduce exercises (see :mod:`course.references`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from course.guard import reference

__all__ = ["eager_lstm_layer", "layer_norm_lstm_cell_reference"]


@reference
def layer_norm_lstm_cell_reference(x: Tensor, state: tuple[Tensor, Tensor], p: dict[str, Tensor],
                                   eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    """The LayerNorm LSTM cell the lesson specifies (normalised input and hidden gate
    pre-activations, each over all 4H gates; normalised cell state), written plainly."""
    h, c = state
    H4 = p["w_ih"].shape[0]
    gi = F.layer_norm(x @ p["w_ih"].T, (H4,), p["ln_ih_weight"], p["ln_ih_bias"], eps)
    gh = F.layer_norm(h @ p["w_hh"].T, (H4,), p["ln_hh_weight"], p["ln_hh_bias"], eps)
    gates = gi + gh
    # ATen's own LSTM cell does the pointwise part (identity input weights, no hidden weights),
    # so that this reference is an independent implementation, not a copy of the exercise.
    eye = torch.eye(H4, dtype=gates.dtype, device=gates.device)
    _, c_raw = torch.lstm_cell(gates, (h, c), eye, gates.new_zeros(H4, h.shape[1]))
    c_norm = F.layer_norm(c_raw, (c.shape[1],), p["ln_c_weight"], p["ln_c_bias"], eps)
    return torch.sigmoid(gates[:, 3 * c.shape[1]:]) * torch.tanh(c_norm), c_norm


@reference
def eager_lstm_layer(x: Tensor, h: Tensor, c: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor,
                     b_hh: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """The course's eager LSTM layer, the baseline of lesson 1's speed check: per time step two
    matrix products, the biases and the pointwise gate update, as an eager layer runs them."""
    hidden = h.shape[1]
    steps = []
    for x_t in x.unbind(0):
        pre = x_t @ w_ih.t() + b_ih + h @ w_hh.t() + b_hh
        in_gate, forget_gate, candidate, out_gate = pre.split(hidden, dim=1)
        c = forget_gate.sigmoid() * c + in_gate.sigmoid() * candidate.tanh()
        h = out_gate.sigmoid() * c.tanh()
        steps.append(h)
    return torch.stack(steps), (h, c)

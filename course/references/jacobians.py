"""Lesson 5's references, the grader's alone (see :mod:`course.references`): the derivatives of the
lesson's functions worked out by hand (the answers of its exercises, in float64), the row loops
that answer exercise 1 (and are the yardstick of "no loop" under the grader), and the search for
the largest ``chunk_size`` under a memory budget (exercise 2).

The functions themselves (``course.jacobians``' layers and energies) are built in the learner's
process too, so they carry no derivative beyond ``Energy.gradient``, an input the lesson
differentiates. In a learner's copy the visible checks use the answers stored for their own calls
(``course/reference_data/05_jacobians.pt`` and ``05_largest_chunk.pt``)."""

from __future__ import annotations

from typing import Callable

import torch

from course.guard import reference
from course.jacobians import Energy, NormedLayer, TanhLayer

__all__ = ["energy_hessian", "energy_hvp", "largest_fitting_chunk", "normed_batched_jacobian", "sample_loop", "tanh_jacobian", "tanh_parameter_jacobians"]


# -- the derivatives by hand --------------------------------------------------------------------

@reference
def tanh_jacobian(layer: TanhLayer, x: torch.Tensor) -> torch.Tensor:
    """The Jacobian of ``tanh(W x + b)``, ``diag(1 - y**2) @ W`` (``(n_out, n_in)``; no autograd)."""
    y = layer(x)
    return (1 - y * y)[:, None] * layer.weight


@reference
def tanh_parameter_jacobians(layer: TanhLayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Jacobians with respect to the weight and the bias, by hand: output ``i`` reads only row
    ``i`` of ``W`` and ``b[i]``, so ``dy_i/dW_jk = (1 - y_i**2) [i == j] x_k`` (shape
    ``(n_out, n_out, n_in)``) and ``dy_i/db_j = (1 - y_i**2) [i == j]`` (``(n_out, n_out)``)."""
    d = 1 - layer(x) ** 2
    eye = torch.eye(layer.n_out, dtype=d.dtype, device=d.device)
    return d[:, None, None] * eye[:, :, None] * x[None, None, :], d[:, None] * eye


@reference
def normed_batched_jacobian(layer: NormedLayer, xs: torch.Tensor) -> torch.Tensor:
    """The Jacobian of every sample of ``xs`` ``(B, n_in)`` through ``tanh(BatchNorm1d(W x + b))`` in
    eval mode, by hand: ``diag(1 - y**2) diag(gamma / sqrt(var + eps)) W``, ``(B, n_out, n_in)``."""
    n = layer.norm
    with torch.no_grad():
        scaled = (n.weight / torch.sqrt(n.running_var + n.eps))[:, None] * layer.weight
        y = layer(xs)
        return (1 - y * y)[:, :, None] * scaled[None]


def _curvature(e: Energy, x: torch.Tensor) -> torch.Tensor:
    """``s (1 - s)`` with ``s = sigmoid(A x + c)``: softplus's second derivative, one per row of ``A``."""
    s = torch.sigmoid(e.A @ x + e.c)
    return s * (1 - s)


@reference
def energy_hessian(e: Energy, x: torch.Tensor) -> torch.Tensor:
    """The whole ``n x n`` Hessian ``A^T diag(s) A - diag(d cos x) + T`` (small ``n`` only)."""
    h = e.A.T @ (_curvature(e, x)[:, None] * e.A) - torch.diag(e.d * torch.cos(x))
    i = torch.arange(e.n - 1, device=x.device)
    h[i, i + 1] += 1
    h[i + 1, i] += 1
    return h


@reference
def energy_hvp(e: Energy, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``H(x) @ v`` from the formula, with vectors and ``k x n`` matrices only."""
    return e.A.T @ (_curvature(e, x) * (e.A @ v)) - e.d * torch.cos(x) * v + Energy._neighbours(v)


# -- the course's loops -------------------------------------------------------------------------

def _rows(f: Callable, x: torch.Tensor) -> torch.Tensor:
    leaf = x.detach().requires_grad_(True)  # a new leaf on the same numbers: x itself is left as it was
    out = f(leaf)  # not reshaped: a view in the graph would be one more step in every backward pass
    basis = torch.eye(out.numel(), dtype=out.dtype, device=out.device)
    if out.dim() != 1:
        basis = basis.view(out.numel(), *out.shape)
    return torch.stack([torch.autograd.grad(out, leaf, row, retain_graph=True)[0] for row in basis])


def _hessian_rows(f: Callable, x: torch.Tensor) -> torch.Tensor:
    """The Hessian of one sample as the leanest loop we know takes it: the gradient with its graph,
    then every row of its Jacobian in one batched backward pass (``is_grads_batched``). One backward
    pass per row took 2.4 times as long, and a learner's loop written this way read 0.33 of it, at
    the bar (red team, round 18)."""
    leaf = x.detach().requires_grad_(True)
    gradient = torch.autograd.grad(f(leaf), leaf, create_graph=True)[0]
    basis = torch.eye(gradient.numel(), dtype=gradient.dtype, device=gradient.device)
    return torch.autograd.grad(gradient, leaf, basis, is_grads_batched=True)[0]


@reference
def sample_loop(f: Callable, xs: torch.Tensor, *, hessian: bool = False, of_batch: bool = False) -> torch.Tensor:
    """The yardstick of 'no loop over the samples': a Python loop over the samples of ``xs`` doing,
    per sample, one backward pass per row of the Jacobian (with ``hessian``, the gradient's Jacobian,
    the Hessian, all its rows in one batched backward pass: :func:`_hessian_rows`). With ``of_batch``, ``f`` takes a batch and is applied to one sample as
    ``f(x[None])[0]``. Nothing but the loop runs per sample (the guard and the lookups run once per
    call): a learner's loop, however lean, takes about as long, not less."""
    per_sample = _hessian_rows if hessian else _rows
    one = (lambda x: f(x[None])[0]) if of_batch else f
    return torch.stack([per_sample(one, x) for x in xs])


# -- chunk_size under a memory budget -------------------------------------------------------------

@reference
def largest_fitting_chunk(peak_bytes: Callable[[int], int], m: int, budget: int) -> int | None:
    """The largest chunk in ``1..m`` whose peak (``peak_bytes(c)``, which never falls as ``c``
    grows) is at most ``budget``; None when not even a chunk of 1 fits."""
    if peak_bytes(1) > budget:
        return None
    fits, over = 1, m + 1  # bisection: peak(fits) is within the budget, every chunk from `over` is not
    while over - fits > 1:
        middle = (fits + over) // 2
        if peak_bytes(middle) <= budget:
            fits = middle
        else:
            over = middle
    return fits


def jacobians_data() -> dict:
    """Lesson 5's visible checks at their own calls (seed 0, default sizes): every float64 answer."""
    from course.checks.jacobians import reference_data

    return reference_data(0)


#: Written by ``python -m course.references``; the chunk answers stay in 05_largest_chunk.pt.
DATA_FILES = {"05_jacobians.pt": jacobians_data}

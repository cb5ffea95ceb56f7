"""Lesson 7's pieces (broadcasting, advanced indexing and higher-order gradients): the data and
models the lesson works on, and its plots.

- :func:`points`: seeded point clouds for pairwise distances, far from the origin on request
  (where the matrix-product identity loses digits) and with some points of ``b`` copied from ``a``
  (distance exactly 0, where the identity gives small negatives);
- :func:`random_graph`: a seeded edge list (source and target nodes) with repeated targets and nodes
  that receive nothing, for segment sums and maxima;
- :func:`critic`: a small smooth critic (tanh MLP, one score per sample) for gradient penalties;
  smooth, so that its second derivatives are not zero almost everywhere, as a ReLU network's are;
- :func:`regression_task`: a linear regression with targets of shape ``(N,)``, for the
  ``(N, 1)`` against ``(N,)`` loss bug;
- naive baselines the lesson measures against (:func:`naive_sq_dists`, :func:`row_loop_sq_dists`,
  :func:`loop_segment_sum`, :func:`loop_penalty`);
- plots: :func:`plot_loss_curves`, :func:`plot_cancellation`.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
from torch import nn

from course.data import generator
from course.devices import pick_device
from course.guard import reference
from course.remote import recipe

__all__ = ["Critic", "critic", "loop_penalty", "loop_segment_sum", "naive_sq_dists", "plot_cancellation",
           "plot_loss_curves", "points", "random_graph", "regression_task", "row_loop_sq_dists"]


# -- data --------------------------------------------------------------------------------------

def points(n: int, d: int, *, seed: int, offset: float = 0.0, device=None, dtype=torch.float32) -> torch.Tensor:
    """``n`` standard normal points in ``d`` dimensions, shifted by ``offset`` in every coordinate
    (drawn in float64 on the CPU, the same numbers on every device)."""
    x = torch.randn(n, d, generator=generator(seed), dtype=torch.float64) + offset
    return x.to(pick_device(device), dtype)


def with_copies(a: torch.Tensor, b: torch.Tensor, every: int = 3) -> torch.Tensor:
    """``b`` with every ``every``-th row replaced by a row of ``a``: pairs at distance exactly 0."""
    b = b.clone()
    rows = torch.arange(0, min(a.shape[0], b.shape[0]), every, device=b.device)
    b[rows] = a[rows]
    return b


def random_graph(nodes: int, edges: int, *, seed: int, device=None, empty: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """``(source, target)``: ``edges`` edges among ``nodes`` nodes, drawn at random (so targets
    repeat), with the last ``empty`` nodes receiving no edge at all. int64, on ``device``."""
    g = generator(seed)
    receiving = max(1, nodes - empty)
    source = torch.randint(nodes, (edges,), generator=g)
    target = torch.randint(receiving, (edges,), generator=g)
    dev = pick_device(device)
    return source.to(dev), target.to(dev)


def regression_task(n: int, features: int = 3, *, seed: int, noise: float = 0.1, device=None):
    """``(x, y, w)``: ``x`` of shape ``(n, features)``, targets ``y = x @ w + noise`` of shape ``(n,)``
    (one number per sample, as a data set usually stores them), and the true weights ``w``."""
    g = generator(seed)
    x = torch.randn(n, features, generator=g, dtype=torch.float64)
    w = torch.randn(features, generator=g, dtype=torch.float64)
    y = x @ w + 2.0 + noise * torch.randn(n, generator=g, dtype=torch.float64)
    dev = pick_device(device)
    return x.float().to(dev), y.float().to(dev), w.float().to(dev)


# -- the critic --------------------------------------------------------------------------------

class Critic(nn.Module):
    """A tanh MLP with one score per sample: ``(N, features) -> (N,)``."""

    def __init__(self, features: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


@recipe
def critic(seed: int = 0, features: int = 8, hidden: int = 32, dtype: str = "float32", device: str = "cpu") -> Critic:
    """A seeded :class:`Critic` (``dtype`` by name: ``"float32"`` or ``"float64"``). It crosses the
    grader's boundary as this recipe: the learner's process builds the same critic."""
    if dtype not in ("float32", "float64"):
        raise ValueError(f"dtype should be 'float32' or 'float64', got {dtype!r}.")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Critic(features, hidden)
    return model.to(device=pick_device(device), dtype=getattr(torch, dtype))


# -- baselines ---------------------------------------------------------------------------------

@reference
def naive_sq_dists(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``|a_i - b_j|^2`` by broadcasting: an ``(N, M, D)`` difference, squared and summed."""
    return ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)


@reference
def row_loop_sq_dists(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The same, one row of ``a`` at a time: ``N`` small ``(M, D)`` differences."""
    return torch.stack([((row - b) ** 2).sum(-1) for row in a])


@reference
def loop_segment_sum(values: torch.Tensor, index: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Segment sums by a Python loop over the edges: what a loop-minded first version does."""
    out = values.new_zeros((num_segments, *values.shape[1:]))
    for e in range(index.shape[0]):
        out[index[e]] += values[e]
    return out


@reference
def loop_penalty(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The gradient penalty ``mean_i (|d model(x)_i / d x_i| - 1)^2``, one sample at a time: a
    backward pass (with ``create_graph``) per sample."""
    terms = []
    for i in range(x.shape[0]):
        xi = x[i:i + 1].detach().requires_grad_()
        g, = torch.autograd.grad(model(xi).sum(), xi, create_graph=True)
        terms.append((g.norm() - 1) ** 2)
    return torch.stack(terms).mean()


@functools.lru_cache(maxsize=8)
def _timing_critic(seed: int, features: int, hidden: int, device: str) -> Critic:
    return critic(seed, features, hidden, "float32", device)


# -- plots -------------------------------------------------------------------------------------

def plot_loss_curves(curves: dict[str, Sequence[float]], *, title: str = "training loss"):
    """One line per named loss curve, on a log scale."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    for label, values in curves.items():
        ax.plot(range(1, len(values) + 1), values, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("mean squared error")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig


def plot_cancellation(offsets: Sequence[float], errors: dict[str, Sequence[float]], *, title: str):
    """The largest error of each method (float32, against float64) as the points move away from
    the origin."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    for label, values in errors.items():
        ax.plot(offsets, [max(v, 1e-12) for v in values], marker="o", label=label)
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_yscale("log")
    ax.set_xlabel("offset of the points from the origin")
    ax.set_ylabel("largest error (float32)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig

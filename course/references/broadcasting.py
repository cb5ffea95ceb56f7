"""Lesson 7's references: the right answer of every exercise (the broadcast rule, the loss, pairwise
squared distances, segment sums and maxima, the gradient penalty, softplus and its derivatives),
so the grader's alone (see :mod:`course.references`). :func:`answers` gives what a check compares
with, on the inputs the check draws from its seed and sizes; :data:`DATA_FILES` stores those of the
lesson's own calls, for the visible checks of a learner's copy.

The lesson's slow baselines (:mod:`course.broadcasting`'s loops and broadcasts) stay with the
lesson: its cells time them, and the speed checks must beat them.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
from torch.func import functional_call

from course.checks.common import visible_call
from course.guard import reference

__all__ = ["DATA_FILES", "answers", "broadcast_shape_reference", "mse_reference", "penalty_reference",
           "penalty_loop", "segment_max_loop", "segment_max_reference", "segment_sum_loop",
           "segment_sum_reference", "softplus_reference", "sq_dists_reference", "visible_answers"]

F64 = torch.float64


# -- the references ----------------------------------------------------------------------------------

@reference
def broadcast_shape_reference(a: tuple, b: tuple) -> tuple | None:
    """The shape ``a`` and ``b`` broadcast to, by torch's own rule; None where they do not."""
    try:
        return tuple(torch.broadcast_shapes(a, b))
    except RuntimeError:
        return None


@reference
def mse_reference(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean squared error of one prediction per target, whatever ``(n,)`` or ``(n, 1)`` shapes."""
    return ((pred.reshape(-1) - target.reshape(-1)) ** 2).mean()


@reference
def sq_dists_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``|a_i - b_j|^2`` in float64, from the differences (no cancellation)."""
    a, b = a.to(F64), b.to(F64)
    return ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)


@reference
def segment_sum_reference(values: torch.Tensor, index: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Row ``s``: the sum of the values of segment ``s`` (every one); 0 for an empty segment."""
    return values.new_zeros((num_segments, *values.shape[1:])).index_add(0, index, values)


# -- the judge's clocks' yardsticks: the leanest loops we know --------------------------------------
# A clock asks "a loop or not" by timing the learner's answer against a loop over the same work; against
# the leanest loop (a few Python or NumPy operations a step) a loop of the learner's reads about 1 and fails
# outright, and the yardstick costs little to run. Each takes the clock's 2-D float inputs.

def _edge_loop(values: torch.Tensor, index: torch.Tensor, num_segments: int, maximum: bool) -> torch.Tensor:
    out: list = [None] * num_segments
    for i, row in zip(index.tolist(), values.tolist()):
        target = out[i]
        if target is None:  # a segment's first value, taken as it is
            out[i] = row
        elif maximum:
            for k, v in enumerate(row):
                if v > target[k]:
                    target[k] = v
        else:
            for k, v in enumerate(row):
                target[k] += v
    zero = [0.0] * values.shape[1]
    return torch.tensor([zero if r is None else r for r in out], dtype=values.dtype)


@reference
def segment_sum_loop(values: torch.Tensor, index: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Segment sums by a loop over the edges in plain Python, on lists: a segment's first value taken
    as it is, a few additions for each further one."""
    return _edge_loop(values, index, num_segments, maximum=False)


@reference
def segment_max_loop(values: torch.Tensor, index: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Segment maxima (0 where a segment is empty) by the same loop, a few comparisons an edge."""
    return _edge_loop(values, index, num_segments, maximum=True)


@reference
def penalty_loop(model: nn.Module, x: torch.Tensor, params: dict | None = None) -> torch.Tensor:
    """The gradient penalty of the lesson's critic (:class:`course.broadcasting.Critic`, with its own
    weights or ``params``) by a loop over the samples in NumPy, each sample's input gradient written out
    by hand: about ten small NumPy calls a sample."""
    import numpy as np

    weights = dict(model.named_parameters()) if params is None else params
    p = {k: v.detach().double().numpy() for k, v in weights.items()}
    W1, b1, W2, b2, w3 = p["net.0.weight"], p["net.0.bias"], p["net.2.weight"], p["net.2.bias"], p["net.4.weight"][0]
    W1T, W2T, total = W1.T.copy(), W2.T.copy(), 0.0
    for xi in x.detach().double().numpy():
        a1 = np.tanh(W1 @ xi + b1)
        a2 = np.tanh(W2 @ a1 + b2)
        g = W1T @ ((W2T @ (w3 * (1 - a2 * a2))) * (1 - a1 * a1))
        total += (np.sqrt(g @ g) - 1.0) ** 2
    return torch.tensor(total / x.shape[0], dtype=x.dtype)


@reference
def segment_max_reference(values: torch.Tensor, index: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Row ``s``: the elementwise maximum of the values of segment ``s``; 0 for an empty segment."""
    out = values.new_zeros((num_segments, *values.shape[1:]))
    for s in range(num_segments):
        rows = values[index == s]
        if rows.shape[0]:
            out[s] = rows.amax(0)
    return out


@reference
def penalty_reference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``mean_i (|grad_x model(x)_i|_2 - 1)^2`` from the full Jacobian of the batch's scores with
    respect to the batch (``jacrev``, small batches only): sample ``i``'s own input gradient is its
    diagonal block ``[i, i]``; differentiable with respect to the model's weights."""
    jac = torch.func.jacrev(lambda inp: functional_call(model, dict(model.named_parameters()), (inp,)))(x)
    own = torch.diagonal(jac.reshape(x.shape[0], x.shape[0], -1), dim1=0, dim2=1).transpose(0, 1)
    return (torch.linalg.vector_norm(own, dim=1).sub(1.0) ** 2).mean()


@reference
def softplus_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``log(1 + exp(x))`` (exact, no overflow) and its first two derivatives, in closed form:
    autograd through this expression would give 1, not 1/2, at ``x = 0`` (the kink of ``clamp``)."""
    s = torch.sigmoid(x)
    return x.clamp_min(0) + torch.log1p(torch.exp(-x.abs())), s, s * (1 - s)


# -- what each check compares with -------------------------------------------------------------------

def _shape_answers(seed: int, n: int) -> dict:
    from course.checks.broadcasting import shape_pairs

    return {"shapes": [broadcast_shape_reference(a, b) for a, b in shape_pairs(seed, n)]}


def _mse_answers(seed: int, n: int) -> dict:
    from course.checks.broadcasting import mse_case

    pred, target = mse_case(seed, n)
    pred = pred.clone().requires_grad_()
    value = mse_reference(pred, target)
    grad, = torch.autograd.grad(value, pred)
    return {"value": value.detach(), "grad": grad}


def _distance_answers(seed: int, n: int, m: int, d: int) -> dict:
    """Per case: the float64 distances, and the gradients of their sum weighted by the case's ``w``."""
    from course.checks.broadcasting import distance_cases

    out = []
    for case in distance_cases(seed, n, m, d, torch.device("cpu")):
        a, b = (t.to(F64).requires_grad_() for t in (case["a"], case["b"]))
        value = sq_dists_reference(a, b)
        ga, gb = torch.autograd.grad((value * case["w"]).sum(), (a, b))
        out.append({"value": value.detach(), "grad_a": ga, "grad_b": gb})
    return {"cases": out}


def _segment_answers(segment_reference: Callable, seed: int, nodes: int, edges: int, d: int) -> dict:
    """The segments' float64 values, and the gradient of their sum weighted by the check's ``w``."""
    from course.checks.broadcasting import segment_case

    values, index, w = segment_case(seed, nodes, edges, d, torch.device("cpu"))
    values = values.clone().requires_grad_()
    value = segment_reference(values, index, nodes)
    grad, = torch.autograd.grad((value * w).sum(), values)
    return {"value": value.detach(), "grad": grad}


def _penalty_answers(seed: int, n: int, features: int, hidden: int) -> dict:
    """The penalty's value, and its gradient w.r.t. each weight it depends on (the last layer's bias
    moves every score by the same amount and never reaches the input gradient: it has none)."""
    from course.checks.broadcasting import penalty_case

    model, x = penalty_case(seed, n, features, hidden, torch.device("cpu"))
    value = penalty_reference(model, x)
    named = list(model.named_parameters())
    grads = torch.autograd.grad(value, [p for _, p in named], allow_unused=True)
    return {"value": value.detach(), "grads": {k: g for (k, _), g in zip(named, grads) if g is not None}}


def _softplus_answers(seed: int, n: int) -> dict:
    from course.checks.broadcasting import softplus_points

    value, first, second = softplus_reference(softplus_points(seed, n, torch.device("cpu"))[0])
    return {"value": value, "first": first, "second": second}


#: exercise -> (its answers from seed and sizes, the check whose defaults are the lesson's own call)
_EXERCISES = {"broadcast_shape": (_shape_answers, "check_broadcast_shape"),
              "mse": (_mse_answers, "check_mse"),
              "pairwise_sq_dists": (_distance_answers, "check_pairwise_sq_dists"),
              "segment_sum": (functools.partial(_segment_answers, segment_sum_reference), "check_segment_sum"),
              "segment_max": (functools.partial(_segment_answers, segment_max_reference), "check_segment_max"),
              "penalty": (_penalty_answers, "check_gradient_penalty"),  # and check_penalty_func: the same defaults
              "softplus": (_softplus_answers, "check_softplus")}


def answers(exercise: str, seed: int, **sizes: int) -> dict:
    """What the check of ``exercise`` compares with on the inputs it draws from ``seed`` and
    ``sizes``: float64 tensors on the CPU (and, for the broadcast rule, shapes)."""
    return _EXERCISES[exercise][0](seed, **sizes)


def visible_answers(seed: int = 0) -> dict:
    """Every exercise's answers at the lesson's own call of its check (``seed``, the default sizes):
    ``{"seed", exercise: {"sizes", "answers"}}``."""
    from course.checks import broadcasting as checks

    out: dict = {"seed": seed}
    for exercise, (_, check) in _EXERCISES.items():
        sizes = visible_call(getattr(checks, check), leave_out=("seed", "device"))
        out[exercise] = {"sizes": sizes, "answers": answers(exercise, seed, **sizes)}
    return out


DATA_FILES = {"07_broadcasting.pt": visible_answers}

"""Lesson 4's references: each computes an exercise's answer (the JVP with respect to a model's
parameters, sinc and its derivative, the wide function's Jacobian), so they are the grader's alone
(see :mod:`course.references`). In a learner's copy the visible checks compare with the answers
stored for their own calls (``course/reference_data/04_forward_ad.pt``), and the speed check
times the learner's own ``jacobian_rev``."""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch.func import functional_call

from course.forward_ad import WideFunction
from course.guard import reference

__all__ = ["DATA_FILES", "central_differences", "param_jvp_reference", "reverse_jacobian", "sinc_derivative_reference",
           "sinc_reference", "wide_jacobian"]

F64 = torch.float64


@reference
def param_jvp_reference(model, x: torch.Tensor, tangents: dict, h: float = 1e-6):
    """(output, J @ v with J from reverse mode in float64, central finite differences) for the
    parameters named in ``tangents``; the others are constants."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    names = list(tangents)
    shapes = [params[n].shape for n in names]
    sizes = [params[n].numel() for n in names]
    flat = torch.cat([params[n].reshape(-1) for n in names])
    v = torch.cat([tangents[n].reshape(-1) for n in names])

    def f(flat_params):
        chunks = flat_params.split(sizes)
        return functional_call(model, {**params, **{n: c.view(s) for n, c, s in zip(names, chunks, shapes)}}, (x,))

    with torch.no_grad():
        out = f(flat)
        fd = (f(flat + h * v) - f(flat - h * v)) / (2 * h)
    jac = torch.autograd.functional.jacobian(f, flat)
    jv = (jac.reshape(-1, flat.numel()) @ v).reshape(out.shape)
    return out, jv, fd


_SERIES_TERMS = 14


@reference
def sinc_reference(x: torch.Tensor) -> torch.Tensor:
    """sin(x)/x in float64: a power series below |x| = 0.5 (no division), the quotient above."""
    x = x.to(F64)
    x2 = x * x
    series = torch.zeros_like(x)
    for n in reversed(range(_SERIES_TERMS)):  # Horner: sum of (-1)^n x^(2n) / (2n+1)!
        series = series * x2 + ((-1) ** n) / math.factorial(2 * n + 1)
    big = x.abs() >= 0.5
    safe = torch.where(big, x, torch.ones_like(x))
    return torch.where(big, torch.sin(safe) / safe, series)


@reference
def sinc_derivative_reference(x: torch.Tensor) -> torch.Tensor:
    """d/dx sin(x)/x in float64: the series' derivative below |x| = 0.5, (x cos x - sin x)/x^2 above."""
    x = x.to(F64)
    x2 = x * x
    series = torch.zeros_like(x)
    for n in reversed(range(1, _SERIES_TERMS)):
        series = series * x2 + ((-1) ** n) * 2 * n / math.factorial(2 * n + 1)
    series = series * x
    big = x.abs() >= 0.5
    safe = torch.where(big, x, torch.ones_like(x))
    return torch.where(big, (safe * torch.cos(safe) - torch.sin(safe)) / (safe * safe), series)


@reference
def wide_jacobian(f: WideFunction, x: torch.Tensor) -> torch.Tensor:
    """The (m, k) Jacobian of the wide function ``f`` at ``x``, in float64, in closed form:
    ``W2 diag(1 - tanh^2) W1``, no autodiff at all."""
    W1, b1, W2 = (t.to(F64) for t in (f.W1, f.b1, f.W2))
    y = torch.tanh(W1 @ x.to(W1) + b1)
    return (W2 * (1 - y * y)) @ W1


@reference
def central_differences(f: Callable, x: torch.Tensor, h: float = 1e-6) -> torch.Tensor:
    """The Jacobian of ``f`` at ``x`` by central finite differences, one column per input."""
    eye = torch.eye(x.numel(), dtype=x.dtype, device=x.device)
    with torch.no_grad():
        return torch.stack([(f(x + h * e) - f(x - h * e)) / (2 * h) for e in eye], dim=1)


@reference
def reverse_jacobian(f: WideFunction, x: torch.Tensor) -> torch.Tensor:
    """The speed check's baseline, reverse mode: ``torch.func.jacrev``, m VJPs vmapped."""
    return torch.func.jacrev(f)(x)


def forward_ad_data() -> dict:
    """The visible checks' answers at their own calls (their defaults), by the references above."""
    from course.checks.forward_ad import reference_data

    return reference_data()


DATA_FILES = {"04_forward_ad.pt": forward_ad_data}

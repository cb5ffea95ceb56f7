"""Compare a learner's result with a trusted reference, and say clearly what differs.

``assert_close`` walks tensors, numbers, and tuples/lists/dicts of them, and raises an
``AssertionError`` written for a learner: which part, what was expected and what came (type,
length, keys, shape, dtype, device), the largest absolute and relative errors and where they
are, how many elements are off, the tolerance used, and a hint.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from course import grader_hooks

__all__ = ["assert_close", "default_tolerance", "describe", "observing_paused", "report_at_least"]

_paused = 0


class observing_paused:
    """Comparisons inside this block are not reported to the autograder (timing loops, whose
    number of rounds depends on the machine)."""

    def __enter__(self):
        global _paused
        _paused += 1

    def __exit__(self, *exc):
        global _paused
        _paused -= 1

def report_at_least(name: str, value: float, bar: float, ceiling: float | None = None,
                    witness: float | None = None, trusted: bool = False) -> None:
    """Tell the autograder (if it is listening) that ``value`` was judged against ``bar`` with
    "at least": a speed check's measured ratio (its lower confidence bound; ``ceiling``, its upper
    bound, says whether a miss was decided). The grading parent checks it again, and compares it
    with the instructor's own measurement: ``witness``, where the course's own solution was timed in
    the same rounds, is the lower bound of the candidate's speed over it. ``trusted``: every side
    timed is the course's or torch's own (the learner's code only chose between them), so no ratio
    can be implausible. Outside the grader this does nothing."""
    if grader_hooks.observer is not None and not _paused:
        tol = dict(name=name, kind="at_least")
        if ceiling is not None:
            tol["ceiling"] = float(ceiling)
        if witness is not None:
            tol["witness"] = float(witness)
        if trusted:
            tol["trusted"] = True
        grader_hooks.observer(float(value), float(bar), tol)


# (rtol, atol) per dtype, the same spirit as torch.testing: a few units in the last place.
_TOLERANCES = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}


def default_tolerance(*dtypes: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for the least precise of ``dtypes`` (exact, 0, for integers and bools)."""
    tols = [_TOLERANCES.get(d, (0.0, 0.0)) for d in dtypes]
    return max(t[0] for t in tols), max(t[1] for t in tols)


def describe(x: Any) -> str:
    """A short, learner-readable description of a value."""
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}, {str(x.dtype).replace('torch.', '')}, on {x.device}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)} item{'s' if len(x) != 1 else ''}"
    if isinstance(x, Mapping):
        return f"a dict with keys {sorted(map(str, x))}"
    if x is None:
        return "None (did the function forget to `return`?)"
    return f"{type(x).__name__} {x!r}"[:120]


class _Mismatch(AssertionError):
    pass


def _fail(path: str, lines: list[str], hint: str | None) -> None:
    msg = [f"{path} does not match the reference."] + [f"  {line}" for line in lines]
    if hint:
        msg.append(f"  Hint: {hint}")
    raise _Mismatch("\n".join(msg))


def _index(flat_idx: int, shape: Sequence[int]) -> tuple[int, ...]:
    out = []
    for dim in reversed(shape):
        out.append(flat_idx % dim if dim else 0)
        flat_idx //= max(dim, 1)
    return tuple(reversed(out))


def _compare_tensors(a: torch.Tensor, e: torch.Tensor, path: str, rtol, atol, check_dtype,
                     check_device, equal_nan, hint) -> None:
    if tuple(a.shape) != tuple(e.shape):
        extra = ""
        if a.numel() == e.numel():
            extra = " Same number of elements: a missing transpose, view or permute?"
        elif a.dim() == e.dim() + 1 or a.dim() + 1 == e.dim():
            extra = " One dimension more or less: a missing or extra (un)squeeze or batch dimension?"
        _fail(path, [f"expected shape {tuple(e.shape)}, got {tuple(a.shape)}.{extra}"], hint)
    if check_dtype and a.dtype != e.dtype:
        _fail(path, [f"expected dtype {e.dtype}, got {a.dtype}."], hint or "convert with .to(dtype).")
    if check_device and a.device != e.device:
        _fail(path, [f"expected a tensor on {e.device}, got one on {a.device}."],
              hint or "create new tensors on the input's device (device=x.device).")
    if rtol is None or atol is None:
        d_rtol, d_atol = default_tolerance(a.dtype, e.dtype)
        rtol = d_rtol if rtol is None else rtol
        atol = d_atol if atol is None else atol
    if a.numel() == 0:
        return
    work = torch.complex128 if (a.dtype.is_complex or e.dtype.is_complex) else torch.float64
    av = a.detach().to("cpu", work)
    ev = e.detach().to("cpu", work)
    a_nan, e_nan = torch.isnan(av), torch.isnan(ev)
    if a_nan.any() and not (equal_nan and torch.equal(a_nan, e_nan)):
        n = int(a_nan.sum())
        first = _index(int(a_nan.flatten().nonzero()[0]), a.shape)
        _fail(path, [f"{n} of {a.numel()} elements are NaN (first at index {first}); the reference has "
                     f"{int(e_nan.sum())}."],
              hint or "NaN often comes from 0/0, log of a negative number, or padding values that leaked in.")
    diff = (av - ev).abs()
    if equal_nan:
        diff = torch.where(a_nan & e_nan, torch.zeros_like(diff), diff)
    # infinities: equal where both are the same infinity
    same_inf = torch.isinf(av) & (av == ev)
    diff = torch.where(same_inf, torch.zeros_like(diff), diff)
    allowed = atol + rtol * ev.abs()
    bad = ~(diff <= allowed)
    if equal_nan:
        bad &= ~(a_nan & e_nan)
    if not bad.any():
        return
    n_bad = int(bad.sum())
    worst = int(diff.flatten().argmax())
    rel = diff / ev.abs().clamp_min(1e-300)
    worst_rel = int(torch.where(bad, rel, torch.zeros_like(rel)).flatten().argmax())
    idx, idx_rel = _index(worst, a.shape), _index(worst_rel, a.shape)
    lines = [
        f"{n_bad} of {a.numel()} elements differ ({100.0 * n_bad / a.numel():.3g}%).",
        f"largest absolute error {diff.flatten()[worst].item():.3g} at index {idx}: "
        f"got {av.flatten()[worst].item():.6g}, expected {ev.flatten()[worst].item():.6g}.",
        f"largest relative error {rel.flatten()[worst_rel].item():.3g} at index {idx_rel}.",
        f"tolerance: |got - expected| <= atol + rtol * |expected| with atol={atol:.2g}, rtol={rtol:.2g}.",
    ]
    _fail(path, lines, hint)


def _walk(a: Any, e: Any, path: str, **kw) -> None:
    hint = kw["hint"]
    if isinstance(e, torch.Tensor):
        if not isinstance(a, torch.Tensor):
            _fail(path, [f"expected {describe(e)}, got {describe(a)}."], hint)
        _compare_tensors(a, e, path, **kw)
    elif isinstance(e, Mapping):
        if not isinstance(a, Mapping):
            _fail(path, [f"expected {describe(e)}, got {describe(a)}."], hint)
        missing, extra = sorted(set(e) - set(a), key=str), sorted(set(a) - set(e), key=str)
        if missing or extra:
            _fail(path, [f"keys differ: missing {missing}, unexpected {extra}."], hint)
        for k in e:
            _walk(a[k], e[k], f"{path}[{k!r}]", **kw)
    elif isinstance(e, (tuple, list)):
        if not isinstance(a, (tuple, list)):
            _fail(path, [f"expected {describe(e)}, got {describe(a)}."], hint)
        if len(a) != len(e):
            _fail(path, [f"expected {len(e)} items, got {len(a)}."], hint)
        for i, (ai, ei) in enumerate(zip(a, e)):
            _walk(ai, ei, f"{path}[{i}]", **kw)
    elif isinstance(e, (int, float, complex)) and not isinstance(e, bool):
        if isinstance(a, torch.Tensor) and a.numel() == 1:
            a = a.item()
        if not isinstance(a, (int, float, complex)) or isinstance(a, bool):
            _fail(path, [f"expected a number, got {describe(a)}."], hint)
        rtol = kw["rtol"] if kw["rtol"] is not None else 1e-7
        atol = kw["atol"] if kw["atol"] is not None else 1e-7
        both_nan = (isinstance(a, float) and isinstance(e, float) and math.isnan(a) and math.isnan(e))
        if not (both_nan and kw["equal_nan"]) and not abs(a - e) <= atol + rtol * abs(e):
            _fail(path, [f"expected {e!r}, got {a!r} (atol={atol:.2g}, rtol={rtol:.2g})."], hint)
    else:
        if a != e:
            _fail(path, [f"expected {describe(e)}, got {describe(a)}."], hint)


def assert_close(actual: Any, expected: Any, *, rtol: float | None = None, atol: float | None = None,
                 name: str = "result", hint: str | None = None, check_dtype: bool = True,
                 check_device: bool = True, equal_nan: bool = False) -> None:
    """Raise ``AssertionError`` unless ``actual`` matches ``expected`` within tolerance.

    Tolerances default to those of the least precise dtype involved; compare against a float64
    reference with ``check_dtype=False`` to measure a float32 result's error honestly.
    """
    if grader_hooks.observer is not None and not _paused:  # under the grader: tell the parent
        grader_hooks.observer(actual, expected, dict(rtol=rtol, atol=atol, name=name, check_dtype=check_dtype,
                                         equal_nan=equal_nan))
    try:
        _walk(actual, expected, name, rtol=rtol, atol=atol, check_dtype=check_dtype,
              check_device=check_device, equal_nan=equal_nan, hint=hint)
    except _Mismatch as exc:
        # A plain AssertionError with no chained internals: the message is the whole story.
        raise AssertionError(str(exc)) from None

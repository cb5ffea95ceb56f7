"""Checks for lesson 05_jacobians_hessians: a Jacobian row by row with ``torch.autograd.grad``; the
largest ``chunk_size`` within a memory budget; a picker between ``jacfwd`` and ``jacrev``, and its
choice measured; batched Jacobians and Hessians, by ``vmap`` and by the summation trick;
Hessian-vector products that never build the Hessian.

Every numeric result is compared with a formula evaluated in float64, on functions and points
drawn from ``seed``. The formulas (the derivatives of ``course.jacobians``' functions, written out
by hand) answer the exercises, so they are the grader's alone (:mod:`course.references.jacobians`,
which the learner's process never has); a learner's copy of the course has no references either,
and there the visible checks (the lesson's own calls) compare with the float64 answers stored for
those calls (``course/reference_data/05_jacobians.pt``, written by ``python -m course.references``).
Two structural questions are answered by ``course.jacobians.TensorWatch``, a
``TorchDispatchMode`` that sees every ATen op:

- *was there a Python loop?* The op count of a loop grows with the number of rows (or samples);
  that of a ``vmap`` does not. Counted on the CPU, whatever the lesson's device, so that the
  count does not depend on where autograd runs its backward pass.
- *was an n x n matrix built?* The learner's HVP runs at n = 40,000 in float64 on the ``meta``
  device, where tensors have shapes and no memory: the Hessian would be 12.8 GB, far over the
  lesson's 2 GB, yet nothing is allocated, so a wrong answer fails with a message instead of
  exhausting the machine. The largest tensor the HVP creates must stay far below ``n * n``.

Under the grader these checks run in the judge (``SERVED``), and the learner's functions are
called across the process boundary: the layers and energies cross as recipes, built again on the
learner's side by the course's own code. Op counts seen there would be that process's word, so
both questions are answered by the judge's own clock instead (:func:`_growth`): the row loop must
take at least ten times as long for 128 times the rows (a vmap measured about 3; five times or less
fails, and in between is undecided); a batched Jacobian (``vmap``, or the summation trick) and an
HVP must take at most a third of the time of the course's own loop (or Hessian) on the same work,
timed beside it while the learner's process is stopped: a loop that sleeps to look flat is still
no faster than a loop. The course's row loop answers exercise 1, so it is the grader's too; the
Hessian times v (``torch.func.hessian``, which the HVP exercise forbids) is no answer to hide.
"""

from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch.func import jacfwd, jacrev

from course.checks.common import (LOOP_LIKE, NO_LOOP, Clocked, best_net, call, clock_against_loop, clock_verdict,
                                  expect_loop_verdict, grader_references, name_mistake, ok, record, stored_answers,
                                  visible_call)
from course.data import randn
from course.devices import pick_device, threads
from course.hand import again
from course.grading import best_of, expect_speedup, speed_bar
from course.jacobians import (TanhLayer, TensorWatch, banded_layer, energy, format_bytes, hvp_run_matches, normed_layer,
                              tanh_layer)
from course.numerics import assert_close, describe
from course.timing import SpeedReport, best_times, compare, format_time
from course.remote import is_remote, mirrored, probe, prober, recipe

#: Checks the grader runs in its judge process, calling the learner's code across the boundary.
SERVED = ("check_row_jacobian", "check_largest_chunk", "check_pick_jacobian", "check_picker_speed",
          "check_parameter_jacobians", "check_batched_jacobian", "check_batched_hessian",
          "check_batched_jacobian_sum", "check_hvp")

__all__ = ["check_batched_hessian", "check_batched_jacobian", "check_batched_jacobian_sum", "check_hvp",
           "check_largest_chunk", "check_parameter_jacobians", "check_pick_jacobian", "check_picker_speed",
           "check_row_jacobian"]

F64 = torch.float64
# float32 results against a float64 formula: a few float32 roundings of values of order 1
TOL32 = dict(rtol=1e-4, atol=2e-5)
TOL64 = dict(rtol=1e-9, atol=1e-11)


def _tol(dtype: torch.dtype) -> dict:
    return TOL64 if dtype == F64 else TOL32


# -- what the checks compare with -----------------------------------------------------------------


#: The float64 answers of the visible checks, for a learner's copy (``python -m course.references``).
DATA_FILE = "05_jacobians.pt"


def _answers(answers: Callable[..., list], seed: int, **sizes: int) -> list:
    """``answers(refs, seed, **sizes)``: a check's float64 answers, on the CPU, by the grader's
    references; in a learner's copy (none there), those stored for the lesson's own call, refused
    for other arguments (the grader checks others)."""
    refs = grader_references("jacobians")
    if refs is not None:
        return answers(refs, seed, **sizes)
    stored = stored_answers(DATA_FILE, seed=seed)[answers.__name__]
    if stored["sizes"] != sizes:
        raise AssertionError(f"This check has reference data for {stored['sizes']} only (the lesson's own call); "
                             f"the grader checks others ({sizes} asked for here).")
    return stored["answers"]


def reference_data(seed: int = 0) -> dict:
    """What :func:`_answers` reads in a learner's copy: every visible check's float64 answers on
    ``seed`` at the check's default sizes, by the grader's references:
    ``{"seed", answers' name: {"sizes", "answers"}}``."""
    from course.references import jacobians as refs

    data: dict = {"seed": seed}
    for check, answers in _VISIBLE.items():
        sizes = visible_call(check, leave_out=("seed", "device"), only=inspect.signature(answers).parameters)
        data[answers.__name__] = {"sizes": sizes, "answers": answers(refs, seed, **sizes)}
    return data


def _course_loop(**how: bool) -> Callable:
    """``(f, xs) ->`` the course's loop over the samples (:func:`course.references.jacobians.sample_loop`,
    with ``how``), looked up when it runs: it is the clock's yardstick across the boundary only, in the
    judge, which has the references (in the learner's own notebook op counts answer, and no loop of
    the course's runs)."""
    return lambda f, xs: grader_references("jacobians").sample_loop(f, xs, **how)


def _expect_tensor(got, name: str, x: torch.Tensor, shape: tuple[int, ...], hint: str) -> None:
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{name} should return a tensor of shape {shape}, got {describe(got)}.\n  Hint: {hint}")
    if tuple(got.shape) != shape:
        raise AssertionError(f"{name} returned shape {tuple(got.shape)}; expected {shape}.\n  Hint: {hint}")
    if got.dtype != x.dtype:
        raise AssertionError(f"{name} returned {got.dtype} for a {x.dtype} input; keep the input's dtype "
                             "(make basis vectors with dtype=x.dtype, device=x.device).")


def _compare(got, ref64: torch.Tensor, name: str, dtype: torch.dtype, hint: str,
             variants: Mapping[str, torch.Tensor] | None = None) -> None:
    """``got`` against the float64 answer ``ref64`` (on the CPU when stored), naming a known mistake."""
    ref = ref64.to(got.device)
    named = {"the result has the opposite sign": -ref, **{k: v.to(got.device) for k, v in (variants or {}).items()}}
    if ref.dim() == 2 and ref.shape[0] == ref.shape[1]:
        named["the result is transposed: row i is output i, column j is input j"] = ref.T
    name_mistake(name, got, ref, named, **_tol(dtype))
    assert_close(got, ref, check_dtype=False, name=name, hint=hint, **_tol(dtype))


# -- the Jacobian cases -------------------------------------------------------------------------

DTYPES = (F64, torch.float32)


def _tanh_exact(layer: TanhLayer, x: torch.Tensor) -> Callable:
    return lambda refs: refs.tanh_jacobian(layer.to(F64), x.to(F64))


def _jacobian_cases(seed: int, n_out: int, n_in: int, device):
    """(label, f, x, exact): a dense layer in float64 and float32, a banded layer, and the
    hand-written gradient of an Energy (whose Jacobian is its Hessian); ``exact(refs)`` is the
    Jacobian in float64 by the grader's formula."""
    dev = pick_device(device)
    cases = []
    for dtype in DTYPES:
        layer = tanh_layer(n_out, n_in, seed=seed, device=dev, dtype=dtype)
        x = randn(n_in, seed=seed + 10, device=dev, dtype=dtype)
        cases.append((f"a {n_out}x{n_in} tanh layer ({str(dtype).replace('torch.', '')})", layer, x,
                      _tanh_exact(layer, x)))
    band = banded_layer(n_in, seed=seed + 3, device=dev, dtype=torch.float32)
    x = randn(n_in, seed=seed + 11, device=dev)
    cases.append((f"a banded {n_in}x{n_in} layer (float32)", band, x, _tanh_exact(band, x)))
    e = energy(max(n_in, 2), seed=seed + 5, device=dev, dtype=F64)
    x_e = randn(e.n, seed=seed + 12, device=dev, dtype=F64)
    cases.append((f"the gradient of an Energy of {e.n} variables (float64)", e.gradient, x_e,
                  lambda refs: refs.energy_hessian(e, x_e)))
    return cases


def _row_answers(refs, seed: int, *, n_out: int, n_in: int) -> list:
    """The float64 Jacobian of each of :func:`_jacobian_cases`."""
    return [exact(refs) for *_, exact in _jacobian_cases(seed, n_out, n_in, "cpu")]


@dataclass
class _Growth:
    """Evidence of a loop: ATen ops at two sizes (counted on the CPU, in the learner's own notebook),
    or the grader's clock: wall times at two sizes, or at the large size beside the course's own
    loop over the same work (which a function that sleeps to look flat cannot beat)."""

    small: float | None
    large: float
    sizes: tuple[int, int]
    unit: str  # "ops" or "time"
    loop: float | None = None  # the course's loop at the large size (time only)
    peak: float | None = None  # the most the learner's peak memory grew during one timed call (the kernel's count)
    worked: float | None = None  # of the wall time of its calls at the large size, the share it spent on a CPU
    wanted: float | None = None  # the share it spent on a CPU or ready for one (waiting: a busy machine)
    no_loop: float = NO_LOOP  # the clock's bars beside the course's loop (expect_loop_verdict)
    loop_like: float = LOOP_LIKE

    @property
    def grows(self) -> bool:
        """The work of a loop: more for more rows or samples, or no faster than the course's loop."""
        if self.loop is not None:  # a vmap measured 0.04-0.2 of the course's loop; a loop about 1
            return self.large > self.no_loop * self.loop
        return self.large >= (1.75 if self.unit == "ops" else LOOP_GROWTH) * self.small

    def text(self, what: str) -> str:
        (a, b) = self.sizes
        if self.unit == "ops":
            return f"ran {int(self.small)} ops for {a} {what} and {int(self.large)} for {b}"
        if self.loop is not None:
            return (f"took {format_time(self.large)} for {b} {what}, where the course's loop over them takes "
                    f"{format_time(self.loop)} (the grader's clock)")
        return (f"took {format_time(self.small)} for {a} {what} and {format_time(self.large)} for {b} "
                "(the grader's clock)")


#: By the clock alone, 128 times the rows: a loop takes at least LOOP_GROWTH times as long, a vmap
#: (measured about 3) at most FLAT_GROWTH; in between a busy machine has blurred the two readings.
LOOP_GROWTH, FLAT_GROWTH = 10.0, 5.0


def _expect_loop(g: _Growth, text: str, fail: str) -> None:
    """A loop, by op counts in the learner's notebook (two verdicts), or by the grader's clock at two
    sizes (:func:`course.checks.common.clock_verdict`: noise slows either reading)."""
    if g.unit == "ops":
        if not g.grows:
            raise AssertionError(text + fail)
        return
    if g.worked is not None and g.worked < WORKED and g.wanted is not None and g.wanted >= WORKED:
        from course.grading import SpeedUndecided

        raise SpeedUndecided(
            f"Undecided: {text}, but your notebook's processes were on a CPU for only {g.worked:.0%} of that time, "
            f"and ready for one, waiting, for {g.wanted - g.worked:.0%} (the operating system's count): the machine "
            "was busy. This is not a pass: run the cell again, with other programs closed.")
    if g.worked is not None and g.worked < WORKED:
        raise AssertionError(
            f"{text}, but your notebook's processes spent only {g.worked:.0%} of that time on a CPU (the operating "
            f"system's count): the time of waiting, not of work. This exercise is the baseline the rest of the "
            f"lesson beats: write the loop, one torch.autograd.grad call per output row.")
    ratio = g.large / g.small
    between = (f"{ratio:.1f} times as long, between the growth of a vmap (at most {FLAT_GROWTH:.0f}x) and of a loop "
               f"(at least {LOOP_GROWTH:.0f}x)")
    flat = ratio <= FLAT_GROWTH
    small, large = getattr(g.small, "net", None), getattr(g.large, "net", None)  # (Clocked: see _recorded)
    if flat and small is not None and large is not None and large > FLAT_GROWTH * max(small, 1e-9):
        # the small calls' time was mostly the crossing's waiting for a CPU (a busy machine adds it to both sizes)
        flat = False
        between = (f"{ratio:.1f} times as long, but {large / max(small, 1e-9):.1f} times net of the time "
                   "your process and the grader waited, ready, for a CPU (the operating system's count)")
    clock_verdict(g.grows, flat, text=text, fail=fail, between=between)


def _expect_no_loop(g: _Growth, text: str, fail: str) -> None:
    """No loop, by op counts in the learner's notebook, or by the grader's clock beside the course's
    loop (where a busy machine can leave it undecided: :func:`course.checks.common.expect_loop_verdict`)."""
    if g.loop is not None:
        expect_loop_verdict(g.large, g.loop, want_loop=False, text=text, fail=fail, no_loop=g.no_loop,
                            loop_like=g.loop_like)
    elif g.grows:
        raise AssertionError(text + fail)


def _growth(fn: Callable, name: str, make: Callable[..., tuple], ops_sizes: tuple[int, int],
            time_sizes: tuple[int, int], loop: Callable | None = None, attempts: int = 3,
            bars: tuple[float, float] = (NO_LOOP, LOOP_LIKE), **tolerance: float) -> _Growth:
    """How ``fn(*make(size))``'s work grows: op counts at ``ops_sizes`` for a function in this
    process; for the learner's function across the boundary, best wall times at ``time_sizes``,
    or (with ``loop``, the course's loop doing the same work) its time at the large size beside
    the loop's, timed here with the learner's process stopped, on fresh inputs every time
    (``make(size, fresh)``), every output compared with the loop's. A clock reading against what the
    lesson asks (no loop when ``loop`` is given, a loop otherwise) is refined by more readings,
    ``attempts`` in all, each side's best kept across them: a busy machine can slow one side of a
    reading, never make a loop faster than a loop. ``bars``: at most what share of the loop's time is
    no loop, and at least what share a loop (a check that measured its own work sets tighter ones).
    Across the boundary the reading is taken once per answer and question in a test cell (the
    hidden tests ask again on other seeds; the learner's function is the same)."""
    if is_remote(fn):
        cache = fn.__dict__.setdefault("growth_readings", {})
        key = (time_sizes, loop is None)
        if key not in cache:
            cache[key] = _clock_growth(fn, name, make, time_sizes, loop, attempts, bars, **tolerance)
        return cache[key]
    counts = []
    for n in ops_sizes:
        with TensorWatch() as w:
            call(fn, *make(n), name=name)
        counts.append(w.ops)
    return _Growth(counts[0], counts[1], ops_sizes, "ops")


def _clock_growth(fn, name: str, make: Callable[..., tuple], time_sizes: tuple[int, int], loop: Callable | None,
                  attempts: int, bars: tuple[float, float], **tolerance: float) -> _Growth:
    """Best times over two to ``attempts`` readings, each side's best kept across all of them: more
    readings refine both sides' estimates (noise only ever adds time), they are not new chances.
    Beside the times, what the kernel counted of the learner's timed calls: the most its peak memory
    grew during one (``peak``), and the largest share of the wall time of its calls at the large size
    that its processes spent on a CPU in one reading (``worked``: a loop works, a sleep waits)."""
    record: dict = {}
    if loop is not None:
        mine, theirs = clock_against_loop(fn, name, lambda fresh: make(time_sizes[1], fresh), loop, attempts=attempts,
                                          record=record, no_loop=bars[0], loop_like=bars[1], **tolerance)
        return _recorded(_Growth(None, mine, time_sizes, "time", loop=theirs, no_loop=bars[0], loop_like=bars[1]),
                         record, 0)
    learner = lambda *args: call(fn, *args, name=name)  # noqa: E731
    best = [float("inf"), float("inf")]
    for attempt in range(max(attempts, 2)):
        times = best_times([(learner, make(n)) for n in time_sizes], record=record)
        best = [min(b, t) for b, t in zip(best, times)]
        g = _recorded(_Growth(best[0], best[1], time_sizes, "time"), record, 1)
        if attempt >= 1 and g.grows and (g.worked is None or g.worked >= WORKED):  # the lesson asks for a loop
            break
    return g


#: A loop works for its time: the learner's processes on a CPU for at least this share of its wall time
#: at the large size (a loop of backward passes: about 1). A function that sleeps to look like a loop
#: waits instead (red team, round 18: jacrev, then a sleep as long as the rows: 0.05-0.1). A loop that a
#: busy machine kept from the CPU waited too, but ready to run (the scheduler counts it): below this share
#: of work and above it of work and readiness together, the verdict is undecided, not a fail.
WORKED = 0.5


def _recorded(g: _Growth, record: dict, large: int) -> _Growth:
    """``g`` with what ``record`` holds of the learner's calls (:func:`course.timing.best_times`):
    its calls are entry 0 against a loop, entries 0 and 1 (small and large) alone."""
    grown = [x for reading in record.get("grown", []) for per_call in reading for x in per_call]
    g.peak = max(grown) if grown else None
    used = record.get("used", [])
    waited = record.get("waited", [])
    shares, wanted = [], []
    for k, reading in enumerate(used):
        if not (len(reading) > large and reading[large] and sum(w for w, _ in reading[large]) > 0):
            continue
        wall = sum(w for w, _ in reading[large])
        shares.append(sum(c for _, c in reading[large]) / wall)
        waits = waited[k][large] if k < len(waited) and len(waited[k]) > large else []
        if len(waits) == len(reading[large]) and min(waits) >= 0:
            wanted.append(shares[-1] + sum(waits) / wall)
    g.worked = max(shares) if shares else None
    # a reading without the scheduler's count of waiting leaves it unknown: the CPU share decides alone
    g.wanted = max(wanted) if wanted and len(wanted) == len(shares) else None
    if large == 1:  # two sizes, the learner's calls alone: each size's best time net of the crossing's waiting
        g.small, g.large = Clocked(g.small, best_net(record, 0)), Clocked(g.large, best_net(record, 1))
    return g


def _rows_growth(fn: Callable, name: str, seed: int) -> _Growth:
    """On layers with 8 and 40 outputs (op counts) or 8 and 1024 (time: enough rows that the work, not
    the crossing of the boundary, dominates), 16 inputs, on the CPU."""
    return _growth(fn, name, lambda m, fresh=0: (tanh_layer(m, 16, seed=seed, device="cpu"),
                                                 randn(16, seed=seed + 1 + fresh, device="cpu")),
                   (8, 40), (8, 1024))


def _jacobian_numerics(fn: Callable, name: str, seed: int, n_out: int, n_in: int, device, hint: str) -> int:
    cases = _jacobian_cases(seed, n_out, n_in, device)
    answers = _answers(_row_answers, seed, n_out=n_out, n_in=n_in)
    for (label, f, x, _), ref in zip(cases, answers):
        x_in = x.clone()
        with mirrored(fn):  # across the boundary, what it did to x comes back
            got = call(fn, f, x_in, name=name)
        _expect_tensor(got, f"{name} on {label}", x, tuple(ref.shape),
                       "row i of the Jacobian is the gradient of output i: (number of outputs, number of inputs).")
        _compare(got, ref, f"{name} on {label}", x.dtype, hint)
        if not torch.equal(x_in.detach(), x):
            raise AssertionError(f"{name} changed its input x in place; differentiate a copy "
                                 "(x.detach().requires_grad_() makes a new leaf without touching x).")
        if x_in.requires_grad:
            raise AssertionError(f"{name} switched on requires_grad of the caller's x (x.requires_grad_() changes "
                                 "the tensor it is given: the caller's next backward would then reach it). "
                                 "Make a new leaf instead: x = x.detach().requires_grad_(True).")
    return len(cases)


def check_row_jacobian(jacobian_rows: Callable, *, seed: int = 0, n_out: int = 12, n_in: int = 9,
                       device=None) -> None:
    """``jacobian_rows(f, x)``: the ``(m, n)`` Jacobian of ``f: R^n -> R^m`` at ``x``, one
    ``torch.autograd.grad`` call per output (the slow baseline: its op count must grow with m)."""
    hint = ("make x a leaf that requires grad, compute y = f(x) once, then for each i take "
            "torch.autograd.grad(y[i], x, retain_graph=True)[0] as row i, and stack the rows.")
    n = _jacobian_numerics(jacobian_rows, "jacobian_rows", seed, n_out, n_in, device, hint)
    g = _rows_growth(jacobian_rows, "jacobian_rows", seed)
    _expect_loop(g, f"jacobian_rows {g.text('outputs')}",
                 ": the same work whatever the number of rows, which is what vmap does. This exercise is the "
                 "baseline the rest of the lesson beats: write the loop, one torch.autograd.grad call per output row.")
    ok(f"jacobian_rows equals the float64 formula on {n} functions (seed {seed}); its loop {g.text('rows')}")


def _measure(candidates: dict, inputs: Callable, check: Callable, name: str, over: str, bar: float, rounds: int,
             min_run_time: float, attempts: int, dev, num_threads) -> SpeedReport:
    """Time side by side; below the bar, measure again (up to ``attempts``) and keep the best run:
    a shared machine can stall one side of a round, but a slower technique stays below in every run."""
    def measure():
        with threads(num_threads if dev.type == "cpu" else None):
            return compare(candidates, inputs=inputs, check=check, baseline=over, rounds=rounds,
                           min_run_time=min_run_time, device=dev, until=(name, over, bar))

    return best_of(measure, name, bar, attempts)


# -- chunk_size under a memory budget ------------------------------------------------------------

@dataclass(frozen=True)
class _Peak:
    """What ``jacrev(f, chunk_size=c)(x)`` made, by the judge's own TensorWatch."""
    bytes: int
    shape: tuple[int, ...]
    op: str
    ops: int


def _chunk_peak(f: Callable, x: torch.Tensor, chunk: int) -> _Peak:
    with TensorWatch() as w:
        jacrev(f, chunk_size=chunk)(x)
    return _Peak(w.largest_bytes, w.largest_shape, w.largest_op, w.ops)


def _chunk_cases(seed: int) -> list[tuple[str, TanhLayer, torch.Tensor, Callable[[int, Callable], int]]]:
    """(label, f, x, budget from (m, peak)): a budget between two chunks' peaks, in float32 and
    float64; one above the whole Jacobian at once; one below the Jacobian itself."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    m32, n32, m64, n64 = pick(300, 600), pick(24, 64), pick(150, 300), pick(16, 40)
    c32, c64 = pick(n32 + 2, m32 - 1), pick(n64 + 2, m64 - 1)  # past n, where the identity outgrows the Jacobian
    between = lambda c: lambda m, peak: (peak(c).bytes + peak(c + 1).bytes) // 2  # noqa: E731
    return [
        (f"a {m32}x{n32} tanh layer (float32)", tanh_layer(m32, n32, seed=seed, device="cpu"),
         randn(n32, seed=seed + 1, device="cpu"), between(c32)),
        (f"a {m64}x{n64} tanh layer (float64)", tanh_layer(m64, n64, seed=seed + 2, device="cpu", dtype=F64),
         randn(n64, seed=seed + 3, device="cpu", dtype=F64), between(c64)),
        (f"a {m64}x{n64} tanh layer (float64)",
         tanh_layer(m64, n64, seed=seed + 4, device="cpu", dtype=F64), randn(n64, seed=seed + 5, device="cpu", dtype=F64),
         lambda m, peak: peak(m).bytes + 4096),
        (f"a {m32}x{n32} tanh layer (float32)",
         tanh_layer(m32, n32, seed=seed + 6, device="cpu"), randn(n32, seed=seed + 7, device="cpu"),
         lambda m, peak: peak(1).bytes - 4 * n32),
    ]


def _ask_chunk(largest_chunk: Callable, f, x: torch.Tensor, budget: int):
    """The learner's answer: an int, or ``ValueError`` (the class) when it raised one."""
    try:
        return call(largest_chunk, f, x, budget, name="largest_chunk")
    except AssertionError as exc:
        if isinstance(exc.__cause__, ValueError):
            return ValueError
        raise


def _chunk_text(c: int, p: _Peak) -> str:
    return (f"jacrev(f, chunk_size={c}) makes a tensor of {format_bytes(p.bytes)} at most ({p.shape}, made by "
            f"{p.op}) and runs {p.ops} ops")


CHUNK_DATA = "05_largest_chunk.pt"


def chunk_reference_data(seed: int = 0) -> dict:
    """The budgets and answers of :func:`check_largest_chunk`'s cases on ``seed``, by the grader's
    search: ``{"seed", "cases": [(budget, answer, or 0 when none fits), ...]}``, in the cases' order."""
    from course.references.jacobians import largest_fitting_chunk

    cases = []
    for _, f, x, budget_of in _chunk_cases(seed):
        m, peak = f(x).numel(), _peaks(f, x)
        budget = int(budget_of(m, peak))
        cases.append((budget, largest_fitting_chunk(lambda c: peak(c).bytes, m, budget) or 0))
    return {"seed": seed, "cases": cases}


def _peaks(f: Callable, x: torch.Tensor) -> Callable[[int], _Peak]:
    return functools.lru_cache(maxsize=None)(lambda c: _chunk_peak(f, x, c))


def check_largest_chunk(largest_chunk: Callable, *, seed: int = 0) -> None:
    """``largest_chunk(f, x, budget_bytes)``: the largest ``chunk_size`` in ``1..m`` (``m``: the number
    of outputs) for which no tensor that ``jacrev(f, chunk_size=c)(x)`` makes is larger than
    ``budget_bytes``; ``ValueError`` when not even ``chunk_size=1`` fits. The answer is an int,
    compared with the grader's own search (in a learner's copy, with the answers stored for the
    visible call), and what the learner's chunk makes is measured by the checker's TensorWatch:
    outputs on inputs the grader chose, nothing taken on trust from the learner's process."""
    refs = grader_references("jacobians")
    answers = (chunk_reference_data(seed) if refs is not None else stored_answers(CHUNK_DATA, seed=seed))["cases"]
    cases = _chunk_cases(seed)
    gots, wants = [], []  # the answers (0: ValueError), for the grading parent to compare again
    for (label, f, x, _), (budget, want) in zip(cases, answers):
        m = f(x).numel()
        peak = _peaks(f, x)
        wants.append(want)
        want = want or None
        got = _ask_chunk(largest_chunk, f, x, budget)
        gots.append(0 if got is ValueError else got)
        where = f"for {label} and a budget of {budget:,} bytes ({format_bytes(budget)})"
        itemsize = x.element_size()
        if want is None:
            if got is ValueError:
                continue
            floor = peak(1)
            raise AssertionError(
                f"largest_chunk returned {describe(got)} {where}, but no chunk fits: even {_chunk_text(1, floor)}. "
                f"That tensor is the Jacobian itself ({m} x {x.numel()} numbers of {itemsize} bytes): chunks "
                "make the cotangents smaller, never the result.\n  Hint: when chunk_size=1 does not fit, raise "
                "ValueError (with a message that says so).")
        if got is ValueError:
            raise AssertionError(f"largest_chunk raised ValueError {where}, but chunk_size={want} fits: "
                                 f"{_chunk_text(want, peak(want))}.")
        if isinstance(got, bool) or not isinstance(got, int):
            raise AssertionError(f"largest_chunk should return an int (a chunk_size), got {describe(got)} {where}.")
        if not 1 <= got <= m:
            raise AssertionError(f"largest_chunk returned {got} {where}; a chunk_size is between 1 and m = {m}, the "
                                 f"number of outputs (chunk_size={m} is every row at once).")
        if peak(got).bytes > budget:
            hint = ""
            if itemsize == 8 and got <= 2 * want + 1 and peak(max(1, got // 2)).bytes <= budget:
                hint = (f"\n  Hint: this Jacobian is {str(x.dtype).replace('torch.', '')}, {itemsize} bytes a number: "
                        "as if each took 4 bytes, a chunk twice too large fits. Measure, or use x.element_size().")
            raise AssertionError(f"largest_chunk returned {got} {where}, but {_chunk_text(got, peak(got))}: over "
                                 f"the budget. The largest that fits is {want}.{hint}")
        if got < want:
            hint = ("\n  Hint: any integer is a chunk size, not only powers of two." if got & (got - 1) == 0
                    else "\n  Hint: measure the peak with TensorWatch and search for the largest chunk that fits.")
            fewer = (f"against {peak(got).ops} ops for chunk_size={got}: the largest chunk that fits runs the fewest "
                     "ops" if peak(got).ops > peak(want).ops else
                     f"as many ops as chunk_size={got} here (both take {-(-m // want)} chunks), but the question asks "
                     "for the largest that fits")
            raise AssertionError(f"largest_chunk returned {got} {where}; it fits, but so does {want}: "
                                 f"{_chunk_text(want, peak(want))}, {fewer}.{hint}")
    record(gots, wants, "largest_chunk's chunk sizes")
    ok(f"largest_chunk finds the largest chunk_size under the budget on {len(cases)} cases (float32, float64, "
       f"room for all of it, and none that fits; seed {seed})")


# -- jacfwd or jacrev -----------------------------------------------------------------------------

class _Flat:
    """A TanhLayer read on a flattened input and reshaped output: shapes other than vectors."""

    def __init__(self, layer: TanhLayer, out_shape: tuple[int, ...]):
        self.layer, self.out_shape = layer, out_shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.reshape(-1)).reshape(self.out_shape)


@recipe
def flat_layer(layer: TanhLayer, out_shape: tuple[int, ...]) -> _Flat:
    """A ``TanhLayer`` on flattened inputs with outputs of shape ``out_shape`` (crosses as a recipe)."""
    return _Flat(layer, tuple(out_shape))


def _picker_cases(seed: int):
    """(f, x, n_out, n_in): tall, wide, square and nearly square, single row or column, and
    inputs/outputs that are not vectors (count elements, not the first dimension)."""
    shapes = [(2048, 32), (32, 2048), (5, 5), (1, 7), (7, 1), (33, 32), (32, 33), (64, 64)]
    cases, cpu = [], "cpu"  # the picker reads shapes: where the tensors live does not matter
    for i, (m, n) in enumerate(shapes):
        cases.append((tanh_layer(m, n, seed=seed + i, device=cpu), randn(n, seed=seed + 50 + i, device=cpu), m, n))
    # x of shape (3, 4): 12 inputs; outputs (2, 7) = 14 (more than the inputs, though 2 < 3)
    cases.append((flat_layer(tanh_layer(14, 12, seed=seed, device=cpu), (2, 7)), randn(3, 4, seed=seed + 90, device=cpu),
                  14, 12))
    # x of shape (6, 2): 12 inputs; outputs (10, 1) = 10 (fewer, though 10 > 6)
    cases.append((flat_layer(tanh_layer(10, 12, seed=seed + 1, device=cpu), (10, 1)),
                  randn(6, 2, seed=seed + 91, device=cpu), 10, 12))
    return cases


def _right_mode(n_out: int, n_in: int):
    return jacfwd if n_out > n_in else jacrev


def _mode_name(mode) -> str:
    return {jacfwd: "jacfwd", jacrev: "jacrev"}.get(mode, describe(mode))


def _pick(pick_jacobian: Callable, f, x):
    got = call(pick_jacobian, f, x.clone(), name="pick_jacobian")
    if isinstance(got, str):
        raise AssertionError(f"pick_jacobian returned the string {got!r}; return the transform itself: "
                             "torch.func.jacfwd or torch.func.jacrev (the functions, not their names).")
    if got is not jacfwd and got is not jacrev:
        extra = ""
        if callable(got) and getattr(got, "__name__", "") in ("jacfwd", "jacrev"):
            extra = " It has the right name but is another object: use the ones from torch.func, not functorch."
        raise AssertionError(f"pick_jacobian returned {describe(got)}; it should return torch.func.jacfwd or "
                             f"torch.func.jacrev (not yet applied to f).{extra}")
    return got


def check_pick_jacobian(pick_jacobian: Callable, *, seed: int = 0) -> None:
    """``pick_jacobian(f, x)`` returns ``torch.func.jacfwd`` when ``f(x)`` has more elements than
    ``x`` and ``torch.func.jacrev`` otherwise (square included), on tall, wide, square and
    non-vector shapes."""
    cases = _picker_cases(seed)
    picks, rights = [], []
    for f, x, n_out, n_in in cases:
        got = _pick(pick_jacobian, f, x)
        right = _right_mode(n_out, n_in)
        picks.append(_mode_name(got))
        rights.append(_mode_name(right))
        if got is not right:
            why = ("more outputs than inputs: forward mode needs one JVP per input, reverse mode one VJP per output, "
                   "so jacfwd does fewer passes" if right is jacfwd else
                   "no more outputs than inputs: reverse mode needs one VJP per output, forward mode one JVP per "
                   "input, so jacrev does no more passes (and on a tie the course takes jacrev)")
            raise AssertionError(
                f"for x of shape {tuple(x.shape)} ({n_in} inputs) and f(x) of shape {tuple(f(x).shape)} ({n_out} "
                f"outputs), pick_jacobian chose {_mode_name(got)}; expected {_mode_name(right)}: {why}.\n"
                "  Hint: compare numbers of elements (.numel()), not the first dimension.")
    record(picks, rights, "pick_jacobian's choices")
    ok(f"pick_jacobian chooses right on {len(cases)} shapes (tall, wide, square, and not vectors)")


def _parameter_case(seed: int, n_out: int, n_in: int, device, dtype: torch.dtype) -> tuple[TanhLayer, torch.Tensor]:
    return (tanh_layer(n_out, n_in, seed=seed, device=device, dtype=dtype),
            randn(n_in, seed=seed + 10, device=device, dtype=dtype))


def _parameter_answers(refs, seed: int, *, n_out: int, n_in: int) -> list:
    """Per dtype, in float64: ``(J_w, J_b, J_x)``, the last (with respect to x) to name a mistake."""
    out = []
    for dtype in DTYPES:
        layer, x = (a.to(F64) for a in _parameter_case(seed, n_out, n_in, "cpu", dtype))
        out.append((*refs.tanh_parameter_jacobians(layer, x), refs.tanh_jacobian(layer, x)))
    return out


def _parameter_mistake(got, j_w: torch.Tensor, j_b: torch.Tensor, j_x: torch.Tensor) -> str | None:
    """What a wrong answer of ``parameter_jacobians`` is, where its result gives it away."""
    def same(a, b) -> bool:
        return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a.to(b), b, rtol=1e-5, atol=1e-7)

    grad_w = j_w.sum(0)
    if isinstance(got, torch.Tensor):
        if same(got, j_w):
            return ("it returned one tensor, the Jacobian with respect to the weight alone: jacrev differentiates "
                    "with respect to argument 0 unless told otherwise. argnums=(0, 1) returns a tuple, one Jacobian "
                    "per argument")
        if same(got, j_x):
            return ("it returned the Jacobian with respect to x: argnums counts the function's arguments by "
                    "position, here (weight, bias, x), so the weight is 0 and the bias 1")
        if same(got, grad_w):
            return ("it returned the gradient of the outputs' sum with respect to the weight (what backward() "
                    "gives): a Jacobian keeps one slice per output, (n_out, *weight.shape)")
        return None
    if isinstance(got, (tuple, list)):
        if len(got) == 2 and same(got[0], j_b) and same(got[1], j_w):
            return "it returned (bias, weight); the order of argnums is the order of the results: (0, 1)"
        if len(got) == 3:
            return ("it returned three Jacobians: x's too (argnums=(0, 1, 2)); the exercise asks for the "
                    "parameters' only, argnums=(0, 1)")
        if len(got) == 2 and same(got[0], grad_w):
            return ("it returned gradients of the outputs' sum (what backward() gives), not Jacobians: a Jacobian "
                    "keeps one slice per output, (n_out, *weight.shape) and (n_out, *bias.shape)")
        if len(got) == 2 and same(got[0], j_x):
            return "its first Jacobian is the one with respect to x: argnums counts positions, weight 0, bias 1"
    return None


def check_parameter_jacobians(parameter_jacobians: Callable, *, seed: int = 0, n_out: int = 5, n_in: int = 7,
                              device=None) -> None:
    """``parameter_jacobians(weight, bias, x) -> (J_w, J_b)``: the Jacobians of
    ``tanh(F.linear(x, weight, bias))`` with respect to the weight, ``(n_out, n_out, n_in)``, and
    the bias, ``(n_out, n_out)``, equal to the formula
    (:func:`course.references.jacobians.tanh_parameter_jacobians`) in float64 and float32; the
    inputs left alone."""
    dev = pick_device(device)
    hint = ("def predict(weight, bias, x): return torch.tanh(F.linear(x, weight, bias)); then "
            "jacrev(predict, argnums=(0, 1))(weight, bias, x) returns (J_w, J_b).")
    answers = _answers(_parameter_answers, seed, n_out=n_out, n_in=n_in)
    for dtype, (j_w, j_b, j_x) in zip(DTYPES, answers):
        layer, x = _parameter_case(seed, n_out, n_in, dev, dtype)
        args = (layer.weight.clone(), layer.bias.clone(), x.clone())
        with mirrored(parameter_jacobians):
            got = call(parameter_jacobians, *args, name="parameter_jacobians")
        for what, before, after in zip(("weight", "bias", "x"), (layer.weight, layer.bias, x), args):
            if not torch.equal(before, after):
                raise AssertionError(f"parameter_jacobians changed its input {what} in place; leave the inputs "
                                     "alone.")
        mistake = _parameter_mistake(got, j_w, j_b, j_x)
        if mistake:
            raise AssertionError(f"parameter_jacobians is wrong: {mistake}.\n  Hint: {hint}")
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise AssertionError(f"parameter_jacobians should return a pair (J_w, J_b), got {describe(got)}.\n"
                                 f"  Hint: {hint}")
        label = str(dtype).replace("torch.", "")
        for name, g, ref, arg in (("J_w", got[0], j_w, layer.weight), ("J_b", got[1], j_b, layer.bias)):
            shape = (n_out, *arg.shape)
            _expect_tensor(g, f"parameter_jacobians' {name}", x, shape,
                           f"a Jacobian has the outputs' shape, then the argument's: ({n_out}, "
                           f"{', '.join(map(str, arg.shape))}). {hint}")
            _compare(g, ref, f"parameter_jacobians' {name} (a {n_out}x{n_in} layer, {label})", dtype, hint)
    ok(f"parameter_jacobians equals the formula for the weight and the bias, in float64 and float32 "
       f"({n_out}x{n_in}, seed {seed})")


def check_picker_speed(pick_jacobian: Callable, *, bars: Mapping[str, float], tall: tuple[int, int],
                       wide: tuple[int, int], seed: int = 0, num_threads: int | None = None, rounds: int = 7,
                       min_run_time: float = 0.1, attempts: int = 3, device=None) -> dict[str, SpeedReport]:
    """On a tall layer (``tall = (outputs, inputs)``, more outputs) and a wide one, the transform
    ``pick_jacobian`` chooses is the right one, and is faster than the other by the device's bar,
    timed side by side, every Jacobian compared with the float64 formula (in a learner's copy, which has
    none, with torch's own reverse mode in float64: what is timed is torch.func, not the learner's code)."""
    dev = pick_device(device)
    refs = grader_references("jacobians")
    exact_jacobian = refs.tanh_jacobian if refs is not None else lambda f, x: jacrev(f)(x)
    if not tall[0] > tall[1] or not wide[0] < wide[1]:
        raise ValueError(f"tall must have more outputs than inputs and wide fewer, got tall={tall}, wide={wide}.")
    reports = {}
    bar = speed_bar(bars, dev)
    for label, (m, n) in (("tall", tall), ("wide", wide)):
        layer = tanh_layer(m, n, seed=seed, device=dev)
        exact = layer.to(F64)
        chosen = _pick(pick_jacobian, layer, randn(n, seed=seed + 1, device=dev))
        right = _right_mode(m, n)
        if chosen is not right:
            raise AssertionError(f"on the {label} {m}x{n} layer (outputs x inputs) pick_jacobian chose "
                                 f"{_mode_name(chosen)}; the right mode is {_mode_name(right)}.")
        other = jacrev if chosen is jacfwd else jacfwd
        picked_name, other_name = f"picked: {_mode_name(chosen)}", f"other: {_mode_name(other)}"
        fast, slow = chosen(layer), other(layer)
        counter = iter(range(10**9))

        def inputs(n=n):
            return (randn(n, seed=seed + 200 + next(counter), device=dev),)

        def check(name, out, args, exact=exact, label=label):
            _compare(out, exact_jacobian(exact, args[0].to(F64)), f"{name} on the {label} layer while timing",
                     torch.float32, "both modes compute the same Jacobian.")

        print(f"{label} layer: {m} outputs x {n} inputs")
        report = _measure({other_name: slow, picked_name: fast}, inputs, check, picked_name, other_name, bar, rounds,
                          min_run_time, attempts, dev, num_threads)
        report.show()
        # both sides are torch.func's transforms, timed here: the learner's code only chose one, so no
        # ratio is implausible (the instructor's own notebook was flagged at 14.5x against its
        # transcript's 3.65x, CI 2026-11-29: the machine's load, nothing cached)
        expect_speedup(report, picked_name, over=other_name, bars=bars, trusted=True,
                       hint="the picker chooses from the shapes; the chosen transform must do fewer passes.")
        reports[label] = report
    return reports


# -- batched Jacobians and Hessians ---------------------------------------------------------------

def _batch(seed: int, batch: int, n_in: int, device, dtype: torch.dtype) -> torch.Tensor:
    return randn(batch, n_in, seed=seed + 20, device=device, dtype=dtype)


def _per_sample(exact: Callable, f, xs: torch.Tensor) -> torch.Tensor:
    """``exact(f, x)`` (a formula of the references) for every sample of ``xs``, in float64."""
    f64 = f.to(F64)
    return torch.stack([exact(f64, x) for x in xs.to(F64)])


def _batched_numerics(fn: Callable, name: str, make: Callable, n_in: int, answers: list, seed: int, batch: int,
                      device, hint: str) -> None:
    """``fn(make(dtype, device), xs)`` against ``answers``, one per dtype of :data:`DTYPES`."""
    dev = pick_device(device)
    for dtype, ref in zip(DTYPES, answers):
        xs = _batch(seed, batch, n_in, dev, dtype)
        got = call(fn, make(dtype, dev), xs.clone(), name=name)
        label = f"{name} on a batch of {batch} ({str(dtype).replace('torch.', '')})"
        _expect_tensor(got, label, xs, tuple(ref.shape), hint)
        _compare(got, ref, label, dtype, hint)


def _no_batch_loop(fn: Callable, name: str, f, n_in: int, seed: int, loop: Callable,
                   fix: str = "Wrap the per-sample transform in vmap instead.") -> _Growth:
    """``loop(f, xs)`` is the course's loop over the samples (:func:`_course_loop`), the yardstick
    under the grader."""
    # 512 samples: the course's loop takes about 120 ms, far more than a crossing of the boundary
    # (on a machine busy with other work, a right answer's 0.5 ms call took 35 ms to cross; beside a
    # 30 ms loop of 128 samples that read as a loop)
    g = _growth(fn, name, lambda b, fresh=0: (f, randn(b, n_in, seed=seed + b + fresh, device="cpu")), (2, 8), (4, 512),
                loop=loop)
    _expect_no_loop(g, f"{name} {g.text('samples')}",
                    f": a Python loop over the samples. {fix}")
    return g


def _batched_jacobian_answers(refs, seed: int, *, batch: int, n_out: int, n_in: int) -> list:
    """Per dtype, the ``(B, m, n)`` Jacobians of :func:`check_batched_jacobian`'s batch, in float64."""
    return [_per_sample(refs.tanh_jacobian, tanh_layer(n_out, n_in, seed=seed, device="cpu", dtype=dtype),
                        _batch(seed, batch, n_in, "cpu", dtype)) for dtype in DTYPES]


def check_batched_jacobian(batched_jacobian: Callable, *, seed: int = 0, batch: int = 6, n_out: int = 5,
                           n_in: int = 7, device=None) -> None:
    """``batched_jacobian(f, xs)``: for a batch ``xs`` of shape ``(B, n)``, the Jacobian of ``f``
    at every sample, ``(B, m, n)``, with ``vmap`` (no loop over the samples)."""
    hint = "vmap(jacrev(f))(xs): jacrev(f) takes one sample, vmap maps it over the batch dimension."
    answers = _answers(_batched_jacobian_answers, seed, batch=batch, n_out=n_out, n_in=n_in)
    _batched_numerics(batched_jacobian, "batched_jacobian",
                      lambda dtype, dev: tanh_layer(n_out, n_in, seed=seed, device=dev, dtype=dtype), n_in, answers,
                      seed, batch, device, hint)
    g = _no_batch_loop(batched_jacobian, "batched_jacobian", tanh_layer(n_out, n_in, seed=seed, device="cpu"), n_in,
                       seed, _course_loop())
    ok(f"batched_jacobian equals the float64 formula for every sample ({batch} x {n_out} x {n_in}, seed {seed}), "
       f"with no loop over the batch: it {g.text('samples')}")


def _sum_trick_shape(got, name: str, batch: int, n_out: int, n_in: int) -> None:
    """The shapes the usual slips of the summation trick leave, named."""
    want = (batch, n_out, n_in)
    shape = tuple(got.shape) if isinstance(got, torch.Tensor) else None
    named = {
        (n_out, batch, n_in): "the batch dimension is in the middle, where the Jacobian of the summed outputs puts "
                              "it: (outputs, batch, inputs). Move it to the front (movedim).",
        (batch, n_out, batch, n_in): "that is the Jacobian of the whole batch's outputs with respect to the whole "
                                     "batch, (B, m, B, n), every sample against every other (mostly zeros). Sum "
                                     "the outputs over the batch first: one (m, B, n) Jacobian.",
        (batch, n_in): "that is a gradient, one number differentiated: the outputs were summed over every "
                       "dimension (.sum()). Sum over the batch only, .sum(0), and keep the m outputs.",
        (n_in, batch): "that is a gradient (one number differentiated: the outputs were summed over every "
                       "dimension, .sum()), with its dimensions swapped. Sum over the batch only, .sum(0).",
        (n_out, n_in): "that is one Jacobian, not one per sample.",
    }
    if shape is not None and len(shape) == 4 and sorted(shape) == sorted((batch, n_out, batch, n_in)):
        shape = (batch, n_out, batch, n_in)  # the whole batch's Jacobian, its dimensions moved or not
    if shape != want:
        why = named.get(shape, "") if shape is not None else ""
        raise AssertionError(f"{name} returned {describe(got)}; expected shape {want}, (batch, outputs, inputs)."
                             + (f"\n  Hint: {why}" if why else ""))


def _sum_cases(seed: int, batch: int, n_out: int, n_in: int, device) -> list[tuple[str, Callable, torch.Tensor]]:
    """(label, f, xs): a tanh layer in float64 and float32, and a layer with a BatchNorm1d in eval mode."""
    dev = pick_device(device)
    cases = [(f"a {n_out}x{n_in} tanh layer ({str(dtype).replace('torch.', '')})",
              tanh_layer(n_out, n_in, seed=seed, device=dev, dtype=dtype), _batch(seed, batch, n_in, dev, dtype))
             for dtype in DTYPES]
    cases.append((f"a {n_out}x{n_in} layer with a BatchNorm1d in eval mode (float64)",
                  normed_layer(n_out, n_in, seed=seed + 1, device=dev, dtype=F64),
                  randn(batch, n_in, seed=seed + 21, device=dev, dtype=F64)))
    return cases


def _sum_answers(refs, seed: int, *, batch: int, n_out: int, n_in: int) -> list:
    """The ``(B, m, n)`` Jacobians of each of :func:`_sum_cases`, in float64."""
    (_, layer64, xs64), (_, layer32, xs32), (_, normed, xs) = _sum_cases(seed, batch, n_out, n_in, "cpu")
    return [_per_sample(refs.tanh_jacobian, layer64, xs64), _per_sample(refs.tanh_jacobian, layer32, xs32),
            refs.normed_batched_jacobian(normed, xs)]


def check_batched_jacobian_sum(batched_jacobian_sum: Callable, *, seed: int = 0, batch: int = 5, n_out: int = 4,
                               n_in: int = 6, device=None) -> None:
    """``batched_jacobian_sum(f, xs)``: for ``f`` a function of a batch whose samples do not mix,
    the Jacobian at every sample, ``(B, m, n)``, by the summation trick: one Jacobian of the
    outputs summed over the batch. The cases: a tanh layer in float64 and float32, and a layer
    with a ``BatchNorm1d`` in eval mode, which refuses a single sample (``vmap`` cannot run it);
    no loop over the samples (op counts, or the grader's clock)."""
    name = "batched_jacobian_sum"
    hint = ("take one Jacobian, of the outputs summed over the batch (f(xs).sum(0)) with respect to xs; it comes "
            "back as (outputs, batch, inputs): move the batch dimension to the front.")
    cases = _sum_cases(seed, batch, n_out, n_in, device)
    answers = _answers(_sum_answers, seed, batch=batch, n_out=n_out, n_in=n_in)
    for (label, f, xs), ref in zip(cases, answers):
        title = f"{name} on a batch of {batch} through {label}"
        got = call(batched_jacobian_sum, f, xs.clone(), name=title)
        _sum_trick_shape(got, title, batch, n_out, n_in)
        _expect_tensor(got, title, xs, (batch, n_out, n_in), hint)
        _compare(got, ref, title, xs.dtype, hint, variants={
            "the outputs were averaged over the batch (.mean(0)): every Jacobian is divided by the batch size; "
            "sum them": ref / batch})
    g = _no_batch_loop(batched_jacobian_sum, name, normed_layer(n_out, n_in, seed=seed + 1, device="cpu"), n_in,
                       seed, _course_loop(of_batch=True),
                       fix="One Jacobian of the outputs summed over the batch does every sample at once.")
    ok(f"{name} equals the float64 formula for every sample ({batch} x {n_out} x {n_in}, seed {seed}), BatchNorm "
       f"layer included, with no loop over the batch: it {g.text('samples')}")


def _batched_hessian_answers(refs, seed: int, *, batch: int, n: int) -> list:
    """Per dtype, the ``(B, n, n)`` Hessians of :func:`check_batched_hessian`'s batch, in float64."""
    return [_per_sample(refs.energy_hessian, energy(n, seed=seed, device="cpu", dtype=dtype),
                        _batch(seed, batch, n, "cpu", dtype)) for dtype in DTYPES]


def check_batched_hessian(batched_hessian: Callable, *, seed: int = 0, batch: int = 6, n: int = 9,
                          device=None) -> None:
    """``batched_hessian(f, xs)``: for a scalar ``f`` and a batch ``xs`` of shape ``(B, n)``, the
    Hessian at every sample, ``(B, n, n)``, with ``vmap`` (no loop over the samples)."""
    hint = "vmap(hessian(f))(xs), where hessian(f) = jacfwd(jacrev(f)) takes one sample."
    answers = _answers(_batched_hessian_answers, seed, batch=batch, n=n)
    _batched_numerics(batched_hessian, "batched_hessian",
                      lambda dtype, dev: energy(n, seed=seed, device=dev, dtype=dtype), n, answers, seed, batch,
                      device, hint)
    g = _no_batch_loop(batched_hessian, "batched_hessian", energy(n, seed=seed, device="cpu"), n, seed,
                       _course_loop(hessian=True))
    ok(f"batched_hessian equals the float64 formula for every sample ({batch} x {n} x {n}, seed {seed}), "
       f"with no loop over the batch: it {g.text('samples')}")


# -- Hessian-vector products ----------------------------------------------------------------------

def _hvp_case(seed: int, n: int, device, dtype: torch.dtype) -> tuple:
    """(energy, x, v) of :func:`check_hvp`."""
    return (energy(n, seed=seed, device=device, dtype=dtype), randn(n, seed=seed + 30, device=device, dtype=dtype),
            randn(n, seed=seed + 31, device=device, dtype=dtype))


def _hvp_answers(refs, seed: int, *, n: int) -> list:
    """Per dtype, in float64: ``H(x) @ v``, and ``H(x) @ ones`` (what an HVP that lost v returns)."""
    out = []
    for dtype in DTYPES:
        e, x, v = (a.to(F64) for a in _hvp_case(seed, n, "cpu", dtype))
        out.append((refs.energy_hvp(e, x, v), refs.energy_hvp(e, x, torch.ones_like(x))))
    return out


@prober
def hvp_modes_case(fn: Callable, label: str, e, x: torch.Tensor, v: torch.Tensor) -> dict:
    """``fn(e, x, v)`` on a watched energy (:class:`course.jacobians.WatchedEnergy`): what it returned,
    and how each evaluation of ``e`` was differentiated (:data:`course.jacobians.MODES_SEEN`)."""
    from course import jacobians

    del jacobians.MODES_SEEN[:]
    got = call(fn, e, x, v, name=label)
    seen = [list(levels) for levels in jacobians.MODES_SEEN]
    del jacobians.MODES_SEEN[:]
    return {"hv": got.detach() if isinstance(got, torch.Tensor) else None, "seen": seen}


#: What each HVP must do to ``f``, as its message says it.
HVP_MODES = {
    "hvp_fwd_rev": ("push v forward through a reverse-mode gradient: jvp(grad(f), (x,), (v,)), where f is evaluated "
                    "under a forward-mode level that holds a reverse-mode one (forward AD's duals through "
                    "torch.autograd.grad count too)"),
    "hvp_rev_rev": ("take the gradient of a gradient: grad(lambda y: torch.dot(grad(f)(y), v))(x), where f is "
                    "evaluated under two reverse-mode levels and no forward mode (torch.autograd.grad twice, with "
                    "create_graph=True, counts too)"),
}


def _modes_text(seen: list) -> str:
    if not seen:
        return "never evaluated f (a formula written out from f's parts does not differentiate it)"
    kinds = sorted({" over ".join(levels) or "no differentiation" for levels in seen})
    return f"evaluated f {len(seen)} time(s), differentiated by {'; '.join(kinds)}"


def _hvp_modes(fn: Callable, name: str, seed: int, n: int, device, exercise: str) -> None:
    """``fn`` computes H @ v the way its name says (:data:`HVP_MODES`), on a watched energy of ``n``
    variables in float64: the levels around its evaluations of ``f`` those of its mode, and its
    result that of the energy differentiated so at ``x``. The energy carries a mark drawn afresh
    here (:class:`course.jacobians.HvpMark`): a second derivative at ``x`` that only an evaluation
    in the exercise's mode sees, so a value computed otherwise beside a call of the right transform
    (finite differences, a formula, the other mode) misses it. Where ``fn`` runs (the learner's
    process: its word; the program host, on the program the judge read: out of the learner's reach)."""
    refs = grader_references("jacobians")
    mark = (exercise, seed + 30, int.from_bytes(os.urandom(4), "big"))  # unknown to any earlier run
    e = energy(n, seed=seed, device=device, dtype=F64, watched=True, mark=mark)
    x, v = (randn(n, seed=seed + s, device=device, dtype=F64) for s in (30, 31))
    got = probe(fn, hvp_modes_case, name, e, x, v)
    if not isinstance(got, dict) or not isinstance(got.get("seen"), list) or \
            not all(isinstance(lv, list) and all(m in ("forward", "reverse") for m in lv) for lv in got["seen"]):
        raise AssertionError(f"{name}: the watch of how it differentiated f came back malformed ({describe(got)}).")
    if not hvp_run_matches(exercise, got["seen"]):
        raise AssertionError(
            f"{name} {_modes_text(got['seen'])}. {exercise} must {HVP_MODES[exercise]}. The same H @ v by finite "
            "differences, by a formula written out, or by the other exercise's mode is not this exercise's answer.")
    hv = got.get("hv")
    _expect_tensor(hv, f"{name} on a watched Energy of {n} variables (float64)", x, (n,), "H(x) @ v has the shape of x.")
    if refs is None:
        return
    plain = refs.energy_hvp(e.to(F64), x, v)
    if torch.allclose(hv.to(F64), plain, **TOL64):
        raise AssertionError(
            f"{name} returned H(x) @ v, but not the value its own differentiation of f at x gave. The grader's "
            f"energy had, at x exactly, second derivatives that only f evaluated there and differentiated as "
            f"{exercise} says sees (value and gradient unchanged): a result computed another way (finite "
            "differences, a formula, the other mode) beside a call of the right transform misses them. Return "
            "the output of the call that differentiates f.")
    # The mark's share taken off here, so that what is compared (and recorded) is the same in every run.
    assert_close(hv.to(F64) - e.mark.hv(v), plain, name=f"{name} on a watched Energy (float64)", **TOL64)


def check_hvp(hvp_fwd_rev: Callable, hvp_rev_rev: Callable, *, seed: int = 0, n: int = 50, big_n: int = 40_000,
              device=None) -> None:
    """``hvp_fwd_rev(f, x, v)`` and ``hvp_rev_rev(f, x, v)`` return ``H(x) @ v`` for a scalar ``f``:
    equal to the float64 formula (float64 and float32), and, run at ``n = big_n`` in float64 on
    the ``meta`` device, never creating a tensor anywhere near ``n x n``."""
    dev = pick_device(device)
    answers = _answers(_hvp_answers, seed, n=n)
    for fn, name, hint in (
            (hvp_fwd_rev, "hvp_fwd_rev", "forward over reverse: torch.func.jvp(grad(f), (x,), (v,)) returns "
                                         "(gradient, H @ v); take the second."),
            (hvp_rev_rev, "hvp_rev_rev", "reverse over reverse: the gradient of x -> dot(grad(f)(x), v) is H @ v "
                                         "(H is symmetric): grad(lambda x: torch.dot(grad(f)(x), v))(x).")):
        for dtype, (ref, hv_ones) in zip(DTYPES, answers):
            e, x, v = _hvp_case(seed, n, dev, dtype)
            got = call(fn, e, x.clone(), v.clone(), name=name)
            label = f"{name} on an Energy of {n} variables ({str(dtype).replace('torch.', '')})"
            _expect_tensor(got, label, x, (n,), "H(x) @ v has the shape of x.")
            _compare(got, ref, label, dtype, hint, variants={
                "it returned the gradient (jvp's first output is grad f(x); H @ v is the second)":
                    torch.func.grad(e.to(F64))(x.to(F64)),
                "v never reached the result (it is H(x) @ ones, the gradient of grad(f)(x).sum())": hv_ones})
        if is_remote(fn):  # the kernel's count first: it fails a built Hessian outright, where a busy
            _hvp_memory(fn, name)  # machine can leave the clock undecided (a closed form sits near its bar)
        else:
            _never_builds_the_hessian(fn, name, seed, big_n)
        # How f was differentiated: where the answer runs (under the grader, the learner's process's
        # word), then on its program, read by the judge and run again in the program host.
        _hvp_modes(fn, name, seed, min(n, 64), dev, name)
        again(fn, name, lambda program, label: _hvp_modes(program, label, seed, min(n, 64), dev, name))
        if is_remote(fn):
            _hvp_growth(fn, name, seed)
    if is_remote(hvp_fwd_rev):
        ok(f"hvp_fwd_rev and hvp_rev_rev equal the float64 formula (n={n}, seed {seed}); at n={HVP_SIZES[1]:,} "
           "each takes a fraction of the time of building the Hessian")
        return
    full = big_n * big_n * 8
    ok(f"hvp_fwd_rev and hvp_rev_rev equal the float64 formula (n={n}, seed {seed}); at n={big_n:,} in float64 "
       f"(a Hessian of {format_bytes(full)}) neither builds anything near n x n")


#: Each visible check with stored answers, and the function of its answers (:func:`reference_data`).
_VISIBLE = {check_row_jacobian: _row_answers, check_parameter_jacobians: _parameter_answers,
            check_batched_jacobian: _batched_jacobian_answers, check_batched_hessian: _batched_hessian_answers,
            check_batched_jacobian_sum: _sum_answers, check_hvp: _hvp_answers}


#: The size at which the grader times a learner's HVP (float64), beside the Hessian built and
#: multiplied by v (the first is unused: a true HVP and a built Hessian are told apart at one size).
#: Above 2,048 a float64 Hessian is over 32 MiB, which glibc always maps afresh (its largest heap block
#: is 32 MiB): the kernel's count sees it during every timed call, however much of the heap is resident;
#: and the clock's comparison (1e-7) refuses a Hessian in float32, small enough for the heap.
HVP_SIZES = (250, 2100)

#: The clock's bars for an HVP beside the Hessian built and multiplied by v, as shares of the latter's
#: time: an HVP read 0.005-0.008 of it, a Hessian built by vmap over jvp of grad 1.0-1.13 (AMD EPYC,
#: served from a thread). The lessons' general bars (a third, and 0.8) left a Hessian built as the
#: course builds it undecided at 0.74 on a busy CI machine; these leave a margin of ten on the one side
#: and of two and a half on the other.
HVP_BARS = (0.1, 0.4)


def _hvp_growth(fn: Callable, name: str, seed: int) -> None:
    """Under the grader: the judge cannot see the tensors the learner's process creates, so it
    times the HVP beside the course's Hessian-times-v on the same energy (learner's process stopped
    meanwhile): an HVP takes at most a tenth of that time, one that builds the Hessian as torch.func
    does at least 0.4 (:data:`HVP_BARS`)."""
    def make(n, fresh=0):
        return (energy(n, seed=seed, device="cpu", dtype=F64), randn(n, seed=seed + 30 + fresh, dtype=F64, device="cpu"),
                randn(n, seed=seed + 31 + 2 * fresh, dtype=F64, device="cpu"))

    g = _growth(fn, name, make, HVP_SIZES, HVP_SIZES, loop=lambda f, x, v: torch.func.hessian(f)(x) @ v,
                bars=HVP_BARS, rtol=1e-7, atol=1e-9)
    # The kernel's count during every timed call too: an answer may not build the Hessian at the size
    # the clock times while it behaves at HVP_MEMORY_N (red team, round 18: a Hessian written out by hand
    # at every other size read 0.06 of the course's and passed the clock).
    if g.peak is not None:
        _expect_small(g.peak, name, HVP_SIZES[1], "during a call the grader timed")
    _expect_no_loop(g, f"{name} {g.text('variables').replace('loop over them', 'Hessian times v')}",
                    ": the work of building the Hessian (or something as large).\n  Hint: never call hessian, jacfwd "
                    "or jacrev here: push v through the derivative of the gradient (jvp of grad, or grad of a dot "
                    "product with v); every tensor then has the size of x.")


#: The size at which the grader reads the learner's memory around one HVP (float64): its Hessian
#: is 128 MiB, every tensor of an HVP the size of x (32 KiB).
HVP_MEMORY_N = 4096


def _hvp_memory(fn: Callable, name: str) -> None:
    """Under the grader, the kernel's count: the peak resident memory of the learner's processes
    (``grader_hooks.learner_peak``, read by the grading parent from ``/proc``) may not grow by a
    quarter of the Hessian's size during one HVP at ``n = HVP_MEMORY_N``, on a fresh energy and
    point (a Hessian kept from an earlier call is no help). A Hessian built by any route, however
    fast (a closed form beats the clock of :func:`_hvp_growth`), makes its pages resident (the parent
    samples them during the call as well: a peak set back from native code is still seen). Read
    once per learner function, judged at every call (the hidden tests of the cell ask again), and
    before the clock: its verdict never waits on a quiet machine."""
    from course import grader_hooks

    if grader_hooks.learner_peak is None:
        return
    n = HVP_MEMORY_N
    grown = fn.__dict__.get("memory_reading")
    if grown is None:
        grown = fn.__dict__["memory_reading"] = _hvp_peak_growth(fn, name, n)
    _expect_small(grown, name, n, "during one call")


def _expect_small(grown: float, name: str, n: int, when: str) -> None:
    """The learner's peak resident memory grew by less than a quarter of a float64 Hessian at ``n``."""
    if grown >= n * n * 8 // 4:
        raise AssertionError(
            f"{name} built the Hessian (or something as large): {when} at n={n:,} in float64, the memory "
            f"of your notebook's process grew by {format_bytes(grown)}, as the operating system counts it; the "
            f"whole Hessian is {format_bytes(n * n * 8)}, and an HVP needs a few vectors the size of x.\n"
            "  Hint: never call hessian, jacfwd or jacrev here, nor write the Hessian out by hand: push v through "
            "the derivative of the gradient (jvp of grad, or grad of a dot product with v).")


def _hvp_peak_growth(fn: Callable, name: str, n: int) -> float:
    """Bytes by which the learner's peak resident memory grew during one call of ``fn`` at ``n``
    (after one call at that size first), its output checked."""
    import secrets

    from course import grader_hooks

    def fresh() -> tuple:
        return _hvp_case(secrets.randbits(31), n, "cpu", F64)

    call(fn, *fresh(), name=name)  # a first call at this size may set up what later calls reuse
    e, x, v = fresh()
    before = grader_hooks.learner_peak(True)
    got = call(fn, e, x, v, name=name)
    grown = grader_hooks.learner_peak(False) - before
    want = torch.func.jvp(torch.func.grad(e), (x,), (v,))[1]
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or not torch.allclose(got, want, rtol=1e-6,
                                                                                             atol=1e-8):
        raise AssertionError(f"{name} at n={n:,} in float64 returned {describe(got)}, not H(x) @ v.")
    return grown


def _never_builds_the_hessian(fn: Callable, name: str, seed: int, big_n: int) -> None:
    e = energy(big_n, seed=seed, device="meta", dtype=F64)
    x = torch.empty(big_n, device="meta", dtype=F64)
    v = torch.empty(big_n, device="meta", dtype=F64)
    full = big_n * big_n * 8
    try:
        with TensorWatch() as w:
            out = fn(e, x, v)
    except Exception as exc:  # noqa: BLE001 - any failure here is the learner's to read
        raise AssertionError(
            f"{name} ran correctly on real tensors, but failed on the 'meta' device (tensors with shapes and no "
            f"memory), where the check runs it at n={big_n:,}: {type(exc).__name__}: {str(exc)[:300]}\n"
            "  Hint: keep to torch operations on tensors (no .item(), .tolist(), .numpy() or Python numbers "
            "read from a tensor).") from exc
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (big_n,):
        raise AssertionError(f"{name} at n={big_n:,} returned {describe(out)}; expected a tensor of shape ({big_n},).")
    limit = full // 64
    if w.largest_bytes >= limit:
        raise AssertionError(
            f"{name} built the Hessian (or something as large): at n={big_n:,} in float64 it created a tensor of "
            f"shape {w.largest_shape} ({format_bytes(w.largest_bytes)}, by aten.{w.largest_op}). The whole "
            f"Hessian is {format_bytes(full)}, and this lesson runs in 2 GB.\n"
            "  Hint: never call hessian, jacfwd or jacrev here: push v through the derivative of the gradient "
            "(jvp of grad, or grad of a dot product with v); every tensor then has the size of x.")

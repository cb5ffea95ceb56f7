"""Measure callables side by side, in one process, interleaved, after warm-up.

    report = course.timing.compare({"eager": f, "compiled": g}, inputs=make_inputs)
    report.show()                      # a table: median time, spread, speedup over the baseline
    report.plot()                      # a bar chart
    report.speedup("compiled")         # Ratio(median=1.42, low=1.38, high=1.47)

Why this shape: a machine's speed drifts (other work, turbo, thermal), so a ratio measured from
two separate runs is mostly noise. Each round here times every candidate once, in a rotating
order, on the same fresh input values; the speedup is the median of the per-round ratios, and
its spread is reported beside it.

Honest by construction: in a round, each candidate runs a block of calls, every call on input
objects of its own (fresh values each round, and each candidate its own copies), so nothing
can be remembered from an earlier call, and the outputs checked are those of the timed calls
themselves (one per block, picked at random after the block). CUDA is synchronised before the
clock is read. A verdict uses :attr:`Ratio.bound`, a lower confidence bound of the median ratio
(an order statistic, 99% one-sided), not the median itself: a slower candidate does not pass on
a few lucky rounds. It fails only below :attr:`Ratio.ceiling`, the matching upper bound: a right
answer is not failed on a few unlucky rounds either. Between the two the verdict is open;
``until=`` adds rounds while it is, and what stays open is *undecided* (measure again), never a
pass.

Fair to both sides: while timing, C memory is held steady (:mod:`course.allocator`), so a call's
speed does not hang on what its process allocated and freed before.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch

from course import grader_hooks
from course.allocator import steady
from course.devices import pick_device, synchronize
from course.numerics import observing_paused

__all__ = ["Ratio", "SpeedReport", "best_times", "compare", "compare_served", "format_time", "machine_to_itself",
           "waited_for_cpu"]


def _waited(tids: Sequence[int | str]) -> float:
    """Seconds threads ``tids`` of this process have waited, ready to run, for a CPU, summed (the
    scheduler's count, the second field of each one's ``schedstat``); -1.0 where none is kept."""
    total, seen = 0, False
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as fh:
                total += int(fh.read().split()[1])
            seen = True
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9 if seen else -1.0


def _own_waited() -> float:
    """:func:`_waited` of the calling thread."""
    import threading

    return _waited([threading.get_native_id()])


def _process_waited() -> float:
    """:func:`_waited` of every live thread of this process."""
    import os

    try:
        return _waited(os.listdir("/proc/self/task"))
    except OSError:
        return -1.0


def waited_for_cpu() -> float:
    """Seconds spent so far waiting, ready to run, for a CPU by the threads a request and its reply pass
    through: the calling thread, and under the grader the learner's interpreter's main thread
    (``grader_hooks.learner_waited(main=True)``, the parent's count); -1.0 where either is not known.
    The difference of two readings is how much a busy machine held a measurement back: a check that
    times calls across the boundary can leave undecided a reading which only that waiting took out of
    its window (lesson 2's profiler), never pass it."""
    own = _own_waited()
    theirs = grader_hooks.learner_waited(main=True) if grader_hooks.learner_waited is not None else 0.0
    return own + theirs if min(own, theirs) >= 0 else -1.0


def machine_to_itself():
    """A context in which, under the autograder, no other submission runs (the timing turn that
    ``compare`` takes): for a check whose evidence is a measurement made some other way (lesson 2's
    profiler rows, measured by the learner's interpreter). Elsewhere it does nothing."""
    return grader_hooks.machine_turn()



def format_time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _bound_rank(n: int, alpha: float = 0.01) -> int:
    """The largest k (0-based) such that P(Binomial(n, 1/2) <= k) <= alpha: the k-th smallest of n
    per-round ratios is then a lower bound of their median at confidence 1 - alpha (-1: none)."""
    total, k = 0.0, -1
    for i in range(n + 1):
        total += math.comb(n, i) / 2**n
        if total > alpha:
            break
        k = i
    return k


@dataclass(frozen=True)
class Ratio:
    """A speedup (baseline time / candidate time: above 1 is faster) with its spread over rounds;
    ``bound`` and ``ceiling``: 99% lower and upper confidence bounds of the median (0 and infinity
    when too few rounds for one)."""

    median: float
    low: float
    high: float
    bound: float = 0.0
    ceiling: float = math.inf

    def verdict(self, bar: float) -> str:
        """``'pass'`` when the lower bound clears ``bar``, ``'fail'`` when even the upper bound is
        below it, else ``'undecided'``: these rounds cannot tell (a busy machine), measure again."""
        if self.bound >= bar:
            return "pass"
        return "fail" if self.ceiling < bar else "undecided"

    def __str__(self) -> str:
        return f"{self.median:.2f}x ({self.low:.2f}-{self.high:.2f})"

    def __float__(self) -> float:
        return self.median


def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    if len(values) < 4:
        return min(values), max(values)
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


@dataclass
class SpeedReport:
    """Per-round times of every candidate (seconds per call) and the speedups they give."""

    times: dict[str, list[float]]
    baseline: str
    device: str
    threads: int
    notes: list[str] = field(default_factory=list)
    #: The entry of ``times`` that is the course's own fast solution, timed beside the others as a
    #: witness of what a right answer costs now, on this machine, under its present load (None: none).
    witness: str | None = None
    #: Rounds counted although this process was starved of CPU in them (every round had already been
    #: measured again once): their ratios tell the machine's load, not the candidates, so no verdict of
    #: this report is "fail" (a starved run read a candidate 512 times lighter as 1.00x: 2026-12-03).
    starved: int = 0
    #: ``compare_served(net=True)``: the same rounds before netting (``times`` holds them net).
    gross: dict[str, list[float]] | None = None

    @property
    def names(self) -> list[str]:
        return list(self.times)

    def median(self, name: str) -> float:
        return statistics.median(self.times[self._known(name)])

    def speedup(self, name: str, over: str | None = None) -> Ratio:
        """How many times faster ``name`` is than ``over`` (default: the baseline)."""
        over = self._known(over or self.baseline)
        ratios = sorted(b / c for b, c in zip(self.times[over], self.times[self._known(name)]))
        low, high = _quartiles(ratios)
        k = _bound_rank(len(ratios))
        return Ratio(statistics.median(ratios), low, high, ratios[k] if k >= 0 else 0.0,
                     ratios[len(ratios) - 1 - k] if k >= 0 and not self.starved else math.inf)

    def _known(self, name: str) -> str:
        if name not in self.times:
            raise KeyError(f"No timing named {name!r}; this report has {self.names}.")
        return name

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for name, ts in self.times.items():
            low, high = _quartiles(ts)
            out.append({"name": name, "median_s": statistics.median(ts), "q1_s": low, "q3_s": high,
                        "speedup": self.speedup(name), "rounds": len(ts)})
        return out

    def table(self) -> str:
        w = max(22, 2 + max(len(n) for n in self.times))
        head = f"{'':<{w}}{'median':>11}{'spread (IQR)':>24}   speedup over {self.baseline}"
        lines = [head, "-" * len(head)]
        for r in self.rows():
            spread = f"{format_time(r['q1_s'])} - {format_time(r['q3_s'])}"
            lines.append(f"{r['name']:<{w}}{format_time(r['median_s']):>11}{spread:>24}   {r['speedup']}")
        threads = f"{self.threads} thread{'' if self.threads == 1 else 's'}"
        lines.append(f"({self.device}, {threads}, {len(next(iter(self.times.values())))} "
                     "interleaved rounds; speedup = median of per-round ratios, with quartiles; "
                     "verdicts use its 99% confidence bounds)")
        return "\n".join(lines + self.notes)

    def __repr__(self) -> str:
        parts = [f"{n} {format_time(self.median(n))}" + ("" if n == self.baseline else f" ({self.speedup(n).median:.2f}x)")
                 for n in self.times]
        return f"<SpeedReport on {self.device}: {', '.join(parts)}>"

    def show(self) -> "SpeedReport":
        print(self.table())
        return self

    def plot(self, ax=None, title: str | None = None, unit: str = "ms"):
        """A bar chart of median times with quartile whiskers, labelled with the speedup."""
        import matplotlib.pyplot as plt

        scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
        if ax is None:
            _, ax = plt.subplots(figsize=(1.6 + 1.3 * len(self.times), 3.2))
        rows = self.rows()
        med = [r["median_s"] * scale for r in rows]
        err = [[(r["median_s"] - r["q1_s"]) * scale for r in rows], [(r["q3_s"] - r["median_s"]) * scale for r in rows]]
        colors = ["#9e9e9e" if r["name"] == self.baseline else "#1f77b4" for r in rows]
        bars = ax.bar([r["name"] for r in rows], med, yerr=err, capsize=4, color=colors)
        for bar, r in zip(bars, rows):
            ax.annotate(f"{r['speedup'].median:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", xytext=(0, 3), textcoords="offset points")
        ax.set_ylabel(f"time per call ({unit})")
        ax.set_title(title or f"Speed on {self.device} (speedup over {self.baseline})")
        ax.margins(y=0.15)
        return ax


def _undecided(ratio: Ratio, bar: float) -> bool:
    """Whether more rounds may change the verdict on ``bar``: it lies between the lower and the
    upper confidence bound of the median."""
    return ratio.verdict(bar) == "undecided"


def _fresh(args):
    """Copies of ``args`` that share no tensor object with them (same values)."""
    if isinstance(args, torch.Tensor):
        return args.detach().clone().requires_grad_(args.requires_grad) if args.is_leaf else args.clone()
    if isinstance(args, tuple):
        return tuple(_fresh(a) for a in args)
    if isinstance(args, list):
        return [_fresh(a) for a in args]
    if isinstance(args, dict):
        return {k: _fresh(v) for k, v in args.items()}
    return args


def _nbytes(args) -> int:
    if isinstance(args, torch.Tensor):
        return args.numel() * args.element_size()
    if isinstance(args, (tuple, list)):
        return sum(_nbytes(a) for a in args)
    if isinstance(args, dict):
        return sum(_nbytes(a) for a in args.values())
    return 0


#: Most calls in one timed block, and most bytes of inputs prepared for one block.
MAX_BLOCK = 64
MAX_BLOCK_BYTES = 256 * 2**20


#: A timed block whose process got less CPU than this share of its wall time was starved (another
#: process held the core for most of it): on a CPU its round is measured again.
STARVED = 0.5


def _starved(wall: float, cpu: float | None, slack: float = 0.0) -> bool:
    """Whether a block of ``wall`` seconds that used ``cpu`` seconds of CPU (None: unknown, as on a
    GPU, whose calls wait rather than compute; ``slack``: the reading's rounding) spent most of its
    time waiting for a core."""
    return cpu is not None and wall > 0.02 and cpu + slack < STARVED * wall


def _expect_a_moving_clock() -> None:
    """A call measured at exactly zero: make sure ``time.perf_counter`` still moves (a notebook that
    replaced it would otherwise make every block of calls enormous, and the timing never end)."""
    t0 = time.perf_counter()
    time.sleep(0.002)
    if time.perf_counter() - t0 < 0.001:
        raise RuntimeError("time.perf_counter does not advance (was it replaced in this notebook?): nothing can "
                           "be timed. Restart the kernel and run the notebook from the top.")


def compare(candidates: Mapping[str, Callable[..., Any]], *, inputs: Callable[[], tuple] | None = None,
            baseline: str | None = None, rounds: int = 7, warmup: int = 2, min_run_time: float = 0.2,
            device: str | torch.device | None = None, progress: bool | None = None,
            check: Callable[[str, Any, tuple], None] | None = None,
            until: tuple[str, str, float] | None = None, max_rounds: int | None = None) -> SpeedReport:
    """Time every candidate in ``rounds`` interleaved rounds after ``warmup`` calls each.

    ``inputs()`` (optional) makes fresh arguments; every call gets objects of its own, and all
    candidates of a round see the same values. ``check(name, output, args)`` (optional) is called
    on the output of one timed call of every candidate in every round (picked at random after
    the block), so a candidate cannot win by skipping work. ``until=(name, over, bar)`` keeps
    adding rounds (up to ``max_rounds``, default four times ``rounds``) while the bar lies
    between the lower and upper confidence bounds of ``name``'s speedup over ``over``.
    """
    # Under the autograder, timing waits for a turn in which no other submission runs.
    with observing_paused(), steady(), grader_hooks.machine_turn():
        return _compare(candidates, inputs=inputs, baseline=baseline, rounds=rounds, warmup=warmup,
                        min_run_time=min_run_time, device=device, progress=progress, check=check,
                        until=until, max_rounds=max_rounds)


def _compare(candidates, *, inputs, baseline, rounds, warmup, min_run_time, device, progress, check,
             until, max_rounds):
    if not candidates:
        raise ValueError("compare() needs at least one candidate, e.g. {'eager': f, 'compiled': g}.")
    for name, fn in candidates.items():
        if not callable(fn):
            raise TypeError(f"Candidate {name!r} is {type(fn).__name__}, not something to call. "
                            "Pass functions, e.g. {'eager': f} rather than {'eager': f(x)}.")
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds must be >= 1 and warmup >= 0, got rounds={rounds}, warmup={warmup}.")
    baseline = baseline or next(iter(candidates))
    if baseline not in candidates:
        raise KeyError(f"The baseline {baseline!r} is not among the candidates {list(candidates)}.")
    if until is not None and (until[0] not in candidates or until[1] not in candidates):
        raise KeyError(f"until={until!r} names a candidate that is not among {list(candidates)}.")
    dev = pick_device(device)
    threads = torch.get_num_threads()
    names = list(candidates)
    make = inputs or (lambda: ())
    pick = random.SystemRandom()

    # Warm-up, and how many calls make a block of at least min_run_time, for each candidate: a
    # candidate a hundred times slower than another is not called a hundred times as often per round
    # (one block size for all, set by the fastest, made a demonstration of a slow side take minutes).
    blocks: dict[str, int] = {}
    args = make()
    for name in names:
        for _ in range(max(warmup, 1)):
            fresh = _fresh(args)
            synchronize(dev)
            t0 = time.perf_counter()
            out = candidates[name](*fresh)
            synchronize(dev)
            took = time.perf_counter() - t0
        if took <= 0:
            _expect_a_moving_clock()
        if check is not None and warmup:
            check(name, out, fresh)
        blocks[name] = math.ceil(min_run_time / max(took, 1e-7))
    per_call = max(_nbytes(args), 1)
    blocks = {name: max(1, min(n, MAX_BLOCK, MAX_BLOCK_BYTES // per_call)) for name, n in blocks.items()}
    block = max(blocks.values())

    times: dict[str, list[float]] = {n: [] for n in names}
    limit = max_rounds or (4 * rounds if until is not None else rounds)
    bar = None
    if progress is None or progress:
        try:
            from tqdm.auto import tqdm
            bar = tqdm(total=rounds * len(names), desc="timing", leave=False,
                       disable=progress is None and rounds * len(names) * min_run_time < 3)
        except ImportError:  # pragma: no cover - tqdm is a dependency
            bar = None
    r = redone = kept = 0
    while r < limit:
        if r >= rounds:
            if until is None:
                break
            report = SpeedReport(times=times, baseline=baseline, device=str(dev), threads=threads, starved=kept)
            if not _undecided(report.speedup(until[0], until[1]), until[2]):
                break
        values = [make() for _ in range(block)]
        order = names[r % len(names):] + names[: r % len(names)]
        got: dict[str, float] = {}
        starved, wall, w0 = False, 0.0, _process_waited()
        for name in order:
            fn = candidates[name]
            calls = [_fresh(v) for v in values[:blocks[name]]]  # this candidate's own objects
            outs = []
            synchronize(dev)
            c0 = time.process_time()
            t0 = time.perf_counter()
            for a in calls:
                outs.append(fn(*a))
            synchronize(dev)
            took = time.perf_counter() - t0
            starved |= _starved(took, time.process_time() - c0 if dev.type == "cpu" else None)
            wall += took
            got[name] = took / len(calls)
            if check is not None:
                i = pick.randrange(len(calls))
                check(name, outs[i], calls[i])
            del outs, calls
            if bar is not None:
                bar.update(1)
        # Threads kept waiting, ready, for a core (the scheduler's count) starve a round too, however much CPU
        # they show: torch's threads spin at a barrier while a peer waits for its core, and two candidates
        # 512 times apart in work both read 16 ms a call, a decided fail of the faster (a busy CI run)
        waited = _process_waited() - w0 if w0 >= 0 else -1.0
        starved |= dev.type == "cpu" and waited > max(STARVED * wall, 0.001)  # (ns counts: short rounds too)
        if starved and redone < rounds:  # a busy machine took the core away: measure this round again
            redone += 1
            continue
        kept += starved
        for name in names:
            times[name].append(got[name])
        r += 1
    if bar is not None:
        bar.close()
    notes = [f"{redone} round(s) measured again: this process was starved of CPU in them."] if redone else []
    if kept:
        notes.append(f"{kept} round(s) counted although starved of CPU: no verdict here is a fail; run it again "
                     "on a quieter machine.")
    return SpeedReport(times=times, baseline=baseline, device=str(dev), threads=threads, notes=notes, starved=kept)


_RECYCLED: set = set()  # (function, factory, sizes, constants' shapes) already seen to stay under MAP_FROM


def _recycled_sizes(local: Mapping[str, Callable | None], factory: Callable, sizes: Mapping[str, int],
                    constants: Sequence[Any], grad: bool) -> None:
    """Refuse to time the course's sides at sizes where one of their blocks would be mapped afresh on
    every call (:data:`course.allocator.MAP_FROM`). Under glibc, what such a block costs depends on
    the history of the process that makes it: lesson 7's broadcast (two 64 MiB tensors a call) ran
    2.5x faster in a process that had first left a free stretch inside its heap (held in place by a
    small tensor above it) than in one mapping fresh pages (40 against 104 ms a call, on the course's
    2-core machine), so a learner's process could have passed the baseline's own code as faster.
    Under the threshold both processes recycle, whatever came before.
    Measured once per function, factory, sizes and constants' shapes (one call each, on a CPU)."""
    from course.allocator import MAP_FROM, available, largest_block

    if not available():
        return
    for side, fn in local.items():
        if fn is None:
            continue
        key = (getattr(fn, "__module__", None), getattr(fn, "__qualname__", repr(fn)),
               f"{factory.__module__}.{factory.__qualname__}", tuple(sorted(sizes.items())),
               tuple(tuple(c.shape) if isinstance(c, torch.Tensor) else repr(c) for c in constants))
        if key in _RECYCLED:
            continue
        with observing_paused(), torch.set_grad_enabled(grad):
            largest = largest_block(fn, *factory(0, device="cpu", **sizes), *constants)
        if largest >= MAP_FROM:
            raise ValueError(
                f"the course's {side!r} makes a {largest / 2**20:.0f} MiB tensor at the sizes {dict(sizes)}: a block "
                f"of {MAP_FROM >> 20} MiB or more is mapped afresh from the operating system on every call, at a cost "
                "that depends on what the process did before, so it cannot be timed fairly against another process "
                "(course.allocator). Time at sizes whose tensors stay under that (the lesson's declared sizes do).")
        _RECYCLED.add(key)


def compare_served(baseline: tuple[str, Callable[..., Any]], candidate: tuple[str, Any], *, factory: Callable,
                   sizes: Mapping[str, int], constants: Sequence[Any] = (), device: str | torch.device | None = None,
                   rounds: int = 7, warmup: int = 2, min_run_time: float = 0.2, rtol: float = 1e-4,
                   until: float | None = None, max_rounds: int | None = None, grad: bool = False,
                   witness: tuple[str, Callable[..., Any]] | None = None, net: bool = False,
                   calibrate: float | None = None) -> SpeedReport:
    """Time the learner's ``candidate`` (a :class:`course.remote.Remote`, or a local function)
    against the course's ``baseline``, the way the grader's judge does: two processes, never at once.

    Every call runs on ``factory(seed, device=..., **sizes) + constants`` (a registered
    :func:`course.remote.factory`), with seeds drawn fresh from the operating system's random
    source for every block and sent only in the request that the judge times, so nothing can be
    prepared ahead. The candidate's block is one request to the learner's process, timed here
    (clock, transfer of the seeds, input making, the calls, CUDA synchronisation and the reply of
    its output checksums); the baseline's block makes the same inputs and checksums here, while
    the learner's process is stopped (``grader_hooks.hold``). Every timed call of the candidate
    must give the checksums of the baseline's call on the same seed (``rtol``: per element, relative).
    ``until=bar`` adds rounds (up to four times ``rounds``) while the bar lies between the lower
    and upper confidence bounds of the speedup. Both sides run without autograd, unless ``grad`` (for
    functions that differentiate inside, such as a Jacobian).

    ``witness``: the course's own fast solution, timed like the baseline (here, the learner's process
    stopped) in every round, on the same seeds, in turn with the other two. A right answer's ratio over
    it does not move with the machine's load the way a ratio over a slow baseline does (a memory-bound
    baseline can slow threefold when another process takes the cache), so the grader judges whether a
    candidate is implausibly fast against it (``SpeedReport.witness``).

    ``net``: report every side's times net of what the harness itself spends per call, making the
    inputs and checking the output (timed here in every round, on the same seeds, with an "answer"
    that returns the baseline's output at once; at most :data:`NET_SHARE` of its least reading, and
    never more than :data:`NET_SHARE` of any side's reading, is taken off). For an answer whose
    work is small beside drawing its inputs (lesson 3's 1x1 convolution: two thirds of a timed
    call is drawing its inputs and checksumming its output), the gross ratio says little. The same
    amount comes off every side, so a slower side stays slower: netting can move a ratio away from
    1, never across it.

    ``calibrate=d``: the baseline is also timed in the learner's process (the course's function of
    the same name there, :func:`course.remote.course_function`), in every round, on the same seeds;
    the course's sides of a round (baseline, witness, harness) then count at the speed the learner's
    process ran the baseline, believed between ``1/(1 + d)`` and ``1 + d`` of the judge's (see
    :func:`_calibrated`). Two processes can run the same code at speeds some percent apart for good
    (a graded lesson 3 ran the same block 13% slower in the learner's process, and the same process
    as fast as a fresh one when timed alone), and a net ratio magnifies that several times; the bound
    is all a learner who slows the course's code in their own process can gain.
    """
    import secrets

    from course.remote import checksum, collector_off, is_remote

    name = f"{factory.__module__}.{factory.__qualname__}"
    base_name, base_fn = baseline
    cand_name, cand = candidate
    wit_name, wit_fn = witness if witness is not None else (None, None)
    if wit_name in (base_name, cand_name):
        raise ValueError(f"the witness needs a name of its own, not {wit_name!r}.")
    local = {base_name: base_fn, wit_name: wit_fn}  # the trusted sides, timed here
    dev = pick_device(device)
    remote = is_remote(cand)
    there = None  # the baseline timed in the learner's process (calibrate)
    if calibrate is not None and remote:
        qualified = f"{getattr(base_fn, '__module__', '')}.{getattr(base_fn, '__qualname__', '')}"
        if not qualified.startswith("course.") or "<" in qualified or qualified.count(".") < 2:
            raise ValueError(f"calibrate needs a baseline that is a course module's function, not {qualified!r}.")
        if not calibrate > 0:
            raise ValueError(f"calibrate is a bound above 0 (0.1: within 10%), not {calibrate!r}.")
        there = (f"{base_name} {_THERE}", qualified)
    # On a CPU, the learner's process may start threads or processes of its own inside the timed
    # call: its block is charged its CPU time over the threads allowed, where that is more.
    counted = remote and dev.type == "cpu" and _counted()
    used: list[tuple[float, float]] = []  # (wall, CPU) of the candidate's blocks
    # With calibrate, the CPU time of the thread that runs the course's own blocks, in each process.
    main_cpu: dict[str, float | None] = {}  # the last block of each side: its main thread's CPU seconds

    def run_local(fn, seeds):
        sums = []
        with torch.set_grad_enabled(grad):
            for seed in seeds:
                sums.append(checksum(fn(*factory(seed, device=str(dev), **sizes), *constants)))
            synchronize(dev)
        return torch.stack(sums).cpu()

    if dev.type == "cpu":
        _recycled_sizes(local, factory, sizes, constants, grad)
    with observing_paused(), steady(), grader_hooks.machine_turn():
        handle = cand.stage(list(constants)) if remote else None

        def run_candidate(seeds):
            if remote:
                return cand.block(handle, name, dict(sizes), seeds, str(dev), grad=grad)
            return run_local(cand, seeds)

        seen: list[str] = []  # what the learner's process had about it in the last block of the course's code there

        def run_there(seeds):
            sums, found = cand.course_block(handle, name, dict(sizes), seeds, str(dev), grad=grad, course_fn=there[1])
            seen[:] = found
            return sums

        def timed(side, seeds):
            """Wall seconds of one block, its checksums, and the CPU seconds it used (None: not known)."""
            synchronize(dev)
            if side in local or not remote:
                with (grader_hooks.learner_stopped() if side in local else nullcontext()), \
                        (collector_off() if there is not None and side in local else nullcontext()):
                    c0, m0 = time.process_time(), time.thread_time()
                    t0 = time.perf_counter()
                    sums = run_local(local[side] if side in local else cand, seeds)
                    took = time.perf_counter() - t0
                    cpu = time.process_time() - c0 if dev.type == "cpu" else None
                    main_cpu[side] = time.thread_time() - m0 if dev.type == "cpu" else None
            else:
                theirs = there is not None and side == there[0]
                k0 = _learner_counts(main_cpu=theirs) if counted else None  # one request each side of the block
                t0 = time.perf_counter()
                sums = run_there(seeds) if theirs else run_candidate(seeds)
                took = time.perf_counter() - t0
                k1 = _learner_counts(main_cpu=theirs) if counted else None
                cpu = k1.cpu - k0.cpu if k0 is not None else None
                m0, m1 = (k0.main_cpu, k1.main_cpu) if theirs and k0 is not None else (None, None)
                main_cpu[side] = m1 - m0 if m0 is not None and m1 is not None and 0 <= m0 <= m1 else None
                if cpu is not None and not theirs:
                    used.append((took, cpu))
            return took, sums, cpu

        def fresh(n):
            return [secrets.randbits(31) for _ in range(n)]

        # Warm-up, and the block length that makes the slower side take min_run_time.
        sides = ((base_name, cand_name) + ((wit_name,) if witness is not None else ())
                 + ((there[0],) if there is not None else ()))
        per_call = 1e-7
        for side in sides:
            for _ in range(max(warmup, 1)):
                took, _, _ = timed(side, fresh(1))
            per_call = max(per_call, took)
        block = max(1, min(MAX_BLOCK, math.ceil(min_run_time / per_call)))
        used.clear()  # (warm-up blocks, compilation included, are not charged)
        harness: list[float] = []  # per call: making the inputs and checking an output, no work
        if net:
            with torch.set_grad_enabled(grad):
                template = base_fn(*factory(fresh(1)[0], device=str(dev), **sizes), *constants)
            template = template.detach() if isinstance(template, torch.Tensor) else template
            local[_HARNESS] = lambda *args: template
            run_local(local[_HARNESS], fresh(1))  # its weights for the checksum, made once
        times: dict[str, list[float]] = {side: [] for side in sides}
        disturbed: list[bool] = []  # per round: the baseline's timing in the learner's process is not believed slow
        why_disturbed: set[str] = set()
        there_used: list[tuple[float, float]] = []  # (wall, CPU) of those blocks
        here_cpu: list[float] = []  # CPU of the baseline's blocks in the judge, the same rounds
        mains: list[tuple[float | None, float | None]] = []  # (there, here): the main threads' CPU of those

        def cpu_ratio() -> float | None:
            """The CPU time the learner's process used on the course's blocks over what the judge's
            used on the same blocks (the readings' slack given to the learner's side): a process that
            truly runs the course's code slower works longer on it; one made to wait (its process
            starved, or a thread of its own holding the interpreter's lock while the course's code
            waits for it) does not. The main threads' CPU where both are known in every round (a
            thread of the learner's that holds the lock works, but not on the main thread), else
            the process's."""
            if mains and all(a is not None and b is not None for a, b in mains):
                theirs, ours, slack = sum(a for a, _ in mains), sum(b for _, b in mains), MAIN_SLACK * len(mains)
            else:
                theirs, ours, slack = sum(c for _, c in there_used), sum(here_cpu), CPU_SLACK
            return (theirs + slack) / ours if there_used and ours > 0 else None

        def calibrated():
            return _calibrated(times, harness, base_name, cand_name, there, calibrate, flags(), cpu_ratio())

        def flags() -> list[bool]:
            """Every round disturbed where, over all the blocks of the course's code there, the
            learner's process tree used more CPU than their wall time on the threads allowed (the
            readings' slack paid once), or, on one thread, where any thread but the one running
            that code used CPU (beyond the readings' slack, a clock tick per block): threads or
            processes of its own ran beside that code (one that shares its core slows it down, and
            the slowed thread's own CPU time grows: no reading of that thread alone can tell)."""
            if cpu_factor(there_used, torch.get_num_threads()) > 1.0:
                why_disturbed.add("threads or processes of its own used CPU")
                return [True] * len(disturbed)
            if torch.get_num_threads() == 1 and mains and all(a is not None for a, _ in mains):
                beside = sum(c for _, c in there_used) - sum(a for a, _ in mains)
                if beside > CPU_SLACK + TICK * len(mains):
                    why_disturbed.add(f"threads or processes of its own used {beside:.2f} s of CPU beside it")
                    return [True] * len(disturbed)
            return disturbed
        limit = max_rounds or (4 * rounds if until is not None else rounds)
        r = redone = kept = 0
        while r < limit:
            if r >= rounds:
                if until is None:
                    break
                now = _netted(*calibrated())
                if not _undecided(SpeedReport(now, base_name, str(dev), torch.get_num_threads(),
                                              starved=kept).speedup(cand_name), until):
                    break
            seeds = fresh(block)
            got, took, starved, charged = {}, {}, False, len(used)
            # every side leads in turn (with two, they alternate; a witness makes three)
            shift = (r + 1) % len(sides)
            odd: list[str] = []
            there_cpu = base_cpu = None
            own_starved = False  # a block of the learner's process read starved (a sleep there reads so too)
            for side in sides[shift:] + sides[:shift]:
                took[side], got[side], cpu = timed(side, seeds)
                theirs = remote and (side == cand_name or (there is not None and side == there[0]))
                if theirs:
                    own_starved |= _starved(took[side], cpu, CPU_SLACK)
                else:
                    starved |= _starved(took[side], cpu)
                if there is not None and side == there[0]:
                    odd, there_cpu = list(seen), cpu
                if side == base_name:
                    base_cpu = cpu
            if net:
                harness_took, _, cpu = timed(_HARNESS, seeds)
                starved |= _starved(harness_took, cpu)
            want = got[base_name]
            for side in (cand_name,) + ((there[0],) if there is not None else ()):
                have = got[side]
                # Outputs within rtol of the baseline's, element by element, move the weighted sum by at
                # most about rtol * |outputs|_2 (times a standard normal): 4 of those is the tolerance;
                # they move the plain sum by at most rtol * the sum of absolute values: 4 of those too.
                bad = checksums_differ(have, want, rtol)
                if bool(bad.any()):
                    i = int(bad.nonzero()[0])
                    raise AssertionError(
                        f"{side}: the output of a timed call differs from {base_name}'s on the same inputs "
                        f"({int(bad.sum())} of {block} calls in round {r + 1}; checksum {float(have[i, 0]):.6g}, "
                        f"expected {float(want[i, 0]):.6g}). "
                        + ("A fast path must compute every call's output." if side == cand_name else
                           "The course's own function gave other outputs in your process: was it changed?"))
            if starved and redone < rounds:  # a busy machine took a core away from the course's side: again
                redone += 1
                del used[charged:]
                continue
            # A round whose learner's block read starved is kept, never measured again: its process could make
            # the rounds it chooses read so (by sleeping in them) and have its slowest rounds thrown away. Kept
            # starved, it takes away every fail (a busy machine may have done it), never the rounds' bound.
            kept += starved or own_starved
            for side in sides:
                times[side].append(took[side] / block)
            disturbed.append(bool(odd))
            why_disturbed.update(odd)
            if there is not None and there_cpu is not None and base_cpu is not None:
                there_used.append((took[there[0]], there_cpu))
                here_cpu.append(base_cpu)
                mains.append((main_cpu.get(there[0]), main_cpu.get(base_name)))
            if net:
                harness.append(harness_took / block)
            r += 1
    notes = [f"{redone} round(s) measured again: a side was starved of CPU in them."] if redone else []
    # Each of the candidate's rounds counts at least its CPU time over the threads allowed (see
    # charged_seconds): round by round, not one factor over the summed wall time, which rounds whose
    # wall clock stretched (the process waiting, using no CPU) diluted for every other round.
    charge = charged_seconds(used, torch.get_num_threads())
    wall = sum(w for w, _ in used)
    if len(charge) == len(times[cand_name]) and wall > 0 and sum(charge) > wall:
        times[cand_name] = [c / block for c in charge]
        notes.append(f"{cand_name} used {sum(c for _, c in used) / wall:.1f} cores' worth of CPU while timed, with "
                     f"{torch.get_num_threads()} thread(s) allowed: each round counts its CPU time over "
                     f"{torch.get_num_threads()} where that is longer ({sum(charge) / wall:.2f}x its wall time in "
                     "all). Threads or processes of your own do not make a call faster here.")
    if there is not None:
        factors = [b / a for a, b in zip(times[base_name], times[there[0]]) if a > 0]
        worked = cpu_ratio()
        times, harness = calibrated()
        if factors:
            held = sum(1 for f in factors if not 1 / (1 + calibrate) <= f <= 1 + calibrate)
            notes.append(f"Your process ran {base_name} at {statistics.median(factors):.2f}x the time it took in "
                         f"the grader's (median of {len(factors)} rounds)"
                         + (f", working {worked:.2f}x the grader's CPU time on it" if worked is not None else "")
                         + f": the course's sides count at your process's speed, believed within "
                         f"{1 + calibrate:.2f}x of the grader's"
                         + (" and no slower than the CPU time says" if worked is not None else "")
                         + (f" (held to it in {held} round(s))." if held else "."))
        marked = flags()
        if any(marked):
            notes.append(f"In {sum(marked)} round(s), while {base_name} ran in your process, "
                         + "; ".join(sorted(why_disturbed)) + f": there your process is not believed slower than the "
                         "grader's. Leave nothing running between calls of your function.")
    gross = None
    if net:
        gross = times
        times = _netted(times, harness)
        taken = gross[base_name][0] - times[base_name][0] if times[base_name] else 0.0
        notes.append(f"Times are net of {format_time(taken)} per call that the check itself spends making the inputs "
                     "and checking the output (measured beside them; the same is taken off every side).")
    if kept:
        notes.append(f"{kept} round(s) counted although this process was starved of CPU in them: no verdict here "
                     "is a fail.")
    return SpeedReport(times=times, baseline=base_name, device=str(dev), threads=torch.get_num_threads(),
                       notes=notes, witness=wit_name, starved=kept, gross=gross)


#: What names the baseline timed in the learner's process (``compare_served(calibrate=...)``).
_THERE = "(in your process)"


def _calibrated(times: dict[str, list[float]], harness: list[float], base: str, cand: str,
                there: tuple[str, str] | None, bound: float | None,
                disturbed: Sequence[bool] = (), cpu_ratio: float | None = None,
                ) -> tuple[dict[str, list[float]], list[float]]:
    """``times`` and ``harness`` with every course side of a round (all but the candidate and the
    baseline's reading in the learner's process) counted at the learner's process's speed in that
    round: times the ratio of the baseline's time there to its time here, held within
    ``[1/(1 + bound), 1 + bound]``. Unchanged without ``there``. A round's candidate is then
    compared with the baseline as that process runs it, where the two processes differ by no more
    than the bound: a learner whose process runs the course's code slower (or who slows it) moves
    their ratio by the bound at most. In a ``disturbed`` round (something in the learner's process
    could have run beside the course's code there: ``course.remote.disturbances``, or CPU of its own)
    the process is believed faster, never slower: the factor is at most 1. ``cpu_ratio``: the CPU
    time that process used on those blocks over the judge's on the same blocks; a process is
    believed slower only as far as it worked longer (a factor at most ``max(1, cpu_ratio)``): time
    it spent waiting (on a thread of its own holding the interpreter's lock, say) is not slowness."""
    if there is None:
        return times, harness
    lo, hi = 1 / (1 + bound), 1 + bound
    if cpu_ratio is not None:
        hi = min(hi, max(1.0, cpu_ratio))
    factors = [min(hi, max(lo, b / a)) if a > 0 else 1.0 for a, b in zip(times[base], times[there[0]])]
    factors = [min(f, 1.0) if i < len(disturbed) and disturbed[i] else f for i, f in enumerate(factors)]
    out = {side: ([t * f for t, f in zip(ts, factors)] if side not in (there[0], cand)
                  else list(ts)) for side, ts in times.items()}
    return out, [h * f for h, f in zip(harness, factors)]


#: The pseudo-side that times the harness alone (``compare_served(net=True)``).
_HARNESS = "(making inputs, checking outputs)"
#: The most of the harness's least per-call reading that netting takes off, and the most of any
#: side's reading: taking off less than the harness costs only dilutes a ratio towards 1.
NET_SHARE = 0.9


def _netted(times: dict[str, list[float]], harness: list[float]) -> dict[str, list[float]]:
    """``times`` with one amount taken off every reading: :data:`NET_SHARE` of the least harness
    reading, capped at :data:`NET_SHARE` of the least reading of any side (unchanged: no harness)."""
    readings = [t for ts in times.values() for t in ts]
    if not harness or not readings:
        return times
    off = NET_SHARE * min(min(harness), min(readings))
    return {side: [t - off for t in ts] for side, ts in times.items()}


#: What the kernel's clock ticks (10 ms, per process of the tree) may add to a CPU reading.
CPU_SLACK = 0.03
#: One clock tick: what each difference of two readings of the tree may be off by.
TICK = 0.01
#: What a block's reading of a main thread's CPU (nanoseconds: the scheduler's count, the judge's
#: ``thread_time``) is given for the learner's side: the request and reply there, not rounding.
MAIN_SLACK = 0.001


def cpu_factor(blocks: Sequence[tuple[float, float]], threads: int) -> float:
    """How much longer than its wall time a candidate's timed blocks count: their CPU time (less
    the readings' slack) over the ``threads`` they were allowed, against their wall time, or 1
    where that is less. ``blocks``: (wall, CPU) seconds of each. Summed over all blocks, the
    readings' rounding (a clock tick) is paid once, not per block."""
    wall = sum(w for w, _ in blocks)
    cpu = sum(c for _, c in blocks)
    if wall <= 0:
        return 1.0
    return max(1.0, (cpu - CPU_SLACK) / max(1, threads) / wall)


def checksums_differ(have: torch.Tensor, want: torch.Tensor, rtol: float) -> torch.Tensor:
    """Per call (row): whether the checksums ``have`` (:func:`course.remote.checksum`, one row of four
    per call) show outputs other than those of ``want``, within ``rtol`` per element.

    All four numbers are compared, each within four times ``rtol`` of its scale (the 2-norm for the
    weighted sum and the norm, the sum of absolute values for the plain sum and itself), and none may
    be NaN or infinite. Two kinds of evidence:

    - the 2-norm and the sum of absolute values: outputs within ``rtol`` of every element move them by
      at most ``rtol`` of themselves (the triangle inequality), whatever the outputs, so an honest
      output never trips them, and an output scaled by more than ``1 + 4 * rtol`` (or less than
      ``1 - 4 * rtol``) trips them in every call. Neither can be had without every element: there is
      no shortcut through the weights (which are public), as there is for a linear sum of a linear
      function's output;
    - the weighted sum (fixed random weights) and the plain sum: what the first two are blind to (a
      sign flipped, elements swapped or moved, an offset where outputs cross zero), seen by chance in
      each call (an error ``e`` moves the weighted sum by about ``|e|_2`` times a standard normal):
      an error of a few ``rtol`` is missed in a share of calls, and seen over the dozens a clock times.
    """
    scale = 4 * rtol * torch.stack([want[:, 1], want[:, 1], want[:, 3], want[:, 3]], dim=1) + 1e-9
    return ((have - want).abs() > scale).any(dim=1) | ~torch.isfinite(have).all(dim=1)


def best_times(calls: Sequence[tuple[Callable[..., Any], Any]], *, held: Sequence[int] = (), reps: int = 5,
               device: str | torch.device | None = None,
               check: Callable[[list], None] | None = None, warm: Sequence[int] = (),
               record: dict | None = None) -> list[float]:
    """The best of ``reps`` wall times of each ``fn(*args)`` in ``calls``, taken in turn within every
    repetition (a busy moment slows one sample of each; the best of each is left), after one
    untimed repetition. Evidence of structure that a check can take from outside the learner's
    process, by its own clock: how time grows with a size, or how a learner's function compares
    with the course's loop on the same work. The calls listed in ``held`` are trusted ones: under
    the grader the learner's process is stopped while they run (``grader_hooks.hold``), and the
    machine is this submission's alone throughout.

    ``args`` may be a function returning the arguments: it is called (untimed) once per
    repetition, and calls that share it get the same fresh arguments, so nothing can be
    memoised across repetitions. ``check(outputs)`` sees every repetition's outputs, in the order
    of ``calls`` (a timed answer must also be right).

    ``warm``: calls that are made once more, untimed, just before each timed one, on arguments of
    their own (``args()`` again: nothing of the timed call's can be kept from it). After a held call
    the learner's process comes back cold (its caches and its allocator's pages the loop's), and the
    first call after pays for that: a per-sample answer that runs in 2 ms read 8 ms so. The warm-up
    call pays it instead; the timed call is the learner's work.

    ``record``: a dict to which this reading appends, under ``"used"``, the (wall, CPU) seconds of each
    learner's call per entry of ``calls`` (how much of its time the learner's processes worked), under
    ``"waited"`` the seconds its threads waited, ready to run, for a CPU during each (-1: not known; a
    busy machine, where a call that worked little wanted to), under ``"net"`` each call's wall time
    less what the threads a request and its reply pass through waited so (this one and the learner's
    interpreter's main thread: :func:`waited_for_cpu`; None: not known), and
    under ``"grown"`` the growth of their peak resident memory during each (the kernel's count, read
    by the grading parent, reset just before the call and its warm-up call: outside the timed span)."""
    dev = pick_device(device)
    counted = dev.type == "cpu" and _counted()
    peak = grader_hooks.learner_peak if record is not None else None
    used: list[list[tuple[float, float]]] = [[] for _ in calls]  # (wall, CPU) of the learner's calls
    waits: list[list[float]] = [[] for _ in calls]  # seconds its threads waited, ready, for a CPU (-1: not known)
    nets: list[list[float | None]] = [[] for _ in calls]  # wall less the crossing threads' waiting
    grown: list[list[float]] = [[] for _ in calls]
    best = [math.inf] * len(calls)
    with observing_paused(), steady(), grader_hooks.machine_turn():
        for rep in range(reps + 1):  # the first is a warm-up
            made: dict[int, tuple] = {}
            outputs = []
            for i, (fn, args) in enumerate(calls):
                base = peak(True) if peak is not None and i not in held else None  # the warm-up call counts too
                if i in warm and callable(args):
                    fn(*tuple(args()))  # untimed, unchecked, on its own fresh arguments
                if callable(args):
                    args = made[id(args)] if id(args) in made else made.setdefault(id(args), tuple(args()))
                with (grader_hooks.learner_stopped() if i in held else nullcontext()):
                    synchronize(dev)
                    # one request to the parent before the call and one after (CPU, waiting, the main thread's)
                    k0 = _learner_counts() if counted and rep and i not in held else None
                    o0 = _own_waited() if k0 is not None and record is not None else -1.0
                    t0 = time.perf_counter()
                    out = fn(*args)
                    synchronize(dev)
                    took = time.perf_counter() - t0
                    if k0 is not None:
                        k1, o1 = _learner_counts(), _own_waited() if o0 >= 0 else -1.0
                        used[i].append((took, k1.cpu - k0.cpu))
                        if record is not None and k0.waited is not None:
                            waits[i].append(k1.waited - k0.waited if min(k0.waited, k1.waited) >= 0 else -1.0)
                            # the waiting of the threads a request and its reply pass through (waited_for_cpu),
                            # never below its CPU time over the threads allowed: waiting is not work, and work
                            # spread over threads of the learner's own (which keep its main thread waiting) counts
                            crossed = ((o1 + k1.main_waited) - (o0 + k0.main_waited)
                                       if min(o0, o1, k0.main_waited, k1.main_waited) >= 0 else None)
                            nets[i].append(max(took - crossed, used[i][-1][1] / max(torch.get_num_threads(), 1))
                                           if crossed is not None else None)
                    if base is not None:
                        grown[i].append(peak(False) - base)
                if rep:
                    best[i] = min(best[i], took)
                outputs.append(out)
            if check is not None:
                check(outputs)
    # Threads or processes of the learner's own do not hide a loop either: each repetition of a
    # learner's call counts at least its CPU time over the threads allowed (charged_seconds), and the
    # best of those is kept.
    threads_allowed = torch.get_num_threads()
    if record is not None:
        record.setdefault("used", []).append(used)
        record.setdefault("waited", []).append(waits)
        record.setdefault("net", []).append(nets)
        record.setdefault("grown", []).append(grown)
    return [min(charged_seconds(u, threads_allowed)) if len(u) == reps else b for b, u in zip(best, used)]


class Counts(NamedTuple):
    """What the grading parent reads about the learner's processes around a timed call or block:
    their CPU seconds; the seconds their live threads waited, ready, for a CPU, and those its
    interpreter's main thread waited; that thread's CPU seconds (-1.0: not known; None: not read)."""
    cpu: float
    waited: float | None
    main_waited: float | None
    main_cpu: float | None


def _counted() -> bool:
    """Whether the grader counts the learner's CPU (``learner_counts``, or ``learner_cpu`` on its own)."""
    return grader_hooks.learner_counts is not None or grader_hooks.learner_cpu is not None


def _learner_counts(main_cpu: bool = False) -> Counts:
    """:class:`Counts` now: one request to the parent where the grader offers it
    (``grader_hooks.learner_counts``); else each hook on its own (``main_cpu``: that one too)."""
    if grader_hooks.learner_counts is not None:
        return Counts(*grader_hooks.learner_counts())
    waited, main = grader_hooks.learner_waited, grader_hooks.learner_main_cpu
    return Counts(grader_hooks.learner_cpu(), waited() if waited is not None else None,
                  waited(main=True) if waited is not None else None,
                  main() if main_cpu and main is not None else None)


def charged_seconds(blocks: Sequence[tuple[float, float]], threads: int) -> list[float]:
    """What each of a learner's timed ``blocks`` ((wall, CPU) seconds) counts: its wall time, or its CPU
    time over the ``threads`` allowed where that is longer, a block's CPU taken at most at the blocks'
    mean (less the readings' slack, paid once over all of them).

    Block by block, so a block whose wall clock stretched (the process kept waiting: CPU time does
    not grow then) lowers no other block's charge, as one factor over the summed wall time did. The
    cap at the mean keeps a block's clock-tick rounding (a reading can be a tick over its wall time)
    from charging an honest block more than the process worked per block; the same work costs
    about the same CPU however it is spread over threads, so the cap does not help a learner's own
    threads either."""
    if not blocks:
        return []
    mean = max(0.0, sum(c for _, c in blocks) - CPU_SLACK) / len(blocks)
    return [max(w, min(c, mean) / max(1, threads)) for w, c in blocks]

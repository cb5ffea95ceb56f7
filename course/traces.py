"""Lesson 8's trace diff: which ops two Chrome traces ran, how often and for how long, and what
differs between them, in plain Python (no pandas: the grader's sandbox has only torch and numpy).

    control = profile_steps(lambda: reference(q, k, v))     # or load_trace("ref.json.gz")
    test = profile_steps(lambda: learner(q, k, v))
    compare_traces(control, test)      # one row per op name: counts, durations, their differences
    ops_diff(control, test)            # {"added": [...], "deleted": [...], "increased": [...], ...}
    explain_diff(control, test)        # ["2 extra aten::copy_ per call (1.2 ms)", ...]

The numbers are exactly those of Holistic Trace Analysis (``hta.trace_diff.TraceDiff.compare_traces``
and ``ops_diff`` with ``device_type=DeviceType.CPU``, first rank, first iteration by default), so
that a learner who checks the lesson's answers with HTA gets the same table. That means copying
HTA's reading of a trace, including its surprises (tests/test_traces.py checks this against HTA):

- Events without ``dur`` or ``cat`` (metadata, instant and flow events) and ``cat == "Trace"`` (the
  profiler's own span) are dropped; everything else counts, ``python_function`` and
  ``user_annotation`` events included (HTA's default JSON reader does not skip them), and the
  ``ProfilerStep#N`` annotation itself is a row of the table.
- "CPU" means the event's ``args["stream"]`` is -1, missing or not a number. GPU kernels, memcpys
  and stream-0 Triton ops have a stream and are left out.
- When timestamps are floats (torch writes ``ts`` with nanosecond decimals), HTA rounds every event
  inwards to whole microseconds: ``ts = ceil(ts)``, ``end = floor(ts + dur)``, ``dur = end - ts``.
  An op shorter than a microsecond can then have a duration of -1 us; totals include it.
- An event belongs to iteration N when its (rounded) start lies in ``[start, start + dur)`` of a
  ``ProfilerStep#N`` event (the last such step in file order wins); an op that starts before or
  after every step belongs to none, one that starts in step N and ends in N+1 belongs to N.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import tempfile
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Union

from course.guard import reference

__all__ = ["compare_traces", "explain_diff", "explain_rows", "iterations", "load_trace", "op_table", "ops_diff",
           "profile_steps", "summary"]

TraceSource = Union[str, os.PathLike, Mapping[str, Any]]
Iteration = Union[int, Iterable[int], None]

_STEP = re.compile(r"ProfilerStep#(\d+)")
_CPU_STREAM = -1
_HOW_TO_STEP = ("profile with a schedule (torch.profiler.schedule(wait=0, warmup=1, active=3)) and call "
                "prof.step() after each call of the timed function, or use course.traces.profile_steps(fn)")

#: Names the profiler itself writes: never the reason code is slow.
_PROFILER_PREFIXES = ("ProfilerStep", "PyTorch Profiler", "Iteration Start", "Record Window End", "[memory]",
                      "Activity Buffer Request")
#: Ops that only allocate or re-view memory: they cost nothing themselves, and whatever they cause
#: (a copy, a kernel) shows up under its own name.
_BOOKKEEPING = frozenset(f"aten::{n}" for n in (
    "empty", "empty_like", "empty_strided", "as_strided", "view", "_reshape_alias", "_unsafe_view", "reshape",
    "expand", "expand_as", "resolve_conj", "resolve_neg", "alias", "detach", "detach_", "lift_fresh", "t",
    "transpose", "permute", "unsqueeze", "squeeze", "slice", "select", "unbind", "split", "chunk", "narrow",
    "result_type", "set_", "resize_"))


# ----------------------------------------------------------------------------------------- loading

def load_trace(source: TraceSource) -> dict:
    """A Chrome trace as a dict: ``source`` is one already (returned as it is), or the path of a
    ``.json`` / ``.json.gz`` file (what ``prof.export_chrome_trace`` and
    ``tensorboard_trace_handler`` write), or a folder holding exactly one such file."""
    if isinstance(source, Mapping):
        return _checked(dict(source) if not isinstance(source, dict) else source, "the dict given")
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"load_trace expected a path (str or Path) to a .json or .json.gz trace, or a trace dict; "
                        f"got {type(source).__name__}. Try prof.export_chrome_trace('trace.json') and pass its path.")
    path = Path(source)
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.name.endswith((".json", ".json.gz")))
        if len(found) != 1:
            raise ValueError(f"load_trace expected a folder with exactly one .json or .json.gz trace; {path} holds "
                             f"{len(found)}{': ' + ', '.join(p.name for p in found) if found else ''}. "
                             f"Pass the file's own path instead.")
        path = found[0]
    if not path.exists():
        raise FileNotFoundError(f"load_trace expected a trace file at {path}, but there is none. Check the path; "
                                f"a trace is written by prof.export_chrome_trace(path), or by "
                                f"tensorboard_trace_handler(folder) into that folder when the profile ends.")
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":  # gzip, whatever the suffix says
            raw = gzip.decompress(raw)
        trace = json.loads(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"load_trace expected {path} to be a JSON trace, plain or gzipped; reading it failed "
                         f"({e}). The file may be cut short (was the profiler still writing it?): export it "
                         f"again.") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"load_trace expected {path} to hold JSON, got a file that is not valid JSON ({e}). "
                         f"The file may be cut short or not a trace: export it again with "
                         f"prof.export_chrome_trace(path).") from e
    return _checked(trace, str(path))


def _checked(trace: Any, what: str) -> dict:
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        got = (f"a JSON {type(trace).__name__}" if not isinstance(trace, dict)
               else f"keys {sorted(trace)[:8]}" if "traceEvents" not in trace
               else f"traceEvents of type {type(trace['traceEvents']).__name__}")
        raise ValueError(f"expected a Chrome trace (a JSON object with a 'traceEvents' list) in {what}; got {got}. "
                         f"Pass the file torch.profiler wrote (prof.export_chrome_trace(path)), not a memory "
                         f"snapshot or a profiler table.")
    return trace


# ------------------------------------------------------------------------- HTA's reading of events

def _missing(v: Any) -> bool:
    """What pandas turns into NaN: an absent key, JSON null, or NaN."""
    return v is None or (isinstance(v, float) and math.isnan(v))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _ts_are_floats(events: list) -> bool:
    """Whether pandas would give the ``ts`` column the dtype float64, which is HTA's sign of
    nanosecond timestamps and makes it round them: some ``ts`` is a float, or one is missing among
    numbers. Integers only (or anything not a number) leave them as they are."""
    numbers = floats = missing = False
    for e in events:
        v = e.get("ts") if isinstance(e, dict) else None
        if _missing(v):
            missing = True
        elif not _is_number(v):
            return False
        else:
            numbers = True
            floats = floats or isinstance(v, float)
    return numbers and (floats or missing)


def _stream(event: dict) -> int:
    """HTA's stream column: ``args["stream"]`` as an integer, -1 when absent or not a number."""
    args = event.get("args")
    value = args.get("stream", _CPU_STREAM) if isinstance(args, dict) else _CPU_STREAM
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return _CPU_STREAM
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return int(value)
    return _CPU_STREAM


def _events(trace: Mapping[str, Any], rounding: bool = True) -> list[tuple[str, str, float, float, int]]:
    """``(name, cat, ts, dur, stream)`` of the events HTA keeps, in file order, with its rounding
    (``rounding=False``: the trace's own times; an event without a start is then dropped)."""
    events = trace["traceEvents"]
    rounding = rounding and _ts_are_floats(events)
    kept = []
    for e in events:
        if not isinstance(e, dict):
            continue
        name, cat, ts, dur = e.get("name"), e.get("cat"), e.get("ts"), e.get("dur")
        if _missing(cat) or cat == "Trace" or _missing(dur) or not isinstance(name, str):
            continue
        if rounding:
            if _missing(ts):
                continue  # its end is NaN, so is its duration: HTA drops it
            start, end = math.ceil(float(ts)), math.floor(float(ts) + float(dur))
            ts, dur = start, end - start
        elif not _is_number(ts) or not _is_number(dur):
            continue
        kept.append((name, cat, ts, dur, _stream(e)))
    return kept


def _steps(events: list) -> list[tuple[float, float, int]]:
    return [(ts, dur, int(m.group(1))) for name, _, ts, dur, _ in events if (m := _STEP.fullmatch(name))]


def _iteration_of(ts: Any, steps: list[tuple[float, float, int]]) -> int:
    """The step whose ``[start, start + dur)`` holds ``ts`` (the last in file order if several do);
    -1 for none."""
    found = -1
    if _is_number(ts):
        for start, dur, n in steps:
            if _is_number(start) and _is_number(dur) and start <= ts < start + dur:
                found = n
    return found


def iterations(trace: TraceSource) -> list[int]:
    """The N of every ``ProfilerStep#N`` event of the trace, sorted (each once)."""
    return sorted({n for _, _, n in _steps(_events(load_trace(trace)))})


def _chosen(present: list[int], iteration: Iteration, what: str = "this trace") -> set[int]:
    if not present:
        raise ValueError(f"{what} has no ProfilerStep#N events, so it has no iterations to pick ops from. "
                         f"To get them, {_HOW_TO_STEP}.")
    if iteration is None:
        return {present[0]}
    wanted = [iteration] if isinstance(iteration, int) and not isinstance(iteration, bool) else list(iteration)
    for i in wanted:
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"expected an iteration number (int) or a list of them, got {i!r}")
        if i not in present:
            raise ValueError(f"iteration {i} is not in {what}: it has iterations {present}. Pick one of those "
                             f"(None picks the first, {present[0]}).")
    return set(wanted)


@reference(in_cells=False)
def _rows(trace: TraceSource, iteration: Iteration, what: str, rounding: bool = True) -> dict[str, list]:
    """name -> [count, total duration (us), categories] over the CPU events of the chosen iterations."""
    events = _events(load_trace(trace), rounding)
    steps = _steps(events)
    chosen = _chosen(sorted({n for _, _, n in steps}), iteration, what)
    rows: dict[str, list] = {}
    durations: dict[str, list] = {}
    for name, cat, ts, dur, stream in events:
        if stream == _CPU_STREAM and _iteration_of(ts, steps) in chosen:
            row = rows.setdefault(name, [0, 0.0, set()])
            row[0] += 1
            row[2].add(cat)
            durations.setdefault(name, []).append(dur)
    for name, row in rows.items():
        row[1] = math.fsum(durations[name])
    return dict(sorted(rows.items()))


@reference(in_cells=False)
def op_table(trace: TraceSource, iteration: Iteration = None, *, rounding: bool = True) -> dict[str, tuple[int, float]]:
    """``{name: (count, total duration in us)}`` of the CPU events (HTA's ``DeviceType.CPU``) of one
    iteration, the first by default (as HTA); a list of iterations sums them. Durations include the
    ops each op calls (they are the trace's own). ``rounding=False``: the trace's own times, not
    HTA's whole microseconds (lesson 8's exercise; counts agree with HTA's on real traces)."""
    return _table(trace, iteration, "this trace", rounding)


# ------------------------------------------------------------------------------------- comparing

@reference(in_cells=False)
def compare_traces(control: TraceSource, test: TraceSource, *, control_iteration: Iteration = None,
                   test_iteration: Iteration = None, rounding: bool = True) -> list[dict]:
    """One row per op name of either trace, sorted by name: ``name, control_counts, test_counts,
    control_duration, test_duration`` (us), ``diff_counts, diff_duration`` (test minus control) and
    ``change``: '+' more of it in test, '-' fewer, '=' as many (HTA's counts_change_categories)."""
    a = _table(control, control_iteration, "the control trace", rounding)
    b = _table(test, test_iteration, "the test trace", rounding)
    rows = []
    for name in sorted(set(a) | set(b)):
        (cc, cd), (tc, td) = a.get(name, (0, 0.0)), b.get(name, (0, 0.0))
        diff = tc - cc
        rows.append({"name": name, "control_counts": cc, "test_counts": tc, "control_duration": cd,
                     "test_duration": td, "diff_counts": diff, "diff_duration": td - cd,
                     "change": "+" if diff > 0 else "-" if diff < 0 else "="})
    return rows


def _table(trace: TraceSource, iteration: Iteration, what: str, rounding: bool = True) -> dict[str, tuple[int, float]]:
    return {name: (count, total) for name, (count, total, _) in _rows(trace, iteration, what, rounding).items()}


@reference(in_cells=False)
def ops_diff(control: TraceSource, test: TraceSource, *, control_iteration: Iteration = None,
             test_iteration: Iteration = None, rounding: bool = True) -> dict[str, list[str]]:
    """Op names by what happened to them in test: ``added`` (only in test), ``deleted`` (only in
    control), ``increased`` / ``decreased`` (in both, more / fewer of them in test), ``unchanged``
    (in both, as many); each list sorted."""
    out: dict[str, list[str]] = {k: [] for k in ("added", "deleted", "increased", "decreased", "unchanged")}
    for r in compare_traces(control, test, control_iteration=control_iteration, test_iteration=test_iteration,
                            rounding=rounding):
        cc, tc = r["control_counts"], r["test_counts"]
        key = ("added" if cc == 0 else "deleted" if tc == 0 else
               "increased" if tc > cc else "decreased" if tc < cc else "unchanged")
        out[key].append(r["name"])
    return out


# ------------------------------------------------------------------------------------ explaining

def _times(n: float) -> str:
    return "once" if n == 1 else "twice" if n == 2 else f"{_count(n)} times"


def _count(n: float) -> str:
    return str(int(n)) if n == int(n) else f"{n:.3g}"


def _us(us: float) -> str:
    seconds = max(us, 0.0) * 1e-6
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _notable(name: str, cats: set) -> bool:
    return not (name.startswith(_PROFILER_PREFIXES) or name in _BOOKKEEPING or cats <= {"python_function"})


def explain_diff(control: TraceSource, test: TraceSource, *, calls: float = 1, top: int = 5) -> list[str]:
    """At most ``top`` sentences on why ``test`` (the learner's run) differs from ``control`` (the
    reference), the most time first: ops only the test ran, ops it skipped that the reference runs,
    ops it ran more often, and ops as frequent but at least 1.5x as slow and worth at least 5% of
    the test's step. ``calls``: calls of the timed function per profiler step (counts and times are
    per call). Views, allocations and profiler annotations are left out: they are symptoms, and
    whatever real work they cause is named on its own. ``[]``: nothing notable."""
    if not (_is_number(calls) and calls > 0):
        raise ValueError(f"calls: expected how many calls of the timed function each profiler step holds "
                         f"(a positive number), got {calls!r}")
    return explain_rows(_rows(control, None, "the control trace"), _rows(test, None, "the test trace"),
                        calls=calls, top=top)


def summary(trace: TraceSource, iteration: Iteration = None) -> dict[str, list]:
    """``{name: [count, total us, [categories]]}`` of one iteration's CPU events: the little that
    :func:`explain_rows` needs, plain enough to cross a process boundary as data."""
    return {name: [c, t, sorted(cats)] for name, (c, t, cats) in _rows(trace, iteration, "this trace").items()}


def explain_rows(control: Mapping[str, Any], test: Mapping[str, Any], *, calls: float = 1, top: int = 5) -> list[str]:
    """:func:`explain_diff` from two :func:`summary` tables (or ``_rows``) instead of two traces."""
    if not (_is_number(calls) and calls > 0):
        raise ValueError(f"calls: expected how many calls of the timed function each profiler step holds "
                         f"(a positive number), got {calls!r}")
    a = {n: (int(r[0]), float(r[1]), set(r[2])) for n, r in control.items()}
    b = {n: (int(r[0]), float(r[1]), set(r[2])) for n, r in test.items()}
    step = sum(t for name, (_, t, _) in b.items() if _STEP.fullmatch(name))
    step = step if step > 0 else max((t for _, t, _ in b.values()), default=0.0)
    found: list[tuple[float, str]] = []
    for name in sorted(set(a) | set(b)):
        cc, cd, ccats = a.get(name, (0, 0.0, set()))
        tc, td, tcats = b.get(name, (0, 0.0, set()))
        if not _notable(name, ccats | tcats):
            continue
        if cc == 0:
            found.append((td, f"{_count(tc / calls)} extra {name} per call ({_us(td / calls)})"))
        elif tc == 0:
            found.append((cd, f"no {name} ran (the reference runs it {_times(cc / calls)} per call)"))
        elif tc > cc:
            extra = td - cd
            found.append((max(extra, 0.0), f"{_count((tc - cc) / calls)} extra {name} per call "
                                           f"({_count(tc / calls)} instead of {_count(cc / calls)}"
                                           + (f", +{_us(extra / calls)})" if extra > 0 else ")")))
        elif tc == cc and td - cd >= 0.05 * step and td >= 1.5 * max(cd, 0.0) and td - cd > 0:
            ratio = f"{td / cd:.1f}x as long" if cd > 0 else "much longer"
            found.append((td - cd, f"{name} took {ratio} ({_us(cd / calls)} -> {_us(td / calls)} per call)"))
    found.sort(key=lambda f: -f[0])
    kept = found[:max(top, 0)]
    # An op the reference runs and the test never does is usually the explanation (a fused kernel
    # missed); on a CPU where that kernel is quick, the many small ops replacing it outweigh it. The
    # two heaviest ones missing always get a line (a composite op and the kernel it dispatches to,
    # such as scaled_dot_product_attention and its flash kernel), in place of the lightest others.
    for miss in [f for f in found if f[1].startswith("no ")][:2]:
        others = [i for i, f in enumerate(kept) if not f[1].startswith("no ")]
        if miss not in kept and others:
            kept[others[-1]] = miss
    kept.sort(key=lambda f: -f[0])
    return [sentence for _, sentence in kept]


# ------------------------------------------------------------------------------------- profiling

def profile_steps(fn: Callable[[], Any], *, steps: int = 3, warmup: int = 1,
                  path: Union[str, os.PathLike, None] = None, record_shapes: bool = False) -> dict:
    """Run ``fn()`` ``warmup + steps`` times under ``torch.profiler`` with a schedule, one profiler
    step per call, and return the Chrome trace of the ``steps`` recorded calls (also written to
    ``path`` if given, ``.json`` or ``.json.gz``). The steps are what make the trace comparable:
    each call becomes a ``ProfilerStep#N`` that HTA and this module pick iterations by; the warmup
    calls are run but not recorded (first-call costs: allocation, one-time dispatch)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    if steps < 1 or warmup < 0:
        raise ValueError(f"expected steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    activities = [ProfilerActivity.CPU]
    cuda = torch.cuda.is_available()
    if cuda:
        activities.append(ProfilerActivity.CUDA)
    if path is None:
        handle, out = tempfile.mkstemp(suffix=".json", prefix="course_trace_")
        os.close(handle)
    else:
        out = os.fspath(path)
    exported = []

    def ready(prof) -> None:
        prof.export_chrome_trace(out)
        exported.append(out)

    try:
        with profile(activities=activities, schedule=schedule(wait=0, warmup=warmup, active=steps, repeat=1),
                     on_trace_ready=ready, record_shapes=record_shapes) as prof:
            for _ in range(warmup + steps):
                fn()
                if cuda:
                    torch.cuda.synchronize()
                prof.step()
        if not exported:
            raise RuntimeError(f"torch.profiler exported no trace after {warmup + steps} steps of its schedule; "
                               f"profile by hand and call prof.export_chrome_trace(path) instead")
        return load_trace(out)
    finally:
        if path is None and os.path.exists(out):
            os.remove(out)

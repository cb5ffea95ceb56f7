"""Lesson 8's op table and trace diff, Holistic Trace Analysis's reading of a Chrome trace: the
answers to its Exercises 1 and 2 (``op_table``, ``ops_diff``), so the grader's alone (see
:mod:`course.references`). A learner's copy of the course had them in ``course/traces.py``, and a
cell could read that file as text, strip the guard and run it as its answer (the bare host only
proves the answer's program does not call torch or the course, not whose source it is); here they
are hidden from the learner's process. :mod:`course.traces` keeps what the lesson's cells use
(``load_trace``, ``profile_steps``, ``explain_diff``), and its ``explain_diff`` reads traces
through :func:`summary` here where this module exists. In a learner's copy the visible checks
compare with the answers stored for their own calls (``course/reference_data/08_profiling.pt``).

The numbers are exactly those of HTA (``hta.trace_diff.TraceDiff.compare_traces`` and ``ops_diff``
with ``device_type=DeviceType.CPU``, first rank, first iteration by default), so that a learner who
checks the lesson's answers with HTA gets the same table. That means copying HTA's reading of a
trace, including its surprises (tests/test_traces.py checks this against HTA):

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

import math
from typing import Any, Iterable, Mapping

from course.guard import reference
from course.traces import _STEP, Iteration, TraceSource, load_trace

__all__ = ["DATA_FILES", "compare_traces", "op_table", "ops_diff", "summary", "table_mistakes"]

_CPU_STREAM = -1
_HOW_TO_STEP = ("profile with a schedule (torch.profiler.schedule(wait=0, warmup=1, active=3)) and call "
                "prof.step() after each call of the timed function, or use course.traces.profile_steps(fn)")


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


def summary(trace: TraceSource, iteration: Iteration = None) -> dict[str, list]:
    """``{name: [count, total us, [categories]]}`` of one iteration's CPU events: the little that
    :func:`course.traces.explain_rows` needs, plain enough to cross a process boundary as data."""
    return {name: [c, t, sorted(cats)] for name, (c, t, cats) in _rows(trace, iteration, "this trace").items()}


def _tally(events: Iterable[tuple]) -> dict[str, tuple[int, float]]:
    out: dict[str, tuple[int, float]] = {}
    for name, _, _, dur, _ in events:
        count, total = out.get(name, (0, 0.0))
        out[name] = (count + 1, total + dur)
    return out


def table_mistakes(trace: Mapping[str, Any], iteration: int | None) -> dict[str, dict]:
    """What each known misreading of a trace gives for ``op_table(trace, iteration)`` (the trace's
    own times), by the sentence that names it: the check names the mistake a wrong table matches."""
    events = _events(trace, rounding=False)  # (name, cat, ts, dur, stream), HTA's events
    steps = _steps(events)
    chosen = min(n for _, _, n in steps) if iteration is None else iteration
    inside = [e for e in events if _iteration_of(e[2], steps) == chosen]
    cpu = [e for e in inside if e[4] == _CPU_STREAM]
    mistakes = {
        "it counted the events of every iteration (and between them), not just the one asked for":
            _tally(e for e in events if e[4] == _CPU_STREAM),
        "it kept only 'cat' == 'cpu_op'; HTA's CPU events are every event with a duration and a category but "
        "the 'Trace' span and GPU work: your labels, Python frames and the ProfilerStep itself too":
            _tally(e for e in cpu if e[1] == "cpu_op"),
        "it counted GPU work too (events with a 'stream' in their args)": _tally(inside),
        "it left out the ProfilerStep event itself (it starts inside its own window)":
            _tally(e for e in cpu if not e[0].startswith("ProfilerStep#")),
    }
    if iteration is None:
        last = max(n for _, _, n in steps)
        mistakes["it read the last iteration; with iteration=None it should read the first"] = \
            op_table(trace, last, rounding=False)
    return mistakes


def profiling_data() -> dict:
    """Lesson 8's visible checks' answers at their own calls (their defaults), by the functions above
    and the sanitizer's replay (:mod:`course.references.streams`)."""
    from course.checks.profiling import reference_data

    return reference_data()


DATA_FILES = {"08_profiling.pt": profiling_data}

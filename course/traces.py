"""Lesson 8's trace tools for the lesson's own cells: read a Chrome trace, profile a function step
by step, and say in sentences why one trace is slower than another, in plain Python (no pandas: the
grader's sandbox has only torch and numpy).

    control = profile_steps(lambda: reference(q, k, v))     # or load_trace("ref.json.gz")
    test = profile_steps(lambda: learner(q, k, v))
    iterations(test)                   # [1, 2, 3]: the ProfilerStep#N of the trace
    explain_diff(control, test)        # ["2 extra aten::copy_ per call (1.2 ms)", ...]

The op table and the trace diff (Holistic Trace Analysis's reading of a trace) are the answers to
the lesson's Exercises 1 and 2, so they live in ``course.references.traces``, the grader's alone: a
function here can be read as text and run as an answer, whatever guards it. Where that module
exists (the grader, the course's tests), :func:`explain_diff` reads traces through it, exactly as
HTA does. In a learner's copy it reads them roughly instead (:func:`_rough_rows`: the ``cpu_op``
and ``user_annotation`` events of the whole trace, per step), enough for sentences about what one
trace runs that the other does not, and deliberately not the exercise's table.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import tempfile
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Union

__all__ = ["explain_diff", "explain_rows", "iterations", "load_trace", "profile_steps", "summary"]

TraceSource = Union[str, os.PathLike, Mapping[str, Any]]
Iteration = Union[int, Iterable[int], None]

_STEP = re.compile(r"ProfilerStep#(\d+)")
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


# ------------------------------------------------------------------------------------ iterations

def iterations(trace: TraceSource) -> list[int]:
    """The N of every ``ProfilerStep#N`` event of the trace that has a duration and a category (the
    events HTA keeps), sorted (each once)."""
    found = set()
    for e in load_trace(trace)["traceEvents"]:
        if isinstance(e, dict) and isinstance(e.get("name"), str) and (m := _STEP.fullmatch(e["name"])):
            if e.get("cat") not in (None, "Trace") and isinstance(e.get("dur"), (int, float)):
                found.add(int(m.group(1)))
    return sorted(found)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _reading():
    """``course.references.traces`` (HTA's reading of a trace), or None in a learner's copy."""
    try:
        from course.references import traces as reading
    except ImportError:
        return None
    return reading


def _rough_rows(trace: TraceSource) -> tuple[dict[str, list], int]:
    """A learner's copy's reading for :func:`explain_diff`: ``{name: [count, total us, {cat}]}`` of
    every ``cpu_op`` and ``user_annotation`` event of the trace (every step, and between them), and
    the number of ``ProfilerStep`` events, to make counts per step. It keeps what a sentence about
    an op needs and is not HTA's table (which the lesson's exercise asks for): neither one iteration
    nor every CPU event."""
    rows: dict[str, list] = {}
    steps = 0
    for e in load_trace(trace)["traceEvents"]:
        if not isinstance(e, dict) or e.get("cat") not in ("cpu_op", "user_annotation"):
            continue
        name, dur = e.get("name"), e.get("dur")
        if not isinstance(name, str) or not isinstance(dur, (int, float)) or isinstance(dur, bool):
            continue
        steps += bool(_STEP.fullmatch(name))
        row = rows.setdefault(name, [0, 0.0, set()])
        row[0] += 1
        row[1] += float(dur)
        row[2].add(e["cat"])
    if not steps:
        raise ValueError(f"this trace has no ProfilerStep#N events, so it has no iterations to compare. To get "
                         f"them, {_HOW_TO_STEP}.")
    return rows, steps


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
    reading = _reading()
    if reading is not None:
        return explain_rows(reading.summary(control), reading.summary(test), calls=calls, top=top)
    (a, steps_a), (b, steps_b) = _rough_rows(control), _rough_rows(test)
    # per step (the traces may hold different numbers of steps), counts kept whole: each side is
    # scaled by the other's steps, and the calls by both
    a = {n: [c * steps_b, t * steps_b, cats] for n, (c, t, cats) in a.items()}
    b = {n: [c * steps_a, t * steps_a, cats] for n, (c, t, cats) in b.items()}
    return explain_rows(a, b, calls=calls * steps_a * steps_b, top=top)


def summary(trace: TraceSource, iteration: Iteration = None) -> dict[str, list]:
    """``{name: [count, total us, [categories]]}`` of one iteration's CPU events (HTA's reading,
    ``course.references.traces.summary``): the little that :func:`explain_rows` needs, plain enough to
    cross a process boundary as data. The grader's alone: in a learner's copy it raises."""
    reading = _reading()
    if reading is None:
        raise RuntimeError("summary reads a trace as the lesson's op_table exercise does, so it is the grader's "
                           "alone; use your own op_table, or explain_diff for sentences.")
    return reading.summary(trace, iteration)


def explain_rows(control: Mapping[str, Any], test: Mapping[str, Any], *, calls: float = 1, top: int = 5) -> list[str]:
    """:func:`explain_diff` from two :func:`summary` tables instead of two traces."""
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

"""Why a speed check failed: what the profiler saw the learner's code run that the course's
solution does not (lesson 8's trace diff, put to work for every lesson's speed checks).

A failed speed check used to say only "1.1x, bar 1.5x". :func:`why_slower` profiles one call of the
learner's function and one of the course's solution on the same inputs (from the check's timing
factory), and turns the difference into sentences: "2 extra aten::copy_ per call (1.2 ms)",
"no aten::_scaled_dot_product_flash_attention_for_cpu ran (the reference runs it once per call)".
Under the grader the learner's call is profiled where it lives, by the course's probe
(:func:`profile_events`): what comes back is a list of plain events, which the judge reads with
its own code. That process could send anything: the sentences are feedback, never a grade, and a
malformed reply gives no sentences, not an error.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from course import traces
from course.remote import FACTORIES, probe, prober

__all__ = ["profile_events", "why_slower"]

#: Most events a profile sends back (a loop over thousands of items makes tens of thousands).
MAX_EVENTS = 20_000
#: A call slower than this (seconds, from the timing) is not profiled again just to explain it.
MAX_CALL_S = 5.0


def _profile(fn: Callable, factory_name: str, sizes: dict, constants: Sequence[Any], device: str, grad: bool,
             seed: int, threads: int | None = None) -> dict:
    from course.devices import asked_threads, threads as pinned
    from course.remote import _registered

    make = _registered(FACTORIES, factory_name, "factory")
    # inputs of its own for each call (made before the profile): an answer that remembers its
    # inputs is profiled doing its work, not answering from memory
    calls = iter([make(seed + i, device=device, **sizes) for i in range(2)])
    # the threads the timing used: PyTorch picks another kernel for another count (on a CPU, a 1x1
    # convolution of a small batch is oneDNN's with two threads and the plain one with one)
    with torch.set_grad_enabled(grad), pinned(asked_threads(threads, device)):
        return traces.profile_steps(lambda: fn(*next(calls), *constants), steps=1, warmup=1)


def _compact(trace: dict) -> list[list]:
    """The trace's timed events as ``[name, cat, ts, dur, stream]`` (``stream``: ``args["stream"]``,
    or None), the steps first, as they are: the judge reads them with HTA's reading
    (``course.references.traces``), which the learner's process, where this runs, does not have."""
    events = []
    for e in trace["traceEvents"]:
        if not isinstance(e, dict) or not isinstance(e.get("name"), str) or not isinstance(e.get("cat"), str):
            continue
        ts, dur = e.get("ts"), e.get("dur")
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in (ts, dur)):
            continue
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        stream = args.get("stream")
        stream = stream if isinstance(stream, (int, float, str)) and not isinstance(stream, bool) else None
        events.append([e["name"], e["cat"], ts, dur, stream])
    steps = [e for e in events if e[0].startswith("ProfilerStep#")]
    rest = [e for e in events if not e[0].startswith("ProfilerStep#")]
    return steps + rest[:MAX_EVENTS]


@prober
def profile_events(fn: Callable, factory_name: str, sizes: dict, constants: list, device: str, grad: bool,
                   seed: int, threads: int | None = None) -> list[list]:
    """Run where ``fn`` lives: one warm-up call and one profiled call of ``fn``, on the factory's
    inputs for ``seed`` and ``seed + 1``, with ``threads`` intra-op threads on a CPU (the judge's);
    the profiled step's CPU events, compact (see :func:`_compact`)."""
    return _compact(_profile(fn, factory_name, sizes, constants, device, grad, seed, threads))


def _as_trace(events: Any) -> dict | None:
    """A trace rebuilt from what the probe sent (:func:`_compact`), or None where it is not a list of
    events."""
    if not isinstance(events, list) or len(events) > MAX_EVENTS + 64:
        return None
    out = []
    for e in events:
        if (not isinstance(e, (list, tuple)) or len(e) != 5 or not all(isinstance(x, str) for x in e[:2])
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                           for x in e[2:4])
                or not (e[4] is None or isinstance(e[4], (int, float, str)) and not isinstance(e[4], bool))):
            return None
        out.append({"ph": "X", "name": e[0], "cat": e[1], "ts": e[2], "dur": e[3],
                    "args": {} if e[4] is None else {"stream": e[4]}})
    return {"traceEvents": out}


def course_solution(reference: Callable | str) -> Callable | None:
    """``reference`` itself, or the course function it names (``"course.references.explain.x"``);
    None where that module is absent (the learners' bundle leaves ``course/references`` out)."""
    if callable(reference):
        return reference
    import importlib

    module, _, name = str(reference).rpartition(".")
    if not module.startswith("course."):
        return None
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def why_slower(candidate: Callable, reference: Callable | str, *, factory: Callable, sizes: dict,
               constants: Sequence[Any] = (), device: torch.device, grad: bool = False, seconds_per_call: float = 0.0,
               top: int = 6) -> list[str]:
    """Sentences on what ``candidate`` ran that ``reference`` (the course's solution) did not, on the
    same inputs; ``[]`` when nothing notable, when a call is too slow to profile again
    (``seconds_per_call``), or when the candidate's profile cannot be read."""
    import secrets

    reference = course_solution(reference)
    if seconds_per_call > MAX_CALL_S or reference is None:
        return []
    from course import grader_hooks

    name = f"{factory.__module__}.{factory.__qualname__}"
    seed = secrets.randbits(31)
    # Profiled as the clock timed them: the machine to this submission alone (with --jobs 2, a
    # classmate's notebook running beside the learner's profile made its copies look 2-3x slower),
    # and the learner's process stopped while the course's solution is profiled here.
    try:
        with grader_hooks.machine_turn():
            mine = probe(candidate, profile_events, name, dict(sizes), list(constants), str(device), grad, seed,
                         torch.get_num_threads())
            test = _as_trace(mine)
            if test is None:
                return []
            with grader_hooks.learner_stopped():
                events = _compact(_profile(reference, name, dict(sizes), constants, str(device), grad, seed))
        return traces.explain_diff(_as_trace(events), test, calls=1, top=top)
    except Exception:  # feedback only: a learner's process that fails here has failed the check already
        return []

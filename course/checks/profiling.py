"""Checks for lesson 08_profiling_trace_diff: a per-iteration op table read from a Chrome trace, a
trace diff, attention through the fused kernel (numbers and measured speed), and a
happens-before checker for CUDA stream events.

Every check is ``SERVED``: under the grader it runs in the judge, and the learner's functions are
called across the boundary on inputs the judge made (traces it profiled or wrote itself from a
seed, programs drawn from a seed), as data. The references are the course's: its op table and
diff (``course.references.traces``, proved equal to Holistic Trace Analysis's in
``tests/test_traces.py``) and PyTorch's CUDA Stream Sanitizer itself
(``course.references.streams.sanitizer_races_many``). A wrong answer that matches a known mistake is
named. Those references answer the exercises, so they are the grader's alone: in a learner's copy
the checks compare with the answers stored for the lesson's own calls (:data:`DATA_FILE`, written by
``python -m course.references`` from :func:`reference_data`), and refuse other arguments.
"""

from __future__ import annotations

import functools
import json
import math
import random
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

from course import streams, traces
from course.bare import expect_value, outcome_said, run_bare
from course.checks.common import (call, expect_grads, grader_references, name_mistake, ok, record, served_speedup,
                                  stored_answers)
from course.checks.sdpa_watch import watched
from course.data import generator
from course.devices import pick_device
from course.numerics import assert_close, describe
from course.profiling import attention_inputs, naive_attention
from course.hand import again
from course.remote import mirrored, probe, prober
from course.timing import SpeedReport

__all__ = ["check_attention", "check_attention_speed", "check_find_races", "check_op_table", "check_ops_diff",
           "synthetic_trace", "workload_trace"]

SERVED = ("check_op_table", "check_ops_diff", "check_attention", "check_attention_speed", "check_find_races")

GROUPS = ("added", "deleted", "increased", "decreased", "unchanged")


# -- traces the checks read ----------------------------------------------------------------------

def _workloads(seed: int) -> dict[str, Callable[[], Any]]:
    """Small steps to profile, all on the CPU, each a few milliseconds: pairs of them differ by what
    a trace diff should find (ops added, deleted, called more or less often)."""
    g = generator(seed)
    n = 24 + seed % 17
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for _ in range(3))
    reps = 2 + seed % 3
    return {
        "matmul": lambda: a @ b,
        "matmul_relu": lambda: (a @ b).relu(),
        "matmul_clone": lambda: (a @ b).clone().contiguous().t().contiguous(),
        "adds": lambda: [a + b for _ in range(reps)],
        "more_adds": lambda: [a + b for _ in range(reps + 2)],
        "naive_attention": lambda: naive_attention(q, k, v),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
        "bf16": lambda: a.bfloat16() @ b.bfloat16(),
    }


#: Real traces of every workload (two variants each), recorded once: a check must read the same
#: trace in the instructor's run and in every submission's (the grader compares the references
#: checks used across runs), and a profile taken at check time never times the same twice.
TRACES = Path(__file__).resolve().parents[1] / "reference_data" / "08_traces.json.gz"
VARIANTS = 2


def live_trace(name: str, seed: int, steps: int = 2) -> dict:
    """A Chrome trace of the workload ``name`` (see :func:`_workloads`) profiled now, ``steps``
    iterations, slimmed to what a trace reader needs."""
    fn = _workloads(seed)[name]
    with torch.no_grad():
        trace = traces.profile_steps(fn, steps=steps, warmup=1)
    keep = ("ph", "cat", "name", "pid", "tid", "ts", "dur")
    events = []
    for e in trace["traceEvents"]:
        if not isinstance(e, dict) or e.get("ph") not in ("X", "M", "i"):
            continue
        slim = {k: e[k] for k in keep if k in e}
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        slim["args"] = {k: args[k] for k in ("stream", "device", "name") if k in args}
        events.append(slim)
    return {"schemaVersion": trace.get("schemaVersion", 1), "traceEvents": events}


def record_traces(path: Path = TRACES) -> Path:
    """Profile every workload's variants and store them (``python -m course.checks.profiling``)."""
    import gzip

    data = {f"{name}/{v}": live_trace(name, v) for name in _workloads(0) for v in range(VARIANTS)}
    data["torch"] = torch.__version__
    with gzip.GzipFile(path, "wb", mtime=0) as f:
        f.write(json.dumps(data, sort_keys=True).encode())
    return path


@functools.lru_cache(maxsize=1)
def _stored() -> dict:
    import gzip

    with gzip.open(TRACES, "rt") as f:
        return json.load(f)


def workload_trace(name: str, seed: int) -> dict:
    """A real trace of the workload ``name`` (a stored one), made a trace of its own by ``seed``:
    shifted in time, its steps renumbered, about one op in ten left out and its events in another
    order. The same seed gives the same trace in every run; no two seeds give the same answer, so
    answers cannot be looked up by trace."""
    rng = random.Random(seed * 7919 + sum(map(ord, name)))
    base = _stored()[f"{name}/{seed % VARIANTS}"]
    shift, renumber = float(rng.randint(1, 10**6)), rng.randint(0, 40)
    events = []
    for e in base["traceEvents"]:
        e = dict(e)
        if "ts" in e:
            e["ts"] = e["ts"] + shift
        step = traces._STEP.fullmatch(str(e.get("name", "")))
        if step:
            e["name"] = f"ProfilerStep#{int(step.group(1)) + renumber}"
        elif e.get("cat") == "cpu_op" and rng.random() < 0.1:
            continue
        events.append(e)
    rng.shuffle(events)
    return {"schemaVersion": base.get("schemaVersion", 1), "traceEvents": events, "traceName": f"{name}-{seed}"}


def synthetic_trace(seed: int, *, ops: tuple[str, ...] = ()) -> dict:
    """A small hand-made trace, as the profiler writes them, with what a careless reader gets wrong:
    several iterations (not in order, not from 1), ops between iterations and one starting exactly
    at a step's end (a window is ``[ts, ts + dur)``), nested ops, labels of
    the user's own (``user_annotation``), Python frames, a GPU kernel and its runtime launch, and
    events that are not complete events (``"ph": "i"``, metadata). ``ops``: names drawn from."""
    rng = random.Random(seed)
    names = list(ops) or ["aten::mm", "aten::add", "aten::relu", "aten::copy_", "aten::empty", "aten::t",
                          "aten::transpose", "aten::_softmax", "aten::bmm"]
    first = rng.randint(3, 40)
    steps = rng.sample(range(first, first + 6), rng.randint(2, 4))
    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}}]
    t = float(rng.randint(1000, 5000))
    for step in steps:
        gap = rng.uniform(5, 40)
        # an op between iterations: in no window
        events.append(_x("cpu_op", rng.choice(names), t, gap / 2))
        t += gap
        length = 0.0
        inner = []
        cursor = t + 1.0
        for _ in range(rng.randint(3, 9)):
            name = rng.choice(names)
            dur = round(rng.uniform(1, 60), 3)
            inner.append(_x("cpu_op", name, cursor, dur))
            if rng.random() < 0.4:  # a nested op, inside the one before
                inner.append(_x("cpu_op", rng.choice(names), cursor + 0.1, round(dur / 3, 3)))
            if rng.random() < 0.25:
                inner.append(_x("user_annotation", f"my_label_{rng.randint(0, 2)}", cursor, dur))
            if rng.random() < 0.25:
                inner.append(_x("python_function", "torch/nn/modules/module.py(1750): _call_impl", cursor, dur))
            if rng.random() < 0.2:
                inner.append(_x("cuda_runtime", "cudaLaunchKernel", cursor + 0.2, 2.0))
                inner.append(_x("kernel", "void gemm_kernel<float>()", cursor + 3.0, 10.0, tid=7, stream=7))
            if rng.random() < 0.1:
                inner.append({"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "ts": cursor, "pid": 1,
                              "tid": 1, "s": "t", "args": {}})
            cursor += dur + rng.uniform(0.5, 3)
        length = cursor - t + 1.0
        marker = _x("user_annotation", f"ProfilerStep#{step}", t, round(length, 3))
        events.append(marker)
        events.extend(inner)
        if rng.random() < 0.6:  # an op that starts exactly where the step ends: in no iteration
            events.append(dict(_x("cpu_op", rng.choice(names), 0.0, 2.0), ts=marker["ts"] + marker["dur"]))
        t += length + rng.uniform(1, 10)
    rng.shuffle(events)  # a trace's events need not be in time order
    return {"schemaVersion": 1, "deviceProperties": [], "traceEvents": events, "traceName": f"synthetic-{seed}"}


def _x(cat: str, name: str, ts: float, dur: float, *, tid: int = 1, stream: int | None = None) -> dict:
    event = {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": round(ts, 3), "dur": dur, "args": {}}
    if stream is not None:
        event["args"] = {"stream": stream, "device": 0}
        event["pid"] = 0
    return event


def _table(got: Any, label: str) -> dict[str, tuple[int, float]]:
    """The learner's table as ``{name: (count, total)}``, or a clear message about its shape."""
    if not isinstance(got, Mapping):
        raise AssertionError(f"{label} should return a dict {{op name: (count, total microseconds)}}, got "
                             f"{describe(got)}.")
    out = {}
    for name, value in got.items():
        if (not isinstance(name, str) or not isinstance(value, (tuple, list)) or len(value) != 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)):
            raise AssertionError(f"{label}: every entry should be 'op name': (count, total microseconds); "
                                 f"got {name!r}: {value!r}.")
        out[name] = (value[0], float(value[1]))
    return out


def _same(got: dict, want: dict) -> bool:
    """The same names and counts, and totals equal but for the order of summing."""
    return got == want or (set(got) == set(want) and all(
        got[n][0] == want[n][0] and math.isclose(got[n][1], want[n][1], rel_tol=1e-9, abs_tol=1e-6) for n in want))


def _compare_tables(got: dict, want: dict, label: str, mistakes: dict) -> None:
    if _same(got, want):
        record({n: [got[n][0], got[n][1]] for n in sorted(got)}, {n: [want[n][0], want[n][1]] for n in sorted(want)},
               label)
        return
    _name_table_mistake(got, want, label, mistakes)
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    counts = sorted(n for n in set(got) & set(want) if got[n][0] != want[n][0])
    parts = []
    if missing:
        parts.append(f"ops missing: {missing[:6]}")
    if extra:
        parts.append(f"ops that should not be there: {extra[:6]}")
    if counts:
        parts.append("counts off: " + ", ".join(f"{n} {got[n][0]} (expected {want[n][0]})" for n in counts[:4]))
    if not parts:
        worst = max(want, key=lambda n: abs(got[n][1] - want[n][1]))
        parts.append(f"totals off: {worst} {got[worst][1]:.6g} us (expected {want[worst][1]:.6g})")
    raise AssertionError(f"{label} is wrong: " + "; ".join(parts) + ".")


def _name_table_mistake(got: dict, want: dict, label: str, mistakes: dict) -> None:
    """Raise naming the mistake when the learner's table is what a known misreading gives
    (``mistakes``: :func:`course.references.traces.table_mistakes`, or those stored)."""
    name_mistake(label, got, want, mistakes, same=_same)


# -- the answers: the grader's references, or those stored for the lesson's own calls --------------

#: What a learner's copy compares the visible calls with (``python -m course.references`` writes it).
DATA_FILE = streams.DATA_FILE


def _stored_answers(kind: str, seed: int, n: int) -> list:
    """The answers stored for ``kind``'s check at the lesson's own call, refused for other arguments."""
    entry = stored_answers(DATA_FILE)[kind]
    if (entry["seed"], entry["n"]) != (seed, n):
        raise AssertionError(f"This check has reference data for seed {entry['seed']}, n {entry['n']} only (the "
                             f"lesson's own call); the grader checks others (seed {seed}, n {n} asked for here).")
    return entry["answers"]


def _table_answers(cases: list, seed: int, n: int) -> list[tuple[dict, dict]]:
    """``(the op table, what each known misreading gives)`` of every case of :func:`check_op_table`."""
    reading = grader_references("traces")
    if reading is None:
        return [(want, mistakes) for want, mistakes in _stored_answers("op_table", seed, n)]
    return [(reading.op_table(trace, iteration, rounding=False), reading.table_mistakes(trace, iteration))
            for trace, iteration, _ in cases]


def _diff_answers(cases: list, seed: int, n: int) -> list[tuple[dict, dict]]:
    """``(ops_diff(control, test), ops_diff(test, control))`` of every case of :func:`check_ops_diff`."""
    reading = grader_references("traces")
    if reading is None:
        return [(want, flipped) for want, flipped in _stored_answers("ops_diff", seed, n)]
    return [(reading.ops_diff(control, test, rounding=False), reading.ops_diff(test, control, rounding=False))
            for control, test, _ in cases]


def _race_answers(programs: list) -> list[list[tuple]]:
    """The sanitizer's reports of every program: replayed (in one fresh process on a GPU machine, see
    ``course.references.streams.sanitizer_races_many``), or those stored (:func:`course.streams.stored_races`)."""
    refs = grader_references("streams")
    if refs is None:
        try:
            return [streams.stored_races(program) for program in programs]
        except LookupError:
            raise AssertionError("This check has reference data for the lesson's own call only (its seed and n); "
                                 "the grader checks others.") from None
    return refs.sanitizer_races_many(programs)


def _defaults(check: Callable) -> dict:
    import inspect

    return {k: p.default for k, p in inspect.signature(check).parameters.items() if k in ("seed", "n")}


def reference_data() -> dict:
    """The answers of the visible checks' own calls (their defaults), by the grader's references, for a
    learner's copy: op tables with their known misreadings, diffs both ways, and the sanitizer's
    reports by program (which ``course.streams.sanitizer_races`` serves there, the planted race
    among them)."""
    out: dict[str, Any] = {}
    for kind, check, cases, answers in (("op_table", check_op_table, _op_table_cases, _table_answers),
                                        ("ops_diff", check_ops_diff, _diff_cases, _diff_answers)):
        args = _defaults(check)
        found = answers(cases(**args), **args)
        out[kind] = {**args, "answers": [[a, b] for a, b in found]}
    programs = _race_programs(**_defaults(check_find_races))
    refs = grader_references("streams")
    races = refs.sanitizer_races_many(programs)
    out["races"] = {repr(streams._checked(p, "sanitizer_races")): [list(r) for r in rs]
                    for p, rs in zip(programs, races)}
    return out


# -- 1. the op table -----------------------------------------------------------------------------

def _op_table_cases(seed: int, n: int) -> list[tuple[dict, int | None, str]]:
    """``(trace, iteration, what)`` of every case :func:`check_op_table` asks about."""
    real = ["matmul_relu", "naive_attention", "adds", "sdpa", "matmul_clone", "bf16"]
    cases: list[tuple[dict, int | None, str]] = []
    for i in range(n):
        name = real[(seed + i) % len(real)]
        trace = workload_trace(name, seed + i)
        its = traces.iterations(trace)
        cases.append((trace, None, f"a real trace ({name.replace('_', ' ')}), first iteration"))
        cases.append((trace, its[-1], f"a real trace ({name.replace('_', ' ')}), iteration {its[-1]}"))
        synthetic = synthetic_trace(seed * 101 + i)
        its = traces.iterations(synthetic)
        cases.append((synthetic, None, "a hand-made trace, first iteration"))
        cases.append((synthetic, random.Random(seed + i).choice(its), "a hand-made trace"))
    return cases


def check_op_table(op_table: Callable, *, seed: int = 0, n: int = 3) -> None:
    """``op_table(trace, iteration=None)``: ``{name: (count, total us)}`` of the CPU ops of one
    iteration, equal to the course's (HTA's) on real traces and on hand-made ones; ``ValueError``
    for a trace without iterations and for an iteration it does not have."""
    label = "op_table"
    cases = _op_table_cases(seed, n)
    answers = _table_answers(cases, seed, n)
    wants = [want for want, _ in answers]
    for (trace, iteration, what), (want, mistakes) in zip(cases, answers):
        got = _table(call(op_table, trace, iteration, name=label), label)
        _compare_tables(got, want, f"{label} on {what}" + (f" (iteration {iteration})" if iteration is not None
                                                          else ""), mistakes)
    # what must raise
    no_steps = {"traceEvents": [e for e in synthetic_trace(seed)["traceEvents"]
                                if not str(e.get("name", "")).startswith("ProfilerStep#")]}
    raising = ((no_steps, None, "a trace without ProfilerStep events (no schedule)"),
               (synthetic_trace(seed + 1), 10_000, "an iteration the trace does not have"))
    for trace, iteration, why in raising:
        try:
            call(op_table, trace, iteration, name=label)
        except AssertionError as exc:
            if type(exc.__cause__).__name__ == "ValueError" or "ValueError" in str(exc).split(":")[0:2][-1]:
                continue
            raise
        raise AssertionError(f"{label} should raise ValueError for {why}, but it returned.")
    # Under the grader, the same program run again in a Python that has no torch and no course (the
    # bare host): what the learner's process computed could have come from the course's own tables.
    outcomes = run_bare(op_table, [[t, i] for t, i, _ in cases + list(raising)], name=label)
    if outcomes is not None:
        for (trace, iteration, what), want, outcome in zip(cases, wants, outcomes):
            where = f"{label}, run without torch or the course, on {what}"
            if not _same(_table(expect_value(outcome, where, _BARE), where), want):
                raise AssertionError(f"{where} returned another table than in your notebook: {_BARE}")
        for (_, _, why), outcome in zip(raising, outcomes[len(cases):]):
            if outcome.get("raised") != "ValueError":
                raise AssertionError(f"{label}, run without torch or the course, should raise ValueError for {why}; "
                                     f"{outcome_said(outcome)}. {_BARE}")
    ok(f"{label} matches the reference on {len(cases)} traces (real and hand-made, seed {seed}) and raises "
       "ValueError where it should")


#: What a check says when the answer run again without torch or the course differs from the answer
#: in the learner's process.
_BARE = ("the grader runs this exercise's answer again in a Python that has only its standard library (no torch, "
         "no course package), so write it in plain Python, defining with def every helper it calls.")


# -- 2. the diff ---------------------------------------------------------------------------------

PAIRS = [("naive_attention", "sdpa"), ("matmul", "matmul_relu"), ("adds", "more_adds"), ("matmul_clone", "matmul"),
         ("more_adds", "adds"), ("matmul", "bf16"), ("sdpa", "sdpa")]


def _groups(got: Any, label: str) -> dict[str, list[str]]:
    if not isinstance(got, Mapping) or set(got) != set(GROUPS):
        raise AssertionError(f"{label} should return a dict with the keys {list(GROUPS)}, got {describe(got)}"
                             + (f" with keys {sorted(map(str, got))}" if isinstance(got, Mapping) else "") + ".")
    out = {}
    for key in GROUPS:
        value = got[key]
        if not isinstance(value, (list, tuple)) or not all(isinstance(x, str) for x in value):
            raise AssertionError(f"{label}[{key!r}] should be a sorted list of op names, got {describe(value)}.")
        out[key] = list(value)
    return out


def _diff_cases(seed: int, n: int) -> list[tuple[dict, dict, str]]:
    """``(control, test, what)`` of every pair :func:`check_ops_diff` asks about."""
    cases = []
    for i in range(n):
        a, b = PAIRS[(seed + i) % len(PAIRS)]
        cases.append((workload_trace(a, seed + i), workload_trace(b, seed + i), f"{a} -> {b}"))
        pool = ("aten::mm", "aten::add", "aten::relu", "aten::copy_", "aten::bmm", "aten::_softmax")
        cases.append((synthetic_trace(seed * 7 + i, ops=pool), synthetic_trace(seed * 7 + i + 1000, ops=pool[1:]),
                      "two hand-made traces"))
    return cases


def check_ops_diff(ops_diff: Callable, *, seed: int = 0, n: int = 3) -> None:
    """``ops_diff(control, test)``: the five groups of ops, sorted, equal to the course's (HTA's
    ``ops_diff``) on pairs of real traces and of hand-made ones."""
    label = "ops_diff"
    cases = _diff_cases(seed, n)
    answers = _diff_answers(cases, seed, n)
    wants = [want for want, _ in answers]
    for (control, test, what), (want, flipped) in zip(cases, answers):
        got = _groups(call(ops_diff, control, test, name=label), label)
        name = f"{label} ({what})"
        if got != want:
            if got == flipped:
                raise AssertionError(f"{name} is wrong; it looks as if control and test were swapped (added is "
                                     "what the test trace has and the control does not).")
            for key in GROUPS:
                if sorted(got[key]) == want[key] and got[key] != want[key]:
                    raise AssertionError(f"{name}[{key!r}] holds the right ops, but not sorted.")
        record(got, want, name)
    outcomes = run_bare(ops_diff, [[control, test] for control, test, _ in cases], name=label)  # see check_op_table
    for (_, _, what), want, outcome in zip(cases, wants, outcomes or ()):
        where = f"{label}, run without torch or the course ({what})"
        if _groups(expect_value(outcome, where, _BARE), where) != want:
            raise AssertionError(f"{where} returned other groups than in your notebook: {_BARE}")
    ok(f"{label} matches the reference on {len(cases)} pairs of traces (seed {seed})")


# -- 3. attention --------------------------------------------------------------------------------

def _attention_reference(q, k, v, causal):
    return naive_attention(q.double(), k.double(), v.double(), causal=causal)


def _attention_numbers(attention: Callable, label: str, seed: int, dev: torch.device) -> None:
    """Equal to the naive formula in float64, causal or not, keys longer than queries too, with its
    gradients; close in float32, keeping the dtype. A known mistake is named."""
    g = generator(seed)
    shapes = [(2, 3, 7, 7, 8), (1, 2, 5, 9, 4), (3, 1, 16, 16, 16)]
    for b, h, lq, lk, d in shapes:
        for causal in (False, True):
            q = torch.randn(b, h, lq, d, generator=g, dtype=torch.float64).to(dev)
            k = torch.randn(b, h, lk, d, generator=g, dtype=torch.float64).to(dev)
            v = torch.randn(b, h, lk, d, generator=g, dtype=torch.float64).to(dev)
            want = _attention_reference(q, k, v, causal)
            name = f"{label}(q {tuple(q.shape)}, k {tuple(k.shape)}, causal={causal})"
            ins = [t.clone().requires_grad_() for t in (q, k, v)]
            with mirrored(attention):
                got = call(attention, *ins, causal=causal, name=label)
            if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
                raise AssertionError(f"{name} should be a tensor of shape {tuple(want.shape)}, got {describe(got)}.")
            if not torch.allclose(got.detach(), want, rtol=1e-7, atol=1e-9):
                other = _attention_reference(q, k, v, not causal)
                if torch.allclose(got.detach(), other, rtol=1e-7, atol=1e-9) and not torch.allclose(other, want):
                    raise AssertionError(f"{name} is wrong; it looks as if causal was "
                                         f"{'ignored' if causal else 'always on'}. Pass is_causal=causal.")
                unscaled = torch.softmax(q @ k.transpose(-2, -1), -1) @ v
                if not causal and torch.allclose(got.detach(), unscaled, rtol=1e-7, atol=1e-9):
                    raise AssertionError(f"{name} is wrong; the scores were not divided by sqrt(d).")
            assert_close(got, want, name=name, rtol=1e-7, atol=1e-9)
            ref_ins = [t.clone().requires_grad_() for t in (q, k, v)]
            expect_grads(got, _attention_reference(*ref_ins, causal), ins, ref_ins, ["q", "k", "v"], label=name,
                         rtol=1e-6, atol=1e-8)
    q, k, v = attention_inputs(seed, device=str(dev), batch=2, heads=2, length=33, dim=16)
    with torch.no_grad():
        got = call(attention, q, k, v, name=label)
    assert_close(got, _attention_reference(q, k, v, False), name=f"{label} in float32", rtol=1e-4, atol=1e-5,
                 check_dtype=False)
    if isinstance(got, torch.Tensor) and got.dtype != torch.float32:
        raise AssertionError(f"{label} in float32 returned {got.dtype}; keep the inputs' dtype.")


@prober
def attention_sdpa_calls(attention: Callable, q, k, v, causal: bool) -> list[dict]:
    """The learner's side: run ``attention`` once and report how it called SDPA
    (:func:`course.checks.sdpa_watch.watched`)."""
    return watched(attention, "attention", q, k, v, causal=causal)[1]


def _fused(attention: Callable, label: str, seed: int, dev: torch.device) -> None:
    """Causal and not, keys longer than queries: ``attention`` called SDPA exactly once, on q, k and
    v as given, and returned what that call returned (the watcher's report: the learner's process's
    word, or the program host's for the program the judge read). Right numbers computed another way
    (the naive formula, a loop over heads of SDPA) are not this exercise's answer."""
    g = generator(seed + 1)
    use = ("Call F.scaled_dot_product_attention once, on the whole batch (q, k and v as given, the mask by is_causal), "
           "and return its output: that one call runs PyTorch's fused kernel.")
    for causal in (False, True):
        q = torch.randn(2, 2, 5, 8, generator=g, dtype=torch.float64).to(dev)
        k, v = (torch.randn(2, 2, 7, 8, generator=g, dtype=torch.float64).to(dev) for _ in range(2))
        calls = probe(attention, attention_sdpa_calls, q, k, v, causal)
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise AssertionError(f"{label} could not be watched (got {describe(calls)}).")
        if not calls:
            raise AssertionError(f"{label} gives the right numbers without calling F.scaled_dot_product_attention: "
                                 f"this exercise is the fused kernel's. {use}")
        if len(calls) != 1:
            raise AssertionError(f"{label} called F.scaled_dot_product_attention {len(calls)} times for one batch "
                                 f"(causal={causal}). {use}")
        seen = calls[0]
        if seen.get("mask") == "unseen":
            raise AssertionError(f"{label} called F.scaled_dot_product_attention where the course's watcher could "
                                 f"not see it (inside another torch function's arguments). {use}")
        want = [list(q.shape), list(k.shape), list(v.shape)]
        if seen.get("shapes") != want or seen.get("result") is not True:
            raise AssertionError(f"{label} called SDPA on {seen.get('shapes')} and returned "
                                 f"{'its output' if seen.get('result') is True else 'something else'}, for q, k, v "
                                 f"of {want}. {use}")


def check_attention(attention: Callable, *, seed: int = 0, device=None) -> None:
    """``attention(q, k, v, causal=False)``: ``softmax(q k^T / sqrt(d)) v`` for ``(B, H, L, D)``
    inputs (keys longer than queries allowed), causal masks aligned to the top left, equal to the
    naive formula in float64 with its gradients, and close in float32; through one call of
    ``F.scaled_dot_product_attention`` that returns the answer, as watched where it runs and, under
    the grader, on its program run again in the program host (:func:`course.hand.again`)."""
    dev = pick_device(device)
    label = "attention"
    _attention_numbers(attention, label, seed, dev)
    _fused(attention, label, seed, dev)
    again(attention, label, lambda program, name: (_attention_numbers(program, name, seed, dev),
                                                   _fused(program, name, seed, dev)))
    ok(f"{label} matches softmax(q k^T / sqrt(d)) v, causal or not, with its gradients, through one call of "
       f"F.scaled_dot_product_attention (seed {seed})")


def check_attention_speed(attention: Callable, *, bars: Mapping[str, float], batch: int, heads: int, length: int,
                          dim: int, causal: bool = True, num_threads: int | None = None, rounds: int = 7,
                          min_run_time: float = 0.2, attempts: int = 3, device=None) -> SpeedReport:
    """``attention(q, k, v, causal)`` is at least ``bars[device]`` times as fast as
    ``naive_attention``, side by side on fresh inputs, every output checked; below the bar, the
    message names what the profiler saw your code run that the course's solution does not."""
    dev = pick_device(device)
    sizes = dict(batch=batch, heads=heads, length=length, dim=dim)
    q, k, v = attention_inputs(12345, device=str(dev), batch=1, heads=2, length=min(length, 64), dim=dim)
    with torch.no_grad():
        got = call(attention, q, k, v, causal, name="attention")
    assert_close(got, naive_attention(q, k, v, causal), name="attention on inputs like the timed ones", rtol=1e-4,
                 atol=1e-5, hint="the timed function must be right before it is fast.")
    return served_speedup(("naive", naive_attention), ("yours", attention), factory=attention_inputs, sizes=sizes,
                          constants=(causal,), bars=bars, num_threads=num_threads, device=dev, rounds=rounds,
                          min_run_time=min_run_time, attempts=attempts, rtol=1e-3,
                          explain="course.references.explain.attention",
                          hint="F.scaled_dot_product_attention runs one fused kernel that never builds the "
                               "(B, H, L, L) score matrix" + (" and skips the blocks the causal mask hides."
                                                              if causal else "."))


# -- 5. stream races -----------------------------------------------------------------------------

def _edge_programs() -> list[list[tuple]]:
    return [
        streams.planted_race(), streams.planted_race_fixed(),
        [("launch", 1, ("x",), ()), ("launch", 2, ("x",), ())],                       # two reads: no race
        [("launch", 1, (), ("x",)), ("launch", 1, ("x",), ("y",))],                   # one stream: ordered
        [("launch", 1, (), ("x",)), ("record", "e", 1), ("wait", 2, "e"), ("launch", 2, ("x",), ("z",)),
         ("record", "f", 2), ("wait", 0, "f"), ("launch", 0, ("z", "x"), ())],      # a chain over three streams
        [("record", "e", 1), ("launch", 1, (), ("x",)), ("wait", 0, "e"), ("launch", 0, ("x",), ())],  # too early
        [("launch", 1, (), ("x",)), ("sync_device",), ("launch", 0, ("x",), ("x",))],
        [("launch", 1, (), ("x",)), ("sync_stream", 1), ("launch", 2, ("x",), ())],
        [("launch", 1, (), ("x",)), ("record", "e", 1), ("sync_event", "e"), ("launch", 3, (), ("x",))],
        [("launch", 1, (), ("x",)), ("record", "e", 1), ("launch", 1, (), ("y",)), ("record", "e", 1),
         ("wait", 0, "e"), ("launch", 0, ("x", "y"), ())],                            # recorded twice: the later
        [("wait", 0, "never"), ("launch", 1, (), ("x",)), ("launch", 0, ("x",), ())],  # never recorded
        [("launch", 1, ("x",), ()), ("launch", 2, ("x",), ()), ("launch", 0, (), ("x",))],  # two reads, one write
        [("launch", 1, (), ("x",)), ("free", "x"), ("launch", 0, ("x",), ())],        # freed: a new tensor
        [("launch", 1, (), ("x",)), ("launch", 0, ("x",), ("x",))],                   # read and written: a write
    ]


def _races(got: Any, label: str) -> list[tuple]:
    if not isinstance(got, (list, tuple)):
        raise AssertionError(f"{label} should return a list of (launch index, kind, tensor, other stream), got "
                             f"{describe(got)}.")
    out = []
    for r in got:
        if not isinstance(r, (list, tuple)) or len(r) != 4:
            raise AssertionError(f"{label}: every report should be (launch index, kind, tensor, other stream), got "
                                 f"{r!r}.")
        out.append(tuple(r))
    return out


def _race_programs(seed: int, n: int) -> list[list[tuple]]:
    """The programs :func:`check_find_races` asks about: the edge cases, then ``n`` drawn from ``seed``."""
    rng = random.Random(seed)
    return _edge_programs() + [
        streams.random_events(rng.randrange(2**31), n=rng.randint(5, 40), streams=rng.randint(2, 4),
                              tensors=rng.randint(1, 5), events=rng.randint(1, 3)) for _ in range(n)]


def check_find_races(find_races: Callable, *, seed: int = 0, n: int = 120) -> None:
    """``find_races(program)`` reports exactly what PyTorch's CUDA Stream Sanitizer reports, in the
    same order, on hand-made edge cases and on ``n`` random programs drawn from ``seed``."""
    label = "find_races"
    programs = _race_programs(seed, n)
    racy = 0
    wants = _race_answers(programs)
    for i, (program, want) in enumerate(zip(programs, wants)):
        got = _races(call(find_races, [tuple(e) for e in program], name=label), label)
        racy += bool(want)
        if got != want:
            shown = "\n    ".join(map(repr, program)) if len(program) <= 14 else f"{len(program)} events"
            if sorted(got, key=repr) == sorted(want, key=repr):
                raise AssertionError(f"{label} finds the right races but in another order on this program:\n    "
                                     f"{shown}\n  expected {want}\n  got      {got}\n  Order: by launch; within one, "
                                     "the read tensors first, then the written ones; reads since a write in program "
                                     "order.")
            extra = [r for r in got if r not in want]
            missing = [r for r in want if r not in got]
            raise AssertionError(f"{label} disagrees with the CUDA Stream Sanitizer on this program:\n    {shown}\n"
                                 f"  missing: {missing[:4]}\n  reported but not a race: {extra[:4]}")
        record(got, want, f"{label} on program {i}")
    outcomes = run_bare(find_races, [[program] for program in programs], name=label)  # see check_op_table
    for i, (want, outcome) in enumerate(zip(wants, outcomes or ())):
        where = f"{label}, run without torch or the course, on program {i}"
        if _races(expect_value(outcome, where, _BARE), where) != want:
            raise AssertionError(f"{where} reported other races than in your notebook: {_BARE}")
    ok(f"{label} agrees with the CUDA Stream Sanitizer on {len(programs)} programs ({racy} with races, seed {seed})")


if __name__ == "__main__":
    print(f"wrote {record_traces()}")

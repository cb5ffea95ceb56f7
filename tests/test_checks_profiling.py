"""Lesson 8's checks: the instructor's solutions pass; the untouched stubs and the planted mistakes a
learner would make fail every check, most with their cause named; a failed speed check names what
the profiler saw (and a learner's process that sends junk back costs the explanation, never the
check)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from autograder.solution_code import load_solution, solution_source
from course.checks.profiling import (check_attention, check_attention_speed, check_find_races, check_op_table,
                                     check_ops_diff, synthetic_trace)
from course.checks.why_slow import _as_trace, why_slower
from course.profiling import attention_inputs, naive_attention

LESSON = "08_profiling_trace_diff"


@pytest.fixture(scope="module")
def sol(tmp_path_factory):
    return load_solution(solution_source(LESSON), tmp_path_factory.mktemp("sol8") / "checks_profiling.py", "l08c")


def stub(*args, **kwargs):
    raise NotImplementedError()


# -- the solutions pass, the stubs fail ----------------------------------------------------------

def test_the_solutions_pass_every_check(sol):
    check_op_table(sol.op_table)
    check_ops_diff(sol.ops_diff)
    check_attention(sol.attention)
    check_find_races(sol.find_races)


@pytest.mark.parametrize("check", [check_op_table, check_ops_diff, check_attention, check_find_races])
def test_the_untouched_stub_fails(check):
    with pytest.raises(AssertionError, match="not written yet"):
        check(stub)


# -- op_table: the misreadings of a trace ----------------------------------------------------------

def _events(trace):
    return [e for e in trace["traceEvents"] if "dur" in e and e.get("cat") not in (None, "Trace")]


def _window(events, iteration):
    steps = {int(e["name"].split("#")[1]): (e["ts"], e["ts"] + e["dur"]) for e in events
             if e["name"].startswith("ProfilerStep#")}
    if not steps:
        raise ValueError("no ProfilerStep")
    if iteration is None:
        iteration = min(steps)
    if iteration not in steps:
        raise ValueError(f"no iteration {iteration}")
    return steps[iteration]


def _tally(events):
    out = {}
    for e in events:
        c, t = out.get(e["name"], (0, 0.0))
        out[e["name"]] = (c + 1, t + e["dur"])
    return out


def _cpu(e):
    return not isinstance((e.get("args") or {}).get("stream"), (int, float))


def every_iteration(trace, iteration=None):
    events = _events(trace)
    _window(events, iteration)
    return _tally(e for e in events if _cpu(e))


def only_cpu_ops(trace, iteration=None):
    events = _events(trace)
    start, end = _window(events, iteration)
    return _tally(e for e in events if _cpu(e) and e.get("cat") == "cpu_op" and start <= e["ts"] < end)


def with_gpu_work(trace, iteration=None):
    events = _events(trace)
    start, end = _window(events, iteration)
    return _tally(e for e in events if start <= e["ts"] < end)


def last_iteration(trace, iteration=None):
    events = _events(trace)
    steps = sorted(int(e["name"].split("#")[1]) for e in events if e["name"].startswith("ProfilerStep#"))
    start, end = _window(events, steps[-1] if iteration is None and steps else iteration)
    return _tally(e for e in events if _cpu(e) and start <= e["ts"] < end)


def end_inclusive(trace, iteration=None):
    events = _events(trace)
    start, end = _window(events, iteration)
    return _tally(e for e in events if _cpu(e) and start <= e["ts"] <= end + 1.0)


def never_raises(trace, iteration=None):
    try:
        return _right(trace, iteration)
    except ValueError:
        return {}


def _right(trace, iteration=None):
    events = _events(trace)
    start, end = _window(events, iteration)
    return _tally(e for e in events if _cpu(e) and start <= e["ts"] < end)


def mean_not_total(trace, iteration=None):
    return {k: (c, t / c) for k, (c, t) in _right(trace, iteration).items()}


def test_a_right_table_written_independently_passes():
    check_op_table(_right)


@pytest.mark.parametrize("wrong, named", [
    (every_iteration, "every iteration"), (only_cpu_ops, "only 'cat' == 'cpu_op'"), (with_gpu_work, "GPU work"),
    (last_iteration, "last iteration"), (end_inclusive, None), (never_raises, "should raise ValueError"),
    (mean_not_total, "totals off")])
def test_op_table_mistakes_fail_and_are_named(wrong, named):
    with pytest.raises(AssertionError) as exc:
        check_op_table(wrong, seed=3)
    if named:
        assert named in str(exc.value), str(exc.value)


def test_the_hand_made_traces_hold_what_a_careless_reader_gets_wrong():
    trace = synthetic_trace(4)
    cats = {e.get("cat") for e in trace["traceEvents"]}
    assert {"cpu_op", "user_annotation"} <= cats and None in cats  # metadata
    steps = [e for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")]
    assert len(steps) >= 2


# -- ops_diff ------------------------------------------------------------------------------------

def _groups(a, b):
    out = {k: [] for k in ("added", "deleted", "increased", "decreased", "unchanged")}
    for name in sorted(set(a) | set(b)):
        ca, cb = a.get(name, (0, 0))[0], b.get(name, (0, 0))[0]
        key = ("added" if ca == 0 else "deleted" if cb == 0 else "increased" if cb > ca else
               "decreased" if cb < ca else "unchanged")
        out[key].append(name)
    return out


def swapped(control, test):
    return _groups(_right(test), _right(control))


def unsorted(control, test):
    return {k: sorted(v, reverse=True) for k, v in _groups(_right(control), _right(test)).items()}


def by_time_not_count(control, test):
    a, b = _right(control), _right(test)
    out = {k: [] for k in ("added", "deleted", "increased", "decreased", "unchanged")}
    for name in sorted(set(a) | set(b)):
        ta, tb = a.get(name, (0, 0.0))[1], b.get(name, (0, 0.0))[1]
        key = ("added" if name not in a else "deleted" if name not in b else "increased" if tb > ta else
               "decreased" if tb < ta else "unchanged")
        out[key].append(name)
    return out


def cpu_ops_only_diff(control, test):
    return _groups(only_cpu_ops(control), only_cpu_ops(test))


@pytest.mark.parametrize("wrong, named", [(swapped, "swapped"), (unsorted, "not sorted"),
                                          (by_time_not_count, None), (cpu_ops_only_diff, None)])
def test_ops_diff_mistakes_fail(wrong, named):
    with pytest.raises(AssertionError) as exc:
        check_ops_diff(wrong, seed=2)
    if named:
        assert named in str(exc.value), str(exc.value)


# -- attention -----------------------------------------------------------------------------------

def unscaled(q, k, v, causal=False):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=1.0)


def causal_ignored(q, k, v, causal=False):
    return F.scaled_dot_product_attention(q, k, v)


def bottom_right(q, k, v, causal=False):
    if not causal:
        return F.scaled_dot_product_attention(q, k, v)
    lq, lk = q.shape[-2], k.shape[-2]
    mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def detached(q, k, v, causal=False):
    return F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=causal)


def half_precision(q, k, v, causal=False):
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal).to(q.dtype)


def by_hand(q, k, v, causal=False):
    return naive_attention(q, k, v, causal)


def head_by_head(q, k, v, causal=False):
    return torch.cat([F.scaled_dot_product_attention(q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], is_causal=causal)
                      for h in range(q.shape[1])], dim=1)


def sdpa_for_show(q, k, v, causal=False):
    F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return naive_attention(q, k, v, causal)


@pytest.mark.parametrize("answer, message", [
    (by_hand, "gives the right numbers without calling F.scaled_dot_product_attention"),
    (head_by_head, "called F.scaled_dot_product_attention 2 times"),
    (sdpa_for_show, "and returned something else"),
])
def test_right_numbers_without_one_sdpa_call_fail(answer, message):
    """Exercise 3 is the fused kernel's: the naive formula, SDPA per head, or SDPA called for show beside
    the answer give the right numbers and fail."""
    with pytest.raises(AssertionError, match=message):
        check_attention(answer, seed=1)


@pytest.mark.parametrize("wrong, named", [(unscaled, "sqrt(d)"), (causal_ignored, "causal was ignored"),
                                          (bottom_right, None), (detached, "gradient"), (half_precision, None)])
def test_attention_mistakes_fail(wrong, named):
    with pytest.raises(AssertionError) as exc:
        check_attention(wrong, seed=1)
    if named:
        assert named in str(exc.value), str(exc.value)


# -- find_races ----------------------------------------------------------------------------------

def _checker(*, waits=True, host=True, record_barrier=False, read_read=False, every_access=False, order=True):
    """A vector-clock checker with one of a learner's mistakes switched on."""
    def find(program):
        seq, hostc, clocks, recorded, last_write, reads_since, races = 0, {}, {}, {}, {}, {}, []
        history: dict = {}

        def clock(s):
            return clocks.setdefault(s, dict(hostc) if host else {})

        def merge(into, other):
            for q, n in other.items():
                into[q] = max(into.get(q, 0), n)

        def ordered(a, c):
            return a[0] <= c.get(a[1], 0)

        for i, ev in enumerate(program):
            kind = ev[0]
            if kind == "launch":
                _, s, reads, writes = ev
                seq += 1
                c = clock(s)
                c[s] = seq
                found = []
                for t in [t for t in reads if t not in writes]:
                    w = last_write.get(t)
                    if w is not None and not ordered(w, c):
                        found.append((i, "read-after-write", t, w[1]))
                    if read_read:
                        found += [(i, "read-after-read", t, r[1]) for r in reads_since.get(t, []) if not ordered(r, c)]
                    reads_since.setdefault(t, []).append((seq, s))
                    history.setdefault(t, []).append((seq, s, "r"))
                for t in writes:
                    prior = reads_since.get(t, [])
                    if every_access:
                        found += [(i, "write-after-read" if k == "r" else "write-after-write", t, q)
                                  for n, q, k in history.get(t, []) if not ordered((n, q), c)]
                    elif prior:
                        found += [(i, "write-after-read", t, r[1]) for r in prior if not ordered(r, c)]
                    else:
                        w = last_write.get(t)
                        if w is not None and not ordered(w, c):
                            found.append((i, "write-after-write", t, w[1]))
                    last_write[t] = (seq, s)
                    reads_since[t] = []
                    history.setdefault(t, []).append((seq, s, "w"))
                races += found if order else found[::-1]
            elif kind == "record":
                recorded[ev[1]] = dict(clock(ev[2]))
                if record_barrier:
                    for other in clocks.values():
                        merge(other, recorded[ev[1]])
            elif kind == "wait":
                if waits:
                    merge(clock(ev[1]), recorded.get(ev[2], {}))
            elif kind in ("sync_stream", "sync_event", "sync_device"):
                if not host:
                    continue
                waited = (clock(ev[1]) if kind == "sync_stream" else recorded.get(ev[1], {}) if kind == "sync_event"
                          else {})
                merge(hostc, waited)
                if kind == "sync_device":
                    for c in list(clocks.values()):
                        merge(hostc, c)
                for c in clocks.values():
                    merge(c, hostc)
            elif kind == "free":
                last_write.pop(ev[1], None)
                reads_since.pop(ev[1], None)
                history.pop(ev[1], None)
        return races
    return find


def test_a_checker_written_independently_passes():
    check_find_races(_checker(), seed=4, n=200)


@pytest.mark.parametrize("mistake", [dict(waits=False), dict(host=False), dict(record_barrier=True),
                                     dict(read_read=True), dict(every_access=True), dict(order=False)])
def test_find_races_mistakes_fail(mistake):
    with pytest.raises(AssertionError, match="Sanitizer|order"):
        check_find_races(_checker(**mistake), seed=4, n=200)


# -- speed, and why it is slow ---------------------------------------------------------------------

SMALL = dict(batch=2, heads=4, length=256, dim=64, num_threads=1, rounds=5, min_run_time=0.05, attempts=1)


def test_naive_attention_fails_the_speed_check_and_the_message_says_what_ran():
    with pytest.raises(AssertionError) as exc:
        check_attention_speed(lambda q, k, v, causal=False: naive_attention(q, k, v, causal), bars={"cpu": 2.0, "cuda": 2.0},
                              **SMALL)
    text = str(exc.value)
    assert "What the profiler saw" in text, text
    assert "_scaled_dot_product_flash_attention_for_cpu ran" in text and "extra aten::" in text, text


def test_why_slower_names_an_extra_copy_and_nothing_for_the_same_code():
    dev = torch.device("cpu")
    sizes = dict(batch=1, heads=2, length=64, dim=16)
    same = why_slower(F.scaled_dot_product_attention, F.scaled_dot_product_attention, factory=attention_inputs,
                      sizes=sizes, device=dev)
    assert not [s for s in same if " extra " in s or s.startswith("no ")], same
    copied = why_slower(lambda q, k, v: F.scaled_dot_product_attention(q.contiguous().clone(), k, v),
                        F.scaled_dot_product_attention, factory=attention_inputs, sizes=sizes, device=dev)
    assert any("aten::clone" in s for s in copied), copied
    assert why_slower(stub, F.scaled_dot_product_attention, factory=attention_inputs, sizes=sizes, device=dev) == []
    assert why_slower(F.scaled_dot_product_attention, F.scaled_dot_product_attention, factory=attention_inputs,
                      sizes=sizes, device=dev, seconds_per_call=60.0) == []


@pytest.mark.parametrize("junk", [None, "events", [["a", "b", 1]], [["a", "cpu_op", float("nan"), 1.0]],
                                  [[1, "cpu_op", 0, 1]], [["a", "cpu_op", True, 1]], [["x", "cpu_op", 0, 1]] * 30_000])
def test_what_a_learners_process_sends_back_is_read_as_data_or_not_at_all(junk):
    assert _as_trace(junk) is None


# -- the traces the checks read -------------------------------------------------------------------

def test_the_stored_traces_are_what_this_torch_profiles():
    """``course/reference_data/08_traces.json.gz`` (``python -m course.checks.profiling``) holds real
    traces: the ops and counts of each workload's first iteration are what profiling it now gives."""
    from course.checks.profiling import VARIANTS, _stored, _workloads, live_trace
    from course.references import traces

    stored = _stored()
    for name in _workloads(0):
        for v in range(VARIANTS):
            counts = {k: c for k, (c, _) in traces.op_table(stored[f"{name}/{v}"], rounding=False).items()}
            now = {k: c for k, (c, _) in traces.op_table(live_trace(name, v), rounding=False).items()}
            assert counts == now, f"{name}/{v} is stale: run python -m course.checks.profiling"


def test_a_seed_makes_a_trace_of_its_own_and_always_the_same_one():
    from course.checks.profiling import workload_trace
    from course.references import traces

    a, again, b = workload_trace("naive_attention", 3), workload_trace("naive_attention", 3), \
        workload_trace("naive_attention", 5)
    assert a == again
    assert a != b and traces.op_table(a, rounding=False) != \
        traces.op_table(b, rounding=False)
    answers = {str(sorted(traces.op_table(workload_trace("adds", s), rounding=False).items())) for s in range(12)}
    assert len(answers) >= 10  # no small table of answers covers the hidden traces

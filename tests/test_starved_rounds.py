"""A busy machine never makes a slower candidate pass (issue 12).

On a shared machine another process can take the core for most of one timed block. If that block
is the baseline's, the candidate looks faster in that round; several such rounds move the median.
Every block on a CPU is therefore timed twice, by the wall clock and by the CPU time its process
used: a block that got less than half a core is starved, and its whole round is measured again
(at most ``rounds`` times, so a candidate that sleeps on purpose only makes itself slower).
Stalls are planted here as sleeps, which use no CPU, exactly like a descheduled process.
"""

from __future__ import annotations

import time

import torch

from course.devices import threads
from course.timing import STARVED, _starved, compare, compare_served


def _work(n=96):
    a = torch.randn(n, n)
    return lambda: (a @ a).sum()


def test_a_block_is_starved_when_it_got_less_than_half_a_core():
    assert _starved(0.1, 0.01) and not _starved(0.1, 0.09)
    assert not _starved(0.1, None)  # a GPU block waits: not known
    assert not _starved(0.001, 0.0)  # too short to tell
    assert not _starved(0.1, STARVED * 0.1 - 0.01, slack=0.03)  # the reading's rounding is allowed for


def test_stalls_in_the_baselines_blocks_do_not_make_a_slower_candidate_pass():
    work = _work()
    calls = {"n": 0}

    def baseline():
        calls["n"] += 1
        if 2 <= calls["n"] <= 4:  # its first three timed rounds (one call a block) are stalled
            time.sleep(0.05)
        return work()

    def slower():  # the same work, twice
        work()
        return work()

    with threads(1):
        rep = compare({"baseline": baseline, "slower": slower}, rounds=5, warmup=1, min_run_time=1e-6,
                      progress=False)
    ratio = rep.speedup("slower")
    assert ratio.median < 1.0 and ratio.verdict(1.0) != "pass", rep.table()
    assert any("measured again" in note for note in rep.notes), rep.notes


def test_a_candidate_that_sleeps_is_measured_again_a_bounded_number_of_times_and_stays_slow():
    work = _work()

    def sleeper():
        time.sleep(0.03)
        return work()

    with threads(1):
        rep = compare({"work": work, "sleeper": sleeper}, rounds=3, warmup=1, min_run_time=1e-6, progress=False)
    assert len(rep.times["sleeper"]) == 3 and rep.speedup("sleeper").median < 1.0
    assert any("3 round(s) measured again" in note for note in rep.notes), rep.notes


def test_compare_served_measures_a_starved_baseline_round_again():
    from course.checks.broadcasting import distance_inputs, naive_sq_dists
    blocks = {"n": 0}

    def baseline(x, y):
        blocks["n"] += 1
        if 3 <= blocks["n"] <= 5:
            time.sleep(0.06)
        return naive_sq_dists(x, y)

    def slower(x, y):
        naive_sq_dists(x, y)
        return naive_sq_dists(x, y)

    with threads(1):
        # blocks of real work (n=m=256, at least 20 ms): the doubled computation, not drawing the inputs
        # or crossing, decides each round
        rep = compare_served(("broadcast", baseline), ("slower", slower), factory=distance_inputs,
                             sizes=dict(n=256, m=256, d=16), device="cpu", rounds=5, warmup=1, min_run_time=0.02)
    assert rep.speedup("slower").median < 1.0, rep.table()
    assert any("measured again" in note for note in rep.notes), rep.notes


def test_a_loops_time_made_of_waiting_for_a_cpu_is_undecided_not_failed(monkeypatch):
    """The judge's clock beside the course's loop decides "a loop" at 0.8 of its time; a busy machine adds
    the crossing's waiting (the learner's main thread and the judge's, ready to run, waiting for a core)
    to every call of the learner's, and a right answer could read a loop's time (an audit, 2026-12-04).
    The scheduler counts that waiting: a reading that is a loop's only with it is undecided, never passed;
    one that is a loop's without it, or where nothing was counted, is decided as before."""
    import pytest

    from course import grader_hooks
    from course.checks.common import Clocked, clock_against_loop, expect_loop_verdict
    from course.grading import SpeedUndecided

    with pytest.raises(SpeedUndecided, match="net of the time your process and the grader waited"):
        expect_loop_verdict(Clocked(1.0, 0.2), 1.0, want_loop=False, text="answer", fail=": a loop")
    for mine in (Clocked(1.0, 0.9), Clocked(1.0, None), 1.0):
        with pytest.raises(AssertionError, match=": a loop") as caught:
            expect_loop_verdict(mine, 1.0, want_loop=False, text="answer", fail=": a loop")
        assert not isinstance(caught.value, SpeedUndecided)

    def loop(x):
        return torch.stack([row * 2 for row in x])

    def twice(x):  # a loop, twice over: a loop's time by any margin the machine leaves
        loop(x)
        return loop(x)

    def make(seed):
        return (torch.randn(400, 8, generator=torch.Generator().manual_seed(seed)),)

    # the whole path, the learner a function here: its calls' waiting as the parent would count it
    monkeypatch.setattr(grader_hooks, "learner_cpu", time.process_time)
    monkeypatch.setattr(grader_hooks, "learner_waited", lambda main=False: 0.0)  # a quiet machine
    mine, theirs = clock_against_loop(twice, "answer", make, loop, attempts=2)
    assert mine.net is not None and mine.net >= 0.5 * mine, (mine, mine.net)
    with pytest.raises(AssertionError, match=": a loop") as caught:
        expect_loop_verdict(mine, theirs, want_loop=False, text="answer", fail=": a loop")
    assert not isinstance(caught.value, SpeedUndecided), caught.value
    # kept from the CPU: a fifth of the time on one, the rest ready and waiting
    monkeypatch.setattr(grader_hooks, "learner_cpu", lambda: time.process_time() / 5)
    monkeypatch.setattr(grader_hooks, "learner_waited", lambda main=False: 2 * time.perf_counter())
    mine, theirs = clock_against_loop(twice, "answer", make, loop, attempts=2)
    assert mine.net <= 0.3 * mine, (mine, mine.net)  # (its CPU time: waiting is not work, work is)
    with pytest.raises(SpeedUndecided):
        expect_loop_verdict(mine, theirs, want_loop=False, text="answer", fail=": a loop")
    # the same waiting, but the CPU time of a loop's work: a loop (work spread over threads of its own counts)
    monkeypatch.setattr(grader_hooks, "learner_cpu", time.process_time)
    mine, theirs = clock_against_loop(twice, "answer", make, loop, attempts=2)
    assert mine.net >= 0.5 * mine, (mine, mine.net)
    with pytest.raises(AssertionError, match=": a loop") as caught:
        expect_loop_verdict(mine, theirs, want_loop=False, text="answer", fail=": a loop")
    assert not isinstance(caught.value, SpeedUndecided), caught.value


def test_a_learners_block_that_reads_starved_is_kept_never_measured_again(monkeypatch):
    """Under the grader a round was measured again when any side's block read starved, the learner's own
    included: its process could sleep in the rounds it chose (its slowest) and have them thrown away, up to
    `rounds` of them (an audit, 2026-12-04). Now only the course's starved sides are measured again; a round
    whose learner's block reads starved is kept, and counted starved (no fail: a busy machine may have done
    it), so its rounds' bound stands as measured."""
    import sys
    from pathlib import Path

    from course import grader_hooks
    from course.checks.broadcasting import distance_inputs, naive_sq_dists

    sys.path.insert(0, str(Path(__file__).parent))
    from served_helpers import served

    blocks = {"n": 0}

    def sleepy(x, y):
        blocks["n"] += 1
        if blocks["n"] % 3 == 0:
            time.sleep(0.15)  # (well past the CPU reading's slack: starved beyond doubt)
        return naive_sq_dists(x, y)

    monkeypatch.setattr(grader_hooks, "learner_cpu", time.process_time)  # the learner is a thread here
    for learner in served({"sleepy": sleepy}):
        with threads(1):
            rep = compare_served(("broadcast", naive_sq_dists), ("sleepy", learner("sleepy")), factory=distance_inputs,
                                 sizes=dict(n=256, m=256, d=16), device="cpu", rounds=5, warmup=1, min_run_time=0.02)
    assert not any("measured again" in note for note in rep.notes), rep.notes
    assert rep.starved >= 1, (rep.starved, rep.notes)

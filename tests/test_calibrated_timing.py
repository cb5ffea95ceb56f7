"""Both sides of a served speed check at one process's speed (``compare_served(calibrate=d)``).

Two processes can run the same code at speeds some percent apart for as long as they live: graded
on a 2-core Xeon, lesson 3's learner process ran the course's own block 11-13% slower than the
judge's, and the net ratio magnified that to a quarter (the right repair read 1.5x against the
course's 2.0x; on the CI machine it read 0.8x). So the baseline is timed in the learner's process
too, and the course's sides count at that process's speed, believed within ``1 + d`` of the
judge's. Checked here: a uniformly slower (or faster) process no longer moves the ratio; a learner
who slows the course's baseline in their own process gains the bound at most, however much they
slow it; only the course's own functions can be named to run there.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

import course.memory_format  # noqa: F401 - its functions are named below
from course.checks.broadcasting import distance_inputs, naive_sq_dists
from course.devices import threads
from course.remote import FACTORIES, checksum, course_function
from course.timing import _THERE, _calibrated, compare_served

BASE, CAND = "planted", "yours"
THERE = (f"{BASE} {_THERE}", "course.checks.broadcasting.naive_sq_dists")


@pytest.mark.parametrize("seed", range(40))
def test_slowing_the_baseline_in_ones_own_process_buys_the_bound_at_most(seed):
    rng = random.Random(seed)
    bound = rng.choice([0.05, 0.1, 0.25])
    n = rng.randint(1, 9)
    base = [rng.uniform(1, 3) for _ in range(n)]
    cand = [rng.uniform(0.5, 3) for _ in range(n)]
    harness = [rng.uniform(0.1, 1) for _ in range(n)]
    honest = [b * rng.uniform(1 / (1 + bound), 1 + bound) for b in base]  # a process within the bound
    slowed = [h * rng.uniform(1, 50) for h in honest]  # ... whose learner slows the baseline there
    fair, fair_h = _calibrated({BASE: base, CAND: cand, THERE[0]: honest}, harness, BASE, CAND, THERE, bound)
    gamed, gamed_h = _calibrated({BASE: base, CAND: cand, THERE[0]: slowed}, harness, BASE, CAND, THERE, bound)
    for r in range(n):
        assert fair[BASE][r] == pytest.approx(honest[r])  # within the bound: the baseline as that process runs it
        assert fair[CAND][r] == cand[r] and gamed[CAND][r] == cand[r]  # the candidate's own reading is never touched
        assert gamed[BASE][r] <= base[r] * (1 + bound) * (1 + 1e-12)
        assert gamed[BASE][r] / fair[BASE][r] <= (1 + bound) ** 2 * (1 + 1e-12)
        assert gamed_h[r] <= harness[r] * (1 + bound) * (1 + 1e-12)
    unchanged, same_h = _calibrated({BASE: base, CAND: cand}, harness, BASE, CAND, None, None)
    assert unchanged == {BASE: base, CAND: cand} and same_h == harness


class StandIn:
    """Stands in for a :class:`course.remote.Remote`: the learner's process, here, runs every block
    ``slower`` times as long as the work takes (a slower process), and the course's own function
    ``sabotage`` times as long again (a learner who slows the baseline where it runs); ``found``:
    what :func:`course.remote.disturbances` reports there."""
    __name__ = CAND

    def __init__(self, fn, slower: float = 1.0, sabotage: float = 1.0, found: tuple[str, ...] = ()):
        self.fn, self.slower, self.sabotage, self.found = fn, slower, sabotage, list(found)

    def stage(self, constants):
        return 0

    def block(self, handle, factory, sizes, seeds, device, grad=False, _fn=None, _pad=1.0):
        start = time.perf_counter()
        sums = torch.stack([checksum((_fn or self.fn)(*FACTORIES[factory](s, device=device, **sizes)))
                            for s in seeds])
        end = time.perf_counter() + (time.perf_counter() - start) * (self.slower * _pad - 1)
        while time.perf_counter() < end:  # busy, like work (a sleep would hand the core to others)
            pass
        return sums

    def course_block(self, handle, factory, sizes, seeds, device, grad=False, *, course_fn):
        return self.block(handle, factory, sizes, seeds, device, grad, course_function(course_fn),
                          self.sabotage), list(self.found)


def _ratio(monkeypatch, cand, calibrate):
    monkeypatch.setattr("course.remote.is_remote", lambda obj: isinstance(obj, StandIn))
    with threads(1):
        report = compare_served((BASE, naive_sq_dists), (CAND, cand), factory=distance_inputs,
                                sizes=dict(n=96, m=96, d=16), device="cpu", rounds=7, min_run_time=0.1,
                                calibrate=calibrate)
    return report.speedup(CAND).median, report


def test_a_slower_process_running_the_same_code_reads_the_same_speed(monkeypatch):
    plain, _ = _ratio(monkeypatch, StandIn(naive_sq_dists, slower=1.5), None)
    fair, report = _ratio(monkeypatch, StandIn(naive_sq_dists, slower=1.5), 0.7)
    assert plain < 0.8, plain  # the process's handicap (1/1.5), read as the answer's
    assert 0.8 < fair < 1.25, report.table()  # the same code, the same speed
    assert any("Your process ran planted at" in note for note in report.notes), report.notes


def test_slowing_the_course_baseline_in_ones_process_gains_the_bound_at_most(monkeypatch):
    gamed, report = _ratio(monkeypatch, StandIn(naive_sq_dists, sabotage=5.0), 0.1)
    # the planted code itself (1.0x), slowed fivefold where the course's copy runs: lifted by the bound
    # at most (1.1x; a shared machine's noise on top), never towards 5x
    assert gamed < 1.1 * 1.3, report.table()
    assert any("held to it" in note for note in report.notes), report.notes


def test_a_process_with_something_running_beside_the_course_code_is_not_believed_slow(monkeypatch):
    """Slowing the course's code in one's own process takes code that runs beside it there: a mode,
    a timer's handler, a thread, a collector callback (``disturbances``), or CPU of one's own. A round
    where any was present counts the course's sides at the grader's speed at most."""
    gamed, report = _ratio(monkeypatch, StandIn(naive_sq_dists, sabotage=5.0, found=("a thread was alive",)), 0.5)
    assert gamed < 1.25, report.table()  # the planted code itself: 1.0x, and no lift (believed, 1.5x)
    assert any("a thread was alive" in note and "not believed slower" in note for note in report.notes), report.notes


def test_cpu_of_its_own_beside_the_course_code_is_a_disturbance(monkeypatch):
    import course.grader_hooks as hooks

    used = {"cpu": 0.0}

    class Burning(StandIn):
        def course_block(self, *args, **kwargs):
            start = time.perf_counter()
            out = super().course_block(*args, **kwargs)
            used["cpu"] += 3 * (time.perf_counter() - start)  # two more cores' worth, beside it
            return out

        def block(self, *args, **kwargs):
            start = time.perf_counter()
            out = super().block(*args, **kwargs)
            used["cpu"] += time.perf_counter() - start
            return out

    monkeypatch.setattr(hooks, "learner_cpu", lambda: used["cpu"])
    gamed, report = _ratio(monkeypatch, Burning(naive_sq_dists, sabotage=5.0), 0.5)
    assert gamed < 1.25, report.table()  # 1.0x, not the 1.5x the bound would allow
    assert any("threads or processes of its own used CPU" in note for note in report.notes), report.notes


def test_the_disturbances_a_learner_can_leave_in_their_process_are_seen():
    import gc
    import signal

    from torch.overrides import TorchFunctionMode

    from course.remote import disturbances

    before = set(disturbances())  # (under pytest-timeout, its own interval timer)

    def new():
        return set(disturbances()) - before

    with TorchFunctionMode():
        assert any("mode" in d for d in new())
    signal.signal(signal.SIGPROF, lambda *a: None)  # a handler alone: a one-shot timer leaves no trace
    try:
        assert any("handler of a timer's signal" in d for d in new())
    finally:
        signal.signal(signal.SIGPROF, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_VIRTUAL, 10.0)  # (pytest-timeout's own is ITIMER_REAL)
    try:
        assert any("ITIMER_VIRTUAL" in d for d in new())
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
    callback = lambda phase, info: None  # noqa: E731
    gc.callbacks.append(callback)
    try:
        assert any("garbage-collector" in d for d in new())
    finally:
        gc.callbacks.remove(callback)
    assert not new()


def test_a_course_baseline_that_computes_otherwise_in_the_learners_process_fails(monkeypatch):
    class Changed(StandIn):
        def course_block(self, *args, **kwargs):
            sums, found = super().course_block(*args, **kwargs)
            return sums * 1.01, found

    with pytest.raises(AssertionError, match="course's own function gave other outputs in your process"):
        _ratio(monkeypatch, Changed(naive_sq_dists), 0.1)


def test_calibrate_wants_a_course_module_function(monkeypatch):
    monkeypatch.setattr("course.remote.is_remote", lambda obj: isinstance(obj, StandIn))
    with pytest.raises(ValueError, match="course module's function"):
        compare_served((BASE, lambda a, b: a), (CAND, StandIn(naive_sq_dists)), factory=distance_inputs,
                       sizes=dict(n=8, m=8, d=2), device="cpu", calibrate=0.1)


@pytest.mark.parametrize("name", ["os.system", "course.references.explain.coord_conv", "course.remote.Remote",
                                  "course.memory_format", "course.memory_format.nothing_here", 42, None,
                                  "course.memory_format.coord_conv_inputs.__wrapped__"])
def test_only_the_course_s_own_functions_run_in_the_learners_process_by_name(name):
    with pytest.raises(ValueError, match="no course function named"):
        course_function(name)
    assert course_function("course.memory_format.coord_conv_planted").__name__ == "coord_conv_planted"

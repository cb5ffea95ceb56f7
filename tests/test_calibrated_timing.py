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


def _never_decided_off(report, low: float, high: float) -> bool:
    """The same code read as the same speed, as the verdicts go: never decided slower than ``low``
    nor faster than ``high`` (a busy machine widens the bounds; it never decides wrongly)."""
    ratio = report.speedup(CAND)
    return ratio.verdict(low) != "fail" and ratio.verdict(high) != "pass"


def _ratio(monkeypatch, cand, calibrate, n=96, rounds=7):
    monkeypatch.setattr("course.remote.is_remote", lambda obj: isinstance(obj, StandIn))
    with threads(1):
        report = compare_served((BASE, naive_sq_dists), (CAND, cand), factory=distance_inputs,
                                sizes=dict(n=n, m=n, d=16), device="cpu", rounds=rounds, min_run_time=0.1,
                                calibrate=calibrate)
    return report.speedup(CAND).median, report


def test_a_slower_process_running_the_same_code_reads_the_same_speed(monkeypatch):
    plain, plain_report = _ratio(monkeypatch, StandIn(naive_sq_dists, slower=1.5), None)
    fair, report = _ratio(monkeypatch, StandIn(naive_sq_dists, slower=1.5), 0.7)
    assert plain_report.speedup(CAND).verdict(0.9) != "pass", plain  # the handicap (1/1.5), read as the answer's
    assert _never_decided_off(report, 0.8, 1.25), report.table()  # the same code, the same speed
    assert any("Your process ran planted at" in note for note in report.notes), report.notes


def test_slowing_the_course_baseline_in_ones_process_gains_the_bound_at_most(monkeypatch):
    gamed, report = _ratio(monkeypatch, StandIn(naive_sq_dists, sabotage=5.0), 0.1)
    # the planted code itself (1.0x), slowed fivefold where the course's copy runs: lifted by the bound
    # at most (1.1x; a shared machine's noise on top), never towards 5x
    assert report.speedup(CAND).verdict(1.25) != "pass", report.table()
    assert any("held to it" in note for note in report.notes), report.notes


def test_a_process_with_something_running_beside_the_course_code_is_not_believed_slow(monkeypatch):
    """Slowing the course's code in one's own process takes code that runs beside it there: a mode,
    a timer's handler, a thread, a collector callback (``disturbances``), or CPU of one's own. A round
    where any was present counts the course's sides at the grader's speed at most."""
    gamed, report = _ratio(monkeypatch, StandIn(naive_sq_dists, sabotage=5.0, found=("a thread was alive",)), 0.5)
    # the planted code itself: 1.0x, and no lift (believed, 1.5x)
    assert report.speedup(CAND).verdict(1.25) != "pass", report.table()
    assert any("a thread was alive" in note and "not believed slower" in note for note in report.notes), report.notes


class Burning(StandIn):
    """Planted code whose process uses two more cores' worth of CPU beside the course's code there
    (``used["cpu"]``: the CPU its process has used, as the parent would read it)."""

    def __init__(self, used: dict, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.used = used

    def course_block(self, *args, **kwargs):
        start = time.perf_counter()
        out = super().course_block(*args, **kwargs)
        self.used["cpu"] += 3 * (time.perf_counter() - start)  # two more cores' worth, beside it
        return out

    def block(self, *args, **kwargs):
        start = time.perf_counter()
        out = super().block(*args, **kwargs)
        self.used["cpu"] += time.perf_counter() - start
        return out


@pytest.mark.parametrize("hook", ["learner_cpu", "learner_counts"])
def test_cpu_of_its_own_beside_the_course_code_is_a_disturbance(monkeypatch, hook):
    """Read through the single hook, or the grader's own (``learner_counts``: one request each side of a
    block of the learner's process reads every count, and none is then asked on its own)."""
    import course.grader_hooks as hooks

    used, asked = {"cpu": 0.0}, []
    if hook == "learner_cpu":
        monkeypatch.setattr(hooks, "learner_cpu", lambda: used["cpu"])
    else:
        def counts():
            asked.append(1)
            return used["cpu"], -1.0, -1.0, -1.0

        def alone(*args, **kwargs):
            raise AssertionError("a count asked on its own")

        monkeypatch.setattr(hooks, "learner_counts", counts)
        for name in ("learner_cpu", "learner_main_cpu", "learner_waited"):
            monkeypatch.setattr(hooks, name, alone)
    gamed, report = _ratio(monkeypatch, Burning(used, naive_sq_dists, sabotage=5.0), 0.5)
    assert report.speedup(CAND).verdict(1.25) != "pass", report.table()  # 1.0x, not the 1.5x the bound allows
    assert any("threads or processes of its own used CPU" in note for note in report.notes), report.notes
    if hook == "learner_counts":
        assert asked and len(asked) % 2 == 0, asked  # one before and one after each block


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
    # a handler alone: a one-shot timer, or a thread that sends the signal, leaves no other trace
    for sig in (signal.SIGPROF, signal.SIGUSR1, signal.SIGALRM):
        previous = signal.signal(sig, lambda *a: None)
        try:
            assert any(f"handler of a signal ({sig.name})" in d for d in disturbances())
        finally:
            signal.signal(sig, previous)
    signal.setitimer(signal.ITIMER_VIRTUAL, 10.0)  # (pytest-timeout's own is ITIMER_REAL)
    try:
        assert any("ITIMER_VIRTUAL" in d for d in new())
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
    import sys

    interval = sys.getswitchinterval()
    sys.setswitchinterval(interval / 10)
    try:
        assert any("switch interval" in d for d in new())
    finally:
        sys.setswitchinterval(interval)
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


def test_the_harness_s_own_time_limit_is_no_disturbance(monkeypatch):
    import signal

    import course.grader_hooks as hooks
    from autograder.sandbox.protocol import Alarm
    from course.remote import disturbances

    alarm = Alarm()
    monkeypatch.setattr(hooks, "alarm", alarm.on_alarm)  # as the sandbox installs it
    previous = signal.getsignal(signal.SIGALRM)
    alarm.install()
    try:
        assert not any("SIGALRM" in d for d in disturbances())
        signal.signal(signal.SIGALRM, Alarm().on_alarm)  # another of the same kind is not the harness's
        assert any("SIGALRM" in d for d in disturbances())
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_the_learner_s_garbage_is_not_finalized_inside_a_block_of_the_course_s_code(monkeypatch):
    """A finalizer (``__del__``, a weakref callback) of cyclic garbage runs when a collection finds
    it: inside a block of the course's code, learner code between its bytecodes, seen by no check
    (a finalizer that makes new garbage runs at every collection). The block runs with the
    collector off."""
    import gc

    from course.remote import FACTORIES, _answer

    inside = [False]

    def marked_inputs(seed, device="cpu", **sizes):  # the block's own factory: we are inside it now
        inside[0] = True
        return distance_inputs(seed, device=device, **sizes)

    monkeypatch.setitem(FACTORIES, "tests.marked_inputs", marked_inputs)
    # ... and the block's last step, still inside it: we are leaving
    monkeypatch.setattr("course.devices.synchronize", lambda device: inside.__setitem__(0, False))
    ran, going = [], [True]

    class Renewing:
        def __init__(self):
            self.me = self

        def __del__(self):
            ran.append(inside[0])
            if going[0]:
                Renewing()  # garbage again, for the next collection

    message = {"op": "block", "name": CAND, "handle": 0, "factory": "tests.marked_inputs",
               "sizes": dict(n=8, m=8, d=4), "seeds": [1, 2, 3], "device": "cpu", "grad_mode": False,
               "threads": 1, "course": "course.broadcasting.naive_sq_dists"}
    thresholds = gc.get_threshold()
    gc.set_threshold(1)  # a collection at almost every allocation
    try:
        for _ in range(20):
            Renewing()
        reply = _answer(message, {CAND: naive_sq_dists}, {}, {0: []})
        assert gc.isenabled()  # on again after the block
        going[0] = False
        gc.collect()
    finally:
        going[0] = False
        gc.set_threshold(*thresholds)
        gc.collect()
    assert ran and True not in ran  # finalizers ran, before and after the block, never inside it
    assert isinstance(reply["disturbed"], list)


@pytest.mark.parametrize("seed", range(20))
def test_a_process_is_believed_slower_only_as_far_as_it_worked_longer(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    base = [rng.uniform(1, 3) for _ in range(n)]
    slowed = [b * rng.uniform(1, 3) for b in base]
    worked = rng.uniform(0.5, 1.3)
    out, _ = _calibrated({BASE: base, CAND: base, THERE[0]: slowed}, [], BASE, CAND, THERE, 0.5, cpu_ratio=worked)
    for r in range(n):
        assert out[BASE][r] <= base[r] * max(1.0, worked) * (1 + 1e-12)


class Waiting(StandIn):
    """A learner's process whose course blocks are made to *wait* ``sabotage`` times as long, not to
    work longer (the process starved, say): here a sleep."""

    def block(self, handle, factory, sizes, seeds, device, grad=False, _fn=None, _pad=1.0):
        start = time.perf_counter()
        sums = super().block(handle, factory, sizes, seeds, device, grad, _fn)
        time.sleep((time.perf_counter() - start) * (_pad - 1))
        return sums


class LockHeld(StandIn):
    """... made to wait on a thread of the learner's that holds the interpreter's lock, working (pure
    Python: the process's CPU time grows with the wait, its main thread's does not)."""

    def block(self, handle, factory, sizes, seeds, device, grad=False, _fn=None, _pad=1.0):
        import threading

        start = time.thread_time()
        sums = super().block(handle, factory, sizes, seeds, device, grad, _fn)
        work = (time.thread_time() - start) * (_pad - 1)  # CPU seconds, whatever else the machine runs

        def spin():
            end = time.thread_time() + work
            while time.thread_time() < end:
                pass
        spinner = threading.Thread(target=spin)
        spinner.start()
        spinner.join()  # the main thread waits, using no CPU
        return sums


class Beside(LockHeld):
    """... whose course blocks share their time with a thread of the learner's that works (the
    course's thread waits meanwhile) and, on top, work longer themselves: what a thread sharing the
    course's core does (it slows that thread, whose own CPU time then grows). The tree's CPU time is
    no more than the wall time, and the course's thread's CPU time grows."""

    def block(self, handle, factory, sizes, seeds, device, grad=False, _fn=None, _pad=1.0):
        return super().block(handle, factory, sizes, seeds, device, grad, _fn, 1 + (_pad - 1) / 2)

    def course_block(self, handle, factory, sizes, seeds, device, grad=False, *, course_fn):
        start = time.thread_time()
        out = super().course_block(handle, factory, sizes, seeds, device, grad, course_fn=course_fn)
        end = time.thread_time() + (time.thread_time() - start) / 3  # the course's thread, slowed
        while time.thread_time() < end:
            pass
        return out


def _readings(monkeypatch):
    """The parent's two CPU readings, of this process (the learner's side runs here)."""
    import course.grader_hooks as hooks

    monkeypatch.setattr(hooks, "learner_cpu", time.process_time)
    monkeypatch.setattr(hooks, "learner_main_cpu", time.thread_time)
    monkeypatch.setattr("course.timing.TICK", 0.0)  # (precise readings: no clock tick per block to allow for)


@pytest.mark.parametrize("kind", [Waiting, LockHeld])
def test_a_process_made_to_wait_is_not_believed_slow(monkeypatch, kind):
    _readings(monkeypatch)
    gamed, report = _ratio(monkeypatch, kind(naive_sq_dists, sabotage=2.0), 1.0, n=256, rounds=15)
    # the planted code itself: 1.0x (a busy machine's noise on top), not the 2x the bound allows
    assert report.speedup(CAND).verdict(1.5) != "pass", report.table()
    assert any("CPU time" in note for note in report.notes), report.notes


def test_a_thread_of_the_learner_s_working_beside_the_course_s_code_on_one_thread_is_a_disturbance(monkeypatch):
    _readings(monkeypatch)
    # (a thread working 1.5 times the course's own work beside it: far above the readings' tick allowance)
    gamed, report = _ratio(monkeypatch, Beside(naive_sq_dists, sabotage=4.0), 1.0, n=256, rounds=15)
    # 1.0x, not the 2x that the bound and the main thread's CPU allow
    assert report.speedup(CAND).verdict(1.5) != "pass", report.table()
    assert any("of its own used" in note and "not believed slower" in note for note in report.notes), report.notes


def test_a_process_that_works_longer_on_the_course_s_code_is_believed(monkeypatch):
    _readings(monkeypatch)
    fair, report = _ratio(monkeypatch, StandIn(naive_sq_dists, slower=1.4), 0.5, n=256, rounds=15)
    assert _never_decided_off(report, 0.8, 1.25), report.table()
    assert not any("not believed slower" in note for note in report.notes), report.notes


def test_in_the_sandbox_the_harness_leaves_nothing_that_counts_and_a_learners_handler_does(tmp_path):
    """In the real learner's process (the sandbox's child, its time limit's handler installed), an
    honest cell leaves no disturbance; a handler of the learner's own for any signal is one."""
    from autograder.sandbox import bwrap_works, run_program

    show = "from course.remote import disturbances\nprint(disturbances())\n"
    cells = [
        {"index": 0, "id": "a", "kind": "instructor", "source": "import torch\n" + show, "grade_id": ""},
        {"index": 1, "id": "b", "kind": "solution", "grade_id": "sol", "answers": [],
         "source": "import signal\nsignal.signal(signal.SIGUSR2, lambda *a: sum(range(10**6)))\n" + show},
    ]
    out = run_program(cells, sandbox="bwrap" if bwrap_works() else "none", cell_timeout=60, timeout=120,
                      memory_mb=2000, log=tmp_path / "log")
    assert out.status == "ok", out
    assert out.cells[0].output.strip() == "[]", out.cells[0]
    assert "SIGUSR2" in out.cells[1].output, out.cells[1]

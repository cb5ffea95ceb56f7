"""A learner's own threads and processes do not make a timed call faster (issue 12).

The judge pins the CPU threads both sides of a speed check run with, but the learner's code can
raise its own (``torch.set_num_threads``), start threads, or farm work out to processes. On a
CPU the judge therefore asks the grading parent, before and after each of the candidate's timed
blocks, how much CPU the learner's process tree has used (``/proc``: every thread and helper
process counted), and charges the block its CPU time over the threads allowed where that is
longer than its wall time. Checked here: the charge itself, the tree's count, the charge inside
``compare_served``, and the whole path through the real sandbox.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

import course.grader_hooks as hooks
from course.devices import threads
from autograder.sandbox.parent import tree_cpu_seconds
from course.timing import CPU_SLACK, best_times, charged_seconds, compare_served, cpu_factor


def test_blocks_are_charged_their_cpu_time_over_the_threads_allowed_where_that_is_longer():
    honest = [(0.010, 0.010)] * 20
    assert cpu_factor(honest, 1) == 1.0  # one thread, honest: its wall time
    assert cpu_factor([(0.010, 0.010 + CPU_SLACK)], 1) == pytest.approx(1.0)  # the readings' rounding costs nothing
    four = [(0.010, 0.040)] * 20  # four cores' worth, 10 ms blocks: short blocks do not hide it
    assert cpu_factor(four, 1) == pytest.approx((0.8 - CPU_SLACK) / 0.2)
    assert cpu_factor(four, 4) == 1.0  # four allowed: its wall time
    assert cpu_factor([], 1) == 1.0



def test_each_block_is_charged_on_its_own_and_a_stretched_one_dilutes_none():
    """A block counts its wall time, or its CPU time over the threads allowed where that is longer.
    Blocks whose wall clock stretched (waiting: no CPU used) leave every other block's charge as it
    was; one factor over the summed wall time let two such blocks take four cores' worth to 1.3."""
    honest = [(0.010, 0.010)] * 20
    assert charged_seconds(honest, 1) == [0.010] * 20
    four = [(0.010, 0.040)] * 5 + [(0.080, 0.040)] * 2  # two blocks kept waiting, not starved (CPU >= half)
    charged = charged_seconds(four, 1)
    assert cpu_factor(four, 1) < 1.4  # the summed factor, diluted
    assert all(c >= 0.040 - CPU_SLACK / 7 - 1e-12 for c in charged[:5]), charged
    assert charged[5:] == [0.080, 0.080]  # the stretched ones: their wall time
    assert charged_seconds(four, 4) == [w for w, _ in four]  # four threads allowed: wall time
    # A reading a clock tick over its wall time charges an honest block no more than the mean it worked.
    ticks = [(0.012, 0.010)] * 9 + [(0.012, 0.020)]
    assert max(charged_seconds(ticks, 1)) <= 0.012 + 1e-12
    assert charged_seconds([], 1) == []


BURN = ("import threading, time, subprocess, sys\n"
        "def spin(s):\n"
        "    t = time.thread_time()\n"
        "    while time.thread_time() - t < s:\n"
        "        pass\n"
        "th = threading.Thread(target=spin, args=(0.3,)); th.start(); th.join()\n"  # a thread that has ended
        "subprocess.run([sys.executable, '-c', 'import time\\nt = time.process_time()\\n"
        "while time.process_time() - t < 0.3: pass'])\n"  # a child, reaped
        "print('burnt', flush=True)\n"
        "time.sleep(30)\n")


def test_the_tree_counts_ended_threads_and_reaped_children():
    proc = subprocess.Popen([sys.executable, "-c", BURN], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "burnt"
        own = tree_cpu_seconds(proc.pid)
        assert own >= 0.55, own
    finally:
        proc.kill()
        proc.wait()
    assert tree_cpu_seconds(proc.pid) == 0.0  # gone: nothing to read


def test_compare_served_charges_the_candidate_and_says_so(monkeypatch):
    """With a parent that reports four cores' worth of CPU per candidate block, the candidate's
    times are its CPU time, and the report says why; the baseline's are untouched."""
    from course.checks.broadcasting import distance_inputs, naive_sq_dists
    from course.remote import Remote

    used = {"cpu": 0.0}

    class FourCores:
        """Stands in for a Remote: the learner's process, here, using four cores a call."""
        __name__ = "yours"

        def stage(self, constants):
            return 0

        def block(self, handle, factory, sizes, seeds, device, grad=False):
            from course.remote import FACTORIES, checksum
            start = time.perf_counter()
            sums = torch.stack([checksum(naive_sq_dists(*FACTORIES[factory](s, device=device, **sizes)))
                                for s in seeds])
            used["cpu"] += 4 * (time.perf_counter() - start)
            return sums

    monkeypatch.setattr("course.remote.is_remote", lambda obj: isinstance(obj, FourCores) or isinstance(obj, Remote))
    monkeypatch.setattr(hooks, "learner_cpu", lambda: used["cpu"])
    with threads(1):
        report = compare_served(("broadcast", naive_sq_dists), ("yours", FourCores()), factory=distance_inputs,
                                sizes=dict(n=128, m=128, d=16), device="cpu", rounds=5, min_run_time=0.2)
    # blocks long beside the readings' slack (30 ms in all): with 0.02 s blocks, a busy machine's slow
    # warm-up call made them 3 ms, and the slack alone took the charge from 4x to 2x (CI, 2026-11-28)
    speedup = report.speedup("yours").median
    assert speedup < 0.4, report.table()  # the same work, charged four cores' worth on one thread allowed
    assert any("cores' worth of CPU" in note for note in report.notes), report.notes



def test_compare_served_charges_each_round_so_rounds_kept_waiting_do_not_dilute_it(monkeypatch):
    """A candidate that uses four cores' worth of CPU per round and waits (using no CPU, never long
    enough to count as starved) in two of the rounds: one factor over the summed wall time fell to
    about 1.3 and its other rounds counted little more than their wall time, so the median round
    came out as fast as the baseline. Round by round, every round that did not wait counts four."""
    from course.checks.broadcasting import distance_inputs, naive_sq_dists
    from course.remote import Remote

    used = {"cpu": 0.0, "blocks": 0}

    class FourCoresSometimesWaiting:
        __name__ = "yours"

        def stage(self, constants):
            return 0

        def block(self, handle, factory, sizes, seeds, device, grad=False):
            from course.remote import FACTORIES, checksum
            used["blocks"] += 1
            start = time.perf_counter()
            sums = torch.stack([checksum(naive_sq_dists(*FACTORIES[factory](s, device=device, **sizes)))
                                for s in seeds])
            took = time.perf_counter() - start
            used["cpu"] += 4 * took
            if used["blocks"] in (4, 6):  # two of the timed rounds (after two warm-up calls) wait
                time.sleep(5 * took)
            return sums

    monkeypatch.setattr("course.remote.is_remote",
                        lambda obj: isinstance(obj, FourCoresSometimesWaiting) or isinstance(obj, Remote))
    monkeypatch.setattr(hooks, "learner_cpu", lambda: used["cpu"])
    with threads(1):
        report = compare_served(("broadcast", naive_sq_dists), ("yours", FourCoresSometimesWaiting()),
                                factory=distance_inputs, sizes=dict(n=128, m=128, d=16), device="cpu", rounds=7,
                                min_run_time=0.2)
    assert used["blocks"] >= 9, used
    speedup = report.speedup("yours")
    assert speedup.median < 0.4, report.table()
    assert speedup.high < 0.6, report.table()
    assert any("cores' worth of CPU" in note for note in report.notes), report.notes


def test_a_warmed_call_gets_an_untimed_call_first_on_inputs_of_its_own():
    """``best_times(warm=)``: before each timed call of the learner's, one untimed call on arguments
    drawn for it alone; the timed call's arguments, shared with the loop beside it, are drawn after."""
    import itertools

    seen, fresh = [], itertools.count()
    learner = lambda x: seen.append(("learner", x))  # noqa: E731
    loop = lambda x: seen.append(("loop", x))  # noqa: E731
    draw = lambda: (next(fresh),)  # noqa: E731
    best_times([(learner, draw), (loop, draw)], held=[], reps=2, device="cpu", warm=[0])
    assert [who for who, _ in seen] == ["learner", "learner", "loop"] * 3  # the first round is a warm-up too
    for k in range(3):
        warm_up, timed, beside = seen[3 * k:3 * k + 3]
        assert timed[1] == beside[1] != warm_up[1] and warm_up[1] < timed[1]  # its own, drawn before
    assert len({x for _, x in seen[::3]} | {x for _, x in seen[1::3]}) == 6


def test_best_times_charges_the_learners_calls_not_the_held_ones(monkeypatch):
    """A learner's call counts its CPU over the threads allowed (four cores' worth: 40 ms for a 1 ms
    call); a held call (the course's, with the learner's process stopped) counts its wall time only,
    even where the CPU reading moved meanwhile. Neither figure rests on how fast the wall clock ran
    (a loaded machine once stretched every 10 ms sample of the held call past the 20 ms this test
    asked for), and a stretched repetition no longer dilutes the charge."""
    used = {"cpu": 0.0}

    def spin(seconds):
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            pass

    def four_cores():
        spin(0.001)
        used["cpu"] += 0.04

    def held():
        spin(0.001)
        used["cpu"] += 0.04  # were it charged, it would count 40 ms

    monkeypatch.setattr(hooks, "learner_cpu", lambda: used["cpu"])
    with threads(1):
        learner, trusted = best_times([(four_cores, ()), (held, ())], held=[1], reps=5, device="cpu")
    assert learner >= 0.04 - CPU_SLACK / 5 - 1e-9, learner
    assert trusted < 0.03, trusted  # its best wall time of 1 ms: 30 times that under any load


def test_best_times_brackets_each_learners_call_with_one_request_before_and_one_after(monkeypatch):
    """Under the grader the three counts a timed call is bracketed with (CPU, its threads' waiting, its
    main thread's) come in one request to the parent (``learner_counts``), not three each side: two
    round trips per timed call, none for a held one; what they say is what the record keeps."""
    asked = []

    def counts():
        asked.append(time.perf_counter())
        return 0.01 * len(asked), 0.002 * len(asked), 0.001 * len(asked), 0.005 * len(asked)

    def refused(*args, **kwargs):
        raise AssertionError("a count read on its own")

    monkeypatch.setattr(hooks, "learner_counts", counts)
    monkeypatch.setattr(hooks, "learner_cpu", refused)
    monkeypatch.setattr(hooks, "learner_waited", refused)
    record: dict = {}
    with threads(1):
        best_times([(lambda: None, ()), (lambda: None, ())], held=[1], reps=3, device="cpu", record=record)
    assert len(asked) == 2 * 3  # the learner's call of each repetition (not the warm-up, not the held call)
    assert [c for _, c in record["used"][0][0]] == [pytest.approx(0.01)] * 3
    assert record["waited"][0][0] == [pytest.approx(0.002)] * 3 and record["used"][0][1] == []
    assert all(n is not None for n in record["net"][0][0])


def test_a_stretched_repetition_does_not_dilute_the_charge(monkeypatch):
    """One repetition's wall time stretched (the process kept waiting: no CPU used) left the best of
    the others, and the CPU charge divided by the summed wall fell with it: four cores' worth read
    as one. The charge is CPU per call, whatever the wall clock did."""
    used = {"cpu": 0.0, "n": 0}

    def four_cores():
        used["n"] += 1
        time.sleep(0.2 if used["n"] == 3 else 0.005)  # one repetition waits 0.2 s, using no CPU
        used["cpu"] += 0.02

    monkeypatch.setattr(hooks, "learner_cpu", lambda: used["cpu"])
    with threads(1):
        (charged,) = best_times([(four_cores, ())], reps=5, device="cpu")
    assert charged >= 0.02 - CPU_SLACK / 5 - 1e-9, charged

def test_without_a_parent_nothing_is_charged(monkeypatch):
    """In a learner's own notebook (no grader, no CPU reading) a call counts its wall time."""
    def four_cores():
        start = time.perf_counter()
        while time.perf_counter() - start < 0.01:
            pass

    monkeypatch.setattr(hooks, "learner_cpu", None)
    with threads(1):
        (alone,) = best_times([(four_cores, ())], reps=3, device="cpu")
    assert 0.009 < alone < 0.03, alone


SERVED = [
    {"index": 0, "id": "a", "kind": "instructor", "source": "import course.grader_hooks as hooks\n", "grade_id": ""},
    {"index": 1, "id": "b", "kind": "solution", "grade_id": "sol", "answers": ["burn"],
     "source": "def burn(s):\n"
               "    import threading, time\n"
               "    def spin():\n"
               "        t = time.thread_time()\n"
               "        while time.thread_time() - t < s:\n"
               "            pass\n"
               "    for _ in range(2):  # (subprocess is refused in submitted code; threads are not)\n"
               "        th = threading.Thread(target=spin); th.start(); th.join()\n"
               "    return 0\n"},
    {"index": 2, "id": "c", "kind": "test", "grade_id": "t", "served": True,
     "source": "c0, w0 = hooks.learner_cpu(), hooks.learner_waited()\nburn(0.3)\n"
               "print(f'used {hooks.learner_cpu() - c0:.2f} waited {w0:.3f} {hooks.learner_waited() - w0:.3f} '\n"
               "      f'{hooks.learner_waited(main=True):.3f}')\n"
               "k0 = hooks.learner_counts()\nburn(0.2)\nk1 = hooks.learner_counts()\n"
               "print('counts', *(f'{b - a:.3f}' for a, b in zip(k0, k1)), *(f'{a:.3f}' for a in k0))\n"},
]


def test_the_judge_reads_the_learners_cpu_through_the_parent(tmp_path):
    from autograder.sandbox import bwrap_works, run_program

    sandbox = "bwrap" if bwrap_works() else "none"
    out = run_program(SERVED, judge_setup=[SERVED[0]["source"]], sandbox=sandbox, cell_timeout=60, timeout=120,
                      memory_mb=2000, log=tmp_path / "log")
    assert out.status == "ok", out
    text, counts = out.cells[2].output.strip().splitlines()
    assert text.startswith("used "), out.cells[2]
    # the readings a timed call is bracketed with, in one request (course.timing): the tree's CPU (two threads
    # of 0.2 s each), its threads' waiting and its main thread's, and that thread's CPU (it only waits), each known
    cpu, waited, main, main_cpu, *at = (float(x) for x in counts.split()[1:])
    assert counts.startswith("counts ") and cpu >= 0.35 and 0 <= waited < 5 and 0 <= main <= waited + 0.01, counts
    assert 0 <= main_cpu < 0.2 and min(at) >= 0 and at[3] > 0 and at[0] >= float(text.split()[1]), counts
    assert float(text.split()[1]) >= 0.55, text
    # the scheduler's count of the learner's waiting for a CPU comes through too (known: not -1)
    assert text.split()[2] == "waited" and float(text.split()[3]) >= 0 and 0 <= float(text.split()[4]) < 5, text
    assert 0 <= float(text.split()[5]) <= float(text.split()[3]) + float(text.split()[4]), text  # its main thread's


def test_the_parent_reads_the_cpu_of_the_learner_interpreter_s_main_thread_alone(tmp_path):
    """``main_thread_cpu_seconds``: the shallowest Python process under the sandbox's own (here a
    shell), its main thread only: a thread of its that works is not counted, the main thread's
    work is."""
    import subprocess
    import sys

    from autograder.sandbox.parent import main_thread_cpu_seconds, tree_cpu_seconds

    script = tmp_path / "learner.py"
    script.write_text(
        "import threading, time, sys\n"
        "def burn(s):\n"
        "    end = time.thread_time() + s\n"
        "    while time.thread_time() < end:\n"
        "        pass\n"
        "t = threading.Thread(target=burn, args=(0.6,)); t.start(); t.join()\n"  # another thread: 0.6 s
        "burn(0.3)\n"  # the main thread: 0.3 s
        "print('done', flush=True)\n"
        "sys.stdin.read()\n")
    proc = subprocess.Popen(["sh", "-c", f"{sys.executable} {script}; true"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "done"
        main, tree = main_thread_cpu_seconds(proc.pid), tree_cpu_seconds(proc.pid)
        assert 0.28 < main < 0.6, main  # (the interpreter's start-up on top of the 0.3 s)
        assert tree > main + 0.5, (tree, main)
    finally:
        proc.kill()
        proc.wait()
    assert main_thread_cpu_seconds(proc.pid) == -1.0  # no such process: not known


def test_the_parent_tells_a_process_kept_from_the_cpu_from_one_that_sleeps(tmp_path):
    """``learner_wait_seconds``: the time a learner's threads waited, ready to run, for a CPU (the
    scheduler's count). Three processes of a learner's, each a spinning loop, pinned to one CPU: two wait
    while one runs, about twice the wall time between two readings; a process that sleeps waits for
    nothing. Lesson 5's row loop check tells a loop a busy machine kept from the CPU (undecided) from a
    sleep (a fail) by it."""
    import os
    from types import SimpleNamespace

    from autograder.sandbox.parent import learner_wait_seconds

    cpu = min(os.sched_getaffinity(0))
    spin = ("import os, time\nos.sched_setaffinity(0, {%d})\n"
            "for _ in range(2):\n    if os.fork() == 0:\n        break\n"
            "os.write(1, b'go\\n')\nend = time.time() + 20\nwhile time.time() < end:\n    pass\n" % cpu)
    sleep = "import time\nprint('go', flush=True)\ntime.sleep(20)\n"
    waited = {}
    for name, source in (("spin", spin), ("sleep", sleep)):
        proc = subprocess.Popen([sys.executable, "-c", source], stdout=subprocess.PIPE, text=True)
        try:
            for _ in range(3 if name == "spin" else 1):
                assert proc.stdout.readline().strip() == "go"
            seen = SimpleNamespace(group=None, proc=proc)
            w0, t0 = learner_wait_seconds(seen), time.perf_counter()
            time.sleep(1.0)
            waited[name] = (learner_wait_seconds(seen) - w0) / (time.perf_counter() - t0)
            assert w0 >= 0, w0
        finally:
            subprocess.run(["pkill", "-KILL", "-P", str(proc.pid)], check=False)
            proc.kill()
            proc.wait()
    assert waited["spin"] > 1.0, waited  # about 2: two of three ready at any time
    assert waited["sleep"] < 0.05, waited
    gone = SimpleNamespace(group=None, proc=proc)
    assert learner_wait_seconds(gone) == -1.0  # no such process: not known


def test_the_learners_interpreter_is_found_once_per_run_and_again_only_when_it_is_gone(monkeypatch):
    """The judge asks for the learner's main thread's counts around every call it times; the walk over
    /proc that finds that thread costs a millisecond per hundred processes on the machine, so it is made
    once per run (keyed by the sandbox root and its start), and again only when the process found is gone."""
    import os

    from autograder.sandbox import parent

    walks = []
    real = parent.shallowest
    monkeypatch.setattr(parent, "shallowest", lambda root, pred: walks.append(root) or real(root, pred))
    monkeypatch.setattr(parent, "_MAINS", {})
    proc = subprocess.Popen(["sh", "-c", f"{sys.executable} -c 'import time; time.sleep(30)'; true"])
    try:
        deadline = time.monotonic() + 20
        while parent.learner_main_pid(proc.pid) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        found, walked = parent.learner_main_pid(proc.pid), len(walks)
        assert found is not None and found != proc.pid, found  # the Python under the shell
        for _ in range(5):
            assert parent.learner_main_pid(proc.pid) == found and parent.main_thread_wait_seconds(proc.pid) >= 0
        assert len(walks) == walked  # found once
        os.kill(found, 9)
        time.sleep(0.3)
        assert parent.learner_main_pid(proc.pid) != found  # gone: not the process found before
    finally:
        proc.kill()
        proc.wait()

"""Pausing a learner's processes while the judge times the course's baseline (``autograder.sandbox``).

The attack: a chain of processes, each forking its successor and exiting, is never the process a
walk over /proc signals, so SIGSTOP to "the tree" leaves it running beside the baseline; outside a
PID namespace its orphans are not even in the tree. A learner reaches ``fork`` past the audit hook
through ``multiprocessing``'s spawn context, which starts a fresh interpreter (no hook, no seal).
The wall: a cgroup per process, frozen by the kernel at once and killed at once. The fallback
(no writable cgroup): signals repeated until the tree is seen stopped, and an account afterwards.

Each chain here beats: every member appends a byte to a file, so the test sees, from outside,
whether anything of it ran while it was held.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autograder.sandbox import cgroup
from autograder.sandbox.parent import PAUSE_SLACK, Pause, bwrap_works

ROOT = Path(__file__).resolve().parents[1]

CHAIN = r"""
import os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < float(sys.argv[2]):
        pass
    os.write(fd, b"x")
    if os.fork():
        os._exit(0)
"""

#: The chain under a root that stays (as the sandbox's first process does): the root sleeps.
ROOTED = "import os, time\nif os.fork():\n    time.sleep(3600)\n    raise SystemExit\n" + CHAIN

HONEST = r"""
import os, sys, threading, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
def spin():
    while True:
        t = time.perf_counter()
        while time.perf_counter() - t < 0.002:
            pass
        os.write(fd, b"x")
for _ in range(3):
    threading.Thread(target=spin, daemon=True).start()
if os.fork() == 0:
    spin()
spin()
"""


def _needs_cgroup():
    if cgroup.base() is None:
        if os.environ.get("COURSE_REQUIRE_CGROUP"):
            pytest.fail("COURSE_REQUIRE_CGROUP is set but no cgroup v2 folder can be made and joined here")
        pytest.skip("no writable cgroup v2 hierarchy on this machine (the grader falls back to signals)")


class _Started:
    """What Pause needs of the parent's ``_Proc``: its ``proc`` and its ``group``."""

    def __init__(self, source: str, beat: Path, *args: str, group: bool, bwrap: bool = False):
        self.group = cgroup.make("test") if group else None
        argv = [sys.executable, "-c", source, str(beat), *args]
        if bwrap:  # a PID namespace of its own, as the grader's sandbox has: orphans stay in the tree
            argv = ["bwrap", "--ro-bind", "/", "/", "--bind", str(beat.parent), str(beat.parent), "--unshare-pid",
                    "--proc", "/proc", "--dev", "/dev", "--die-with-parent", "--", *argv]
        if self.group is not None:
            argv = self.group.wrap(argv)
        self.proc = subprocess.Popen(argv, start_new_session=True)
        self.beat = beat

    def beats(self) -> int:
        try:
            return self.beat.stat().st_size
        except FileNotFoundError:
            return 0

    def close(self):
        from autograder.proc import kill_tree

        kill_tree(self.proc.pid)
        if self.group is not None:
            self.group.kill()
        self.proc.wait(timeout=30)
        if self.group is not None:
            self.group.remove()


def _holds(started: _Started, n: int, held_s: float = 0.15):
    """``n`` pauses: (beats while held, what the account said) for each."""
    out = []
    for _ in range(n):
        pause = Pause(started)
        pause.begin()
        before = started.beats()
        time.sleep(held_s)
        during = started.beats() - before
        out.append((during, pause.end()))
        time.sleep(0.05)  # running again
    return out


def _wait_beating(started: _Started):
    deadline = time.monotonic() + 20
    while started.beats() < 20:
        assert time.monotonic() < deadline, "the chain never started"
        time.sleep(0.02)


def test_a_frozen_cgroup_holds_a_chain_of_forks_and_kills_all_of_it(tmp_path):
    _needs_cgroup()
    started = _Started(ROOTED, tmp_path / "beats", "0.001", group=True)
    try:
        _wait_beating(started)
        holds = _holds(started, 8)
        assert all(during == 0 for during, _ in holds), holds  # nothing of it ran while held
        assert all(said == "" for _, said in holds), holds
        running = started.beats()
        time.sleep(0.2)
        assert started.beats() > running  # and it runs again after
        from autograder.proc import descendants

        tree = {started.proc.pid, *descendants(started.proc.pid)}
        chain = [p for p in started.group.pids() if p not in tree]
        assert chain, "the chain's members are orphans, out of the root's tree: signals to the tree miss them"
    finally:
        group = started.group
        started.close()
    assert not group.path.exists() or not group.pids()
    after = started.beats()
    time.sleep(0.3)
    assert started.beats() == after, "a member of the chain outlived the grader's kill"


def test_signals_alone_say_so_whenever_a_chain_ran_while_held(tmp_path, monkeypatch):
    """The fallback: inside a PID namespace (the sandbox's), the chain stays in the tree; SIGSTOP,
    sent again to whatever is seen running, stops it most of the time, and in every pause where
    it ran anyway the account says so (its members' CPU, counted by the scheduler)."""
    if not bwrap_works():
        pytest.skip("bubblewrap is needed for a PID namespace")
    started = _Started(ROOTED, tmp_path / "beats", "0.003", group=False, bwrap=True)
    try:
        _wait_beating(started)
        holds = _holds(started, 12)
    finally:
        started.close()
    for during, said in holds:
        if during >= 5:  # ran at least 15 ms of the 150 ms hold
            assert "while paused" in said, holds
    assert sum(1 for during, _ in holds if during == 0) >= 1, holds  # the signals do stop it at times


def test_the_account_names_a_process_that_ran_while_held(tmp_path):
    """Deterministically: a held process is let run (as a chain's member could do to it) and the
    account at the end of the pause says so, with and without a cgroup."""
    for group in (False, True):
        if group and cgroup.base() is None:
            continue
        started = _Started(HONEST, tmp_path / f"beats-{group}", group=group)
        try:
            _wait_beating(started)
            pause = Pause(started)
            pause.begin()
            before = started.beats()
            if group:
                started.group.thaw()  # what a forged thaw would do
            else:
                from autograder.proc import signal_tree
                signal_tree(started.proc.pid, signal.SIGCONT)
            time.sleep(0.1)
            ran = started.beats() - before
            said = pause.end()
            assert ran > 0 and "while paused" in said and float(said.split(" s of CPU")[0].split()[-1]) > PAUSE_SLACK, \
                (group, ran, said)
        finally:
            started.close()


@pytest.mark.parametrize("group", [False, True])
def test_an_honest_busy_tree_is_held_still_and_never_accused(tmp_path, group):
    """Control: four threads and a child process, all busy; every pause holds them (no beat) and
    the account says nothing ran."""
    if group:
        _needs_cgroup()
    started = _Started(HONEST, tmp_path / "beats", group=group, bwrap=bwrap_works() and not group)
    try:
        _wait_beating(started)
        holds = _holds(started, 10, held_s=0.1)
    finally:
        started.close()
    assert all(during == 0 and said == "" for during, said in holds), holds


def test_a_chain_spawned_past_the_audit_hook_is_frozen_while_the_judge_times(tmp_path):
    """End to end, through the real parent and judge (``--sandbox none``: the judge reads the beats
    on the host): the learner's cell starts the chain with ``multiprocessing``'s spawn context, which
    no audit event reports; the judge's cell holds the learner's process and counts the beats while
    held. With the cgroup, none; and nothing of the chain outlives the run."""
    _needs_cgroup()
    from autograder.sandbox import run_program

    beats = tmp_path / "beats"
    learner = (f"import multiprocessing as mp\nCHAIN = {CHAIN!r}\nimport sys\n"
               f"sys.argv = ['chain', {str(beats)!r}, '0.001']\n"
               "mp.get_context('spawn').Process(target=exec, args=(CHAIN,)).start()\n"
               "def lstm_cell(*args):\n    return args[1], args[2]\n")
    check = (f"import os, time\nimport course.grader_hooks as hooks\nBEATS = {str(beats)!r}\n"
             "deadline = time.monotonic() + 20\n"
             "while (os.path.getsize(BEATS) if os.path.exists(BEATS) else 0) < 20 and time.monotonic() < deadline:\n"
             "    time.sleep(0.02)\n"
             "held = []\n"
             "for _ in range(5):\n"
             "    with hooks.learner_stopped():\n"
             "        a = os.path.getsize(BEATS)\n        time.sleep(0.15)\n"
             "        held.append(os.path.getsize(BEATS) - a)\n"
             "    time.sleep(0.05)\n"
             "print('beats while held:', held, 'in all:', os.path.getsize(BEATS))\n")
    from test_hostile_grading import _served_program

    cells, setup = _served_program(learner, check)
    out = run_program(cells, judge_setup=setup, sandbox="none", cell_timeout=60, timeout=120, memory_mb=2000,
                      log=tmp_path / "log")
    text = out.cells[2].output
    assert "beats while held: [0, 0, 0, 0, 0]" in text, (out, text, out.cells[1])
    total = int(text.split("in all:")[1].split()[0])
    assert total >= 20, text  # the chain did run, outside the holds
    assert not out.cells[2].escaped and not any(name == "escaped-pause" for name, _ in out.flags), out.flags
    after = beats.stat().st_size
    time.sleep(0.3)
    assert beats.stat().st_size == after, "a member of the chain outlived the run"


def test_a_submission_that_ran_while_paused_for_another_is_named(tmp_path):
    """With ``--jobs``, the other submissions are held while one measures (``_Child``): one whose
    processes ran meanwhile is named in ``escaped`` (the run loop then stops it, status ``crashed``),
    an honest one never is."""
    from autograder.proc import signal_tree
    from autograder.sandbox.parent import _Child

    started = _Started(HONEST, tmp_path / "beats", group=False)
    try:
        _wait_beating(started)
        clock = _Child(started)
        for _ in range(3):
            clock.pause()
            time.sleep(0.05)
            clock.resume()
        assert clock.escaped == [] and clock.paused() > 0.1
        clock.pause()
        signal_tree(started.proc.pid, signal.SIGCONT)  # as a chain that escaped the signals would run
        time.sleep(0.1)
        clock.resume()
        assert len(clock.escaped) == 1 and "while paused" in clock.escaped[0], clock.escaped
        clock.close()
    finally:
        started.close()


def test_a_runs_paused_time_read_while_another_thread_resumes_it_is_never_counted_twice(monkeypatch):
    """A run's loop reads its paused time (:meth:`_Child.paused`) while a classmate's thread pauses
    and resumes it for the classmate's timing turns. Read between the two fields' updates, the pause
    under way was counted twice (a cell's clock read then was dated early by the pause's length) or
    the read raised TypeError (the run's loop failed: the grader's fault). Every read must be one
    consistent instant: never less than an earlier read, never more than the time elapsed."""
    import threading
    import types

    from autograder.sandbox import parent

    class Held:  # the pause's bookkeeping alone: no process to stop
        def __init__(self, proc):
            pass

        def begin(self):
            pass

        def end(self):
            return ""

    monkeypatch.setattr(parent, "Pause", Held)
    clock = parent._Child(types.SimpleNamespace(proc=types.SimpleNamespace(pid=os.getpid())))
    begun, until = time.monotonic(), time.monotonic() + 1.5
    wrong: list[str] = []

    def classmate():
        while time.monotonic() < until:
            clock.pause()
            clock.resume()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # thread switches as often as the interpreter allows: the race shows
    try:
        thread = threading.Thread(target=classmate)
        thread.start()
        last = 0.0
        while time.monotonic() < until and len(wrong) < 5:
            try:
                now = clock.paused()
            except TypeError as exc:
                wrong.append(f"raised {exc}")
                continue
            if now < last or now > time.monotonic() - begun:
                wrong.append(f"read {now:.6f} s after {last:.6f} s, {time.monotonic() - begun:.6f} s elapsed")
            last = max(last, now)
        thread.join()
    finally:
        sys.setswitchinterval(old)
        clock.close()
    assert not wrong, wrong
    assert last > 0


def test_a_group_the_kernel_did_not_freeze_is_held_with_signals_instead(tmp_path, monkeypatch):
    """Where the kernel does not confirm the freeze in time (a process stuck in a disk wait), the
    pause falls back to signals and their account, rather than timing beside a tree half running
    or accusing an honest one."""
    _needs_cgroup()
    monkeypatch.setattr(cgroup.Group, "freeze", lambda self, limit=2.0: False)
    started = _Started(HONEST, tmp_path / "beats", group=True)
    try:
        _wait_beating(started)
        pause = Pause(started)
        pause.begin()
        assert pause.group is None and pause.ns  # held by signals
        before = started.beats()
        time.sleep(0.1)
        assert started.beats() == before
        assert pause.end() == ""
        time.sleep(0.1)
        assert started.beats() > before  # running again
    finally:
        started.close()


class _Counted(cgroup.Group):
    """A group the kernel says is frozen, whose CPU count reads ``counts`` in turn (then the last)."""

    def __init__(self, counts: list[float]):
        super().__init__(Path("/nonexistent"))
        self.counts = counts

    def holds(self, pid: int) -> bool:
        return True

    def freeze(self, limit: float = 2.0) -> bool:
        return True

    def thaw(self) -> None:
        pass

    def cpu_seconds(self) -> float:
        return self.counts.pop(0) if len(self.counts) > 1 else self.counts[0]


class _Held:
    def __init__(self, group):
        self.group, self.proc = group, type("P", (), {"pid": os.getpid()})()


@pytest.mark.parametrize("counts, escaped", [
    # The last thread's time since the scheduler's tick, added as it is switched out just after
    # the kernel said "frozen": read before it lands, it was charged to the learner (CI, 0.007 s).
    ([10.0, 10.004, 10.007, 10.007], False),
    ([10.0, 10.0], False),
    # What runs once the count has settled is still charged: the account keeps its teeth.
    ([10.0, 10.0, 10.5], True),
    ([10.0, 10.004, 10.004, 10.1], True),
])
def test_a_frozen_groups_count_is_read_once_it_has_settled(counts, escaped):
    """The pause reads the frozen group's CPU count only once two readings agree, so the time its
    threads ran before the freeze, accounted by the kernel a moment after it says "frozen", is
    not charged as time run while paused; what the count gains after that is."""
    pause = Pause(_Held(_Counted(list(counts))))
    pause.begin()
    said = pause.end()
    assert bool(said) is escaped, said

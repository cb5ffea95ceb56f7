"""A cgroup (version 2) for each confined process, where the machine lets the grader make one.

Stopping a process tree with SIGSTOP signals one process at a time, after a walk over ``/proc``:
a learner's process that forks a successor and exits, over and over, is never the one signalled,
and its chain keeps running while the judge times the course's baseline "with the learner's
process stopped" (``tests/test_pause.py`` shows it: with signals alone, such a chain ran through
most holds). Its orphans are not even in the tree once their parents exit (outside bubblewrap's
PID namespace), so the tree's CPU count misses them, and so does ``kill_tree``.

A cgroup holds every process started inside it, whoever its parent becomes. The kernel freezes
them all at once (``cgroup.freeze``: a process forked while freezing is frozen too), counts the
CPU time of all of them, exited ones included (``cpu.stat``), and kills them all at once
(``cgroup.kill``). The parent uses a group for each process it starts (:func:`make`); where no
cgroup v2 hierarchy is writable (a grader that is neither root nor given a delegated cgroup),
``make`` returns None and the parent falls back to signals, verified after every pause
(``parent.py``: :class:`~autograder.sandbox.parent.Pause`).

Set ``GRADING_NO_CGROUP=1`` to use the fallback on purpose (its tests do).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

#: Set (to anything but "" or "0") to grade without cgroups: signals only.
ENV_OFF = "GRADING_NO_CGROUP"

_BASE: list = []  # [Path | None] once looked for


def own_folder(controller: str | None = None, proc: Path = Path("/proc/self")) -> Path | None:
    """This process's own cgroup as a folder: in the cgroup v2 hierarchy (``controller`` None), or in
    the cgroup v1 hierarchy that holds ``controller`` ("memory"). None where that hierarchy is not
    mounted here. ``proc`` is where ``cgroup`` and ``mountinfo`` are read (a laid-out folder in tests)."""
    try:
        lines = [line.split(":", 2) for line in (proc / "cgroup").read_text().splitlines()]
        mounts = [line.split() for line in (proc / "mountinfo").read_text().splitlines()]
    except OSError:
        return None

    def ours(parts: list[str]) -> bool:
        if len(parts) != 3:
            return False
        return parts[:2] == ["0", ""] if controller is None else controller in parts[1].split(",")

    own = next((parts[2].strip() for parts in lines if ours(parts)), None)
    if own is None:
        return None
    for fields in mounts:
        # "id parent dev root mount-point options [optional...] - fstype source super-options"
        sep = fields.index("-") if "-" in fields else -1
        if sep < 6 or len(fields) < sep + 2:
            continue
        fstype, options = fields[sep + 1], (fields[sep + 3].split(",") if len(fields) > sep + 3 else [])
        wanted = fstype == "cgroup2" if controller is None else (fstype == "cgroup" and controller in options)
        if not wanted:
            continue
        root = fields[3]  # the mount's root within the hierarchy (a cgroup namespace: "/")
        rel = os.path.relpath(own, root) if own.startswith(root) else None
        if rel is None or rel.startswith(".."):
            continue
        folder = Path(fields[4]) / ("" if rel == "." else rel)
        if (folder / "cgroup.procs").exists():
            return folder
    return None


def probe(folder: Path, needs: tuple[str, ...] = (), setup=None) -> bool:
    """Whether this grader can make a group in ``folder`` and move a process into it: a test group is
    made, given ``setup(group)`` (a limit it needs first), a short-lived shell moved into it, the files
    ``needs`` looked for (its controllers'), and the group removed."""
    group = new_folder(folder, "probe")
    if group is None:
        return False
    try:
        if setup is not None:
            setup(group)
        moved = subprocess.run(["/bin/sh", "-c", 'echo 0 > "$0/cgroup.procs"', str(group)],
                               capture_output=True, timeout=10).returncode == 0
        return moved and all((group / name).exists() for name in needs)
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        remove_folder(group)


def base() -> Path | None:
    """Where this grader can make groups and move a process into one (looked for once): its own
    cgroup v2 folder, proved by :func:`probe` (a group that can be frozen and counts CPU time)."""
    if os.environ.get(ENV_OFF, "") not in ("", "0"):
        return None
    if _BASE:
        return _BASE[0]
    folder = own_folder()
    found = folder if folder is not None and probe(folder, needs=("cgroup.freeze", "cpu.stat")) else None
    if found is not None:
        sweep(found)
    _BASE.append(found)
    return found


def sweep(folder: Path) -> None:
    """Remove the empty groups a grader that was killed left behind (its pid is in their name)."""
    for path in folder.glob("grading-*-*-*"):
        try:
            owner = int(path.name.rsplit("-", 2)[1])
        except ValueError:
            continue
        if owner != os.getpid() and not Path(f"/proc/{owner}").exists():
            try:
                path.rmdir()  # refused while a process is still in it
            except OSError:
                pass


def remove_folder(folder: Path, limit: float = 5.0) -> None:
    """Remove an emptied group (its last processes may still be exiting)."""
    deadline = time.monotonic() + limit
    while True:
        try:
            folder.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)


def enter(procs: list[Path], argv: list[str]) -> list[str]:
    """``argv`` run by a shell that first writes its own pid into each ``cgroup.procs`` of ``procs``
    (one group per hierarchy); a write that fails is skipped."""
    script = 'while [ "$1" != -- ]; do echo 0 > "$1" 2>/dev/null; shift; done; shift; exec "$@"'
    return ["/bin/sh", "-c", script, "sh", *(str(p) for p in procs), "--", *argv]


class Group:
    """One cgroup: every process started by the command :meth:`wrap` made, and their descendants."""

    def __init__(self, path: Path):
        self.path = path

    def wrap(self, argv: list[str], *also: Path) -> list[str]:
        """``argv`` run by a shell that first moves itself into this group (its pid is ``argv``'s
        after ``exec``), and into the groups whose ``cgroup.procs`` are ``also`` (another hierarchy's).
        Should the move fail, the command still runs, outside: :meth:`holds` says."""
        return enter([self.path / "cgroup.procs", *also], argv)

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def holds(self, pid: int) -> bool:
        """Whether ``pid`` is in this group."""
        return pid in self.pids()

    def _write(self, name: str, value: str) -> bool:
        try:
            (self.path / name).write_text(value)
            return True
        except OSError:
            return False

    def frozen(self) -> bool:
        try:
            return "frozen 1" in (self.path / "cgroup.events").read_text().splitlines()
        except OSError:
            return False

    def freeze(self, limit: float = 2.0) -> bool:
        """Freeze every process in the group; True once the kernel says all are frozen (within ``limit`` s)."""
        if not self._write("cgroup.freeze", "1"):
            return False
        deadline = time.monotonic() + limit
        while not self.frozen():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)
        return True

    def thaw(self) -> None:
        self._write("cgroup.freeze", "0")

    def cpu_seconds(self) -> float:
        """User and system CPU seconds of every process that has been in the group, exited ones
        included (microseconds; -1.0 where it cannot be read)."""
        try:
            for line in (self.path / "cpu.stat").read_text().splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1e6
        except (OSError, ValueError):
            pass
        return -1.0

    def settled_cpu_seconds(self, step: float = 0.002, limit: float = 0.05) -> float:
        """:meth:`cpu_seconds` of a frozen group, once the count has stopped moving: read every
        ``step`` s until two readings agree (at most ``limit`` s; then the last). The kernel says
        a group is frozen when its last thread has entered the freezer, just before that thread
        is switched out, and only the switch adds the CPU time it ran since the last scheduler
        tick (up to a tick per thread, several ms). A reading taken in between misses that time,
        and the pause's account would charge it to the learner as CPU used while frozen: a
        fresh-clone CI run flagged an honest notebook ('escaped-pause', 0.007 s) that way."""
        reading, deadline = self.cpu_seconds(), time.monotonic() + limit
        while time.monotonic() < deadline:
            time.sleep(step)
            again = self.cpu_seconds()
            if again == reading:
                break
            reading = again
        return reading

    def kill(self) -> None:
        """Kill every process in the group, frozen or not (whoever their parents are now)."""
        if self._write("cgroup.kill", "1"):
            return
        for _ in range(100):  # kernels before 5.14: one by one, until none is left
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            self.thaw()
            time.sleep(0.01)

    def remove(self, limit: float = 5.0) -> None:
        """Remove the group once its processes are gone (after :meth:`kill`, and the parent's wait)."""
        deadline = time.monotonic() + limit
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.01)
        remove_folder(self.path)


def make(label: str) -> Group | None:
    """A new, empty group for one process (``label`` names it), or None where groups cannot be made."""
    folder = base()
    if folder is None:
        return None
    path = new_folder(folder, label)
    return None if path is None else Group(path)


def new_folder(folder: Path, label: str) -> Path | None:
    """A new group in ``folder``, named for ``label`` and this grader's pid (so :func:`sweep` can tell
    a dead grader's leftovers), or None where it cannot be made."""
    path = folder / f"grading-{label}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        path.mkdir()
    except OSError:
        return None
    return path

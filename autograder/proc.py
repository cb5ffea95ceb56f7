"""Process trees: find every descendant of a process, signal or kill them all.

Used by the nbgrader runner (``runner.py``) and the grading sandbox (``sandbox/``): a learner's
code may start processes of its own, and none of them may outlive its submission.
"""

from __future__ import annotations

import os
import signal


def _children() -> dict[int, list[int]]:
    """Every live process's children, by parent pid, from /proc (empty where it does not exist)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        # Format: "pid (comm) state ppid ..."; comm may itself contain spaces or parens.
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def descendants(root: int) -> list[int]:
    """All live descendants of ``root``, from /proc (empty where /proc does not exist).

    Jupyter starts kernels in a session of their own, so killing our process group alone
    would leave a runaway kernel behind.
    """
    children = _children()
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    # Stop the leader first so that it cannot start anything new, then the rest.
    for target in [pid, *descendants(pid)]:
        try:
            os.kill(target, signal.SIGSTOP if target == pid else signal.SIGKILL)
        except ProcessLookupError:
            pass
    for target in descendants(pid):
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def signal_tree(pid: int, sig: int, *, only=None) -> None:
    """Send ``sig`` to ``pid`` and its descendants (those for which ``only(pid)`` holds, if given)."""
    for target in [pid, *descendants(pid)]:
        if only is not None and not only(target):
            continue
        try:
            os.kill(target, sig)
        except (ProcessLookupError, PermissionError):
            pass


def shallowest(root: int, keep) -> list[int]:
    """The processes at or under ``root`` for which ``keep(pid)`` holds that lie nearest to it:
    all those of the first generation (``root`` itself the zeroth) that has any."""
    children = _children()
    level = [root]
    while level:
        found = [p for p in level if keep(p)]
        if found:
            return found
        level = [c for p in level for c in children.get(p, [])]
    return []


def is_python(pid: int) -> bool:
    """Whether ``pid`` runs a Python interpreter: its executable's name starts with 'python'. Not its
    command name (``/proc/<pid>/comm``), which is its main thread's name: torch 2.4 renames that thread
    ``pt_main_thread`` as it loads, and any code can rename it, so a process that imported torch went
    unsignalled (a cell past its limit was never interrupted: the submission timed out whole, on the
    torch 2.4 the course supports). The command name only where the executable cannot be read."""
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith("python")
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as fh:
            return fh.read().startswith("python")
    except OSError:
        return False

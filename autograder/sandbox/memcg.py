"""The kernel's own count of a learner's memory: a memory cgroup, where the machine lets the grader
make one.

The parent's memory cap is a poll: the processes' resident memory, plus what :mod:`.held` finds
the kernel holding for the sandbox outside them (tmpfs files, memory files open in the tree,
socket queues). Memory that only the kernel refers to escapes that look. A memory file passed
over a unix socket (``socket.send_fds``) and closed is in no process's descriptor table while it
waits in the socket's queue: a learner that wrote 1.4 GB into such files, 96 MB at a time, held
them under a 1 GB cap and was graded "ok". Pipe buffers, and the kernel's objects of every other
kind, are in no count either.

A memory cgroup charges every page to the group of the process that made it, wherever it is
referred to from afterwards: a process's own memory, tmpfs and memory files (``shmem`` in the
group's ``memory.stat``, in flight or not) and the kernel's objects (socket buffers, pipes, page
tables, ...). So where a group can be made, the parent adds to its count what the group says
beyond what :mod:`.held` found, and the kernel holds a wall the poll cannot: the group's limit
(twice the cap, like ``RLIMIT_DATA``), where it reclaims the file cache and then kills
(``oom_kill`` in the group's events: the run's status is ``oom``).

Two places can hold one: cgroup v2, where the memory controller is enabled for the groups the
grader makes (``memory`` in its own group's ``cgroup.subtree_control``: the same group as
:mod:`.cgroup`'s), or a cgroup v1 memory hierarchy whose folder for this grader is writable (a group
of its own there). Neither (a grader that is not root, or a v2 machine without the controller
delegated): ``make`` returns None and the poll alone counts. ``GRADING_NO_CGROUP=1`` turns this off
too.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import cgroup

#: What each version calls the files read and written.
FILES = {1: {"limit": "memory.limit_in_bytes", "events": "memory.oom_control", "kernel": "memory.kmem.usage_in_bytes"},
         2: {"limit": "memory.max", "events": "memory.events", "kernel": None}}
#: cgroup v2's ``memory.stat`` keys for kernel memory, where it has no ``kernel`` total (before 5.18).
V2_KERNEL = ("kernel_stack", "pagetables", "sec_pagetables", "percpu", "sock", "slab", "vmalloc")

_BASE: list = []  # [tuple[Path, int] | None] once looked for


def base() -> tuple[Path, int] | None:
    """Where memory groups can be made (looked for once): cgroup v2's groups, if the controller is
    on for them, else this grader's v1 folder, proved by :func:`.cgroup.probe`."""
    if _BASE:
        return _BASE[0]
    found = None
    if os.environ.get(cgroup.ENV_OFF, "") in ("", "0"):
        v2 = cgroup.base()
        try:
            if v2 is not None and "memory" in (v2 / "cgroup.subtree_control").read_text().split():
                found = (v2, 2)
        except OSError:
            pass
        folder = cgroup.own_folder("memory") if found is None else None
        if folder is not None and cgroup.probe(folder, needs=("memory.stat",), setup=_probe_limit):
            found = (folder, 1)
            cgroup.sweep(folder)
    _BASE.append(found)
    return found


def _probe_limit(group: Path) -> None:
    (group / FILES[1]["limit"]).write_text(str(1 << 30))


class Memory:
    """One memory group: what the kernel charges to the processes in it, and its limit."""

    def __init__(self, path: Path, version: int, own: bool):
        self.path, self.version, self.own = path, version, own  # own: a folder of its own to remove

    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def _read(self, name: str) -> str:
        try:
            return (self.path / name).read_text()
        except OSError:
            return ""

    def _stat(self) -> dict[str, int]:
        out = {}
        for line in self._read("memory.stat").splitlines():
            key, _, value = line.partition(" ")
            try:
                out[key] = int(value)
            except ValueError:
                continue
        return out

    def limit(self, nbytes: int) -> bool:
        try:
            (self.path / FILES[self.version]["limit"]).write_text(str(int(nbytes)))
            return True
        except OSError:
            return False

    def counts(self) -> dict[str, int]:
        """Bytes charged now: ``shared`` (tmpfs, memory files, System V: ``shmem``) and ``kernel``
        (the kernel's objects: socket buffers, pipes, page tables, slab...)."""
        stat = self._stat()
        if self.version == 1:
            try:
                kernel = int(self._read(FILES[1]["kernel"]) or 0)
            except ValueError:
                kernel = 0
        else:
            kernel = stat["kernel"] if "kernel" in stat else sum(stat.get(k, 0) for k in V2_KERNEL)
        return {"shared": stat.get("shmem", 0), "kernel": kernel}

    def oom_kills(self) -> int:
        """Processes the kernel killed in this group for its limit."""
        for line in self._read(FILES[self.version]["events"]).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                try:
                    return int(value)
                except ValueError:
                    return 0
        return 0

    def remove(self) -> None:
        if self.own:
            cgroup.remove_folder(self.path)


def make(label: str, limit_bytes: int, group: cgroup.Group | None) -> Memory | None:
    """A memory group limited to ``limit_bytes`` for one process: on cgroup v2, ``group`` itself
    (its memory files); on v1, a new group (its ``cgroup.procs`` is written beside ``group``'s).
    None where none can be made."""
    where = base()
    if where is None:
        return None
    folder, version = where
    if version == 2:
        if group is None:
            return None
        memory = Memory(group.path, 2, own=False)
    else:
        path = cgroup.new_folder(folder, label)
        if path is None:
            return None
        memory = Memory(path, 1, own=True)
    if not memory.limit(limit_bytes):
        memory.remove()
        return None
    return memory

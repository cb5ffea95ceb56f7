"""A host uid of its own for every confined process, when the grader runs as root.

As root, bubblewrap sets the sandbox up without a user namespace and the process drops to an
unprivileged uid (``parent.py``). The kernel counts some limits per user, not per process: above
all the processes and threads a user may have (``RLIMIT_NPROC``, which each child sets on itself),
and its queued signals. Were every sandbox the host's ``nobody``, one learner's process holding
4,095 idle threads (a few megabytes) would leave every other sandbox of the same grader, and of any
other grader on the machine, unable to start a thread or a process: a classmate graded at the same
time (``--jobs``) would lose its cells to it (``tests/test_hostile_grading.py`` shows it). So each
process gets a uid that nothing else on the machine has, as ``isolate`` gives each of its boxes.

The uids come from a range no account uses: ``GRADING_UID_BASE`` (default 2,100,000,000, below
2**31 and above the ranges that SSSD and container tools hand out by default), :data:`SPAN` of them.
A uid is held with a lock file (``flock``) for as long as its process lives, so that two graders on
one machine never pick the same one; the kernel drops the lock if the grader dies. A uid that has
an account (``pwd``), or that some running process already uses, is passed over.

A grader that is not root runs each sandbox in a user namespace of its own, where the kernel
already counts each namespace's processes apart (Linux 5.14 and later); it needs none of this.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import secrets
import stat
import tempfile
from pathlib import Path

#: Environment variable: the first uid of the range (an integer).
BASE_ENV = "GRADING_UID_BASE"
DEFAULT_BASE = 2_100_000_000
#: How many uids the range holds: the processes that can be confined at once on one machine.
SPAN = 4096


def base() -> int:
    raw = os.environ.get(BASE_ENV, "").strip()
    if not raw:
        return DEFAULT_BASE
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{BASE_ENV} should be a whole number (the first uid of the sandboxes' range), "
                         f"got {raw!r}") from None
    if not 1000 <= value <= 2**31 - 1 - SPAN:
        raise ValueError(f"{BASE_ENV}={value}: expected a uid from 1000 to {2**31 - 1 - SPAN}, with the "
                         f"{SPAN} after it unused by any account on this machine")
    return value


def _lock_folder() -> Path:
    """A folder only root can write, for the lock files: under /run where it is there, else /tmp.
    Refuses one that is a link or that someone else owns (a trap laid in /tmp)."""
    parent = Path("/run") if os.access("/run", os.W_OK) else Path(tempfile.gettempdir())
    folder = parent / "course-grading-uids"
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise RuntimeError(f"{folder} should be a folder of this grader's user, writable by it alone "
                           f"(where it keeps the locks of the sandboxes' uids); remove it and grade again")
    return folder


def _has_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def _in_use(uid: int) -> bool:
    """Whether a running process has ``uid`` as its real, effective or saved uid."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as fh:
                line = next((line for line in fh if line.startswith("Uid:")), "")
        except OSError:
            continue
        if str(uid) in line.split()[1:4]:
            return True
    return False


class Claim:
    """One uid, held until :meth:`release` (after its process and everything it started are gone)."""

    def __init__(self, uid: int, fd: int):
        self.uid, self._fd = uid, fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def claim() -> Claim:
    """A uid of the range that no account, no running process and no other claim holds."""
    first, folder = base(), _lock_folder()
    start = secrets.randbelow(SPAN)  # graders starting together rarely try the same uid first
    for k in range(SPAN):
        uid = first + (start + k) % SPAN
        if _has_account(uid):
            continue
        fd = os.open(folder / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        if _in_use(uid):
            os.close(fd)
            continue
        return Claim(uid, fd)
    raise RuntimeError(f"all {SPAN} uids from {first} ({BASE_ENV}) are in use or belong to accounts: "
                       "too many sandboxes at once, or choose another range")

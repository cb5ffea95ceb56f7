"""Run a graded program in a fresh, confined Python process and collect what it reports.

Confinement (``bubblewrap``, Debian's ``bwrap``): the process sees the Python installation, the
virtual environment and this checkout's ``course`` package read-only, an empty writable
``/grading`` and ``/tmp``, and nothing else: not ``solutions/``, not the work folder with the
gradebook and the other submissions, not the network (every namespace but the user's is
unshared), and it runs as ``nobody``. When the grader runs as root, bwrap sets up the sandbox
without a user namespace (inside one, ``nobody`` would be host root) and the process drops to an
unprivileged uid of its own before any learner code runs: one no account and no other process on
the machine has (``uids.py``), so that no limit the kernel counts per user is shared between
sandboxes. Where bwrap is missing
(``--sandbox none``, or ``auto`` on a machine without it) the process still starts fresh in an
empty folder with ``python -I``, and the report says the run was unconfined.

Each process it starts gets a cgroup of its own where the machine allows (``cgroup.py``): a
pause is then the kernel's freeze of every process in it at once, and the end of a run kills them
all, whatever became of their parents; elsewhere, signals to the process tree, accounted for after
each pause (:class:`Pause`).

Limits: the parent owns every clock, net of the time a child spends paused while another
submission measures speed. A cell past its limit is interrupted (SIGALRM to the child's
Python), then killed 30 s later; a submission past its limit is killed; a timing turn held
longer than :data:`TURN_LIMIT` is ended and the holder killed. Memory is polled from /proc
(the ``oom`` status): the processes' resident memory and what the kernel holds for the sandbox
outside it (``held.py``: its tmpfs files, memory files, socket buffers), and where a memory cgroup
can be made, what the kernel charged it beyond that (``memcg.py``); the kernel enforces file size,
process count, open descriptors and, on a CPU, data size (rlimits set in the child before learner
code runs), the size of each tmpfs (the cap), and the memory group's limit (:data:`WALL` caps).
The judge, whose work a learner's answers can drive, is held to the same limits, its memory on its
own count against the same cap. The script host (``script_host.py``), started at the judge's
request, runs a learner's TorchScript confined as the learner's process is, and its memory counts
with the learner's; so does the bare host's (``bare_host.py``), which runs a learner's answers by
hand in a Python that has its standard library and no installed package (no torch, no NumPy), and the
program host's (``script_host.py`` again, a process of its own), which runs the programs the judge
read (``course.hand``) beside nothing else of the learner's, its TorchScript included.
Messages are bounded (``protocol.py``).
"""

from __future__ import annotations

import functools
import os
import pickle
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..intake import safe_text
from ..proc import descendants, is_python, kill_tree, shallowest, signal_tree
from . import cgroup, memcg, protocol, seccomp, uids
from .held import FDS, Held, TooManyFiles
from .protocol import ProtocolError, Reader, decode

HERE = Path(__file__).resolve().parent
CHILD = HERE / "child.py"
JUDGE = HERE / "judge.py"
SCRIPT_HOST = HERE / "script_host.py"
BARE_HOST = HERE / "bare_host.py"
PROTOCOL = HERE / "protocol.py"
SECCOMP = HERE / "seccomp.py"  # read by child.py too: lesson 10's workers add a filter of their own
#: This checkout's helper package: what the sandbox imports, whatever else is installed.
COURSE = Path(__file__).resolve().parents[2] / "course"
#: Longest a submission may hold the machine for one measurement.
TURN_LIMIT = 600.0
#: How long an interrupted cell has to stop before its process is killed.
GRACE = 30.0
#: The kernel's wall on a learner's memory group (``memcg``), in memory caps: the poll decides at
#: the cap; the kernel holds this between two of its looks (like RLIMIT_DATA's, per process).
WALL = 2.0
#: What each host runs of a learner's (in messages).
HOSTED = protocol.HOST_RUNS
#: Seconds between two looks at a learner's memory.
POLL = 0.2
#: Looks in a row that must find a process over the memory cap before its run is ``oom``.
OVER_LOOKS = 2


@dataclass
class CellReport:
    index: int
    error: str = ""
    output: str = ""
    seconds: float = 0.0
    records: list = field(default_factory=list)
    tampered: bool = False
    #: What ran in the learner's processes while the judge held them paused during this cell ("": nothing).
    escaped: str = ""
    finished: bool = False
    probed: bool = False  # a served cell whose check asked the learner's process to run a probe


@dataclass
class Outcome:
    status: str                      # ok | timeout | oom | crashed
    cells: dict[int, CellReport]
    flags: list[tuple[str, str]]
    seconds: float
    peak_rss_mb: float
    detail: str = ""
    confined: bool = True
    judge_peak_mb: float = 0.0       # the judge's count against the cap, at the parent's looks (0: no judge)


class _Turns:
    """Timing turns across submissions graded in parallel (``--jobs``): a child that starts a
    measurement gets the machine to itself; every other child is stopped (SIGSTOP or its cgroup
    frozen) until the measurement ends, and its time limits do not count the pause.

    Nothing here waits: a run's loop asks with :meth:`take` and goes on watching its processes
    (limits, memory, pipes) until the turn is its own, first come first served; the run at the head
    of the queue is woken (:attr:`_Child.wake_r`) when a turn ends. A run that waits is paused by the
    holder meanwhile, and its clocks stop with the pause, not with the wait (counted once)."""

    def __init__(self):
        self.registry = threading.Lock()
        self.children: dict[int, "_Child"] = {}
        self.holder: int | None = None
        self.queue: list[int] = []  # the children asking for the turn, in the order they asked

    def add(self, child: "_Child") -> None:
        with self.registry:
            self.children[child.pid] = child
            if self.holder is not None:
                child.pause()

    def remove(self, child: "_Child") -> None:
        with self.registry:
            self.children.pop(child.pid, None)
        self.withdraw(child)

    def withdraw(self, child: "_Child") -> None:
        """``child`` no longer asks for the turn (it leaves the queue; the next in it may take the turn)."""
        with self.registry:
            if child.pid in self.queue:
                self.queue.remove(child.pid)
                self._wake_next()

    def take(self, child: "_Child") -> bool:
        """The turn for ``child`` if it is free and no one asked before it (True); otherwise ``child``
        is queued, once, and False comes back at once."""
        with self.registry:
            if child.pid not in self.queue:
                self.queue.append(child.pid)
            if self.holder is not None or self.queue[0] != child.pid:
                return False
            self.queue.pop(0)
            self.holder = child.pid
            try:
                child.resume()  # (a no-op unless a resume that failed left it paused)
                for other in self.children.values():
                    if other is not child:
                        other.pause()
            except BaseException:  # a turn never stays held by a take that failed
                self._release()
                raise
        return True

    def end(self, child: "_Child") -> None:
        """Give the turn back, if ``child`` holds it; every other child resumes."""
        with self.registry:
            if self.holder == child.pid:
                self._release()

    def _release(self) -> None:
        """Every child resumes, whatever fails for one of them (the first failure is raised after)."""
        self.holder, failed = None, None
        for other in self.children.values():
            try:
                other.resume()
            except Exception as exc:  # noqa: BLE001 - the next still resumes: none stays paused for good
                failed = failed or exc
        self._wake_next()
        if failed is not None:
            raise failed

    def _wake_next(self) -> None:
        if self.queue and self.holder is None and self.queue[0] in self.children:
            self.children[self.queue[0]].wake()


class _Child:
    """The processes of one submission (the learner's, and the judge's when it has served
    checks): paused, resumed and clocked together. ``escaped``: what ran in them while they were
    paused for another submission's measurement (see :class:`Pause`)."""

    def __init__(self, *procs: "_Proc"):
        self.procs, self.pid = procs, procs[0].proc.pid
        self.paused_total, self.paused_since = 0.0, None
        # The two fields above change together in another run's thread (its timing turn pauses and
        # resumes this one) while this run's thread reads them: read or written under this lock only.
        self.clock_lock = threading.Lock()
        self.pauses: list[Pause] = []
        self.escaped: list[str] = []
        # Written to when a timing turn ends and this child is the first to have asked for the next:
        # its run's loop, waiting on its pipes, then looks again at once.
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)

    def wake(self) -> None:
        try:
            os.write(self.wake_w, b"\0")
        except (BlockingIOError, OSError):  # woken already (the pipe is full), or the run has ended
            pass

    def woken(self) -> None:
        """Read what :meth:`wake` wrote (any number of wakes)."""
        try:
            while os.read(self.wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        for fd in (self.wake_r, self.wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def pause(self) -> None:
        if self.paused_since is None:
            with self.clock_lock:
                self.paused_since = time.monotonic()
            self.pauses = [Pause(p) for p in self.procs]
            for pause in self.pauses:
                pause.begin()

    def resume(self) -> None:
        if self.paused_since is not None:
            for pause in self.pauses:
                ran = pause.end()
                if ran:
                    self.escaped.append(ran)
            self.pauses = []
            with self.clock_lock:
                self.paused_total += time.monotonic() - self.paused_since
                self.paused_since = None

    def paused(self) -> float:
        """Seconds paused so far, the pause under way included; never less than an earlier answer."""
        with self.clock_lock:
            since = self.paused_since
            return self.paused_total + (time.monotonic() - since if since is not None else 0.0)


TURNS = _Turns()


def bwrap_works() -> bool:
    exe = shutil.which("bwrap")
    if not exe:
        return False
    try:
        return subprocess.run([exe, "--ro-bind", "/", "/", "--unshare-all", "--", "true"],
                              capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@functools.lru_cache(maxsize=None)
def bwrap_sizes_tmpfs() -> bool:
    """Whether this bwrap can give a tmpfs a size (``--size``, bubblewrap 0.7 and later)."""
    try:
        text = subprocess.run(["bwrap", "--help"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    return "--size" in text


def choose_sandbox(kind: str) -> str:
    """``bwrap`` or ``none``; ``auto`` picks bwrap when it works on this machine."""
    if kind == "auto":
        return "bwrap" if bwrap_works() else "none"
    if kind == "bwrap" and not bwrap_works():
        from . import UsageError
        raise UsageError("--sandbox bwrap: bubblewrap is not installed or cannot create namespaces "
                         "here; install it (Debian: apt-get install bubblewrap) or pass --sandbox none "
                         "on a machine you trust")
    return kind


#: glibc's allocator settings of every process a run starts (see :mod:`course.allocator`).
STEADY_MALLOC = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=268435456"


def _env(extra: dict[str, str]) -> dict[str, str]:
    # LD_LIBRARY_PATH: where a GPU machine's driver library (libcuda) may be found; the folders
    # it names are visible inside only if they are under the read-only system folders bound below.
    keep = ("LANG", "LC_ALL", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
            "COURSE_DEVICE", "COURSE_THREADS", "LD_LIBRARY_PATH")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update({"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
                "HOME": "/tmp", "USER": "learner", "LOGNAME": "learner",  # as root, a uid with no account
                "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1",
                "TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor", "TRITON_CACHE_DIR": "/tmp/triton",
                # Inductor's pool of compile workers, at most two: by default it starts one per
                # core, each importing torch, and on a 16-core runner the pool alone would pass
                # the memory cap that the process tree is held to (two: what a 2-core CI gets anyway).
                "TORCHINDUCTOR_COMPILE_THREADS": str(max(1, min(2, len(os.sched_getaffinity(0))))),
                "PYTHONDONTWRITEBYTECODE": "1",
                # C memory steady from the first allocation in both processes, the learner's and
                # the judge's: the same code then runs as fast in either, whatever each did
                # before (course.allocator.TUNABLES, not imported here: that would import torch).
                "GLIBC_TUNABLES": STEADY_MALLOC})
    env.update(extra)
    return env


def bare_python() -> str:
    """The interpreter the bare host runs: this environment's base Python (a virtual
    environment's ``python`` is a link to it, and the environment itself is not mounted there)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


#: Where installed packages live below a folder the sandbox mounts (``/usr``, ``/lib``, the base
#: Python's prefix...): hidden from the bare host under an empty folder each.
PACKAGE_FOLDERS = ("python3*/site-packages", "python3*/dist-packages", "lib/python3*/site-packages",
                   "lib/python3*/dist-packages", "lib64/python3*/site-packages", "lib64/python3*/dist-packages",
                   "local/lib/python3*/site-packages", "local/lib/python3*/dist-packages",
                   "local/lib64/python3*/site-packages", "local/lib64/python3*/dist-packages")


def package_folders(roots: list[str]) -> list[str]:
    """Every folder of installed packages below ``roots`` (as the sandbox sees them: the same
    paths), this interpreter's own site folders included."""
    import glob
    import site

    found = {path for root in roots for pattern in PACKAGE_FOLDERS
             for path in glob.glob(os.path.join(root, pattern))}
    try:
        found.update(site.getsitepackages())
        found.add(site.getusersitepackages())
    except AttributeError:  # an interpreter without them (some embedded builds)
        pass
    return sorted(p for p in found if os.path.isdir(p) and not os.path.islink(p)
                  and any(p == r or p.startswith(r.rstrip("/") + "/") for r in roots))


def _bwrap_argv(script: str, args: list[str], uid: int | None = None, scratch_bytes: int | None = None,
                seccomp_fd: int | None = None) -> list[str]:
    """bwrap's argv to run ``/grading/<script> ARGS`` (``child.py`` or ``judge.py``) confined;
    ``uid``: the host uid it runs as, when the grader is root (:mod:`.uids`); ``scratch_bytes``:
    the size of each of its two writable folders, ``/tmp`` and ``/grading`` (tmpfs: what is
    written there is held in the machine's memory), where bwrap can set one; ``seccomp_fd``: a
    descriptor bwrap reads the filter from (:mod:`.seccomp`: no namespaces of its own)."""
    size = ["--size", str(int(scratch_bytes))] if scratch_bytes and bwrap_sizes_tmpfs() else []
    binds: list[str] = []
    system = ("/usr", "/lib", "/lib64", "/bin", "/sbin", "/etc")
    for path in system:
        binds += ["--ro-bind-try", path, path]
    bare = script == "bare_host.py"  # the interpreter and its standard library, no installed package
    envs = sorted({os.path.realpath(sys.base_prefix)} if bare else
                  {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), sys.prefix})
    # Mount points' parents as plain 0755 folders: the environment may sit below a private one
    # (/root, a checkout made by mktemp -d) that the sandbox's user could not otherwise pass.
    parents = sorted({str(a) for path in envs for a in Path(path).parents if str(a) != "/"}, key=len)
    dirs = [x for a in parents for x in ("--perms", "0755", "--dir", a)]
    for path in envs:
        binds += ["--ro-bind", path, path]
    if bare:  # after the binds: each folder of packages mounted over with an empty one
        binds += [x for path in package_folders([*system, *envs]) for x in ("--tmpfs", path)]
    devices: list[str] = []
    if Path("/dev/nvidiactl").exists() and not bare:  # a GPU runner: let the child reach the devices
        # After --dev /dev (below), which mounts a fresh /dev over anything bound there before.
        names = ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", *(f"nvidia{i}" for i in range(16))]
        devices = [x for name in names for x in ("--dev-bind-try", f"/dev/{name}", f"/dev/{name}")]
    command = [bare_python(), "-I", "-S", f"/grading/{script}", *args] if bare else \
        [sys.executable, "-I", f"/grading/{script}", *args]
    if os.geteuid() == 0:
        # No user namespace (inside it, uid 65534 would be host root): bwrap makes the mounts as
        # root, then the child runs as a uid of its own, with no capabilities left.
        if uid is None:
            raise ValueError("a grader running as root confines each process as a uid of its own (uids.claim())")
        spaces = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        command = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                   "--bounding-set=-all", "--no-new-privs", *command]
    else:
        spaces = ["--unshare-all", "--unshare-user", "--uid", "65534", "--gid", "65534"]
    return ["bwrap", *spaces, "--die-with-parent", "--new-session",
            # /tmp first: the environment itself may live under /tmp and is bound over it.
            "--perms", "1777", *size, "--tmpfs", "/tmp", *dirs, *binds, "--proc", "/proc", "--dev", "/dev", *devices,
            "--perms", "0755", *size, "--tmpfs", "/grading",
            "--ro-bind", str(CHILD), "/grading/child.py", "--ro-bind", str(JUDGE), "/grading/judge.py",
            "--ro-bind", str(SCRIPT_HOST), "/grading/script_host.py", "--ro-bind", str(PROTOCOL), "/grading/protocol.py",
            "--ro-bind", str(BARE_HOST), "/grading/bare_host.py", "--ro-bind", str(SECCOMP), "/grading/seccomp.py",
            # The course is not the bare host's: it imports torch, and the bare host has none.
            *(["--perms", "0755", "--dir", "/grading/pkg", "--ro-bind", str(COURSE.resolve()), "/grading/pkg/course"]
              if not bare else []),
            # The references that reproduce exercises are the judge's alone: hidden from every process
            # that runs learner code (the learner's, the script host).
            *(["--tmpfs", "/grading/pkg/course/references"] if script not in ("judge.py", "bare_host.py") else []),
            "--perms", "0777", "--dir", "/grading/cells", "--chdir", "/grading/cells",
            *(["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []), "--", *command]


def _resident_bytes(pids: list[int]) -> float:
    """The resident bytes of ``pids`` now, summed (``/proc/<pid>/statm``)."""
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/statm") as fh:
                total += int(fh.read().split()[1])
        except (OSError, ValueError, IndexError):
            pass
    return total * float(os.sysconf("SC_PAGE_SIZE"))


def _tree_rss_mb(tree: list[int]) -> float:
    return _resident_bytes(tree) / 2**20


def _private_bytes_and_files_once(pids: list[int]) -> float:
    """The resident bytes of ``pids`` with the file-backed pages counted once: each process's private
    and shared-memory pages (``RssAnon`` and ``RssShmem`` in ``/proc/<pid>/status``), summed, and the
    largest ``RssFile`` among them. A host's processes (the program host and the workers it starts for
    lesson 10) map the same libraries (torch's, about 77 MB a process), which the kernel keeps once;
    summed per process they made lesson 10's instructor run read 2,227 MB, about 400 MB of it the same
    library pages counted again."""
    private, files = 0, 0
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as fh:
                fields = dict(line.split(":", 1) for line in fh if line.startswith("Rss"))
            private += sum(int(fields.get(k, "0 kB").split()[0]) for k in ("RssAnon", "RssShmem"))
            files = max(files, int(fields.get("RssFile", "0 kB").split()[0]))
        except (OSError, ValueError, IndexError):
            pass
    return (private + files) * 1024.0


def tree_cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of ``pid`` and its descendants, their reaped children included:
    what a learner's process tree has used, every thread and helper process counted (a thread
    that has ended stays in its process's count; a child, in its parent's once reaped)."""
    ticks = 0
    for p in [pid, *descendants(pid)]:
        try:
            with open(f"/proc/{p}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            ticks += sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
        except (OSError, ValueError, IndexError):
            pass
    return ticks / os.sysconf("SC_CLK_TCK")


def learner_cpu_seconds(proc: "_Proc") -> float:
    """The CPU seconds every process of ``proc`` has used: its cgroup's count (microseconds, exited
    processes included, whatever their parent became), else its tree's (:func:`tree_cpu_seconds`)."""
    if proc.group is not None and proc.group.holds(proc.proc.pid):
        reading = proc.group.cpu_seconds()
        if reading >= 0:
            return reading
    return tree_cpu_seconds(proc.proc.pid)


def learner_wait_seconds(proc: "_Proc") -> float:
    """The seconds the live threads of every process of ``proc`` (its cgroup's, else its tree's) have
    spent ready to run but waiting for a CPU, from the scheduler's count (:func:`_schedstat`; -1.0
    where the kernel keeps none). Beside :func:`learner_cpu_seconds`: a process that waited for a
    CPU wanted to work (a busy machine), one that slept did not (a function that sleeps to look like
    a loop): ``course.checks.jacobians`` tells the two apart."""
    pids = proc.group.pids() if proc.group is not None and proc.group.holds(proc.proc.pid) else []
    waited, seen = 0, False
    for pid in pids or [proc.proc.pid, *descendants(proc.proc.pid)]:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                waited += _schedstat(pid, tid)[1]
                seen = True
            except (OSError, ValueError, IndexError):
                pass
    return waited / 1e9 if seen else -1.0


def _start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, field 22 of its ``stat``); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


#: The learner's interpreter found under each sandbox root, (root, its start) -> (pid, its start): the
#: judge asks for its main thread's counts around every call it times, and a walk over /proc costs a
#: millisecond per hundred processes on the machine.
_MAINS: dict[tuple[int, int], tuple[int, int]] = {}


def learner_main_pid(root: int) -> int | None:
    """The learner's interpreter (the shallowest Python process at or under ``root``: the sandbox's
    own processes sit above it, the learner's below it), or None where there is not exactly one;
    found once per run, and found again only if that process is gone."""
    rooted = _start_time(root)
    if rooted is None:
        return None
    known = _MAINS.get((root, rooted))
    if known is not None and _start_time(known[0]) == known[1]:
        return known[0]
    found = shallowest(root, is_python)
    started = _start_time(found[0]) if len(found) == 1 else None
    if started is None:
        return None
    _MAINS[(root, rooted)] = (found[0], started)
    return found[0]


def main_thread_wait_seconds(root: int) -> float:
    """The seconds the main thread of the learner's interpreter (:func:`learner_main_pid`) has waited,
    ready to run, for a CPU; -1.0 where not known. The thread that runs what the judge asks for: its
    waits are the ones on the way of a request and its reply."""
    return _main_thread_seconds(root, 1)


def main_thread_cpu_seconds(root: int) -> float:
    """CPU seconds of the main thread of the learner's interpreter (:func:`learner_main_pid`), from
    the scheduler's nanosecond count; -1.0 where no single such process is found or the kernel
    keeps no such count (a reading in clock ticks would be too coarse to compare). What the
    course's code run there costs its one thread, apart from any other thread of the learner's
    (``course.timing.compare_served(calibrate=...)``)."""
    seconds = _main_thread_seconds(root, 0)
    return seconds if seconds > 0 else -1.0


def _main_thread_seconds(root: int, field: int) -> float:
    """Field ``field`` of :func:`_schedstat` of the learner's interpreter's main thread, in seconds
    (-1.0: not known)."""
    return main_thread_counts(root)[field]


def main_thread_counts(root: int) -> tuple[float, float]:
    """The seconds the learner's interpreter's main thread (:func:`learner_main_pid`) has run and has
    waited, ready to run, for a CPU, from one reading of its ``schedstat`` (-1.0 each: not known)."""
    pid = learner_main_pid(root)
    if pid is None:
        return -1.0, -1.0
    try:
        ran, waited = _schedstat(pid, pid)
    except (OSError, ValueError, IndexError):
        return -1.0, -1.0
    return ran / 1e9, waited / 1e9


def _schedstat(pid: int, tid: int | str) -> list[int]:
    """The scheduler's counts for thread ``tid`` of ``pid``, in nanoseconds: the time it has run, and
    the time it has waited, ready to run, for a CPU (its ``schedstat``); raises ``OSError`` when it is
    gone."""
    with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
        return [int(x) for x in fh.read().split()[:2]]


def tree_peak_bytes(pid: int, reset: bool = False) -> float:
    """The peak resident memory (``VmHWM``, bytes) of ``pid`` and its descendants, summed; with
    ``reset``, each one's peak is first set back to what is resident now (``clear_refs``, 5)."""
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            if reset:
                with open(f"/proc/{p}/clear_refs", "w") as fh:
                    fh.write("5")
            with open(f"/proc/{p}/status") as fh:
                total += next((int(line.split()[1]) for line in fh if line.startswith("VmHWM:")), 0)
        except (OSError, ValueError, IndexError):
            pass
    return total * 1024.0


class PeakWatch:
    """The most memory a process tree held at once between :meth:`start` and :meth:`stop`, seen from
    outside: its resident bytes, sampled every ``interval`` seconds on a thread of this process (its
    members looked up again every ``refresh`` seconds), beside the kernel's own peak (``VmHWM``).

    Why both: ``VmHWM`` sees the briefest peak, but the tree can set it back itself (``clear_refs``),
    from native code where no audit hook looks (a C++ extension compiled in the sandbox), and it
    leaves with a helper process that ends before the reading. The resident count cannot be set back
    by anyone; a Hessian written to memory is resident for far longer than a sample's interval (at
    n = 4,096 in float64, 134 MB take tens of milliseconds just to write), and a helper that builds
    it is sampled while it lives."""

    def __init__(self, pid: int, interval: float = 0.001, refresh: float = 0.05):
        self.pid, self.interval, self.refresh = pid, interval, refresh
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.most = 0.0

    def _run(self) -> None:
        pids, looked = [self.pid, *descendants(self.pid)], time.monotonic()
        while not self._stop.is_set():
            if time.monotonic() - looked > self.refresh:
                pids, looked = [self.pid, *descendants(self.pid)], time.monotonic()
            self.most = max(self.most, _resident_bytes(pids))
            self._stop.wait(self.interval)

    def start(self) -> float:
        """Reset the kernel's peak and start sampling; returns the tree's peak now (its resident bytes)."""
        self.stop()
        self._stop.clear()
        now = tree_peak_bytes(self.pid, reset=True)
        self.most = 0.0
        self._thread = threading.Thread(target=self._run, name="peak-watch", daemon=True)
        self._thread.start()
        return now

    def stop(self) -> float:
        """Stop sampling; the most the tree held since :meth:`start`: the larger of the kernel's peak
        and the most resident bytes sampled."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        return max(tree_peak_bytes(self.pid), self.most)


def task_limit(jobs: int = 1) -> int:
    """The processes and threads one learner's sandbox may have (``RLIMIT_NPROC``, counted per
    sandbox: see :mod:`.uids`): 4,096, less where ``jobs`` sandboxes at that many would take more
    than a quarter of the machine's process ids (``kernel.pid_max``, 32,768 on many machines), but
    never under 1,024 (a lesson's run uses a few hundred at most)."""
    try:
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        pid_max = 32768
    return max(1024, min(4096, pid_max // (4 * max(1, jobs))))


#: The parts of a memory count outside the processes' resident memory, as an ``oom`` detail names them.
OUTSIDE = {"files": "the files it wrote in the sandbox's /tmp or /grading (kept in memory)",
           "memory files": "memory files (memfd) it holds open",
           "sockets": "data queued in its sockets",
           "shared": "shared memory only the kernel refers to (memory files passed away, System V)",
           "kernel": "the kernel's objects made for it (socket and pipe buffers, page tables)"}


def _memory_look(proc: "_Proc", held: Held | None, files_once: bool = False) -> tuple[float, dict[str, int]]:
    """One look at the memory of ``proc``'s tree (one walk over it): its resident MB, and the bytes
    the kernel holds for it outside that, by part (:data:`OUTSIDE`): what ``held`` finds (tmpfs
    files, memory files, socket queues), and what its memory group was charged beyond that.
    ``files_once``: the tree's file-backed pages counted once (:func:`_private_bytes_and_files_once`;
    the hosts' trees). Raises :class:`TooManyFiles`."""
    tree = [proc.proc.pid, *descendants(proc.proc.pid)]
    rss = _private_bytes_and_files_once(tree) / 2**20 if files_once else _tree_rss_mb(tree)
    outside = held.bytes(tree) if held is not None else {}
    if proc.memory is not None:  # what the kernel charged beyond what was found
        kernel = proc.memory.counts()
        seen = outside.get("files", 0) + outside.get("memory files", 0)
        outside["shared"] = max(0, kernel["shared"] - seen)
        outside["kernel"] = max(0, kernel["kernel"] - outside.get("sockets", 0))
    return rss, outside


def _limits(memory_mb: float, env: dict[str, str], tasks: int = 4096) -> str:
    """The rlimits a confined process (the learner's, the judge) sets on itself before it runs a
    cell, as ``name=value,...``."""
    import resource

    fds = min(FDS, resource.getrlimit(resource.RLIMIT_NOFILE)[1])  # never above the grader's own
    limits = {"FSIZE": 256 * 2**20, "NPROC": int(tasks), "NOFILE": fds, "CORE": 0}
    if env.get("CUDA_VISIBLE_DEVICES") == "" or not Path("/dev/nvidiactl").exists():
        # CUDA maps huge private ranges; on a CPU, twice the cap is a backstop the kernel enforces.
        limits["DATA"] = int(2 * memory_mb * 2**20)
    return ",".join(f"{k}={v}" for k, v in limits.items())


def _stop_and_wait(pid: int, limit: float = 1.0) -> bool:
    """SIGSTOP the tree of ``pid`` and wait (at most ``limit`` s) until every thread is stopped,
    signalling again any process found running (one started after a walk over /proc was not
    signalled); True once two walks in a row find nothing running."""
    signal_tree(pid, signal.SIGSTOP)
    deadline, quiet = time.monotonic() + limit, 0
    while time.monotonic() < deadline:
        running = []
        for p in [pid, *descendants(pid)]:
            try:
                for task in os.listdir(f"/proc/{p}/task"):
                    with open(f"/proc/{p}/task/{task}/stat") as fh:
                        state = fh.read().rsplit(")", 1)[1].split()[0]
                    if state not in ("T", "t", "Z", "X"):
                        running.append(p)
                        break
            except (OSError, IndexError):
                continue
        for p in running:
            try:
                os.kill(p, signal.SIGSTOP)
            except OSError:
                pass
        quiet = 0 if running else quiet + 1
        if quiet >= 2:
            return True
        time.sleep(0.001)
    return False


#: CPU seconds a paused tree may still show when its pause ends: a process that was already
#: exiting, or in an uninterruptible wait, when it was stopped. What escapes a pause runs far more.
PAUSE_SLACK = 0.002


def _scheduled_ns(pids: list[int]) -> dict[int, int]:
    """Per live process of ``pids``: the scheduler's nanosecond count, summed over its threads."""
    out = {}
    for p in pids:
        total = 0
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                total += _schedstat(p, task)[0]
        except (OSError, ValueError, IndexError):
            continue
        out[p] = total
    return out


class Pause:
    """One process's tree held still for a while, with an account of whether it was.

    With the process's cgroup (:mod:`.cgroup`), the kernel freezes every process in it at once,
    those forked meanwhile included, and the group's CPU count, which keeps the time of processes
    that have exited, must not grow. Without one: SIGSTOP to the tree, repeated until every process
    in it is seen stopped; afterwards no process that was there may have run (the scheduler's count
    of its threads), and a process that was not there counts all the CPU it used. A learner's chain
    of processes that fork and exit faster than a walk over /proc can escape the signals; it shows
    in those counts unless its members have all exited before the pause ends, reaped by a process
    of its own that ignores them: the cgroup is the wall, the signals and their account a fallback
    (``docs/grading.md``)."""

    def __init__(self, proc: "_Proc"):
        self.proc, self.group = proc, None
        self.cpu, self.ns = 0.0, {}

    def begin(self) -> None:
        pid, group = self.proc.proc.pid, self.proc.group
        if group is not None and group.holds(pid) and group.freeze():
            self.group = group
            self.cpu = group.settled_cpu_seconds()
        else:  # no group, or the kernel did not say it froze (a process stuck in a disk wait): signals
            if group is not None:
                group.thaw()
            _stop_and_wait(pid)
            self.ns = _scheduled_ns([pid, *descendants(pid)])

    def end(self) -> str:
        """Resume the tree; what ran in it while it was held ("": nothing did)."""
        pid, started = self.proc.proc.pid, 0
        if self.group is not None:
            used = self.group.cpu_seconds() - self.cpu
            self.group.thaw()
        else:
            now = _scheduled_ns([pid, *descendants(pid)])
            signal_tree(pid, signal.SIGCONT)
            started = sum(1 for p in now if p not in self.ns)
            used = sum(max(0, n - self.ns.get(p, 0)) for p, n in now.items()) / 1e9
        if used <= PAUSE_SLACK:
            return ""
        return (f"its processes used {used:.3f} s of CPU while paused"
                + (f", {started} of them started meanwhile" if started else "")
                + ("" if self.group is not None else " (they escaped the grader's SIGSTOP)"))


class _Proc:
    """One confined process of a run and its two pipes (frames in, messages out)."""

    def __init__(self, script: str, args: list[str], *, sandbox: str, env: dict, log: Path, token: str,
                 extra_fds: tuple[int, ...] = (), scratch_bytes: int | None = None,
                 memory_limit: int | None = None):
        to_r, self.to_w = os.pipe()
        os.set_blocking(self.to_w, False)  # see send(): the parent never waits for a process to read
        self.outbox = bytearray()
        self.from_r, from_w = os.pipe()
        self.token, self.reader, self.done = token, Reader(), False
        self.ready = False  # said so after installing its alarm handler: SIGALRM is safe to send from then on
        self.scratch = None
        self.uid: uids.Claim | None = None
        filter_fd = None
        fds = [str(to_r), str(from_w)]
        # Every process it starts, whatever becomes of its parent, stays in its cgroup (if one can be made).
        self.group = cgroup.make(Path(script).stem)
        # The kernel's count of its memory, wherever it is referred to from, and a wall at memory_limit.
        self.memory = memcg.make(Path(script).stem, memory_limit, self.group) if memory_limit else None
        if sandbox == "bwrap":
            # As root, a uid of its own: no per-user count of the kernel's shared with another sandbox.
            self.uid = uids.claim() if os.geteuid() == 0 else None
            # No namespaces of its own: what it kept in them would be out of the parent's sight.
            bpf = seccomp.program()
            if bpf is not None:
                filter_fd = os.memfd_create("seccomp", os.MFD_CLOEXEC)
                os.write(filter_fd, bpf)
                os.lseek(filter_fd, 0, os.SEEK_SET)
                extra_fds = (*extra_fds, filter_fd)
            argv = _bwrap_argv(script, fds + _sandbox_args(script, args), self.uid.uid if self.uid else None,
                               scratch_bytes, filter_fd)
            cwd = "/"
        else:
            self.scratch = tempfile.mkdtemp(prefix="grading-")
            (Path(self.scratch) / "cells").mkdir()
            argv = [*([bare_python(), "-I", "-S"] if script == "bare_host.py" else [sys.executable, "-I"]),
                    str(HERE / script), *fds, *_local_args(script, args, f"{self.scratch}/cells")]
            cwd = f"{self.scratch}/cells"
        also = [self.memory.procs()] if self.memory is not None and self.memory.own else []
        if self.group is not None:
            argv = self.group.wrap(argv, *also)
        elif also:
            argv = cgroup.enter(also, argv)
        try:
            with open(log, "wb") as logfh:
                self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=logfh,
                                             stderr=subprocess.STDOUT, pass_fds=(to_r, from_w, *extra_fds),
                                             start_new_session=True)
        except BaseException:
            if self.uid is not None:
                self.uid.release()
            if self.memory is not None:
                self.memory.remove()
            raise
        finally:
            if filter_fd is not None:
                os.close(filter_fd)
        os.close(to_r)
        os.close(from_w)

    # What the parent writes to the process waits in ``outbox`` for the pipe to take it; the write end
    # never blocks. A process that asks and never reads (a learner's code asking for the timing turn
    # in a loop, its answers filling the pipe) would otherwise stop the parent's loop mid-write, with
    # the turn held: no limit enforced, and every classmate stopped for the turn, for good.

    def send(self, message: dict) -> None:
        self.outbox += protocol.frame(pickle.dumps(message))
        self.flush()

    def go(self) -> None:
        self.answer(protocol.GO)

    def no(self) -> None:
        self.answer(protocol.NO)

    def answer(self, data: bytes) -> None:
        self.outbox += data
        self.flush()

    def flush(self) -> None:
        """Write what the pipe takes now of ``outbox``; what it does not stays for the next call."""
        while self.outbox:
            try:
                n = os.write(self.to_w, self.outbox)
            except BlockingIOError:
                return
            except OSError:  # the process is gone: nothing will read it
                self.outbox.clear()
                return
            del self.outbox[:n]

    def close(self) -> None:
        kill_tree(self.proc.pid)  # nothing the submission started outlives it
        if self.group is not None:
            self.group.kill()  # not even a process that has left the tree
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            self.proc.wait()
        if self.group is not None:
            self.group.kill()
            self.group.remove()
        if self.memory is not None:
            self.memory.remove()
        os.close(self.from_r)
        os.close(self.to_w)
        if self.uid is not None:  # every process that had it is gone
            self.uid.release()
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)


def _sandbox_args(script: str, args: list[str]) -> list[str]:
    if script == "child.py":  # CELLS_DIR PKG_ROOT LIMITS [CALL_FD REPLY_FD]
        return ["/grading/cells", "/grading/pkg", *args]
    if script == "bare_host.py":  # CALL_FD REPLY_FD LIMITS: no course there
        return list(args)
    # judge: CALL_FD REPLY_FD PKG_ROOT LIMITS SCRIPT_CALL_FD SCRIPT_REPLY_FD BARE_CALL_FD BARE_REPLY_FD;
    # script host: CALL_FD REPLY_FD PKG_ROOT LIMITS
    return [*args[:2], "/grading/pkg", *args[2:]]


def _local_args(script: str, args: list[str], cells: str) -> list[str]:
    if script == "child.py":
        return [cells, str(COURSE.parent), *args]
    if script == "bare_host.py":
        return list(args)
    return [*args[:2], str(COURSE.parent), *args[2:]]


def _readable(fds: list[int], timeout_s: float, writing: list[int] = ()) -> set[int]:
    """Those of ``fds`` with bytes to read or a closed other end (a read then returns b""), within
    ``timeout_s``; the wait ends early too when one of ``writing`` can take bytes. ``poll``, not
    ``select``, which refuses a descriptor numbered 1,024 or more (a grader with many submissions at
    once, or many files open, gets such numbers)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    for fd in writing:
        poller.register(fd, select.POLLOUT)
    return {fd for fd, _ in poller.poll(timeout_s * 1000) if fd in fds}


def run_program(cells: list[dict], *, sandbox: str, cell_timeout: float, timeout: float,
                memory_mb: float, log: Path, env: dict[str, str] | None = None,
                judge_setup: list[str] | None = None, tasks: int | None = None,
                preload: list[str] | None = None, seed_key: bytes | None = None) -> Outcome:
    """Run ``cells`` (``Program.to_message()``) in a fresh child; never raises for the child's sake.

    Test cells marked ``served`` run in a second confined process, the judge (``judge.py``), after
    the instructor's ``judge_setup`` cells; the learner's process answers its calls meanwhile.
    ``tasks``: the processes and threads the learner's sandbox may have (:func:`task_limit`);
    ``preload``: modules the learner's process imports before any learner code, beyond its own list
    (:data:`autograder.program.PRELOADS`); ``seed_key``: the class's secret key, from which the
    judge draws the seeds its checks use (:func:`course.checks.draw_seeds`; ``None``: the seeds the
    cells name)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    child_env = _env(env or {})
    limits = _limits(memory_mb, child_env, task_limit() if tasks is None else tasks)
    served = [c for c in cells if c.get("served")]
    start = time.monotonic()
    call_r = call_w = reply_r = reply_w = None
    host_fds: dict[str, list[int]] = {}  # each host's ends of its pipes to the judge, until it starts
    judge_host_fds: list[int] = []  # the judge's ends: script host's call and reply, then the bare host's
    child_args = [limits]
    if served:
        call_r, call_w = os.pipe()    # judge -> learner: requests
        reply_r, reply_w = os.pipe()  # learner -> judge: replies
        child_args += [str(call_r), str(reply_w)]
        for which in protocol.HOSTS:  # the script host (TorchScript), the bare host (answers by hand)
            host_call_r, host_call_w = os.pipe()    # judge -> host
            host_reply_r, host_reply_w = os.pipe()  # host -> judge
            host_fds[which] = [host_call_r, host_reply_w]
            judge_host_fds += [host_call_w, host_reply_r]
    wall = int(WALL * memory_mb * 2**20)  # each process's memory group: the kernel's wall between looks
    # The learner's tmpfs folders can hold no more than the memory cap each (where bwrap sizes them);
    # what they hold counts toward the cap beside the processes' memory (the poll below).
    child = _Proc("child.py", child_args, sandbox=sandbox, env=child_env, log=log, token=secrets.token_hex(16),
                  extra_fds=(call_r, reply_w) if served else (), scratch_bytes=int(memory_mb * 2**20),
                  memory_limit=wall)
    judge = None
    if served:
        # The judge runs trusted code only, but what it computes the learner's answers can drive
        # (replies are kept): the submission's limits and memory cap hold for it too, on its own count
        # (8 GB allocated by a scripted function, when TorchScript still ran in the judge, was graded
        # "ok" under a 1 GB cap). It gets its ends of the hosts' pipes now; each host starts when
        # the judge first asks for it (start_host).
        judge = _Proc("judge.py", [str(call_w), str(reply_r), limits, *map(str, judge_host_fds)],
                      sandbox=sandbox, env=child_env, log=log.with_name(log.name + ".judge"),
                      token=secrets.token_hex(16), extra_fds=(call_w, reply_r, *judge_host_fds),
                      memory_limit=wall)
        for fd in (call_r, call_w, reply_r, reply_w, *judge_host_fds):
            os.close(fd)
    procs = [p for p in (child, judge) if p is not None]  # the processes that run cells
    # The hosts the judge asked for (they run no cell): "script" runs the learner's TorchScript,
    # "bare" the learner's answers by hand, in a Python without torch (bare_host.py), "program" the
    # programs the judge read (script_host.py, never the TorchScript's process).
    hosts: dict[str, _Proc] = {}
    host_fault = ""  # why a host could not be started: the grader's failure, not the learner's

    def start_host(which: str = "script") -> bool:
        """The host ``which``, confined as the learner's process is, on the pipes the judge holds."""
        nonlocal host_fault
        fds = host_fds.get(which)
        if which not in hosts and fds:
            try:
                hosts[which] = _Proc(protocol.HOST_SCRIPTS[which], [str(fds[0]), str(fds[1]), limits], sandbox=sandbox,
                                     env=child_env, log=log.with_name(f"{log.name}.{which}"),
                                     token=secrets.token_hex(16), extra_fds=tuple(fds),
                                     scratch_bytes=int(memory_mb * 2**20), memory_limit=wall)
            except Exception as exc:  # noqa: BLE001 - no uid left, no bwrap, no memory group...
                host_fault = f"the {which} host: {type(exc).__name__}: {exc}"
                return False
            finally:
                for fd in fds:
                    os.close(fd)
                fds.clear()
            clock.procs = (*clock.procs, hosts[which])  # paused with the submission for another's measurement
        return which in hosts
    pending = list(cells)  # sent one at a time, each after the previous cell ended
    owner: list = [None, None]  # who runs the cell now, and its kind

    # The cell sent last, and since when (net seconds) its process has not started it: a process
    # still inside an interrupted call (an alarm that landed just before the call began) is
    # interrupted again, until it takes the cell or the grace runs out (see the loop below).
    waiting: dict = {"index": None, "since": None, "nudges": 0}

    def send_next() -> None:
        if not pending:
            waiting.update(index="done", since=None, nudges=0)
            return
        cell = pending.pop(0)
        waiting.update(index=cell["index"], since=None, nudges=0)
        if cell.get("served") and judge is not None:
            child.send({"index": cell["index"], "kind": "serve"})
            judge.send({"index": cell["index"], "source": cell["source"]})
            owner[:] = judge, cell.get("kind")
        else:
            child.send(cell)
            owner[:] = child, cell.get("kind")

    child.send({"token": child.token, "count": len(cells), "cell_timeout": float(cell_timeout),
                "preload": list(preload or [])})
    if judge is not None:
        judge.send({"token": judge.token, "count": len(served), "cell_timeout": float(cell_timeout),
                    "setup_cells": list(judge_setup or []), "seed_key": seed_key.hex() if seed_key else None})
    send_next()
    clock = _Child(*procs)
    holding: _Proc | None = None
    holding_since: float | None = None
    asking: _Proc | None = None  # the process whose request for the timing turn waits in TURNS' queue
    asked_in = None  # the cell it asked in

    def refuse_request() -> None:
        """The request that waits is taken out of the queue and answered NO (never granted later)."""
        nonlocal asking
        TURNS.withdraw(clock)
        asking, source = None, asking
        source.no()

    reports: dict[int, CellReport] = {}
    tampered_in: set[int] = set()
    flags: list[tuple[str, str]] = []
    status, detail = "", ""
    peak = judge_peak = 0.0
    current: CellReport | None = None
    cell_started = start
    interrupted = False
    last_poll = 0.0
    held: list[Pause] | None = None  # the judge has the learner's processes stopped (a baseline block)
    over_looks: dict[int, int] = {}  # per process: looks in a row that found it over the cap
    watch = PeakWatch(child.proc.pid)  # the learner's memory between the judge's two PEAK messages
    held_for = Held(child.proc.pid) if sandbox == "bwrap" else None  # memory outside its processes
    closed: _Proc | None = None  # a process whose pipe closed before it said it was done

    def net() -> float:
        return time.monotonic() - clock.paused()

    def finished() -> bool:
        return all(p.done for p in procs)

    ended_anyway = False

    fault: Exception | None = None  # the grader's own failure while it ran this submission
    TURNS.add(clock)  # from here on, the clean-up below takes it out again
    try:
        while True:
            now = net()
            if clock.escaped:  # kept running while paused for another submission's measurement
                flags.append(("escaped-pause", f"while another submission measured speed, {clock.escaped[0]}"[:300]))
                status, detail = "crashed", ("its processes kept running while it was paused for another "
                                             "submission's measurement; it was stopped so that no one else's "
                                             "grade depends on it")
                break
            if now - last_poll > POLL:
                last_poll = now
                over = ""
                for proc, outside_of in ((child, held_for), (judge, None)):
                    if proc is None:
                        continue
                    try:
                        rss, outside = _memory_look(proc, outside_of)
                        # The learner's TorchScript and answers by hand, run in the hosts: the learner's count.
                        in_hosts: dict[str, float] = {}
                        for which, host in (hosts.items() if proc is child else ()):
                            rss_host, more = _memory_look(host, None, files_once=True)
                            in_hosts[which] = rss_host + sum(more.values()) / 2**20
                        scripts = sum(in_hosts.values())
                    except TooManyFiles as exc:
                        over = f"{exc} (the memory cap is {memory_mb:g} MB)"
                        break
                    used = rss + sum(outside.values()) / 2**20 + scripts
                    if proc is child:
                        peak = max(peak, rss + scripts)
                    else:  # the judge's own count, against the same cap
                        judge_peak = max(judge_peak, used)
                    if used <= memory_mb:
                        over_looks[id(proc)] = 0
                        continue
                    # Over the cap at two looks in a row: a single reading past it can be a misreading (a
                    # folder read while bwrap sets the sandbox up); between two looks, the kernel's wall
                    # (the memory group's limit, WALL times the cap) holds.
                    over_looks[id(proc)] = over_looks.get(id(proc), 0) + 1
                    if over_looks[id(proc)] >= OVER_LOOKS:
                        said = "".join(f", {OUTSIDE[k]} {v / 2**20:.0f} MB" for k, v in outside.items() if v >= 2**20)
                        said += "".join(f", its {HOSTED[w]} in the {w} host {mb:.0f} MB"
                                        for w, mb in in_hosts.items() if mb >= 1)
                        over = (f"used more than the memory cap of {memory_mb:g} MB" if proc is child else
                                f"its answers made the judge process (served checks) hold {used:.0f} MB, more than "
                                f"the memory cap of {memory_mb:g} MB") + f" (its processes {rss:.0f} MB{said})"
                        break
                if over:
                    status, detail = "oom", over
                    break
            if now - start > timeout:
                status, detail = "timeout", f"ran past the limit of {timeout:g} s per submission"
                break
            if holding_since is not None and time.monotonic() - holding_since > TURN_LIMIT:
                status, detail = "timeout", f"held the machine for one measurement longer than {TURN_LIMIT:g} s"
                break
            # A cell sent but not started (after the first, so that start-up is not counted), or the
            # end not reached after the last cell: the process is stuck in an interrupted call.
            started = current is not None and current.index == waiting["index"]
            if reports and waiting["index"] is not None and not started and not finished():
                waiting["since"] = now if waiting["since"] is None else waiting["since"]
                stuck = now - waiting["since"]
                if stuck > cell_timeout + GRACE:
                    if waiting["index"] == "done":
                        ended_anyway = True  # every cell has its report: stop waiting for the goodbye
                        break
                    status, detail = "timeout", (f"the notebook's process did not start the next cell within "
                                                 f"{cell_timeout + GRACE:g} s (stuck in an interrupted call)")
                    break
                if stuck > cell_timeout * (waiting["nudges"] + 1):
                    waiting["nudges"] += 1
                    for p in procs:
                        if p.ready and not p.done:  # (before its handler, SIGALRM would end the process)
                            signal_tree(p.proc.pid, signal.SIGALRM, only=is_python)
            if current is not None and not current.finished:
                if not interrupted and now - cell_started > cell_timeout:
                    interrupted = True  # the cell raises a timeout error (in the judge and the learner's process)
                    for p in reversed(procs):  # the judge first: its verdict on a served cell is the timeout
                        signal_tree(p.proc.pid, signal.SIGALRM, only=is_python)
                elif interrupted and now - cell_started > cell_timeout + GRACE:
                    status, detail = "timeout", f"a cell ran past {cell_timeout:g} s and did not stop when interrupted"
                    break
            if asking is child and (asked_in != waiting["index"] or not (owner[0] is child and owner[1] == "test")):
                refuse_request()  # left behind by a test cell of the learner's that has ended
            if asking is not None and TURNS.take(clock):  # its turn came (first come, first served)
                holding, holding_since, asking = asking, time.monotonic(), None
                holding.go()
            for p in procs:
                p.flush()
            ready = _readable([*(p.from_r for p in procs if not p.done), clock.wake_r], 0.1,
                              [p.to_w for p in procs if p.outbox])
            if clock.wake_r in ready:
                clock.woken()
            closed = None
            for source in procs:
                if source.from_r not in ready:
                    continue
                chunk = os.read(source.from_r, 1 << 20)
                if not chunk:
                    closed = source  # it ended (or closed its pipe) before saying it was done
                    break
                try:
                    messages = source.reader.feed(chunk)
                except ProtocolError as exc:
                    flags.append(("tampered", f"the grading pipe carried {exc}"))
                    status, detail = "crashed", f"the grading pipe carried {exc}"
                    break
                for payload in messages:
                    try:
                        msg = decode(payload)
                        if msg.get("token") != source.token:
                            raise ProtocolError("a message without the harness's token")
                        kind = msg["kind"]
                        mine = source is owner[0]
                        if kind == protocol.CELL_START and mine:
                            current = reports.setdefault(int(msg["cell"]), CellReport(int(msg["cell"])))
                            cell_started, interrupted = net(), False
                        elif kind == protocol.RECORD and mine and current is not None and msg["cell"] == current.index:
                            current.records.append(msg)
                        elif (kind == protocol.CELL_END and mine and current is not None
                              and msg["cell"] == current.index):
                            current.error = safe_text(str(msg["error"]))[-protocol.MAX_ERROR_CHARS:]
                            current.output = safe_text(str(msg["output"]))[-protocol.MAX_OUTPUT_CHARS:]
                            current.seconds, current.tampered = float(msg["seconds"]), bool(msg["tampered"])
                            current.probed = msg.get("probed") is True
                            current.finished = True
                            send_next()
                        elif kind == protocol.FLAG:
                            flags.append((safe_text(str(msg["name"]))[:40], safe_text(str(msg["detail"]))[:300]))
                            if msg["name"] == "tampered" and source is child and type(msg.get("cell")) is int:
                                tampered_in.add(msg["cell"])  # found in the learner's process after that cell
                        elif kind == protocol.SPEED_BEGIN and holding_since is None and asking is None and (
                                source is judge or (mine and owner[1] == "test")):
                            # The learner's process measures in its own test cells only (as its harness
                            # asks): anywhere else a turn is its code's, pausing every classmate. Where
                            # another submission holds the turn, the request waits in the queue (taken at
                            # the top of the loop) while this loop goes on watching its processes.
                            if TURNS.take(clock):
                                holding, holding_since = source, time.monotonic()
                                source.go()
                            else:
                                asking, asked_in = source, waiting["index"]
                        elif kind == protocol.SPEED_BEGIN:
                            source.no()  # answered at once: nothing waits for a turn it will not get
                        elif kind == protocol.SPEED_END and holding is source:
                            TURNS.end(clock)
                            holding, holding_since = None, None
                        elif kind == protocol.SPEED_END and asking is source:  # (no honest harness does this)
                            refuse_request()  # it no longer wants the turn it asked for
                        elif kind == protocol.HOLD and source is judge and held is None:
                            # The bare host runs only while the judge waits for it, never during a hold.
                            held = [Pause(p) for p in (child, hosts.get("script"), hosts.get("program"))
                                    if p is not None]
                            for pause in held:
                                pause.begin()
                            source.go()
                        elif kind == protocol.HOLD:
                            source.no()
                        elif (kind == protocol.HOST and source is judge
                              and msg.get("which", "script") not in protocol.HOSTS):
                            raise ProtocolError("a request for a host of no known kind")
                        elif kind == protocol.HOST and source is judge and msg.get("stop") is True:
                            host = hosts.get(msg.get("which", "script"))
                            if host is not None:  # a call the judge gave up on (code that never returns)
                                kill_tree(host.proc.pid)
                                if host.group is not None:
                                    host.group.kill()
                            source.answer(protocol.NUMBER_ANSWER.pack(1.0))
                        elif kind == protocol.HOST and source is judge:
                            started = start_host(msg.get("which", "script"))
                            source.answer(protocol.NUMBER_ANSWER.pack(1.0 if started else 0.0))
                            if not started:  # the grader's own failure: raised below, the row says so (error)
                                status = "crashed"
                        elif kind == protocol.CPU and source is judge and msg.get("counts") is True:
                            ran, waited = main_thread_counts(child.proc.pid)
                            counts = (learner_cpu_seconds(child), learner_wait_seconds(child), waited,
                                      ran if ran > 0 else -1.0)
                            source.answer(protocol.COUNTS_ANSWER.pack(*counts))
                        elif kind == protocol.CPU and source is judge:
                            main, waited = msg.get("main") is True, msg.get("waited") is True
                            reading = (main_thread_wait_seconds(child.proc.pid) if main and waited
                                       else main_thread_cpu_seconds(child.proc.pid) if main
                                       else learner_wait_seconds(child) if waited
                                       else learner_cpu_seconds(child))
                            source.answer(protocol.NUMBER_ANSWER.pack(reading))
                        elif kind == protocol.PEAK and source is judge:
                            reading = watch.start() if msg.get("reset") is True else watch.stop()
                            source.answer(protocol.NUMBER_ANSWER.pack(reading))
                        elif kind == protocol.RELEASE and source is judge and held is not None:
                            ran, held = next(filter(None, [pause.end() for pause in held]), ""), None
                            if ran and current is not None:  # the course's baseline was not timed alone
                                current.escaped = current.escaped or ran
                                flags.append(("escaped-pause", f"cell {current.index}: {ran}"[:300]))
                        elif kind == protocol.DONE:
                            source.done = True
                        elif kind == protocol.READY:
                            source.ready = True
                    except (ProtocolError, KeyError, TypeError, ValueError) as exc:
                        why = (str(exc) if isinstance(exc, ProtocolError)
                               else f"a malformed message ({type(exc).__name__})")
                        flags.append(("tampered", f"the grading pipe carried {why}"))
                        status, detail = "crashed", "the grading pipe was written to by something other than the grader"
                        break
                    if len(flags) > 200:
                        del flags[100:-50]  # a flood of flags is kept bounded
                if status:
                    break
            if status or closed is not None or finished():
                break
    except Exception as exc:  # noqa: BLE001 - ends this run, and everything it holds, never the batch
        fault, status = exc, "crashed"
        detail = f"the grader failed while running it ({type(exc).__name__}: {exc})"[:300]

    def settle(*steps) -> None:
        """Run every step of the clean-up, whatever failed before it (the first failure is the grader's:
        raised once the run's processes are ended)."""
        nonlocal fault, status, detail
        for step in steps:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - the next step still runs
                if fault is None:
                    fault, status = exc, "crashed"
                    detail = f"the grader failed while ending it ({type(exc).__name__}: {exc})"[:300]

    # The turn is given back and the run leaves the queue for it whatever failed above (TURNS.end ends
    # only the holder's own turn); its wake pipe is closed only once it has left TURNS (a later wake
    # would write to a descriptor number reused).
    settle(watch.stop, *(pause.end for pause in held or []), lambda: TURNS.end(clock),
           lambda: (TURNS.remove(clock), clock.close()), clock.resume)
    done = finished() or ended_anyway
    if done and not status:
        try:
            child.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    if closed is not None:
        try:  # the process that closed its pipe is exiting: its own status says why
            closed.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
    for index in tampered_in:  # patching found in the learner's process right after a served cell
        if index in reports:
            reports[index].tampered = True
    exits = {id(p): p.proc.poll() for p in procs}  # before close() kills what is left
    everyone = [*procs, *hosts.values()]
    for p in everyone:
        killed = p.memory.oom_kills() if p.memory is not None else 0  # (a read that fails is 0)
        if killed and status != "oom":  # the kernel's wall: between two looks, past WALL times the cap
            whose = ("" if p is child else ", in the judge process (served checks) its answers drove" if p is judge
                     else ", in the script host, running its TorchScript" if p is hosts.get("script")
                     else ", in the program host, running its program read by the grader" if p is hosts.get("program")
                     else ", in the bare host, running its answer by hand")
            status, detail = "oom", (f"used more than {WALL:g} times the memory cap of {memory_mb:g} MB between two "
                                     f"looks{whose}: the kernel ended {killed} of its processes")
    settle(*(() if held_for is None else (held_for.close,)), *(p.close for p in everyone),
           *(lambda fd=fd: os.close(fd) for fds in host_fds.values() for fd in fds))  # fds: hosts never started
    if host_fault:
        raise RuntimeError(f"the grader could not start a process that runs a learner's code for the judge ({host_fault})")
    if fault is not None:  # its processes ended, its turn and holds given back: the row says the grader failed
        raise RuntimeError(f"the grader failed while running this submission ({type(fault).__name__}: "
                           f"{fault})") from fault
    if not status:
        hungry = [r.index for r in reports.values() if r.error.startswith("MemoryError")]
        if done and hungry:  # the kernel's data limit refused an allocation; later cells still ran
            status, detail = "oom", f"a cell ran out of memory (the limit is {memory_mb:g} MB)"
        elif done:
            status = "ok"
        else:
            status = "crashed"
            dead = closed if closed is not None else (
                judge if judge is not None and exits[id(judge)] is not None and exits[id(child)] is None else child)
            code = exits[id(dead)] if exits[id(dead)] is not None else dead.proc.returncode
            why = f"signal {-code}" if code is not None and code < 0 else f"exit status {code}"
            who = "the Python process" if dead is child else "the judge process (served checks)"
            detail = f"{who} died ({why}) before the end of the notebook"
    return Outcome(status, reports, flags, round(time.monotonic() - start - clock.paused(), 2), round(peak, 1), detail,
                   confined=sandbox == "bwrap", judge_peak_mb=round(judge_peak, 1))

"""Run a graded program in a fresh, confined Python process and collect what it reports.

Confinement (``bubblewrap``, Debian's ``bwrap``): the process sees the Python installation, the
virtual environment and the ``course`` package read-only, an empty writable ``/grading`` and
``/tmp``, and nothing else: not ``solutions/``, not the work folder with the gradebook and the
other submissions, not the network (every namespace is unshared), and it runs as ``nobody``.
Where bwrap is missing (``--sandbox none``, or ``auto`` on a machine without it) the process
still starts fresh in an empty folder with ``python -I``, and the report says the run was
unconfined.

Limits, enforced from outside: a wall-clock limit per cell and per submission (the child also
interrupts a long cell itself), and a memory cap on the whole process tree, polled from /proc.
"""

from __future__ import annotations

import io
import os
import pickle
import secrets
import select
import shutil
import struct
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .runner import _descendants, _kill_tree

CHILD = Path(__file__).resolve().parent / "child.py"
COURSE = Path(__file__).resolve().parents[1] / "course"


@dataclass
class CellReport:
    index: int
    error: str = ""
    output: str = ""
    seconds: float = 0.0
    records: list = field(default_factory=list)
    tampered: bool = False
    finished: bool = False


@dataclass
class Outcome:
    status: str                      # ok | timeout | oom | crashed
    cells: dict[int, CellReport]
    flags: list[tuple[str, str]]
    seconds: float
    peak_rss_mb: float
    detail: str = ""
    confined: bool = True


class _Turns:
    """Timing turns across submissions graded in parallel (``--jobs``): a child that starts a
    measurement gets the machine to itself; every other child is stopped (SIGSTOP) until the
    measurement ends, and its time limits do not count the pause."""

    def __init__(self):
        self.lock = threading.Lock()          # held by the child that is timing
        self.registry = threading.Lock()
        self.children: dict[int, "_Child"] = {}
        self.holder: int | None = None

    def add(self, child: "_Child") -> None:
        with self.registry:
            self.children[child.pid] = child
            if self.holder is not None:
                child.pause()

    def remove(self, child: "_Child") -> None:
        with self.registry:
            self.children.pop(child.pid, None)

    def begin(self, child: "_Child") -> None:
        self.lock.acquire()
        with self.registry:
            self.holder = child.pid
            for other in self.children.values():
                if other is not child:
                    other.pause()

    def end(self, child: "_Child") -> None:
        with self.registry:
            if self.holder != child.pid:
                return
            self.holder = None
            for other in self.children.values():
                other.resume()
        self.lock.release()


class _Child:
    def __init__(self, pid: int):
        self.pid, self.paused_total, self.paused_since = pid, 0.0, None

    def _signal(self, sig) -> None:
        for p in [self.pid, *_descendants(self.pid)]:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass

    def pause(self) -> None:
        if self.paused_since is None:
            self.paused_since = time.monotonic()
            self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.paused_since is not None:
            self._signal(signal.SIGCONT)
            self.paused_total += time.monotonic() - self.paused_since
            self.paused_since = None

    def paused(self) -> float:
        extra = time.monotonic() - self.paused_since if self.paused_since is not None else 0.0
        return self.paused_total + extra


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


def _env(extra: dict[str, str]) -> dict[str, str]:
    keep = ("LANG", "LC_ALL", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
            "COURSE_DEVICE", "COURSE_THREADS")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update({"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
                "HOME": "/tmp", "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1",
                "TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor", "TRITON_CACHE_DIR": "/tmp/triton",
                "PYTHONDONTWRITEBYTECODE": "1"})
    env.update(extra)
    return env


def _bwrap_argv(in_fd: int, out_fd: int) -> list[str]:
    binds: list[str] = []
    for path in ("/usr", "/lib", "/lib64", "/bin", "/sbin", "/etc"):
        binds += ["--ro-bind-try", path, path]
    for path in {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), sys.prefix,
                 str(COURSE.resolve())}:
        binds += ["--ro-bind", path, path]
    if Path("/dev/nvidiactl").exists():  # a GPU runner: let the child reach the devices
        binds += ["--dev-bind-try", "/dev/nvidiactl", "/dev/nvidiactl", "--dev-bind-try",
                  "/dev/nvidia-uvm", "/dev/nvidia-uvm"]
        binds += [x for i in range(8) for x in ("--dev-bind-try", f"/dev/nvidia{i}", f"/dev/nvidia{i}")]
    return ["bwrap", "--unshare-all", "--unshare-user", "--uid", "65534", "--gid", "65534",
            # /tmp first: the environment itself may live under /tmp and is bound over it.
            "--die-with-parent", "--new-session", "--tmpfs", "/tmp", *binds, "--proc", "/proc",
            "--dev", "/dev", "--tmpfs", "/grading", "--ro-bind", str(CHILD), "/grading/child.py",
            "--dir", "/grading/cells", "--chdir", "/grading/cells",
            "--", sys.executable, "-I", "/grading/child.py", str(in_fd), str(out_fd), "/grading/cells"]


def _tree_rss_mb(pid: int) -> float:
    total = 0
    for p in [pid, *_descendants(pid)]:
        try:
            with open(f"/proc/{p}/statm") as fh:
                total += int(fh.read().split()[1])
        except (OSError, ValueError, IndexError):
            pass
    return total * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_program(cells: list[dict], *, sandbox: str, cell_timeout: float, timeout: float,
                memory_mb: float, log: Path, env: dict[str, str] | None = None) -> Outcome:
    """Run ``cells`` (``Program.to_message()``) in a fresh child; never raises for the child's sake."""
    import torch

    log.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    scratch = None
    if sandbox == "bwrap":
        argv = _bwrap_argv(to_child_r, from_child_w)
        cwd = "/"
    else:
        scratch = tempfile.mkdtemp(prefix="grading-")
        (Path(scratch) / "cells").mkdir()
        argv = [sys.executable, "-I", str(CHILD), str(to_child_r), str(from_child_w), f"{scratch}/cells"]
        cwd = f"{scratch}/cells"
    start = time.monotonic()
    with open(log, "wb") as logfh:
        proc = subprocess.Popen(argv, cwd=cwd, env=_env(env or {}), stdin=subprocess.DEVNULL, stdout=logfh,
                                stderr=subprocess.STDOUT, pass_fds=(to_child_r, from_child_w),
                                start_new_session=True)
    os.close(to_child_r)
    os.close(from_child_w)
    setup = pickle.dumps({"token": token, "cells": cells, "cell_timeout": float(cell_timeout)})
    try:
        os.write(to_child_w, struct.pack(">Q", len(setup)))
        view = memoryview(setup)
        while view:
            view = view[os.write(to_child_w, view):]
    except OSError:
        pass
    child = _Child(proc.pid)
    TURNS.add(child)
    holding = False

    reports: dict[int, CellReport] = {}
    flags: list[tuple[str, str]] = []
    buf = bytearray()
    status, detail = "", ""
    peak = 0.0
    current: CellReport | None = None
    cell_started = start
    done = False
    last_poll = 0.0
    while True:
        now = time.monotonic() - child.paused()
        if now - last_poll > 0.2:
            last_poll = now
            peak = max(peak, _tree_rss_mb(proc.pid))
            if peak > memory_mb:
                status, detail = "oom", f"used more than the memory cap of {memory_mb:g} MB"
                break
        if now - start > timeout:
            status, detail = "timeout", f"ran past the limit of {timeout:g} s per submission"
            break
        if current is not None and not current.finished and now - cell_started > cell_timeout + 30:
            status, detail = "timeout", f"a cell ran past {cell_timeout:g} s and did not stop when interrupted"
            break
        ready, _, _ = select.select([from_child_r], [], [], 0.1)
        if ready:
            chunk = os.read(from_child_r, 1 << 20)
            if not chunk:
                break
            buf += chunk
        while len(buf) >= 8:
            size = struct.unpack(">Q", bytes(buf[:8]))[0]
            if len(buf) < 8 + size:
                break
            payload, buf = bytes(buf[8:8 + size]), buf[8 + size:]
            try:
                msg = torch.load(io.BytesIO(payload), weights_only=True)
                if not isinstance(msg, dict) or msg.get("token") != token:
                    raise ValueError("wrong token")
            except Exception as exc:  # noqa: BLE001 - anything unreadable is a forgery
                flags.append(("tampered", f"an unreadable or forged message on the grading pipe ({type(exc).__name__})"))
                status, detail = "crashed", "the grading pipe was written to by something other than the grader"
                break
            kind = msg["kind"]
            if kind == "cell_start":
                current = reports.setdefault(msg["cell"], CellReport(msg["cell"]))
                cell_started = time.monotonic() - child.paused()
            elif kind == "record" and current is not None and msg["cell"] == current.index:
                current.records.append(msg)
            elif kind == "cell_end" and current is not None and msg["cell"] == current.index:
                current.error, current.output = msg["error"], msg["output"]
                current.seconds, current.tampered = msg["seconds"], msg["tampered"]
                current.finished = True
            elif kind == "flag":
                flags.append((msg["name"], msg["detail"]))
            elif kind == "speed_begin" and not holding:
                TURNS.begin(child)
                holding = True
                try:
                    os.write(to_child_w, b"g")
                except OSError:
                    pass
            elif kind == "speed_end" and holding:
                TURNS.end(child)
                holding = False
            elif kind == "done":
                done = True
        if status or done:
            break
    if holding:
        TURNS.end(child)
    TURNS.remove(child)
    child.resume()
    if status or not done:
        _kill_tree(proc.pid)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        proc.wait()
    os.close(from_child_r)
    os.close(to_child_w)
    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    if not status:
        if done:
            status = "ok"
        else:
            status = "crashed"
            code = proc.returncode
            why = f"signal {-code}" if code is not None and code < 0 else f"exit status {code}"
            detail = f"the Python process died ({why}) before the end of the notebook"
    return Outcome(status, reports, flags, round(time.monotonic() - start - child.paused(), 2), round(peak, 1), detail,
                   confined=sandbox == "bwrap")

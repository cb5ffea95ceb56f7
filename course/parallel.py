"""Helpers for lesson 10_data_parallel: starting a few worker processes on one machine, joined in a
``torch.distributed`` process group, from a notebook, and never leaving one behind.

Why workers live in module files: ``torch.multiprocessing`` starts each worker with the *spawn*
method (a fresh interpreter; *fork* would copy a process that may hold threads, and CUDA refuses
it). A spawned worker finds its function again by importing it by name, ``module.function``. A
function defined in a notebook cell belongs to the kernel's ``__main__``, which the new
interpreter cannot import, so the worker fails before it starts. The lesson writes each worker's
code to a module file (:func:`write_worker`) and names it here. The course's launcher starts its
workers the same way (a fresh interpreter each) but by itself, with ``subprocess``: spawn would also
run the launching script's ``__main__`` again in every worker (a script without an
``if __name__ == "__main__":`` guard, such as a notebook runner, would start over).

:func:`launch` is the course's trusted launcher: it picks the rendezvous (a ``file://`` in a fresh
folder, or ``tcp://`` on a free local port), starts ``world_size`` processes that each join the
group, call ``function(rank, world_size, *args)`` and hand back its result, and waits for all of
them with one deadline. A worker that raises, dies or outlives the deadline ends the whole launch:
every worker is terminated (then killed), and the error names the rank and what happened
(:class:`WorkersFailed`). Nothing is left running, whatever the workers did.
"""

from __future__ import annotations

import importlib
import os
import pickle
import secrets
import shutil
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

__all__ = ["WorkersFailed", "launch", "write_worker"]


class WorkersFailed(RuntimeError):
    """A launch whose workers did not all finish: which rank failed, and how."""


#: What every worker module written from functions starts with: the names a lesson's workers use.
WORKER_HEADER = """# Written from a notebook by course.parallel.write_worker: workers import this module by its name.
import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
"""


def worker_source(*parts: Callable | str) -> str:
    """The text of a worker module: :data:`WORKER_HEADER`, then each part, a function (its source, as
    written in its cell) or a string of code. A function found only in a notebook cell's memory
    (its source cannot be read) is refused, with why."""
    import inspect
    import textwrap

    texts = [WORKER_HEADER]
    for part in parts:
        if isinstance(part, str):
            texts.append(textwrap.dedent(part))
            continue
        if not inspect.isfunction(part):
            raise TypeError(f"a worker is made of functions and code strings; got {type(part).__name__}")
        try:
            texts.append(textwrap.dedent(inspect.getsource(part)))
        except (OSError, TypeError):
            raise WorkersFailed(f"the source of {part.__name__!r} cannot be read (it was made by exec, a lambda "
                                "in an expression, or a cell that no longer exists); define it with def in a cell "
                                "and run that cell again") from None
    return "\n\n".join(t.rstrip() + "\n" for t in texts)


def write_worker(name: str, *parts: Callable | str, folder: str | os.PathLike | None = None) -> Path:
    """Write a module ``<folder>/<name>.py`` (default: the current folder) that spawned workers can
    import: :data:`WORKER_HEADER`, then each part, a function (its source is copied, see
    :func:`worker_source`) or code as a string. Drops any earlier import of that module in this
    process and returns the path. ``name`` must be a plain module name (letters, digits, underscores)."""
    if not name.isidentifier():
        raise ValueError(f"a worker module needs a plain Python name, such as 'ring_worker'; got {name!r}")
    if not parts:
        raise ValueError("write_worker needs the worker's functions (or its code as a string)")
    text = worker_source(*parts)
    path = Path(folder or os.getcwd()) / f"{name}.py"
    path.write_text(text)
    sys.modules.pop(name, None)
    importlib.invalidate_caches()
    return path


def _target_name(function: Callable | str) -> tuple[str, str]:
    if isinstance(function, str):
        module, _, name = function.partition(":")
        if not module or not name:
            raise ValueError(f"name a worker as 'module:function', e.g. 'ring_worker:main'; got {function!r}")
        return module, name
    module, name = getattr(function, "__module__", None), getattr(function, "__qualname__", "")
    if module in (None, "__main__", "__mp_main__") or "<" in name:
        raise WorkersFailed(
            f"{getattr(function, '__name__', function)!r} is defined in this notebook (module {module!r}), and a "
            "spawned worker is a fresh Python that cannot import a notebook's cells. Write the worker's code to a "
            "module file (course.parallel.write_worker('my_worker', source)) and launch 'my_worker:function'.")
    return module, name


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(spec_path: str, rank: int, key_fd: int = -1) -> None:
    """A worker process's entry (``python -c``, see :func:`launch`): read the launch's spec, and the
    key its result is signed with from ``key_fd`` (a pipe the launcher wrote it to, closed here before
    any learner code runs: the key then lives only in this call's frames), run."""
    with open(spec_path, "rb") as fh:
        spec = pickle.load(fh)  # written by the launcher in this same (learner's, if graded) sandbox
    key = b""
    if key_fd >= 0:
        while len(key) < KEY_BYTES:
            chunk = os.read(key_fd, KEY_BYTES - len(key))
            if not chunk:
                break
            key += chunk
        os.close(key_fd)
    _worker(rank, key=key, **spec)


def _worker(rank: int, world_size: int, init_method: str, backend: str, module: str, name: str, args: tuple,
            out: str, paths: list[str], timeout_s: float, key: bytes = b"") -> None:
    """One worker: join the group, run the function, write its result (or its traceback) to ``out``
    (``rank`` filled in), signed with ``key`` (:func:`_signed`), leave the group."""
    import datetime

    import torch.distributed as dist

    out = out.format(rank=rank)
    sys.path[:0] = [p for p in paths if p not in sys.path]
    result: dict[str, Any]
    report = _confine()
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s + HELD_ALLOWANCE_S))
        # Every rank in the group before any runs on: a rank whose function has no collective in it
        # would otherwise end while a slower peer is still joining (rank 0 hosts the tcp:// store, and
        # each rank one end of a connection to every peer), which fails that peer with "Connection
        # reset by peer" (seen on a busy 2-core machine, in lesson 10's first launch).
        dist.barrier()
        fn = getattr(importlib.import_module(module), name)
        result = {"ok": True, "value": fn(rank, world_size, *args)}
    except BaseException:  # noqa: BLE001 - everything goes back to the launcher, named by rank
        result = {"ok": False, "error": traceback.format_exc(limit=8)}
    result["flags"] = report()
    tmp = out + ".part"
    try:
        payload = _saved(result)
    except Exception:  # noqa: BLE001 - a result that cannot be saved is an error of its own
        payload = _saved({"ok": False, "error": f"rank {rank}'s result could not be sent back:\n"
                                                + traceback.format_exc(limit=3), "flags": result["flags"]})
    with open(tmp, "wb") as fh:
        fh.write(_signed(key, payload) + payload)
    os.replace(tmp, out)
    # The process ends here, without dist.destroy_process_group(): on torch 2.4 it can hang for good once a
    # DDP comm hook's future callback has run (gloo's thread and this one wait on each other). What this
    # rank sent has left (gloo's send returns once received); a peer still waiting on it sees the
    # connection close and fails at once, as it would after destroy_process_group().
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


#: The bytes of the key a worker signs its result with: drawn by the launcher for each launch.
KEY_BYTES = 32


def _saved(value: Any) -> bytes:
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _signed(key: bytes, payload: bytes) -> bytes:
    """The HMAC of ``payload`` under the launch's ``key``. A worker's result file is written by the
    course's worker code after the learner's function returned, but any code in that process could
    write a file there (a result the learner made up, its flags emptied): the launcher believes only a
    file signed with the key, which the learner's code never held."""
    import hashlib
    import hmac

    return hmac.new(key, payload, hashlib.sha256).digest()


class _Process:
    """A worker started with ``subprocess`` in a session of its own (so that it and anything it
    started stop together), with the few methods the launcher uses."""

    def __init__(self, command: list[str], log: str, pass_fds: tuple = ()):
        import subprocess

        with open(log, "wb") as fh:
            self.popen = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                          start_new_session=True, pass_fds=pass_fds)
        self.pid, self.log = self.popen.pid, log

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self):
        return self.popen.poll()

    def join(self, timeout: float) -> None:
        import subprocess

        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def _signal(self, sig) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def terminate(self) -> None:
        import signal

        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        import signal

        self._signal(signal.SIGKILL)

    def tail(self, chars: int = 1500) -> str:
        try:
            with open(self.log, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - chars))
                return fh.read().decode(errors="replace").strip()
        except OSError:
            return ""


#: What confined workers reported (under the grader): ``(flag, detail)`` pairs, read by the harness.
WORKER_FLAGS: list[tuple[str, str]] = []
#: Set by the grader's harness in the learner's process: the file whose ``confine_worker`` every
#: worker calls before it imports learner code (inherited by spawned workers through the environment).
GUARD_ENV = "COURSE_WORKER_GUARD"


def _confine() -> Callable[[], list]:
    """Under the grader (:data:`GUARD_ENV` names the harness's ``child.py``), seal this worker and
    install the harness's audit hook exactly as in the learner's process; return a function that
    says what they saw. Elsewhere, nothing to do."""
    guard = os.environ.get(GUARD_ENV)
    if not guard:
        return list
    import importlib.util

    spec = importlib.util.spec_from_file_location("_grading_worker_guard", guard)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.confine_worker()


#: Between two looks at the clock, a gap longer than this is the process held still, not time its
#: workers took: under the grader, another submission's timing turn freezes this one whole, workers
#: included, for as long as that turn lasts (up to ten minutes, ``HELD_ALLOWANCE_S``).
HELD_GAP_S = 1.0
#: What a worker's collectives wait beyond ``timeout_s`` before they give up: they may be frozen in the
#: middle of one for a whole timing turn of another submission's. The launcher's own clock
#: (:class:`_AwakeClock`), net of such pauses, is what stops a launch that hangs.
HELD_ALLOWANCE_S = 600.0


class _AwakeClock:
    """Seconds since it was made, as this process lived them: each gap between two calls counts at
    most :data:`HELD_GAP_S` (its callers look every few hundredths of a second). A pause of the whole
    submission does not use up a deadline read from it; a busy machine, which only slows, still does."""

    def __init__(self):
        self._last, self.spent = time.monotonic(), 0.0

    def __call__(self) -> float:
        now = time.monotonic()
        self.spent += min(max(now - self._last, 0.0), HELD_GAP_S)
        self._last = now
        return self.spent


def launch(function: Callable | str, world_size: int = 2, *args: Any, backend: str = "gloo",
           rendezvous: str = "file", timeout_s: float = 60.0, path: str | os.PathLike | None = None,
           echo: bool = True, plain: bool = False) -> list[Any]:
    """Run ``function(rank, world_size, *args)`` in ``world_size`` spawned processes joined in one
    process group, and return the results in rank order.

    ``function`` is ``"module:function"`` or a function importable by its module's name (never one
    defined in a notebook cell: see the module's docstring). ``rendezvous``: ``"file"`` (a file in a
    fresh folder: nothing listens on the network) or ``"tcp"`` (a free port on 127.0.0.1). The
    arguments and results cross processes by pickling; tensors are best returned on the CPU.
    ``timeout_s`` bounds the whole launch; a worker that raises, dies or hangs (a ``recv`` with no
    matching ``send`` waits forever) raises :class:`WorkersFailed` naming its rank, after every worker
    has been stopped. ``path``: a folder the workers import from first (default: the current folder).
    ``echo``: print what the workers printed (each line marked ``[rank r]``) once they have ended.

    Under the grader every worker confines itself before it imports anything of the learner's, as the
    learner's own process is (see :func:`_confine`), and what it saw comes back in :data:`WORKER_FLAGS`.
    ``plain``: read the results back as plain values and tensors only (``weights_only``): the program
    host's launches ask for it, and under the grader's harness (:data:`GUARD_ENV`) every launch is plain,
    so nothing a result holds runs code where it is read. The one rule, decided here."""
    import subprocess

    plain = plain or bool(os.environ.get(GUARD_ENV))

    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size should be a positive int (the number of workers), got {world_size!r}")
    if rendezvous not in ("file", "tcp"):
        raise ValueError(f"rendezvous should be 'file' or 'tcp', got {rendezvous!r}")
    module, name = _target_name(function)
    try:
        pickle.dumps(args)
    except Exception as e:  # noqa: BLE001
        raise WorkersFailed(f"the arguments cannot be sent to the workers ({type(e).__name__}: {e}); pass tensors, "
                            "numbers, strings, lists and dicts of them.") from None
    folder = tempfile.mkdtemp(prefix="course-launch-")
    init = (f"file://{folder}/rendezvous" if rendezvous == "file" else f"tcp://127.0.0.1:{_free_port()}")
    outs = [os.path.join(folder, f"rank{r}.pt") for r in range(world_size)]
    paths = [str(path or os.getcwd()), *[p for p in sys.path if p]]
    spec = os.path.join(folder, "spec.pkl")
    with open(spec, "wb") as fh:
        pickle.dump({"world_size": world_size, "init_method": init, "backend": backend, "module": module, "name": name,
                     "args": args, "out": os.path.join(folder, "rank{rank}.pt"), "paths": paths,
                     "timeout_s": timeout_s}, fh)
    root = str(Path(__file__).resolve().parent.parent)
    entry = ("import sys; sys.path.insert(0, sys.argv[3]); from course.parallel import _worker_main; "
             "_worker_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[4]))")
    flags = subprocess._args_from_interpreter_flags()
    keys = [secrets.token_bytes(KEY_BYTES) for _ in range(world_size)]  # each rank its own
    procs = []
    try:
        for r in range(world_size):
            key_r, key_w = os.pipe()
            try:
                os.write(key_w, keys[r])  # 32 bytes: the pipe holds them until the worker reads
                procs.append(_Process([sys.executable, *flags, "-c", entry, spec, str(r), root, str(key_r)],
                                      os.path.join(folder, f"rank{r}.log"), pass_fds=(key_r,)))
            finally:
                os.close(key_r)
                os.close(key_w)
        awake = _AwakeClock()  # (not a wall-clock deadline: see HELD_GAP_S)
        results: dict[int, dict] = {}  # each rank's result, read (verified, unpickled) once its file appears

        def settled() -> bool:
            _poll(outs, keys, results, plain)
            return all(_settled(p, results.get(r)) for r, p in enumerate(procs))

        while not settled() and awake() < timeout_s:
            if any(_failed(p, results.get(r)) for r, p in enumerate(procs)):
                # one failure usually brings the others down (a peer's connection resets): let them settle
                settle = time.monotonic() + 1.0
                while time.monotonic() < settle and not settled():
                    time.sleep(0.02)
                break
            time.sleep(0.02)
        for p in procs:
            if not p.is_alive() and p.pid is not None:
                p.join(1.0)
        _poll(outs, keys, results, plain)  # a rank may have written its result since the last look
        states = [_state(p, results.get(r)) for r, p in enumerate(procs)]
        for result in results.values():
            WORKER_FLAGS.extend(result.get("flags", ()))
        if echo:
            for r, p in enumerate(procs):
                for line in p.tail(4000).splitlines()[-40:]:
                    print(f"[rank {r}] {line}")
        if all(s == "finished" for s, _ in states):
            return [results[r]["value"] for r in range(world_size)]
        raise WorkersFailed(_report(name, world_size, states, timeout_s, [p.tail() for p in procs]))
    finally:
        _stop(procs)
        shutil.rmtree(folder, ignore_errors=True)


def _poll(outs: list[str], keys: list[bytes], results: dict[int, dict], plain: bool) -> None:
    """Read into ``results`` the result of every rank whose file has appeared since the last look,
    once: a worker writes its file whole (``os.replace``), and the first file there is the one that
    counts (one written over it later is not read)."""
    for r, out in enumerate(outs):
        if r not in results and os.path.exists(out):
            results[r] = _read(out, keys[r], r, plain)


def _settled(p, result: dict | None) -> bool:
    return result is not None or not p.is_alive()


def _failed(p, result: dict | None) -> bool:
    if result is not None:
        return not result["ok"]
    return not p.is_alive() and p.exitcode is not None


def _state(p, result: dict | None) -> tuple[str, str]:
    """``(kind, detail)``: finished, raised (the traceback), died (the exit code) or running."""
    if result is not None:
        return ("finished", "") if result["ok"] else ("raised", result["error"])
    if p.is_alive():
        return "running", ""
    return "died", f"exit code {p.exitcode}"


_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket closed")


def _report(name: str, world_size: int, states: list[tuple[str, str]], timeout_s: float,
            logs: list[str] | None = None) -> str:
    """Say first what most likely went wrong: a rank that died, then one that raised an error of its
    own (not a peer's connection going away), then one that hung; then every rank's state."""
    died = [r for r, (k, _) in enumerate(states) if k == "died"]
    raised = [r for r, (k, _) in enumerate(states) if k == "raised"]
    own = [r for r in raised if not any(m in states[r][1] for m in _PEER_GONE)]
    running = [r for r, (k, _) in enumerate(states) if k == "running"]
    if died:
        said = (logs or [""] * world_size)[died[0]]
        head = f"rank {died[0]} died ({states[died[0]][1]}) without a result" + (
            f"; its last output:\n{said}" if said else "")
    elif own:
        head = f"rank {own[0]} raised:\n{states[own[0]][1]}"
    elif raised:
        head = (f"rank {raised[0]} lost its connection to a peer that had ended (a send or recv, or a collective, that "
                f"the other ranks never reached):\n{states[raised[0]][1]}")
    else:
        head = (f"rank{'s' if len(running) > 1 else ''} {', '.join(map(str, running))} did not finish in {timeout_s:g} s: "
                "a recv (or a collective) that no other rank matches waits forever")
    ranks = "; ".join(f"rank {r}: {k}" + (f" ({d})" if k == "died" else "") for r, (k, d) in enumerate(states))
    return f"{name} in {world_size} workers failed: {head}\n  ({ranks}; every worker has been stopped)"


def _read(path: str, key: bytes, rank: int, plain: bool) -> dict:
    """Rank ``rank``'s result, if the course's worker wrote it (signed with the launch's ``key``); a
    file anything else wrote there is a failed rank, and under the grader a ``tampered`` flag.
    ``plain`` (:func:`launch` decides it): only plain values and tensors are read back
    (``weights_only``), and nothing a file holds runs code here."""
    import hmac
    import io

    import torch

    with open(path, "rb") as fh:
        data = fh.read()
    mac, payload = data[:32], data[32:]
    if not hmac.compare_digest(mac, _signed(key, payload)):
        flags = [("tampered", f"a worker: rank {rank}'s result was not written by the course's worker code")]
        return {"ok": False, "error": f"rank {rank}'s result was not written by the course's worker (something else "
                                      "wrote the file it leaves)", "flags": flags if os.environ.get(GUARD_ENV) else []}
    try:
        return torch.load(io.BytesIO(payload), weights_only=plain)
    except Exception as exc:  # noqa: BLE001 - what the learner's function returned could not be read back
        return {"ok": False, "error": f"rank {rank}'s result could not be read back ({type(exc).__name__}: "
                                      f"{str(exc)[:300]}); return tensors, numbers, strings, lists and dicts of them",
                "flags": []}


def _stop(procs: list) -> None:
    """Terminate every worker still running, then kill what is left of each worker's session (what a
    worker started too), and reap them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        p.kill()
        p.join(2.0)


# -- traffic, counted where it is sent ---------------------------------------------------------------

_POINT_TO_POINT = ("send", "recv", "isend", "irecv")
_COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "batch_isend_irecv")


class _Counting:
    """Counts this rank's point-to-point traffic (bytes sent, received) and notes its collectives,
    by wrapping the functions in ``torch.distributed`` and ``torch.distributed.distributed_c10d``
    (so ``from torch.distributed import send`` in a module imported afterwards is counted too)."""

    def __init__(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.traffic: dict[str, Any] = {"sent": 0, "received": 0, "collectives": []}
        self._barrier = c10d.barrier
        for module in (dist, c10d):
            for name in _POINT_TO_POINT:
                if hasattr(c10d, name):
                    setattr(module, name, self._counted(name, getattr(c10d, name)))
            for name in _COLLECTIVES:
                if hasattr(c10d, name):
                    setattr(module, name, self._noted(name, getattr(c10d, name)))

    def wire(self, start: int) -> int:
        """Bytes this process wrote since ``start`` (:func:`_written`, read by the case before the
        learner's code ran, and kept where that code cannot reach: the case's own frame): every byte
        gloo sent, whatever API sent it, plus what the process printed; -1 where the kernel does not
        say (under the grader, a failure). A barrier first, so that asynchronous sends have left."""
        self._barrier()
        now = _written()
        return now - start if start >= 0 and now >= start else -1

    # Only the outermost call counts: some releases implement recv with irecv (and send with isend),
    # and a collective may be built from others.
    _depth = 0

    def _counted(self, name, fn):
        key = "sent" if name in ("send", "isend") else "received"

        def wrapper(tensor, *a, **k):
            if self._depth == 0:
                self.traffic[key] += tensor.numel() * tensor.element_size()
            self._depth += 1
            try:
                return fn(tensor, *a, **k)
            finally:
                self._depth -= 1
        return _mark(wrapper, fn)

    def _noted(self, name, fn):
        def wrapper(*a, **k):
            if self._depth == 0:
                self.traffic["collectives"].append(name)
            self._depth += 1
            try:
                return fn(*a, **k)
            finally:
                self._depth -= 1
        return _mark(wrapper, fn)


def _written(_open=open) -> int:
    """The kernel's count of bytes this process has written (``wchar`` in ``/proc/self/io``: writes to
    files, pipes and sockets alike), or -1 where there is no such file. (``open`` is the one this
    module saw when it was imported, before any learner code.)"""
    try:
        with _open("/proc/self/io") as fh:
            for line in fh:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return -1


def _mark(wrapper, fn):
    wrapper.__wrapped__ = fn
    wrapper.__name__ = getattr(fn, "__name__", "wrapper")
    return wrapper


def _target(target: "str | dict") -> Callable:
    """The function a case calls: ``"module:function"``, or a program the judge read (``{"source",
    "bindings", "name"}``, :func:`course.hand.read_program`), defined here as the program host defines
    one: in a namespace of its own, with the imports the judge read and a few builtins."""
    if isinstance(target, dict):
        from course.hand import define

        return define(target.get("source"), target.get("bindings"), target.get("name"))
    mod, _, fn = target.partition(":")
    return getattr(importlib.import_module(mod), fn)


def rank_input(seed: int, rank: int, numel: int) -> "torch.Tensor":
    """The float64 tensor rank ``rank`` contributes in a check drawn from ``seed``."""
    import torch

    return torch.randn(numel, generator=torch.Generator().manual_seed(seed * 1009 + rank), dtype=torch.float64)


def private_part(numel: int) -> "torch.Tensor":
    """``numel`` float64 values in [-1, 1) drawn from the operating system's randomness by the process
    that calls this, 53 random bits each: no other process can compute them (as it could a seeded
    draw, from the seed the launcher gave every rank), and none can learn them unless sent about as
    many bytes as the values themselves."""
    import torch

    raw = torch.frombuffer(bytearray(os.urandom(8 * numel)), dtype=torch.int64)
    return (raw >> 11).to(torch.float64) * 2.0 ** -52  # an arithmetic shift: [-2**52, 2**52), exact in float64


def private_input(seed: int, rank: int, numel: int) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Rank ``rank``'s input in a point-to-point check: the seeded :func:`rank_input` plus a part only
    this process drew (:func:`private_part`), and that part, which the rank reports (the check
    computes what each rank should end with from them, and records the seeded remainder)."""
    own = private_part(numel)
    return rank_input(seed, rank, numel) + own, own


def all_reduce_case(rank: int, world_size: int, target: str, seed: int, numel: int) -> dict:
    """A worker for the ring all-reduce check: draws this rank's own input (:func:`private_input`: no
    rank sees another's, nor can compute it), calls ``target(tensor)`` with its traffic counted, and
    returns the tensor after the call (an all-reduce works in place, like ``dist.all_reduce``) or what
    it returned, and the private part of its input."""
    tensor, own = private_input(seed, rank, numel)
    counting = _Counting()
    start = _written()
    target = _target(target)
    out = target(tensor)
    return {"value": tensor if out is None else out, "drawn": own, **counting.traffic, "wire": counting.wire(start)}


def _noted_sizes(counting: _Counting, name: str) -> None:
    """Also note the dtype and size of every ``name`` call's tensor (a comm hook's all_reduce)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    inner = getattr(c10d, name)
    noted = counting.traffic.setdefault("tensors", [])

    def wrapper(tensor, *a, **k):
        noted.append([str(tensor.dtype).replace("torch.", ""), int(tensor.numel())])
        return inner(tensor, *a, **k)
    for module in (dist, c10d):
        setattr(module, name, _mark(wrapper, inner))


def shift_case(rank: int, world_size: int, target: str, seed: int, numel: int) -> dict:
    """A worker for the point-to-point check: this rank's own input (:func:`private_input`),
    ``target(tensor)`` with its traffic counted; the tensor it returned, and its input's private part."""
    tensor, own = private_input(seed, rank, numel)
    counting = _Counting()
    start = _written()
    target = _target(target)
    out = target(tensor.clone())
    return {"value": out, "drawn": own, **counting.traffic, "wire": counting.wire(start)}


# -- data-parallel training: the same model and data on every rank, from a seed ----------------------

def regression_model(seed: int, dtype: str = "float64") -> "torch.nn.Module":
    """The lesson's small model (8 -> 32 -> 1, tanh), its weights drawn from ``seed``."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(getattr(torch, dtype))


def regression_data(seed: int, rows: int, dtype: str = "float64") -> tuple:
    """``(inputs, targets)``: ``rows`` rows of a noisy smooth function, drawn from ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed + 7919)  # drawn in float64 whatever the dtype: the same rows
    x = torch.randn(rows, 8, generator=g, dtype=torch.float64)
    y = _targets(x, torch.randn(rows, 1, generator=g, dtype=x.dtype))
    return x.to(getattr(torch, dtype)), y.to(getattr(torch, dtype))


def _targets(x: "torch.Tensor", noise: "torch.Tensor") -> "torch.Tensor":
    import torch

    return torch.sin(x[:, :1] * 2) + 0.5 * x[:, 1:2] * x[:, 2:3] + 0.1 * noise


def private_batch(seed: int, rank: int, world_size: int, rows: int, dtype: str = "float64") -> tuple:
    """What rank ``rank`` trains on in a data-parallel check: ``(inputs, targets)`` of the whole
    batch's shape, whose rows in this rank's share (``chunk(world_size)[rank]``) were drawn in this
    process (:func:`private_part`: no other rank has them, nor can compute them) and whose other rows
    stand in for the other ranks' shares (:func:`regression_data`); and that share, which the rank
    reports (the check trains one process on the shares of every rank together). So a rank cannot
    reach the full batch's result by computing on its own: the other shares' gradients must come to
    it, which is what data parallelism does."""
    import torch

    x, y = regression_data(seed, rows)
    xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]  # views: filled in place
    xs.copy_(2 * private_part(xs.numel()).view_as(xs))
    ys.copy_(_targets(xs, private_part(ys.numel()).view_as(ys)))
    x, y = x.to(getattr(torch, dtype)), y.to(getattr(torch, dtype))
    return x, y, (x.chunk(world_size)[rank].clone(), y.chunk(world_size)[rank].clone())


def _count_rows(model) -> list:
    rows: list = []
    model.register_forward_pre_hook(lambda m, args: rows.append(int(args[0].shape[0])))
    return rows


def _params(model) -> dict:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def ddp_case(rank: int, world_size: int, target: str, seed: int, rows: int, steps: int, lr: float) -> dict:
    """A worker for the DDP check: every rank gets the same model and a batch of the full batch's
    shape (:func:`private_batch`), and calls ``target(model, inputs, targets, steps, lr)``, which must
    train on this rank's share; returns the parameters after, the rows each forward pass saw, and the
    share."""
    model = regression_model(seed)
    x, y, share = private_batch(seed, rank, world_size, rows)
    seen = _count_rows(model)
    counting = _Counting()
    _target(target)(model, x, y, steps, lr)
    return {"params": _params(model), "rows": seen, "collectives": counting.traffic["collectives"], "share": share}


def accumulate_case(rank: int, world_size: int, target: str, seed: int, rows: int, micro: int, steps: int,
                    lr: float) -> dict:
    """A worker for the gradient-accumulation check: the course wraps the model in DDP with a comm
    hook that counts gradient synchronisations (then averages, as DDP does), splits this rank's share
    into ``micro`` micro-batches and calls ``target(ddp_model, optimizer, micro_inputs,
    micro_targets)`` once per step."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = regression_model(seed)
    _, _, (share_x, share_y) = private_batch(seed, rank, world_size, rows)
    ddp = DDP(model)
    syncs: list = []

    def counted(state, bucket):
        syncs.append(1)
        buffer = bucket.buffer()
        return dist.all_reduce(buffer.div_(world_size), async_op=True).get_future().then(lambda f: f.value()[0])
    ddp.register_comm_hook(None, counted)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    seen = _count_rows(model)
    per_step, rows = [], []
    for _ in range(steps):
        before, forwards = len(syncs), len(seen)
        _target(target)(ddp, optimizer, list(share_x.chunk(micro)), list(share_y.chunk(micro)))
        per_step.append(len(syncs) - before)
        rows.append(seen[forwards:])
    return {"params": _params(model), "syncs": per_step, "rows": rows, "share": (share_x, share_y)}


def hook_case(rank: int, world_size: int, target: str, seed: int, rows: int, steps: int, lr: float) -> dict:
    """A worker for the communication-hook check: a float32 model in DDP with ``target`` registered
    as its comm hook (state ``None``: the default group), ``steps`` SGD steps on this rank's share;
    the parameters after, and the dtype and size of every tensor the hook all-reduced."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = regression_model(seed, "float32")
    _, _, (share_x, share_y) = private_batch(seed, rank, world_size, rows, "float32")
    ddp = DDP(model)
    counting = _Counting()
    _noted_sizes(counting, "all_reduce")
    ddp.register_comm_hook(None, _target(target))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        F.mse_loss(ddp(share_x), share_y).backward()
        optimizer.step()
    return {"params": _params(model), "tensors": counting.traffic.get("tensors", []),
            "collectives": counting.traffic["collectives"], "buckets": sum(p.numel() for p in model.parameters()),
            "share": (share_x, share_y)}


def train_full_batch(seed: int, rows: int, steps: int, lr: float, dtype: str = "float64", *, loss_scale: float = 1.0,
                     grad_scale: float = 1.0, accumulate: bool = False, data: tuple | None = None) -> dict:
    """One process, the full batch (``data``, else :func:`regression_data`'s rows): the reference the
    data-parallel checks compare with. ``loss_scale`` and ``grad_scale`` (and ``accumulate``: never
    zeroing gradients) make the usual mistakes' results, to name them."""
    import torch
    import torch.nn.functional as F

    model = regression_model(seed, dtype)
    x, y = data if data is not None else regression_data(seed, rows, dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        if not accumulate:
            optimizer.zero_grad()
        (F.mse_loss(model(x), y) * loss_scale).backward()
        if grad_scale != 1.0:
            for p in model.parameters():
                p.grad.mul_(grad_scale)
        optimizer.step()
    return _params(model)


# -- what data parallelism costs on this machine (reported, never graded) ------------------------------

def timing_case(rank: int, world_size: int, seed: int, width: int, depth: int, rows: int, micro: int,
                rounds: int) -> dict:
    """Seconds per training step, interleaved round by round: ``one process`` (rank 0 alone on the full
    batch with every thread the ranks have, the others waiting), ``DDP`` (every rank on its share, one
    thread each), and gradient accumulation over ``micro`` micro-batches synchronising ``every
    micro-batch`` or once (``no_sync``). Returns rank 0's times and the bytes of gradient per sync."""
    import contextlib
    import time as _time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(seed)
    layers = [torch.nn.Linear(64, width), torch.nn.Tanh()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))
    alone = torch.nn.Sequential(*[type(m)(m.in_features, m.out_features) if isinstance(m, torch.nn.Linear) else m
                                  for m in model])
    alone.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(rows, 64, generator=g), torch.randn(rows, 1, generator=g)
    share_x, share_y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
    ddp = DDP(model)
    opt, opt_alone = torch.optim.SGD(model.parameters(), lr=1e-4), torch.optim.SGD(alone.parameters(), lr=1e-4)

    def one():
        if rank == 0:
            with _threads(world_size):
                opt_alone.zero_grad()
                F.mse_loss(alone(x), y).backward()
                opt_alone.step()

    def step(sync_each: bool | None):
        opt.zero_grad()
        parts = [(share_x, share_y)] if sync_each is None else list(zip(share_x.chunk(micro), share_y.chunk(micro)))
        for i, (a, b) in enumerate(parts):
            quiet = sync_each is False and i < len(parts) - 1
            with ddp.no_sync() if quiet else contextlib.nullcontext():
                (F.mse_loss(ddp(a), b) / len(parts)).backward()
        opt.step()

    kinds = {"one process": one, "DDP": lambda: step(None), "every micro-batch": lambda: step(True),
             "no_sync": lambda: step(False)}
    times: dict = {k: [] for k in kinds}
    with _threads(1):
        for r in range(rounds + 1):  # the first round warms up
            for name, fn in kinds.items():
                dist.barrier()
                start = _time.perf_counter()
                fn()
                dist.barrier()
                if r:
                    times[name].append(_time.perf_counter() - start)
    return {"times": times, "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def _threads(n: int):
    from course.devices import threads

    return threads(n)


def torchrun(script: str | os.PathLike, nproc: int = 2, *args: str, timeout_s: float = 120.0) -> str:
    """Run ``torchrun --standalone --nproc-per-node NPROC SCRIPT ARGS`` (as ``python -m
    torch.distributed.run``: the ``torchrun`` command may not be on the PATH) and return what its
    processes printed. torchrun starts the processes, gives each ``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (so the script calls
    ``dist.init_process_group("gloo")`` with no arguments) and ``OMP_NUM_THREADS=1``, and restarts or
    stops them together. A run that fails or outlives ``timeout_s`` raises :class:`WorkersFailed` with
    its output; nothing is left running."""
    import signal
    import subprocess

    script = Path(script)
    if not script.is_file():
        raise FileNotFoundError(f"{script} does not exist: write it first (course.parallel.write_worker)")
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, str(script.resolve().parent),
                                                                   os.environ.get("PYTHONPATH", "")) if p)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={int(nproc)}",
               "-m", "course.torchrun_entry", str(script), *map(str, args)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    awake = _AwakeClock()  # (a pause of the whole submission is not the run's time: see HELD_GAP_S)
    try:
        while True:
            try:
                out, _ = proc.communicate(timeout=0.05)
                break
            except subprocess.TimeoutExpired:
                if awake() >= timeout_s:
                    raise
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise WorkersFailed(f"torchrun {script.name} did not finish in {timeout_s:g} s (every process has been "
                            f"stopped); its output:\n{out[-3000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode:
        raise WorkersFailed(f"torchrun {script.name} failed (exit code {proc.returncode}); its output:\n{out[-3000:]}")
    return out


def library_all_reduce(tensor) -> None:
    """``dist.all_reduce`` as a ring check's target: what the library itself sends (benchmarks)."""
    import torch.distributed.distributed_c10d as c10d

    getattr(c10d.all_reduce, "__wrapped__", c10d.all_reduce)(tensor)

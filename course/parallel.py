"""Helpers for lesson 10_data_parallel (groundwork): starting a few worker processes on one machine,
joined in a ``torch.distributed`` process group, from a notebook, and never leaving one behind.

Why workers live in module files: ``torch.multiprocessing`` starts each worker with the *spawn*
method (a fresh interpreter; *fork* would copy a process that may hold threads, and CUDA refuses
it). A spawned worker finds its function again by importing it by name, ``module.function``. A
function defined in a notebook cell belongs to the kernel's ``__main__``, which the new
interpreter cannot import, so the worker fails before it starts. The lesson writes each worker's
code to a module file (:func:`write_worker`) and names it here.

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


def write_worker(name: str, source: str, folder: str | os.PathLike | None = None) -> Path:
    """Write ``source`` to ``<folder>/<name>.py`` (default: the current folder) so that spawned
    workers can import it, drop any earlier import of that module in this process, and return the
    path. ``name`` must be a plain module name (letters, digits, underscores)."""
    if not name.isidentifier():
        raise ValueError(f"a worker module needs a plain Python name, such as 'ring_worker'; got {name!r}")
    path = Path(folder or os.getcwd()) / f"{name}.py"
    path.write_text(source)
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


def _worker(rank: int, world_size: int, init_method: str, backend: str, module: str, name: str, args: tuple,
            out: str, paths: list[str], timeout_s: float) -> None:
    """One worker (runs in the spawned process): join the group, run the function, write its result
    (or its traceback) to ``out``, leave the group."""
    import datetime

    import torch.distributed as dist

    sys.path[:0] = [p for p in paths if p not in sys.path]
    result: dict[str, Any]
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            fn = getattr(importlib.import_module(module), name)
            result = {"ok": True, "value": fn(rank, world_size, *args)}
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything goes back to the launcher, named by rank
        result = {"ok": False, "error": traceback.format_exc(limit=8)}
    tmp = out + ".part"
    try:
        import torch

        torch.save(result, tmp)
    except Exception:  # noqa: BLE001 - a result that cannot be saved is an error of its own
        torch.save({"ok": False, "error": f"rank {rank}'s result could not be sent back:\n"
                                          + traceback.format_exc(limit=3)}, tmp)
    os.replace(tmp, out)


def launch(function: Callable | str, world_size: int = 2, *args: Any, backend: str = "gloo",
           rendezvous: str = "file", timeout_s: float = 60.0) -> list[Any]:
    """Run ``function(rank, world_size, *args)`` in ``world_size`` spawned processes joined in one
    process group, and return the results in rank order.

    ``function`` is ``"module:function"`` or a function importable by its module's name (never one
    defined in a notebook cell: see the module's docstring). ``rendezvous``: ``"file"`` (a file in a
    fresh folder: nothing listens on the network) or ``"tcp"`` (a free port on 127.0.0.1). The
    arguments and results cross processes by pickling; tensors are best returned on the CPU.
    ``timeout_s`` bounds the whole launch; a worker that raises, dies or hangs (a ``recv`` with no
    matching ``send`` waits forever) raises :class:`WorkersFailed` naming its rank, after every worker
    has been stopped."""
    import torch.multiprocessing as mp

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
    paths = [os.getcwd(), *[p for p in sys.path if p]]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, world_size, init, backend, module, name, args, outs[r], paths,
                                                timeout_s), daemon=True, name=f"course-worker-{r}")
             for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while not all(_settled(p, o) for p, o in zip(procs, outs)) and time.monotonic() < deadline:
            if any(_failed(p, o) for p, o in zip(procs, outs)):
                # one failure usually brings the others down (a peer's connection resets): let them settle
                settle = time.monotonic() + 1.0
                while time.monotonic() < settle and not all(_settled(p, o) for p, o in zip(procs, outs)):
                    time.sleep(0.02)
                break
            time.sleep(0.02)
        for p in procs:
            if _settled(p, "") and p.pid is not None:
                p.join(1.0)
        states = [_state(r, p, o) for r, (p, o) in enumerate(zip(procs, outs))]
        if all(s == "finished" for s, _ in states):
            return [_read(o)["value"] for o in outs]
        raise WorkersFailed(_report(name, world_size, states, timeout_s))
    finally:
        _stop(procs)
        shutil.rmtree(folder, ignore_errors=True)


def _settled(p, out: str) -> bool:
    return (bool(out) and os.path.exists(out)) or not p.is_alive()


def _failed(p, out: str) -> bool:
    if os.path.exists(out):
        return not _read(out)["ok"]
    return not p.is_alive() and p.exitcode is not None


def _state(rank: int, p, out: str) -> tuple[str, str]:
    """``(kind, detail)``: finished, raised (the traceback), died (the exit code) or running."""
    if os.path.exists(out):
        r = _read(out)
        return ("finished", "") if r["ok"] else ("raised", r["error"])
    if p.is_alive():
        return "running", ""
    return "died", f"exit code {p.exitcode}"


_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket closed")


def _report(name: str, world_size: int, states: list[tuple[str, str]], timeout_s: float) -> str:
    """Say first what most likely went wrong: a rank that died, then one that raised an error of its
    own (not a peer's connection going away), then one that hung; then every rank's state."""
    died = [r for r, (k, _) in enumerate(states) if k == "died"]
    raised = [r for r, (k, _) in enumerate(states) if k == "raised"]
    own = [r for r in raised if not any(m in states[r][1] for m in _PEER_GONE)]
    running = [r for r, (k, _) in enumerate(states) if k == "running"]
    if died:
        head = f"rank {died[0]} died ({states[died[0]][1]}) without a result"
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


def _read(path: str) -> dict:
    import torch

    return torch.load(path, weights_only=False)


def _stop(procs: list) -> None:
    """Terminate every worker still running, then kill what is left, and reap them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + 3.0
    for p in procs:
        if p.pid is not None:
            p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
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
        for module in (dist, c10d):
            for name in _POINT_TO_POINT:
                if hasattr(c10d, name):
                    setattr(module, name, self._counted(name, getattr(c10d, name)))
            for name in _COLLECTIVES:
                if hasattr(c10d, name):
                    setattr(module, name, self._noted(name, getattr(c10d, name)))

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


def _mark(wrapper, fn):
    wrapper.__wrapped__ = fn
    wrapper.__name__ = getattr(fn, "__name__", "wrapper")
    return wrapper


def _target(target: str) -> Callable:
    mod, _, fn = target.partition(":")
    return getattr(importlib.import_module(mod), fn)


def rank_input(seed: int, rank: int, numel: int) -> "torch.Tensor":
    """The float64 tensor rank ``rank`` contributes in a check drawn from ``seed``."""
    import torch

    return torch.randn(numel, generator=torch.Generator().manual_seed(seed * 1009 + rank), dtype=torch.float64)


def all_reduce_case(rank: int, world_size: int, target: str, seed: int, numel: int) -> dict:
    """A worker for the ring all-reduce check: draws this rank's own input (:func:`rank_input`; no
    rank sees another's), calls ``target(tensor)`` with its traffic counted, and returns the tensor
    after the call (an all-reduce works in place, like ``dist.all_reduce``) or what it returned."""
    tensor = rank_input(seed, rank, numel)
    counting = _Counting()
    out = _target(target)(tensor)
    return {"value": tensor if out is None else out, **counting.traffic}

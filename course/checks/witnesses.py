"""Witnesses beside the course's watchers of *how* an answer computed its result.

The watchers (:class:`course.checks.common.TorchCalls`, lesson 7's call watcher) see the Python
the answer runs on the calling thread. Two routes around them need no C of the learner's own:

- **compiled code on the same thread.** A TorchScript function the notebook scripted earlier runs
  its ops in C++: no ``TorchFunctionMode`` and no profile function hears them, nor the work a
  ``torch.jit.fork`` hands torch's inter-op pool. :class:`DispatcherOps` reads them where every op
  passes, the dispatcher's record-function callbacks (the profiler's legacy, Kineto-free path:
  about 1 ms to start, the same API on torch 2.4 to 2.15), by ATen name (``aten::lstm_cell``).
- **another thread.** Modes and profile functions are each thread's own, so an answer that hands
  its work to a thread the notebook started *before* the call (a queue and a waiting thread, or a
  thread spinning on a flag) is unseen by both. :class:`OtherThreads` reads, from the kernel, the
  CPU time of every other thread of the process around the call: a thread that waits costs none,
  so any that worked while the answer ran is seen. :func:`alone` runs a watched call that way,
  again after a short wait where a thread worked (a rare wake-up of an honest one: a progress
  bar's monitor, Jupyter's heartbeat), and fails it when another thread worked every time.

Both are probes in the learner's process, as the watchers are: that process's word, raising the
cost of the Python routes; the values stay the judge's to check.
"""

from __future__ import annotations

from os import listdir as _listdir
from threading import enumerate as _python_threads, get_native_id as _native_id
from time import clock_gettime_ns as _clock_ns, monotonic as _monotonic, sleep as _sleep
from typing import Callable, TypeVar

import torch
from torch.autograd import _disable_profiler_legacy, _enable_profiler_legacy

# (the functions above are held here, in the module's own names: the grader's seal covers them, so a
# notebook that rebinds time.clock_gettime_ns or os.listdir leaves the witnesses' readings alone)

__all__ = ["DispatcherOps", "OtherThreads", "PRODUCTS", "alone"]

T = TypeVar("T")


# -- ops the dispatcher ran ----------------------------------------------------------------------

def _profiler_config(shapes: bool = False):
    from torch.autograd import ProfilerConfig, ProfilerState

    return ProfilerConfig(ProfilerState.CPU, shapes, False, False, False, False,
                          torch._C._profiler._ExperimentalConfig())


#: ATen's matrix products (what ``@``, ``matmul``, ``linear``, ``einsum`` and the rest come down to),
#: each with the index of the operand whose leading dimensions are the product's rows.
PRODUCTS = {"aten::mm": 0, "aten::addmm": 1, "aten::_addmm_activation": 1, "aten::bmm": 0, "aten::baddbmm": 1,
            "aten::addbmm": 1, "aten::mv": 0, "aten::addmv": 1, "aten::dot": 0, "aten::vdot": 0}


class DispatcherOps:
    """The ATen ops (``aten::mm``, ``aten::lstm_cell``) the dispatcher ran on this thread while
    active, TorchScript's and ``torch.jit.fork``'s included: ``names``, in the order first run
    (ops only: the scopes a TorchScript function or ``record_function`` opens carry names code chose),
    and ``counts``, how often each ran, an op's calls of itself inside it not counted (``vmap``'s
    batching rules call the op again): a program's code that runs inside a torch function, where a
    ``TorchFunctionMode`` is off the stack, still calls ops the dispatcher records.
    ``blocked`` says why it could not watch (a profiler of the notebook's already running on this
    thread) or was stopped while it watched; the caller fails the answer for either.

    ``shapes``: the inputs' shapes are recorded too, and ``products`` holds one ``[rows, inner]`` per
    matrix product (:data:`PRODUCTS`; a product run inside another not counted again): ``rows`` the
    product of the row operand's leading dimensions, ``inner`` its last (the contraction); both -1
    where the dispatcher gave no shapes (TorchScript's ops)."""

    def __init__(self, shapes: bool = False):
        self.names: list[str] = []
        self.counts: dict[str, int] = {}
        self.products: list[list[int]] = []
        self.blocked = ""
        self._shapes = shapes
        self._on = False

    def __enter__(self) -> "DispatcherOps":
        try:
            _enable_profiler_legacy(_profiler_config(self._shapes))
            self._on = True
        except RuntimeError as exc:  # "profiler is already enabled on this thread"
            self.blocked = f"a profiler of the notebook's was running ({str(exc).strip()[:120]})"
        return self

    def __exit__(self, *exc) -> bool:
        if not self._on:
            return False
        self._on = False
        try:
            records = _disable_profiler_legacy()
        except RuntimeError:
            self.blocked = "the course's profiler was stopped while the answer ran"
            return False
        counts: dict[str, int] = {}
        for thread in records:
            open_: list[str] = []  # the names pushed and not yet popped
            for event in thread:
                name, kind = str(event.name()), event.kind()
                if kind == "push":
                    if "::" in name and name not in open_:  # ops (namespace::op), not the scopes code names
                        counts[name] = counts.get(name, 0) + 1
                        if self._shapes and name in PRODUCTS and not any(o in PRODUCTS for o in open_):
                            self.products.append(_product(event.shapes(), PRODUCTS[name]))
                    open_.append(name)
                elif kind == "pop" and open_:
                    open_.pop()
        self.names, self.counts = list(counts), counts
        return False


def _product(shapes: list, at: int) -> list[int]:
    """``[rows, inner]`` of a matrix product whose row operand is ``shapes[at]``; -1s if not given."""
    shape = [int(d) for d in shapes[at]] if len(shapes) > at else []
    if not shape:
        return [-1, -1]
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return [rows, shape[-1]]


# -- other threads -------------------------------------------------------------------------------

def _cpu_ns(tid: int) -> int | None:
    """CPU time (ns) of thread ``tid`` of this process, from the kernel's per-thread clock
    (``MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)``); None once the thread is gone."""
    try:
        return _clock_ns((~tid << 3) | 6)
    except (OSError, OverflowError, ValueError):
        return None


def _comm(tid: int) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()[:40]
    except OSError:
        return "?"


def _task_ids() -> list[int]:
    try:
        return [int(t) for t in _listdir("/proc/self/task") if t.isdigit()]
    except OSError:  # no /proc
        return []


#: The threads this process had when the course's checks were imported: the environment's own, not
#: an answer's (Jupyter's kernel: its heartbeat, its output thread, which a print in an answer wakes).
#: Under the grader these modules are imported before any learner code, so the notebook's threads
#: are never among them. Held as a frozenset's own method: rebinding it breaks the grader's seal.
_ambient = frozenset(_task_ids()).__contains__


class OtherThreads:
    """How much CPU every other thread of this process used while active: ``worked`` describes
    each that used any. The kernel's count of a thread that waits (on a lock, a queue, a pipe)
    does not move, so an idle thread is never seen, and a thread that did work for the answer
    always is. The threads the process had when this module was imported are left out
    (:data:`_ambient`).

    ``every=False`` counts only threads Python's ``threading`` knows: on a CUDA runner (CUDA
    initialised), whose driver keeps threads of its own (:func:`alone` decides)."""

    def __init__(self, every: bool = True):
        self.every = every
        self.worked: list[str] = []
        self._before: dict[int, int] = {}

    def _threads(self) -> list[int]:
        me = _native_id()
        if self.every:
            tids = _task_ids()  # (no /proc: nothing to read, and nothing claimed)
        else:
            tids = [t.native_id for t in _python_threads() if t.native_id is not None]
        return [t for t in tids if t != me and not _ambient(t)]

    def sample(self) -> dict[int, int]:
        out = {}
        for tid in self._threads():
            ns = _cpu_ns(tid)
            if ns is not None:
                out[tid] = ns
        return out

    def settle(self, bound_s: float = 0.1, window_s: float = 0.002) -> bool:
        """Wait (at most ``bound_s``) until no other thread used CPU over a ``window_s``: torch's
        own workers spin for a few milliseconds after their last parallel work, then sleep."""
        end = _monotonic() + bound_s
        before = self.sample()
        while True:
            _sleep(window_s)
            now = self.sample()
            if all(now[t] == before.get(t, now[t]) for t in now):
                return True
            if _monotonic() > end:
                return False
            before = now

    def __enter__(self) -> "OtherThreads":
        self.worked = []
        self._before = self.sample()
        return self

    def __exit__(self, *exc) -> bool:
        after = self.sample()
        for tid, ns in after.items():
            used = ns - self._before.get(tid, 0)  # a thread started meanwhile: all of its time
            if used > 0:
                self.worked.append(f"thread {tid} ({_comm(tid)}) used {used / 1e6:.2f} ms of CPU")
        return False


def alone(run: Callable[[], T], *, label: str, attempts: int = 3) -> T:
    """``run()`` (a watched call of an answer) while no other thread of this process works:
    torch's own pool held to one thread meanwhile (so its workers sleep), every other thread's
    CPU time read around the call. Where another thread worked, the call is made again after the
    threads settle; when one worked on every attempt, the answer fails with ``label``. On a CUDA
    runner only Python's threads are counted (the CUDA driver's own are not the learner's)."""
    every = not (torch.cuda.is_available() and torch.cuda.is_initialized())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        others = OtherThreads(every=every)
        for _ in range(attempts):
            others.settle()
            with others:
                out = run()
            if not others.worked:
                return out
    finally:
        torch.set_num_threads(threads)
    raise AssertionError(
        f"{label}: while the answer ran, another thread of your notebook's process worked ({others.worked[0]}), "
        f"on {attempts} tries. The course checks how an answer computes its result, and it cannot watch work "
        "handed to another thread. Compute the answer in the call itself (no threads, queues or "
        "torch.jit.fork), restart the kernel to stop threads started earlier, and run the cells again.")

"""The C allocator held steady while the course times code.

Every CPU tensor's memory comes from the C library's ``malloc``. With glibc's defaults, a block of
more than 128 KiB is a fresh ``mmap`` from the kernel, returned on ``free``, and every page of it
faults in again on first touch; but each such block freed raises that threshold (up to 32 MiB)
for the rest of the process, and with it the amount of free memory kept at the top of the heap.
So the same code runs at speeds that depend on what its process did before: naive attention over
2 x 4 heads x 512 tokens ran 1.6x to 2.4x slower in a fresh process than in one that had freed a
30 MiB block, on this course's 2-core machine. A timing that compares two processes (the
grader's judge and the learner's) would compare their histories.

While :func:`steady` is held, and for the whole life of a process the grader starts with
:data:`TUNABLES` in its environment, the threshold is glibc's largest (32 MiB) from the start and up
to 256 MiB of free memory is kept at the top of the heap; and each hold starts by handing back the
free memory the heap kept, so what the calls inside it get depends on those calls alone, in every
process alike, whatever came before. A block under 32 MiB is recycled after the first call; a larger
one is mapped afresh on every call (unless the call itself freed enough at the top of the heap just
before: then it is recycled too). What the hand-back cannot undo: a free stretch inside the heap,
held in place by a live block above it, keeps its addresses and can still take a block over 32 MiB,
which is why :func:`course.timing.compare_served` refuses to time the course's side of a comparison
at sizes where it makes a tensor that large. Keeping every block on the heap, large ones too, would
be faster still for some code, but a heap that never maps cannot hand back what fragments it: a
lesson's served run grew from 0.6 to 2.3 GB that way.

Outside glibc (macOS, musl) there is nothing to set and :func:`steady` does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from typing import Any, Callable, Iterator

__all__ = ["MAP_FROM", "TUNABLES", "available", "counts_faults", "faults_per_call", "hold_process", "largest_block",
           "mapped_blocks", "pinned", "steady", "steady_now"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
_MAP_FROM = 32 << 20  # blocks from 32 MiB up are mapped: glibc's largest threshold (HEAP_MAX_SIZE / 2)
_KEEP = 256 << 20  # free memory kept at the top of the heap while steady: 8 blocks of the largest kept size
MAP_FROM = _MAP_FROM  #: the size from which a block is mapped afresh on every call, while steady
_AFTER = 2 * _MAP_FROM  # and afterwards: what glibc's own adjustment sets beside a 32 MiB threshold

#: glibc's tunables for a process steady from its first allocation (``GLIBC_TUNABLES``).
TUNABLES = f"glibc.malloc.mmap_threshold={_MAP_FROM}:glibc.malloc.trim_threshold={_KEEP}"


def _libc():
    """glibc's functions, looked up once at import (before any learner code runs), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc, not musl: musl's mallopt does nothing
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc


_LIBC = _libc()
_LOCK = threading.Lock()
_HELD = 0
_PROCESS = False


def available() -> bool:
    """Whether this process's allocator can be held steady (Linux with glibc)."""
    return _LIBC is not None


def pinned() -> bool:
    """Whether this process is steady for good: started with :data:`TUNABLES` in its environment,
    or held by :func:`hold_process`."""
    return available() and (_PROCESS or TUNABLES in os.environ.get("GLIBC_TUNABLES", ""))


def _hold() -> None:
    _LIBC.mallopt(_M_MMAP_THRESHOLD, _MAP_FROM)
    _LIBC.mallopt(_M_TRIM_THRESHOLD, _KEEP)


def hold_process() -> bool:
    """Hold ``malloc`` steady for the rest of this process (the grader's processes call it at
    start-up, before any learner code: the environment variable alone does not reach a process
    that a set-user-ID sandbox starts). Returns whether it could."""
    global _PROCESS
    if not available():
        return False
    _hold()
    _PROCESS = True
    return True


@contextlib.contextmanager
def steady() -> Iterator[None]:
    """Hold ``malloc`` steady for the block (re-entrant, process-wide). On entry the free memory the
    heap keeps is handed back (``malloc_trim``), so that what the block's calls get from the
    allocator depends on them alone: with free memory left at the top of the heap by earlier work,
    a block over 32 MiB would come from there instead of being mapped. Afterwards the threshold
    stays at 32 MiB (where glibc's own adjustment would take it, now without the history) and
    the free memory kept meanwhile is handed back to the system."""
    global _HELD
    if not available():
        yield
        return
    with _LOCK:
        _HELD += 1
        if _HELD == 1:
            if not pinned():
                _hold()
            _LIBC.malloc_trim(0)
    try:
        yield
    finally:
        with _LOCK:
            _HELD -= 1
            if _HELD == 0 and not pinned():
                _LIBC.mallopt(_M_TRIM_THRESHOLD, _AFTER)
                _LIBC.malloc_trim(_AFTER)


class _Info(ctypes.Structure):  # struct mallinfo2 (glibc 2.33+)
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo() -> Callable[[], _Info] | None:
    """glibc's own account of its memory (``mallinfo2``), or None before glibc 2.33 or outside glibc."""
    if not available():
        return None
    try:
        mallinfo2 = _LIBC.mallinfo2
    except AttributeError:
        return None
    mallinfo2.restype, mallinfo2.argtypes = _Info, []
    return mallinfo2


def mapped_blocks() -> int | None:
    """How many blocks ``malloc`` holds mapped from the kernel right now, by its own account (each is
    handed back on ``free``); None where glibc cannot say. Unlike page faults, which some kernels do
    not count, this is the allocator's own count."""
    info = _mallinfo()
    return None if info is None else int(info().hblks)


def steady_now() -> bool | None:
    """Whether ``malloc`` keeps blocks under 32 MiB for reuse right now in this process, by
    experiment: a 24 MiB block, allocated and freed twice, comes from the heap both times rather
    than being mapped (None where glibc is not the allocator). A process whose history raised
    glibc's threshold that far passes too: for blocks of that size it behaves the same."""
    info = _mallinfo()
    if info is None:
        return None
    _LIBC.malloc.restype, _LIBC.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    _LIBC.free.argtypes = [ctypes.c_void_p]
    mapped = []
    for _ in range(2):
        before = info().hblks
        p = _LIBC.malloc(24 << 20)
        mapped.append(info().hblks > before)
        _LIBC.free(p)
    return not any(mapped)


_COUNTS: list[bool] = []


def counts_faults() -> bool:
    """Whether this kernel counts this process's page faults, by experiment: 64 fresh pages mapped and
    touched must add to ``ru_minflt`` (some sandboxed kernels report none, ever)."""
    if not _COUNTS:
        try:
            import mmap
            import resource
        except ImportError:  # Windows
            _COUNTS.append(False)
            return False
        pages = 64
        region = mmap.mmap(-1, pages * mmap.PAGESIZE)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for i in range(pages):
            region[i * mmap.PAGESIZE] = 1
        _COUNTS.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt > before)
        region.close()
    return _COUNTS[0]


def faults_per_call(fn: Callable[[], Any], calls: int = 5, warmup: int = 10) -> float | None:
    """Page faults per call of ``fn()`` after ``warmup`` calls: pages of fresh memory the kernel
    handed this process (minor faults; None where the platform does not count them)."""
    if not counts_faults():
        return None
    import resource

    for _ in range(warmup):
        fn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def largest_block(fn: Callable[..., Any], *args: Any) -> int:
    """Bytes of the largest CPU tensor any PyTorch operation makes in one call ``fn(*args)``: the
    largest block the call asks ``malloc`` for (scratch memory inside a single kernel aside). Seen
    through a dispatch mode, so it counts inside ``torch.func`` transforms too; the call runs once."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class _Largest(TorchDispatchMode):
        seen = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    self.seen = max(self.seen, t.untyped_storage().nbytes())
            return out

    with _Largest() as mode:
        fn(*args)
    return mode.seen

"""Lesson 8's happens-before checker with vector clocks, and the replay of a program through
PyTorch's CUDA Stream Sanitizer: each answers its exercise (the replay with the sanitizer's source
inlined beside it did, copied from ``course.streams`` into a notebook), so they are the grader's
alone (see :mod:`course.references`). The checks grade against the sanitizer itself
(:func:`sanitizer_races_many`); :func:`find_races` proves, in the tests, that the rule the lesson
teaches is the sanitizer's, and it runs without importing the sanitizer. In a learner's copy,
``course.streams.sanitizer_races`` gives the reports stored for the lesson's own programs."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from course.guard import reference
from course.streams import RAW, WAR, WAW, Race, _checked

__all__ = ["find_races", "sanitizer_races_many"]


@reference(in_cells=False)
def find_races(events: Sequence[tuple]) -> list[Race]:
    """The course's happens-before checker, with vector clocks (pure Python).

    Every launch gets the next sequence number. Each stream keeps a clock: for every stream, the
    sequence number of the last launch there that its work is ordered after. An earlier access
    ``(seq, q)`` is ordered before the current launch on stream ``s`` when
    ``seq <= clock[s][q]``. A record copies the stream's clock into the event, a wait merges the
    event's copy into the stream's clock (element-wise max). The host keeps a clock too: a host
    wait merges what it waited for into the host's clock and into every stream's, since whatever
    is enqueued afterwards runs after it; a stream seen for the first time starts from the
    host's clock. Output: see the module docstring.
    """
    program = _checked(events, "find_races")
    seq = 0
    host: dict[int, int] = {}
    clocks: dict[int, dict[int, int]] = {0: {}}
    recorded: dict[Any, dict[int, int]] = {}
    last_write: dict[Any, tuple[int, int]] = {}       # tensor -> (seq, stream)
    reads_since: dict[Any, list[tuple[int, int]]] = {}  # tensor -> [(seq, stream), ...]
    races: list[Race] = []

    def clock(s: int) -> dict[int, int]:
        if s not in clocks:
            clocks[s] = dict(host)
        return clocks[s]

    def merge(into: dict[int, int], other: dict[int, int]) -> None:
        for q, n in other.items():
            if n > into.get(q, 0):
                into[q] = n

    def host_waits_for(knowledge: dict[int, int]) -> None:
        knowledge = dict(knowledge)
        merge(host, knowledge)
        for c in clocks.values():
            merge(c, knowledge)

    for i, ev in enumerate(program):
        kind = ev[0]
        if kind == "launch":
            _, s, reads, writes = ev
            seq += 1
            now = clock(s)
            now[s] = seq

            def unordered(prev: tuple[int, int]) -> bool:
                return prev[0] > now.get(prev[1], 0)

            for t in reads:
                if t in writes:
                    continue
                w = last_write.get(t)
                if w is not None and unordered(w):
                    races.append((i, RAW, t, w[1]))
                reads_since.setdefault(t, []).append((seq, s))
            for t in writes:
                earlier = reads_since.get(t)
                if earlier:
                    races.extend((i, WAR, t, r[1]) for r in earlier if unordered(r))
                elif t in last_write and unordered(last_write[t]):
                    races.append((i, WAW, t, last_write[t][1]))
                last_write[t] = (seq, s)
                reads_since[t] = []
        elif kind == "record":
            recorded[ev[1]] = dict(clock(ev[2]))
        elif kind == "wait":
            merge(clock(ev[1]), recorded.get(ev[2], {}))
        elif kind == "sync_stream":
            host_waits_for(clock(ev[1]))
        elif kind == "sync_event":
            host_waits_for(recorded.get(ev[1], {}))
        elif kind == "sync_device":
            everything: dict[int, int] = {}
            for c in clocks.values():
                merge(everything, c)
            host_waits_for(everything)
        elif kind == "free":
            last_write.pop(ev[1], None)
            reads_since.pop(ev[1], None)
    return races


# -- the same program through PyTorch's sanitizer ----------------------------------------------

@reference(in_cells=False)
def sanitizer_races_many(programs: Sequence[Sequence[tuple]]) -> list[list[Race]]:
    """The program replayed through ``torch.cuda._sanitizer.EventHandler``, the pure-Python core
    of PyTorch's CUDA Stream Sanitizer, and its ``UnsynchronizedAccessError`` s converted to
    :func:`find_races`'s report (same order), for every program. Tensors become fake data
    pointers, events ints. Moved here from ``course.streams``: the conversion answers the exercise.

    Only a private handler is driven: the sanitizer is never *enabled* (that would put every
    later tensor operation of the process under its CUDA dispatch mode, which breaks them all
    on a machine without CUDA). Importing the module, done here on first call (never by
    :func:`find_races`), does one thing process-wide: it switches PyTorch's GPU trace on and
    registers an idle handler with it. On a CPU nothing calls the trace; on a CUDA machine every
    later allocation, event and synchronisation calls that handler in Python, so results stay
    right but time a little more: keep speed measurements out of that process. So on a CUDA machine,
    unless the module is already imported here, the replay runs in a fresh Python process."""
    checked = [_checked(events, "sanitizer_races") for events in programs]
    if "torch.cuda._sanitizer" in sys.modules or os.environ.get(_IN_PROCESS) or not _cuda():
        return [_replay(program) for program in checked]
    import json
    import subprocess

    script = ("import json, sys\nfrom course.references.streams import sanitizer_races_many\n"
              "programs = json.load(sys.stdin)\n"
              "programs = [[tuple(tuple(x) if isinstance(x, list) else x for x in ev) for ev in p] for p in programs]\n"
              "json.dump(sanitizer_races_many(programs), sys.stdout)\n")
    done = subprocess.run([sys.executable, "-c", script], input=json.dumps(checked), capture_output=True, text=True,
                          env=dict(os.environ, **{_IN_PROCESS: "1"}), timeout=600)
    if done.returncode:
        raise RuntimeError(f"replaying the programs through the sanitizer in a fresh process failed: "
                           f"{done.stderr.strip()[-500:]}")
    return [[tuple(r) for r in races] for races in json.loads(done.stdout)]


_IN_PROCESS = "COURSE_SANITIZER_IN_PROCESS"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@reference(in_cells=False)
def _replay(program: list[tuple]) -> list[Race]:
    from torch.cuda import _sanitizer as csan

    handler = csan.EventHandler()
    pointers: dict[Any, int] = {}
    tensors: dict[int, Any] = {}
    event_ids: dict[Any, int] = {}

    def pointer(t: Any) -> int:
        if t not in pointers:
            pointers[t] = 0x1000 + len(pointers)  # small ints: a set of them iterates by value
            tensors[pointers[t]] = t
        return pointers[t]

    def event_id(e: Any) -> int:
        return event_ids.setdefault(e, len(event_ids) + 1)

    races: list[Race] = []
    for i, ev in enumerate(program):
        kind = ev[0]
        if kind == "launch":
            _, s, reads, writes = ev
            written = {pointer(t) for t in writes}
            read_only = {pointer(t) for t in reads} - written
            aliases = {pointer(t): [repr(t)] for t in (*reads, *writes)}
            errors = handler._handle_kernel_launch(s, read_only, written, set(), f"launch {i}", aliases)
            found = []
            for err in errors:
                if not isinstance(err, csan.UnsynchronizedAccessError):
                    raise TypeError(f"the sanitizer reported {type(err).__name__}, which this module "
                                    f"does not know how to convert: {err}")
                t = tensors[err.data_ptr]
                now, prev = err.current_access, err.previous_access
                if now.type is csan.AccessType.READ:
                    race, key = (i, RAW, t, prev.stream), (0, reads.index(t), prev.seq_num)
                else:
                    race_kind = WAR if prev.type is csan.AccessType.READ else WAW
                    race, key = (i, race_kind, t, prev.stream), (1, writes.index(t), prev.seq_num)
                found.append((key, race))
            races.extend(race for _, race in sorted(found, key=lambda kr: kr[0]))
        elif kind == "record":
            handler._handle_event_record(event_id(ev[1]), ev[2])
        elif kind == "wait":
            handler._handle_event_wait(event_id(ev[2]), ev[1])
        elif kind == "sync_stream":
            handler._handle_stream_synchronization(ev[1])
        elif kind == "sync_event":
            handler._handle_event_synchronization(event_id(ev[1]))
        elif kind == "sync_device":
            handler._handle_device_synchronization()
        elif kind == "free":
            handler._handle_memory_deallocation(pointer(ev[1]))
    return races

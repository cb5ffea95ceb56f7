"""Lesson 8's happens-before checker with vector clocks: the answer to its exercise, so the
grader's alone (see :mod:`course.references`). The checks grade against PyTorch's CUDA Stream
Sanitizer itself (:func:`course.streams.sanitizer_races`); this one proves, in the tests, that the
rule the lesson teaches is the sanitizer's, and it runs without importing the sanitizer."""

from __future__ import annotations

from collections.abc import Sequence

from course.guard import reference
from course.streams import RAW, WAR, WAW, Race, _checked

__all__ = ["find_races"]


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



"""Lesson 8's pieces (CUDA stream races): a small vocabulary of synthetic CUDA events, programs
written in it, and their reports from PyTorch's CUDA Stream Sanitizer, which the learner's checker
is graded against. No GPU needed. The replay through the sanitizer and the course's own checker
both answer the lesson's exercise, so they live in ``course.references.streams``, the grader's.

A *program* is a list of events, plain tuples a learner can write by hand (stream 0 is the
default stream; streams are ints >= 0; tensors and events are named by a str or an int):

- ``("launch", stream, reads, writes)``: a kernel on ``stream`` reading the tensors of the tuple
  ``reads`` and writing those of ``writes``. A tensor in both is updated in place and counts as
  written only (the sanitizer's own dispatcher does the same: reads minus writes are "read
  only").
- ``("record", event, stream)``: ``event.record(stream)``: the event captures what ``stream``
  has been ordered after so far. Recording again replaces the capture: the later record counts.
- ``("wait", stream, event)``: ``stream.wait_event(event)``: later work on ``stream`` is
  ordered after what ``event`` captured *when the wait was issued*. A never-recorded event
  captured nothing, so waiting on it orders nothing (as in CUDA, where the wait returns at once).
- ``("sync_stream", stream)``, ``("sync_event", event)``, ``("sync_device",)``: the host waits
  (``stream.synchronize()``, ``event.synchronize()``, ``torch.cuda.synchronize()``). Everything
  enqueued afterwards, on any stream, is ordered after what the host waited for.
- ``("free", tensor)``: the tensor's memory is released, and its access history with it: a later
  use of the name is a fresh tensor. The sanitizer checks nothing at a free (its deallocation
  hook has no stream), and its allocation hook has the same effect, so there is no ``"alloc"``.

:func:`sanitizer_races` and the course's own checker (``course.references.streams.find_races``,
the grader's alone: it answers lesson 8's exercise) return the same report: a list of
``(launch index, kind, tensor, stream of the earlier access)``, where ``launch index`` is the
position of the racing launch in the program and ``kind`` is ``"read-after-write"``,
``"write-after-read"`` or ``"write-after-write"``. Which earlier accesses are checked is the
sanitizer's rule: a read against the tensor's last write; a write against the reads since its
last write, or, when there were none, against the last write. In a race-free program this is the
same as checking every earlier access (ordering is transitive); in a racy one, it reports the
races at the frontier and not the ones behind them. One report per unordered earlier access, in
this order: by launch index; within a launch, the read-only tensors in the order of ``reads``,
then the written ones in the order of ``writes``; for one written tensor, the earlier reads in
program order. (The sanitizer iterates over sets of data pointers, so its own order within a
launch is an accident of hashing; :func:`sanitizer_races` sorts its reports into this order.)

- :func:`random_events`: seeded random programs, some race-free, some not;
- :func:`planted_race` / :func:`planted_race_fixed`: the lesson's example, and its record/wait fix.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from course.guard import reference


__all__ = ["KINDS", "planted_race", "planted_race_fixed", "random_events", "sanitizer_races", "stored_races"]

RAW, WAR, WAW = "read-after-write", "write-after-read", "write-after-write"

#: each event's kind and its fields after the kind, as the error messages show them
KINDS = {
    "launch": ("stream", "reads", "writes"),
    "record": ("event", "stream"),
    "wait": ("stream", "event"),
    "sync_stream": ("stream",),
    "sync_event": ("event",),
    "sync_device": (),
    "free": ("tensor",),
}
_EXAMPLES = {
    "launch": '("launch", 1, ("x",), ("y",))',
    "record": '("record", "e", 1)',
    "wait": '("wait", 0, "e")',
    "sync_stream": '("sync_stream", 1)',
    "sync_event": '("sync_event", "e")',
    "sync_device": '("sync_device",)',
    "free": '("free", "x")',
}

Race = tuple  # (int, str, object, int)


# -- input checks ------------------------------------------------------------------------------

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _show(v: Any) -> str:
    return f"{v!r} ({type(v).__name__})"


def _checked(events: Any, who: str) -> list[tuple]:
    """The program as a list of tuples, or a ValueError/TypeError that says what was expected,
    what came, and what to try: a learner's hand-written events are the usual input."""
    if isinstance(events, (str, bytes)) or not isinstance(events, Sequence):
        raise TypeError(f"{who} expects a list of event tuples, got {_show(events)}. "
                        f"Try: [{_EXAMPLES['launch']}, {_EXAMPLES['record']}]")
    if events and isinstance(events[0], str) and events[0] in KINDS:
        raise TypeError(f"{who} expects a list of events, and this looks like one event: {tuple(events)!r}. "
                        f"Wrap it in a list: [{tuple(events)!r}]")
    return [_checked_event(i, ev) for i, ev in enumerate(events)]


def _checked_event(i: int, ev: Any) -> tuple:
    where = f"event {i}"
    if not isinstance(ev, (tuple, list)) or not ev:
        hint = _EXAMPLES.get(ev, _EXAMPLES["launch"]) if isinstance(ev, str) else _EXAMPLES["launch"]
        if isinstance(ev, str) and ev in KINDS and not KINDS[ev]:
            hint = f"({ev!r},)"
        raise TypeError(f"{where}: expected an event tuple, got {_show(ev)}. Try {hint}")
    kind = ev[0]
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"{where}: unknown kind {kind!r}; expected one of {', '.join(map(repr, KINDS))}. "
                         f"Try {_EXAMPLES['launch']}")
    fields = KINDS[kind]
    if len(ev) != 1 + len(fields):
        form = "(" + ", ".join([repr(kind), *fields]) + ("," if not fields else "") + ")"
        raise ValueError(f"{where}: {tuple(ev)!r} has {len(ev)} item(s); a {kind!r} event is {form}, "
                         f"{1 + len(fields)} item(s). Try {_EXAMPLES[kind]}")
    out: list[Any] = [kind]
    for name, value in zip(fields, ev[1:]):
        if name == "stream":
            if not _is_int(value) or value < 0:
                raise ValueError(f"{where}: the stream must be an int >= 0 (0 is the default stream), "
                                 f"got {_show(value)}. Try {_EXAMPLES[kind]}")
        elif name in ("event", "tensor"):
            if not (_is_int(value) or isinstance(value, str)):
                raise ValueError(f"{where}: the {name} must be named by a str or an int, got {_show(value)}. "
                                 f"Try {_EXAMPLES[kind]}")
        else:  # reads / writes
            value = _checked_tensors(where, name, value)
        out.append(value)
    return tuple(out)


def _checked_tensors(where: str, name: str, value: Any) -> tuple:
    if isinstance(value, (str, bytes)) or _is_int(value):
        raise TypeError(f"{where}: {name} must be a tuple of tensor names, got {_show(value)}. "
                        f"Did you mean ({value!r},)? (A one-item tuple needs its comma.)")
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"{where}: {name} must be a tuple of tensor names, got {_show(value)}. "
                        f"Try () for none, or ('x', 'y')")
    for t in value:
        if not (_is_int(t) or isinstance(t, str)):
            raise ValueError(f"{where}: {name} holds {_show(t)}; a tensor is named by a str or an int. "
                             f"Try ('x', 'y')")
    if len(set(value)) != len(value):
        twice = next(t for t in value if list(value).count(t) > 1)
        raise ValueError(f"{where}: {name} lists tensor {twice!r} more than once; list each tensor once "
                         f"(a tensor both read and written goes in both reads and writes)")
    return tuple(value)


# -- the same program through PyTorch's sanitizer ----------------------------------------------

def sanitizer_races(events: Sequence[tuple]) -> list[Race]:
    """The program replayed through ``torch.cuda._sanitizer.EventHandler``, the pure-Python core
    of PyTorch's CUDA Stream Sanitizer, and its ``UnsynchronizedAccessError`` s converted to
    ``find_races``'s report (same order): ``course.references.streams.sanitizer_races_many``.

    That conversion, with the sanitizer's source beside it, answers the lesson's Exercise 5, so it
    is the grader's alone (a function here can be read as text and run as an answer, whatever
    guards it). In a learner's copy of the course, which has no ``course.references``, this gives
    the reports stored for the lesson's own programs (:func:`planted_race`,
    :func:`planted_race_fixed` and the visible check's, ``course/reference_data/08_profiling.pt``)
    and refuses others; on a GPU, ``course.profiling.run_sanitized_race`` runs the real sanitizer."""
    program = _checked(events, "sanitizer_races")
    try:
        from course.references.streams import sanitizer_races_many
    except ImportError:
        return stored_races(program)
    return sanitizer_races_many([program])[0]


@reference(in_cells=False)
def stored_races(program: Sequence[tuple]) -> list[Race]:
    """The sanitizer's reports stored for ``program`` (``python -m course.references`` writes them for
    the lesson's own programs), or a ``LookupError`` saying why there are none. Guarded: a lookup
    is no answer to the exercise (and the bare host, which has no course, shows it is none)."""
    from course.checks.common import stored_answers

    key = repr(_checked(program, "sanitizer_races"))
    races = stored_answers(DATA_FILE)["races"].get(key)
    if races is None:
        raise LookupError("Your copy of the course has the CUDA Stream Sanitizer's reports for the lesson's own "
                          "programs only (planted_race(), planted_race_fixed() and the visible check's): the "
                          "replay that computes them answers Exercise 5, so it is the grader's. On a GPU, "
                          "course.profiling.run_sanitized_race runs the real sanitizer.")
    return [tuple(r) for r in races]


#: Where a learner's copy finds the sanitizer's reports (and lesson 8's other visible answers).
DATA_FILE = "08_profiling.pt"


# -- programs ----------------------------------------------------------------------------------

def random_events(seed: Any, n: int = 30, streams: int = 3, tensors: int = 4, events: int = 3) -> list[tuple]:
    """A reproducible random program of ``n`` events: launches (reading and writing 1-3 of
    ``tensors`` tensors ``"t0"``...) on ``streams`` streams, mixed with records and waits on
    ``events`` events ``"e0"``..., host syncs and frees. Each program draws its own carefulness
    (how often a launch is preceded by a wait, followed by a record), so that some programs are
    race-free and others are not; waits on never-recorded events and events recorded twice come
    up too."""
    for name, value, least in (("n", n, 0), ("streams", streams, 1), ("tensors", tensors, 1), ("events", events, 1)):
        if not _is_int(value) or value < least:
            raise ValueError(f"random_events: {name} must be an int >= {least}, got {_show(value)}")
    rng = random.Random(seed)
    care = rng.random() ** 0.5
    names = [f"t{k}" for k in range(tensors)]
    evs = [f"e{k}" for k in range(events)]
    out: list[tuple] = []
    while len(out) < n:
        s = rng.randrange(streams)
        r = rng.random()
        if r < 0.62:
            for e in evs:
                if rng.random() < care:
                    out.append(("wait", s, e))
            touched = rng.sample(names, rng.randint(1, min(3, tensors)))
            writes = tuple(t for t in touched if rng.random() < 0.4)
            reads = tuple(t for t in touched if t not in writes or rng.random() < 0.3)
            out.append(("launch", s, reads, writes))
            if rng.random() < care:
                out.append(("record", evs[s % events], s))
        elif r < 0.70:
            out.append(("record", rng.choice(evs), s))
        elif r < 0.78:
            out.append(("wait", s, rng.choice(evs)))
        elif r < 0.84:
            out.append(("sync_stream", s))
        elif r < 0.90:
            out.append(("sync_event", rng.choice(evs)))
        elif r < 0.95:
            out.append(("sync_device",))
        else:
            out.append(("free", rng.choice(names)))
    return out[:n]


def planted_race() -> list[tuple]:
    """The lesson's race: a producer on stream 1 writes ``x``; the consumer on the default stream
    reads it with nothing ordering the two, so it may read ``x`` before (or while) it is written.
    ``find_races`` reports ``[(1, "read-after-write", "x", 1)]``."""
    return [
        ("launch", 1, (), ("x",)),        # producer: x = ...         on stream 1
        ("launch", 0, ("x",), ("y",)),    # consumer: y = f(x)        on stream 0
    ]


def planted_race_fixed() -> list[tuple]:
    """:func:`planted_race` fixed the CUDA way, without blocking the host: stream 1 records an
    event after writing ``x`` and the default stream waits on it before reading. No race."""
    return [
        ("launch", 1, (), ("x",)),        # producer: x = ...         on stream 1
        ("record", "x_ready", 1),         # x_ready.record(stream 1)
        ("wait", 0, "x_ready"),           # stream 0 .wait_event(x_ready)
        ("launch", 0, ("x",), ("y",)),    # consumer: y = f(x)        on stream 0
    ]

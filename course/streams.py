"""Lesson 8's pieces (CUDA stream races): a small vocabulary of synthetic CUDA events, the
course's reference happens-before checker over it, and the same events replayed through
PyTorch's CUDA Stream Sanitizer, which the learner's checker is graded against. No GPU needed.

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

import os
import random
import sys
from collections.abc import Sequence
from typing import Any

from course.guard import reference

__all__ = ["KINDS", "planted_race", "planted_race_fixed", "random_events", "sanitizer_races",
           "sanitizer_races_many"]

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
    :func:`find_races`'s report (same order). Tensors become fake data pointers, events ints.

    Only a private handler is driven: the sanitizer is never *enabled* (that would put every
    later tensor operation of the process under its CUDA dispatch mode, which breaks them all
    on a machine without CUDA). Importing the module, done here on first call (never by
    :func:`find_races`), does one thing process-wide: it switches PyTorch's GPU trace on and
    registers an idle handler with it. On a CPU nothing calls the trace; on a CUDA machine every
    later allocation, event and synchronisation calls that handler in Python, so results stay
    right but time a little more: keep speed measurements out of that process. So on a CUDA machine,
    unless the module is already imported here, the replay runs in a fresh Python process."""
    return sanitizer_races_many([events])[0]


@reference(in_cells=False)
def sanitizer_races_many(programs: Sequence[Sequence[tuple]]) -> list[list[Race]]:
    """:func:`sanitizer_races` of every program, in one fresh process on a CUDA machine (see there)."""
    checked = [_checked(events, "sanitizer_races") for events in programs]
    if "torch.cuda._sanitizer" in sys.modules or os.environ.get(_IN_PROCESS) or not _cuda():
        return [_replay(program) for program in checked]
    import json
    import subprocess

    script = ("import json, sys\nfrom course.streams import sanitizer_races_many\n"
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

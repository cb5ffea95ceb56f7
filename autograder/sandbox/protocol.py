"""The one definition of what crosses the sandbox's boundary, used by both sides.

Parent to child (trusted to untrusted): framed pickles (the child may trust its parent): a
set-up message (token, cell limit, number of cells), then each cell only once the one before
it has ended (:func:`frame`), so no cell's source, hidden tests included, is in the child
before that cell runs; and answers during a cell: ``GO`` grants a timing turn or a hold, ``NO``
refuses one, numbers answer the judge's requests. The parent never waits for its writes to be read.

Child to parent (untrusted to trusted): frames of an 8-byte big-endian length and a payload
that :func:`decode` reads with ``torch.load(weights_only=True)``: tensors, numbers, strings
and containers only, no code. The parent refuses a frame longer than :data:`MAX_MESSAGE`, and
a run that sends more than :data:`MAX_TOTAL` in all, so a flooded pipe costs the grader a
bounded amount of memory. Message kinds are the constants below; anything else is a forgery.

This file is also loaded inside the sandbox by path (``/grading/protocol.py``), so it imports
nothing from the grader.
"""

from __future__ import annotations

import contextlib
import io
import os
import struct
import threading

#: Largest single message from the child (records carry tensors: a lesson's are at most a few MB).
MAX_MESSAGE = 64 * 2**20
#: Most bytes one run may send in all.
MAX_TOTAL = 512 * 2**20
#: Longest cell output and error text the parent keeps (the tail is kept).
MAX_OUTPUT_CHARS = 6000
MAX_ERROR_CHARS = 4000

HEADER = struct.Struct(">Q")
GO = b"g"
#: The parent's answer to a request it does not grant (a timing turn while one is held, a second
#: hold): every request for a turn or a hold is answered, at once where it is refused.
NO = b"n"

# Child -> parent message kinds.
READY, CELL_START, RECORD, CELL_END, FLAG, SPEED_BEGIN, SPEED_END, DONE = (
    "ready", "cell_start", "record", "cell_end", "flag", "speed_begin", "speed_end", "done")
# Judge -> parent only: stop the learner's process (answered by GO once it is stopped), resume it;
# the CPU seconds the learner's process tree has used (answered by NUMBER_ANSWER: 8 bytes, a double),
# or with ``main`` true those of the learner's interpreter's main thread alone (-1: not known), or
# with ``waited`` true the seconds its live threads waited, ready, for a CPU (with ``main`` too: that
# main thread's alone; -1: not known); with ``counts`` true every reading a timed call is bracketed
# with, in one round trip (COUNTS_ANSWER: the tree's CPU seconds, its live threads' waiting, its
# interpreter's main thread's waiting and its CPU seconds; -1 where not known);
# the peak resident bytes of the learner's processes: PEAK with ``reset`` true starts a window (the
# kernel's peak set back, the resident bytes sampled from then on), PEAK without it ends it; both are
# answered the same way (``parent.PeakWatch``).
HOLD, RELEASE, CPU, PEAK = "hold", "release", "cpu", "peak"
# Judge -> parent only: start a host, answered by NUMBER_ANSWER (1.0: started, 0.0: not); with
# ``stop`` true, stop it (a call the judge gave up on at a time limit). ``which``: the script host
# (``script_host.py``, the default: the learner's TorchScript), the bare host (``bare_host.py``) or the
# program host (``script_host.py`` again, a process of its own: the programs the judge read,
# ``course.hand``, never beside the learner's TorchScript), one of HOSTS.
HOST = "host"
HOSTS = ("script", "bare", "program")
#: What each host runs: its script, and what it runs for the learner, in words.
HOST_SCRIPTS = {"script": "script_host.py", "bare": "bare_host.py", "program": "script_host.py"}
HOST_RUNS = {"script": "TorchScript", "bare": "answer by hand", "program": "program, read by the grader"}
NUMBER_ANSWER = struct.Struct(">d")
COUNTS_ANSWER = struct.Struct(">dddd")
KINDS = {READY, CELL_START, RECORD, CELL_END, FLAG, SPEED_BEGIN, SPEED_END, DONE, HOLD, RELEASE, CPU, PEAK, HOST}

_INT, _TEXT, _BOOL = (int,), (str,), (bool,)
#: The fields the parent reads, by kind, and the exact types it reads them as: a message with one of
#: another type is a forgery (``bool(tensor)`` raised out of the parent's loop, ``str`` of a list that
#: holds itself twice at every depth never ended). Other fields are never read.
FIELDS = {
    CELL_START: {"cell": _INT},
    RECORD: {"cell": _INT, "n": _INT, "name": _TEXT},
    CELL_END: {"cell": _INT, "error": _TEXT, "output": _TEXT, "seconds": (int, float), "records": _INT,
               "tampered": _BOOL, "probed": _BOOL},
    FLAG: {"name": _TEXT, "detail": _TEXT, "cell": (int, type(None))},
    READY: {"seal_entries": _INT},
    SPEED_BEGIN: {"cell": (int, type(None))},
    CPU: {"main": _BOOL, "waited": _BOOL, "counts": _BOOL},
    PEAK: {"reset": _BOOL},
    HOST: {"which": _TEXT, "stop": _BOOL},
}
#: How many values a message may hold, read as a tree (a part reached twice counted twice), beyond one
#: per byte of its payload: what a message of this protocol never needs (each value costs a byte at
#: least, unless it is a part repeated), and what keeps every walk over it as short as its bytes.
SLACK_VALUES = 4096


#: The judge and the bare host (``bare_host.py``, a Python with its standard library alone) speak
#: JSON: plain values (None, booleans, numbers, strings, lists, dicts with string keys), framed
#: like every message here (HEADER, then the payload). Integers longer than this many digits are
#: refused, as are NaN and the infinities.
JSON_DIGITS = 24


def json_payload(value) -> bytes:
    """``value`` (plain values only) as one JSON payload."""
    import json

    return json.dumps(value, allow_nan=False, separators=(",", ":")).encode()


def json_value(payload: bytes):
    """The plain value in ``payload``, or :class:`ProtocolError`: never more than JSON can say."""
    import json

    def number(text: str):
        if len(text) > JSON_DIGITS:
            raise ValueError("an integer too long")
        return int(text)

    def refuse(name: str):
        raise ValueError(f"{name} is not a JSON number")

    try:
        return json.loads(bytes(payload).decode("utf-8"), parse_int=number, parse_constant=refuse)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"an unreadable JSON message ({type(exc).__name__})") from None


def frame(payload: bytes) -> bytes:
    """One framed payload: its length (:data:`HEADER`), then the payload."""
    return HEADER.pack(len(payload)) + payload


class ProtocolError(Exception):
    """The child sent something that is not a message of this protocol."""


def encode(message: dict) -> bytes:
    """One framed message (used by the child)."""
    import torch

    buf = io.BytesIO()
    torch.save(message, buf)
    return frame(buf.getvalue())


def decode(payload: bytes) -> dict:
    """The message in ``payload`` (used by the parent): data only, or :class:`ProtocolError`."""
    import torch

    try:
        message = torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - anything unreadable is a forgery
        raise ProtocolError(f"an unreadable message ({type(exc).__name__})") from None
    if type(message) is not dict or type(message.get("kind")) is not str or message["kind"] not in KINDS:
        raise ProtocolError("a message of no known kind")
    if type(message.get("token")) is not str:
        raise ProtocolError("a message without a token")
    for field, types in FIELDS.get(message["kind"], {}).items():
        if field in message and type(message[field]) not in types:
            raise ProtocolError(f"a {message['kind']} message whose {field} is a {type(message[field]).__name__}")
    if not within(message, len(payload) + SLACK_VALUES):
        raise ProtocolError(f"a message of {len(payload)} bytes that repeats its own parts past "
                            f"{len(payload) + SLACK_VALUES} values")
    return message


def within(value, most: int) -> bool:
    """Whether ``value``, read as a tree (a container reached twice counted twice, one that holds itself
    without end), has at most ``most`` values; the walk stops there."""
    stack, seen = [value], 0
    while stack:
        item = stack.pop()
        seen += 1
        if seen > most:
            return False
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
    return True


class Reader:
    """Cuts the child's byte stream into payloads, within the size limits."""

    def __init__(self):
        self.buf = bytearray()
        self.total = 0

    def feed(self, chunk: bytes) -> list[bytes]:
        self.total += len(chunk)
        if self.total > MAX_TOTAL:
            raise ProtocolError(f"more than {MAX_TOTAL // 2**20} MB sent in all")
        self.buf += chunk
        out = []
        while len(self.buf) >= HEADER.size:
            (size,) = HEADER.unpack(bytes(self.buf[:HEADER.size]))
            if size > MAX_MESSAGE:
                raise ProtocolError(f"a message of {size} bytes, over the {MAX_MESSAGE // 2**20} MB limit")
            if len(self.buf) < HEADER.size + size:
                break
            out.append(bytes(self.buf[HEADER.size:HEADER.size + size]))
            del self.buf[:HEADER.size + size]
        return out


# -- shared by the harnesses inside the sandbox (child.py, judge.py) --------------------------

class Channel:
    """Framed messages to the parent (``protocol.encode``), each stamped with the token, and the
    parent's answers to requests (read from ``in_fd``).

    ``alarm``: the process's :class:`Alarm`, held while a frame is written and while a request and
    its answer cross. Cut there, a frame would be left half written, or an answer unread and read
    later as the next message's first bytes: every later message would be read from the wrong
    place. The parent answers every request, at once or, for the timing turn, once the turn comes
    (while another submission holds it, this one is paused and its clocks stopped, so its alarms
    wait too): holding the alarm there never holds it long.
    """

    def __init__(self, fd: int, token: str, in_fd: int | None = None, alarm: "Alarm | None" = None):
        self._fd, self._token, self._lock, self._in_fd = fd, token, threading.Lock(), in_fd
        self._asking = threading.RLock()  # one request and its answer at a time, whichever thread asks
        self._held = alarm.uninterrupted if alarm is not None else contextlib.nullcontext
        self.owed: list[str] = []  # what to send to give back what the parent granted, last granted last

    def send(self, kind: str, **data) -> None:
        frame = encode({"token": self._token, "kind": kind, **data})
        with self._lock, self._held():
            write_all(self._fd, frame)

    def request(self, kind: str, size: int, **data) -> bytes:
        """Send a request and read the parent's answer, ``size`` bytes."""
        with self._asking, self._held():
            self.send(kind, **data)
            return read_exact(self._in_fd, size)

    def granted(self, begin: str, end: str, refusal: str, **data) -> "Granted":
        """Ask the parent for something (``begin``: the timing turn, a hold), wait for its answer,
        give it back (``end``) after: a context manager (:class:`Granted`)."""
        return Granted(self, begin, end, refusal, data)

    def give_back(self, upto: str | None = None) -> None:
        """Give back what the parent granted, the last granted first, down to ``upto`` (None: all).
        A harness calls it after each cell, its alarm disarmed: an alarm can land anywhere in a
        cell, ``Granted.__exit__`` not yet begun included, and a grant left held would keep the
        learner's process stopped, or every classmate paused for the turn."""
        with self._asking, self._held():
            if upto is not None and upto not in self.owed:
                return
            while self.owed:
                end = self.owed[-1]
                self.send(end)
                self.owed.pop()
                if end == upto:
                    return


class Granted:
    """What :meth:`Channel.granted` returns. A class, not a generator: a generator left suspended by
    an alarm would give its grant back whenever it was collected, in the middle of another frame."""

    def __init__(self, channel: Channel, begin: str, end: str, refusal: str, data: dict):
        self.channel, self.begin, self.end, self.refusal, self.data = channel, begin, end, refusal, data

    def __enter__(self) -> "Granted":
        channel = self.channel
        with channel._asking, channel._held():
            channel.send(self.begin, **self.data)
            answer = read_exact(channel._in_fd, 1)
            if answer == GO:
                channel.owed.append(self.end)
        if answer != GO:
            raise RuntimeError(f"grading: the parent refused {self.refusal}")
        return self

    def __exit__(self, *exc) -> bool:
        self.channel.give_back(self.end)
        return False


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def read_exact(fd: int, n: int) -> bytes:
    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            raise EOFError("the grading parent closed the pipe")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def end(code: int) -> None:
    """End this process at once with ``code``, its standard streams flushed. Its last message is
    sent: nothing it does from here is heard, and Python's own ending (torch's modules torn down,
    atexit handlers, a learner's too) cost over a second of every submission."""
    import sys

    for stream in (sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or replaced stream
            pass
    os._exit(code)


def set_limits(spec: str) -> None:
    """Lower this process's rlimits (soft and hard) to ``spec``: ``FSIZE=...,NPROC=...``."""
    import resource

    for item in filter(None, spec.split(",")):
        name, _, value = item.partition("=")
        which = getattr(resource, f"RLIMIT_{name}")
        resource.setrlimit(which, (int(value), int(value)))


def plain(value, depth: int = 0):
    """A copy of ``value`` made of tensors, numbers, strings and containers only: what the parent
    can load without running code. Anything else becomes a description (and fails comparison)."""
    import torch

    if depth > 20:
        return "<nested too deeply>"
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type != "meta":
            t = t.cpu()
        return t.clone().as_subclass(torch.Tensor) if type(t) is not torch.Tensor else t.clone()
    if value is None or type(value) in (bool, int, float, complex, str):
        return value
    if isinstance(value, (torch.dtype, torch.device, torch.Size, torch.memory_format)):
        return str(value) if not isinstance(value, torch.Size) else tuple(value)
    if type(value) in (tuple, list):
        return type(value)(plain(v, depth + 1) for v in value)
    if type(value) is dict:
        return {str(k): plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, tuple):  # named tuples and torch return types
        return tuple(plain(v, depth + 1) for v in value)
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


class CellTimeout(BaseException):
    """A cell ran past its limit: raised by :class:`Alarm`'s SIGALRM handler, inside :meth:`Alarm.run` only."""


class Alarm:
    """The parent's SIGALRM as a :class:`CellTimeout` inside the code a cell runs, and nowhere else.

    An alarm can land a moment early or late: while the harness handles the cell's own exception,
    reports its end, or waits for the next cell. Raised there, it would kill the process and
    every later cell's grade with it. So the handler raises only while armed, and disarms itself
    as it raises (one alarm, one exception); :meth:`run` arms inside a ``try`` whose ``finally``
    disarms, nested in a second ``try`` that catches whatever the first let out, the alarm raised
    in the ``finally`` itself included. Python runs signal handlers in the main thread between
    bytecodes, whichever thread the kernel delivered to, so the flag is all the guard needs.
    """

    def __init__(self):
        self.armed = False
        self.held = 0  # inside uninterrupted(): an alarm that lands waits for its end
        self.missed = False

    def install(self) -> "Alarm":
        import signal

        signal.signal(signal.SIGALRM, self.on_alarm)
        return self

    def on_alarm(self, signum, frame):
        if self.armed:
            if self.held:
                self.missed = True
                return
            self.armed = False
            raise CellTimeout()

    @contextlib.contextmanager
    def uninterrupted(self):
        """A few lines an alarm must not cut in two: a frame half written to the judge/learner
        channel, bytes read from it and not yet kept (``course.remote.Link``, through
        ``course.grader_hooks.uninterrupted``), a request to the parent and its answer
        (:class:`Channel`). Cut there, the stream would lose or repeat bytes and every later message
        would be read from the wrong place. An alarm that lands inside is raised as the block ends,
        if the cell is still armed. The block waits only for a peer that answers at once. In a
        thread other than the main one it holds nothing: the alarm is raised in the main thread
        alone, so it cannot cut what another thread does (and is never raised in that thread)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1
            if not self.held and self.missed:
                self.missed = False
                if self.armed:
                    self.armed = False
                    raise CellTimeout()

    def run(self, fn, *args):
        """``fn(*args)`` with the alarm armed; the exception it ended with (a :class:`CellTimeout`
        for the alarm, any ``BaseException`` of the code's own), or None."""
        try:
            try:
                self.missed = False  # an alarm held back in an earlier cell is not this one's
                self.armed = True
                fn(*args)
            finally:
                self.armed = False
        except BaseException as exc:  # noqa: BLE001 - the cell's outcome, reported by the caller
            return exc
        return None

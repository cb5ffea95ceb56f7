"""The one definition of what crosses the sandbox's boundary, used by both sides.

Parent to child (trusted to untrusted): framed pickles (the child may trust its parent): a
set-up message (token, cell limit, number of cells), then each cell only once the one before
it has ended (:func:`send_frame`), so no cell's source, hidden tests included, is in the child
before that cell runs; and single bytes during a cell: ``GO`` grants a timing turn.

Child to parent (untrusted to trusted): frames of an 8-byte big-endian length and a payload
that :func:`decode` reads with ``torch.load(weights_only=True)``: tensors, numbers, strings
and containers only, no code. The parent refuses a frame longer than :data:`MAX_MESSAGE`, and
a run that sends more than :data:`MAX_TOTAL` in all, so a flooded pipe costs the grader a
bounded amount of memory. Message kinds are the constants below; anything else is a forgery.

This file is also loaded inside the sandbox by path (``/grading/protocol.py``), so it imports
nothing from the grader.
"""

from __future__ import annotations

import io
import struct

#: Largest single message from the child (records carry tensors: a lesson's are at most a few MB).
MAX_MESSAGE = 64 * 2**20
#: Most bytes one run may send in all.
MAX_TOTAL = 512 * 2**20
#: Longest cell output and error text the parent keeps (the tail is kept).
MAX_OUTPUT_CHARS = 6000
MAX_ERROR_CHARS = 4000

HEADER = struct.Struct(">Q")
GO = b"g"

# Child -> parent message kinds.
READY, CELL_START, RECORD, CELL_END, FLAG, SPEED_BEGIN, SPEED_END, DONE = (
    "ready", "cell_start", "record", "cell_end", "flag", "speed_begin", "speed_end", "done")
KINDS = {READY, CELL_START, RECORD, CELL_END, FLAG, SPEED_BEGIN, SPEED_END, DONE}


def send_frame(fd: int, payload: bytes) -> None:
    """Write one framed payload to ``fd`` (parent to child)."""
    data = memoryview(HEADER.pack(len(payload)) + payload)
    while data:
        data = data[__import__("os").write(fd, data):]


class ProtocolError(Exception):
    """The child sent something that is not a message of this protocol."""


def encode(message: dict) -> bytes:
    """One framed message (used by the child)."""
    import torch

    buf = io.BytesIO()
    torch.save(message, buf)
    payload = buf.getvalue()
    return HEADER.pack(len(payload)) + payload


def decode(payload: bytes) -> dict:
    """The message in ``payload`` (used by the parent): data only, or :class:`ProtocolError`."""
    import torch

    try:
        message = torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - anything unreadable is a forgery
        raise ProtocolError(f"an unreadable message ({type(exc).__name__})") from None
    if not isinstance(message, dict) or message.get("kind") not in KINDS:
        raise ProtocolError("a message of no known kind")
    return message


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

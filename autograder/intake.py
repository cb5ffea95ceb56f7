"""Read what a learner submitted as untrusted data: the staging wall.

Nothing here follows a symbolic link, opens a special file, reads without a size cap, or
hands a half-checked structure to the rest of the grader. A submitted notebook becomes a
small, normalised dict (cells with a type, an id, a source string and the nbgrader fields the
grader uses) or a one-line reason why it cannot be graded, which becomes its ``invalid`` row.

Why each rule exists (each is a test in ``tests/test_intake.py``):

- links: a notebook or folder that is a link to the instructor's notebook or a classmate's
  folder would be graded as the learner's own work; a link to ``/dev/zero`` or a FIFO would
  hang or fill the disk;
- size and nesting caps: deeply nested or huge JSON exhausts the parser's stack or memory;
- integers of thousands of digits make Python's parser raise (or spend seconds converting);
- lone surrogates (``"\\ud800"`` is valid JSON) cannot be written as UTF-8 anywhere later;
- non-string sources, non-dict metadata and the like would crash the code that reads them.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

#: Largest notebook accepted (a lesson with outputs is a few MB; outputs are never graded).
MAX_NOTEBOOK_BYTES = 32 * 2**20
#: Deepest JSON nesting accepted (a notebook needs about 6).
MAX_DEPTH = 64
#: Most cells accepted, and the longest source of one cell.
MAX_CELLS = 2000
MAX_SOURCE_CHARS = 200_000
#: Files beside the notebook that are listed (never read) before the listing stops.
MAX_LISTED = 50

_CELL_TYPES = {"code", "markdown", "raw"}


class Rejected(Exception):
    """Why a submission cannot be graded: the ``detail`` of its ``invalid`` row."""


def shown(name: str) -> str:
    """A file name as it can be printed and written to CSV, whatever bytes it holds."""
    text = name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def safe_text(text: str) -> str:
    """``text`` with anything that is not valid Unicode (lone surrogates) made visible."""
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def kind_of(path: Path) -> str:
    """What is at ``path``, without following a link: 'file', 'dir', 'link', 'missing' or
    the kind of special file ('fifo', 'socket', 'device')."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "device"


def describe_kind(kind: str) -> str:
    return {"link": "a symbolic link", "fifo": "a named pipe (FIFO)", "socket": "a socket",
            "device": "a device file", "dir": "a folder", "missing": "missing"}.get(kind, kind)


def read_bytes(path: Path, limit: int = MAX_NOTEBOOK_BYTES) -> bytes:
    """The bytes of the regular file at ``path``; never follows a link, never blocks on a
    special file, never reads more than ``limit`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        kind = kind_of(path)
        if kind != "file":
            raise Rejected(f"{shown(path.name)} is {describe_kind(kind)}, not a file: submit the notebook "
                           "file itself") from None
        raise Rejected(f"{shown(path.name)} cannot be opened ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Rejected(f"{shown(path.name)} is {describe_kind(kind_of(path))}, not a file: submit the "
                           "notebook file itself")
        if info.st_size > limit:
            raise Rejected(f"{shown(path.name)} is {info.st_size / 2**20:.1f} MB, more than the "
                           f"{limit / 2**20:.0f} MB a notebook may have: clear its outputs "
                           "(Edit > Clear Outputs of All Cells) and save it again")
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise Rejected(f"{shown(path.name)} grew past {limit / 2**20:.0f} MB while being read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _depth(text: str) -> int:
    """The deepest nesting of JSON arrays and objects in ``text`` (strings skipped)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_DEPTH:
                    return deepest
        elif ch in "]}":
            depth -= 1
    return deepest


def _int(text: str) -> int:
    if len(text.lstrip("-")) > 30:
        raise Rejected(f"holds an integer of {len(text)} digits; a notebook has none that long")
    return int(text)


def _constant(name: str):
    raise Rejected(f"holds {name}, which is not JSON")


def parse_notebook(raw: bytes, name: str = "the notebook") -> dict:
    """The notebook in ``raw`` as a normalised dict, or :class:`Rejected` saying why not."""
    where = shown(name)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Rejected(f"{where} is not UTF-8 text (byte {exc.start}): is it a notebook?") from None
    if _depth(text) > MAX_DEPTH:
        raise Rejected(f"{where} nests JSON more than {MAX_DEPTH} levels deep; a notebook never does")
    try:
        data = json.loads(text, parse_int=_int, parse_constant=_constant)
    except Rejected as exc:
        raise Rejected(f"{where} {exc}") from None
    except json.JSONDecodeError as exc:
        raise Rejected(f"{where} is not valid JSON ({exc.msg} at line {exc.lineno}); open it in "
                       "Jupyter and save it again, or submit an earlier copy") from None
    except (RecursionError, ValueError, MemoryError) as exc:
        raise Rejected(f"{where} cannot be parsed as JSON ({type(exc).__name__})") from None
    return normalise(data, where)


def _check_text(value: str, what: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise Rejected(f"{what} holds text that is not valid Unicode (a lone surrogate); re-type "
                       "the affected characters and save again") from None
    return value


def _string(value, what: str, limit: int = 10_000) -> str:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        value = "".join(value)
    if not isinstance(value, str):
        raise Rejected(f"{what} should be text, but it is {type(value).__name__}")
    if len(value) > limit:
        raise Rejected(f"{what} is {len(value)} characters long, more than the {limit} allowed")
    return _check_text(value, what)


def normalise(data, where: str = "the notebook") -> dict:
    """Keep only what grading reads, each field checked for its type."""
    if not isinstance(data, dict) or "cells" not in data or "nbformat" not in data:
        raise Rejected(f"{where} is JSON but not a Jupyter notebook (no 'cells' and 'nbformat')")
    if data.get("nbformat") != 4:
        raise Rejected(f"{where} has notebook format {str(data.get('nbformat'))[:20]!s}, expected 4")
    cells = data["cells"]
    if not isinstance(cells, list):
        raise Rejected(f"{where}: 'cells' should be a list, but it is {type(cells).__name__}")
    if len(cells) > MAX_CELLS:
        raise Rejected(f"{where} has {len(cells)} cells, more than the {MAX_CELLS} allowed")
    out = []
    for n, cell in enumerate(cells):
        what = f"{where}, cell {n + 1}"
        if not isinstance(cell, dict):
            raise Rejected(f"{what} should be a JSON object, but it is {type(cell).__name__}")
        ctype = cell.get("cell_type")
        if ctype not in _CELL_TYPES:
            raise Rejected(f"{what} has cell_type {str(ctype)[:30]!r}; expected code, markdown or raw")
        cid = cell.get("id")
        cid = _string(cid, f"{what}'s id", 200) if cid is not None else None
        meta = cell.get("metadata", {})
        if not isinstance(meta, dict):
            raise Rejected(f"{what}'s metadata should be a JSON object, but it is {type(meta).__name__}")
        nb = meta.get("nbgrader", {})
        if not isinstance(nb, dict):
            raise Rejected(f"{what}'s nbgrader metadata should be a JSON object, but it is "
                           f"{type(nb).__name__}: was it edited by hand?")
        clean = {}
        if "grade_id" in nb:
            clean["grade_id"] = _string(nb["grade_id"], f"{what}'s grade_id", 200)
        for key in ("solution", "grade", "locked"):
            if key in nb:
                if not isinstance(nb[key], bool):
                    raise Rejected(f"{what}'s nbgrader '{key}' should be true or false")
                clean[key] = nb[key]
        if "points" in nb:
            if isinstance(nb["points"], bool) or not isinstance(nb["points"], (int, float)):
                raise Rejected(f"{what}'s nbgrader 'points' should be a number")
            clean["points"] = nb["points"]
        source = _string(cell.get("source", ""), f"{what}'s source", MAX_SOURCE_CHARS)
        out.append({"cell_type": ctype, "id": cid, "source": source,
                    "metadata": {"nbgrader": clean} if clean else {}})
    return {"nbformat": 4, "cells": out}


def listing(folder: Path, skip: set[str]) -> list[str]:
    """Names of what lies in ``folder`` (never followed, never read), for the report."""
    names = []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name in skip:
                    continue
                names.append(shown(entry.name))
                if len(names) >= MAX_LISTED:
                    names.append("...")
                    break
    except OSError:
        pass
    return sorted(names)

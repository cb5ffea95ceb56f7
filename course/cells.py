"""The one reader of nbgrader's cell metadata, for the course and the grader alike.

A notebook cell is a JSON object; nbgrader marks graded cells in ``metadata.nbgrader``: a
*solution* cell (``solution: true``) holds the learner's answer, a *test* cell (``grade: true``
and no solution) holds the checks and their points. Everything that asks "which kind of cell
is this" or "what is its grade id" asks here, and gets a safe answer for a malformed cell
(metadata that is not a dict, a source that is a list of lines).
"""

from __future__ import annotations

import ast
from typing import Any

__all__ = ["TooDeep", "find", "grade_id", "is_solution", "is_test", "names", "nbgrader", "parse", "points", "source"]


def nbgrader(cell: Any) -> dict:
    """The cell's nbgrader metadata ({} when there is none, or it is not a dict)."""
    meta = cell.get("metadata", {}) if isinstance(cell, dict) else {}
    nb = meta.get("nbgrader", {}) if isinstance(meta, dict) else {}
    return nb if isinstance(nb, dict) else {}


def source(cell: Any) -> str:
    """The cell's source as one string (nbformat allows a list of lines)."""
    src = cell.get("source", "") if isinstance(cell, dict) else ""
    return "".join(src) if isinstance(src, list) else str(src)


def grade_id(cell: Any, default: str = "") -> str:
    gid = nbgrader(cell).get("grade_id", default)
    return gid if isinstance(gid, str) else default


def find(cells: list, wanted: str) -> Any:
    """The first of ``cells`` whose grade id is ``wanted``; a KeyError naming it where none is."""
    for cell in cells:
        if grade_id(cell) == wanted:
            return cell
    raise KeyError(f"no cell has the grade id {wanted!r}")


def is_solution(cell: Any) -> bool:
    """A code cell that holds a learner's answer."""
    return cell.get("cell_type") == "code" and bool(nbgrader(cell).get("solution"))


def is_test(cell: Any) -> bool:
    """A code cell of graded tests (autograder tests: ``grade`` without ``solution``)."""
    meta = nbgrader(cell)
    return cell.get("cell_type") == "code" and bool(meta.get("grade")) and not meta.get("solution")


def points(cell: Any) -> float:
    value = nbgrader(cell).get("points", 0)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


class TooDeep(Exception):
    """Code that nests deeper than Python's parser goes at this process's recursion limit."""


def parse(code: str, *, say_too_deep: bool = False) -> ast.Module | None:
    """``code``'s syntax tree, or None where it is not Python (a syntax error, a null byte: such a
    cell fails when it runs) or nests deeper than the parser goes at this process's recursion limit.
    That code a process with a higher limit (a learner's, after ``sys.setrecursionlimit``) still
    compiles and runs: with ``say_too_deep``, it raises :class:`TooDeep` instead, so that a reader
    of learner code can say it could not read it."""
    try:
        return ast.parse(code)
    except (SyntaxError, ValueError):
        return None
    except (RecursionError, MemoryError) as exc:
        if say_too_deep:
            raise TooDeep(f"nests deeper than Python's parser goes here ({type(exc).__name__})") from None
        return None


def names(code: str) -> tuple[set[str], set[str]]:
    """(names a cell's code reads, names it binds anywhere: assignments, functions, classes,
    imports); both empty when it does not parse. Which names a test cell takes from the learner,
    and which set-up cells the grader's judge may run, are decided from these."""
    tree = parse(code)
    if tree is None:
        return set(), set()
    loaded, stored = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else stored).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stored.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            stored |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return loaded, stored

"""The one reader of nbgrader's cell metadata, for the course and the grader alike.

A notebook cell is a JSON object; nbgrader marks graded cells in ``metadata.nbgrader``: a
*solution* cell (``solution: true``) holds the learner's answer, a *test* cell (``grade: true``
and no solution) holds the checks and their points. Everything that asks "which kind of cell
is this" or "what is its grade id" asks here, and gets a safe answer for a malformed cell
(metadata that is not a dict, a source that is a list of lines).
"""

from __future__ import annotations

from typing import Any

__all__ = ["grade_id", "is_solution", "is_test", "nbgrader", "points", "source"]


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

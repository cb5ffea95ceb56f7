"""The lessons' running times, as the README states them, from a measurement, never from memory.

The figure is a learner's run: every cell top to bottom in one namespace, the closing self-check
included (it runs the tests again), on the pinned torch, as ``make torch-matrix``
(``benchmarks/torch_matrix.py``) runs each lesson; ``docs/compatibility.json`` keeps its seconds.
``python -m autograder.runtimes [docs/compatibility.json]`` records the pinned version's figures
in ``course/lessons.json`` (``measured_s``) and rewrites the README's "runs in" column from them.
Two tests keep it honest: the README's column equals the recorded figures, and
``tests/test_lessons.py`` runs each lesson the same way on every test run (writing the seconds
to ``test-artifacts/lesson-runtimes.json``) and fails when one takes more than twice what is
recorded: a lesson that became slower cannot keep an old figure in the README.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LESSONS_JSON = ROOT / "course" / "lessons.json"
README = ROOT / "README.md"
MATRIX = ROOT / "docs" / "compatibility.json"

__all__ = ["readme_column", "text", "update"]


def text(seconds: float) -> str:
    """How the README says a running time: "about 35 s", "about 2 min"."""
    if seconds < 90:
        return f"about {max(5, 5 * round(seconds / 5))} s"
    return f"about {round(seconds / 60)} min"


def _rows(readme: str) -> list[tuple[int, str, list[str]]]:
    """(line number, lesson id, cells) of each row of the README's lessons table."""
    out = []
    for n, line in enumerate(readme.splitlines()):
        found = re.match(r"\|\s*\d+\s*\|.*?\]\(lessons/([\w]+)/", line)
        if found:
            out.append((n, found.group(1), line.split("|")))
    return out


def readme_column(readme: str | None = None) -> dict[str, str]:
    """The "runs in" cell of each lesson's row of the README's table."""
    readme = README.read_text() if readme is None else readme
    return {lesson: cells[5].strip() for _, lesson, cells in _rows(readme)}


def update(measured: dict[str, float], *, lessons_json: Path = LESSONS_JSON, readme: Path = README) -> None:
    """Record ``measured`` (lesson id -> seconds) and rewrite the README's column from it."""
    catalog = json.loads(lessons_json.read_text())
    for item in catalog:
        if item["id"] in measured:
            item["measured_s"] = round(float(measured[item["id"]]))
    lessons_json.write_text(json.dumps(catalog, indent=2) + "\n")
    seconds = {item["id"]: item.get("measured_s") for item in catalog}
    lines = readme.read_text().splitlines()
    for n, lesson, cells in _rows("\n".join(lines)):
        if seconds.get(lesson) is not None:
            cells[5] = f" {text(seconds[lesson])} "
            lines[n] = "|".join(cells)
    readme.write_text("\n".join(lines) + "\n")


def from_matrix(matrix: dict, version: str | None = None) -> dict[str, float]:
    """Seconds per lesson of the pinned torch's runs in a torch-matrix result (only lessons that
    passed: a failed run's time says nothing)."""
    if version is None:
        for line in (ROOT / "requirements" / "lock.txt").read_text().splitlines():
            if line.startswith("torch=="):
                version = line.split("==")[1].strip()
    runs = matrix.get("runs", matrix).get(version) or {}
    return {lesson: r["seconds"] for lesson, r in runs.items() if r.get("ok")}


if __name__ == "__main__":
    source = Path(sys.argv[1]) if len(sys.argv) > 1 else MATRIX
    measured = from_matrix(json.loads(source.read_text()))
    if not measured:
        sys.exit(f"{source} holds no passing run of the pinned torch: run `make torch-matrix` first")
    update(measured)
    print(f"recorded {len(measured)} lessons' running times from {source} in {LESSONS_JSON.name} and the README")

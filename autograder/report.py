"""The outputs of ``grade``: ``grades.csv``, ``cells.csv`` and the summary table."""

from __future__ import annotations

import csv
import os
import threading
from dataclasses import astuple, dataclass, fields
from pathlib import Path


@dataclass
class Row:
    """One row of grades.csv: a student's result for one lesson."""
    student_id: str
    lesson_id: str
    score: float
    max_score: float
    status: str  # graded | missing | invalid | timeout | oom | crashed | error
    cell_errors: int
    seconds: float
    peak_rss_mb: float
    flags: str   # comma-separated names of what the submission tried (see docs/grading.md)
    detail: str
    device: str = ""  # what it was graded on: cpu or cuda (the speed bars differ)


@dataclass
class CellRow:
    """One row of cells.csv: the autograded score of one graded cell, and its verdict: passed,
    failed, or undecided (a speed bar the grading machine was too busy to decide: no points yet,
    measured again by the next ``grade`` run)."""
    student_id: str
    lesson_id: str
    notebook: str
    grade_id: str
    score: float
    max_score: float
    verdict: str = "passed"
    reason: str = ""  # why not, when not passed: one of autograder.verdict.REASONS


def _write(path: Path, rows: list, cls) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow([f.name for f in fields(cls)])
        for row in rows:
            writer.writerow([_fmt(v) for v in astuple(row)])
    os.replace(tmp, path)


class RowSink:
    """Appends each row to ``grades.csv`` and ``cells.csv`` the moment it is decided (flushed to
    disk), so that a crash of the grader itself loses no row already graded. ``grade`` rewrites
    both files in submission order at the end."""

    def __init__(self, out: Path):
        self.lock = threading.Lock()
        self.files = {}
        for name, cls in (("grades.csv", Row), ("cells.csv", CellRow)):
            fh = open(out / name, "w", newline="", encoding="utf-8")
            csv.writer(fh).writerow([f.name for f in fields(cls)])
            fh.flush()
            self.files[cls] = fh

    def add(self, row: Row, cells: list[CellRow]) -> None:
        with self.lock:
            for cls, items in ((Row, [row]), (CellRow, cells)):
                fh = self.files[cls]
                writer = csv.writer(fh)
                for item in items:
                    writer.writerow([_fmt(v) for v in astuple(item)])
                fh.flush()
                os.fsync(fh.fileno())

    def close(self) -> None:
        for fh in self.files.values():
            fh.close()


def _fmt(value):
    if isinstance(value, float):
        return f"{value:.2f}".rstrip("0").rstrip(".") if value != int(value) else str(int(value))
    if isinstance(value, str):
        # one line per row, whatever the detail says, and always writable as UTF-8
        return " ".join(value.encode("utf-8", "surrogatepass").decode("utf-8", "replace").split())
    return value


def write_grades(out: Path, rows: list[Row]) -> Path:
    path = out / "grades.csv"
    _write(path, rows, Row)
    return path


def write_cells(out: Path, rows: list[CellRow]) -> Path:
    path = out / "cells.csv"
    _write(path, rows, CellRow)
    return path


def summary_table(rows: list[Row], cells: list[CellRow] = ()) -> str:
    """Students down, lessons across: ``score/max`` plus the status when not graded; then the
    counts, the flags, and the cells left undecided."""
    undecided = [f"{c.student_id}/{c.lesson_id}/{c.grade_id}" for c in cells if c.verdict == "undecided"]
    students = sorted({r.student_id for r in rows})
    lessons = sorted({r.lesson_id for r in rows})
    cell = {(r.student_id, r.lesson_id):
            f"{_fmt(r.score)}/{_fmt(r.max_score)}" + ("" if r.status == "graded" else f" {r.status}")
            for r in rows}
    header = ["student"] + lessons
    table = [header] + [[s] + [cell.get((s, l), "-") for l in lessons] for s in students]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    lines.append("")
    lines.append(", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "no submissions")
    flagged = [f"{r.student_id}/{r.lesson_id}: {r.flags}" for r in rows if r.flags]
    if flagged:
        lines.append("flagged: " + "; ".join(flagged))
    if undecided:
        lines.append(f"undecided: {len(undecided)} speed cell(s), no points yet ("
                     + "; ".join(undecided[:10]) + ("; ..." if len(undecided) > 10 else "")
                     + "): the machine was too busy to decide; run the same grade command again, on a quieter "
                     "machine if you can: only these are measured again")
    return "\n".join(lines)

"""``python -m autograder grade``: autograde every submission, one subprocess each.

Each submission is graded by its own ``nbgrader autograde`` process, so a crash, a dead
kernel or an endless loop costs that one submission a row with status ``error`` or
``timeout`` and the batch goes on. Scores are read back from nbgrader's gradebook.
Feedback runs no student code, so it is made by one ``nbgrader generate_feedback`` per
lesson after the batch, which saves an nbgrader start-up (seconds) per submission.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from .release import build_student_version
from .report import CellRow, Row, summary_table, write_cells, write_grades
from .submissions import Submission, find_submissions, stage
from .workspace import Workspace, last_error, notebooks_in, select_lessons


class Lesson:
    """What grading needs to know about one lesson's source."""

    def __init__(self, ws: Workspace, lesson_id: str):
        from nbgrader.api import Gradebook

        self.id = lesson_id
        self.notebooks = [p.name for p in notebooks_in(ws.source(lesson_id))]
        # Graded cells in notebook order, to list cells.csv the way the lesson reads.
        self.order: dict[tuple[str, str], int] = {}
        for path in notebooks_in(ws.source(lesson_id)):
            nb = json.loads(path.read_text(encoding="utf-8"))
            for cell in nb.get("cells", []):
                meta = cell.get("metadata", {}).get("nbgrader", {})
                if meta.get("grade"):
                    self.order[(path.stem, meta.get("grade_id", ""))] = len(self.order)
        with Gradebook(ws.db_url) as gb:
            self.max_score = float(gb.find_assignment(lesson_id).max_score)


def grade(submissions: Path, out: Path, solutions: Path, work: Path, *, lesson: str | None = None,
          db_url: str | None = None, cell_timeout: int = 600, timeout: float = 1800) -> list[Row]:
    """Grade ``SUBMISSIONS/<student>/<lesson>/`` into ``out``; returns the grades.csv rows."""
    lesson_ids = select_lessons(solutions, lesson)
    subs = find_submissions(submissions, lesson_ids, lesson)
    ws = Workspace(work, db_url=db_url, cell_timeout=cell_timeout)
    lessons: dict[str, Lesson] = {}
    for lesson_id in sorted({s.lesson for s in subs}):
        print(f"preparing {lesson_id}: nbgrader generate_assignment", flush=True)
        build_student_version(ws, solutions, lesson_id, no_db=False)
        lessons[lesson_id] = Lesson(ws, lesson_id)

    out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    cells: list[CellRow] = []
    for n, sub in enumerate(subs, 1):
        row, cell_rows = grade_one(ws, sub, lessons[sub.lesson], out, timeout)
        rows.append(row)
        cells.extend(cell_rows)
        score = f"{row.score:g}/{row.max_score:g}"
        extra = f" - {row.detail}" if row.detail else ""
        print(f"[{n}/{len(subs)}] {sub.student}/{sub.lesson}: {row.status} {score} "
              f"({row.seconds:.1f} s, {row.peak_rss_mb:.0f} MB){extra}", flush=True)

    for lesson_id in sorted(lessons):
        make_feedback(ws, lesson_id, [r for r in rows if r.lesson_id == lesson_id], out)

    write_grades(out, rows)
    write_cells(out, cells)
    print()
    print(summary_table(rows))
    print(f"\nwrote {out / 'grades.csv'}, {out / 'cells.csv'} and {out / 'feedback'}/", flush=True)
    return rows


def grade_one(ws: Workspace, sub: Submission, lesson: Lesson, out: Path,
              timeout: float) -> tuple[Row, list[CellRow]]:
    start = time.monotonic()
    deadline = start + timeout
    student = sub.student
    feedback_out = out / "feedback" / student / lesson.id
    for stale in (ws.autograded(student, lesson.id), ws.feedback(student, lesson.id), feedback_out):
        if stale.exists():
            shutil.rmtree(stale)

    def row(status: str, detail: str, score: float = 0.0, cell_errors: int = 0,
            peak: float = 0.0) -> Row:
        return Row(student, lesson.id, score, lesson.max_score, status, cell_errors,
                   round(time.monotonic() - start, 2), round(peak, 1), detail)

    status, detail = stage(sub, lesson.notebooks, ws.submitted(student, lesson.id))
    if status:
        return row(status, detail), []
    notes = [detail] if detail else []

    log = ws.log(student, lesson.id, "autograde.log")
    run = ws.nbgrader(["autograde", lesson.id, "--student", student, "--force"],
                      log=log, timeout=deadline - time.monotonic())
    peak = run.peak_rss_mb
    if run.timed_out:
        notes.append(f"killed after the --timeout of {timeout:g} s; log: {log}")
        return row("timeout", "; ".join(notes), peak=peak), []
    if run.returncode != 0:
        notes.append(f"nbgrader autograde exited with {run.returncode}: {last_error(log)}; log: {log}")
        return row("error", "; ".join(notes), peak=peak), []

    score, cell_rows = read_scores(ws, student, lesson)
    errors = count_cell_errors(ws.autograded(student, lesson.id), lesson.notebooks)
    if errors:
        notes.append(f"{errors} cell(s) raised an error")
    return row("graded", "; ".join(notes), score=score, cell_errors=errors, peak=peak), cell_rows


def make_feedback(ws: Workspace, lesson_id: str, rows: list[Row], out: Path) -> None:
    """Generate the HTML feedback of this run's graded rows of a lesson, copy it to ``out``.

    Other autograded copies in the work folder (earlier runs, timed-out submissions)
    are excluded. A row
    whose feedback could not be made keeps its score and says so in ``detail``.
    """
    graded = {r.student_id: r for r in rows if r.status == "graded"}
    if not graded:
        return
    others = sorted(p.parent.name for p in ws.root.glob(f"autograded/*/{lesson_id}")
                     if p.parent.name not in graded)
    args = ["generate_feedback", lesson_id, "--force"]
    if others:
        args.append(f"--CourseDirectory.student_id_exclude={','.join(others)}")
    log = ws.log("generate_feedback", f"{lesson_id}.log")
    plural = "s" if len(graded) != 1 else ""
    print(f"feedback for {lesson_id}: nbgrader generate_feedback ({len(graded)} submission{plural})",
          flush=True)
    run = ws.nbgrader(args, log=log, timeout=120 + 30 * len(graded))
    for student, row in sorted(graded.items()):
        pages = sorted(ws.feedback(student, lesson_id).glob("*.html"))
        if not pages:
            why = "timed out" if run.timed_out else last_error(log)
            note = f"no feedback (generate_feedback: {why}); log: {log}"
            row.detail = f"{row.detail}; {note}" if row.detail else note
            continue
        dest = out / "feedback" / student / lesson_id
        dest.mkdir(parents=True, exist_ok=True)
        for page in pages:
            shutil.copyfile(page, dest / page.name)


def read_scores(ws: Workspace, student: str, lesson: Lesson) -> tuple[float, list[CellRow]]:
    """The submission's total and per-cell autograded scores, from the gradebook."""
    from nbgrader.api import Gradebook

    cells = []
    with Gradebook(ws.db_url) as gb:
        submission = gb.find_submission(lesson.id, student)
        total = float(submission.score)
        for notebook in submission.notebooks:
            for grade in notebook.grades:
                cells.append(CellRow(student, lesson.id, notebook.name, grade.name,
                                     float(grade.score or 0.0), float(grade.max_score)))
    cells.sort(key=lambda c: (lesson.order.get((c.notebook, c.grade_id), len(lesson.order)),
                              c.notebook, c.grade_id))
    return total, cells


def count_cell_errors(folder: Path, notebooks: list[str]) -> int:
    """Code cells of the autograded notebooks whose outputs hold an error."""
    count = 0
    for name in notebooks:
        path = folder / name
        if not path.exists():
            continue
        nb = json.loads(path.read_text(encoding="utf-8"))
        count += sum(
            1 for cell in nb.get("cells", [])
            if cell.get("cell_type") == "code"
            and any(o.get("output_type") == "error" for o in cell.get("outputs", [])))
    return count

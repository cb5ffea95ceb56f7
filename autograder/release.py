"""``python -m autograder release``: regenerate ``lessons/`` from ``solutions/``.

The student versions are committed, and a test regenerates them and compares bytes, so
the output must depend on the source notebooks only: nbgrader runs without a gradebook
(``--no-db``, a release must not depend on what was graded before), cell ids are made
stable before nbgrader sees the notebooks, and every released notebook is rewritten
by nbformat without outputs.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import nbformat

from course.lessons import catalog
from course.selfcheck import exercises_of

from . import UsageError, launch
from .workspace import Workspace, copy_tree, last_error, notebooks_in, select_lessons

RELEASE_TIMEOUT_S = 600


def release(solutions: Path, lessons: Path, work: Path, lesson: str | None = None) -> list[str]:
    """Regenerate ``lessons/<id>`` for one or all lessons; returns the ids released.

    The course's own lessons first get their launch cells brought up to date in ``solutions/``
    (the Colab set-up cell, the Binder/Colab links, the self-check at the end), and the
    visible tests of the released lessons are written to ``course/exercises.json`` for the
    learner's self-check.
    """
    ids = select_lessons(solutions, lesson)
    ws = Workspace(work)
    lessons.mkdir(parents=True, exist_ok=True)
    course_ids = {item["id"] for item in catalog()}
    for lesson_id in ids:
        if lesson_id in course_ids:
            for path in notebooks_in(solutions / lesson_id):
                if launch.apply_to_file(path, lesson_id):
                    print(f"updated the launch cells of {path}", flush=True)
        build_student_version(ws, solutions, lesson_id, no_db=True)
        out = lessons / lesson_id
        copy_tree(ws.release(lesson_id), out)
        n_nb = len(notebooks_in(out))
        n_files = sum(1 for p in out.rglob("*") if p.is_file()) - n_nb
        print(f"released {lesson_id}: {n_nb} notebook(s), {n_files} other file(s) -> {out}",
              flush=True)
    if lessons.resolve() == (launch.ROOT / "lessons").resolve():
        write_exercises(lessons, launch.ROOT / "course" / "exercises.json")
    return ids


def exercise_table(lessons: Path) -> dict:
    """Each course lesson's visible test cells, as the learner's self-check runs them."""
    table = {}
    for item in catalog():
        found = notebooks_in(lessons / item["id"]) if (lessons / item["id"]).is_dir() else []
        if found:
            nb = json.loads(found[0].read_text(encoding="utf-8"))
            table[item["id"]] = [asdict(e) for e in exercises_of(nb)]
    return table


def write_exercises(lessons: Path, out: Path) -> None:
    text = json.dumps(exercise_table(lessons), indent=1, ensure_ascii=False) + "\n"
    if not out.exists() or out.read_text(encoding="utf-8") != text:
        out.write_text(text, encoding="utf-8")
        print(f"wrote {out}", flush=True)


def build_student_version(ws: Workspace, solutions: Path, lesson_id: str, *, no_db: bool) -> None:
    """Stage the source and run ``nbgrader generate_assignment`` for one lesson.

    With ``no_db=False`` the lesson's cells (and the hidden tests) are recorded in the
    gradebook, which autograding needs; raises UsageError when nbgrader fails, since no
    submission of that lesson can be graded then.
    """
    ws.stage_source(solutions, lesson_id)
    released = ws.release(lesson_id)
    if released.exists():
        shutil.rmtree(released)
    args = ["generate_assignment", lesson_id, "--force"]
    if no_db:
        args.append("--no-db")
    log = ws.log("generate_assignment", f"{lesson_id}.log")
    result = ws.nbgrader(args, log=log, timeout=RELEASE_TIMEOUT_S)
    if result.returncode != 0 or not released.is_dir():
        why = "timed out" if result.timed_out else f"exited with {result.returncode}"
        raise UsageError(
            f"nbgrader generate_assignment {lesson_id} {why}: expected a student version of "
            f"{solutions / lesson_id}, got none. nbgrader said: {last_error(log)!r}. "
            f"Full log: {log}. Check the nbgrader cell metadata of the source notebook; if "
            "the gradebook is stale (cells removed from a graded lesson), delete the work "
            "folder or pass --db.")
    for path in notebooks_in(released):
        canonical_rewrite(path)


def canonical_rewrite(path: Path) -> None:
    """Rewrite a notebook the way nbformat writes it, with outputs and counts cleared."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    nbformat.write(nb, path)

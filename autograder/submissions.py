"""Find the submissions in ``SUBMISSIONS/<student_id>/<lesson_id>/`` and vet them.

Students make predictable mistakes (a renamed notebook, an empty folder, a file that
is not JSON). These are decided here, before nbgrader runs, so that each turns into a
clear row of the report instead of an nbgrader traceback.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

from . import UsageError
from .workspace import IGNORED_NAMES, notebooks_in

#: Student ids become folder names and nbgrader path patterns: keep them plain.
SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,99}$")


@dataclass(frozen=True)
class Submission:
    student: str
    lesson: str
    folder: Path  # may not exist: the student has no folder for a lesson asked for


def find_submissions(root: Path, lessons: list[str], only_lesson: str | None) -> list[Submission]:
    """One Submission per student and lesson, sorted by student then lesson.

    With ``--lesson`` every student gets a row for that lesson (``missing`` when the
    folder is absent); without it, the lesson folders each student has are graded.
    """
    if not root.is_dir():
        raise UsageError(
            f"expected a SUBMISSIONS folder laid out as SUBMISSIONS/<student_id>/<lesson_id>/"
            f"*.ipynb, but {root} {'is not a folder' if root.exists() else 'does not exist'}; "
            "check the path (e.g. unpack the collected submissions there first)")
    found: list[Submission] = []
    students = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(".") or entry.name in IGNORED_NAMES:
            continue
        if not entry.is_dir():
            warn(f"skipping {entry}: expected one folder per student, this is a file")
            continue
        if not SAFE_ID.match(entry.name):
            warn(f"skipping {entry}: the student id {entry.name!r} is not a safe folder name "
                 "(letters, digits, '.', '_', '-', '@', '+'; not starting with a symbol)")
            continue
        students.append(entry.name)
        if only_lesson is not None:
            found.append(Submission(entry.name, only_lesson, entry / only_lesson))
            continue
        for sub in sorted(entry.iterdir()):
            if sub.name.startswith(".") or sub.name in IGNORED_NAMES:
                continue
            if sub.is_dir() and sub.name in lessons:
                found.append(Submission(entry.name, sub.name, sub))
            elif sub.is_dir():
                warn(f"skipping {sub}: no lesson {sub.name!r} in the course "
                     f"(known: {', '.join(lessons)})")
            else:
                warn(f"skipping {sub}: expected lesson folders <lesson_id>/ inside a "
                     "student folder")
    if not students:
        raise UsageError(
            f"expected student folders in {root} (SUBMISSIONS/<student_id>/<lesson_id>/"
            "*.ipynb), found none; check the path")
    if not found:
        raise UsageError(
            f"found student folders in {root} ({', '.join(students[:5])}"
            f"{', ...' if len(students) > 5 else ''}) but no lesson folders of this course "
            f"in them; expected SUBMISSIONS/<student_id>/<lesson_id>/ with a lesson id among: "
            f"{', '.join(lessons)}; check --solutions, or pass --lesson ID")
    return sorted(found, key=lambda s: (s.student, s.lesson))


def stage(sub: Submission, expected: list[str], dest: Path) -> tuple[str | None, str]:
    """Copy a submission into the nbgrader course root as nbgrader expects it.

    ``expected`` are the notebook file names of the lesson's source. Returns
    ``(status, detail)``: status ``missing`` or ``invalid`` when there is nothing
    to grade, ``None`` when ``dest`` is ready for ``nbgrader autograde``.
    """
    if dest.exists():
        shutil.rmtree(dest)
    if not sub.folder.is_dir():
        return "missing", f"no folder {sub.lesson}/ for this student"
    submitted = notebooks_in(sub.folder)
    if not submitted:
        return "missing", f"no .ipynb in {sub.lesson}/"
    names = {p.name for p in submitted}
    rename: dict[str, str] = {}
    notes = []
    if not names & set(expected):
        if len(expected) == 1 and len(submitted) == 1:
            rename[submitted[0].name] = expected[0]
            notes.append(f"graded {submitted[0].name!r} as {expected[0]!r}")
        else:
            return "missing", (f"expected {', '.join(expected)}; found "
                               f"{', '.join(sorted(names))}")
    dest.mkdir(parents=True)
    for item in sorted(sub.folder.iterdir()):
        if item.name.startswith(".") or item.name in IGNORED_NAMES:
            continue
        target = dest / rename.get(item.name, item.name)
        if item.is_dir():
            shutil.copytree(item, target, copy_function=shutil.copyfile,
                            ignore=lambda _d, ns: [n for n in ns if n in IGNORED_NAMES])
        else:
            shutil.copyfile(item, target)
    for name in expected:
        path = dest / name
        if path.exists():
            problem = notebook_problem(path)
            if problem:
                original = next((k for k, v in rename.items() if v == name), name)
                return "invalid", f"{original}: {problem}"
    missing = [n for n in expected if not (dest / n).exists()]
    if missing:
        notes.append(f"missing {', '.join(missing)} (scored 0)")
    return None, "; ".join(notes)


def notebook_problem(path: Path) -> str:
    """Why ``path`` cannot be graded as a notebook, or '' when it can."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        return "not a text file"
    except json.JSONDecodeError as exc:
        return f"not valid JSON ({exc.msg} at line {exc.lineno})"
    if not isinstance(raw, dict) or "cells" not in raw or "nbformat" not in raw:
        return "JSON but not a Jupyter notebook (no 'cells'/'nbformat')"
    if raw.get("nbformat") != 4:
        return f"notebook format {raw.get('nbformat')!r}, expected 4"
    try:
        nbformat.reads(json.dumps(raw), as_version=4)
    except Exception as exc:  # nbformat raises a variety of errors on malformed notebooks
        return f"unreadable notebook ({type(exc).__name__}: {exc})"[:200]
    return ""


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)

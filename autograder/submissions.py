"""Find the submissions in ``SUBMISSIONS/<student_id>/<lesson_id>/`` and vet them.

Students make predictable mistakes (a renamed notebook, an empty folder, a file that
is not JSON), and a determined one submits links, special files or JSON built to break a
parser. All of it is decided here, reading the files as data (``intake.py``), before anything
runs, so that each turns into a clear ``missing`` or ``invalid`` row.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from . import UsageError
from .intake import Rejected, describe_kind, kind_of, listing, parse_notebook, read_bytes, shown
from .workspace import IGNORED_NAMES

#: Student ids become folder names and nbgrader path patterns: keep them plain.
SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,99}$")


@dataclass(frozen=True)
class Submission:
    student: str
    lesson: str
    folder: Path  # may not exist: the student has no folder for a lesson asked for
    problem: str = ""  # set when the layout itself cannot be graded (a linked folder)


def _is_dir(path: Path) -> bool:
    """A real folder: a symbolic link to one is not."""
    return kind_of(path) == "dir"


def find_submissions(root: Path, lessons: list[str], only_lesson: str | None) -> list[Submission]:
    """One Submission per student and lesson, sorted by student then lesson.

    With ``--lesson`` every student gets a row for that lesson (``missing`` when the
    folder is absent); without it, the lesson folders each student has are graded. A student
    or lesson folder that is a symbolic link (to a classmate's folder, say) is never followed:
    it gets an ``invalid`` row.
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
        kind = kind_of(entry)
        if kind not in ("dir", "link"):
            warn(f"skipping {shown(str(entry))}: expected one folder per student, this is "
                 f"{describe_kind(kind)}")
            continue
        if not SAFE_ID.match(entry.name):
            warn(f"skipping {shown(str(entry))}: the student id is not a safe folder name "
                 "(letters, digits, '.', '_', '-', '@', '+'; not starting with a symbol)")
            continue
        students.append(entry.name)
        if kind == "link":
            problem = ("the student folder is a symbolic link (to another folder); submit the files "
                       "themselves, not a link")
            for lesson in ([only_lesson] if only_lesson else lessons):
                found.append(Submission(entry.name, lesson, entry / lesson, problem))
            continue
        if only_lesson is not None:
            found.append(Submission(entry.name, only_lesson, entry / only_lesson))
            continue
        for sub in sorted(entry.iterdir()):
            if sub.name.startswith(".") or sub.name in IGNORED_NAMES:
                continue
            sub_kind = kind_of(sub)
            if sub.name in lessons and sub_kind in ("dir", "link"):
                found.append(Submission(entry.name, sub.name, sub))
            elif sub_kind == "dir":
                warn(f"skipping {shown(str(sub))}: no lesson of that name in the course "
                     f"(known: {', '.join(lessons)})")
            else:
                warn(f"skipping {shown(str(sub))}: expected lesson folders <lesson_id>/ inside a "
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


@dataclass
class Staged:
    """A submission that can be graded: its notebook's bytes and normalised content."""
    raw: bytes
    notebook: dict
    notes: list[str]
    extra: list[str]   # names of other things beside the notebook (never read)


def stage(sub: Submission, expected: str) -> tuple[str, str] | Staged:
    """Read the learner's notebook for lesson ``sub.lesson`` as data.

    ``expected`` is the notebook's file name in the lesson's source. Returns ``(status,
    detail)`` (``missing`` or ``invalid``) when there is nothing to grade, else a
    :class:`Staged`. Nothing is copied, nothing beside the notebook is opened, and no link
    is followed.
    """
    if sub.problem:
        return "invalid", sub.problem
    kind = kind_of(sub.folder)
    if kind == "missing":
        return "missing", f"no folder {sub.lesson}/ for this student"
    if kind != "dir":
        return "invalid", (f"{sub.lesson}/ is {describe_kind(kind)}, not a folder: submit the "
                           "lesson's folder with the notebook in it")
    candidates = []
    try:
        with os.scandir(sub.folder) as entries:
            for entry in entries:
                if entry.name.endswith(".ipynb") and not entry.name.startswith("."):
                    candidates.append(entry.name)
    except OSError as exc:
        return "invalid", f"{sub.lesson}/ cannot be listed ({exc.strerror})"
    if not candidates:
        return "missing", f"no .ipynb in {sub.lesson}/"
    notes = []
    if expected in candidates:
        name = expected
    elif len(candidates) == 1:
        name = candidates[0]
        notes.append(f"graded '{shown(name)}' as '{expected}'")
    else:
        return "missing", (f"expected {expected}; found "
                           f"{', '.join(shown(n) for n in sorted(candidates)[:10])}")
    try:
        raw = read_bytes(sub.folder / name)
        notebook = parse_notebook(raw, name)
    except Rejected as exc:
        return "invalid", str(exc)
    extra = listing(sub.folder, skip={name, *IGNORED_NAMES})
    return Staged(raw, notebook, notes, extra)


def notebook_problem(path: Path) -> str:
    """Why ``path`` cannot be graded as a notebook, or '' when it can."""
    try:
        parse_notebook(read_bytes(path), path.name)
    except Rejected as exc:
        return str(exc)
    return ""


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)

"""``python -m autograder canvas OUT``: the class's scores as a CSV that Canvas's gradebook imports.

Canvas imports the same layout it exports (Grades > Export): the identity columns ``Student``,
``ID``, ``SIS User ID``, ``SIS Login ID``, ``Section``, an optional ``Points Possible`` row, then
one column per assignment, named ``Title (id)`` for an assignment Canvas has, or a new title,
which Canvas offers to create. The best input is that export (``--roster``): every learner keeps
the identity Canvas knows them by, matched to the grader's student id through one column
(``--match``, default ``SIS Login ID``), and each lesson fills the assignment column whose title
names it (or ``--title LESSON=COLUMN``), else a new column. Without a roster, the student id goes
in ``SIS Login ID``.

A missing submission is left blank (Canvas's own policy for missing work then applies); any other
row gives its score (0 for an invalid one). Learners in one file and not the other are named.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from . import UsageError

IDENTITY = ["Student", "ID", "SIS User ID", "SIS Login ID", "Section"]
POINTS_ROW = "Points Possible"


def _read(path: Path) -> list[dict]:
    with path.open(newline="", encoding="utf-8-sig") as fh:
        return list(csv.DictReader(fh))


def export(out: Path, *, roster: Path | None = None, match: str = "SIS Login ID",
           titles: dict[str, str] | None = None) -> Path:
    grades_csv = out / "grades.csv"
    if not grades_csv.is_file():
        raise UsageError(f"expected {grades_csv} (what `python -m autograder grade` or `collect` writes): pass "
                         "the folder given to grade --out")
    grades = _read(grades_csv)
    lessons = sorted({r["lesson_id"] for r in grades})
    max_points = {lid: max(float(r["max_score"]) for r in grades if r["lesson_id"] == lid) for lid in lessons}
    score = {(r["student_id"], r["lesson_id"]): ("" if r["status"] == "missing" else _fmt(float(r["score"])))
             for r in grades}
    students = sorted({r["student_id"] for r in grades})
    titles = dict(titles or {})

    if roster is not None:
        if not roster.is_file():
            raise UsageError(f"--roster {roster}: no such file; export it from Canvas (Grades > Export > CSV)")
        rows = _read(roster)
        header = list(rows[0].keys()) if rows else []
        if match not in header:
            raise UsageError(f"--match {match!r}: the roster's columns are {header[:8]}; name the one that holds "
                             "the ids the submissions folder uses (e.g. 'SIS Login ID', 'SIS User ID', 'ID')")
        identity = [c for c in header if c in IDENTITY or c in ("Integration ID",)]
        points = next((r for r in rows if (r.get("Student") or "").strip() == POINTS_ROW), None)
        learners = [r for r in rows if r is not points and (r.get(match) or "").strip()]
    else:
        identity, points = IDENTITY, None
        learners = [{"SIS Login ID": s} for s in students]
        match = "SIS Login ID"
        header = IDENTITY
    columns = {}
    for lid in lessons:
        if lid in titles:
            columns[lid] = titles[lid]
        else:
            named = [c for c in header if c not in identity and lid in c]
            columns[lid] = named[0] if len(named) == 1 else lid
    target = out / "canvas.csv"
    with target.open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(identity + [columns[lid] for lid in lessons])
        if points is not None or roster is None:
            w.writerow([POINTS_ROW if c == "Student" else "" for c in identity]
                       + [_fmt(max_points[lid]) for lid in lessons])
        for r in learners:
            sid = (r.get(match) or "").strip()
            w.writerow([r.get(c, "") for c in identity] + [score.get((sid, lid), "") for lid in lessons])
    known = {(r.get(match) or "").strip() for r in learners}
    unmatched = [s for s in students if s not in known]
    ungraded = sorted(k for k in known if not any((k, lid) in score for lid in lessons))
    if unmatched:
        print(f"warning: {len(unmatched)} graded student id(s) not in the roster's {match!r} column, left out: "
              f"{', '.join(unmatched[:20])}", file=sys.stderr)
    if ungraded and roster is not None:
        print(f"note: {len(ungraded)} learner(s) of the roster have no graded submission (blank): "
              f"{', '.join(ungraded[:20])}", file=sys.stderr)
    print(f"wrote {target}: {len(learners)} learner(s), {len(lessons)} assignment column(s) "
          f"({', '.join(columns[lid] for lid in lessons)}); import it in Canvas: Grades > Import", flush=True)
    return target


def _fmt(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".") if x != int(x) else str(int(x))

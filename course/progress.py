"""A learner's progress across lessons: what the self-checks found, kept in one small file.

``course.self_check(...)`` and ``python -m course check`` record a report per lesson here;
``python -m course progress`` shows them, and with ``--run`` checks again every lesson whose
notebook changed since (or was never checked). The file is
``~/.cache/fast-differentiable-pytorch/progress.json``, or ``$COURSE_PROGRESS_FILE``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from course.lessons import catalog
from course.selfcheck import Report, check_notebook, digest

__all__ = ["find_notebook", "load", "record", "store_path", "summary"]


def store_path() -> Path:
    env = os.environ.get("COURSE_PROGRESS_FILE")
    if env:
        return Path(env)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "fast-differentiable-pytorch" / "progress.json"


def load() -> dict[str, Report]:
    path = store_path()
    try:
        data = json.loads(path.read_text())
        return {k: Report.from_dict(v) for k, v in data.get("lessons", {}).items()}
    except FileNotFoundError:
        return {}
    except (ValueError, TypeError, KeyError):
        # A damaged file is not worth an error: the next check writes a good one.
        return {}


def record(report: Report) -> None:
    """Keep the newest report of each lesson (written atomically; a read-only home is fine)."""
    reports = load()
    reports[report.lesson_id] = report
    path = store_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"lessons": {k: v.as_dict() for k, v in sorted(reports.items())}},
                                  indent=1))
        os.replace(tmp, path)
    except OSError:
        pass


def find_notebook(folder: Path, lesson_id: str) -> Path | None:
    """A lesson's notebook under ``folder``: ``<id>/<id>.ipynb``, ``<id>.ipynb``, or the only
    notebook in ``<id>/``."""
    for candidate in (folder / lesson_id / f"{lesson_id}.ipynb", folder / f"{lesson_id}.ipynb"):
        if candidate.is_file():
            return candidate
    sub = folder / lesson_id
    found = sorted(p for p in sub.glob("*.ipynb") if not p.name.startswith(".")) if sub.is_dir() else []
    return found[0] if len(found) == 1 else None


def _state(report: Report | None, notebook: Path | None) -> str:
    if report is None:
        return "not checked yet"
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(report.when))
    how = "in the notebook" if report.how == "self_check" else "python -m course check"
    note = f"checked {when} ({how})"
    if report.how == "check" and report.digest and stale(report, notebook):
        note += ", notebook changed since"
    return note


def stale(report: Report | None, notebook: Path | None) -> bool:
    if notebook is None:
        return False
    if report is None or report.how != "check" or not report.digest:
        return True
    try:
        return digest(json.loads(notebook.read_text(encoding="utf-8"))) != report.digest
    except (OSError, ValueError):
        return True


def summary(folder: Path, *, run: bool = False, cell_timeout: int = 900, details: bool = True) -> str:
    """The progress table; with ``run``, lessons found under ``folder`` whose notebook changed
    since their last check (or never had one) are checked first."""
    reports = load()
    lines, earned, total = [], 0.0, 0.0
    for n, item in enumerate(catalog(), 1):
        lesson_id = item["id"]
        notebook = find_notebook(folder, lesson_id)
        report = reports.get(lesson_id)
        if run and stale(report, notebook):
            print(f"checking {notebook} (runs the whole notebook; lesson {n} takes minutes on a CPU)",
                  flush=True)
            report = check_notebook(notebook, lesson_id=lesson_id, cell_timeout=cell_timeout)
        total += item["points"]
        if report is None:
            lines.append(f"{n}. {item['title']}\n   {'-':>5} of {item['points']} points, "
                         f"{_state(None, notebook)}")
            continue
        earned += report.earned
        lines.append(f"{n}. {item['title']}\n   {report.earned:>5g} of {report.total:g} points, "
                     f"{report.n_passed} of {len(report.results)} exercises pass; "
                     f"{_state(report, notebook)}")
        if details:
            for r in report.results:
                if not r.passed:
                    lines.append(f"       to do: {r.title}")
    head = f"Your progress: {earned:g} of {total:g} points in self-checks ({store_path()})"
    hint = ("Check a lesson: run its last cell, course.self_check(...), or "
            "`python -m course check NOTEBOOK`; `python -m course progress --run` checks every "
            "lesson whose notebook changed.")
    return "\n".join([head, *lines, hint])

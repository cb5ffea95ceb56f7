"""A learner's self-check: which exercises of a lesson pass, before anything is handed in.

Two ways in, one report:

- the cell helper ``course.self_check("01_custom_rnns")``, the last cell of every lesson: runs the
  lesson's visible test cells again against what the notebook's kernel holds now, and prints one
  line per exercise (no Jupyter extension needed, so it works on Colab too);
- the command ``python -m course check NOTEBOOK``: runs a saved notebook top to bottom in a fresh
  kernel and reads each test cell's outcome.

Both record what they found (:mod:`course.progress`), which ``python -m course progress`` shows.
The visible tests come from the released notebooks (``exercises.json``, written by
``python -m autograder release``); the grader runs the same checks again on hidden inputs.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Iterable

from course import cells
from course.grader_hooks import SELF_CHECK_SKIP as SKIP_ENV

__all__ = ["Exercise", "Report", "Result", "check_notebook", "exercises", "exercises_of",
           "self_check"]

#: SKIP_ENV, set (to anything) in processes where the cell helper must not re-run the tests: the
#: grader's sandbox and ``python -m course check``, which read the test cells' own outcomes instead.

_HEADING = re.compile(r"^#{2,4}\s*(Exercise\s+\d+[a-z]?)\b[^:\n]*:?\s*(.*)$", re.MULTILINE)


@dataclass(frozen=True)
class Exercise:
    """One graded test cell of a lesson, as a learner sees it."""

    grade_id: str
    points: float
    title: str
    source: str


@dataclass
class Result:
    grade_id: str
    title: str
    points: float
    status: str  # "pass", "fail", "undecided" (a speed bar a busy machine could not decide) or "not run"
    message: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "pass"


@dataclass
class Report:
    lesson_id: str
    results: list[Result]
    how: str  # "self_check" (in the notebook) or "check" (python -m course check)
    when: float = field(default_factory=time.time)
    notebook: str | None = None
    digest: str | None = None
    seconds: float = 0.0

    @property
    def earned(self) -> float:
        return sum(r.points for r in self.results if r.passed)

    @property
    def total(self) -> float:
        return sum(r.points for r in self.results)

    @property
    def n_passed(self) -> int:
        return sum(r.passed for r in self.results)

    @property
    def complete(self) -> bool:
        return bool(self.results) and self.n_passed == len(self.results)

    def lines(self) -> list[str]:
        title = _lesson_title(self.lesson_id)
        out = [f"Self-check of {title}: {self.n_passed} of {len(self.results)} exercises pass, "
               f"{_pts(self.earned)} of {_pts(self.total)} points."]
        width = max((len(r.title) for r in self.results), default=10)
        for r in self.results:
            mark = {"pass": "pass", "fail": "FAIL", "undecided": "????"}.get(r.status, "----")
            line = f"  {mark}  {r.title:<{width}}  {_pts(r.points):>3} pt"
            if r.message and not r.passed:
                line += f"  {_first_line(r.message)}"
            out.append(line)
        if any(r.status == "undecided" for r in self.results):
            out.append("????: the machine was too busy to tell whether the speedup clears its bar; not a pass "
                       "yet: run that test cell again (close other programs first).")
        if self.complete:
            out.append("All visible checks pass. The grader runs them again on inputs you have "
                       "not seen (other seeds and sizes) and re-measures the speedups.")
        else:
            out.append("Scroll to an exercise's test cell and run it for the whole message.")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Report":
        data = dict(data)
        data["results"] = [Result(**r) for r in data.get("results", [])]
        return cls(**data)


def _pts(x: float) -> str:
    return f"{x:g}"


def _first_line(message: str, limit: int = 110) -> str:
    text = " ".join(message.strip().split("\n", 1)[0].split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _lesson_title(lesson_id: str) -> str:
    from course.lessons import catalog

    for n, item in enumerate(catalog(), 1):
        if item["id"] == lesson_id:
            return f"lesson {n} ({item['title']})"
    return lesson_id


# -- the exercises of a notebook ---------------------------------------------------------------

def exercises_of(notebook: dict) -> list[Exercise]:
    """The graded test cells of a notebook (nbgrader metadata), each titled by the exercise
    heading above it ("Exercise 3: scripted_layer")."""
    found, heading = [], None
    for cell in notebook.get("cells", []):
        source = _text(cell.get("source", ""))
        if cell.get("cell_type") == "markdown":
            for m in _HEADING.finditer(source):
                name = re.sub(r"[`*]", "", m.group(2)).strip()
                heading = f"{m.group(1)}: {name}" if name else m.group(1)
            continue
        if cells.is_test(cell):
            title = heading or cells.grade_id(cell)
            found.append(Exercise(cells.grade_id(cell), cells.points(cell), title, source))
    # Two test cells under one heading: tell them apart.
    titles = [e.title for e in found]
    return [Exercise(e.grade_id, e.points, e.title if titles.count(e.title) == 1
                     else f"{e.title} ({e.grade_id})", e.source) for e in found]


def _text(source: Any) -> str:
    return "".join(source) if isinstance(source, list) else str(source)


@lru_cache(maxsize=1)
def _catalog_exercises() -> dict:
    text = resources.files("course").joinpath("exercises.json").read_text()
    return json.loads(text)


def exercises(lesson_id: str) -> list[Exercise]:
    """The visible test cells of a released lesson, shipped with the package."""
    table = _catalog_exercises()
    if lesson_id not in table:
        known = ", ".join(table)
        raise ValueError(f"No lesson {lesson_id!r} to check; the course has: {known}. "
                         "Pass the lesson's id, as in course.self_check(\"01_custom_rnns\").")
    return [Exercise(**e) for e in table[lesson_id]]


# -- the cell helper ---------------------------------------------------------------------------

def self_check(lesson_id: str, namespace: dict | None = None, *, record: bool = True,
               show: bool = True) -> Report | None:
    """Run the lesson's visible test cells again, in this notebook's namespace, and report
    which exercises pass. Nothing is graded here; the result is recorded for
    ``python -m course progress``."""
    if os.environ.get(SKIP_ENV):
        print("self-check skipped here (this notebook is being graded or checked as a whole).")
        return None
    if namespace is None:
        namespace = sys._getframe(1).f_globals
    items = exercises(lesson_id)
    start = time.perf_counter()
    results = []
    for ex in _progress(items, f"self-check {lesson_id}"):
        results.append(_run_test(ex, namespace))
    report = Report(lesson_id, results, how="self_check", seconds=time.perf_counter() - start)
    if record:
        from course import progress

        progress.record(report)
    if show:
        print(report)
    return report


def _progress(items: list, desc: str, unit: str = "exercise") -> Iterable:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return items
    return tqdm(items, desc=desc, unit=unit, leave=False)


def _run_test(ex: Exercise, namespace: dict) -> Result:
    """Run one test cell's code; its chatter and its plots are kept out of the report."""
    figures = _open_figures()
    sink = io.StringIO()
    try:
        code = compile(ex.source, f"<test cell {ex.grade_id}>", "exec")
        with contextlib.redirect_stdout(sink):
            exec(code, namespace)
        return Result(ex.grade_id, ex.title, ex.points, "pass")
    except NameError as exc:
        name = getattr(exc, "name", None) or str(exc)
        return Result(ex.grade_id, ex.title, ex.points, "not run",
                      f"`{name}` does not exist yet: write the cell that defines it (the exercise's "
                      "cell, or one above it) and run it, or use Run > Run All Cells Above.")
    except Exception as exc:  # noqa: BLE001 - a learner's failure is reported, never raised
        if type(exc).__name__ == "SpeedUndecided":
            return Result(ex.grade_id, ex.title, ex.points, "undecided", str(exc))
        return Result(ex.grade_id, ex.title, ex.points, "fail", f"{type(exc).__name__}: {exc}"
                      if not isinstance(exc, AssertionError) else str(exc))
    finally:
        _close_new_figures(figures)


def _open_figures() -> set | None:
    plt = sys.modules.get("matplotlib.pyplot")
    return set(plt.get_fignums()) if plt else None


def _close_new_figures(before: set | None) -> None:
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    for num in set(plt.get_fignums()) - (before or set()):
        plt.close(num)


# -- the command: a saved notebook in a fresh kernel -------------------------------------------

def check_notebook(path: str | Path, *, lesson_id: str | None = None, cell_timeout: int = 900,
                   record: bool = True, kernel_name: str = "python3") -> Report:
    """Run a saved notebook top to bottom in a fresh kernel (errors do not stop it) and report
    each graded test cell's outcome."""
    path = Path(path)
    try:
        notebook = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"Could not read {path} as a notebook ({exc}). Expected the .ipynb "
                         "file of a lesson, as in lessons/01_custom_rnns/01_custom_rnns.ipynb.")
    lesson_id = lesson_id or lesson_of(path, notebook)
    items = {e.grade_id: e for e in exercises_of(notebook)}
    if not items:
        raise ValueError(f"{path} has no graded test cells (nbgrader metadata): is it a lesson "
                         "notebook? Its test cells may have been deleted; take a fresh copy of "
                         "the lesson and paste your solutions in.")
    try:
        import nbformat
        from nbclient import NotebookClient
    except ImportError as exc:
        raise RuntimeError("`python -m course check` runs notebooks with nbclient, which is not "
                           f"installed ({exc}). Install it with: pip install nbclient ipykernel, "
                           "or use course.self_check(...) in the notebook instead.") from None

    nb = nbformat.reads(json.dumps(notebook), as_version=4)
    extra = {}
    if os.name == "posix":  # local socket files, not TCP (ipykernel warns about plain TCP)
        from traitlets.config import Config

        runtime = tempfile.mkdtemp(prefix="course-check-")
        extra["config"] = Config({"KernelManager": {"transport": "ipc",
                                                    "ip": os.path.join(runtime, "kernel")}})
    client = NotebookClient(nb, timeout=cell_timeout, kernel_name=kernel_name, allow_errors=True,
                            resources={"metadata": {"path": str(path.parent.resolve())}}, **extra)
    start = time.perf_counter()
    failure = None
    try:
        with _env(**{SKIP_ENV: "1", "MPLBACKEND": "Agg"}):
            _execute(client)
    except Exception as exc:  # noqa: BLE001 - a dead kernel or a cell over its time limit
        failure = exc
    finally:
        if "config" in extra:
            shutil.rmtree(runtime, ignore_errors=True)
    if failure is not None and not any(c.get("execution_count") for c in nb.cells
                                       if c.cell_type == "code"):
        raise RuntimeError(f"could not run {path} in a Python kernel ({type(failure).__name__}: "
                           f"{failure}). Is ipykernel installed here? Try: pip install ipykernel")
    results = []
    for cell in nb.cells:
        grade_id = cells.grade_id(cell)
        if grade_id in items:
            results.append(_outcome(items[grade_id], cell))
    report = Report(lesson_id, results, how="check", notebook=str(path.resolve()),
                    digest=digest(notebook), seconds=time.perf_counter() - start)
    if record:
        from course import progress

        progress.record(report)
    return report


def _execute(client: Any) -> None:
    """Execute cell by cell with a progress bar (nbclient runs them all when given none)."""
    with client.setup_kernel():
        for index, cell in enumerate(_progress(client.nb.cells, "running", "cell")):
            if cell.cell_type == "code":
                client.execute_cell(cell, index)


def _outcome(ex: Exercise, cell: Any) -> Result:
    if cell.get("execution_count") is None and not cell.get("outputs"):
        return Result(ex.grade_id, ex.title, ex.points, "not run",
                      "the notebook stopped before this cell (time limit or a crash above)")
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            message = f"{out.get('ename')}: {out.get('evalue')}"
            if out.get("ename") == "AssertionError":
                message = out.get("evalue") or message
            if out.get("ename") == "NameError":
                message += " (defined in a cell above that failed or was not run)"
            if out.get("ename") == "SpeedUndecided":
                return Result(ex.grade_id, ex.title, ex.points, "undecided", out.get("evalue") or message)
            return Result(ex.grade_id, ex.title, ex.points, "fail", message)
    return Result(ex.grade_id, ex.title, ex.points, "pass")


@contextlib.contextmanager
def _env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def digest(notebook: dict) -> str:
    """A digest of a notebook's code: it changes when the learner edits code, not when outputs
    or metadata change."""
    import hashlib

    h = hashlib.sha256()
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") == "code":
            h.update(_text(cell.get("source", "")).encode())
            h.update(b"\0")
    return h.hexdigest()[:16]


def lesson_of(path: Path, notebook: dict | None = None) -> str:
    """The lesson id of a notebook, from its file name (``01_custom_rnns.ipynb``) or folder."""
    from course.lessons import catalog

    ids = [item["id"] for item in catalog()]
    for name in (path.stem, path.parent.name):
        for lesson_id in ids:
            if name == lesson_id or name.startswith(lesson_id):
                return lesson_id
    raise ValueError(f"Which lesson is {path.name}? Expected a file or folder named after a "
                     f"lesson ({', '.join(ids)}); rename it, or pass --lesson.")

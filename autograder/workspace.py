"""The nbgrader course root that every run builds inside the work folder.

nbgrader wants one folder holding ``nbgrader_config.py``, the source notebooks, the
release, the submissions, the gradebook and its logs. Building that folder under
``--work`` (``.autograder/`` by default, git-ignored) keeps all of it out of the
repository. Layout::

    WORK/
      nbgrader_config.py     autograder/nbgrader_config.py + this run's settings
      jupyter/kernels/python3/kernel.json   the kernel: this interpreter
      solutions/<lesson>/    staged copy of the source notebooks (ids normalised)
      lessons/<lesson>/      nbgrader's student versions
      submitted/<student>/<lesson>/    the vetted bytes of what was graded (under the lesson's name)
      autograded/<student>/<lesson>/   the graded program with each cell's output, for instructors
      trusted/               the instructor runs' transcripts, per lesson and grading code
      results/<student>/     each submission's decided row, keyed by its bytes (re-runs resume)
      flags/                 what each flagged submission tried, in detail
      logs/...               nbgrader calls, sandbox runs (logs/runs/), grader errors (logs/errors/)
      gradebook.db           default gradebook (``--db`` overrides it); it also keeps the class's
                             seed key, the secret the hidden tests' seeds are drawn from

The learners' feedback pages are written to ``OUT/feedback/``, not here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

from course import cells as nbcells

from . import NBGRADER_CONFIG, UsageError
from .runner import RunResult, run_limited

#: Files and folders never copied from a course or submission folder.
IGNORED_NAMES = {".ipynb_checkpoints", "__pycache__", ".DS_Store", ".git"}

#: nbgrader's course id: PostgreSQL enforces the gradebook's foreign keys to it.
COURSE_ID = "default_course"

_CELL_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def lesson_ids(solutions: Path) -> list[str]:
    """The lessons of a course: folders of ``solutions`` holding at least one notebook."""
    if not solutions.is_dir():
        raise UsageError(
            f"expected a folder of nbgrader source notebooks at {solutions}, but it does "
            "not exist; pass --solutions DIR pointing at the folder that holds "
            "<lesson_id>/<lesson_id>.ipynb")
    return sorted(p.name for p in solutions.iterdir()
                  if p.is_dir() and not p.name.startswith(".") and notebooks_in(p))


def select_lessons(solutions: Path, lesson: str | None) -> list[str]:
    """The lessons to work on: all of them, or the one named by ``--lesson``."""
    known = lesson_ids(solutions)
    if lesson is None:
        if not known:
            raise UsageError(
                f"expected lesson folders with notebooks in {solutions}, found none; "
                "check --solutions")
        return known
    if lesson not in known:
        raise UsageError(
            f"--lesson {lesson!r} has no source notebook: expected "
            f"{solutions / lesson / (lesson + '.ipynb')}; known lessons: "
            f"{', '.join(known) or '(none)'}")
    return [lesson]


def notebooks_in(folder: Path) -> list[Path]:
    """The notebooks directly inside ``folder``, hidden ones excluded, sorted by name."""
    return sorted(p for p in folder.glob("*.ipynb")
                  if p.is_file() and not p.name.startswith("."))


def copy_tree(src: Path, dest: Path) -> None:
    """Replace ``dest`` by a copy of ``src``, without checkpoints or caches.

    Only contents are copied, not permission bits: nbgrader marks its outputs read-only.
    """
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest, copy_function=shutil.copyfile,
                    ignore=lambda _dir, names: [n for n in names if n in IGNORED_NAMES])


class Workspace:
    """One nbgrader course root in ``root`` using the gradebook at ``db_url``."""

    def __init__(self, root: Path, db_url: str | None = None, cell_timeout: int = 600):
        self.root = root.resolve()
        self.db_url = _driver(db_url) if db_url else f"sqlite:///{self.root / 'gradebook.db'}"
        self.cell_timeout = cell_timeout
        self.root.mkdir(parents=True, exist_ok=True)
        self._write_config()
        self._write_kernelspec()

    # -- set-up -------------------------------------------------------------------------

    def _write_config(self) -> None:
        base = NBGRADER_CONFIG.read_text(encoding="utf-8")
        run = (
            "\n# --- this run (written by python -m autograder) ---\n"
            f"c.CourseDirectory.root = {str(self.root)!r}\n"
            f"c.CourseDirectory.db_url = {self.db_url!r}\n"
            f"c.CourseDirectory.course_id = {COURSE_ID!r}\n"
            f"c.Execute.timeout = {int(self.cell_timeout)}\n"
            "# Always run the kernelspec of jupyter/kernels/python3: the grading interpreter.\n"
            "c.Execute.kernel_name = 'python3'\n"
        )
        atomic_write(self.root / "nbgrader_config.py", base + run)

    def _write_kernelspec(self) -> None:
        """A ``python3`` kernelspec that runs this interpreter, found first via JUPYTER_PATH.

        Without it, ``python3`` resolves to whatever kernelspec the machine has first
        (a user-wide one may point at another Python).
        """
        spec_dir = self.root / "jupyter" / "kernels" / "python3"
        spec_dir.mkdir(parents=True, exist_ok=True)
        spec = {
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (autograder)",
            "language": "python",
            "metadata": {"debugger": False},
        }
        atomic_write(spec_dir / "kernel.json", json.dumps(spec, indent=1) + "\n")

    def env(self) -> dict[str, str]:
        """The environment of nbgrader calls: our kernelspec first, no user config."""
        env = dict(os.environ)
        # nbgrader runs the ``alembic`` command when it creates a gradebook: it must come
        # from this environment even when the venv is not activated.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        env["JUPYTER_PATH"] = os.pathsep.join(
            [str(self.root / "jupyter")] + [p for p in env.get("JUPYTER_PATH", "").split(os.pathsep) if p])
        env["JUPYTER_CONFIG_DIR"] = str(self.root / "jupyter" / "config")
        env["IPYTHONDIR"] = str(self.root / "jupyter" / "ipython")
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("MPLBACKEND", "Agg")
        env.pop("PYTHONSTARTUP", None)
        return env

    # -- folders --------------------------------------------------------------------------

    def source(self, lesson: str) -> Path:
        return self.root / "solutions" / lesson

    def release(self, lesson: str) -> Path:
        return self.root / "lessons" / lesson

    def submitted(self, student: str, lesson: str) -> Path:
        return self.root / "submitted" / student / lesson

    def autograded(self, student: str, lesson: str) -> Path:
        return self.root / "autograded" / student / lesson

    def feedback(self, student: str, lesson: str) -> Path:
        return self.root / "feedback" / student / lesson

    def log(self, *parts: str) -> Path:
        return self.root.joinpath("logs", *parts)

    def stage_source(self, solutions: Path, lesson: str) -> None:
        """Copy ``solutions/<lesson>`` into the course root and give every cell a stable id.

        Cells without an id (notebooks older than nbformat 4.5, or written by tools that
        omit them) would otherwise get random ids from nbformat, and the student versions
        would change on every release.
        """
        dest = self.source(lesson)
        copy_tree(solutions / lesson, dest)
        for path in notebooks_in(dest):
            normalise_cell_ids(path)

    # -- nbgrader -------------------------------------------------------------------------

    def nbgrader(self, args: list[str], *, log: Path, timeout: float) -> RunResult:
        """Run ``python -m nbgrader ARGS`` in the course root with this interpreter.

        Through ``autograder.nbgrader_cli``, which is nbgrader's own entry point with a
        slow optional import skipped.
        """
        cmd = [sys.executable, "-m", "autograder.nbgrader_cli", *args]
        return run_limited(cmd, cwd=self.root, env=self.env(), timeout=timeout, log=log)


def atomic_write(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: shards sharing a work folder read it meanwhile."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _driver(url: str) -> str:
    """``postgresql://`` names no driver, and SQLAlchemy 2.1 then wants psycopg 3; the course
    pins psycopg2, so use it unless the URL names a driver or psycopg 3 is installed."""
    if url.startswith(("postgresql://", "postgres://")):
        import importlib.util

        if importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is not None:
            return "postgresql+psycopg2://" + url.split("://", 1)[1]
    return url


def normalise_cell_ids(path: Path) -> None:
    """Give cells without an id a deterministic one (grade id, else ``cell-<index>``)."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    cells = nb.get("cells", [])
    if all("id" in cell for cell in cells) and nb.get("nbformat_minor", 0) >= 5:
        return
    taken = {cell["id"] for cell in cells if "id" in cell}
    for index, cell in enumerate(cells):
        if "id" in cell:
            continue
        grade_id = nbcells.grade_id(cell)
        candidate = grade_id if _CELL_ID.match(grade_id or "") else f"cell-{index}"
        while candidate in taken:
            candidate = f"{candidate[:56]}-{index}"
        cell["id"] = candidate
        taken.add(candidate)
    if nb.get("nbformat") == 4:
        nb["nbformat_minor"] = max(nb.get("nbformat_minor", 0), 5)
    path.write_text(json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n",
                    encoding="utf-8")


def last_error(log: Path, limit: int = 300) -> str:
    """The most telling line of an nbgrader log, for the ``detail`` column and messages.

    That is the last exception line of a traceback (``SomeError: why``) when there is one,
    else the last ERROR line, else the last line.
    """
    try:
        lines = [l.strip() for l in log.read_text(encoding="utf-8", errors="replace").splitlines()]
    except OSError:
        return ""
    lines = [l for l in lines if l]
    exception = [l for l in lines if _EXCEPTION_LINE.match(l)]
    errors = [l for l in lines if "| ERROR]" in l]
    picked = (exception or errors or lines or [""])[-1]
    return picked[:limit]


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b:?")

"""The learner's part of an instructor notebook, as importable Python.

Tests and benchmarks use the instructor's own solutions (the code of the nbgrader solution cells,
with the imports of the notebook's first code cell after the Colab set-up cell), so that they measure and check exactly what
the notebook teaches, and follow it when it changes.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

from course import cells

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["load_solution", "solved_notebook", "solution_source"]


def solution_source(lesson_id: str, solutions: Path | None = None) -> str:
    path = (solutions or ROOT / "solutions") / lesson_id / f"{lesson_id}.ipynb"
    if not path.exists():
        raise FileNotFoundError(f"No instructor notebook at {path}; expected solutions/<id>/<id>.ipynb.")
    nb = json.loads(path.read_text())
    # Code cells, less the Colab set-up cell (a no-op where the course is installed).
    code = [c for c in nb["cells"] if c["cell_type"] == "code"
            and "course-setup" not in c.get("metadata", {}).get("tags", [])]
    setup = "".join(code[0]["source"])
    parts = ["\n".join(line for line in setup.splitlines() if not line.startswith("report ="))]
    parts += [cells.source(c) for c in code if cells.is_solution(c)]
    return "\n\n".join(parts) + "\n"


def load_solution(source: str, path: Path, name: str) -> ModuleType:
    """Import ``source`` from a real file (TorchScript reads functions' source from disk)."""
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def solved_notebook(lesson_id: str, root: Path | None = None) -> dict:
    """A learner's notebook with every exercise done: the student version of a lesson, each
    solution cell holding the instructor's code (the nbgrader markers dropped). What a learner
    who finished the lesson would have; the browser, Colab and self-check tests run it."""
    root = root or ROOT
    student = json.loads((root / "lessons" / lesson_id / f"{lesson_id}.ipynb").read_text())
    source = json.loads((root / "solutions" / lesson_id / f"{lesson_id}.ipynb").read_text())
    answers = {}
    for cell in source["cells"]:
        if cells.is_solution(cell):
            lines = cells.source(cell).splitlines()
            answers[cells.grade_id(cell)] = "\n".join(
                line for line in lines if line.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION"))
    for cell in student["cells"]:
        gid = cells.grade_id(cell)
        if gid in answers:
            cell["source"] = answers[gid]
    return student

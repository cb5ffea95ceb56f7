"""The learner's part of an instructor notebook, as importable Python.

Tests and benchmarks use the instructor's own solutions (the code of the nbgrader solution cells,
with the imports of the notebook's first code cell), so that they measure and check exactly what
the notebook teaches, and follow it when it changes.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["load_solution", "solution_source"]


def solution_source(lesson_id: str, solutions: Path | None = None) -> str:
    path = (solutions or ROOT / "solutions") / lesson_id / f"{lesson_id}.ipynb"
    if not path.exists():
        raise FileNotFoundError(f"No instructor notebook at {path}; expected solutions/<id>/<id>.ipynb.")
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    setup = "".join(code[0]["source"])
    parts = ["\n".join(line for line in setup.splitlines() if not line.startswith("report ="))]
    parts += ["".join(c["source"]) for c in code if c.get("metadata", {}).get("nbgrader", {}).get("solution")]
    return "\n\n".join(parts) + "\n"


def load_solution(source: str, path: Path, name: str) -> ModuleType:
    """Import ``source`` from a real file (TorchScript reads functions' source from disk)."""
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

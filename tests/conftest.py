"""Shared test fixtures: the repository's paths and the lesson notebooks' solution code."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "solutions"
LESSONS = ROOT / "lessons"


def solution_source(lesson_id: str) -> str:
    """The code of every nbgrader solution cell of a lesson's instructor notebook, in order,
    with the imports of its first code cell: the learner's part, ready to import."""
    nb = json.loads((SOLUTIONS / lesson_id / f"{lesson_id}.ipynb").read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    setup = "".join(code[0]["source"])
    setup = "\n".join(line for line in setup.splitlines() if not line.startswith("report ="))
    parts = [setup]
    for c in code:
        if c.get("metadata", {}).get("nbgrader", {}).get("solution"):
            parts.append("".join(c["source"]))
    return "\n\n".join(parts) + "\n"


def load_module(source: str, path: Path, name: str):
    """Import ``source`` from a real file (TorchScript needs the source on disk)."""
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def rnn_solution(tmp_path_factory):
    """Lesson 1's instructor solutions as a module (``compiled_layer`` left out: tests compile
    what they need)."""
    src = solution_source("01_custom_rnns").replace(
        "compiled_layer = torch.compile(fast_lstm_layer)", "compiled_layer = None")
    return load_module(src, tmp_path_factory.mktemp("sol") / "rnn_solution.py", "rnn_solution")


@pytest.fixture(scope="session")
def mutate(tmp_path_factory):
    """``mutate(old, new)``: lesson 1's solutions with one planted mistake, as a module."""
    base = solution_source("01_custom_rnns").replace(
        "compiled_layer = torch.compile(fast_lstm_layer)", "compiled_layer = None")
    counter = iter(range(10**6))

    def make(old: str, new: str):
        assert old in base, f"the planted mistake's anchor is not in the solution: {old!r}"
        name = f"rnn_mutant_{next(counter)}"
        return load_module(base.replace(old, new), tmp_path_factory.mktemp("mut") / f"{name}.py", name)

    return make

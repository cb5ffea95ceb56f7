"""Shared test fixtures: the repository's paths and the lesson notebooks' solution code."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib
import pytest

from autograder.solution_code import load_solution as load_module, solution_source

matplotlib.use("Agg")

# A test suite run inside a job array or a parallel CI job must not grade a shard of its toy
# classes: the engines' shard variables are not the tests' (tests that want them set their own).
for _name in ("COURSE_SHARD", "COURSE_SHARDS", "SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX", "CI_NODE_INDEX"):
    os.environ.pop(_name, None)

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "solutions"
LESSONS = ROOT / "lessons"


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


@pytest.fixture
def learners_copy(monkeypatch):
    """The checks as a learner's copy of the course runs them (the bundle, or the learner's process
    under the grader): ``course.references`` and every module in it cannot be imported, so each
    check falls back on the stored answers, and any use of a reference on its way fails."""
    import pkgutil
    import sys

    import course.references as R
    from course.checks.common import grader_references

    hidden = {"course.references", *(f"course.references.{m.name}" for m in pkgutil.iter_modules(R.__path__))}
    for name in hidden | {n for n in sys.modules if n.startswith("course.references.")}:
        monkeypatch.setitem(sys.modules, name, None)
    assert all(grader_references(name.rpartition(".")[2]) is None for name in hidden - {"course.references"})


@pytest.fixture
def program_host(monkeypatch):
    """The judge's hook to a program host served from a thread (the grader's is a confined process)."""
    from course import grader_hooks
    from course.remote import serve_in_thread

    with serve_in_thread({}, host=True) as link:
        monkeypatch.setattr(grader_hooks, "program_host", lambda: link)
        yield link

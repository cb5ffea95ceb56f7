"""The course's own solution timed beside the learner's (``served_speedup``'s witness).

Whether a speed ratio is implausibly high was judged against the instructor solution's ratio,
measured earlier in the same grading run. Over a slow, memory-bound baseline such a ratio moves
with the machine's load: CI graded the instructor's own lesson 7 notebook at "at least 37.23x",
more than three times the 10.96x its transcript held, and took its point. Under the grader, every
served speed check now times the course's solution in the same rounds, and the parent judges the
candidate's ratio over that (``autograder.verdict``), which load moves far less.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import course.checks as checks_package
from autograder.program import TEST, Cell, Program
from autograder.sandbox import CellReport, Outcome
from autograder.solution_code import load_solution, solution_source
from autograder.verdict import IMPLAUSIBLE, Transcript, judge
from course import grader_hooks
from course.checks import broadcasting as C
from course.checks.common import WITNESS
from course.checks.why_slow import course_solution

GENEROUS = {"cpu": 0.01, "cuda": 0.01}
SIZES = dict(n=192, m=192, d=32, num_threads=1, rounds=9, min_run_time=0.02, attempts=1)


def _served_speedup_calls():
    """(module, explain) of every ``served_speedup(...)`` call in the checks modules."""
    for path in sorted(Path(checks_package.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "served_speedup":
                explain = next((k.value for k in node.keywords if k.arg == "explain"), None)
                yield path.stem, (explain.value if isinstance(explain, ast.Constant) else explain)


def test_every_served_speed_check_names_a_course_solution_the_grader_can_time():
    calls = list(_served_speedup_calls())
    assert len(calls) >= 9, calls  # lessons 3, 4, 6, 7 (three), 8 and 9 (two)
    for module, explain in calls:
        assert isinstance(explain, str), f"{module}: served_speedup without a course solution to time beside it"
        assert callable(course_solution(explain)), (module, explain)


@pytest.fixture(scope="module")
def sol(tmp_path_factory):
    return load_solution(solution_source("07_broadcasting_indexing_higher_order"),
                         tmp_path_factory.mktemp("witness") / "witness_solution.py", "witness_solution")


@pytest.fixture
def records(monkeypatch):
    seen = []
    monkeypatch.setattr(grader_hooks, "observer", lambda actual, expected, tol: seen.append(
        {"name": tol["name"], "actual": actual, "expected": expected, "tol": tol}))
    return seen


def test_outside_the_grader_and_in_a_learners_copy_nothing_else_is_timed(sol, records, monkeypatch, learners_copy):
    assert C.check_distance_speed(sol.pairwise_sq_dists, bars=GENEROUS, **SIZES).witness is None
    assert records and "witness" not in records[-1]["tol"]
    monkeypatch.setattr(grader_hooks, "observer", None)
    assert C.check_distance_speed(sol.pairwise_sq_dists, bars=GENEROUS, **SIZES).names == ["broadcast", "yours"]


def _served(records_of_a_run):
    program = Program("l", "l.ipynb", [Cell(0, "s", "solution", "x = 1", "sol"),
                                       Cell(1, "t", TEST, "check(x)", "distance_speed", 1.0, served=True)])
    outcome = Outcome("ok", {0: CellReport(0, finished=True),
                             1: CellReport(1, records=records_of_a_run, finished=True)}, [], 1.0, 10.0)
    return program, outcome


def test_a_baseline_slowed_by_load_moves_the_ratio_but_not_the_ratio_over_the_witness(sol, records, monkeypatch):
    """The instructor's run on a quiet machine, then the same solution while something slows the
    broadcast baseline 24 times over (as a process that takes the cache slows a memory-bound
    one): the ratio over the baseline jumps past three times the instructor's, the ratio over the
    course's solution, timed in the same rounds, stays near 1, and the parent credits the cell."""
    report = C.check_distance_speed(sol.pairwise_sq_dists, bars=GENEROUS, **SIZES)
    assert report.witness == WITNESS and set(report.names) == {"broadcast", "yours", WITNESS}
    quiet = list(records)
    naive = C.naive_sq_dists
    # 24 times over: the premise (the cross-time check would flag it) must hold however noisy the
    # rounds; at 8 times, a busy machine's lower bound came out under 3x the quiet one's (1 run in 3)
    monkeypatch.setattr(C, "naive_sq_dists", lambda a, b: [naive(a, b) for _ in range(24)][-1])
    records.clear()
    C.check_distance_speed(sol.pairwise_sq_dists, bars=GENEROUS, **SIZES)
    loaded = list(records)
    assert loaded[-1]["actual"] > IMPLAUSIBLE * quiet[-1]["actual"]  # the cross-time check would flag it
    assert loaded[-1]["tol"]["witness"] < IMPLAUSIBLE

    program, outcome = _served(quiet)
    transcript = Transcript.from_outcome(program, outcome)
    program, outcome = _served(loaded)
    verdict = judge(program, outcome, transcript)[0]
    assert verdict.points == 1.0 and not program.flags, verdict.message

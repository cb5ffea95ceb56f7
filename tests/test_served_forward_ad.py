"""Lesson 4's checks across the judge/learner boundary: the learner's classes (a Dual, an
``autograd.Function``) and functions are exercised by the course's probes on the learner's side,
models and wide functions cross as recipes, every value comes back as data and is compared with
the judge's references, and the speed check is the judge's clock against ``torch.func.jacrev``.
Every planted mistake of the in-process tests fails across the boundary with the same cause."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from autograder import program as prog
from autograder.solution_code import load_solution, solution_source
from course import remote, wire
from course.checks import forward_ad as C
from course.forward_ad import mlp, wide_function
from served_helpers import served, untouched
from test_checks_forward_ad import MISTAKES

ROOT = Path(__file__).resolve().parents[1]
LESSON = "04_forward_ad"
SPEED = dict(k=4, m=2048, hidden=128, threads=1, rounds=5, min_run_time=0.05)
NAMES = ("Dual", "param_jvp", "param_jvp_func", "Sinc", "jacobian_fwd", "jacobian_rev", "tall_jacobian")


@pytest.fixture(scope="module")
def source():
    return solution_source(LESSON)


@pytest.fixture(scope="module")
def solution(source, tmp_path_factory):
    return load_solution(source, tmp_path_factory.mktemp("served4") / "fad_served.py", "fad_served")


def namespace(module) -> dict:
    return {n: getattr(module, n) for n in NAMES}


@pytest.fixture
def learner(solution):
    yield from served(namespace(solution))


def run(kind: str, learner) -> None:
    if kind == "dual":
        C.check_dual(learner("Dual"))
    elif kind == "param_jvp":
        C.check_param_jvp(learner("param_jvp"), seed=3, sizes=(4, 8, 3), norm=False, subset=True, batch=1)
    elif kind == "param_jvp_func":
        C.check_param_jvp_func(learner("param_jvp_func"))
    elif kind == "sinc":
        C.check_sinc(learner("Sinc"))
    elif kind == "jacobians":
        C.check_jacobians(learner("jacobian_fwd"), learner("jacobian_rev"))


def test_the_models_and_functions_cross_as_recipes():
    model, f = mlp((3, 5, 2), seed=4), wide_function(3, 6, 4, seed=1, mode="forward", dtype=torch.float64)
    built_model, built_f = remote.build(wire.decode(wire.encode([model, f])))
    x = torch.randn(2, 3, dtype=torch.float64)
    assert torch.equal(built_model(x), model(x)) and built_f.mode == "forward"
    assert torch.equal(built_f(x[0]), f(x[0]))


def test_right_answers_pass_every_served_check(learner, capsys):
    for kind in ("dual", "param_jvp", "param_jvp_func", "sinc", "jacobians"):
        run(kind, learner)
    assert capsys.readouterr().out.count("ok:") == 5


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_each_planted_mistake_fails_across_the_boundary_with_its_cause(mistake, source, tmp_path):
    kind, old, new, says = MISTAKES[mistake]
    name = f"fad_served_mutant_{abs(hash(mistake))}"
    module = load_solution(source.replace(old, new), tmp_path / f"{name}.py", name)
    for learner in served(namespace(module)):
        with pytest.raises(AssertionError, match=re.compile(says, re.S)):
            run(kind, learner)


def test_an_unwritten_or_missing_answer_fails_with_a_friendly_message(source, tmp_path):
    stubbed = untouched(source)
    module = load_solution(stubbed, tmp_path / "fad_served_stub.py", "fad_served_stub")
    for learner in served(namespace(module)):
        for kind in ("dual", "param_jvp", "param_jvp_func", "sinc", "jacobians"):
            with pytest.raises(AssertionError, match="not written yet"):
                run(kind, learner)
    for learner in served({}):
        with pytest.raises(AssertionError, match="Sinc is not defined in your notebook"):
            C.check_sinc(learner("Sinc"))


def test_only_registered_probes_run_on_the_learners_side(learner):
    with pytest.raises(ValueError, match="not a registered probe"):
        remote.probe(learner("Dual"), lambda Dual: Dual)
    with pytest.raises(ValueError, match="no probe named"):
        learner("Dual")._link.request({"op": "probe", "name": "Dual", "probe": "os.system", "args": ["true"]})


def test_the_speed_check_times_the_answer_across_the_boundary_against_jacrev(learner, solution, monkeypatch):
    """As the notebook calls it, with the learner's jacobian_rev, which the judge (it has the grader's
    references) leaves alone: its baseline is its own torch.func.jacrev. Reverse mode twice fails on its
    mode before any clock (version 60), and on the clock when that gate is left out."""
    report = C.check_jacobian_speed(learner("tall_jacobian"), learner("jacobian_rev"), bars={"cpu": 1.5}, **SPEED)
    assert report.speedup("your tall_jacobian").bound >= 1.5
    twice_reverse = "slow_fwd"
    slow = {**namespace(solution), twice_reverse: lambda f, x: (solution.jacobian_rev(f, x),
                                                                solution.jacobian_rev(f, x))[1]}
    for other in served(slow):
        with pytest.raises(AssertionError, match="tall_jacobian differentiated f by reverse mode"):
            C.check_jacobian_speed(other(twice_reverse), bars={"cpu": 1.5}, attempts=1, **SPEED)
        monkeypatch.setattr(C, "_tall_structure", lambda *a, **k: None)
        with pytest.raises(AssertionError, match="the bar on this device is 1.50x"):
            C.check_jacobian_speed(other(twice_reverse), bars={"cpu": 1.5}, attempts=1, **SPEED)


def test_lesson_4_routes_every_graded_cell_to_the_judge():
    program = prog.instructor_program(LESSON, ROOT / f"solutions/{LESSON}/{LESSON}.ipynb")
    assert program.graded and all(c.served for c in program.graded), [c.grade_id for c in program.graded
                                                                      if not c.served]
    setup = "\n".join(program.judge_setup)
    assert "from course.checks.forward_ad import" in setup and "S = course.sizes(" in setup

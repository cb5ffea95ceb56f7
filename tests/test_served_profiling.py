"""Lesson 8's checks across the judge/learner boundary: traces and programs cross as data, the
instructor's solutions pass, stubs fail with the usual message, the course's references refuse to
serve as answers, and a failed speed check explains itself from a profile taken where the learner's
code lives (by the course's probe)."""

from __future__ import annotations

from pathlib import Path

import pytest

import course.grader_hooks as hooks
from autograder import program as prog
from autograder.solution_code import load_solution, solution_source
from course.checks.profiling import (SERVED, check_attention, check_attention_speed, check_find_races,
                                     check_op_table, check_ops_diff)
from course.profiling import naive_attention
from served_helpers import UNDECIDED, expect_refused, never_failed, served

ROOT = Path(__file__).resolve().parents[1]
LESSON = "08_profiling_trace_diff"
ANSWERS = ("op_table", "ops_diff", "attention", "find_races")
# causal at 1,024 tokens: the fused kernel skips the masked blocks (2.4x naive here, one thread, steady C memory)
SMALL = dict(batch=1, heads=4, length=1024, dim=64, num_threads=1, rounds=5, min_run_time=0.05, attempts=1)


def stub(*args, **kwargs):
    raise NotImplementedError()


def borrowed_op_table(trace, iteration=None):
    from course.references.traces import op_table  # the grader's alone: hidden from the learner's sandbox too
    return op_table(trace, iteration, rounding=False)


def borrowed_ops_diff(control, test):
    import course.references.traces as t
    return t.ops_diff(control, test, rounding=False)


def borrowed_races(program):
    from course.streams import sanitizer_races
    return sanitizer_races(program)


def borrowed_clock(program):
    from course.references import streams  # the grader's alone: hidden from the learner's sandbox too
    return streams.find_races(program)


def slow_attention(q, k, v, causal=False):
    return naive_attention(q, k, v, causal)


@pytest.fixture(scope="module")
def sol(tmp_path_factory):
    return load_solution(solution_source(LESSON), tmp_path_factory.mktemp("sol8s") / "served_profiling.py",
                         "served_profiling_solution")


@pytest.fixture
def learner(sol):
    yield from served({**{name: getattr(sol, name) for name in ANSWERS}, "stub": stub,
                       "borrowed_op_table": borrowed_op_table, "borrowed_ops_diff": borrowed_ops_diff,
                       "borrowed_races": borrowed_races, "borrowed_clock": borrowed_clock,
                       "slow_attention": slow_attention})


def test_right_answers_pass_every_served_check(learner, capsys):
    check_op_table(learner("op_table"))
    check_ops_diff(learner("ops_diff"))
    check_attention(learner("attention"))
    check_find_races(learner("find_races"), n=60)
    out = capsys.readouterr().out
    assert out.count("ok:") == 4, out


def test_the_served_solution_passes_the_speed_check(learner):
    # The lesson's CPU bar is 1.5x at its own sizes; at these small ones a busy CI machine measured 1.49x
    # (1.07x-2.00x): a bar below that tests the served path, not the machine's noise.
    # A busy machine may leave it undecided (never a pass); a decided miss fails.
    report = never_failed(lambda: check_attention_speed(learner("attention"), bars={"cpu": 1.2, "cuda": 1.2}, **SMALL))
    assert report is UNDECIDED or report.names == ["naive", "yours"]


def test_a_slow_answer_fails_and_the_explanation_comes_from_a_profile_on_the_learners_side(learner):
    with pytest.raises(AssertionError) as exc:
        check_attention_speed(learner("slow_attention"), bars={"cpu": 2.0, "cuda": 2.0}, **SMALL)
    text = str(exc.value)
    assert "What the profiler saw" in text and "_scaled_dot_product_flash_attention_for_cpu ran" in text, text


@pytest.mark.parametrize("check", [check_op_table, check_ops_diff, check_attention, check_find_races])
def test_unwritten_answers_fail_with_a_friendly_message_across_the_boundary(learner, check):
    with pytest.raises(AssertionError, match="not written yet"):
        check(learner("stub"))


@pytest.mark.parametrize("check, name", [(check_op_table, "borrowed_op_table"), (check_ops_diff, "borrowed_ops_diff"),
                                         (check_find_races, "borrowed_races"), (check_find_races, "borrowed_clock")])
def test_the_course_references_refuse_to_answer_under_the_grader(learner, monkeypatch, check, name):
    expect_refused(monkeypatch, lambda: check(learner(name)))


def test_outside_an_answer_the_lesson_may_still_show_the_references(monkeypatch):
    """The notebook's own cells call the sanitizer replay and the trace explanation as
    demonstrations: under the grader too, as long as no check is calling an answer."""
    from course.streams import planted_race, sanitizer_races
    monkeypatch.setattr(hooks, "learner_prefix", "/nowhere/learner-cells/")
    assert sanitizer_races(planted_race()) == [(1, "read-after-write", "x", 1)]


def test_lesson_8_routes_every_graded_cell_to_the_judge():
    program = prog.instructor_program(LESSON, ROOT / "solutions" / LESSON / f"{LESSON}.ipynb")
    unserved = [c.grade_id for c in program.graded if not c.served]
    assert program.graded and not unserved, unserved
    assert len(program.graded) == len(SERVED) == 5
    setup = "\n".join(program.judge_setup)
    assert "from course.checks.profiling import" in setup and "S = course.sizes(" in setup

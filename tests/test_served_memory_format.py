"""Lesson 3's checks across the judge/learner boundary: models cross as recipes and tensors with
their exact strides, a converted model comes back as its state and is loaded into the judge's own
copy of the architecture, the "by hand" and autocast facts come from the course's probes, and the
speed check times the learner's repaired block in its process against the course's planted one in
the judge. Every planted mistake of the in-process tests fails across the boundary with the same
cause; a repair that loses the format on the way fails on the judge's clock."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from autograder import program as prog
from autograder.solution_code import load_solution, solution_source
from course import remote, wire
from course.checks import memory_format as C
from course.memory_format import PLANTED_VARIANTS, planted_model
from course.models import small_resnet, small_resnet_channels
from served_helpers import served, untouched
from test_checks_memory_format import COORD_BARS, LESSON_SPEED, MISTAKES, SLOW_MISTAKES, TOO_SLOW

ROOT = Path(__file__).resolve().parents[1]
LESSON = "03_channels_last"
CL = torch.channels_last
SPEED = dict(batch=2, channels=12, size=16, rounds=3, min_run_time=0.02)
NAMES = ("nchw_strides", "nhwc_strides", "is_channels_last_contiguous", "to_channels_last", "find_format_loss",
         "autocast_inference", "coord_conv")


@pytest.fixture(scope="module")
def source():
    return solution_source(LESSON)


@pytest.fixture(scope="module")
def solution(source, tmp_path_factory):
    return load_solution(source, tmp_path_factory.mktemp("served3") / "cl_served.py", "cl_served")


def namespace(module) -> dict:
    return {n: getattr(module, n) for n in NAMES}


@pytest.fixture
def learner(solution):
    yield from served(namespace(solution))


def run(kind: str, learner) -> None:
    if kind == "strides":
        C.check_strides(learner("nchw_strides"), learner("nhwc_strides"))
    elif kind == "is_cl":
        C.check_is_channels_last_contiguous(learner("is_channels_last_contiguous"))
    elif kind == "convert":
        C.check_to_channels_last(learner("to_channels_last"))
    elif kind == "finder":
        C.check_format_finder(learner("find_format_loss"))
    elif kind == "autocast":
        C.check_autocast_inference(learner("autocast_inference"))
    elif kind == "coord":
        C.check_coord_conv(learner("coord_conv"))


def test_tensors_cross_with_their_exact_strides_and_models_as_recipes():
    ambiguous = torch.randn(4, 1, 8, 8).to(memory_format=CL)  # strides (64, 1, 8, 1): contiguous() would lose them
    one_pixel = torch.randn(4, 16, 1, 1).to(memory_format=CL)
    for t in (torch.randn(2, 3, 4, 5).to(memory_format=CL), ambiguous, one_pixel, torch.randn(3, 5).t()):
        back = wire.decode(wire.encode(t))
        assert back.stride() == t.stride() and torch.equal(back, t)
    sliced = torch.randn(2, 6, 4, 4)[:, ::2]  # not dense: crosses contiguous, values intact
    back = wire.decode(wire.encode(sliced))
    assert back.is_contiguous() and torch.equal(back, sliced)
    x = torch.randn(2, 3, 24, 24)
    for model in (small_resnet(seed=3, width=8), small_resnet_channels(seed=2, in_channels=1, width=8),
                  planted_model("gate", seed=1, width=8)):
        built = remote.build(wire.decode(wire.encode(model)))
        assert type(built) is type(model)
        inp = x if model.stem[0].in_channels == 3 else x[:, :1]
        with torch.no_grad():
            assert torch.equal(built(inp), model(inp))


def test_right_answers_pass_every_served_check(learner, capsys):
    for kind in ("strides", "is_cl", "convert", "finder", "autocast", "coord"):
        run(kind, learner)
    C.check_to_channels_last(learner("to_channels_last"), seed=11, in_channels=1, width=8, size=24, batch=3)
    C.check_to_channels_last(learner("to_channels_last"), seed=5, blocks=(1, 2), tap=True, width=12, size=20)
    for variant in PLANTED_VARIANTS:
        C.check_format_finder(learner("find_format_loss"), variant=variant, seed=2, width=8, size=24)
    assert capsys.readouterr().out.count("ok:") == 8 + len(PLANTED_VARIANTS)


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_each_planted_mistake_fails_across_the_boundary_with_its_cause(mistake, source, tmp_path):
    kind, old, new, says = MISTAKES[mistake]
    name = f"cl_served_mutant_{abs(hash(mistake))}"
    module = load_solution(source.replace(old, new), tmp_path / f"{name}.py", name)
    for learner in served(namespace(module)):
        with pytest.raises(AssertionError, match=re.compile(says, re.S)):
            run(kind, learner)


def test_the_ambiguous_grayscale_case_is_judged_on_the_strides_that_came_back(source, tmp_path):
    module = load_solution(source.replace("return model.to(memory_format=CL), x.to(memory_format=CL)",
                                          "return model.to(memory_format=CL), x.contiguous(memory_format=CL)"),
                           tmp_path / "cl_served_gray.py", "cl_served_gray")
    for learner in served(namespace(module)):
        C.check_to_channels_last(learner("to_channels_last"))  # three channels: contiguous() converts for real
        with pytest.raises(AssertionError, match="only because the shape"):
            C.check_to_channels_last(learner("to_channels_last"), in_channels=1)


def test_an_unwritten_or_missing_answer_fails_with_a_friendly_message(source, tmp_path):
    stubbed = untouched(source)
    module = load_solution(stubbed, tmp_path / "cl_served_stub.py", "cl_served_stub")
    for learner in served(namespace(module)):
        for kind in ("strides", "is_cl", "convert", "finder", "autocast", "coord"):
            with pytest.raises(AssertionError, match="not written yet"):
                run(kind, learner)
        with pytest.raises(AssertionError, match="not written yet"):
            C.check_coord_conv_speed(learner("coord_conv"), bars={"cpu": 1.25, "cuda": 1.2}, **SPEED)
    for learner in served({}):
        with pytest.raises(AssertionError, match="to_channels_last is not defined in your notebook"):
            C.check_to_channels_last(learner("to_channels_last"))
        with pytest.raises(AssertionError, match="nchw_strides is not defined in your notebook"):
            C.check_strides(learner("nchw_strides"), learner("nhwc_strides"))


def test_a_returned_model_must_be_the_architecture_it_was_given(solution):
    def other(model, x):
        return small_resnet(seed=0, width=16, tap=True).to(memory_format=CL), x.to(memory_format=CL)

    def half(model, x):
        return model.half().to(memory_format=CL), x.to(memory_format=CL)

    def wrapped(model, x):
        return torch.nn.Sequential(model.to(memory_format=CL)), x.to(memory_format=CL)

    for learner in served({"other": other, "half": half, "wrapped": wrapped}):
        with pytest.raises(AssertionError, match="weights are not the ones it was given"):
            C.check_to_channels_last(learner("other"))
        with pytest.raises(AssertionError, match="is a tensor of shape .* float16"):
            C.check_to_channels_last(learner("half"))
        with pytest.raises(AssertionError, match="returned a Sequential, not the SmallResNet"):
            C.check_to_channels_last(learner("wrapped"))


def test_the_speed_check_times_the_learners_block_against_the_course_planted_one(solution):
    def bumped(x, weight, bias):
        return solution.coord_conv(x, weight, bias + 0.1)

    names = {**namespace(solution), "bumped": bumped}
    for learner in served(names):
        report = C.check_coord_conv_speed(learner("coord_conv"), bars={"cpu": 0.01, "cuda": 0.01}, **SPEED)
        # the planted block is timed in the learner's process too: both sides at its speed
        assert report.names == ["planted", "repaired", "planted (in your process)"]
        assert any("Your process ran planted at" in note for note in report.notes), report.notes
        with pytest.raises(AssertionError, match="the bar on this device is 50.00x"):
            C.check_coord_conv_speed(learner("coord_conv"), bars={"cpu": 50.0, "cuda": 50.0}, attempts=1, **SPEED)
        with pytest.raises(AssertionError, match="checksum|differ"):
            C.check_coord_conv_speed(learner("bumped"), bars={"cpu": 0.01, "cuda": 0.01}, **SPEED)


@pytest.mark.parametrize("mistake", sorted(SLOW_MISTAKES))
def test_a_repair_that_loses_the_format_on_the_way_fails_on_the_judges_clock(mistake, source, tmp_path):
    """Nothing asks the learner's process which op lost the format: check_coord_conv passes such a
    block (right values, right output format), and check_coord_conv_speed, the judge's clock at the
    lesson's sizes, fails it and names the likely cause, so the cell (test_coord_conv) loses its points."""
    old, new = SLOW_MISTAKES[mistake]
    name = f"cl_served_slow_{abs(hash(mistake))}"
    module = load_solution(source.replace(old, new), tmp_path / f"{name}.py", name)
    for learner in served(namespace(module)):
        C.check_coord_conv(learner("coord_conv"))
        with pytest.raises(AssertionError, match=TOO_SLOW):
            C.check_coord_conv_speed(learner("coord_conv"), bars=COORD_BARS, attempts=2, **LESSON_SPEED)


def test_only_registered_probes_run_on_the_learners_side(learner):
    with pytest.raises(ValueError, match="not a registered probe"):
        remote.probe(learner("nchw_strides"), lambda fn: fn)


def test_lesson_3_routes_every_graded_cell_to_the_judge():
    program = prog.instructor_program(LESSON, ROOT / f"solutions/{LESSON}/{LESSON}.ipynb")
    assert program.graded and all(c.served for c in program.graded), [c.grade_id for c in program.graded
                                                                      if not c.served]
    setup = "\n".join(program.judge_setup)
    assert "from course.checks.memory_format import" in setup and "S = course.sizes(" in setup

"""Lesson 2's checks across the judge/learner boundary: models cross as recipes (the learner's
process traces the same graph, node names and all), what the learner's code does to a graph runs
as the course's probes, a fused graph comes back as a description (course.graph_wire) and is
rebuilt, run and timed in the judge. Every planted mistake of the in-process tests fails across
the boundary with the same cause."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import fx

from autograder import program as prog
from autograder.solution_code import load_solution, solution_source
from course import cells, graph_wire, remote, wire
from course.checks import fx as C
from course.models import small_resnet
from served_helpers import served, untouched
from test_checks_fx import MISTAKES, SPEED, convs_twice, run_check

ROOT = Path(__file__).resolve().parents[1]
LESSON = "02_fx_transforms"
NAMES = ("op_type", "conv_bn_pairs", "fold_conv_bn", "fuse", "ProfilingInterpreter", "fold_affine", "compile_frozen")


@pytest.fixture(scope="module")
def source():
    return solution_source(LESSON)


@pytest.fixture(scope="module")
def solution(source, tmp_path_factory):
    return load_solution(source, tmp_path_factory.mktemp("served2") / "fx_served.py", "fx_served")


def namespace(module) -> dict:
    return {n: getattr(module, n) for n in NAMES}


@pytest.fixture
def learner(solution):
    yield from served(namespace(solution))


class Remotes:
    """A stand-in for a lesson module whose answers are the learner's names across the boundary."""

    def __init__(self, learner):
        for name in NAMES:
            setattr(self, name, learner(name))


def test_a_model_with_a_training_batchnorm_crosses_as_its_recipe():
    model = small_resnet(seed=3, width=4, blocks=(1, 1), tap=True, train_bn="stem.1")
    built = remote.build(wire.decode(wire.encode(model)))
    assert built.stem[1].training and not built.stem[0].training
    assert [n.name for n in fx.symbolic_trace(built).graph.nodes] == [n.name for n in fx.symbolic_trace(model).graph.nodes]


def test_right_answers_pass_every_served_check(learner, capsys):
    s = Remotes(learner)
    C.check_op_type(s.op_type)
    C.check_conv_bn_pairs(s.conv_bn_pairs)
    C.check_conv_bn_pairs(s.conv_bn_pairs, seed=3, blocks=(1, 1, 1), train_bn="stem.1")
    C.check_fold_conv_bn(s.fold_conv_bn)
    C.check_fold_conv_bn(s.fold_conv_bn, bias=False, groups=5, c_in=5, eps=1e-3)
    C.check_fuse(s.fuse)
    C.check_profiler(s.ProfilingInterpreter)
    C.check_fold_affine(s.fold_affine)
    C.check_fusion_speed(s.fold_affine, bars={"cpu": 0.5, "cuda": 0.5}, rounds=3, min_run_time=0.02, **SPEED)
    assert capsys.readouterr().out.count("ok:") == 9


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_each_planted_mistake_fails_across_the_boundary_with_its_cause(mistake, source, tmp_path):
    kind, old, new, says = MISTAKES[mistake]
    name = f"fx_served_mutant_{abs(hash(mistake))}"
    module = load_solution(source.replace(old, new), tmp_path / f"{name}.py", name)
    for learner in served(namespace(module)):
        with pytest.raises(AssertionError, match=re.compile(says, re.S)):
            run_check(kind, Remotes(learner))


def test_an_unwritten_or_missing_answer_fails_with_a_friendly_message(source, tmp_path):
    stubbed = untouched(source)
    module = load_solution(stubbed, tmp_path / "fx_served_stub.py", "fx_served_stub")
    for learner in served(namespace(module)):
        s = Remotes(learner)
        for check in (C.check_op_type, C.check_conv_bn_pairs, C.check_fold_conv_bn, C.check_fuse,
                      C.check_profiler, C.check_fold_affine, C.check_compile_frozen):
            with pytest.raises(AssertionError, match="not written yet"):
                check(getattr(s, {C.check_op_type: "op_type", C.check_conv_bn_pairs: "conv_bn_pairs",
                                  C.check_fold_conv_bn: "fold_conv_bn", C.check_fuse: "fuse",
                                  C.check_profiler: "ProfilingInterpreter", C.check_fold_affine: "fold_affine",
                                  C.check_compile_frozen: "compile_frozen"}[check]))
        with pytest.raises(AssertionError, match="not written yet"):
            C.check_fusion_speed(s.fold_affine, bars={"cpu": 1.1, "cuda": 1.05}, **SPEED)
    for learner in served({}):
        with pytest.raises(AssertionError, match="fuse is not defined in your notebook"):
            C.check_fuse(learner("fuse"))
        with pytest.raises(AssertionError, match="ProfilingInterpreter is not defined in your notebook"):
            C.check_profiler(learner("ProfilingInterpreter"))


def test_the_fused_graph_is_rebuilt_and_timed_in_the_judge(solution, monkeypatch):
    calls = []

    def counted(gm):
        calls.append(1)
        return solution.fold_affine(gm)

    def slow(gm):  # every convolution twice, in the graph itself
        return convs_twice(solution.fold_affine(gm))

    def foreign(model):  # a function off the list: the grader cannot rebuild it, so it is refused
        gm = solution.fuse(model)
        out = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(out):
            odd = gm.graph.call_function(torch.special.expit, (out.args[0],))
        out.args = (odd,)
        gm.recompile()
        return gm

    for learner in served({**namespace(solution), "counted": counted, "slow": slow, "foreign": foreign}):
        report = C.check_fusion_speed(learner("counted"), bars={"cpu": 0.5, "cuda": 0.5}, rounds=3,
                                      min_run_time=0.02, **SPEED)
        assert report.names[:2] == ["exported", "folded"] and calls == [1]  # one fold, then the judge's clock
        with pytest.raises(AssertionError, match="the graph runs .* ops, and folding every legal chain leaves"):
            C.check_fusion_speed(learner("slow"), bars={"cpu": 1.1, "cuda": 1.05}, rounds=3, min_run_time=0.02,
                                 **SPEED)
        with monkeypatch.context() as m:  # the structure check out of the way: the clock alone fails it too
            m.setattr(C, "_check_folded_graph", lambda *args: (0, 0))
            with pytest.raises(AssertionError, match="the bar on this device is 1.10x"):
                C.check_fusion_speed(learner("slow"), bars={"cpu": 1.1, "cuda": 1.05}, rounds=3,
                                     min_run_time=0.02, **SPEED)
        with pytest.raises(AssertionError, match="calls 'special_expit', which is not one of the tensor operations"):
            C.check_fuse(learner("foreign"))


def test_compile_frozen_across_the_boundary(learner, source, tmp_path):
    torch._dynamo.reset()
    C.check_compile_frozen(learner("compile_frozen"), image=16, width=4, blocks=(1,))
    wrong = load_solution(source.replace("with torch.no_grad(), torch._inductor.config.patch(freezing=True):",
                                         "with torch._inductor.config.patch(freezing=True):"),
                          tmp_path / "fx_served_grad.py", "fx_served_grad")
    for other in served(namespace(wrong)):
        with pytest.raises(AssertionError, match="still computes BatchNorm"):
            C.check_compile_frozen(other("compile_frozen"), seed=2, image=16, width=4, blocks=(1,))
    torch._dynamo.reset()


K = {"dict": {}}  # no keyword arguments, as describe writes it


@pytest.mark.parametrize("desc, says", [
    ({"nodes": [["x", "placeholder", "x", (), K], ["y", "call_function", "os.system", ({"node": "x"},), K],
                ["output", "output", "output", ({"node": "y"},), K]], "modules": {}, "tensors": {}},
     "cannot be rebuilt"),
    ({"nodes": [["x", "placeholder", "x", (), K], ["output", "output", "output", ({"node": "z"},), K]],
      "modules": {}, "tensors": {}}, "not an earlier node"),
    ({"nodes": [], "modules": {"__class__": ["ReLU", {}, False, {}]}, "tensors": {}}, "plain attribute names"),
    ({"nodes": [], "modules": {"a": ["Conv2d", {"in_channels": 1, "out_channels": 1, "kernel_size": 1,
                                                "bias": False}, False, {"weight": torch.zeros(2, 2)}]},
      "tensors": {}}, "could not be built"),
    ({"nodes": [], "modules": {"a": ["Twice", {}, False, {}]}, "tensors": {}}, "cannot build"),
    ("print('hi')", "not a graph description"),
])
def test_a_graph_description_builds_only_what_the_lists_allow(desc, says):
    with pytest.raises(graph_wire.GraphError, match=says):
        graph_wire.rebuild(desc)


def test_lesson_2_routes_every_graded_cell_to_the_judge():
    program = prog.instructor_program(LESSON, ROOT / f"solutions/{LESSON}/{LESSON}.ipynb")
    assert program.graded and all(c.served for c in program.graded), [c.grade_id for c in program.graded
                                                                      if not c.served]
    setup = "\n".join(program.judge_setup)
    assert "from course.checks.fx import" in setup and "S = course.sizes(" in setup


def test_code_the_lesson_gives_is_not_flagged_but_the_same_thing_added_is():
    """``replace_submodule`` (given in the student version) calls setattr: that is the lesson's doing,
    not the learner's, so a faithful submission carries no flag; a setattr the learner adds does."""
    import json

    source = ROOT / f"solutions/{LESSON}/{LESSON}.ipynb"
    release = ROOT / f"lessons/{LESSON}/{LESSON}.ipynb"
    submitted = json.loads(release.read_text())
    assert not prog.learner_program(LESSON, source, release, submitted).flags
    fuse = cells.find(submitted["cells"], "fuse")
    fuse["source"] = cells.source(fuse) + "\nsetattr(torch, 'relu', torch.sigmoid)\n"
    flags = prog.learner_program(LESSON, source, release, submitted).flags
    assert list(flags) == ["patching"] and "calls setattr" in flags["patching"][0], flags


class _Written(fx.Interpreter):
    """A profile written down, not measured: runs the graph as asked, then reports the old planted
    node's mean (16 ms) for 'slow' and a microsecond for every other node."""

    def profile(self, *args, runs=5):
        for _ in range(runs):
            out = self.run(*args)
        return out

    def slow_mean(self):
        return 0.016

    def rows(self):
        names = [n.name for n in self.module.graph.nodes]
        means = {n: (self.slow_mean() if n == "slow" else 1e-6) for n in names}
        total = sum(means.values())
        return sorted((("op", n, means[n], means[n] / total) for n in names), key=lambda r: r[2], reverse=True)


class _Peeking(_Written):
    """Reads what the planted node sleeps from the node itself, as a learner's own copy allows."""

    def slow_mean(self):
        cycle = self.module.slow.fn.fn.cycle_s
        return sum(cycle) / len(cycle)


class _OneMoreCall(_Written):
    """Measures the planted node by calling it once more, outside the runs."""

    def slow_mean(self):
        x = self.module.lin(torch.zeros(3, 6))
        start = __import__("time").perf_counter()
        self.module.slow(x)
        return __import__("time").perf_counter() - start


def test_a_profile_not_measured_fails_as_the_planted_nodes_times_are_the_judges(monkeypatch):
    """The planted node's work is lent by the judge, with times drawn for each check: a number
    written down fails (here the draw is kept far from it), the node's own attributes hold nothing
    across the boundary, and calling the node outside the runs is counted."""
    monkeypatch.setattr(C.Sleeper, "LONG_S", (0.100, 0.110))
    for learner in served({"ProfilingInterpreter": _Written}):
        with pytest.raises(AssertionError, match=r"by the grader's clock its mean over the 4 runs was"):
            C.check_profiler(learner("ProfilingInterpreter"))
    for learner in served({"ProfilingInterpreter": _Peeking}):
        with pytest.raises(AssertionError, match="rows raised AttributeError: '_Back' object has no attribute 'fn'"):
            C.check_profiler(learner("ProfilingInterpreter"))
    # (in a learner's own copy the node is the Sleeper itself: the learner's to read, and to forge)
    for learner in served({"ProfilingInterpreter": _OneMoreCall}):
        with pytest.raises(AssertionError, match=r"node 'slow' ran 5 times while profile\(x, runs=4\) ran"):
            C.check_profiler(learner("ProfilingInterpreter"))


def test_the_planted_nodes_times_are_drawn_for_each_check_and_timed_by_it():
    draws = {C.Sleeper().cycle_s for _ in range(20)}
    assert len(draws) == 20
    for short, long in draws:
        assert C.Sleeper.SHORT_S[0] <= short <= C.Sleeper.SHORT_S[1] < C.Sleeper.LONG_S[0] <= long <= C.Sleeper.LONG_S[1]
        # the last run alone (the long sleep) falls outside the window whatever was drawn
        assert (long - short) / 2 > C.CROSSING_S
    sleeper = C.Sleeper()
    sleeper.cycle_s = (0.001, 0.003)
    x = torch.ones(3, 6)
    assert sleeper(x) is x and sleeper(x) is x
    assert len(sleeper.slept) == 2 and sleeper.slept[0] >= 0.001 and sleeper.slept[1] >= 0.003
    with pytest.raises(TypeError, match="takes the \\(3, 6\\) tensor the graph gives it"):
        sleeper(torch.ones(4096, 4096))  # it sends back what it was given: nothing of the learner's choosing
    assert len(sleeper.slept) == 2


@pytest.mark.parametrize("long_s", [0.035, 0.045, 0.2])
def test_the_profile_of_one_run_or_of_their_sum_is_named_whatever_was_drawn(long_s):
    """The last run's time alone is named so even when the long sleep is short enough that four
    crossings' allowance around the sum would reach it (a 35-44 ms draw once called it the sum)."""
    sleeper = C.Sleeper()
    sleeper.cycle_s = (0.004, long_s)
    sleeper.slept = [0.004, long_s, 0.004, long_s]
    with pytest.raises(AssertionError, match="the last run's time alone"):
        C._slow_mean(long_s + 0.001, sleeper, 4)
    with pytest.raises(AssertionError, match="the first run's time alone"):
        C._slow_mean(0.0045, sleeper, 4)
    with pytest.raises(AssertionError, match="the sum of the runs' times"):
        C._slow_mean(sum(sleeper.slept) + 0.004, sleeper, 4)
    C._slow_mean(sleeper.mean + 0.001, sleeper, 4)

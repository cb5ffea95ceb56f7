"""Lesson 2 graded on writing the fuser (red team, 2026-12-05, against grader version 61): PyTorch's own
conv/BatchNorm folding (``torch.fx.experimental.optimization.fuse``, ``torch.nn.utils.fusion``) earned
``fuse`` (3), ``fold_conv_bn`` (2) and ``conv_bn_pairs`` (2) without a rule written; ``compile_frozen``
earned its point with freezing off by giving the model the forward of a copy fused by hand."""

from __future__ import annotations

import copy
import sys
import threading

import pytest
import torch
from torch import fx, nn

from autograder.solution_code import load_solution, solution_source
from course.checks import fx as C
from course.checks.library import LibraryCalls
from course.models import small_resnet

LESSON = "02_fx_transforms"


@pytest.fixture(scope="module")
def fx_solution(tmp_path_factory):
    return load_solution(solution_source(LESSON), tmp_path_factory.mktemp("sol") / "fx_method_solution.py",
                         "fx_method_solution")


def _torch_fuse(model: nn.Module) -> fx.GraphModule:
    from torch.fx.experimental.optimization import fuse as torch_fuse

    m = copy.deepcopy(model)
    off = [bn for bn in m.modules() if isinstance(bn, nn.BatchNorm2d) and bn.training and bn.track_running_stats]
    for bn in off:
        bn.track_running_stats = False  # torch's pass skips these
    gm = torch_fuse(m, inplace=True)
    for bn in off:
        bn.track_running_stats = True
    return gm


def _pairs_by_torch(gm: fx.GraphModule):
    left = {str(n.target) for n in _torch_fuse(gm).graph.nodes if n.op == "call_module"}
    return [(n.args[0], n) for n in gm.graph.nodes
            if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.BatchNorm2d)
            and str(n.target) not in left]


def _fold_by_torch(w, b, mean, var, gamma, beta, eps):
    from torch.nn.utils.fusion import fuse_conv_bn_weights

    w2, b2 = fuse_conv_bn_weights(w, b, mean, var, eps, gamma, beta)
    return w2.detach(), b2.detach()


def _fold_by_torch_aliased(w, b, mean, var, gamma, beta, eps):
    fold = vars(sys.modules["torch.nn.utils.fusion"])["fuse_conv_bn_weights"]  # no name of it in the source
    w2, b2 = fold(w, b, mean, var, eps, gamma, beta)
    return w2.detach(), b2.detach()


def _fold_by_quantization(w, b, mean, var, gamma, beta, eps):
    from torch.ao.quantization.fuse_modules import fuse_known_modules

    conv = nn.Conv2d(w.shape[1], w.shape[0], w.shape[2:], bias=b is not None).double()
    bn = nn.BatchNorm2d(w.shape[0], eps=eps).double().eval()
    with torch.no_grad():
        conv.weight.copy_(w)
        if b is not None:
            conv.bias.copy_(b)
        bn.running_mean.copy_(mean), bn.running_var.copy_(var), bn.weight.copy_(gamma), bn.bias.copy_(beta)
    fused, _ = fuse_known_modules([conv.eval(), bn], False)
    return fused.weight.detach(), fused.bias.detach()


def test_the_instructors_fuser_passes_with_pytorchs_own_refused(fx_solution):
    C.check_conv_bn_pairs(fx_solution.conv_bn_pairs, seed=3, blocks=(1, 1, 1), train_bn="stem.1")
    C.check_fold_conv_bn(fx_solution.fold_conv_bn, bias=False)
    C.check_fuse(fx_solution.fuse)


@pytest.mark.parametrize("check, answer, says", [
    (C.check_fuse, _torch_fuse, r"fuse calls PyTorch's own implementation of this exercise: "
                                r"torch\.fx\.experimental\.optimization"),
    (C.check_conv_bn_pairs, _pairs_by_torch, r"conv_bn_pairs calls PyTorch's own .*optimization"),
    (C.check_fold_conv_bn, _fold_by_torch, r"fold_conv_bn calls PyTorch's own .*torch\.nn\.utils\.fusion"),
    (C.check_fold_conv_bn, _fold_by_torch_aliased, r"torch\.nn\.utils\.fusion"),
    (C.check_fold_conv_bn, _fold_by_quantization, r"torch\.ao \(the quantization fusers"),
])
def test_pytorchs_own_fuser_earns_nothing(check, answer, says):
    with pytest.raises(AssertionError, match=says):
        check(answer)


def test_the_fold_check_still_names_an_input_changed_in_place(fx_solution):
    def in_place(w, b, mean, var, gamma, beta, eps):
        out = fx_solution.fold_conv_bn(w, b, mean, var, gamma, beta, eps)
        gamma.mul_(2)
        return out

    with pytest.raises(AssertionError, match="changed its input gamma in place"):
        C.check_fold_conv_bn(in_place)


def test_the_watch_cannot_be_switched_off_or_sidestepped_by_a_thread(fx_solution):
    def unwatched(w, b, mean, var, gamma, beta, eps):
        sys.setprofile(None)
        return _fold_by_torch(w, b, mean, var, gamma, beta, eps)

    def in_a_thread(w, b, mean, var, gamma, beta, eps):
        out = []
        t = threading.Thread(target=lambda: out.append(_fold_by_torch(w, b, mean, var, gamma, beta, eps)))
        t.start()
        t.join()
        return out[0]

    with pytest.raises(AssertionError, match="the profile function the course set was replaced"):
        C.check_fold_conv_bn(unwatched)
    with pytest.raises(AssertionError, match="a thread was started"):
        C.check_fold_conv_bn(in_a_thread)
    with LibraryCalls("nothing"):  # a block that calls none of it leaves as it came
        torch.ones(3).sum()


def test_a_profile_function_set_before_is_kept_and_still_called():
    seen = []

    def mine(frame, event, arg):
        seen.append(event)

    sys.setprofile(mine)
    try:
        with LibraryCalls("answer"):
            torch.ones(2).add(1)
        assert sys.getprofile() is mine and seen
    finally:
        sys.setprofile(None)


@pytest.mark.parametrize("change, says", [
    (lambda m, fused: setattr(m, "forward", fused.forward), "the model got attributes of its own that are "
                                                             "functions \\(forward\\)"),
    (lambda m, fused: m.register_forward_hook(lambda mod, i, o: fused(i[0])), "the model got hooks"),
    (lambda m, fused: setattr(m.stem, "1", nn.Identity()), "its modules changed|stem.1 became a Identity"),
    (lambda m, fused: m.stem[1].running_mean.add_(1), "its parameters or buffers changed"),
])
def test_compile_frozen_may_not_change_the_model_it_compiles(fx_solution, change, says):
    """The model's forward swapped for a fused copy's (red team: 1/1 with freezing off), a hook that
    answers for it, a BatchNorm swapped out, its statistics changed: each named."""
    model = small_resnet(seed=0, width=4, blocks=(1,), tap=False).eval()
    before = C._model_shape(model)
    assert C._model_changed(model, before) == ""
    change(model, fx_solution.fuse(model))
    assert __import__("re").search(says, C._model_changed(model, before))


def test_compile_frozen_by_a_swapped_forward_fails_the_check(fx_solution):
    def swapped(model, example):
        model.forward = fx_solution.fuse(model).forward
        compiled = torch.compile(model)
        with torch.no_grad():
            compiled(example)
        return compiled

    torch._dynamo.reset()
    with pytest.raises(AssertionError, match=r"compile_frozen changed the model it was given: the model got "
                                             r"attributes of its own that are functions \(forward\)"):
        C.check_compile_frozen(swapped, width=4, blocks=(1,), image=8)

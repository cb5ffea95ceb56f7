"""Errors PyTorch raises inside a learner's code get the course's hint beside them, and only
those: each hint is triggered here by the real error of the installed torch, as a plausible wrong
answer of the lessons makes it."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import jvp, vmap

from course.checks.common import call
from course.checks.hints import HINTS, torch_hint
from course.remote import _exception


class OldStyle(torch.autograd.Function):  # forward(ctx, x): fine for autograd, not for torch.func
    @staticmethod
    def forward(ctx, x):
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        return g


class SavedForBackwardOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        return g * x.cos()

    @staticmethod
    def jvp(ctx, t):
        x, = ctx.saved_tensors
        return t * x.cos()


def _forward_mode(fn):
    def run(x):
        with fwAD.dual_level():
            return fwAD.unpack_dual(fn(fwAD.make_dual(x, torch.ones_like(x)))).tangent
    return run


x = torch.randn(3, 3)
leaf = torch.randn(3, requires_grad=True)

#: hint name -> (a wrong answer, its arguments)
WRONG = {
    "vmap: mapped sizes differ": (lambda a, b: vmap(lambda p, q: p + q, in_dims=(0, 0))(a, b),
                                  (torch.randn(10, 3), torch.randn(32, 3))),
    "vmap: in_dims does not fit the arguments": (lambda a: vmap(lambda p: p * 2, in_dims=(0, 0))(a), (x,)),
    "vmap: a value read from a tensor": (lambda a: vmap(lambda p: p * p.sum().item())(a), (x,)),
    "vmap: a layer that wants a batch": (lambda a: vmap(torch.func.jacrev(torch.nn.BatchNorm1d(3).eval()))(a), (x,)),
    "torch.func: an old-style autograd.Function": (lambda a: jvp(OldStyle.apply, (a,), (a,)), (x,)),
    "forward mode: no jvp": (_forward_mode(OldStyle.apply), (x,)),
    "matrix product: inner sizes": (lambda a: a @ torch.randn(5, 4), (x,)),
    "dtypes differ": (lambda a: a @ torch.eye(3), (x.double(),)),
    "autograd.grad of a non-scalar": (lambda a: torch.autograd.grad(a * 2, a), (leaf,)),
    "autograd: the graph was freed": (lambda a: [torch.autograd.grad(y, a) for y in [(a * a).sum()] * 2], (leaf,)),
    "shapes do not broadcast": (lambda a: a + torch.randn(5), (torch.randn(3, 4),)),
    "vmap: a random op in randomness error mode": (lambda a: vmap(lambda r: torch.nn.functional.dropout(r, 0.5))(a),
                                                   (x,)),
    "autograd.grad: the input needs a gradient": (lambda a: torch.autograd.grad((a * a).sum(), a), (x,)),
    "scatter: the index's dimensions": (lambda a: torch.zeros(4, 3).scatter_reduce(0, torch.tensor([0, 1, 1]), a,
                                                                                  reduce="amax"), (x,)),
    "in place on a leaf that requires grad": (lambda a: a.index_add_(0, torch.tensor([0]), torch.ones(1)), (leaf,)),
}


@pytest.mark.parametrize("name", sorted(WRONG))
def test_a_known_error_gets_its_hint(name):
    fn, args = WRONG[name]
    hint = next(h for n, _, h in HINTS if n == name)
    with pytest.raises(AssertionError) as info:
        call(fn, *args, name="answer")
    text = str(info.value)
    assert "answer raised" in text and f"Hint: {hint}" in text, text


def test_every_hint_is_tested_against_the_real_error():
    untested = {n for n, _, _ in HINTS} - set(WRONG) - {"devices differ"}  # needs a second device
    assert not untested, untested
    # the device message, as torch words it (a CUDA machine raises it for a tensor made on the CPU)
    exc = RuntimeError("Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!")
    assert "device=x.device" in torch_hint(exc)


def test_a_missing_save_for_forward_is_named_only_where_jvp_unpacked_nothing():
    with pytest.raises(AssertionError, match="save_for_forward"):
        call(_forward_mode(SavedForBackwardOnly.apply), x, name="sinc")
    with pytest.raises(AssertionError) as info:  # the same error elsewhere: no guess
        call(lambda a: (lambda p, q: p)(*[]), x, name="other")
    assert "Hint:" not in str(info.value)


def test_an_unknown_error_keeps_its_message_and_gets_no_hint():
    with pytest.raises(AssertionError) as info:
        call(lambda a: {}["missing"], x, name="answer")
    assert "KeyError" in str(info.value) and "Hint:" not in str(info.value)


def test_pytorchs_not_implemented_is_not_mistaken_for_an_unwritten_stub():
    with pytest.raises(AssertionError) as info:
        call(_forward_mode(OldStyle.apply), x, name="Sinc")
    assert "not written yet" not in str(info.value) and "jvp" in str(info.value)

    def stub(a):
        raise NotImplementedError()

    with pytest.raises(AssertionError, match="not written yet"):
        call(stub, x)


def test_a_stub_run_by_an_fx_interpreter_is_still_a_stub():
    """FX's Interpreter rewrites the message of an error raised while it runs a node ("While
    executing %x ..."): a bare raise in a learner's run_node is the stub all the same, and an error
    with a message of its own keeps it."""
    import torch.fx

    class Stub(torch.fx.Interpreter):
        def run_node(self, n):
            raise NotImplementedError()

    class Own(torch.fx.Interpreter):
        def run_node(self, n):
            raise NotImplementedError("no kernel for this op")

    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    with pytest.raises(AssertionError, match="not written yet"):
        call(lambda t: Stub(gm).run(t), x, name="profile")
    with pytest.raises(AssertionError) as info:
        call(lambda t: Own(gm).run(t), x, name="profile")
    assert "not written yet" not in str(info.value) and "no kernel for this op" in str(info.value)


def test_the_hint_reaches_an_error_that_crossed_from_the_learners_process():
    exc = _exception("RuntimeError", "mat1 and mat2 shapes cannot be multiplied (3x3 and 5x4)")
    assert "x @ W.T" in torch_hint(exc)
    with pytest.raises(AssertionError, match="not written yet"):
        call(lambda: (_ for _ in ()).throw(_exception("NotImplementedError", "")))

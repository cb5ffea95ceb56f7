"""Lesson 4's answers earn their points by the method the exercise asks, not only by right values
(red team, 2026-12-05): a Jacobian by finite differences or by a closed form from the wide
function's weights, dressed with one token ``jvp`` or ``vjp``; a closed form timed as
``tall_jacobian``; ``param_jvp_func`` that ran the model once inside ``torch.func.jvp`` with zero
tangents and returned a tangent computed elsewhere. Each is right in value and fails here, with a
message that says what the exercise asks; the instructor's answers pass beside them (in
``tests/test_checks_forward_ad.py``). Through the real grader: ``tests/test_hostile_grading.py``."""

import copy

import pytest
import torch
from torch.func import functional_call, jvp, vjp, vmap

from course import forward_ad as FA
from course.checks import forward_ad as C

SPEED = dict(k=4, m=2048, hidden=128, threads=1, rounds=3, min_run_time=0.02)
BARS = {"cpu": 1.5, "cuda": 1.5}


def differences(f, x):
    """The (m, k) Jacobian by central differences over one vmapped call of f."""
    h = 1e-6
    basis = torch.eye(x.numel(), dtype=x.dtype, device=x.device)
    ys = vmap(f)(torch.cat([x + h * basis, x - h * basis]))
    k = x.numel()
    return ((ys[:k] - ys[k:]) / (2 * h)).T


def closed_form(f, x):
    """The Jacobian from the wide function's public weights: no differentiation at all."""
    y = torch.tanh(f.W1 @ x + f.b1)
    return f.W2 @ ((1 - y * y)[:, None] * f.W1)


def fd_in_a_token_jvp(f, x):
    jac, _ = jvp(lambda z: differences(f, z), (x,), (torch.zeros_like(x),))
    return jac


def closed_form_beside_one_jvp(f, x):
    jvp(f, (x,), (torch.ones_like(x),))
    return closed_form(f, x)


def fd_in_a_token_vjp(f, x):
    jac, pullback = vjp(lambda z: differences(f, z), x)
    pullback(torch.zeros_like(jac))
    return jac


def forward_mode_computed_then_differences(f, x):
    """All k tangents pushed through the differences' one call of f (their forward-mode derivative
    thrown away), the differences returned: the rule sees k directions, the digits give it away."""
    basis = torch.eye(x.numel(), dtype=x.dtype, device=x.device)
    return vmap(lambda v: jvp(lambda z: differences(f, z), (x,), (v,))[0])(basis)[0]


def right_fwd(f, x):
    basis = torch.eye(x.numel(), dtype=x.dtype, device=x.device)
    return vmap(lambda v: jvp(f, (x,), (v,))[1])(basis).T


def right_rev(f, x):
    out, pullback = vjp(f, x)
    return vmap(pullback)(torch.eye(out.numel(), dtype=out.dtype, device=out.device))[0]


@pytest.mark.parametrize("fwd, rev, says", [
    (fd_in_a_token_jvp, right_rev, r"jacobian_fwd pushed tangents through f that span 0 directions where the 5 "
                                   r"input basis vectors span 5"),
    (closed_form_beside_one_jvp, right_rev, "jacobian_fwd pushed tangents through f that span 1 directions"),
    (right_fwd, fd_in_a_token_vjp, "jacobian_rev pushed cotangents through f that span 0 directions where the 7 "
                                   "output basis vectors span 7"),
    (forward_mode_computed_then_differences, right_rev, r"to rounding in float64"),
], ids=["differences in a zero jvp", "closed form beside one jvp", "differences in a zero vjp",
        "forward mode thrown away, differences returned"])
def test_a_jacobian_computed_another_way_beside_a_token_transform_fails(fwd, rev, says):
    with pytest.raises(AssertionError, match=says):
        C.check_jacobians(fwd, rev)


def test_the_right_jacobians_pass_and_are_seen_to_push_every_basis_vector(capsys):
    C.check_jacobians(right_fwd, right_rev)
    assert "ok: jacobian_fwd" in capsys.readouterr().out
    f = FA.WideFunction(5, 7, 16, seed=0, mode="watched", dtype=torch.float64)
    x = torch.randn(5, dtype=torch.float64)
    for answer, mode, span in ((torch.func.jacfwd(f), "forward", 5), (torch.func.jacrev(f), "reverse", 7)):
        with FA.watching() as seen:
            answer(x)
        assert [m for m, _ in seen] == [mode] and int(torch.linalg.matrix_rank(seen[0][1])) == span
    with FA.watching() as seen:  # the legacy API's vmap, unwrapped too
        torch.autograd.functional.jacobian(f, x, vectorize=True, strategy="forward-mode")
    assert int(torch.linalg.matrix_rank(seen[0][1])) == 5
    f(x)
    assert FA.TANGENTS_SEEN == seen and len(seen) == 1  # nothing noted outside the watch


def test_tall_jacobian_by_a_closed_form_earns_nothing_however_fast():
    """As fast as forward mode (one matrix product per output block): it fails before any clock."""
    with pytest.raises(AssertionError, match="tall_jacobian differentiated f by no mode"):
        C.check_jacobian_speed(closed_form, bars=BARS, **SPEED)
    with pytest.raises(AssertionError, match="tall_jacobian pushed tangents through f that span 1"):
        C.check_jacobian_speed(closed_form_beside_one_jvp, bars=BARS, **SPEED)


def test_tall_jacobians_program_may_call_the_one_call_forward_jacobians_but_not_read_the_weights():
    """The program host's reading for Exercise 6 (vocabulary ``jacobians``): ``jacfwd`` and the legacy
    ``jacobian`` are on its list; ``f``'s weights are not, nor are they for Exercise 5's answers."""
    from course.hand import read_program

    for ok in ("def t(f, x):\n    return torch.func.jacfwd(f)(x)\n",
               "def t(f, x):\n    return torch.autograd.functional.jacobian(f, x, vectorize=True, "
               "strategy='forward-mode')\n"):
        read_program("import torch\n" + ok, vocabulary="jacobians")
        with pytest.raises(AssertionError, match="may not use|not among"):
            read_program("import torch\n" + ok)  # the tensors vocabulary: every other exercise
    with pytest.raises(AssertionError, match="W1"):
        read_program("import torch\ndef t(f, x):\n    return f.W1\n", vocabulary="jacobians")
    read_program("import torch\ndef t(f, x):\n    return torch.vmap(f)(x)\n")  # the alias the lessons name


def stripped_copy_tangent(model, x, tangents):
    """The watched run inside jvp with zero tangents; the tangent from an unwatched copy of the model."""
    params = dict(model.named_parameters())
    zeros = {n: torch.zeros_like(p) for n, p in params.items()}
    out, _ = jvp(lambda p: functional_call(model, p, (x,)), (params,), (zeros,))
    twin = copy.deepcopy(model)
    for m in twin.modules():
        m._forward_hooks.clear()
        m._forward_pre_hooks.clear()
    full = {n: tangents.get(n, torch.zeros_like(p)) for n, p in params.items()}
    _, tangent = jvp(lambda p: functional_call(twin, p, (x,)), (dict(twin.named_parameters()),), (full,))
    return out, tangent


def test_param_jvp_func_must_return_the_tangent_its_run_carried():
    with pytest.raises(AssertionError, match="param_jvp_func returned a tangent that is not the one its run"):
        C.check_param_jvp_func(stripped_copy_tangent)


class JvpDual:
    """Every operation by ``torch.func.jvp`` of the torch op itself: no rule written."""

    def __init__(self, primal, tangent):
        self.primal, self.tangent = primal, tangent

    @staticmethod
    def lift(other):
        if isinstance(other, JvpDual):
            return other
        other = torch.as_tensor(other, dtype=torch.float64)
        return JvpDual(other, torch.zeros_like(other))

    def _two(self, other, op):
        other = JvpDual.lift(other)
        return JvpDual(*jvp(op, (self.primal, other.primal), (self.tangent, other.tangent)))

    def _one(self, op):
        return JvpDual(*jvp(op, (self.primal,), (self.tangent,)))

    def __add__(self, o): return self._two(o, torch.add)
    def __radd__(self, o): return JvpDual.lift(o)._two(self, torch.add)
    def __sub__(self, o): return self._two(o, torch.sub)
    def __rsub__(self, o): return JvpDual.lift(o)._two(self, torch.sub)
    def __mul__(self, o): return self._two(o, torch.mul)
    def __rmul__(self, o): return JvpDual.lift(o)._two(self, torch.mul)
    def __truediv__(self, o): return self._two(o, torch.div)
    def __rtruediv__(self, o): return JvpDual.lift(o)._two(self, torch.div)
    def __neg__(self): return self._one(torch.neg)
    def sin(self): return self._one(torch.sin)
    def exp(self): return self._one(torch.exp)
    def tanh(self): return self._one(torch.tanh)


def test_a_dual_class_that_hands_its_rules_to_pytorchs_ad_fails(tmp_path, monkeypatch):
    """Right values by torch.func.jvp (or autograd) on the torch op: the Dual exercise asks for the rules."""
    from autograder.solution_code import load_solution, solution_source

    Dual = load_solution(solution_source("04_forward_ad"), tmp_path / "fad.py", "fad_method_dual").Dual
    C.check_dual(Dual)
    with pytest.raises(AssertionError, match=r"`x \+ y` with Duals x and y ran PyTorch's own differentiation"):
        C.check_dual(JvpDual)

    def sin_by_autograd(self):
        """The instructor's rules, but ``sin``'s derivative from a backward pass."""
        p = self.primal.detach().requires_grad_()
        (d,) = torch.autograd.grad(torch.sin(p), p, self.tangent)
        return Dual(torch.sin(self.primal), d)

    monkeypatch.setattr(Dual, "sin", sin_by_autograd)
    with pytest.raises(AssertionError, match=r"`x.sin\(\)` with Duals x and y ran PyTorch's own differentiation "
                                             r"\(autograd::engine"):
        C.check_dual(Dual)


class HeldDual:
    """Forward AD's own dual tensor, made in ``__init__`` and read in the ``primal`` and ``tangent``
    properties, its level left open: every operation is the torch op on the dual tensor."""

    level = None

    def __init__(self, primal=None, tangent=None, held=None):
        import torch.autograd.forward_ad as fwAD

        if held is None:
            if HeldDual.level is None:
                HeldDual.level = fwAD.dual_level()
                HeldDual.level.__enter__()
            held = fwAD.make_dual(primal, tangent)
        self.held = held

    primal = property(lambda s: __import__("torch").autograd.forward_ad.unpack_dual(s.held).primal)
    tangent = property(lambda s: __import__("torch").autograd.forward_ad.unpack_dual(s.held).tangent)

    def _of(self, o):
        return o.held if isinstance(o, HeldDual) else o

    def __add__(self, o): return HeldDual(held=self.held + self._of(o))
    def __radd__(self, o): return HeldDual(held=self._of(o) + self.held)
    def __sub__(self, o): return HeldDual(held=self.held - self._of(o))
    def __rsub__(self, o): return HeldDual(held=self._of(o) - self.held)
    def __mul__(self, o): return HeldDual(held=self.held * self._of(o))
    def __rmul__(self, o): return HeldDual(held=self._of(o) * self.held)
    def __truediv__(self, o): return HeldDual(held=self.held / self._of(o))
    def __rtruediv__(self, o): return HeldDual(held=self._of(o) / self.held)
    def __neg__(self): return HeldDual(held=-self.held)
    def sin(self): return HeldDual(held=self.held.sin())
    def exp(self): return HeldDual(held=self.held.exp())
    def tanh(self): return HeldDual(held=self.held.tanh())


class ComplexStepDual(JvpDual):
    """Every operation on ``primal + i h tangent``, the tangent read off the imaginary part / h."""

    H = 1e-150

    def _z(self):
        return torch.complex(self.primal, self.H * self.tangent)

    @classmethod
    def _back(cls, z):
        return cls(z.real.clone(), z.imag / cls.H)

    @staticmethod
    def lift(other):
        if isinstance(other, ComplexStepDual):
            return other
        other = torch.as_tensor(other, dtype=torch.float64)
        return ComplexStepDual(other, torch.zeros_like(other))

    def _two(self, other, op):
        return self._back(op(self._z(), ComplexStepDual.lift(other)._z()))

    def __radd__(self, o): return ComplexStepDual.lift(o)._two(self, torch.add)
    def __rsub__(self, o): return ComplexStepDual.lift(o)._two(self, torch.sub)
    def __rmul__(self, o): return ComplexStepDual.lift(o)._two(self, torch.mul)
    def __rtruediv__(self, o): return ComplexStepDual.lift(o)._two(self, torch.div)

    def _one(self, op):
        return self._back(op(self._z()))


@pytest.mark.parametrize("dual, says", [(HeldDual, r"make_dual|a forward-AD dual level left open"),
                                        (ComplexStepDual, r"complex numbers")],
                         ids=["forward AD's dual tensor held", "a complex step"])
def test_a_dual_class_that_differentiates_another_way_fails(dual, says):
    """Red team, 2026-12-05, second round: right values with no rule written, by PyTorch's forward AD made
    outside the first watch's reach (in ``__init__``, read in properties) or by complex numbers."""
    try:
        with pytest.raises(AssertionError, match=says):
            C.check_dual(dual)
    finally:
        if HeldDual.level is not None:
            HeldDual.level.__exit__(None, None, None)
            HeldDual.level = None


def tall_by_dtype(f, x):
    """Forward mode where the structure check looks in float64, differences where it is timed."""
    if x.dtype == torch.float64:
        return torch.func.jacfwd(f)(x)
    k = x.shape[0]
    step = torch.eye(k, dtype=x.dtype, device=x.device) * 1e-2
    ys = vmap(f)(torch.cat([x + step, x - step]))
    return ((ys[:k] - ys[k:]) / 2e-2).T


def test_tall_jacobian_is_held_to_forward_mode_on_the_timed_function_too():
    with pytest.raises(AssertionError, match=r"tall_jacobian, on the function it is timed on \(float32, k=4, m=2048\), "
                                             r"differentiated f by no mode"):
        C.check_jacobian_speed(tall_by_dtype, bars=BARS, **SPEED)

"""Lesson 4's checks (forward-mode AD): the instructor's solutions pass every one, and every one
fails on the untouched student version and on a planted mistake aimed at it. Solutions, the
student version and the mistakes all come from the instructor notebook itself. Also: the lesson's
helpers in course.forward_ad and the references the checks trust (the grader's, in
course.references.forward_ad), and the checks of a learner's copy, which has none of them."""

import json
import math
import re
from pathlib import Path

import pytest
import torch

from autograder.solution_code import load_solution, solution_source
from course import forward_ad as FA
from course import cells
from course.checks import forward_ad as C
from course.checks.common import visible_call
from course.references import forward_ad as R

LESSON = "04_forward_ad"
SPEED = dict(k=4, m=2048, hidden=128, threads=1, rounds=3, min_run_time=0.02)
BARS = {"cpu": 1.5, "cuda": 1.5}


@pytest.fixture(scope="module")
def base_source():
    return solution_source(LESSON)


@pytest.fixture(scope="module")
def fad(base_source, tmp_path_factory):
    return load_solution(base_source, tmp_path_factory.mktemp("sol4") / "fad_solution.py", "fad_solution")


@pytest.fixture(scope="module")
def untouched(base_source, tmp_path_factory):
    """The student version's code: every solution region replaced by nbgrader's stub."""
    stubbed = re.sub(r"( *)### BEGIN SOLUTION\n.*?### END SOLUTION", r"\1raise NotImplementedError()",
                     base_source, flags=re.S)
    assert "### BEGIN SOLUTION" not in stubbed and stubbed.count("raise NotImplementedError()") >= 20
    return load_solution(stubbed, tmp_path_factory.mktemp("stub4") / "fad_stub.py", "fad_stub")


@pytest.fixture(scope="module")
def mutate4(base_source, tmp_path_factory):
    """``mutate4(old, new)``: lesson 4's solutions with one planted mistake, as a module."""
    counter = iter(range(10**6))

    def make(old: str, new: str):
        assert old in base_source, f"the planted mistake's anchor is not in the solution: {old!r}"
        name = f"fad_mutant_{next(counter)}"
        return load_solution(base_source.replace(old, new), tmp_path_factory.mktemp("mut4") / f"{name}.py", name)

    return make


def test_solutions_pass_every_check(fad):
    s = fad
    C.check_dual(s.Dual, seed=5, shape=(4, 3))
    C.check_param_jvp(s.param_jvp, seed=2, subset=True)
    C.check_param_jvp_func(s.param_jvp_func, seed=2, sizes=(3, 5, 2), norm=False)
    C.check_sinc(s.Sinc, seed=9, n=200)
    C.check_jacobians(s.jacobian_fwd, s.jacobian_rev, seed=6, k=3, m=11, hidden=7)
    report = C.check_jacobian_speed(s.tall_jacobian, bars=BARS, **SPEED)
    assert report.names == ["reverse (m VJPs)", "your tall_jacobian"]


@pytest.mark.parametrize("check", [
    lambda s: C.check_dual(s.Dual),
    lambda s: C.check_param_jvp(s.param_jvp),
    lambda s: C.check_param_jvp_func(s.param_jvp_func),
    lambda s: C.check_sinc(s.Sinc),
    lambda s: C.check_jacobians(s.jacobian_fwd, s.jacobian_rev),
    lambda s: C.check_jacobian_speed(s.tall_jacobian, bars=BARS, **SPEED),
], ids=["dual", "param_jvp", "param_jvp_func", "sinc", "jacobians", "speed"])
def test_untouched_student_version_fails_with_a_friendly_message(check, untouched):
    with pytest.raises(AssertionError, match="not written yet"):
        check(untouched)


def test_a_half_written_dual_class_still_fails(mutate4, fad):
    """Only __add__ written: the check reaches the first operation that is still the stub."""
    m = mutate4("        other = Dual.lift(other)\n        return Dual(self.primal - other.primal",
                "        raise NotImplementedError()\n        return Dual(self.primal - other.primal")
    with pytest.raises(AssertionError, match=r"computing `x - y`.*not written yet"):
        C.check_dual(m.Dual)


# (check, anchor in the solution, planted mistake, what the message must say)
MISTAKES = {
    "dual: product rule without the second term": (
        "dual", "self.tangent * other.primal + self.primal * other.tangent", "self.tangent * other.primal",
        r"tangent of `x \* y`"),
    "dual: 3 / y computed as y / 3": (
        "dual", "        return Dual.lift(other) / self", "        return self / other", r"primal of `3 / y`"),
    "dual: 1 - x computed as x - 1": (
        "dual", "        return Dual.lift(other) - self", "        return self - other", r"primal of `1 - x`"),
    "dual: tanh' = 1 - tanh": (
        "dual", "(1 - value * value) * self.tangent", "(1 - value) * self.tangent", r"tangent of `x.tanh\(\)`"),
    "dual: quotient rule not divided by b": (
        "dual", "(self.tangent - value * other.tangent) / other.primal", "(self.tangent - value * other.tangent)",
        r"tangent of `x / y`"),
    "dual: sin' = -cos": (
        "dual", "torch.cos(self.primal) * self.tangent", "-torch.cos(self.primal) * self.tangent",
        r"tangent of `x.sin\(\)`"),
    "dual: numbers not lifted": (
        "dual", "        other = Dual.lift(other)\n        return Dual(self.primal * other.primal",
        "        return Dual(self.primal * other.primal", r"computing `2 \* x`.*AttributeError"),
    "dual: an operation updates its input": (
        "dual", "        other = Dual.lift(other)\n        return Dual(self.primal + other.primal, self.tangent + other.tangent)",
        "        other = Dual.lift(other)\n        self.tangent = self.tangent + other.tangent\n"
        "        return Dual(self.primal + other.primal, self.tangent)", "changed its input"),
    "param_jvp: tangents of ones": (
        "param_jvp", "fwAD.make_dual(params[name], t)", "fwAD.make_dual(params[name], torch.ones_like(t))",
        r"J @ v"),
    "param_jvp: a second forward pass for the primal": (
        "param_jvp", "    return primal, tangent\n", "    return model(x), tangent\n", "ran the model 2 times"),
    "param_jvp: tangent not unpacked": (
        "param_jvp", "    return primal, tangent\n", "    return primal, None\n", r"returned \(output, None\)"),
    "param_jvp: p.data = make_dual (the tangent never reaches the model)": (
        "param_jvp", "        dual = {name: fwAD.make_dual(params[name], t) for name, t in tangents.items()}\n"
                     "        out = functional_call(model, dual, (x,))\n",
        "        for name, t in tangents.items():\n"
        "            params[name].data = fwAD.make_dual(params[name].detach(), t)\n"
        "        out = model(x)\n", "these parameters carried no tangent"),
    "param_jvp: unpacked after the dual level closed": (
        "param_jvp", "        primal, tangent = fwAD.unpack_dual(out)\n    return primal, tangent\n",
        "    primal, tangent = fwAD.unpack_dual(out)\n    return primal, tangent\n", "inside the `with fwAD.dual_level"),
    "param_jvp: torch.func instead of forward_ad": (
        "param_jvp", "    params = dict(model.named_parameters())\n    with fwAD.dual_level():",
        "    return param_jvp_func(model, x, tangents)\n    params = dict(model.named_parameters())\n"
        "    with fwAD.dual_level():", "inside torch.func"),
    "param_jvp_func: forward_ad instead of torch.func": (
        "param_jvp_func", "    primals = {name: params[name] for name in tangents}\n",
        "    return param_jvp(model, x, tangents)\n", "outside torch.func"),
    "param_jvp_func: tangent of the wrong parameter": (
        "param_jvp_func", "(dict(tangents),))", "(dict(zip(tangents, [tangents[n] * 2 for n in tangents])),))",
        r"J @ v"),
    "sinc: jvp uses the value": (
        "sinc", "        return x_tangent * sinc_derivative(x)", "        return x_tangent * sinc_value(x)",
        "Jacobian computed with forward mode mismatch"),
    "sinc: backward uses the value": (
        "sinc", "        return grad_output * sinc_derivative(x)", "        return grad_output * sinc_value(x)",
        "gradcheck.*Jacobian mismatch"),
    "sinc: textbook derivative, guarded only at 0": (
        "sinc", "    return torch.where(small, series, (torch.cos(safe) - torch.sin(safe) / safe) / safe)",
        "    return torch.where(x == 0, torch.zeros_like(x), (torch.cos(x) - torch.sin(x) / x) / x)",
        r"gradient of Sinc \(backward\)"),
    "sinc: textbook value": (
        "sinc", "    return torch.where(small, series, torch.sin(safe) / safe)", "    return torch.sin(x) / x", "NaN"),
    "sinc: derivative series cut after one term": (
        "sinc", "    series = -x / 3 * (1 - x2 / 10 * (1 - x2 / 28))", "    series = -x / 3",
        r"gradient of Sinc \(backward\)"),
    "sinc: nothing saved for forward mode": (
        "sinc", "        ctx.save_for_forward(x)\n", "", "gradcheck.*raised"),
    "jacobians: forward columns in a Python loop": (
        "jacobians", "    return vmap(column, out_dims=1)(basis)",
        "    return torch.stack([column(v) for v in basis], dim=1)", "called f 5 times"),
    "jacobians: forward Jacobian by jacrev": (
        "jacobians", "    return vmap(column, out_dims=1)(basis)", "    return jacrev(f)(x)", "differentiated f by reverse mode"),
    "jacobians: reverse Jacobian by jacfwd": (
        "jacobians", "    out, pullback = vjp(f, x)\n", "    return jacfwd(f)(x)\n", "differentiated f by forward mode"),
    "jacobians: forward Jacobian transposed": (
        "jacobians", "    return vmap(column, out_dims=1)(basis)", "    return vmap(column)(basis)", "the transpose"),
}


def run_check(kind, m):
    if kind == "dual":
        C.check_dual(m.Dual)
    elif kind == "param_jvp":
        C.check_param_jvp(m.param_jvp)
    elif kind == "param_jvp_func":
        C.check_param_jvp_func(m.param_jvp_func)
    elif kind == "sinc":
        C.check_sinc(m.Sinc)
    elif kind == "jacobians":
        C.check_jacobians(m.jacobian_fwd, m.jacobian_rev)


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_each_check_catches_a_planted_mistake(mistake, mutate4):
    kind, old, new, says = MISTAKES[mistake]
    m = mutate4(old, new)
    with pytest.raises(AssertionError, match=re.compile(says, re.S)):
        run_check(kind, m)


def test_all_parameters_made_dual_fails_only_when_some_are_constants(mutate4):
    m = mutate4("{name: fwAD.make_dual(params[name], t) for name, t in tangents.items()}",
                "{name: fwAD.make_dual(p, tangents[name]) for name, p in params.items()}")
    C.check_param_jvp(m.param_jvp)  # every parameter has a tangent: the mistake is invisible
    with pytest.raises(AssertionError, match="KeyError"):
        C.check_param_jvp(m.param_jvp, seed=3, subset=True)


@pytest.fixture
def clock_only(monkeypatch):
    """The speed check's clock alone: its structure gate (forward mode, all k tangents) left out."""
    monkeypatch.setattr(C, "_tall_structure", lambda *a, **k: None)


def test_speed_check_fails_when_forward_mode_is_not_faster(fad, clock_only):
    with pytest.raises(AssertionError, match="bar on this device is 1.50x"):
        # "forward" that is really reverse mode done twice: clearly slower, so no noise can pass it
        C.check_jacobian_speed(lambda f, x: (fad.jacobian_rev(f, x), fad.jacobian_rev(f, x))[1], bars=BARS,
                               attempts=2, **SPEED)


def test_speed_check_verifies_every_output_it_times(fad, clock_only):
    with pytest.raises(AssertionError, match="on the function it is timed on"):
        C.check_jacobian_speed(lambda f, x: fad.jacobian_fwd(f, x) * 1.01, bars={"cpu": 0.01, "cuda": 0.01}, **SPEED)
    # Right once, where the check looks first (every element compared); wrong where it is timed, where
    # each call's outputs are compared by checksums (course.remote.checksum). Scaled by 1.01, the weighted
    # and plain sums alone missed it in half the calls (measured on this function, 300 fresh points: three
    # short rounds once let every timed call through, CI 2026-12-04); the norm moves by 1%, beyond its
    # tolerance of 4 * rtol = 0.4%, so since grader version 52 every timed call is caught.
    calls = iter(range(10**6))

    def right_once(f, x):
        return fad.jacobian_fwd(f, x) * (1.0 if next(calls) == 0 else 1.01)

    with pytest.raises(AssertionError, match="the output of a timed call differs from reverse"):
        C.check_jacobian_speed(right_once, bars={"cpu": 0.01, "cuda": 0.01}, **SPEED)


# -- the helpers and the references ------------------------------------------------------------

def test_wide_function_closed_form_jacobian_matches_autograd():
    f = FA.WideFunction(3, 5, 7, seed=1, dtype=torch.float64)
    x = torch.randn(3, dtype=torch.float64)
    torch.testing.assert_close(R.wide_jacobian(f, x), torch.autograd.functional.jacobian(f, x))
    torch.testing.assert_close(R.central_differences(f, x), R.wide_jacobian(f, x), rtol=1e-6, atol=1e-8)
    assert f.calls > 0 and "R^3 -> R^5" in repr(f)
    with pytest.raises(ValueError, match="vector of 3"):
        f(torch.randn(4, dtype=torch.float64))


def test_one_mode_functions_refuse_the_other_mode():
    x = torch.randn(3, dtype=torch.float64)
    fwd = FA.WideFunction(3, 4, 5, seed=0, mode="forward", dtype=torch.float64)
    rev = FA.WideFunction(3, 4, 5, seed=0, mode="reverse", dtype=torch.float64)
    torch.testing.assert_close(torch.func.jacfwd(fwd)(x), R.wide_jacobian(fwd, x))
    torch.testing.assert_close(torch.func.jacrev(rev)(x), R.wide_jacobian(rev, x))
    with pytest.raises(FA.ModeNotAllowed):
        torch.func.jacrev(fwd)(x)
    with pytest.raises(FA.ModeNotAllowed):
        torch.func.jacfwd(rev)(x)
    with pytest.raises(ValueError, match="mode must be"):
        FA.WideFunction(3, 4, 5, seed=0, mode="sideways")


def test_transform_in_use_sees_jvp_and_nothing_outside():
    seen = []

    def f(x):
        seen.append(FA.transform_in_use())
        return x * 2

    f(torch.ones(2))
    torch.func.jvp(f, (torch.ones(2),), (torch.ones(2),))
    torch.func.vmap(f)(torch.ones(3, 2))
    assert seen == [None, "Jvp", "Vmap"]


def test_mlp_is_seeded_and_smooth():
    a, b = FA.mlp((4, 8, 2), seed=3), FA.mlp((4, 8, 2), seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert any(isinstance(m, torch.nn.LayerNorm) for m in a) and not any(
        isinstance(m, torch.nn.LayerNorm) for m in FA.mlp((4, 8, 2), seed=3, norm=False))
    assert next(a.parameters()).dtype == torch.float64


def test_sinc_references_agree_with_torch_and_the_series():
    x = torch.tensor([-20.0, -3.0, -0.7, 0.5, 0.6, 1.0, 2.0, 7.5], dtype=torch.float64)
    torch.testing.assert_close(R.sinc_reference(x), torch.sinc(x / math.pi), rtol=1e-14, atol=1e-15)
    closed = (x * torch.cos(x) - torch.sin(x)) / (x * x)
    torch.testing.assert_close(R.sinc_derivative_reference(x), closed, rtol=1e-13, atol=1e-15)
    tiny = torch.tensor([0.0, 1e-300, 1e-9, -1e-4, 0.01, -0.03], dtype=torch.float64)
    torch.testing.assert_close(R.sinc_reference(tiny), 1 - tiny**2 / 6 + tiny**4 / 120 - tiny**6 / 5040 + tiny**8 / 362880,
                               rtol=1e-15, atol=0.0)
    torch.testing.assert_close(R.sinc_derivative_reference(tiny),
                               -tiny / 3 + tiny**3 / 30 - tiny**5 / 840 + tiny**7 / 45360 - tiny**9 / 3991680,
                               rtol=1e-14, atol=0.0)


def test_plot_jacobian_sweep_draws_two_lines():
    ax = FA.plot_jacobian_sweep([4, 16, 64], [1e-3, 1e-3, 2e-3], [5e-4, 1e-3, 8e-3], k=16)
    assert len(ax.get_lines()) == 3  # two curves and the m = k line
    with pytest.raises(ValueError, match="one entry per output size"):
        FA.plot_jacobian_sweep([4, 16], [1e-3], [1e-3, 2e-3], k=4)


def test_the_planted_legacy_jacobian_fails_the_bar_and_its_forward_knob_passes():
    """Exercise 6: torch.autograd.functional.jacobian with its defaults (reverse mode, a loop) and with
    vectorize=True alone (still reverse) fall far below the bar; strategy='forward-mode' clears it."""
    from torch.autograd.functional import jacobian

    from course.forward_ad import tall_jacobian_planted

    for slow in (tall_jacobian_planted, lambda f, x: jacobian(f, x, vectorize=True)):
        with pytest.raises(AssertionError, match="tall_jacobian differentiated f by reverse mode"):
            C.check_jacobian_speed(slow, bars=BARS, attempts=1, **SPEED)
    C.check_jacobian_speed(forward_knob, bars=BARS, **SPEED)


def forward_knob(f, x):
    """Exercise 6 by the legacy API's forward-mode knob: a program the grader reads and runs again."""
    return torch.autograd.functional.jacobian(f, x, vectorize=True, strategy="forward-mode")


# -- a learner's copy of the course: no grader references, stored answers ---------------------------

def test_without_the_grader_references_the_visible_checks_use_stored_answers(learners_copy, fad, capsys):
    """The visible calls (the defaults) compare with the stored float64 answers; other arguments
    are refused honestly (the grader checks those)."""
    C.check_param_jvp(fad.param_jvp)
    C.check_param_jvp_func(fad.param_jvp_func)
    C.check_sinc(fad.Sinc)
    C.check_jacobians(fad.jacobian_fwd, fad.jacobian_rev)
    assert capsys.readouterr().out.count("ok: ") == 4
    for refused in (lambda: C.check_param_jvp(fad.param_jvp, seed=2), lambda: C.check_sinc(fad.Sinc, n=200),
                    lambda: C.check_jacobians(fad.jacobian_fwd, fad.jacobian_rev, k=3),
                    lambda: C.check_param_jvp_func(fad.param_jvp_func, subset=True)):
        with pytest.raises(AssertionError, match="reference data for .* only"):
            refused()


@pytest.mark.parametrize("mistake", sorted(m for m in MISTAKES if MISTAKES[m][0] != "dual"))
def test_without_the_grader_references_a_planted_mistake_fails_with_its_cause(mistake, learners_copy, mutate4):
    """Each planted mistake fails the visible call with the message the grader's references give
    (the Dual check needs none: torch.func.jvp of the same expression is its reference)."""
    kind, old, new, says = MISTAKES[mistake]
    with pytest.raises(AssertionError, match=re.compile(says, re.S)):
        run_check(kind, mutate4(old, new))


def test_without_the_grader_references_a_wrong_jacobian_of_the_right_shape_fails(learners_copy, mutate4):
    m = mutate4("    basis = torch.eye(x.numel(), dtype=x.dtype, device=x.device)\n",
                "    basis = torch.eye(x.numel(), dtype=x.dtype, device=x.device).flip(0)\n")
    with pytest.raises(AssertionError, match=r"jacobian_fwd\(f, x\) \(vs the closed-form Jacobian\)"):
        C.check_jacobians(m.jacobian_fwd, m.jacobian_rev)


def test_without_the_grader_references_the_speed_baseline_is_the_learners_jacobian_rev(learners_copy, fad,
                                                                                      monkeypatch, clock_only):
    sizes = dict(k=3, m=40, hidden=8)
    with pytest.raises(AssertionError, match="needs your jacobian_rev"):
        C.check_jacobian_speed(fad.tall_jacobian, bars=BARS, **sizes)
    with pytest.raises(AssertionError, match="on the function it is timed on"):
        C.check_jacobian_speed(lambda f, x: fad.tall_jacobian(f, x) * 1.01, fad.jacobian_rev, bars=BARS, **sizes)
    seen = []
    monkeypatch.setattr(C, "served_speedup", lambda baseline, candidate, **kw: seen.append(baseline))
    C.check_jacobian_speed(fad.tall_jacobian, fad.jacobian_rev, bars=BARS, **sizes)
    assert seen == [("reverse (m VJPs)", fad.jacobian_rev)]


def test_with_the_grader_references_the_speed_baseline_is_the_graders(fad, monkeypatch):
    seen = []
    monkeypatch.setattr(C, "served_speedup", lambda baseline, candidate, **kw: seen.append(baseline))
    C.check_jacobian_speed(fad.tall_jacobian, fad.jacobian_rev, bars=BARS, k=3, m=40, hidden=8)
    assert seen == [("reverse (m VJPs)", R.reverse_jacobian)]


def test_the_stored_answers_are_for_the_visible_calls():
    """What reference_data stores is what the checks' defaults ask, on the lesson's own call."""
    data = C.reference_data()
    for check in (C.check_param_jvp, C.check_param_jvp_func, C.check_sinc, C.check_jacobians):
        for name, default in visible_call(check).items():
            assert data[name] == (tuple(default) if name == "sizes" else default), (check.__name__, name)
    assert R.DATA_FILES == {C.DATA_FILE: R.forward_ad_data}


def test_no_lesson_cell_uses_the_grader_references():
    """The lesson's own cells run in the learner's process, where course.references does not exist."""
    nb = json.loads((Path(__file__).resolve().parents[1] / "solutions" / LESSON / f"{LESSON}.ipynb").read_text())
    code = [cells.source(c) for c in nb["cells"] if c["cell_type"] == "code" and not cells.is_test(c)]
    for name in ("course.references", *R.__all__):
        assert not any(name in cell for cell in code), name

"""Lesson 5's checks (Jacobians, Hessians, HVPs): the instructor's solutions pass every one, and
every one fails on the untouched student stub and on a planted mistake aimed at it. Solutions and
mistakes come from the instructor notebook itself. Also: the hand-written derivatives of the
grader's references (course.references.jacobians) and the op watcher in course.jacobians, which
the checks trust; and, without the references (a learner's copy), the visible checks on the
answers stored for them."""


import pytest
import torch
from torch.func import grad, hessian, jacfwd, jacrev, vmap

from autograder.solution_code import load_solution, solution_source
from course import jacobians as J
from course.checks import jacobians as C
from course.references import jacobians as R
from served_helpers import UNDECIDED, never_failed

LESSON = "05_jacobians_hessians"
F64 = torch.float64
QUICK = dict(rounds=3, min_run_time=0.02, num_threads=1)


@pytest.fixture(scope="module")
def base_source():
    return solution_source(LESSON)


@pytest.fixture(scope="module")
def jac_solution(base_source, tmp_path_factory):
    return load_solution(base_source, tmp_path_factory.mktemp("sol5") / "jac_solution.py", "jac_solution")


@pytest.fixture(scope="module")
def mutate5(base_source, tmp_path_factory):
    """``mutate5(old, new)``: lesson 5's solutions with one planted mistake, as a module."""
    counter = iter(range(10**6))

    def make(old: str, new: str):
        assert old in base_source, f"the planted mistake's anchor is not in the solution: {old!r}"
        name = f"jac_mutant_{next(counter)}"
        return load_solution(base_source.replace(old, new), tmp_path_factory.mktemp("mut5") / f"{name}.py", name)

    return make


def stub(*args, **kwargs):
    raise NotImplementedError()


# -- the helpers the checks trust ------------------------------------------------------------------

def test_tanh_layer_jacobian_formula_matches_autograd():
    for layer in (J.tanh_layer(7, 5, seed=1, dtype=F64), J.banded_layer(9, width=3, seed=2, dtype=F64)):
        x = torch.randn(layer.n_in, dtype=F64)
        torch.testing.assert_close(R.tanh_jacobian(layer, x), jacrev(layer)(x))
        torch.testing.assert_close(R.tanh_jacobian(layer, x), jacfwd(layer)(x))


def test_normed_layer_jacobian_formula_matches_autograd():
    norm = J.normed_layer(5, 7, seed=3, dtype=F64)
    xs = torch.randn(4, 7, dtype=F64)
    per_sample = torch.stack([jacrev(lambda x: norm(x[None])[0])(x) for x in xs])
    torch.testing.assert_close(R.normed_batched_jacobian(norm, xs), per_sample)


def test_the_course_sample_loop_gives_the_jacobians_and_the_hessians():
    layer, e = J.tanh_layer(6, 4, seed=1, dtype=F64), J.energy(5, seed=2, dtype=F64)
    xs, xs_e = torch.randn(3, 4, dtype=F64), torch.randn(3, 5, dtype=F64)
    torch.testing.assert_close(R.sample_loop(layer, xs), vmap(jacrev(layer))(xs))
    torch.testing.assert_close(R.sample_loop(layer, xs, of_batch=True), vmap(jacrev(layer))(xs))
    torch.testing.assert_close(R.sample_loop(e, xs_e, hessian=True), vmap(hessian(e))(xs_e))


def test_the_functions_carry_no_derivative_a_learner_could_call():
    """Built in the learner's process too (they cross as recipes): only the gradient, an input, stays."""
    assert not any(hasattr(J.TanhLayer, m) for m in ("jacobian", "parameter_jacobians"))
    assert not hasattr(J.NormedLayer, "batched_jacobian")
    assert not any(hasattr(J.Energy, m) for m in ("hessian", "hvp")) and hasattr(J.Energy, "gradient")
    assert not any(hasattr(C, m) for m in ("_course_row_loop", "_course_hessian"))


def test_banded_layer_is_banded():
    w = J.banded_layer(12, width=5, seed=0).weight
    i = torch.arange(12)
    outside = (i[:, None] - i[None, :]).abs() > 2
    assert torch.all(w[outside] == 0) and torch.all(w[~outside] != 0)


def test_energy_derivative_formulas_match_autograd():
    e = J.energy(13, k=3, seed=4, dtype=F64)
    x, v = torch.randn(13, dtype=F64), torch.randn(13, dtype=F64)
    torch.testing.assert_close(e.gradient(x), grad(e)(x))
    torch.testing.assert_close(R.energy_hessian(e, x), hessian(e)(x))
    torch.testing.assert_close(R.energy_hvp(e, x, v), hessian(e)(x) @ v)
    torch.testing.assert_close(jacrev(e.gradient)(x), R.energy_hessian(e, x))


def _hvp_ways():
    """Each way to take H(x) @ v by differentiating f, with the exercise whose mode it is (None: neither)."""
    import torch.autograd.forward_ad as fw
    from torch.func import jvp, vjp

    def autograd_twice(f, x, v):
        y = x.detach().requires_grad_()
        g = torch.autograd.grad(f(y), y, create_graph=True)[0]
        return torch.autograd.grad(g @ v, y)[0]

    def duals_through_autograd(f, x, v):
        with fw.dual_level():
            y = fw.make_dual(x.detach().requires_grad_(), v)
            return fw.unpack_dual(torch.autograd.grad(f(y), y)[0]).tangent

    return {"jvp of grad": ("hvp_fwd_rev", lambda f, x, v: jvp(grad(f), (x,), (v,))[1]),
            "forward AD's duals through autograd.grad": ("hvp_fwd_rev", duals_through_autograd),
            "grad of grad . v": ("hvp_rev_rev", lambda f, x, v: grad(lambda y: torch.dot(grad(f)(y), v))(x)),
            "vjp of grad": ("hvp_rev_rev", lambda f, x, v: vjp(grad(f), x)[1](v)[0]),
            "autograd.grad twice": ("hvp_rev_rev", autograd_twice),
            "grad of jvp (reverse over forward)": (None, lambda f, x, v: grad(lambda y: jvp(f, (y,), (v,))[1])(x)),
            "differences of the gradient": (None, lambda f, x, v: (grad(f)(x + 1e-4 * v) - grad(f)(x - 1e-4 * v)) / 2e-4),
            "one-sided differences from x": (None, lambda f, x, v: (grad(f)(x + 1e-7 * v) - grad(f)(x)) / 1e-7)}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("exercise", J.HVP_EXERCISES)
def test_an_hvp_mark_is_seen_by_its_exercises_mode_at_its_point_and_by_nothing_else(exercise, seed):
    """A marked energy is the plain one in value and gradient, at its point and beside it; an HVP
    taken there in the exercise's mode (every way of writing it) gains exactly the mark's (w . v) w,
    and every other HVP (the other mode, reverse over forward, differences) gains nothing."""
    n = 9
    x, v = torch.randn(n, dtype=F64, generator=torch.Generator().manual_seed(seed)), torch.randn(n, dtype=F64)
    marked = J.energy(n, seed=seed, dtype=F64, watched=True, mark=(exercise, 0, 77 + seed))
    marked.mark.x0 = x.clone()  # the point the check passes (drawn from its seed there)
    plain = J.energy(n, seed=seed, dtype=F64)
    for y in (x, x + 1e-6 * v, x.double().clone()):
        assert torch.equal(marked(y), plain(y))
        assert torch.equal(grad(marked)(y), grad(plain)(y))
    hv = R.energy_hvp(plain, x, v)
    extra = marked.mark.hv(v)
    assert torch.all(extra.abs() >= 0.5 * v.abs())
    for way, (mode, fn) in _hvp_ways().items():
        want = hv + extra if mode == exercise else hv
        torch.testing.assert_close(fn(marked, x, v), want, rtol=1e-5 if "differences" in way else 1e-9,
                                   atol=1e-5 if "differences" in way else 1e-11, msg=lambda m: f"{way}: {m}")
    J.MODES_SEEN.clear()


def test_an_hvp_mark_is_checked_and_drawn_at_the_checks_point():
    x = J.energy(5, seed=1, dtype=F64, watched=True, mark=("hvp_rev_rev", 31, 4)).mark.x0
    from course.data import randn

    assert torch.equal(x, randn(5, seed=31, dtype=F64))
    for bad in (("hvp_fwd", 1, 2), ("hvp_rev_rev", 1), ("hvp_rev_rev", 1.0, 2)):
        with pytest.raises(ValueError):
            J.energy(5, dtype=F64, watched=True, mark=bad)
    with pytest.raises(ValueError, match="watched"):
        J.energy(5, dtype=F64, mark=("hvp_rev_rev", 1, 2))
    from course.allowed_ops import ATTRIBUTES

    assert not {"mark", "x0", "w", "term", "hv"} & ATTRIBUTES  # a program run again cannot read it


@pytest.mark.parametrize("seen, fwd_rev, rev_rev", [
    ([["forward", "reverse"]], True, False),  # jvp of grad
    ([["reverse"], ["forward", "reverse"]], True, False),
    ([["reverse", "forward"]], False, False),  # reverse over forward: neither exercise
    ([["reverse", "reverse"]], False, True),  # grad of grad, or autograd.grad twice
    ([["reverse", "reverse"], ["forward"]], False, False),  # a forward level anywhere: not reverse over reverse
    ([["reverse"], ["reverse"]], False, False),  # differences of gradients: one level each
    ([], False, False),  # a formula: f never evaluated
])
def test_an_hvp_runs_mode_is_read_from_all_its_evaluations(seen, fwd_rev, rev_rev):
    assert J.hvp_run_matches("hvp_fwd_rev", seen) is fwd_rev
    assert J.hvp_run_matches("hvp_rev_rev", seen) is rev_rev
    with pytest.raises(ValueError, match="no HVP exercise"):
        J.hvp_run_matches("hvp", seen)


def test_makers_are_seeded_and_reject_bad_sizes():
    a, b = J.tanh_layer(4, 3, seed=9), J.tanh_layer(4, 3, seed=9)
    assert torch.equal(a.weight, b.weight) and not torch.equal(a.weight, J.tanh_layer(4, 3, seed=8).weight)
    assert J.energy(50, seed=0, device="meta").A.device.type == "meta"
    with pytest.raises(ValueError, match="at least one output"):
        J.tanh_layer(0, 3)
    with pytest.raises(ValueError, match="n >= 2"):
        J.energy(1)


def test_tensor_watch_counts_ops_and_measures_storage_not_views():
    x = torch.randn(1000)
    with J.TensorWatch() as w:
        y = x.expand(1000, 1000) * 1.0      # a real 1000 x 1000 result
        z = x.expand(1000, 1000)            # a view: no new memory
    assert w.ops == 3
    assert w.largest_bytes == 1000 * 1000 * 4 and w.largest_shape == (1000, 1000) and w.largest_op == "mul"
    with J.TensorWatch() as w2:
        x.expand(1000, 1000)
    assert w2.largest_bytes == 4000, "an expanded view shares the small storage"
    assert "ops; largest tensor" in w.summary() and y.shape == z.shape


def test_tensor_watch_sees_backward_and_vmap_and_meta():
    e = J.energy(40_000, seed=0, device="meta", dtype=F64)
    x = torch.empty(40_000, device="meta", dtype=F64)
    with J.TensorWatch() as w:
        hessian(e)(x)
    assert w.largest_bytes >= 40_000 ** 2 * 8
    assert J.format_bytes(w.largest_bytes).endswith("GB")


def test_plots_draw_and_reject_bad_input():
    assert J.plot_matrix(torch.randn(5, 4)) is not None
    assert J.plot_crossover([(4, 1), (2, 2), (1, 4)], [1e-3, 2e-3, 3e-3], [3e-3, 2e-3, 1e-3]) is not None
    with pytest.raises(ValueError, match="2-D"):
        J.plot_matrix(torch.randn(3))
    with pytest.raises(ValueError, match="as many"):
        J.plot_crossover([(4, 1)], [1e-3], [])


# -- the checks --------------------------------------------------------------------------------------

def test_solutions_pass_every_check(jac_solution):
    s = jac_solution
    C.check_row_jacobian(s.jacobian_rows, seed=4, n_out=6, n_in=11)
    C.check_batched_jacobian_sum(s.batched_jacobian_sum, seed=4, batch=1, n_out=3, n_in=2)
    C.check_largest_chunk(s.largest_chunk, seed=9)
    C.check_pick_jacobian(s.pick_jacobian, seed=2)
    C.check_parameter_jacobians(s.parameter_jacobians, seed=3, n_out=4, n_in=2)
    C.check_parameter_jacobians(s.parameter_jacobians, seed=5, n_out=1, n_in=1)
    C.check_batched_jacobian(s.batched_jacobian, seed=1, batch=1, n_out=3, n_in=2)
    C.check_batched_hessian(s.batched_hessian, seed=1, batch=4, n=2)
    C.check_hvp(s.hvp_fwd_rev, s.hvp_rev_rev, seed=2, n=5, big_n=50_000)


def test_speed_checks_pass_the_solutions(jac_solution):
    # (the instructor's run read a lower bound of 3.65x at these sizes: a busy machine may leave it undecided)
    reports = never_failed(lambda: C.check_picker_speed(jac_solution.pick_jacobian, bars={"cpu": 3.0, "cuda": 2.0},
                                                        tall=(2048, 32), wide=(32, 2048), **QUICK))
    assert reports is UNDECIDED or set(reports) == {"tall", "wide"}


@pytest.mark.parametrize("check", [
    lambda: C.check_row_jacobian(stub),
    lambda: C.check_batched_jacobian_sum(stub),
    lambda: C.check_largest_chunk(stub),
    lambda: C.check_pick_jacobian(stub),
    lambda: C.check_picker_speed(stub, bars={"cpu": 3.0, "cuda": 2.0}, tall=(64, 4), wide=(4, 64), **QUICK),
    lambda: C.check_batched_jacobian(stub),
    lambda: C.check_batched_hessian(stub),
    lambda: C.check_hvp(stub, stub),
    lambda: C.check_parameter_jacobians(stub),
], ids=["rows", "batched_sum", "largest_chunk", "pick", "pick_speed", "batched_jacobian", "batched_hessian", "hvp", "argnums"])
def test_untouched_stub_fails_with_a_friendly_message(check):
    with pytest.raises(AssertionError, match="not written yet"):
        check()


def test_one_hvp_written_and_the_other_left_as_the_stub_fails(jac_solution):
    with pytest.raises(AssertionError, match="hvp_rev_rev is not written yet"):
        C.check_hvp(jac_solution.hvp_fwd_rev, stub)


def test_picker_speed_refuses_shapes_that_are_not_tall_and_wide(jac_solution):
    with pytest.raises(ValueError, match="tall must have more outputs"):
        C.check_picker_speed(jac_solution.pick_jacobian, bars={"cpu": 3.0, "cuda": 2.0}, tall=(4, 64), wide=(64, 4))


# (check, anchor in the solution, planted mistake, what the message must say)
MISTAKES = {
    "rows: graph freed after the first row": (
        "rows", "torch.autograd.grad(y[i], x, retain_graph=True)[0]", "torch.autograd.grad(y[i], x)[0]",
        "raised RuntimeError"),
    "rows: gradients stacked as columns": (
        "rows", "    return torch.stack(rows)\n", "    return torch.stack(rows, dim=1)\n", "returned shape"),
    "rows: jacrev instead of the loop": (
        "rows", "    rows = [torch.autograd.grad(y[i], x, retain_graph=True)[0] for i in range(y.shape[0])]\n"
                "    return torch.stack(rows)\n", "    return jacrev(f)(x)\n", "write the loop"),
    "rows: the caller's x made to require grad": (
        "rows", "    x = x.detach().requires_grad_(True)\n    y = f(x)\n    rows =",
        "    x.requires_grad_(True)\n    y = f(x)\n    rows =", "switched on requires_grad of the caller's x"),
    "rows: sign flipped": (
        "rows", "    return torch.stack(rows)\n", "    return -torch.stack(rows)\n", "the opposite sign"),
    "sum: the batch left in the middle": (
        "bsum", "    return by_output.movedim(1, 0)\n", "    return by_output\n", "the batch dimension is in the middle"),
    "sum: the Jacobian of the whole batch": (
        "bsum", "jacrev(lambda batch: f(batch).sum(0))(xs)", "jacrev(f)(xs)", "every sample against every other"),
    "sum: every dimension summed": (
        "bsum", "jacrev(lambda batch: f(batch).sum(0))(xs)", "jacrev(lambda batch: f(batch).sum())(xs)",
        "one number differentiated"),
    "sum: averaged over the batch": (
        "bsum", "f(batch).sum(0)", "f(batch).mean(0)", "averaged over the batch"),
    "sum: vmap, which the BatchNorm refuses": (
        "bsum", "    by_output = jacrev(lambda batch: f(batch).sum(0))(xs)", "    return vmap(jacrev(f))(xs)",
        "refuses a single sample"),
    "sum: a loop over the samples": (
        "bsum", "    by_output = jacrev(lambda batch: f(batch).sum(0))(xs)",
        "    return torch.stack([jacrev(lambda x: f(x[None])[0])(x) for x in xs])", "a Python loop over the samples"),
    "sum: transposed Jacobians": (
        "bsum", "    return by_output.movedim(1, 0)\n", "    return by_output.permute(1, 2, 0)\n", "expected shape"),
    "pick: forward mode on a tie": (
        "pick", "return jacfwd if n_out > x.numel() else jacrev", "return jacfwd if n_out >= x.numel() else jacrev",
        "expected jacrev"),
    "pick: modes swapped": (
        "pick", "return jacfwd if n_out > x.numel() else jacrev", "return jacrev if n_out > x.numel() else jacfwd",
        "expected jacfwd"),
    "pick: first dimension instead of elements": (
        "pick", "n_out = f(x).numel()\n    return jacfwd if n_out > x.numel() else jacrev",
        "n_out = f(x).shape[0]\n    return jacfwd if n_out > x.shape[0] else jacrev", r"numel"),
    "pick: names instead of transforms": (
        "pick", "return jacfwd if n_out > x.numel() else jacrev",
        "return 'jacfwd' if n_out > x.numel() else 'jacrev'", "the string"),
    "batched jacobian: no vmap": (
        "bjac", "return vmap(jacrev(f))(xs)", "return jacrev(f)(xs)", "returned shape"),
    "batched jacobian: a loop over the samples": (
        "bjac", "return vmap(jacrev(f))(xs)", "return torch.stack([jacrev(f)(x) for x in xs])",
        "loop over the samples"),
    "batched hessian: one derivative only": (
        "bhes", "return vmap(hessian(f))(xs)", "return vmap(jacrev(f))(xs)", "returned shape"),
    "batched hessian: a loop over the samples": (
        "bhes", "return vmap(hessian(f))(xs)", "return torch.stack([hessian(f)(x) for x in xs])",
        "loop over the samples"),
    "hvp fwd-rev: the whole Hessian": (
        "hvp", "return jvp(grad(f), (x,), (v,))[1]", "return hessian(f)(x) @ v", "built the Hessian"),
    "hvp fwd-rev: the gradient instead": (
        "hvp", "return jvp(grad(f), (x,), (v,))[1]", "return jvp(grad(f), (x,), (v,))[0]", "it returned the gradient"),
    "hvp rev-rev: jacrev of the gradient": (
        "hvp", "return grad(lambda y: torch.dot(grad(f)(y), v))(x)", "return jacrev(grad(f))(x) @ v",
        "built the Hessian"),
    "hvp rev-rev: v forgotten": (
        "hvp", "return grad(lambda y: torch.dot(grad(f)(y), v))(x)", "return grad(lambda y: grad(f)(y).sum())(x)",
        "v never reached the result"),
    "hvp fwd-rev: reads a Python number": (
        "hvp", "return jvp(grad(f), (x,), (v,))[1]",
        "return jvp(grad(f), (x,), (v,))[1] * (1.0 + 0.0 * float(v.sum()))", "meta"),
    "hvp fwd-rev: finite differences of the gradient (four points)": (
        "hvp", "return jvp(grad(f), (x,), (v,))[1]",
        "g, h, x2, v2 = grad(f.to(torch.float64)), 1e-3, x.double(), v.double()\n"
        "    d = [g(x2 + k * h * v2) for k in (-2, -1, 1, 2)]\n"
        "    return ((d[0] - 8 * d[1] + 8 * d[2] - d[3]) / (12 * h)).to(x.dtype)", "hvp_fwd_rev evaluated f 4 time"),
    "hvp fwd-rev: reverse over forward": (
        "hvp", "return jvp(grad(f), (x,), (v,))[1]", "return grad(lambda y: jvp(f, (y,), (v,))[1])(x)",
        "by reverse over forward"),
    "hvp fwd-rev: reverse over reverse": (
        "hvp", "return jvp(grad(f), (x,), (v,))[1]", "return grad(lambda y: torch.dot(grad(f)(y), v))(x)",
        "hvp_fwd_rev must push v forward"),
    "hvp fwd-rev: jvp of the hand-written gradient": (
        "hvp", "return jvp(grad(f), (x,), (v,))[1]", "return jvp(f.gradient, (x,), (v,))[1]", "never evaluated f"),
    "hvp fwd-rev: the right call made for show, reverse over reverse returned": (
        "hvp", "return jvp(grad(f), (x,), (v,))[1]",
        "jvp(grad(f), (x,), (v,))\n    return grad(lambda y: torch.dot(grad(f)(y), v))(x)",
        "not the value its own differentiation of f at x gave"),
    "hvp rev-rev: the right call made for show, forward over reverse returned": (
        "hvp", "return grad(lambda y: torch.dot(grad(f)(y), v))(x)",
        "grad(lambda y: torch.dot(grad(f)(y), v))(x + 1)\n    return jvp(grad(f), (x,), (v,))[1]",
        "hvp_rev_rev must take the gradient of a gradient"),
    "hvp rev-rev: the right call made for show, a formula returned": (
        "hvp", "return grad(lambda y: torch.dot(grad(f)(y), v))(x)",
        "grad(lambda y: torch.dot(grad(f)(y), v))(x)\n"
        "    s = torch.sigmoid(f.A @ x + f.c)\n"
        "    return f.A.T @ (s * (1 - s) * (f.A @ v)) - f.d * torch.cos(x) * v + f._neighbours(v)",
        "not the value its own differentiation of f at x gave"),
    "hvp rev-rev: forward over reverse": (
        "hvp", "return grad(lambda y: torch.dot(grad(f)(y), v))(x)", "return jvp(grad(f), (x,), (v,))[1]",
        "hvp_rev_rev must take the gradient of a gradient"),
    "hvp rev-rev: finite differences through autograd": (
        "hvp", "return grad(lambda y: torch.dot(grad(f)(y), v))(x)",
        "h, out, f2 = 1e-3, [], f.to(torch.float64)\n    for k in (-2, -1, 1, 2):\n"
        "        y = (x.double() + k * h * v.double()).requires_grad_()\n"
        "        out.append(torch.autograd.grad(f2(y), y, create_graph=True)[0])\n"
        "    return ((out[0] - 8 * out[1] + 8 * out[2] - out[3]) / (12 * h)).to(x.dtype)",
        "hvp_rev_rev must take the gradient of a gradient"),
    "chunk: the Jacobian itself forgotten (a chunk that cannot fit)": (
        "chunk", "    if peak(1) > budget_bytes:\n        raise ValueError", "    if False:\n        raise ValueError",
        "That tensor is the Jacobian itself"),
    "chunk: powers of two only": (
        "chunk", "    return lo\n", "    return 1 << (lo.bit_length() - 1)\n", "not only powers of two"),
    "chunk: one past the largest": (
        "chunk", "    return lo\n", "    return min(lo + 1, f(x).numel())\n", "over the budget"),
    "chunk: a formula for 4-byte numbers": (
        "chunk", "    lo, hi = 1, f(x).numel()",
        "    return max(1, min(f(x).numel(), budget_bytes // (4 * f(x).numel())))\n    lo, hi = 1, f(x).numel()",
        "8 bytes a number"),
    "chunk: the budget compared the wrong way": (
        "chunk", "if peak(mid) <= budget_bytes:", "if peak(mid) >= budget_bytes:", "largest_chunk returned"),
    "chunk: a float for an int": (
        "chunk", "    return lo\n", "    return float(lo)\n", "should return an int"),
    "argnums: the weight's Jacobian only": (
        "argnums", "jacrev(predict, argnums=(0, 1))(weight, bias, x)", "jacrev(predict)(weight, bias, x)", "with respect to the weight alone"),
    "argnums: the Jacobian with respect to x": (
        "argnums", "jacrev(predict, argnums=(0, 1))(weight, bias, x)", "jacrev(predict, argnums=2)(weight, bias, x)", "with respect to x"),
    "argnums: bias and weight swapped": (
        "argnums", "jacrev(predict, argnums=(0, 1))(weight, bias, x)", "jacrev(predict, argnums=(1, 0))(weight, bias, x)", "returned \\(bias, weight\\)"),
    "argnums: x's Jacobian too": (
        "argnums", "jacrev(predict, argnums=(0, 1))(weight, bias, x)", "jacrev(predict, argnums=(0, 1, 2))(weight, bias, x)", "three Jacobians"),
    "argnums: a gradient instead of a Jacobian": (
        "argnums", "return jacrev(predict, argnums=(0, 1))(weight, bias, x)",
        "return tuple(torch.autograd.grad(predict(weight.requires_grad_(), bias.requires_grad_(), x).sum(),\n"
        "                                     (weight, bias)))", "gradients of the outputs' sum"),
    "argnums: the bias's Jacobian as its diagonal": (
        "argnums", "return jacrev(predict, argnums=(0, 1))(weight, bias, x)",
        "j_w, j_b = jacrev(predict, argnums=(0, 1))(weight, bias, x)\n    return j_w, j_b.diagonal()", "returned shape"),
    "speed: modes swapped": (
        "pspeed", "return jacfwd if n_out > x.numel() else jacrev", "return jacrev if n_out > x.numel() else jacfwd",
        "the right mode is jacfwd"),
}


def run_check(kind, m):
    if kind == "rows":
        C.check_row_jacobian(m.jacobian_rows)
    elif kind == "bsum":
        C.check_batched_jacobian_sum(m.batched_jacobian_sum)
    elif kind == "pick":
        C.check_pick_jacobian(m.pick_jacobian)
    elif kind == "bjac":
        C.check_batched_jacobian(m.batched_jacobian)
    elif kind == "bhes":
        C.check_batched_hessian(m.batched_hessian)
    elif kind == "hvp":
        C.check_hvp(m.hvp_fwd_rev, m.hvp_rev_rev)
    elif kind == "argnums":
        C.check_parameter_jacobians(m.parameter_jacobians)
    elif kind == "chunk":
        C.check_largest_chunk(m.largest_chunk)
    elif kind == "pspeed":
        C.check_picker_speed(m.pick_jacobian, bars={"cpu": 3.0, "cuda": 2.0}, tall=(2048, 32), wide=(32, 2048),
                             **QUICK)


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_each_check_catches_a_planted_mistake(mistake, mutate5):
    kind, old, new, says = MISTAKES[mistake]
    m = mutate5(old, new)
    with pytest.raises(AssertionError, match=says):
        run_check(kind, m)


def test_parameter_jacobians_formula_matches_autograd():
    layer = J.tanh_layer(4, 3, seed=2, dtype=F64)
    x = torch.randn(3, dtype=F64)
    j_w, j_b = R.tanh_parameter_jacobians(layer, x)
    ref_w, ref_b = jacrev(lambda w, b: torch.tanh(torch.nn.functional.linear(x, w, b)), argnums=(0, 1))(
        layer.weight, layer.bias)
    assert torch.allclose(j_w, ref_w) and torch.allclose(j_b, ref_b)
    assert j_w.shape == (4, 4, 3) and j_b.shape == (4, 4)


# -- a learner's copy: no references, the visible checks on stored answers ----------------------------

def test_without_the_grader_references_the_visible_checks_use_stored_answers(learners_copy, jac_solution, capsys):
    s = jac_solution
    C.check_row_jacobian(s.jacobian_rows)
    C.check_largest_chunk(s.largest_chunk)
    C.check_pick_jacobian(s.pick_jacobian)
    C.check_parameter_jacobians(s.parameter_jacobians)
    C.check_batched_jacobian(s.batched_jacobian)
    C.check_batched_hessian(s.batched_hessian)
    C.check_batched_jacobian_sum(s.batched_jacobian_sum)
    C.check_hvp(s.hvp_fwd_rev, s.hvp_rev_rev)
    assert capsys.readouterr().out.count("ok: ") == 8
    with pytest.raises(AssertionError, match="reference data for seed 0 only"):
        C.check_row_jacobian(s.jacobian_rows, seed=17, n_out=7, n_in=13)
    with pytest.raises(AssertionError, match=r"reference data for \{'n': 50\} only"):
        C.check_hvp(s.hvp_fwd_rev, s.hvp_rev_rev, n=17)


def test_without_the_grader_references_the_picker_speed_check_compares_with_autodiff(learners_copy, jac_solution):
    """Its Jacobians are torch.func's own, timed in the checker: float64 reverse mode is their witness."""
    reports = C.check_picker_speed(jac_solution.pick_jacobian, bars={"cpu": 2.0, "cuda": 2.0}, tall=(2048, 32),
                                   wide=(32, 2048), **QUICK)
    assert set(reports) == {"tall", "wide"}


#: Planted mistakes whose numbers the stored answers must catch, and name, as the references do.
STORED_MISTAKES = {
    **{name: MISTAKES[name] for name in (
        "rows: sign flipped", "rows: gradients stacked as columns", "sum: averaged over the batch",
        "argnums: bias and weight swapped", "argnums: the Jacobian with respect to x",
        "argnums: a gradient instead of a Jacobian", "hvp rev-rev: v forgotten", "hvp fwd-rev: the gradient instead",
        "chunk: one past the largest")},
    "rows: the float32 Jacobian 0.1% off": (
        "rows", "    return torch.stack(rows)\n",
        "    return torch.stack(rows) * (1 + 1e-3 * (x.dtype == torch.float32))\n",
        "jacobian_rows on a .* tanh layer \\(float32\\)"),
    "batched jacobian: halved": (
        "bjac", "return vmap(jacrev(f))(xs)", "return vmap(jacrev(f))(xs) * 0.5", "batched_jacobian on a batch of 6"),
    "batched hessian: the sign": (
        "bhes", "return vmap(hessian(f))(xs)", "return -vmap(hessian(f))(xs)", "the opposite sign"),
    "sum: wrong on the BatchNorm layer only": (
        "bsum", "    return by_output.movedim(1, 0)\n",
        "    return by_output.movedim(1, 0) * (0.5 if type(f).__name__ == 'NormedLayer' else 1.0)\n",
        "through a 4x6 layer with a BatchNorm1d"),
}


@pytest.mark.parametrize("mistake", sorted(STORED_MISTAKES))
def test_without_the_grader_references_a_planted_mistake_fails_with_its_cause(mistake, mutate5, learners_copy):
    kind, old, new, says = STORED_MISTAKES[mistake]
    with pytest.raises(AssertionError, match=says):
        run_check(kind, mutate5(old, new))

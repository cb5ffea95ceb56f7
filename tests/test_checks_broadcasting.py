"""Lesson 7's checks (broadcasting by hand, the (N, 1) against (N,) loss, pairwise squared
distances, segment sums and maxima, gradient penalties, a twice-differentiable autograd.Function):
the instructor's solutions pass every one, at the notebook's visible and hidden seeds and sizes;
every one fails on the untouched student stub; a catalogue of plausible wrong answers each fails
with its cause named, as the grader checks (with its references) and as a learner's copy does
(with the answers stored for the lesson's own calls); and a speed check fails a slow answer that is
right. Solutions and most
mistakes come from the instructor notebook itself (a mistake is planted by replacing an anchor
string of the solution source); the rest are written here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autograder.solution_code import load_solution, solution_source
from course.broadcasting import points, with_copies
from course.checks import broadcasting as C
from course.grading import SpeedUndecided

LESSON = "07_broadcasting_indexing_higher_order"
GENEROUS = {"cpu": 0.01, "cuda": 0.01}
QUICK = dict(num_threads=1, rounds=3, min_run_time=0.02)
# a slow answer is failed on more rounds: a ratio near 1 can stay undecided for a few rounds on a busy machine
# The negative speed tests must never be undecided: with 7 rounds the 99% ceiling is the largest round's
# ratio, so one round stalled on a busy machine made a loop timed against its like "undecided". With 15
# it is the third largest (course.timing._bound_rank): three stalled rounds, all the same way, to flake.
SLOW = dict(num_threads=1, rounds=15, min_run_time=0.02)
DIST_SIZES, SEG_SIZES, PEN_SIZES = dict(n=32, m=32, d=8), dict(nodes=16, edges=64, d=4), dict(n=8, features=4, hidden=8)
DIST_SPEED, SEG_SPEED, PEN_SPEED = dict(**DIST_SIZES, **QUICK), dict(**SEG_SIZES, **QUICK), dict(**PEN_SIZES, **QUICK)


@pytest.fixture(scope="module")
def base_source():
    return solution_source(LESSON)


@pytest.fixture(scope="module")
def sol(base_source, tmp_path_factory):
    return load_solution(base_source, tmp_path_factory.mktemp("sol7") / "broadcasting_solution.py",
                         "broadcasting_solution")


@pytest.fixture(scope="module")
def mutate(base_source, tmp_path_factory):
    """``mutate(old, new)``: lesson 7's solutions with one planted mistake, as a module."""
    counter = iter(range(10**6))

    def make(old: str, new: str):
        assert old in base_source, f"the planted mistake's anchor is not in the solution: {old!r}"
        name = f"broadcasting_mutant_{next(counter)}"
        return load_solution(base_source.replace(old, new), tmp_path_factory.mktemp("mut7") / f"{name}.py", name)

    return make


def stub(*args, **kwargs):
    raise NotImplementedError()


@pytest.fixture(params=["grader", "learner's copy"])
def where(request):
    """Each check as the grader runs it (its references), then as a learner's copy does (stored answers)."""
    if request.param == "learner's copy":
        request.getfixturevalue("learners_copy")
    return request.param


class StubSoftplus(torch.autograd.Function):
    """The Softplus exercise before it is written: a Function whose methods are the stub."""

    @staticmethod
    def forward(x):
        raise NotImplementedError()

    @staticmethod
    def setup_context(ctx, inputs, output):
        raise NotImplementedError()

    @staticmethod
    def backward(ctx, grad_out):
        raise NotImplementedError()


# -- the solutions pass ------------------------------------------------------------------------

def test_solutions_pass_every_check(sol, capsys):
    # the visible test of each exercise, then its hidden tests (seeds and sizes as in the notebook)
    C.check_broadcast_shape(sol.broadcast_shape)
    C.check_broadcast_shape(sol.broadcast_shape, seed=7, n=60)
    C.check_mse(sol.mse)
    C.check_mse(sol.mse, seed=3, n=1)
    C.check_mse(sol.mse, seed=5, n=33)
    C.check_pairwise_sq_dists(sol.pairwise_sq_dists)
    C.check_pairwise_sq_dists(sol.pairwise_sq_dists, seed=4, n=30, m=2, d=17)
    C.check_pairwise_sq_dists(sol.pairwise_sq_dists, seed=9, n=1, m=40, d=1)
    C.check_segment_sum(sol.segment_sum)
    C.check_segment_sum(sol.segment_sum, seed=11, nodes=40, edges=300, d=5)
    C.check_segment_sum(sol.segment_sum, seed=12, nodes=3, edges=2, d=1)
    C.check_segment_max(sol.segment_max)
    C.check_segment_max(sol.segment_max, seed=21, nodes=25, edges=200, d=4)
    C.check_gradient_penalty(sol.gradient_penalty)
    C.check_gradient_penalty(sol.gradient_penalty, seed=5, n=9, features=3, hidden=5)
    C.check_penalty_func(sol.gradient_penalty_func)
    C.check_penalty_func(sol.gradient_penalty_func, seed=6, n=5, features=6, hidden=3)
    C.check_softplus(sol.Softplus)
    C.check_softplus(sol.Softplus, seed=8, n=50)
    assert capsys.readouterr().out.count("ok:") == 19


def test_speed_checks_pass_the_solutions_on_a_generous_bar(sol):
    report = C.check_distance_speed(sol.pairwise_sq_dists, bars=GENEROUS, **DIST_SPEED)
    assert report.names == ["broadcast", "yours"]
    report = C.check_segment_speed(sol.segment_sum, bars=GENEROUS, **SEG_SPEED)
    assert report.names == ["loop", "yours"]
    report = C.check_penalty_speed(sol.gradient_penalty, bars=GENEROUS, **PEN_SPEED)
    assert report.names == ["per-sample loop", "yours"]


def test_every_served_check_is_exported():
    assert set(C.SERVED) <= set(C.__all__) and len(C.SERVED) == 11


# -- the untouched stub fails ------------------------------------------------------------------

@pytest.mark.parametrize("check", [
    lambda: C.check_broadcast_shape(stub),
    lambda: C.check_mse(stub),
    lambda: C.check_pairwise_sq_dists(stub),
    lambda: C.check_distance_speed(stub, bars={"cpu": 3.0, "cuda": 2.0}, **DIST_SPEED),
    lambda: C.check_segment_sum(stub),
    lambda: C.check_segment_speed(stub, bars={"cpu": 20.0, "cuda": 20.0}, **SEG_SPEED),
    lambda: C.check_segment_max(stub),
    lambda: C.check_gradient_penalty(stub),
    lambda: C.check_penalty_speed(stub, bars={"cpu": 3.0, "cuda": 3.0}, **PEN_SPEED),
    lambda: C.check_penalty_func(stub),
    lambda: C.check_softplus(StubSoftplus),
], ids=["broadcast_shape", "mse", "pairwise", "distance_speed", "segment_sum", "segment_speed", "segment_max",
        "penalty", "penalty_speed", "penalty_func", "softplus"])
def test_untouched_stub_fails_with_a_friendly_message(check):
    with pytest.raises(AssertionError, match="not written yet"):
        check()


# -- a learner's copy of the course: no grader references, stored answers ---------------------------

def test_without_the_grader_references_the_visible_checks_use_stored_answers(sol, learners_copy, capsys):
    """A learner's copy has no course.references: the lesson's own calls (seed 0, default sizes)
    compare with the stored answers, and refuse other seeds and sizes honestly. That the stored
    answers still fail wrong ones, with their causes named, the catalogue below shows (``where``)."""
    C.check_broadcast_shape(sol.broadcast_shape)
    C.check_mse(sol.mse)
    C.check_pairwise_sq_dists(sol.pairwise_sq_dists)
    C.check_segment_sum(sol.segment_sum)
    C.check_segment_max(sol.segment_max)
    C.check_gradient_penalty(sol.gradient_penalty)
    C.check_penalty_func(sol.gradient_penalty_func)
    C.check_softplus(sol.Softplus)
    assert capsys.readouterr().out.count("ok: ") == 8
    with pytest.raises(AssertionError, match="reference data for seed 0 only"):
        C.check_mse(sol.mse, seed=3, n=1)
    with pytest.raises(AssertionError, match=r"reference data for n=12, m=9, d=5 only .* \(n=30, m=2, d=17 asked"):
        C.check_pairwise_sq_dists(sol.pairwise_sq_dists, n=30, m=2, d=17)
    with pytest.raises(AssertionError, match="reference data for n=6, features=4, hidden=8 only"):
        C.check_penalty_func(sol.gradient_penalty_func, n=5, features=6, hidden=3)


def test_the_references_are_the_graders_alone():
    """What reproduces an exercise's answer lives in course.references (out of a learner's copy and
    of the learner's process), guarded; the checks module keeps none of it."""
    import course.references.broadcasting as R

    for name in ("broadcast_shape_reference", "mse_reference", "sq_dists_reference", "segment_sum_reference",
                 "segment_max_reference", "penalty_reference", "softplus_reference"):
        assert getattr(getattr(R, name), "__course_reference__", False), name
        assert not hasattr(C, name), name
    assert not any(hasattr(C, old) for old in ("_expected_shape", "_weight_grads", "_softplus64"))


# -- a catalogue of plausible wrong answers, each named ------------------------------------------

PAD = "    a = (1,) * (n - len(a)) + tuple(a)\n    b = (1,) * (n - len(b)) + tuple(b)\n"
PAD_RIGHT = "    a = tuple(a) + (1,) * (n - len(a))\n    b = tuple(b) + (1,) * (n - len(b))\n"
RAISE = "        if x != y and x != 1 and y != 1:\n            raise"
FLAT = "        if t.dim() == 1 or (t.dim() == 2 and t.shape[1] == 1):\n            return t.reshape(-1)\n"
MSE_RETURN = "    return ((p - t) ** 2).mean()"
CLAMP = "    return sq.clamp_min(0)"
SEG_OUT = "    out = values.new_zeros((num_segments, *values.shape[1:]))\n    return out.index_add_(0, index, values)"
SEG_ADD = "    return out.index_add_(0, index, values)"
MAX_OUT = "    out = values.new_zeros((num_segments, *values.shape[1:]))\n    expanded"
MAX_REDUCE = '    return out.scatter_reduce(0, expanded, values, reduce="amax", include_self=False)'
PEN_GRAD = "    g, = torch.autograd.grad(critic(x).sum(), x, create_graph=True)\n"
ONE_NORM = ("((g.flatten(1).norm(dim=1) - 1) ** 2).mean()", "(g.norm() - 1) ** 2")
PEN_RETURN = ("    return ((g.flatten(1).norm(dim=1) - 1) ** 2).mean()\n    ### END SOLUTION\n\n"
              "def gradient_penalty_func")
FUNC_SCORE = "        return functional_call(model, p, (xi[None],))[0]\n"
FUNC_BODY = ("    g = vmap(grad(score, argnums=1), in_dims=(None, 0))(params, x)\n"
             "    return ((g.flatten(1).norm(dim=1) - 1) ** 2).mean()")
SP_FORWARD = "        return x.clamp_min(0) + torch.log1p(torch.exp(-x.abs()))"
SP_BACKWARD_DEF = "    @staticmethod\n    def backward(ctx, grad_out):\n"
SP_BACKWARD = "        return grad_out * torch.sigmoid(x)"

# (exercise, anchor in the solution, planted mistake, what the message must say)
PLANTED = {
    "broadcast_shape: never raises": ("broadcast_shape", RAISE, "        if False:\n            raise",
                                      "these shapes do not broadcast: compared from the right"),
    "mse: summed, not averaged": ("mse", MSE_RETURN, "    return ((p - t) ** 2).sum()", "summed, not averaged"),
    "mse: (N, 2) accepted (first column taken)": (
        "mse", FLAT, "        if t.dim() == 1:\n            return t\n        if t.dim() == 2:\n"
                     "            return t[:, 0]\n", r"neither \(n,\) nor \(n, 1\)"),
    "mse: through .item()": ("mse", MSE_RETURN, "    return torch.tensor(((p - t) ** 2).mean().item(), dtype=p.dtype)",
                             "carries no gradient back to pred"),
    "pairwise: no clamp": ("pairwise", CLAMP, "    return sq", "negative values"),
    "pairwise: detached": ("pairwise", CLAMP, "    return sq.clamp_min(0).detach()", "carries no gradient to a and b"),
    "pairwise: right values, doubled gradients": (
        "pairwise", CLAMP, "    return (sq + (sq - sq.detach())).clamp_min(0)",
        "the gradient of pairwise_sq_dists .* w.r.t. a"),
    "segment_sum: out[index] += values": ("segment_sum", SEG_ADD, "    out[index] += values\n    return out",
                                          "holds just one of its values"),
    "segment_sum: under no_grad": ("segment_sum", SEG_ADD, "    with torch.no_grad():\n"
                                                           "        return out.index_add_(0, index, values)",
                                   "carries no gradient to values"),
    "segment_sum: right values, doubled gradient": (
        "segment_sum", SEG_ADD, "    out = out.index_add(0, index, values)\n    return out + (out - out.detach())",
        "the gradient of segment_sum w.r.t. values"),
    "segment_sum: as many segments as the largest index": (
        "segment_sum", SEG_OUT, SEG_OUT.replace("(num_segments,", "(int(index.max()) + 1,"),
        "including segments with no value"),
    "segment_max: include_self left at its default": (
        "segment_max", MAX_REDUCE, MAX_REDUCE.replace(", include_self=False", ""), "initial zeros"),
    "segment_max: starts from -inf": (
        "segment_max", MAX_OUT, MAX_OUT.replace("values.new_zeros((num_segments, *values.shape[1:]))",
                                                'values.new_full((num_segments, *values.shape[1:]), float("-inf"))'),
        r"-inf \(or inf\) for segments with no value"),
    "segment_max: right values, doubled gradient": (
        "segment_max", MAX_REDUCE,
        MAX_REDUCE.replace("    return out", "    out = out") + "\n    return out + (out - out.detach())",
        "the gradient of segment_max w.r.t. values"),
    "segment_max: under no_grad": ("segment_max", MAX_REDUCE, "    with torch.no_grad():\n    " + MAX_REDUCE,
                                   "carries no gradient to values"),
    "penalty: no create_graph": ("penalty", PEN_GRAD, PEN_GRAD.replace(", create_graph=True", ""),
                                 "create_graph=True"),
    "penalty: gradient of the mean score": ("penalty", PEN_GRAD, PEN_GRAD.replace(".sum()", ".mean()"),
                                            r"\*mean\* score"),
    "penalty: one norm over the batch": ("penalty", PEN_RETURN, PEN_RETURN.replace(*ONE_NORM),
                                         "one norm was taken over the whole batch"),
    "penalty: right value, doubled weight gradients": (
        "penalty", PEN_RETURN, PEN_RETURN.replace("    return ((g.flatten(1).norm(dim=1) - 1) ** 2).mean()",
                                                  "    p = ((g.flatten(1).norm(dim=1) - 1) ** 2).mean()\n"
                                                  "    return p + (p - p.detach())"),
        "the gradient of gradient_penalty w.r.t. the critic's weights"),
    "penalty: squared norm": ("penalty", PEN_RETURN, PEN_RETURN.replace("norm(dim=1) - 1", "norm(dim=1) ** 2 - 1"),
                              "the squared norm was used"),
    "penalty: summed over the batch": ("penalty", PEN_RETURN, PEN_RETURN.replace("** 2).mean()", "** 2).sum()"),
                                       "summed over the batch, not averaged"),
    "penalty_func: the model's own weights": ("penalty_func", FUNC_SCORE, "        return model(xi[None])[0]\n",
                                              r"no gradient reaches params\["),
    "penalty_func: params detached": (
        "penalty_func", FUNC_SCORE,
        "        return functional_call(model, {k: v.detach() for k, v in p.items()}, (xi[None],))[0]\n",
        "carries no gradient to params"),
    "penalty_func: gradient of the mean score": (
        "penalty_func", FUNC_BODY, FUNC_BODY.replace(
            "vmap(grad(score, argnums=1), in_dims=(None, 0))(params, x)",
            "grad(lambda p, xs: functional_call(model, p, (xs,)).mean(), argnums=1)(params, x)"), r"\*mean\* score"),
    "penalty_func: one norm over the batch": (
        "penalty_func", FUNC_BODY, FUNC_BODY.replace(*ONE_NORM), "one norm was taken over the whole batch"),
    "softplus: @once_differentiable backward": (
        "softplus", SP_BACKWARD_DEF,
        "    @staticmethod\n    @torch.autograd.function.once_differentiable\n    def backward(ctx, grad_out):\n",
        "backward is not differentiable"),
    "softplus: naive log1p(exp(x))": ("softplus", SP_FORWARD, "        return torch.log1p(torch.exp(x))",
                                      r"not finite at x = \[800.0\]"),
    "softplus: backward from x.detach()": ("softplus", SP_BACKWARD, SP_BACKWARD.replace("(x)", "(x.detach())"),
                                           "backward is not differentiable"),
    "softplus: backward under no_grad": ("softplus", SP_BACKWARD, "        with torch.no_grad():\n    " + SP_BACKWARD,
                                         "backward is not differentiable"),
    "softplus: backward with the wrong second derivative": (
        "softplus", SP_BACKWARD, "        return grad_out * (torch.sigmoid(x.detach()) + (x - x.detach()))",
        "the second derivative through Softplus's backward"),
    "softplus: backward gives exp(x)": ("softplus", SP_BACKWARD, SP_BACKWARD.replace("sigmoid", "exp"),
                                        r"Hint: backward returns grad_output \* sigmoid\(x\)"),
}


def shape_of_tensors(a, b):
    """Right rule, but computed with tensors: the sizes come back as 0-d tensors, not ints."""
    n = max(len(a), len(b))
    pa = torch.tensor((1,) * (n - len(a)) + tuple(a), dtype=torch.long)
    pb = torch.tensor((1,) * (n - len(b)) + tuple(b), dtype=torch.long)
    if bool(((pa != pb) & (pa != 1) & (pb != 1)).any()):
        raise ValueError(f"{a} and {b} do not broadcast")
    return tuple(torch.where(pa == 1, pb, pa))


def shape_by_torch(a, b):
    """Right values, by torch's rule rather than one's own."""
    return tuple(torch.broadcast_shapes(a, b))


def shape_by_numpy(a, b):
    import numpy as np

    return tuple(np.broadcast_shapes(a, b))


def shape_by_meta_tensors(a, b):
    """Tensors with no storage, added: the shape of the sum."""
    from torch import empty  # an alias: the check watches calls, not names

    return tuple((empty(a, device="meta") + empty(b, device="meta")).shape)


def mse_broadcast(pred, target):
    """The bug the exercise is about: no shape handling at all."""
    return ((pred - target) ** 2).mean()


def dists_in_float64(a, b):
    """Right values, computed (and returned) in float64."""
    a, b = a.double(), b.double()
    return ((a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2 * a @ b.T).clamp_min(0)


def softplus_function(x):
    """A plain function, not an autograd.Function."""
    return F.softplus(x)


# (exercise, the wrong answer, what the message must say)
WRITTEN = {
    "broadcast_shape: a tuple of 0-d tensors": ("broadcast_shape", shape_of_tensors, "as a tuple of ints"),
    "broadcast_shape: torch.broadcast_shapes wrapped": ("broadcast_shape", shape_by_torch,
                                                        "called torch.functional.broadcast_shapes: the exercise"),
    "broadcast_shape: NumPy's broadcast_shapes": ("broadcast_shape", shape_by_numpy, "called numpy.*the rule itself"),
    "broadcast_shape: meta tensors added": ("broadcast_shape", shape_by_meta_tensors, "called .*torch.empty"),
    "mse: (N, 1) broadcast against (N,)": ("mse", mse_broadcast, "broadcast against each other"),
    "pairwise: float64 returned for float32": ("pairwise", dists_in_float64, "keep the inputs' dtype"),
    "softplus: a plain function": ("softplus", softplus_function, "subclass of torch.autograd.Function"),
}

ANSWER = {"broadcast_shape": "broadcast_shape", "mse": "mse", "pairwise": "pairwise_sq_dists",
          "segment_sum": "segment_sum", "segment_max": "segment_max", "penalty": "gradient_penalty",
          "penalty_func": "gradient_penalty_func", "softplus": "Softplus"}
CHECK = {"broadcast_shape": C.check_broadcast_shape, "mse": C.check_mse, "pairwise": C.check_pairwise_sq_dists,
         "segment_sum": C.check_segment_sum, "segment_max": C.check_segment_max,
         "penalty": C.check_gradient_penalty, "penalty_func": C.check_penalty_func, "softplus": C.check_softplus}


def test_the_catalogue_covers_every_exercise():
    per_exercise = {k: 0 for k in CHECK}
    for exercise, *_ in list(PLANTED.values()) + list(WRITTEN.values()):
        per_exercise[exercise] += 1
    assert min(per_exercise.values()) >= 2, per_exercise
    assert sum(per_exercise.values()) >= 12


@pytest.mark.parametrize("mistake", sorted(PLANTED))
def test_each_planted_mistake_is_named(mistake, mutate, where):
    exercise, old, new, says = PLANTED[mistake]
    m = mutate(old, new)
    with pytest.raises(AssertionError, match=says):
        CHECK[exercise](getattr(m, ANSWER[exercise]))


@pytest.mark.parametrize("mistake", sorted(WRITTEN))
def test_each_written_mistake_is_named(mistake, where):
    exercise, answer, says = WRITTEN[mistake]
    with pytest.raises(AssertionError, match=says):
        CHECK[exercise](answer)


def shape_left_aligned_max(a, b):
    """Aligned from the left, and never raises: the larger size of each pair."""
    n = max(len(a), len(b))
    a, b = tuple(a) + (1,) * (n - len(a)), tuple(b) + (1,) * (n - len(b))
    return tuple(max(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", ["raises", "never raises"])
def test_broadcast_shape_aligned_from_the_left_is_named(kind, mutate, where):
    answer = mutate(PAD, PAD_RIGHT).broadcast_shape if kind == "raises" else shape_left_aligned_max
    with pytest.raises(AssertionError, match=r"from the \*left\*"):
        C.check_broadcast_shape(answer)


def test_the_unclamped_identity_really_goes_negative_on_the_checks_points():
    """The premise of the 'no clamp' mistake: on the check's points (float32, 20 from the origin,
    every third point of b a copy of one of a), |a|^2 + |b|^2 - 2 a.b is negative somewhere on
    this CPU, and the check names it in float32 when float64 is exact. The check also has a case where
    every point of b copies one of a's: there an unclamped answer is caught on every seed (next test)."""
    a = points(12, 5, seed=0, offset=20.0, device="cpu")
    b = with_copies(a, points(9, 5, seed=1, offset=20.0, device="cpu"))
    raw = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2 * a @ b.T
    assert a.dtype == torch.float32 and bool((raw < 0).any()), raw.min()

    def unclamped_in_float32(a, b):  # exact (clamped) in float64: only the float32 cases can catch it
        sq = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2 * a @ b.T
        return sq if a.dtype == torch.float32 else sq.clamp_min(0)

    with pytest.raises(AssertionError, match=r"\(float32, points \d+ from the origin\) has \d+ negative values"):
        C.check_pairwise_sq_dists(unclamped_in_float32, device="cpu")  # the rounding seen above is the CPU's


@pytest.mark.parametrize("seed", range(0, 60, 3))
def test_the_unclamped_identity_is_caught_on_any_seed(seed):
    def unclamped(a, b):
        return (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2 * a @ b.T

    with pytest.raises(AssertionError, match="negative values"):
        C.check_pairwise_sq_dists(unclamped, seed=seed, device="cpu")


def test_a_max_of_sizes_is_told_that_one_against_zero_gives_zero(where):
    def max_sizes(a, b):
        n = max(len(a), len(b))
        a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
        if any(x != y and 1 not in (x, y) for x, y in zip(a, b)):
            raise ValueError("no")
        return tuple(max(x, y) for x, y in zip(a, b))

    with pytest.raises(AssertionError, match="0 included"):
        C.check_broadcast_shape(max_sizes)


# -- speed checks fail slow right answers, and check what they time --------------------------------

def broadcast_dists(a, b):
    """The (N, M, D) broadcast itself, offered as the answer: right, and no faster than the baseline."""
    return ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)


def test_distance_speed_check_fails_the_broadcast_itself():
    with pytest.raises(AssertionError, match="the bar on this device is 3.00x") as caught:
        C.check_distance_speed(broadcast_dists, bars={"cpu": 3.0, "cuda": 3.0}, n=256, m=256, d=64, attempts=1,
                               **SLOW)
    assert not isinstance(caught.value, SpeedUndecided), "a clear fail, not undecided"


def test_the_broadcast_is_never_timed_where_its_blocks_are_mapped_afresh_every_call():
    """At lesson 7's 512 x 512 x 64 the broadcast makes two 64 MiB tensors a call: over glibc's 32 MiB
    threshold, what they cost depends on the process's history (a process with a free stretch inside
    its heap ran the same broadcast 2.5x faster than a fresh one). compare_served refuses to time the
    course's side there, and so does the check called at those sizes on a CPU (lesson 7 times at
    its declared 256 x 256, 16 MiB, where the broadcast itself fails the bar: the test above)."""
    from course import allocator
    from course.timing import compare_served

    if not allocator.available():
        pytest.skip("glibc's malloc is not this process's allocator")
    with pytest.raises(ValueError, match=r"'broadcast' makes a 64 MiB tensor .* mapped afresh"):
        compare_served(("broadcast", C.naive_sq_dists), ("yours", broadcast_dists), factory=C.distance_inputs,
                       sizes=dict(n=512, m=512, d=64), device="cpu", rounds=1)
    with pytest.raises(ValueError, match=r"'broadcast' makes a 64 MiB tensor .*[(]the lesson's declared sizes"):
        C.check_distance_speed(broadcast_dists, bars={"cpu": 3.0, "cuda": 3.0}, n=512, m=512, d=64, attempts=1,
                               device="cpu", **SLOW)


def segment_loop(values, index, num_segments):
    """A Python loop over the edges, offered as the answer: right, and no faster than the course's loop."""
    out = values.new_zeros((num_segments, *values.shape[1:]))
    for e in range(index.shape[0]):
        out[index[e]] += values[e]
    return out


def penalty_loop(critic, x):
    """A backward pass per sample, offered as the answer: right, and no faster than the course's loop."""
    terms = []
    for i in range(x.shape[0]):
        xi = x[i:i + 1].detach().requires_grad_()
        g, = torch.autograd.grad(critic(xi).sum(), xi, create_graph=True)
        terms.append((g.norm() - 1) ** 2)
    return torch.stack(terms).mean()


def test_segment_and_penalty_speed_checks_fail_loops_like_the_courses():
    with pytest.raises(AssertionError, match="the bar on this device is 3.00x") as caught:
        C.check_segment_speed(segment_loop, bars={"cpu": 3.0, "cuda": 3.0}, attempts=1, **SEG_SIZES, **SLOW)
    assert not isinstance(caught.value, SpeedUndecided)
    with pytest.raises(AssertionError, match="the bar on this device is 3.00x") as caught:
        C.check_penalty_speed(penalty_loop, bars={"cpu": 3.0, "cuda": 3.0}, attempts=1, **PEN_SIZES, **SLOW)
    assert not isinstance(caught.value, SpeedUndecided)


def right_once(fn, wrong):
    """``fn`` on the first call (the one a speed check makes before timing), ``wrong`` after."""
    calls = []

    def answer(*args):
        calls.append(1)
        return fn(*args) if len(calls) == 1 else wrong(*args)
    return answer


def test_speed_checks_verify_what_they_time(sol):
    def off_dists(a, b):
        return sol.pairwise_sq_dists(a, b) + 0.5

    def off_segments(values, index, num_segments):
        return sol.segment_sum(values, index, num_segments) * 1.01

    def off_penalty(model, x):
        return sol.gradient_penalty(model, x) * 1.01

    speed = [(C.check_distance_speed, sol.pairwise_sq_dists, off_dists, DIST_SPEED),
             (C.check_segment_speed, sol.segment_sum, off_segments, SEG_SPEED),
             (C.check_penalty_speed, sol.gradient_penalty, off_penalty, PEN_SPEED)]
    for check, right, wrong, sizes in speed:
        with pytest.raises(AssertionError, match="right before it is fast"):
            check(wrong, bars=GENEROUS, **sizes)
        # right on the call checked before timing, wrong on the timed calls (fresh inputs, every output checked)
        with pytest.raises(AssertionError, match="output of a timed call differs"):
            check(right_once(right, wrong), bars=GENEROUS, **sizes)

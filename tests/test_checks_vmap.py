"""Lesson 6's checks (vmap ensembles, per-sample gradients, DP-SGD): the instructor's solutions
pass every one, and every one fails on the untouched student stub and on a planted mistake aimed
at it. Solutions and mistakes come from the instructor notebook itself. Also: the visible checks
without the grader's references (a learner's copy), the lesson's helpers in course.vmap and the
DP-SGD reference."""

import copy
import warnings

import pytest
import torch
from torch.func import grad, vmap

from autograder.solution_code import load_solution, solution_source
from course import vmap as V
from course.checks import vmap as C
from course.references import vmap as R
from served_helpers import never_failed

LESSON = "06_vmap_ensembles"
KL_SPEED = dict(n=64, batch=8, features=16, hidden=16, num_threads=1, rounds=3, min_run_time=0.02)


# Opacus's hooks trigger one PyTorch warning, explained in the lesson (course.vmap.quiet_opacus).
pytestmark = [pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning"),
              # the planted F.kl_div under vmap: PyTorch's warning is what the lesson is about
              pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")]


@pytest.fixture(scope="module")
def base_source():
    return solution_source(LESSON)


@pytest.fixture(scope="module")
def sol(base_source, tmp_path_factory):
    return load_solution(base_source, tmp_path_factory.mktemp("sol6") / "vmap_solution.py", "vmap_solution")


@pytest.fixture(scope="module")
def mutate6(base_source, tmp_path_factory):
    """``mutate6(old, new)``: lesson 6's solutions with one planted mistake, as a module."""
    counter = iter(range(10**6))

    def make(old: str, new: str):
        assert old in base_source, f"the planted mistake's anchor is not in the solution: {old!r}"
        name = f"vmap_mutant_{next(counter)}"
        return load_solution(base_source.replace(old, new), tmp_path_factory.mktemp("mut6") / f"{name}.py", name)

    return make


def stub(*args, **kwargs):
    raise NotImplementedError()


def test_solutions_pass_every_check(sol):
    C.check_stack_ensemble(sol.stack_ensemble)
    C.check_stack_ensemble(sol.stack_ensemble, seed=7, n=1)
    C.check_ensemble_predict(sol.predict_each, sol.predict_all)
    C.check_predict_dropout(sol.predict_all_dropout)
    C.check_predict_dropout(sol.predict_all_dropout, seed=7, n=3, batch=24, features=9, hidden=12, p=0.3)
    C.check_ensemble_predict(sol.predict_each, sol.predict_all, seed=3, n=3, batch=3, classes=3)
    C.check_member_kl(sol.member_kl)
    C.check_member_kl(sol.member_kl, seed=6, n=3, batch=4, features=9, hidden=7, classes=3)
    C.check_member_kl(sol.member_kl, seed=10, n=1, batch=1, classes=2)
    C.check_ensemble_sgd_step(sol.ensemble_sgd_step)
    C.check_ensemble_sgd_step(sol.ensemble_sgd_step, seed=2, n=1, batch=3, lr=0.01)
    C.check_per_sample_grads_loop(sol.per_sample_grads_loop)
    C.check_per_sample_grads(sol.per_sample_grads)
    C.check_per_sample_grads(sol.per_sample_grads, seed=4, batch=3, size=12, channels=(2, 2), classes=3)
    C.check_opacus_grads(sol.opacus_per_sample_grads)
    C.check_opacus_grads(sol.opacus_per_sample_grads, seed=5, batch=2, size=4)
    C.check_dp_sgd_step(sol.dp_sgd_step)
    C.check_dp_sgd_step(sol.dp_sgd_step, seed=11, batch=3)


def test_speed_checks_pass_the_solutions_on_a_generous_bar(sol):
    report = C.check_member_kl_speed(sol.member_kl, bars={"cpu": 0.01, "cuda": 0.01}, **KL_SPEED)
    assert report.names == ["planted", "repaired"]


@pytest.mark.parametrize("check", [
    lambda: C.check_stack_ensemble(stub),
    lambda: C.check_ensemble_predict(stub, stub),
    lambda: C.check_member_kl(stub),
    lambda: C.check_member_kl_speed(stub, bars={"cpu": 1.5, "cuda": 2.0}, **KL_SPEED),
    lambda: C.check_per_sample_grads_loop(stub),
    lambda: C.check_per_sample_grads(stub),
    lambda: C.check_opacus_grads(stub),
    lambda: C.check_predict_dropout(stub),
    lambda: C.check_dp_sgd_step(stub),
    lambda: C.check_ensemble_sgd_step(stub),
], ids=["stack", "predict", "member_kl", "member_kl_speed", "psg_loop", "psg_vmap", "opacus", "dropout", "dp_sgd",
        "ens_sgd"])
def test_untouched_stub_fails_with_a_friendly_message(check):
    with pytest.raises(AssertionError, match="not written yet"):
        check()


def test_predict_all_left_as_the_stub_fails_too(sol):
    with pytest.raises(AssertionError, match="predict_all is not written yet"):
        C.check_ensemble_predict(sol.predict_each, stub)


LOOP_BODY = ("    for i in range(x.shape[0]):\n"
             "        loss = F.cross_entropy(model(x[i:i + 1]), y[i:i + 1])\n"
             "        rows.append(torch.autograd.grad(loss, params))\n")
PSG_RETURN = "    return vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)\n"
ONE_MODEL = ("        return functional_call(base, (p, b), (x,))\n\n"
             "    return vmap(one_model, in_dims=(0, 0, 0))(params, buffers, xs)")
OPACUS_CALL = 'gsm = GradSampleModule(model, loss_reduction="mean")'
CLIP = "        clipped_sum = (factor.view(-1, *([1] * (g.dim() - 1))) * g).sum(dim=0)\n"
UPDATE = "new[name] = p - lr * (clipped_sum + noise_multiplier * max_norm * noise) / batch"
ENS_GRADS = "    grads = vmap(grad(member_loss), in_dims=(0, 0, 0, 0))(params, buffers, xs, ys)\n"
ENS_STEP = "    return {name: p - lr * grads[name] for name, p in params.items()}"
MEMBER_LOSS = "        return F.cross_entropy(functional_call(base, (p, b), (x,)), y)\n\n    grads"
KL_TERM = "        return (torch.xlogy(target, target) - target * log_q).sum(-1).mean()\n"
DROPOUT_VMAP = '    return vmap(one_model, in_dims=(0, 0, None), randomness="different")(params, buffers, x)'
KL_LOGQ = "        log_q = F.log_softmax(functional_call(base, (p, b), (x,)), dim=-1)\n"

# (check, anchor in the solution, planted mistake, what the message must say)
MISTAKES = {
    "stack: the model itself moved to meta": (
        "stack", 'base = copy.deepcopy(models[0]).to("meta")', 'base = models[0].to("meta")', "changed models"),
    "stack: base keeps real weights": (
        "stack", 'base = copy.deepcopy(models[0]).to("meta")', "base = copy.deepcopy(models[0])", "meta device"),
    "stack: buffers forgotten": (
        "stack", "    return params, buffers, base\n", "    return params, {}, base\n", "buffers is empty"),
    "stack: stacked along the wrong dimension": (
        "stack", "    return params, buffers, base\n",
        "    return {k: v.transpose(0, -1) for k, v in params.items()}, buffers, base\n", "params"),
    "predict: a loop over the models": (
        "predict", ONE_MODEL,
        "        return functional_call(base, (p, b), (x,))\n\n"
        "    return torch.stack([one_model({k: v[i] for k, v in params.items()}, {k: v[i] for k, v in "
        "buffers.items()}, xs[i]) for i in range(xs.shape[0])])", "a Python loop"),
    "predict: vmap inside a loop": (
        "predict", ONE_MODEL,
        "        return functional_call(base, (p, b), (x,))\n\n"
        "    return torch.cat([vmap(one_model)({k: v[i:i + 1] for k, v in params.items()}, {k: v[i:i + 1] for k, v in "
        "buffers.items()}, xs[i:i + 1]) for i in range(xs.shape[0])])", "vmap is inside a loop"),
    "predict: a loop dressed with one token vmap call": (
        "predict", ONE_MODEL,
        "        return functional_call(base, (p, b), (x,))\n\n"
        "    vmap(one_model)({k: v[:1] for k, v in params.items()}, {k: v[:1] for k, v in buffers.items()}, xs[:1])\n"
        "    shadow = copy.deepcopy(base)\n"
        "    return torch.stack([functional_call(shadow, ({k: v[i] for k, v in params.items()}, {k: v[i] for k, v in "
        "buffers.items()}), (xs[i],)) for i in range(xs.shape[0])])", "the work grows with the number of models"),
    "psg: a loop dressed with one token vmap(grad) call": (
        "psg_vmap", "    return vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)",
        "    vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x[:1], y[:1])\n"
        "    shadow = copy.deepcopy(model)\n"
        "    rows = [torch.autograd.grad(F.cross_entropy(shadow(x[i:i + 1]), y[i:i + 1]), list(shadow.parameters()))\n"
        "            for i in range(x.shape[0])]\n"
        "    return {n: torch.stack([r[j] for r in rows]) for j, (n, _) in enumerate(shadow.named_parameters())}",
        "the work grows with the number of samples"),
    "predict: one minibatch sliced per model": (
        "predict", "in_dims=(0, 0, None))(params, buffers, x)", "in_dims=(0, 0, 0))(params, buffers, x)",
        "predict_all raised"),
    "predict: every model on the first minibatch": (
        "predict", "in_dims=(0, 0, 0))(params, buffers, xs)", "in_dims=(0, 0, None))(params, buffers, xs[0])",
        "every model ran on the first minibatch"),
    "predict: buffers left out": (
        "predict", "functional_call(base, (p, b), (x,))", "functional_call(base, p, (x,))", "Pass the stacked state"),
    "loop: gradients accumulate in p.grad": (
        "psg_loop", LOOP_BODY,
        "    for i in range(x.shape[0]):\n"
        "        F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()\n"
        "        rows.append([p.grad.clone() for p in params])\n", "accumulated"),
    "loop: the whole batch's loss": (
        "psg_loop", "loss = F.cross_entropy(model(x[i:i + 1]), y[i:i + 1])",
        "loss = F.cross_entropy(model(x), y)", "the whole batch's loss"),
    "vmap: grad in a loop": (
        "psg_vmap", PSG_RETURN,
        "    rows = [grad(sample_loss)(params, x[i], y[i]) for i in range(x.shape[0])]\n"
        "    return {k: torch.stack([r[k] for r in rows]) for k in params}\n", "grad in a Python loop"),
    "vmap: the loop instead": (
        "psg_vmap", PSG_RETURN, "    return per_sample_grads_loop(model, x, y)\n", "a Python loop"),
    "vmap: mapped over the parameters too": (
        "psg_vmap", "in_dims=(None, 0, 0))(params, x, y)", "in_dims=(0, 0, 0))(params, x, y)", "raised"),
    "vmap: loss divided by the batch size": (
        "psg_vmap", "        return F.cross_entropy(logits, y_i.unsqueeze(0))\n",
        "        return F.cross_entropy(logits, y_i.unsqueeze(0)) / x.shape[0]\n", "divided by the batch size"),
    "opacus: loss_reduction disagrees with the loss": (
        "opacus", OPACUS_CALL, 'gsm = GradSampleModule(model, loss_reduction="sum")', "the batch size"),
    "opacus: the wrapper's names": (
        "opacus", "for name, p in model.named_parameters()}\n    finally",
        "for name, p in gsm.named_parameters()}\n    finally", "_module."),
    "opacus: vmap instead": (
        "opacus", "    gsm = GradSampleModule(model, loss_reduction=\"mean\")\n    try:",
        "    return per_sample_grads(model, x, y)\n    gsm = None\n    try:", "about Opacus"),
    "dp: each parameter clipped separately": (
        "dp", CLIP,
        "        f = (max_norm / (g.reshape(batch, -1).norm(dim=1) + 1e-6)).clamp(max=1.0)\n"
        "        clipped_sum = (f.view(-1, *([1] * (g.dim() - 1))) * g).sum(dim=0)\n", "clipped on its own"),
    "dp: small gradients scaled up": (
        "dp", "factor = (max_norm / (norms + 1e-6)).clamp(max=1.0)", "factor = max_norm / (norms + 1e-6)",
        "the small ones too"),
    "dp: nothing clipped": (
        "dp", "factor = (max_norm / (norms + 1e-6)).clamp(max=1.0)", "factor = torch.ones_like(norms)",
        "nothing was clipped"),
    "dp: summed, not averaged": (
        "dp", UPDATE, UPDATE.replace(" / batch", ""), "summed, not averaged"),
    "dp: global random state": (
        "dp", "torch.randn(p.shape, generator=generator, ", "torch.randn(p.shape, ", "did not draw from"),
    "dp: noise std without max_norm": (
        "dp", UPDATE, UPDATE.replace("noise_multiplier * max_norm * noise", "noise_multiplier * noise"),
        "noise_multiplier alone"),
    "dp: noise not averaged": (
        "dp", UPDATE, "new[name] = p - lr * (clipped_sum / batch + noise_multiplier * max_norm * noise)",
        "not divided by the batch size"),
    "dp: parameters updated in place": (
        "dp", UPDATE, "new[name] = p.sub_(lr * (clipped_sum + noise_multiplier * max_norm * noise) / batch)",
        "in place"),
    "dp: noise drawn twice": (
        "dp", "        noise = torch.randn(p.shape, generator=generator, device=p.device, dtype=p.dtype)\n",
        "        noise = torch.randn(p.shape, generator=generator, device=p.device, dtype=p.dtype)\n"
        "        torch.randn(1, generator=generator, device=p.device, dtype=p.dtype)\n", "different amount"),
    "dp: noise in float32": (
        "dp", "noise = torch.randn(p.shape, generator=generator, device=p.device, dtype=p.dtype)",
        "noise = torch.randn(p.shape, generator=generator, device=p.device).to(p.dtype)", "parameter's dtype"),
    "ens: the members' losses averaged": (
        "ens", ENS_GRADS,
        "    grads = grad(lambda p: vmap(member_loss)(p, buffers, xs, ys).mean())(params)\n", "1/N of its step"),
    "ens: every member on the first minibatch": (
        "ens", ENS_GRADS,
        "    grads = vmap(grad(member_loss), in_dims=(0, 0, None, None))(params, buffers, xs[0], ys[0])\n",
        "first minibatch"),
    "ens: gradient ascent": ("ens", ENS_STEP, ENS_STEP.replace("p - lr", "p + lr"), "up the gradient"),
    "ens: the gradients returned": ("ens", ENS_STEP, "    return grads", "returned the gradients"),
    "ens: the loss summed over the minibatch": (
        "ens", MEMBER_LOSS, MEMBER_LOSS.replace("(x,)), y)", "(x,)), y, reduction='sum')"), "summed over the minibatch"),
    "ens: the mean gradient for everyone": (
        "ens", ENS_STEP, "    return {name: p - lr * grads[name].mean(0) for name, p in params.items()}", "same step"),
    "ens: updated in place": (
        "ens", ENS_STEP, "    return {name: p.sub_(lr * grads[name]) for name, p in params.items()}", "in place"),
    "ens: a loop over the members": (
        "ens", ENS_GRADS,
        "    rows = [grad(member_loss)({k: v[i] for k, v in params.items()}, {k: v[i] for k, v in buffers.items()},\n"
        "                              xs[i], ys[i]) for i in range(xs.shape[0])]\n"
        "    grads = {k: torch.stack([r[k] for r in rows]) for k in params}\n", "a Python loop"),
    "kl: F.kl_div inside vmap (the planted op)": (
        "kl", KL_TERM, '        return F.kl_div(log_q, target, reduction="batchmean")\n', "aten::kl_div member by member"),
    "kl: 0 * log 0": (
        "kl", KL_TERM, "        return (target * (target.log() - log_q)).sum(-1).mean()\n", "torch.xlogy"),
    "kl: reduction 'mean'": (
        "kl", KL_TERM, '        return F.kl_div(log_q, target, reduction="mean")\n', "averaged over the classes too"),
    "kl: summed over the minibatch": (
        "kl", KL_TERM, KL_TERM.replace(".sum(-1).mean()", ".sum()"), "summed over the minibatch"),
    "kl: the other direction": (
        "kl", KL_TERM, "        return (log_q.exp() * (log_q - target.log())).sum(-1).mean()\n", "the other way round"),
    "kl: logits for log-probabilities": (
        "kl", KL_LOGQ, "        log_q = functional_call(base, (p, b), (x,))\n", "log_softmax them first"),
    "kl: one number for the ensemble": (
        "kl", "    return vmap(one_member)(params, buffers)\n",
        "    return vmap(one_member)(params, buffers).mean().expand(params['1.weight'].shape[0])\n",
        "each member gets its own"),
    "kl: buffers left out": (
        "kl", KL_LOGQ, KL_LOGQ.replace("(p, b)", "p"), "Pass the stacked state"),
    "dropout: one mask shared by the members": (
        "dropout", DROPOUT_VMAP, DROPOUT_VMAP.replace('"different"', '"same"'), "every member dropped the same units"),
    "dropout: randomness left at its default": (
        "dropout", DROPOUT_VMAP, DROPOUT_VMAP.replace(', randomness="different"', ''),
        "pass randomness='different'"),
    "dropout: the members switched to eval mode": (
        "dropout", "    def one_model(p, b, x):\n        return functional_call(base, (p, b), (x,))\n\n"
                   "    return vmap(one_model, in_dims=(0, 0, None), randomness",
        "    base.eval()\n    def one_model(p, b, x):\n        return functional_call(base, (p, b), (x,))\n\n"
        "    return vmap(one_model, in_dims=(0, 0, None), randomness", "no unit was dropped"),
    "dropout: the members in another order": (
        "dropout", DROPOUT_VMAP, DROPOUT_VMAP.replace("(params, buffers, x)", "(params, buffers, x).flip(0)"),
        "member 0's output is not its own model with some units dropped"),
    "dropout: a loop over the members": (
        "dropout", DROPOUT_VMAP,
        "    return torch.stack([functional_call(base, ({k: v[i] for k, v in params.items()}, "
        "{k: v[i] for k, v in buffers.items()}), (x,)) for i in range(len(next(iter(params.values()))))])",
        "a Python loop"),
    "ens: buffers left out": (
        "ens", "functional_call(base, (p, b), (x,)), y)", "functional_call(base, p, (x,)), y)",
        "Pass the stacked state"),
}


def run_check(kind, m):
    if kind == "stack":
        C.check_stack_ensemble(m.stack_ensemble)
    elif kind == "predict":
        C.check_ensemble_predict(m.predict_each, m.predict_all)
    elif kind == "psg_loop":
        C.check_per_sample_grads_loop(m.per_sample_grads_loop)
    elif kind == "psg_vmap":
        C.check_per_sample_grads(m.per_sample_grads)
    elif kind == "opacus":
        C.check_opacus_grads(m.opacus_per_sample_grads)
    elif kind == "dp":
        C.check_dp_sgd_step(m.dp_sgd_step)
    elif kind == "ens":
        C.check_ensemble_sgd_step(m.ensemble_sgd_step)
    elif kind == "kl":
        C.check_member_kl(m.member_kl)
    elif kind == "dropout":
        C.check_predict_dropout(m.predict_all_dropout)


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_each_check_catches_a_planted_mistake(mistake, mutate6):
    kind, old, new, says = MISTAKES[mistake]
    m = mutate6(old, new)
    with pytest.raises(AssertionError, match=says):
        run_check(kind, m)


def test_member_kl_speed_check_fails_the_planted_op_and_a_repair_run_twice(sol):
    """The planted F.kl_div (vmap loops over the members) and an answer slower than it (the
    repair, then the planted one) both miss the lesson's CPU bar, at the lesson's CPU sizes."""
    sizes = dict(KL_SPEED, n=256, features=32, hidden=32)
    with pytest.raises(AssertionError, match="bar on this device is 1.50x"):
        C.check_member_kl_speed(V.member_kl_planted, bars={"cpu": 1.5, "cuda": 2.0}, attempts=2, **sizes)

    def both(*args):
        sol.member_kl(*args)
        return V.member_kl_planted(*args)

    with pytest.raises(AssertionError, match="bar on this device is 1.50x"):
        C.check_member_kl_speed(both, bars={"cpu": 1.5, "cuda": 2.0}, attempts=2, **sizes)


def test_the_member_kl_repair_passes_the_lessons_cpu_bar(sol):
    """At the lesson's CPU sizes the repair measured 2.1x the planted op (one thread): the bar
    of 1.5x leaves room for a busy machine. Another repair, F.kl_div outside vmap, passes too."""
    sizes = dict(n=256, batch=8, features=32, hidden=32, num_threads=1)

    def outside(params, buffers, base, x, target):
        log_q = torch.nn.functional.log_softmax(
            vmap(lambda p, b: torch.func.functional_call(base, (p, b), (x,)))(params, buffers), dim=-1)
        return torch.nn.functional.kl_div(log_q, target.expand_as(log_q), reduction="none").sum(-1).mean(-1)

    C.check_member_kl(outside)
    for repair in (sol.member_kl, outside):  # (a busy machine may leave either undecided, never failed)
        never_failed(lambda: C.check_member_kl_speed(repair, bars={"cpu": 1.5, "cuda": 2.0}, **sizes))


def test_speed_checks_verify_every_output_they_time(sol):
    def wrong_kl(params, buffers, base, x, target):
        return sol.member_kl(params, buffers, base, x, target) + 1e-3

    with pytest.raises(AssertionError, match="right before it is fast"):
        C.check_member_kl_speed(wrong_kl, bars={"cpu": 0.01, "cuda": 0.01}, **KL_SPEED)

    def right_once(fn, wrong):
        calls = []

        def answer(*args):
            calls.append(1)
            return fn(*args) if len(calls) == 1 else wrong(*args)
        return answer

    # right on the call checked before timing, wrong on the timed calls (fresh inputs, every output checked)
    with pytest.raises(AssertionError, match="output of a timed call differs"):
        C.check_member_kl_speed(right_once(sol.member_kl, wrong_kl), bars={"cpu": 0.01, "cuda": 0.01},
                                **KL_SPEED)


def test_per_sample_grads_summed_over_the_batch_get_a_shape_hint(sol):
    def summed(model, x, y):
        return {k: v.sum(0) for k, v in sol.per_sample_grads(model, x, y).items()}

    with pytest.raises(AssertionError, match="one gradient for the whole batch"):
        C.check_per_sample_grads(summed)


# -- without the grader's references (a learner's copy) -------------------------------------------

def test_without_the_grader_references_the_visible_checks_use_stored_answers(sol, learners_copy, capsys):
    """The lesson's own calls compare with the answers stored for them (course/reference_data/06_vmap.pt)."""
    C.check_ensemble_predict(sol.predict_each, sol.predict_all)
    C.check_member_kl(sol.member_kl)
    C.check_ensemble_sgd_step(sol.ensemble_sgd_step)
    C.check_per_sample_grads_loop(sol.per_sample_grads_loop)
    C.check_per_sample_grads(sol.per_sample_grads)
    C.check_opacus_grads(sol.opacus_per_sample_grads)
    C.check_dp_sgd_step(sol.dp_sgd_step)
    C.check_predict_dropout(sol.predict_all_dropout)
    assert capsys.readouterr().out.count("ok: ") == 8


def clip_after_averaging(params, grads, *, lr, max_norm, noise_multiplier, generator):
    """DP-SGD with the clipping after the average: the batch's mean gradient clipped, not each sample's."""
    batch = next(iter(grads.values())).shape[0]
    mean = {k: g.mean(0) for k, g in grads.items()}
    factor = min(1.0, max_norm / (float(torch.stack([m.norm() for m in mean.values()]).norm()) + 1e-6))
    return {k: p - lr * (factor * mean[k] + noise_multiplier * max_norm / batch * torch.randn(
        p.shape, generator=generator, device=p.device, dtype=p.dtype)) for k, p in params.items()}


# a planted mistake of each stored answer, and what the message must say (as with the references)
STORED_MISTAKES = ["predict: every model on the first minibatch", "kl: 0 * log 0", "kl: reduction 'mean'",
                   "kl: the other direction", "ens: every member on the first minibatch", "ens: the members' losses averaged",
                   "loop: gradients accumulate in p.grad", "vmap: loss divided by the batch size",
                   "opacus: loss_reduction disagrees with the loss", "dp: each parameter clipped separately",
                   "dp: small gradients scaled up", "dp: nothing clipped", "dp: summed, not averaged",
                   "dp: noise std without max_norm", "dp: noise not averaged"]


@pytest.mark.parametrize("mistake", STORED_MISTAKES)
def test_without_the_grader_references_a_planted_mistake_is_named(mistake, mutate6, learners_copy):
    kind, old, new, says = MISTAKES[mistake]
    with pytest.raises(AssertionError, match=says):
        run_check(kind, mutate6(old, new))


def test_without_the_grader_references_wrong_answers_fail_and_other_calls_are_refused(sol, learners_copy):
    with pytest.raises(AssertionError, match="dp_sgd_step without noise"):
        C.check_dp_sgd_step(clip_after_averaging)
    with pytest.raises(AssertionError, match="right before it is fast"):  # the planted op's values, here
        C.check_member_kl_speed(lambda *a: sol.member_kl(*a) + 1e-3, bars={"cpu": 0.01, "cuda": 0.01}, **KL_SPEED)
    C.check_member_kl_speed(sol.member_kl, bars={"cpu": 0.01, "cuda": 0.01}, **KL_SPEED)
    for check in (lambda: C.check_ensemble_predict(sol.predict_each, sol.predict_all, seed=3),
                  lambda: C.check_member_kl(sol.member_kl, n=3),
                  lambda: C.check_ensemble_sgd_step(sol.ensemble_sgd_step, lr=0.1),
                  lambda: C.check_per_sample_grads(sol.per_sample_grads, batch=5),
                  lambda: C.check_dp_sgd_step(sol.dp_sgd_step, seed=2)):
        with pytest.raises(AssertionError, match="reference data for .* only"):
            check()


# -- the DP-SGD reference ------------------------------------------------------------------------

def _case(batch=6):
    model = V.small_cnn(seed=0, channels=(2, 3), size=8, classes=4, dtype=torch.float64)
    x, y = V.toy_images(batch, seed=1, size=8, classes=4, dtype=torch.float64)
    params = {k: p.detach() for k, p in model.named_parameters()}
    return params, R.reference_per_sample_grads(model, x, y)


def test_dp_reference_without_clipping_or_noise_is_sgd_on_the_mean_gradient():
    params, grads = _case()
    new = R.dp_sgd_reference(params, grads, lr=0.1, max_norm=1e9, noise_multiplier=0.0,
                             generator=torch.Generator().manual_seed(0))
    for k, p in params.items():
        torch.testing.assert_close(new[k], p - 0.1 * grads[k].mean(0), rtol=1e-12, atol=1e-14)


def test_dp_reference_clips_every_sample_to_max_norm():
    params, grads = _case()
    max_norm = float(R.per_sample_norms(grads).min()) / 2  # every sample is clipped
    new = R.dp_sgd_reference(params, grads, lr=1.0, max_norm=max_norm, noise_multiplier=0.0,
                             generator=torch.Generator().manual_seed(0))
    step = {k: (params[k] - new[k]) * 6 for k in params}  # the sum of the clipped gradients
    norms = R.per_sample_norms(grads)
    unit = {k: (g / norms.view(-1, *([1] * (g.dim() - 1)))).sum(0) * max_norm for k, g in grads.items()}
    for k in params:
        torch.testing.assert_close(step[k], unit[k], rtol=1e-5, atol=1e-12)


def test_dp_reference_noise_is_reproducible_and_scaled():
    params, grads = _case()
    kw = dict(lr=1.0, max_norm=2.0, noise_multiplier=3.0)
    a = R.dp_sgd_reference(params, grads, generator=torch.Generator().manual_seed(1), **kw)
    b = R.dp_sgd_reference(params, grads, generator=torch.Generator().manual_seed(1), **kw)
    c = R.dp_sgd_reference(params, grads, generator=torch.Generator().manual_seed(2), **kw)
    assert all(torch.equal(a[k], b[k]) for k in a) and not torch.equal(a["fc.weight"], c["fc.weight"])
    quiet = R.dp_sgd_reference(params, grads, generator=torch.Generator().manual_seed(1), lr=1.0, max_norm=2.0,
                               noise_multiplier=0.0)
    noise = (quiet["fc.weight"] - a["fc.weight"]) * 6 / (3.0 * 2.0)  # back to standard normal
    assert 0.7 < float(noise.std()) < 1.3


# -- the helpers ---------------------------------------------------------------------------------

def test_transforms_active_reads_functorch_levels():
    seen = []

    def f(x):
        seen.append(V.transforms_active())
        return (x ** 2).sum()

    f(torch.ones(2))
    vmap(f)(torch.ones(3, 2))
    vmap(grad(f))(torch.ones(3, 2))
    grad(f)(torch.ones(2))
    assert seen == [(), ("vmap",), ("vmap", "grad"), ("grad",)]


def test_forward_watch_counts_calls_and_removes_its_hook():
    model = V.small_cnn(seed=0, size=8)
    x = torch.randn(3, 1, 8, 8)
    with V.ForwardWatch(model) as watch:
        model(x)
        vmap(lambda xi: model(xi[None]))(x)
    assert watch.calls == [(), ("vmap",)] and not watch.under_vmap
    assert "2 time(s)" in watch.summary()
    model(x)
    assert len(watch.calls) == 2
    with pytest.raises(TypeError, match="nn.Module"):
        V.ForwardWatch(lambda x: x)


def test_models_and_data_are_seeded():
    a, b = V.mlp_ensemble(3, seed=1), V.mlp_ensemble(3, seed=1)
    assert all(torch.equal(p, q) for m, n in zip(a, b)
               for p, q in zip(m.state_dict().values(), n.state_dict().values()))
    assert not torch.equal(a[0][1].weight, a[1][1].weight)
    assert not torch.equal(a[0][0].shift, torch.zeros(64))
    x1, y1 = V.toy_images(5, seed=3)
    x2, y2 = V.toy_images(5, seed=3)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and x1.shape == (5, 1, 16, 16)
    assert torch.equal(V.small_cnn(seed=2).fc.weight, V.small_cnn(seed=2).fc.weight)
    with pytest.raises(ValueError, match="multiple of 4"):
        V.small_cnn(seed=0, size=10)
    with pytest.raises(ValueError, match="at least one model"):
        V.mlp_ensemble(0, seed=0)


def test_toy_images_are_learnable_templates():
    x, y = V.toy_images(400, seed=0, noise=0.0)
    for c in range(10):
        same = x[y == c]
        assert torch.allclose(same, same[:1].expand_as(same))


def test_quiet_opacus_silences_only_the_hook_warning(capsys):
    import course.vmap as module

    module._opacus_explained = False
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        V.quiet_opacus()
        V.quiet_opacus()
        warnings.warn("Full backward hook is firing when gradients are computed with respect to module outputs "
                      "since no inputs require gradients.", UserWarning)
        warnings.warn("something else", UserWarning)
    assert [str(w.message) for w in seen] == ["something else"]
    assert capsys.readouterr().out.count("Note:") == 1


def test_opacus_solution_leaves_the_model_clean(sol):
    model = V.small_cnn(seed=0, channels=(2, 3), size=8)
    before = copy.deepcopy(model.state_dict())
    x, y = V.toy_images(4, seed=0, size=8)
    first = sol.opacus_per_sample_grads(model, x, y)
    second = sol.opacus_per_sample_grads(model, x, y)  # no accumulation, no "hooks added twice"
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert not model._forward_hooks and not model.conv1._forward_hooks


def test_speedup_plot():
    import matplotlib.pyplot as plt

    from course.timing import Ratio

    ax = V.plot_speedup_by_batch([2, 8], {"vmap": [Ratio(0.5, 0.4, 0.6), Ratio(2.0, 1.8, 2.1)]})
    assert ax.get_xlabel() == "batch size" and len(ax.lines) >= 2
    plt.close(ax.figure)


def test_the_summed_loss_is_an_equal_answer_to_the_ensemble_step(sol):
    """The lesson's claim: members share no parameter, so grad of the summed losses is each member's
    own gradient (an equal answer the check must accept)."""
    def summed(params, buffers, base, xs, ys, lr):
        def member_loss(p, b, x, y):
            return torch.nn.functional.cross_entropy(torch.func.functional_call(base, (p, b), (x,)), y)
        g = grad(lambda p: vmap(member_loss)(p, buffers, xs, ys).sum())(params)
        return {k: p - lr * g[k] for k, p in params.items()}
    C.check_ensemble_sgd_step(summed, seed=3)


def test_teacher_task_is_seeded_fixed_and_roughly_balanced():
    x, y = V.teacher_task(4000, features=64, seed=4)
    x2, y2 = V.teacher_task(4000, features=64, seed=4)
    assert torch.equal(x, x2) and torch.equal(y, y2) and x.shape == (4000, 64) and y.shape == (4000,)
    counts = torch.bincount(y, minlength=10)
    assert counts.min() > 0.8 * 400 and counts.max() < 1.2 * 400, counts
    # the rule is the task's, not the draw's: the same features get the same labels under any seed
    xa, ya = V.teacher_task(5, 7, features=16, seed=9, classes=4)
    assert xa.shape == (5, 7, 16) and ya.shape == (5, 7) and int(ya.max()) < 4
    assert torch.equal(V.teacher_task(5, 7, features=16, seed=9, classes=4)[1], ya)


def test_the_lesson_ensemble_learns_and_its_vote_beats_the_average_member(sol):
    """The lesson's training cell, small: after some steps every member has learned something, and
    the vote is better than the average member (the claim the lesson's prose makes)."""
    models = V.mlp_ensemble(16, seed=0, features=64, hidden=32)
    params, buffers, base = sol.stack_ensemble(models)
    state = {k: v.detach() for k, v in params.items()}
    held_x, held_y = V.teacher_task(1024, features=64, seed=7)
    for step in range(60):
        xs, ys = V.teacher_task(16, 32, features=64, seed=100 + step)
        state = sol.ensemble_sgd_step(state, buffers, base, xs, ys, 0.5)
    with torch.no_grad():
        logits = sol.predict_all(state, buffers, base, held_x)
    members = (logits.argmax(-1) == held_y).float().mean(1)
    vote = (logits.softmax(-1).mean(0).argmax(-1) == held_y).float().mean()
    assert members.min() > 0.15, members  # chance is 0.1
    assert vote > members.mean() + 0.03, (vote, members)


def _clock_setup(monkeypatch, clock, *args) -> dict:
    """What a lesson-6 clock hands the judge's clock (``setup()``), without timing anything."""
    seen = {}

    def capture(fn, label, setup, **kwargs):
        seen.update(setup(), no_loop=kwargs["no_loop"])
        return "timed"

    monkeypatch.setattr(C, "_expect_no_loop_by_clock", capture)
    getattr(C, clock)(*args)
    return seen


@pytest.mark.parametrize("clock, answer, extra, dtype", [
    ("_ensemble_clock", "predict_each", (False,), torch.float32),
    ("_ensemble_clock", "predict_all", (True,), torch.float32),
    ("_sgd_clock", "ensemble_sgd_step", (0.5,), torch.float64),
    ("_per_sample_clock", "per_sample_grads", (), torch.float64),
    ("_per_sample_clock", "opacus_per_sample_grads", (), torch.float64),
])
def test_the_block_clocks_yardsticks_give_the_right_answers_on_the_clocks_inputs(sol, monkeypatch, clock, answer,
                                                                                   extra, dtype):
    """The clocks timed as blocks compare every timed output's checksums with their yardstick's (the
    leanest loop, course.references.vmap): on the clock's own inputs (the factory's, after the staged
    state) the yardstick gives the instructor's answer, and a third of it is the bar."""
    fn = getattr(sol, answer)
    seen = _clock_setup(monkeypatch, clock, fn, answer, *extra)
    assert seen["make"] is None and seen["no_loop"] == C.NO_LOOP
    args = (*seen.get("constants", ()), *seen["factory"](11, device="cpu", **seen["sizes"]))
    with torch.set_grad_enabled(seen.get("grad", False)):
        want, got = seen["loop"](*args), fn(*args)
    if isinstance(want, torch.Tensor):
        want, got = {"out": want}, {"out": got}
    assert set(want) == set(got) and {t.dtype for t in want.values()} == {dtype}
    for k in want:
        torch.testing.assert_close(got[k].detach(), want[k], **(dict(rtol=1e-9, atol=1e-12) if dtype == torch.float64
                                                                 else dict(rtol=1e-5, atol=1e-6)))


def test_the_sgd_clock_times_float64_members_where_no_relu_kink_splits_a_right_answer(sol, monkeypatch):
    """The clock compares every timed step with the loop's. In float32 a ReLU input within rounding of
    0 sent one of 1,024 members down the other side in the batched kernel about once in 300 calls,
    and the instructor's notebook lost the cell (CI on 2e78c7d); in float64 the steps agree: the staged
    state and the factory's inputs are float64, for the per-sample clock too."""
    for clock, extra in (("_sgd_clock", (0.5,)), ("_per_sample_clock", ())):
        seen = _clock_setup(monkeypatch, clock, sol.ensemble_sgd_step, "x", *extra)
        args = (*seen.get("constants", ()), *seen["factory"](11, device="cpu", **seen["sizes"]))
        floats = [t for a in args for t in (a.values() if isinstance(a, dict) else
                                            a.parameters() if isinstance(a, torch.nn.Module) else [a])
                  if isinstance(t, torch.Tensor) and t.is_floating_point()]
        assert floats and {t.dtype for t in floats} == {torch.float64}, clock


def test_the_block_clocks_state_is_drawn_once_and_matches_a_member_made_by_the_course():
    """The prediction and SGD clocks' stacked state is drawn once per judge (8,192 members in
    milliseconds: building modules took 3 s for 4,096), in the shape ``stack_module_state`` gives."""
    from torch.func import stack_module_state

    C._clock_state.cache_clear()
    params, buffers, base = C._clock_state(8, torch.float32)
    assert C._clock_state(8, torch.float32)[0] is params
    ref_p, ref_b = stack_module_state(V.mlp_ensemble(8, seed=0, features=4, hidden=4, classes=3, device="cpu"))
    assert {k: v.shape for k, v in params.items()} == {k: v.shape for k, v in ref_p.items()}
    assert {k: v.shape for k, v in buffers.items()} == {k: v.shape for k, v in ref_b.items()}
    assert all(p.device.type == "meta" for p in base.parameters())
    assert len({tuple(v[i].flatten().tolist()) for v in params.values() for i in range(8)}) > 8  # members differ

def test_the_exercises_state_the_clocks_sizes_and_bars():
    """The lesson's text tells the learner what the grader's clocks ask: their sizes and bars as the
    code has them (a draft's figures once stayed in lesson 7's text)."""
    import json
    from pathlib import Path

    nb = json.loads((Path(__file__).resolve().parents[1] / "solutions" / "06_vmap_ensembles"
                     / "06_vmap_ensembles.ipynb").read_text())
    text = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    for count in (C.PREDICT_MEMBERS, C.CLOCK_MEMBERS, C.CLOCK_SAMPLES, C.ENSEMBLE_MEMBERS):
        assert f"{count:,}" in text, count
    assert C.BLOCK_NO_LOOP == 1 / 3 and text.count("at most a third of the time of the") >= 3
    assert C.ENSEMBLE_NO_LOOP == 1 / 20 and "under a twentieth" in text  # the dropout clock's
    assert "0.06" not in text and "1,024 samples" not in text

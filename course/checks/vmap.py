"""Checks for lesson 06_vmap_ensembles: stacking an ensemble's state, ensemble predictions with
``vmap`` (a different minibatch per model, and one minibatch for all), the members' KL divergence
with no op that ``vmap`` runs member by member (and its speed over the planted ``F.kl_div``), one
SGD step for every member, per-sample gradients by a loop, by ``vmap(grad(loss))`` and by Opacus,
one DP-SGD step, and members that keep their dropout on (``randomness=``).

Models and data come from ``seed`` (``course.vmap``), so the learner chooses none of the inputs.
Under the grader every check here runs in the judge (``SERVED``): models cross as recipes (the
learner's process builds the same seeded model with the course's code), a generator as its state,
and what the learner's function did to its inputs comes back (:func:`course.remote.mirrored`).
Numerics are checked twice where it matters: in float64 against a float64 loop, with a tight
tolerance (any real mistake is far larger than float64 rounding), and in float32 against the
same float64 reference, with a tolerance that float32 rounding honestly needs. Structure is
checked with :class:`course.vmap.ForwardWatch`: a loop calls the model once per sample or per
member with no transform active; ``vmap`` calls it once, inside ``vmap``. Across the boundary
those calls happen in the learner's process, so there "a loop or not" is the judge's clock: on
work where a loop is slow (1,024 models, 256 samples), the answer must take at most a third of the
course's own loop, timed beside it with the learner's process stopped.

The references (the loops, the DP-SGD step) answer the exercises, so they are the grader's alone
(:mod:`course.references.vmap`): the judge and the tests compute every answer with them; a
learner's copy of the course has the answers of the lesson's own calls only (seed 0, the default
sizes, ``course/reference_data/06_vmap.pt``), and refuses other arguments: the grader checks those.
"""

from __future__ import annotations

import copy
import functools
import secrets
import warnings
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import stack_module_state
from torch.utils._pytree import tree_map

from course.checks.common import (NO_LOOP, call, expect_loop_verdict, expect_no_loop_by_clock,
                                  grader_references, name_mistake, ok, probed_names, record, same_values,
                                  served_speedup, stored_answers, visible_call)
from course.data import device_generator
from course.devices import pick_device
from course.grading import expect_constant_work
from course.numerics import assert_close, describe, observing_paused
from course.remote import factory, is_remote, mirrored, prober
from course.timing import SpeedReport
from course.vmap import (ForwardWatch, member_kl_planted, meta_copy, meta_mlp, mlp, mlp_ensemble, small_cnn, toy_features,
                         toy_images, vmap_fallbacks)
from course.wire import ModuleState

__all__ = ["check_dp_sgd_step", "check_ensemble_predict", "check_ensemble_sgd_step", "check_member_kl",
           "check_member_kl_speed", "check_opacus_grads",
           "check_per_sample_grads", "check_per_sample_grads_loop", "check_predict_dropout",
           "check_stack_ensemble", "reference_data"]

SERVED = ("check_stack_ensemble", "check_ensemble_predict", "check_predict_dropout", "check_member_kl",
          "check_member_kl_speed", "check_ensemble_sgd_step", "check_per_sample_grads_loop",
          "check_per_sample_grads", "check_opacus_grads", "check_dp_sgd_step")

#: Sizes at which the judge's clock asks "a loop or not": enough models or samples that a loop's
#: per-item cost dominates, small enough to take a fraction of a second. Three of the four clocks time
#: *blocks* (``clock_against_loop(factory=)``): the members' state crosses once, ahead of the clock, and
#: each timed request carries a seed, from which the learner's process makes the inputs with the
#: course's factory and answers with its output's checksums; what is timed is the learner's work alone.
#: Their yardstick is the leanest loop we know (:mod:`course.references.vmap`: ``predictions_loop``,
#: ``sgd_step_loop``, ``per_sample_grads_loop``, NumPy on each member's or sample's few numbers, the
#: gradient by hand): a loop of the learner's reads about 1 and fails outright, where against the
#: course's loops of module calls (ten times as slow) NumPy loops read 0.10-0.16, undecided, and each
#: such submission was graded twice.
CLOCK_MEMBERS = 2048
#: The per-sample clocks' samples (:func:`_per_sample_clock`). Their model is a tiny MLP, not the
#: lesson's CNN: under ``vmap`` a convolution's per-sample weight gradient costs about 25 us a sample on
#: a CPU, as much as a loop writing each sample's whole CNN gradient by hand in NumPy (2026-12-02).
CLOCK_SAMPLES = 2048
#: The members of the prediction clocks (a member is five NumPy calls in the yardstick, about 4 us).
PREDICT_MEMBERS = 8192
#: The members of the ensemble-with-dropout's clock (each a few module calls in the course's loop, 40-80 us).
ENSEMBLE_MEMBERS = 4096
#: The bar of the clocks timed as blocks, against the leanest loops: a third (under the grader right
#: answers read 0.10-0.19 of them, the red team's NumPy loops 0.97-1.75; 2-core Xeon, 2026-12-02).
BLOCK_NO_LOOP = NO_LOOP
#: The ensemble-with-dropout's bar, against the course's loop (its outputs are random: they cross, and
#: are read back member by member, so it is not timed as blocks). A loop over the members in NumPy,
#: each member's forward in five ops (about 1 us each), read 0.09-0.13 with dropout at 2,048 to 4,096
#: members and passed every earlier bar (red team, round 11); right answers, with the state kept,
#: read 0.020 at 4,096 members, in a thread (2026-12-02). A twentieth leaves each side a margin of two.
ENSEMBLE_NO_LOOP = 0.05
#: The seed of the clocks' members. The clock is the judge's yardstick, not the check's case: it asks
#: once per learner function (a hidden test on another seed, size or rate asks the same question of
#: the same function, and gets the first reading), on members built once per judge. Built per case,
#: a lesson-6 grade built 4,096 members seven times and ran three more clocks: 15 of its 55 s.
CLOCK_SEED = 0

# float64: a few hundred ulps of slack for a different order of additions (batched kernels).
TIGHT = dict(rtol=1e-9, atol=1e-11)
#: Results that agree to float64 rounding: what names a mistake in lesson 6's steps.
CLOSE64 = dict(rtol=1e-7, atol=1e-10)


#: The two dtypes every value is checked in, by name (the stored answers' keys).
DTYPES = {"float64": torch.float64, "float32": torch.float32}

#: What the visible checks compare with in a learner's copy (``python -m course.references`` writes it).
DATA_FILE = "06_vmap.pt"


def _answers(kind: str, dev: torch.device, **case) -> dict:
    """The answers of one ``kind`` of check on ``case`` (its seed and sizes), on ``dev``: computed by
    the grader's references where they exist, else the ones stored for the lesson's own call."""
    refs = grader_references("vmap")
    if refs is not None:
        return ANSWERS[kind](refs, dev, **case)
    for entry in stored_answers(DATA_FILE)[kind]:
        if entry["case"] == case:
            return tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, entry["answers"])
    lesson = " or ".join(str(entry["case"]) for entry in stored_answers(DATA_FILE)[kind])
    raise AssertionError(f"This check has reference data for {lesson} only (the lesson's own call); the grader "
                         f"checks others ({case} asked for here).")


def _float32_tolerance(dev: torch.device) -> dict:
    """float32 against a float64 reference. On a CPU the errors measured in this lesson are below
    5e-7 for values of order 1 (a batched kernel adds in another order than a per-sample one);
    1e-5 leaves a wide margin yet catches any real mistake. On CUDA, convolutions may run in
    TF32 (10-bit mantissa), so the PyTorch tutorial's atol of 3e-3 is used there."""
    return dict(rtol=1e-4, atol=1e-5) if dev.type == "cpu" else dict(rtol=1e-3, atol=3e-3)


# -- ensembles -----------------------------------------------------------------------------------

def _stacked(models):
    params, buffers = stack_module_state(models)
    return params, buffers, meta_copy(models[0])


def _call_stacked(fn: Callable, *args, name: str):
    """``call`` for a function of stacked state and a meta ``base``: an error that mentions the meta
    device gets the hint that names its usual cause."""
    try:
        return call(fn, *args, name=name)
    except AssertionError as exc:
        if "meta" not in str(exc):
            raise
        raise AssertionError(f"{exc}\n  Hint: a tensor on the meta device took part in the computation: base's "
                             "own (meta) state. Pass the stacked state, parameters and buffers, as "
                             "functional_call(base, (p, b), (x,)).") from exc.__cause__


@functools.lru_cache(maxsize=4)
def _clock_state(n: int, dtype: torch.dtype) -> tuple[dict, dict, nn.Module]:
    """``(params, buffers, base)``: the stacked state of ``n`` tiny members (4 features, 4 hidden units,
    3 classes; drawn as :func:`course.vmap.mlp` draws a member's, from ``CLOCK_SEED``, for all at once)
    and their meta base, once per judge: the clocks timed as blocks need no modules (their yardsticks
    work on the stacked state), and drawing it costs milliseconds where building 4,096 modules took 3 s."""
    g = torch.Generator().manual_seed(CLOCK_SEED)
    architecture = meta_mlp(features=4, hidden=4, classes=3, dtype=dtype)
    weights = {}
    for k, t in architecture.named_parameters():
        fan_in = architecture.get_submodule(k.rpartition(".")[0]).in_features
        weights[k] = ((torch.rand(n, *t.shape, generator=g, dtype=torch.float64) * 2 - 1) / fan_in ** 0.5).to(dtype)
    standardise = {"0.shift": (torch.randn(n, 4, generator=g, dtype=torch.float64) * 0.3).to(dtype),
                   "0.scale": (torch.rand(n, 4, generator=g, dtype=torch.float64) + 0.5).to(dtype)}
    return weights, standardise, architecture


def _clock_members(n: int, seed: int, dtype: torch.dtype, classes: int, dropout: float | None) -> list[nn.Module]:
    """The dropout clock's ``n`` tiny members (4 features, 4 hidden units), built when its reading is
    made (once per learner function: the hidden tests of the cell get the reading) and let go after:
    4,096 modules take about 3 s to build, and while the judge held them (tens of thousands of
    tensors) the NumPy yardsticks of the other clocks ran 20-30% slower, and the leanest loops read
    0.7 of them (undecided) where they read 1. The judge only ever runs them (the learner's side gets
    their state); the unit before the dropout is pushed alive (every mask bit readable)."""
    members = mlp_ensemble(n, seed=seed, features=4, hidden=4, classes=classes, dropout=dropout, device="cpu",
                           dtype=dtype)
    if dropout is not None:
        with torch.no_grad():
            for m in members:
                m[-4].bias.add_(5.0)
    return members


def _module_facts(base) -> tuple[str, dict[str, str]] | None:
    """``(type name, {state name: device type})`` of a module, or of one the learner's process
    described (``ModuleState``); ``None`` for anything else."""
    if isinstance(base, ModuleState):
        return base.type_name, {k: t.device.type for k, t in base.state.items()}
    if isinstance(base, nn.Module):
        return f"{type(base).__module__}.{type(base).__qualname__}", {
            k: t.device.type for k, t in base.state_dict().items()}
    return None


def _expect_no_loop_by_clock(fn: Callable, label: str, setup: Callable[[], dict], *, count: int, unit: str,
                             key: tuple, no_loop: float = NO_LOOP) -> str:
    """:func:`course.checks.common.expect_no_loop_by_clock`, with lesson 6's hint (vmap)."""
    return expect_no_loop_by_clock(fn, label, setup, count=count, unit=unit, key=key, no_loop=no_loop,
                                   hint=f"write the computation for one {unit} and let torch.func.vmap run it over "
                                        "all of them in one call; no loop inside or around it.")


def check_stack_ensemble(stack_ensemble: Callable, *, seed: int = 0, n: int = 4, features: int = 12,
                         hidden: int = 16, classes: int = 5, device=None) -> None:
    """``stack_ensemble(models) -> (params, buffers, base)``: every parameter and buffer stacked
    along a new first dimension (one slice per model, as ``stack_module_state`` does), and a
    stateless copy of the architecture on the ``meta`` device; the models themselves untouched."""
    dev = pick_device(device)
    models = mlp_ensemble(n, seed=seed, features=features, hidden=hidden, classes=classes, device=dev,
                          dtype=torch.float64)
    before = [copy.deepcopy(m.state_dict()) for m in models]
    expected_p, expected_b = stack_module_state(models)
    expected_p = {k: v.detach() for k, v in expected_p.items()}
    with mirrored(stack_ensemble):  # across the boundary, what it did to the models comes back
        got = call(stack_ensemble, models, name="stack_ensemble")
    if not (isinstance(got, (tuple, list)) and len(got) == 3):
        raise AssertionError(f"stack_ensemble should return (params, buffers, base), got {describe(got)}.")
    params, buffers, base = got
    if len(models) != n:  # across the boundary a list that shrank comes back shorter: its last models unseen
        raise AssertionError(f"stack_ensemble changed the list of models it was given: it held {n}, it now holds "
                             f"{len(models)}. Leave the caller's list (and its models) as they were.")
    if not isinstance(params, Mapping) or not isinstance(buffers, Mapping):
        raise AssertionError(f"params and buffers should be dicts (name -> stacked tensor), got "
                             f"{describe(params)} and {describe(buffers)}.\n  Hint: "
                             "params, buffers = torch.func.stack_module_state(models)")
    for i, (m, state) in enumerate(zip(models, before)):
        for name, t in m.state_dict().items():
            if t.device != state[name].device or not torch.equal(t, state[name]):
                raise AssertionError(
                    f"stack_ensemble changed models[{i}] (its {name} is now {describe(t)}). Did you move "
                    "models[0] itself to the meta device? .to() changes a module in place: move a copy, "
                    "copy.deepcopy(models[0]).to('meta').")
    if not buffers and expected_b:
        raise AssertionError(f"buffers is empty, but these models have buffers ({', '.join(expected_b)}: the "
                             "Standardize layer's shift and scale). They are state too: stack them as well.")
    assert_close(dict(params), expected_p, name="params", **TIGHT,
                 hint=f"params[name] is the {n} models' parameter `name` stacked along a new first dimension.")
    assert_close(dict(buffers), dict(expected_b), name="buffers", **TIGHT,
                 hint=f"buffers[name] is the {n} models' buffer `name` stacked along a new first dimension.")
    facts = _module_facts(base)
    if facts is None:
        raise AssertionError(f"base should be an nn.Module (a copy of the architecture), got {describe(base)}.")
    kind, devices = facts
    if kind != _module_facts(models[0])[0] or list(devices) != list(models[0].state_dict()):
        raise AssertionError("base should have the same architecture as the models: a copy of models[0].")
    real = [n_ for n_, d in devices.items() if d != "meta"]
    if real:
        raise AssertionError(f"base holds real tensors ({real[0]} is on {devices[real[0]]}); it "
                             "should be stateless, on the meta device, where tensors have shapes but no memory.\n"
                             "  Hint: base = copy.deepcopy(models[0]).to('meta')")
    ok(f"stack_ensemble stacks {len(params)} parameters and {len(buffers)} buffers of {n} models, base is on "
       f"the meta device, the models are untouched (seed {seed})")


def _expect_vmapped(watch: ForwardWatch, what: str, loop_count: int, unit: str) -> None:
    if not watch.calls:
        raise AssertionError(f"{what} never called the model it was given (`base`). Run it with "
                             "torch.func.functional_call(base, (params, buffers), (x,)) inside vmap.")
    if not watch.under_vmap:
        loop = " That is one call per " + unit + ": a Python loop." if len(watch.calls) >= loop_count else ""
        raise AssertionError(f"{what}: {watch.summary()}.{loop}\n  Hint: write the computation for one "
                             "model (or one sample) and let torch.func.vmap run it over the whole batch in one "
                             "call.")
    if len(watch.calls) >= loop_count > 1:  # with one member, one vmapped call is right
        raise AssertionError(f"{what}: {watch.summary()}: once per {unit}, so vmap is inside a loop. Let one "
                             "vmap call cover the whole batch.")


def _predict_case(seed: int, n: int, batch: int, features: int, hidden: int, classes: int, dev: torch.device,
                   dtype: torch.dtype) -> tuple:
    """``(models, xs, x)``: exercise 2's ensemble, a minibatch per model and one for all."""
    models = mlp_ensemble(n, seed=seed, features=features, hidden=hidden, classes=classes, device=dev, dtype=dtype)
    return (models, toy_features(n, batch, features, seed=seed + 1, device=dev, dtype=dtype),
            toy_features(batch, features, seed=seed + 2, device=dev, dtype=dtype))


def _predict_answers(refs, dev: torch.device, **case) -> dict:
    """Exercise 2's answers by the loop over the models, in either dtype: ``predict_each``,
    ``predict_all``, and ``first`` (every model on ``xs[0]``: a slip's result)."""
    out = {}
    for name, dtype in DTYPES.items():
        models, xs, x = _predict_case(**case, dev=dev, dtype=dtype)
        with torch.no_grad():
            out[name] = {"predict_each": refs.loop_predictions(models, xs, same_minibatch=False),
                         "predict_all": refs.loop_predictions(models, x, same_minibatch=True),
                         "first": refs.loop_predictions(models, xs[0], same_minibatch=True)}
    return out


def check_ensemble_predict(predict_each: Callable, predict_all: Callable, *, seed: int = 0, n: int = 5,
                           batch: int = 7, features: int = 12, hidden: int = 16, classes: int = 5,
                           device=None) -> None:
    """``predict_each(params, buffers, base, xs)`` with ``xs`` of shape ``(n, batch, features)``
    returns every model's output on its own minibatch, ``(n, batch, classes)``;
    ``predict_all(params, buffers, base, x)`` with ``x`` of shape ``(batch, features)`` returns
    every model's output on that one minibatch, ``(n, batch, classes)``. Both equal the loop over
    the models, and both call the base model once, under ``vmap``."""
    dev = pick_device(device)
    case = dict(seed=seed, n=n, batch=batch, features=features, hidden=hidden, classes=classes)
    answers = _answers("ensemble predictions", dev, **case)
    for dtype_name, dtype in DTYPES.items():
        tol = TIGHT if dtype == torch.float64 else _float32_tolerance(dev)
        models, xs, x_all = _predict_case(**case, dev=dev, dtype=dtype)
        want = answers[dtype_name]
        for label, fn, x, same in (("predict_each", predict_each, xs, False),
                                   ("predict_all", predict_all, x_all, True)):
            params, buffers, base = _stacked(models)
            expected = want[label]
            with torch.no_grad(), ForwardWatch(base) as watch:
                got = _call_stacked(fn, params, buffers, base, x.clone(), name=label)
            if not isinstance(got, torch.Tensor):
                raise AssertionError(f"{label} should return a tensor of shape {tuple(expected.shape)}, got "
                                     f"{describe(got)}.")
            where = "xs[i], model i's own minibatch" if not same else "the same x for every model"
            in_dims = "(0, 0, 0)" if not same else "(0, 0, None)"
            if not same:
                with torch.no_grad():
                    name_mistake(label, got, expected, {
                        "every model ran on the first minibatch xs[0]; model i takes its own xs[i] "
                        "(in_dims=(0, 0, 0) over params, buffers and xs)": want["first"],
                        "model 0 ran on every minibatch; each model takes its own parameters (in_dims 0 over "
                        "params and buffers)": torch.stack([models[0](x[i]) for i in range(len(models))]),
                    }, **tol)
            assert_close(got, expected, name=f"{label} ({str(dtype).replace('torch.', '')})", **tol,
                         hint=f"row i is model i on {where}: vmap over (params, buffers, x) with "
                              f"in_dims={in_dims}.")
            if not is_remote(fn):  # across the boundary the model runs in the learner's process: the clock below
                _expect_vmapped(watch, label, n, "model")
    evidence = []
    for label, fn, same in (("predict_each", predict_each, False), ("predict_all", predict_all, True)):
        if is_remote(fn):
            evidence.append(_ensemble_clock(fn, label, same))
            continue

        def prepare(k, fn=fn, same=same, label=label):
            members = mlp_ensemble(k, seed=seed, features=features, hidden=hidden, classes=classes, device=dev)
            params, buffers, base = _stacked(members)
            x = toy_features(*((batch, features) if same else (k, batch, features)), seed=seed + 3, device=dev)

            def run():
                with torch.no_grad():
                    call(fn, params, buffers, base, x, name=label)
            return run

        expect_constant_work(prepare, n, 2 * n, what=label, unit="model")
    if evidence:
        ok(f"predict_each and predict_all equal the loop over {n} models in float64 and float32; "
           f"{'; '.join(evidence)} (batch={batch}, seed {seed})")
        return
    ok(f"predict_each and predict_all equal the loop over {n} models in float64 and float32, with one vmapped "
       f"call of the base model each and as much work for {2 * n} models as for {n} (batch={batch}, seed {seed})")


def _ensemble_clock(fn: Callable, label: str, same: bool) -> str:
    """The judge's clock on ``PREDICT_MEMBERS`` small models (on the CPU), timed as blocks against
    the leanest loop (``predictions_loop``)."""
    def setup() -> dict:
        yardstick = grader_references("vmap").predictions_loop
        params, buffers, base = _clock_state(PREDICT_MEMBERS, torch.float32)

        def loop(params, buffers, base, x):
            return yardstick(params, buffers, x, same_minibatch=same)
        return dict(make=None, loop=loop, factory=ensemble_clock_inputs, constants=(params, buffers, base),
                    sizes=dict(members=PREDICT_MEMBERS, same=same))

    with torch.no_grad():
        text = _expect_no_loop_by_clock(fn, label, setup, count=PREDICT_MEMBERS, unit="model",
                                        key=("ensemble", same), no_loop=BLOCK_NO_LOOP)
    return f"{label} {text}"


@factory
def ensemble_clock_inputs(seed: int, *, device: str, members: int, same: bool) -> tuple:
    """``(x,)`` for one timed call of the prediction clocks: one minibatch of 4 for every member, or
    one for each (the members' state comes ahead of it, staged once)."""
    shape = (4, 4) if same else (members, 4, 4)
    return (torch.randn(shape, generator=device_generator(seed, device), device=device),)


# -- dropout in an ensemble: randomness= ----------------------------------------------------------

def _agree_by_chance(p: float) -> float:
    """The share of units on which two independent dropout masks agree: both drop or both keep."""
    return p * p + (1 - p) * (1 - p)


def _share_near_p(share: float, p: float, units: int) -> bool:
    """Whether ``share`` dropped of ``units`` is dropout's ``p``, within five binomial sigmas and 0.02."""
    return abs(share - p) <= 5 * (p * (1 - p) / max(units, 1)) ** 0.5 + 0.02


def _kept_units(members, x: torch.Tensor, got: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What each member's dropout did, read back from its output (float64): ``(z, h, scaled)``,
    each ``(n, batch, hidden)``. ``h`` is the hidden layer before dropout, ``scaled`` what a kept
    unit passes on (``h / (1 - p)``), and ``z`` what the output says reached the last layer: it
    is square and invertible in the check's models, so ``z = (out - b) W^-T``."""
    zs, hs, scaled = [], [], []
    for model, out in zip(members, got.double()):
        h, dropout, last = model[:-2](x), model[-2], model[-1]
        zs.append(torch.linalg.solve(last.weight.double(), (out - last.bias.double()).T).T)
        hs.append(h)
        scaled.append(h / (1 - dropout.p))
    return torch.stack(zs), torch.stack(hs), torch.stack(scaled)


def check_predict_dropout(predict_all_dropout: Callable, *, seed: int = 0, n: int = 4, batch: int = 32,
                          features: int = 12, hidden: int = 16, p: float = 0.5, device=None) -> None:
    """``predict_all_dropout(params, buffers, base, x)``: every member of an ensemble trained with
    dropout (:func:`course.vmap.mlp` with ``dropout=p``, training mode) on the one minibatch ``x``, each
    member drawing its own dropout mask, as a loop over the members would: ``(n, batch, hidden)``.

    The check reads every member's mask back from its output (its last layer is square and
    invertible here) and asks: is each output the member's own with some units dropped and the
    rest scaled by ``1 / (1 - p)``; is the share dropped near ``p``; do the members' masks differ
    (``randomness='same'`` shares one). In the learner's own process it also watches the base
    model: one call, under ``vmap``; across the boundary the judge's clock asks instead
    (:func:`_dropout_clock`)."""
    dev = pick_device(device)
    members = mlp_ensemble(n, seed=seed, features=features, hidden=hidden, classes=hidden, dropout=p, device=dev,
                           dtype=torch.float64)
    params, buffers = stack_module_state(members)
    base = meta_mlp(features=features, hidden=hidden, classes=hidden, dropout=p, dtype=torch.float64)
    x = toy_features(batch, features, seed=seed + 5, device=dev, dtype=torch.float64)
    label = "predict_all_dropout"
    with torch.no_grad(), ForwardWatch(base) as watch:
        got = _call_stacked(predict_all_dropout, params, buffers, base, x.clone(), name=label)
    shape = (n, batch, hidden)
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != shape:
        raise AssertionError(f"{label} should return a tensor of shape {shape} (member, row, output), got "
                             f"{describe(got)}.")
    if not is_remote(predict_all_dropout):
        _expect_vmapped(watch, label, n, "model")
    with torch.no_grad():
        z, h, scaled = _kept_units(members, x, got)
        for m in members:
            m.eval()
        plain = torch.stack([m(x) for m in members])
    if torch.allclose(got.double(), plain, **TIGHT):
        raise AssertionError(f"{label}: no unit was dropped: every member's output is its output in eval mode. "
                             "The base model comes in training mode; run it as it is (no base.eval()), so that "
                             "its Dropout draws a mask.")
    live = h > 1e-9 * float(h.abs().max())                   # a unit at 0 says nothing about its mask
    dropped = z.abs() <= 1e-7 * scaled.abs().amax()
    kept = (z - scaled).abs() <= 1e-7 * scaled.abs().amax()
    odd = live & ~dropped & ~kept
    if odd.any():
        i, row, unit = (int(v) for v in odd.nonzero()[0])
        raise AssertionError(f"{label}: member {i}'s output is not its own model with some units dropped: hidden "
                             f"unit {unit} of row {row} reached the last layer as {float(z[i, row, unit]):.6g}, but "
                             f"dropout passes 0 or h / (1 - p) = {float(scaled[i, row, unit]):.6g}.\n  Hint: row i of "
                             "the result is member i on x: functional_call(base, (p, b), (x,)) under vmap with "
                             "in_dims=(0, 0, None).")
    with torch.no_grad():  # the outputs again, from the masks read back
        through = torch.where(kept & live, scaled, torch.zeros_like(scaled))
        rebuilt = torch.stack([t @ m[-1].weight.T + m[-1].bias for t, m in zip(through, members)])
    # The masks are the learner's process's draw, which anything else that process drew before moves
    # (an honest answer beside one more dropout call in its cell lost the cell as "altered"): the
    # comparison is this run's own, and the parent hears its verdict.
    with observing_paused():
        assert_close(got.double(), rebuilt, rtol=1e-6, atol=1e-9 * float(rebuilt.abs().max()),
                     name=f"{label}: each member's output, rebuilt from the mask read back from it")
    with torch.no_grad():
        again = _call_stacked(predict_all_dropout, params, buffers, base, x.clone(), name=label)
    if isinstance(again, torch.Tensor) and again.shape == got.shape and torch.equal(again, got):
        raise AssertionError(f"{label}: a second call on the same inputs dropped exactly the same units: dropout "
                             "draws a fresh mask on every call (from the global generator, as the base model's "
                             "Dropout does); masks fixed by a seed of their own are not dropout.")
    if isinstance(again, torch.Tensor) and again.shape == got.shape:  # most units kept from the first call
        z_again, _, _ = _kept_units(members, x, again)
        dropped_again = z_again.abs() <= 1e-7 * scaled.abs().amax()
        for i in range(n):
            kept_live = int(live[i].sum())
            repeat = float((dropped[i] == dropped_again[i])[live[i]].double().mean()) if kept_live else 0.0
            if kept_live and repeat > _same_masks_bar(p, kept_live):
                raise AssertionError(f"{label}: a second call on the same inputs gave member {i} {repeat:.0%} of the "
                                     "same mask (independent draws agree on about "
                                     f"{_agree_by_chance(p):.0%}): dropout draws a fresh mask on every call; "
                                     "masks kept from an earlier call are not dropout.")
    share = float(dropped[live].double().mean())
    near_p = _share_near_p(share, p, int(live.sum()))
    if not near_p:
        raise AssertionError(f"{label}: {share:.0%} of the units were dropped; dropout with p = {p} drops about "
                             f"{p:.0%}. Run the base model as it is, once per member.")
    chance = _agree_by_chance(p)
    agree, common, pairs = [], [], []
    for i in range(n):
        for j in range(i + 1, n):
            both = live[i] & live[j]
            agree.append(float((dropped[i] == dropped[j])[both].double().mean()))
            common.append(int(both.sum()))
            pairs.append((i, j))
    over = [k for k, a in enumerate(agree) if a > _same_masks_bar(p, common[k])]
    shared = bool(over)
    if agree and len(over) == len(agree) and min(agree) > 0.99:
        raise AssertionError(f"{label}: every member dropped the same units (between any two members, at least "
                             f"{min(agree):.0%} of the units agree; independent masks agree on about {chance:.0%}). "
                             "randomness='same' draws one mask and shares it across the members; a loop over the "
                             "members draws one each: randomness='different'.")
    if shared:
        k = max(over, key=agree.__getitem__)
        raise AssertionError(f"{label}: members {pairs[k][0]} and {pairs[k][1]} dropped the same units more often "
                             f"than chance: on {agree[k]:.0%} of the {common[k]} units both kept alive, where "
                             f"independent masks agree on about {chance:.0%}. Each member draws its own mask, as a "
                             "loop over the members would: randomness='different'.")
    record([True, near_p, not shared], [True, True, True], f"{label}: each member's output is its own with a mask; "
           "the share dropped is near p; the members' masks differ; a second call draws again")
    clocked = f"; {_dropout_clock(predict_all_dropout, label, p)}" if is_remote(predict_all_dropout) else ""
    ok(f"{label}: every member's output is its own with a mask of its own ({share:.0%} of the units dropped, "
       f"p = {p}; two members agree on {sum(agree) / max(len(agree), 1):.0%} of them){clocked} (n={n}, seed {seed})")


def _masks_read_back(label: str, got, out: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dropped, live)``, each ``(n, batch, units)``: the mask each member's output ``got`` shows, found
    among every mask of the few units before the last layer (``hidden``: what reached each member's
    dropout; ``weight``, ``bias``: each member's last layer), and which units were alive (a unit at 0
    tells nothing of its mask). Raises when an output is no member's own output under any mask."""
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(out.shape):
        raise AssertionError(f"{label} while timed beside the course's loop should return a tensor of shape "
                             f"{tuple(out.shape)} (member, row, output), got {describe(got)}.")
    units = hidden.shape[-1]
    masks = ((torch.arange(2 ** units)[:, None] >> torch.arange(units)) & 1).to(hidden.dtype)  # (masks, units)
    with torch.no_grad():
        every = torch.einsum("nbu,ku,ncu->nbkc", hidden / (1 - p), masks, weight) + bias[:, None, None, :]
        miss, which = (every - got.to(every.dtype)[:, :, None, :]).abs().amax(-1).min(-1)
    scale = 1e-4 * max(1.0, float(every.abs().amax()))
    if not bool(miss.le(scale).all()):
        i, row = (int(v) for v in miss.gt(scale).nonzero()[0])
        raise AssertionError(f"{label} while timed beside the course's loop: member {i}'s output on row {row} is "
                             f"not its own output with any dropout mask ({float(miss[i, row]):.3g} from the "
                             "nearest).\n  Hint: a timed answer must be right on every input it is given.")
    live = hidden > 1e-3 * float(hidden.abs().amax())
    return masks[which] == 0, live


def _same_masks_bar(p: float, units: int) -> float:
    """The share of units on which two members' masks may agree at most: what independent masks agree
    on (``p**2 + (1 - p)**2``) and five binomial sigmas over ``units`` compared, plus 0.02. Masks drawn
    once and shared agree on every unit; masks shared in part (a few units redrawn per member) on more
    than chance, and with hundreds of units compared that is seen."""
    chance = _agree_by_chance(p)
    return chance + 5 * (chance * (1 - chance) / max(units, 1)) ** 0.5 + 0.02


def _mask_codes(dropped: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Each member's whole mask as one integer (a bit per unit), for the members whose every unit was alive."""
    bits = dropped.flatten(1).long()
    codes = (bits << torch.arange(bits.shape[1])).sum(1)
    return codes[live.flatten(1).all(1)]


def _fresh_masks(label: str, dropped: torch.Tensor, live: torch.Tensor, earlier: dict, p: float) -> None:
    """This timed call's masks against the previous call's (``earlier`` keeps them): each member's mask
    may agree with its own previous one no more than independent draws do, and the members' whole masks
    may be found among the previous call's no more often than among masks the judge draws now (masks
    kept from an earlier call, whether by the same member or handed round, are not dropout)."""
    before = earlier.get("masks")
    earlier["masks"] = (dropped, live)
    if before is None:
        return
    prev, prev_live = before
    both = live & prev_live
    repeat = float((dropped == prev)[both].double().mean())
    if repeat > _same_masks_bar(p, int(both.sum())):
        raise AssertionError(f"{label} while timed beside the course's loop: each member's mask agreed with its mask "
                             f"of the previous call on {repeat:.0%} of the units (fresh draws agree on about "
                             f"{_agree_by_chance(p):.0%}): dropout draws a fresh mask on every call.")
    now, then = _mask_codes(dropped, live), _mask_codes(prev, prev_live)
    if len(now) < 100 or len(then) < 100:
        return
    drawn = _mask_codes(torch.rand(prev.shape) < p, torch.ones_like(prev_live))
    found = float(torch.isin(now, then).double().mean())
    chance = float(torch.isin(now, drawn).double().mean())
    if found > chance + 5 * (max(chance, 0.01) * (1 - chance) / len(now)) ** 0.5 + 0.05:
        raise AssertionError(f"{label} while timed beside the course's loop: {found:.0%} of the members' masks were "
                             f"masks of the previous call (among fresh masks: {chance:.0%}): dropout draws a fresh "
                             "mask on every call.")


def _dropout_clock(fn: Callable, label: str, p: float) -> str:
    """The judge's clock on ``ENSEMBLE_MEMBERS`` small members with dropout (on the CPU), against the course's
    loop over them (the prediction clock's loop, each member in training mode drawing its own mask).
    The two sides cannot agree value for value (each draws its masks), so every timed output is read
    back instead: each member's own output under some mask, about ``p`` of the units dropped, the
    members' masks independent."""
    def setup() -> dict:
        loop_predictions = grader_references("vmap").loop_predictions
        # every unit before the dropout alive
        members = _clock_members(ENSEMBLE_MEMBERS, CLOCK_SEED, torch.float32, 4, p)
        params, buffers = stack_module_state(members)
        base = meta_mlp(features=4, hidden=4, classes=4, dropout=p)
        head = base[:-2]  # what reaches the dropout, run on the stacked state after the clock, untimed
        head_params = {k: v for k, v in params.items() if k.split(".")[0] in head._modules}
        weight = torch.stack([m[-1].weight.detach() for m in members])
        bias = torch.stack([m[-1].bias.detach() for m in members])

        def make(fresh):
            return params, buffers, base, toy_features(4, 4, seed=fresh, device="cpu")

        def loop(params, buffers, base, x):
            return loop_predictions(members, x, same_minibatch=True), x

        earlier: dict = {}

        def agree(got, loops) -> None:
            out, x = loops
            with torch.no_grad():
                hidden = torch.func.vmap(lambda p_, b_: torch.func.functional_call(head, (p_, b_), (x,)))(
                    head_params, buffers)
            dropped, live = _masks_read_back(label, got, out, hidden, weight, bias, p)
            step = 1 + secrets.randbelow(len(members) - 1)  # each member beside another, drawn now
            both = live & live.roll(step, 0)
            same = float((dropped == dropped.roll(step, 0))[both].double().mean())
            if same > _same_masks_bar(p, int(both.sum())):
                raise AssertionError(f"{label} while timed beside the course's loop: the members' masks agree on "
                                     f"{same:.0%} of the units (independent masks agree on about "
                                     f"{_agree_by_chance(p):.0%}): each member draws a mask of its own.")
            share = float(dropped[live].double().mean())
            if not _share_near_p(share, p, int(live.sum())):
                raise AssertionError(f"{label} while timed beside the course's loop: {share:.0%} of the units were "
                                     f"dropped; dropout with p = {p} drops about {p:.0%}.")
            _fresh_masks(label, dropped, live, earlier, p)

        return dict(make=make, loop=loop, agree=agree, kept=3)

    with torch.no_grad():
        return _expect_no_loop_by_clock(fn, label, setup, count=ENSEMBLE_MEMBERS, unit="model", key=("dropout",),
                                        no_loop=ENSEMBLE_NO_LOOP)


# -- an op without a batching rule, repaired -----------------------------------------------------

def _kl_target(batch: int, classes: int, seed: int, dev: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``(batch, classes)`` probabilities from ``seed``, with exact zeros as real targets have
    them: row 0 is one-hot (a hard label), row 1 has one class at 0; the others are a softmax."""
    g = torch.Generator().manual_seed(seed)
    t = torch.softmax(2 * torch.randn(batch, classes, generator=g, dtype=torch.float64), dim=-1)
    if classes > 1:
        t[0] = 0.0
        t[0, seed % classes] = 1.0
        if batch > 1:
            t[1, (seed + 1) % classes] = 0.0
            t[1] /= t[1].sum()
    return t.to(dev, dtype)


def _smoothed(target: torch.Tensor) -> torch.Tensor:
    """``target`` without zeros: the same question, where ``0 * log 0`` cannot arise."""
    return (target + 0.05) / (1 + 0.05 * target.shape[-1])


def _kl_case(seed: int, n: int, batch: int, features: int, hidden: int, classes: int, dev: torch.device,
             dtype: torch.dtype) -> tuple:
    """``(models, x, target)``: exercise 3's ensemble, minibatch and target probabilities."""
    models = mlp_ensemble(n, seed=seed, features=features, hidden=hidden, classes=classes, device=dev, dtype=dtype)
    return (models, toy_features(batch, features, seed=seed + 5, device=dev, dtype=dtype),
            _kl_target(batch, classes, seed, dev, dtype))


def _kl_answers(refs, dev: torch.device, **case) -> dict:
    """Exercise 3's answers by the loop over the members, in either dtype: on the target
    (``expected``), on the target without zeros (``smooth``), and the usual slips' (``mistakes``)."""
    out = {}
    for name, dtype in DTYPES.items():
        models, x, target = _kl_case(**case, dev=dev, dtype=dtype)
        with torch.no_grad():
            out[name] = {"expected": refs.loop_member_kl(models, x, target),
                         "smooth": refs.loop_member_kl(models, x, _smoothed(target)),
                         "mistakes": refs.kl_mistakes(models, x, target)}
    return out


@prober
def kl_fallbacks(member_kl: Callable, params, buffers, base, x: torch.Tensor, target: torch.Tensor) -> list[str]:
    """The ops ``vmap`` ran member by member while ``member_kl`` ran (PyTorch's fallback warning),
    in the learner's process: only a failed check's message uses it; the verdict rests on values
    and on the judge's clock (:func:`check_member_kl_speed`)."""
    with torch.no_grad():
        return vmap_fallbacks(member_kl, params, buffers, base, x, target)


def check_member_kl(member_kl: Callable, *, seed: int = 0, n: int = 5, batch: int = 6, features: int = 12,
                    hidden: int = 16, classes: int = 5, device=None) -> None:
    """``member_kl(params, buffers, base, x, target)``: every member's ``KL(target || member)`` on
    ``x``, averaged over the minibatch, ``(N,)``, as :func:`course.vmap.member_kl_planted` computes
    it, on targets with exact zeros (a one-hot row, a class at 0), in float64 and float32 against
    the loop over the members in float64; a wrong value is matched against the usual slips. Then
    no op may fall back to a loop under ``vmap`` (PyTorch's warning, seen by a probe in the
    learner's process: that process's word, backed by the clock of :func:`check_member_kl_speed`)."""
    dev = pick_device(device)
    case = dict(seed=seed, n=n, batch=batch, features=features, hidden=hidden, classes=classes)
    answers = _answers("member KL", dev, **case)
    for dtype_name, dtype in DTYPES.items():
        tol = TIGHT if dtype == torch.float64 else _float32_tolerance(dev)
        models, x, target = _kl_case(**case, dev=dev, dtype=dtype)
        params, buffers, base = _stacked(models)
        expected = answers[dtype_name]["expected"]
        with torch.no_grad():
            got = _call_stacked(member_kl, params, buffers, base, x.clone(), target.clone(), name="member_kl")
        members = f"{n} member{'s' if n != 1 else ''}"
        label = f"member_kl ({str(dtype).replace('torch.', '')}, {members})"
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != (n,):
            raise AssertionError(f"{label} returned {describe(got)}; expected a tensor of shape ({n},): one "
                                 "divergence per member, each averaged over the minibatch.")
        if bool(torch.isnan(got).any()):
            with torch.no_grad():
                fine = _call_stacked(member_kl, params, buffers, base, x.clone(), _smoothed(target), name="member_kl")
            if isinstance(fine, torch.Tensor) and same_values(fine, answers[dtype_name]["smooth"], **tol):
                raise AssertionError(
                    f"{label} is NaN where a target probability is exactly 0 (this target has a one-hot row), "
                    "and right on a target without zeros: target * target.log() is 0 * -inf = NaN there, while "
                    "the KL divergence counts those terms as 0 (F.kl_div does).\n  Hint: torch.xlogy(target, "
                    "target) computes target * log(target), with 0 where target is 0.")
        name_mistake(label, got, expected, answers[dtype_name]["mistakes"], **tol)
        assert_close(got, expected, name=label, **tol,
                     hint="compute what course.vmap.member_kl_planted computes: for every member, the sum over "
                          "classes of target * (log target - log_softmax(output)), averaged over the minibatch.")
    fallbacks = probed_names(member_kl, kl_fallbacks, params, buffers, base, x, target, label="member_kl")
    if fallbacks:
        raise AssertionError(
            f"member_kl's values are right, but vmap ran {', '.join(fallbacks)} member by member, in a loop: "
            f"PyTorch has no batching rule for {'it' if len(fallbacks) == 1 else 'them'} (its warning says "
            "'There is a performance drop because we have not yet implemented the batching rule for ...').\n"
            "  Hint: write that op with ops vmap batches (elementwise ops, sums, log_softmax), or run it outside "
            "vmap on the stacked outputs of every member.")
    record([True, True], [True, True], "member_kl: values and batching rules")
    ok(f"member_kl equals the loop over {members} in float64 and float32, targets with exact zeros included, "
       f"and vmap runs no op member by member (batch={batch}, seed {seed})")


@functools.lru_cache(maxsize=4)
def _timing_ensemble(n: int, features: int, hidden: int, classes: int, model_seed: int, device: str):
    models = mlp_ensemble(n, seed=model_seed, features=features, hidden=hidden, classes=classes, device=device)
    params, buffers = stack_module_state(models)
    return models, {k: v.detach() for k, v in params.items()}, buffers, meta_copy(models[0])


@factory
def member_kl_inputs(seed: int, *, device: str, n: int, batch: int, features: int, hidden: int, classes: int,
                     model_seed: int) -> tuple:
    """Fresh ``(params, buffers, base, x, target)`` for one timed call of the KL speed check: the
    ensemble's stacked state from ``model_seed`` (the same in every call), the minibatch ``x`` and
    the target probabilities from ``seed``. The judge and the learner's process build the same
    ones from the seeds."""
    _, params, buffers, base = _timing_ensemble(n, features, hidden, classes, model_seed, device)
    g = device_generator(seed, device)  # drawn in float32 on the device (course.data.device_generator says why)
    x = torch.randn(batch, features, generator=g, device=device)
    target = torch.softmax(2 * torch.randn(batch, classes, generator=g, device=device), dim=-1)
    return params, buffers, base, x, target


def check_member_kl_speed(member_kl: Callable, *, bars: Mapping[str, float], n: int, batch: int, features: int,
                          hidden: int, classes: int = 10, num_threads: int | None = None, seed: int = 0,
                          rounds: int = 9, min_run_time: float = 0.2, attempts: int = 3, device=None) -> SpeedReport:
    """The repaired ``member_kl`` at least ``bars[device]`` times as fast as the planted one
    (:func:`course.vmap.member_kl_planted`, whose ``F.kl_div`` vmap runs member by member), side by
    side without autograd on fresh minibatches and targets, every output checked
    (:func:`served_speedup`); under the grader the learner's side runs in its process, the
    planted one in the judge's, never at once. ``num_threads`` pins the CPU thread count. First,
    its values on that ensemble must equal the loop over the members (in a learner's copy, which
    has no references: the planted function's, the lesson's own definition of them)."""
    dev = pick_device(device)
    sizes = dict(n=n, batch=batch, features=features, hidden=hidden, classes=classes, model_seed=seed)
    models = _timing_ensemble(n, features, hidden, classes, seed, str(dev))[0]
    params, buffers, base, x, target = member_kl_inputs(seed + 31, device=str(dev), **sizes)
    refs = grader_references("vmap")
    with torch.no_grad():
        got = call(member_kl, params, buffers, base, x, target, name="member_kl")
    with warnings.catch_warnings():  # the planted op's warning is the lesson's, not the check's
        warnings.filterwarnings("ignore", message=".*batching rule.*")
        with torch.no_grad():
            want = (refs.loop_member_kl(models, x, target) if refs is not None
                    else member_kl_planted(params, buffers, base, x, target))
        assert_close(got, want, name="member_kl on the ensemble it is timed on", **_float32_tolerance(dev),
                     hint="the timed function must be right before it is fast.")
        return served_speedup(("planted", member_kl_planted), ("repaired", member_kl), factory=member_kl_inputs,
                              sizes=sizes, bars=bars, device=dev, num_threads=num_threads, rounds=rounds,
                              min_run_time=min_run_time, attempts=attempts, explain="course.references.explain.member_kl",
                              hint="no op that vmap runs member by member (its warning names it): the KL divergence "
                                   "from elementwise ops, or F.kl_div outside vmap. If the machine is busy, run the "
                                   "cell again.")


# -- training an ensemble ------------------------------------------------------------------------

def _labels(shape: tuple, classes: int, seed: int, dev: torch.device) -> torch.Tensor:
    return torch.randint(classes, shape, generator=torch.Generator().manual_seed(seed)).to(dev)


def _sgd_case(seed: int, n: int, batch: int, features: int, hidden: int, classes: int, dev: torch.device,
              dtype: torch.dtype) -> tuple:
    """``(models, xs, ys)``: exercise 5's ensemble and a minibatch of features and labels per member."""
    models = mlp_ensemble(n, seed=seed, features=features, hidden=hidden, classes=classes, device=dev, dtype=dtype)
    return (models, toy_features(n, batch, features, seed=seed + 1, device=dev, dtype=dtype),
            _labels((n, batch), classes, seed + 2, dev))


def _sgd_answers(refs, dev: torch.device, *, lr: float, **case) -> dict:
    """Exercise 5's answers by the loop over the members, in either dtype (``expected``), and in
    float64 what training every member on the first minibatch gives (``first``: a slip's result)."""
    out = {}
    for name, dtype in DTYPES.items():
        models, xs, ys = _sgd_case(**case, dev=dev, dtype=dtype)
        out[name] = {"expected": refs.loop_sgd_step(models, xs, ys, lr)}
        if dtype == torch.float64:
            n, batch = ys.shape
            first = (xs[:1].expand(n, *xs.shape[1:]), ys[:1].expand(n, batch))
            out[name]["first"] = refs.loop_sgd_step(models, *first, lr)
    return out


def _step_variants(params, ys, lr: float, expected, first) -> dict:
    """Results of common mistakes in one ensemble step, to name the one a wrong answer matches
    (``first``: every member trained on the first minibatch)."""
    n, batch = ys.shape
    step = {k: params[k] - expected[k] for k in params}  # lr * each member's own gradient
    out = {"the step went up the gradient (p + lr * g): a descent step is p - lr * g":
           {k: params[k] + step[k] for k in params},
           "it returned the gradients, not the updated parameters":
           {k: step[k] / lr for k in params},
           "the learning rate was left out (p - g)":
           {k: params[k] - step[k] / lr for k in params},
           "every member was trained on the first minibatch, xs[0] (member i's minibatch is xs[i]: "
           "in_dims 0 for xs and ys too)": first,
           "the loss was summed over the minibatch (reduction='sum'); the lesson's loss is its mean":
           {k: params[k] - step[k] * batch for k in params}}
    if n > 1:
        out["the members' losses were averaged: every member moved 1/N of its step. Members share no "
            "parameters, so the gradient of the members' *summed* losses is each member's own gradient; "
            "a mean divides it by N"] = {k: params[k] - step[k] / n for k in params}
        out["every member took the same step, the members' average gradient: each member follows its own "
            "gradient"] = {k: params[k] - step[k].mean(0, keepdim=True) for k in params}
    return out


def check_ensemble_sgd_step(ensemble_sgd_step: Callable, *, seed: int = 0, n: int = 4, batch: int = 6,
                            features: int = 12, hidden: int = 16, classes: int = 5, lr: float = 0.5,
                            device=None) -> None:
    """``ensemble_sgd_step(params, buffers, base, xs, ys, lr)``: every member ``i`` of a stacked
    ensemble takes one SGD step on its own minibatch ``(xs[i], ys[i])`` (mean cross-entropy), all
    at once; returns the new stacked parameters, as new tensors, its inputs left alone. Equal to
    the loop over the members (``loop_sgd_step``) in float64 and float32; one vmapped call of
    the base model (across the boundary: the judge's clock on 1,024 members)."""
    dev = pick_device(device)
    label = "ensemble_sgd_step"
    across = is_remote(ensemble_sgd_step)
    case = dict(seed=seed, n=n, batch=batch, features=features, hidden=hidden, classes=classes)
    answers = _answers("ensemble SGD step", dev, lr=lr, **case)
    for dtype_name, dtype in DTYPES.items():
        tol = TIGHT if dtype == torch.float64 else _float32_tolerance(dev)
        models, xs, ys = _sgd_case(**case, dev=dev, dtype=dtype)
        params, buffers, base = _stacked(models)
        params = {k: v.detach() for k, v in params.items()}
        expected = answers[dtype_name]["expected"]
        inputs = ({k: v.clone() for k, v in params.items()}, {k: v.clone() for k, v in buffers.items()},
                  xs.clone(), ys.clone())
        with ForwardWatch(base) as watch, mirrored(ensemble_sgd_step):
            got = _call_stacked(ensemble_sgd_step, inputs[0], inputs[1], base, inputs[2], inputs[3], lr, name=label)
        if not isinstance(got, Mapping) or set(got) != set(params):
            raise AssertionError(f"{label} should return a dict with the same keys as params ({sorted(params)}), "
                                 f"got {describe(got)}.")
        for what, before, after in (("params", params, inputs[0]), ("buffers", buffers, inputs[1]),
                                    ("xs", {"": xs}, {"": inputs[2]}), ("ys", {"": ys}, {"": inputs[3]})):
            changed = [k for k in before if not torch.equal(before[k], after[k])]
            if changed:
                where = f"{what}[{changed[0]!r}]" if changed[0] else what
                raise AssertionError(f"{label} changed its input {where} in place. Return new tensors and leave "
                                     "the inputs alone (the caller may still need them).")
        if any(got[k] is inputs[0][k] for k in got):
            raise AssertionError(f"{label} returned an input tensor itself; return the updated parameters.")
        name = f"{label} ({str(dtype).replace('torch.', '')})"
        if dtype == torch.float64:  # name_mistake leaves a right answer alone
            name_mistake(name, dict(got), expected,
                         _step_variants(params, ys, lr, expected, answers[dtype_name]["first"]), **CLOSE64)
        assert_close(dict(got), expected, name=name, **tol,
                     hint="member i steps on its own loss, F.cross_entropy(functional_call(base, (p, b), (x,)), y) "
                          "with (p, b, x, y) the i-th slices: vmap(grad(member_loss)) over (params, buffers, xs, ys), "
                          "then p - lr * g for every parameter.")
        if not across:
            _expect_vmapped(watch, label, n, "member")
    if across:
        evidence = _sgd_clock(ensemble_sgd_step, label, lr)
        ok(f"{label} equals the loop over {n} members in float64 and float32 and leaves its inputs alone; "
           f"{evidence} (batch={batch}, seed {seed})")
        return
    ok(f"{label} equals the loop over {n} members in float64 and float32, with one vmapped call of the base "
       f"model, and leaves its inputs alone (batch={batch}, seed {seed})")


def _sgd_clock(fn: Callable, label: str, lr: float) -> str:
    """The judge's clock on ``CLOCK_MEMBERS`` small models (on the CPU), timed as blocks against the
    leanest loop (``sgd_step_loop``).

    In float64: a gradient jumps where a ReLU's input crosses 0, and in float32 a pre-activation
    within rounding of 0 falls on one side in the batched kernel and on the other in the loop's.
    One member's whole step then differs (a right answer measured 0.26 against 0.31), and with
    1,024 members and fresh inputs on every timed call, float32 met such a member in about one
    grading in four (CI on 2e78c7d: the instructor's notebook lost the cell). Float64 rounding
    is 2**29 times finer; the clock's ratio is the same (both sides' cost is per-call overhead)."""
    def setup() -> dict:
        yardstick = grader_references("vmap").sgd_step_loop
        params, buffers, base = _clock_state(CLOCK_MEMBERS, torch.float64)

        def loop(params, buffers, base, xs, ys, lr):
            return yardstick(params, buffers, xs, ys, lr)
        return dict(make=None, loop=loop, factory=sgd_clock_inputs, constants=(params, buffers, base),
                    sizes=dict(members=CLOCK_MEMBERS, lr=lr), grad=True)

    return f"{label} " + _expect_no_loop_by_clock(fn, label, setup, count=CLOCK_MEMBERS, unit="member",
                                                  key=("ensemble_sgd",), no_loop=BLOCK_NO_LOOP)


@factory
def sgd_clock_inputs(seed: int, *, device: str, members: int, lr: float) -> tuple:
    """``(xs, ys, lr)`` for one timed SGD step: a minibatch of 4 (float64) and its labels for each member."""
    g = device_generator(seed, device)
    return (torch.randn(members, 4, 4, generator=g, device=device, dtype=torch.float64),
            torch.randint(3, (members, 4), generator=g, device=device), lr)


# -- per-sample gradients ------------------------------------------------------------------------

def _cnn_case(seed, batch, size, channels, classes, dev, dtype):
    model = small_cnn(seed=seed, channels=channels, size=size, classes=classes, device=dev, dtype=dtype)
    x, y = toy_images(batch, seed=seed + 1, size=size, classes=classes, device=dev, dtype=dtype)
    return model, x, y


def _grads_answers(refs, dev: torch.device, **case) -> dict:
    """Exercise 6's answer in float64, the loop of single-sample backward passes (``grads``): what
    exercises 7 and 8 must equal too, and the input of exercise 9's check."""
    return {"grads": refs.reference_per_sample_grads(*_cnn_case(**case, dev=dev, dtype=torch.float64))}


def _expect_grad_dict(got, model: nn.Module, batch: int, label: str) -> None:
    shapes = {k: (batch,) + tuple(p.shape) for k, p in model.named_parameters()}
    if not isinstance(got, Mapping):
        raise AssertionError(f"{label} should return a dict {{parameter name: per-sample gradients}}, got "
                             f"{describe(got)}.\n  Hint: the keys are model.named_parameters()'s names.")
    missing, extra = sorted(set(shapes) - set(got)), sorted(set(got) - set(shapes))
    if missing or extra:
        hint = ""
        if any(str(k).startswith("_module.") for k in extra):
            hint = ("\n  Hint: names starting with '_module.' are the wrapper's (GradSampleModule); use the names "
                    "of the model you were given (model.named_parameters()).")
        raise AssertionError(f"{label}: the keys should be the model's parameter names {sorted(shapes)}; missing "
                             f"{missing}, unexpected {extra}.{hint}")
    for k, shape in shapes.items():
        g = got[k]
        if not isinstance(g, torch.Tensor):
            raise AssertionError(f"{label}[{k!r}] should be a tensor of shape {shape}, got {describe(g)}.")
        if tuple(g.shape) == shape[1:]:
            raise AssertionError(f"{label}[{k!r}] has the parameter's own shape {shape[1:]}: that is one gradient "
                                 f"for the whole batch. Per-sample gradients have a leading batch dimension: "
                                 f"{shape}.")


def _psg_variants(model, x, y, expected) -> dict:
    """Per-sample gradients as plausible mistakes compute them, to name the one a wrong answer matches."""
    params = dict(model.named_parameters())
    loss = F.cross_entropy(model(x.to(next(model.parameters()).dtype)), y)
    whole = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
    n = x.shape[0]
    return {
        "each sample's loss was divided by the batch size (the loss of one sample is its own mean, over one "
        "sample: F.cross_entropy(model(x_i[None]), y_i[None]))": {k: e / n for k, e in expected.items()},
        "every row is the gradient of the whole batch's loss (model(x), not model(x[i:i+1]))":
            {k: whole[k].detach().to(e.dtype).expand_as(e) for k, e in expected.items()},
    }


def _compare_grads(got, expected, label: str, dtype: torch.dtype, dev: torch.device, hint: str,
                   variants: Mapping[str, dict] | None = None) -> None:
    tol = TIGHT if dtype == torch.float64 else _float32_tolerance(dev)
    if variants and isinstance(got, dict) and all(k in got for k in expected):
        name_mistake(label, {k: got[k] for k in expected}, expected, variants, **tol)
    for k, e in expected.items():
        assert_close(got[k], e, name=f"{label}[{k!r}] ({str(dtype).replace('torch.', '')})", check_dtype=False,
                     **tol, hint=hint)


def _accumulated(got, expected) -> bool:
    """True if the learner's rows look like running sums of the true per-sample gradients."""
    try:
        return all(torch.allclose(got[k].double(), e.double().cumsum(0), rtol=1e-5, atol=1e-7)
                   for k, e in expected.items())
    except (RuntimeError, KeyError):
        return False


def check_per_sample_grads_loop(per_sample_grads_loop: Callable, *, seed: int = 0, batch: int = 6, size: int = 8,
                                channels=(3, 4), classes: int = 5, device=None) -> None:
    """``per_sample_grads_loop(model, x, y)`` returns ``{name: (batch, *param.shape)}``, row ``i``
    being the gradient of sample ``i``'s cross-entropy alone, in float64 within rounding."""
    dev = pick_device(device)
    case = dict(seed=seed, batch=batch, size=size, channels=tuple(channels), classes=classes)
    model, x, y = _cnn_case(**case, dev=dev, dtype=torch.float64)
    expected = _answers("per-sample gradients", dev, **case)["grads"]
    got = call(per_sample_grads_loop, model, x.clone(), y.clone(), name="per_sample_grads_loop")
    _expect_grad_dict(got, model, batch, "per_sample_grads_loop")
    if _accumulated(got, expected):
        raise AssertionError("per_sample_grads_loop: row i holds the sum of the gradients of samples 0..i: the "
                             "gradients accumulated in p.grad across samples.\n  Hint: clear them before each "
                             "sample (model.zero_grad()), or use torch.autograd.grad, which returns them instead.")
    _compare_grads(got, expected, "per_sample_grads_loop", torch.float64, dev,
                   "row i is the gradient of F.cross_entropy(model(x[i:i+1]), y[i:i+1]) alone; stack the rows.",
                   variants=_psg_variants(model, x, y, expected))
    ok(f"per_sample_grads_loop equals the reference on {batch} samples in float64 (seed {seed})")


def _expect_vmap_grad(watch: ForwardWatch, label: str, batch: int) -> None:
    if not watch.calls:
        raise AssertionError(f"{label} never called the model it was given.")
    if all(c == ("grad",) for c in watch.calls):
        raise AssertionError(f"{label}: {watch.summary()}: torch.func.grad in a Python loop. Wrap it in "
                             "torch.func.vmap, with in_dims that map over the samples and not over the "
                             "parameters.")
    _expect_vmapped(watch, label, batch, "sample")
    if not all("grad" in c for c in watch.calls):
        raise AssertionError(f"{label}: {watch.summary()}; the gradient should come from torch.func.grad inside "
                             "vmap: vmap(grad(loss_of_one_sample), in_dims=...).")


def check_per_sample_grads(per_sample_grads: Callable, *, seed: int = 0, batch: int = 8, size: int = 8,
                           channels=(3, 4), classes: int = 5, device=None) -> None:
    """``per_sample_grads(model, x, y)``: the same as the loop, in float64 (tight) and float32
    (against the float64 reference), computed with ``vmap(grad(...))``: the model is called once,
    with ``vmap`` and ``grad`` active."""
    dev = pick_device(device)
    case = dict(seed=seed, batch=batch, size=size, channels=tuple(channels), classes=classes)
    expected = _answers("per-sample gradients", dev, **case)["grads"]
    for dtype in DTYPES.values():
        model, x, y = _cnn_case(**case, dev=dev, dtype=dtype)
        ref_model, ref_x, _ = _cnn_case(**case, dev=dev, dtype=torch.float64)
        with ForwardWatch(model) as watch:
            got = call(per_sample_grads, model, x.clone(), y.clone(), name="per_sample_grads")
        _expect_grad_dict(got, model, batch, "per_sample_grads")
        if not is_remote(per_sample_grads):  # across the boundary: the judge's clock below
            _expect_vmap_grad(watch, "per_sample_grads", batch)
        _compare_grads(got, expected, "per_sample_grads", dtype, dev,
                       "the loss of one sample is F.cross_entropy(model(x_i[None]), y_i[None]); "
                       "vmap(grad(loss), in_dims=(None, 0, 0)) maps over x and y, not over the parameters.",
                       variants=_psg_variants(ref_model, ref_x, y, expected))
    if is_remote(per_sample_grads):
        text = _per_sample_clock(per_sample_grads, "per_sample_grads")
        ok(f"per_sample_grads equals the loop in float64 and float32 and {text} (batch={batch}, seed {seed})")
        return

    def prepare(n):
        m, xs, ys = _cnn_case(seed, n, size, channels, classes, dev, torch.float32)
        return lambda: call(per_sample_grads, m, xs, ys, name="per_sample_grads")

    expect_constant_work(prepare, batch, 2 * batch, what="per_sample_grads", unit="sample")
    ok(f"per_sample_grads equals the loop in float64 and float32, with one vmap(grad) call of the model, "
       f"as much work for {2 * batch} samples as for {batch} (batch={batch}, seed {seed})")


def _per_sample_clock(fn: Callable, label: str) -> str:
    """The judge's clock on ``CLOCK_SAMPLES`` samples of a tiny MLP (on the CPU, in float64, for the
    reason :func:`_sgd_clock` gives; see :data:`CLOCK_SAMPLES` for why not the CNN), timed as blocks
    against the leanest loop (``per_sample_grads_loop``). The model is made afresh in every call (the
    factory's), not kept: an answer may leave things on the module it is given (Opacus's hooks and
    ``grad_sample``, a ``.grad``), which a kept model would carry into the next call."""
    def setup() -> dict:
        return dict(make=None, loop=grader_references("vmap").per_sample_grads_loop, factory=per_sample_clock_inputs,
                    sizes=dict(samples=CLOCK_SAMPLES), grad=True)

    return _expect_no_loop_by_clock(fn, label, setup, count=CLOCK_SAMPLES, unit="sample", key=("per-sample",),
                                    no_loop=BLOCK_NO_LOOP)


@factory
def per_sample_clock_inputs(seed: int, *, device: str, samples: int) -> tuple:
    """``(model, x, y)`` for one timed call of the per-sample clocks: the clock's MLP (float64, from
    ``CLOCK_SEED``, built afresh) and ``samples`` features and labels from ``seed``."""
    g = device_generator(seed, device)
    return (mlp(seed=CLOCK_SEED, features=4, hidden=4, classes=3, device=device, dtype=torch.float64),
            torch.randn(samples, 4, generator=g, device=device, dtype=torch.float64),
            torch.randint(3, (samples,), generator=g, device=device))


def check_opacus_grads(opacus_per_sample_grads: Callable, *, seed: int = 0, batch: int = 8, size: int = 8,
                       channels=(3, 4), classes: int = 5, device=None) -> None:
    """``opacus_per_sample_grads(model, x, y)``: the per-sample gradients of the mean
    cross-entropy's terms computed by Opacus's ``GradSampleModule`` from one batched forward and
    backward pass (no ``vmap``), keyed by the model's own parameter names, equal to the loop's."""
    dev = pick_device(device)
    case = dict(seed=seed, batch=batch, size=size, channels=tuple(channels), classes=classes)
    expected = _answers("per-sample gradients", dev, **case)["grads"]
    for dtype in DTYPES.values():
        model, x, y = _cnn_case(**case, dev=dev, dtype=dtype)
        with ForwardWatch(model) as watch:
            got = call(opacus_per_sample_grads, model, x.clone(), y.clone(), name="opacus_per_sample_grads")
        _expect_grad_dict(got, model, batch, "opacus_per_sample_grads")
        if is_remote(opacus_per_sample_grads):
            pass  # the model ran in the learner's process: one batched pass is the judge's clock's question below
        elif any(c for c in watch.calls):
            raise AssertionError(f"opacus_per_sample_grads: {watch.summary()}. This exercise is about Opacus: wrap "
                                 "the model in opacus.GradSampleModule and run one ordinary forward and backward "
                                 "pass on the whole batch.")
        elif len(watch.calls) != 1:
            raise AssertionError(f"opacus_per_sample_grads: {watch.summary()}; Opacus needs one forward pass over "
                                 "the whole batch (its hooks split the gradient by sample).")
        dot = sum((got[k].double() * e).sum() for k, e in expected.items())
        ratio = float(dot / sum((e * e).sum() for e in expected.values()))
        if abs(ratio - batch) < 1e-3 * batch or abs(ratio - 1 / batch) < 1e-3 / batch:
            which = "larger" if ratio > 1 else "smaller"
            raise AssertionError(
                f"opacus_per_sample_grads: every gradient is {batch}x (the batch size) {which} than the loop's. "
                "Opacus must be told how the loss reduces the batch: GradSampleModule(model, loss_reduction=...) "
                "has to match the reduction of the loss you backpropagate ('mean' for F.cross_entropy's default, "
                "'sum' for reduction='sum').")
        _compare_grads(got, expected, "opacus_per_sample_grads", dtype, dev,
                       "wrap the model in GradSampleModule, run the loss of the whole batch backward, read "
                       "p.grad_sample of every parameter.")
    clock = ""
    if is_remote(opacus_per_sample_grads):
        clock = " and " + _per_sample_clock(opacus_per_sample_grads, "opacus_per_sample_grads")
    ok(f"opacus_per_sample_grads equals the loop in float64 and float32{clock} (batch={batch}, seed {seed})")


# -- DP-SGD --------------------------------------------------------------------------------------

#: The steps the check takes: ``(noise_multiplier, lr)``, without noise and with it.
DP_STEPS = ((0.0, 0.3), (1.1, 0.5))


def _dp_case(*, seed: int, batch: int, size: int, channels: tuple, classes: int, dev: torch.device) -> tuple:
    """``(params, grads)``: the CNN's float64 parameters and its per-sample gradients (exercise 6's
    answer on the same case), each sample's scaled so that their norms vary a lot: some samples
    are clipped and some are not."""
    model, _, _ = _cnn_case(seed, batch, size, channels, classes, dev, torch.float64)
    grads = _answers("per-sample gradients", dev, seed=seed, batch=batch, size=size, channels=channels,
                     classes=classes)["grads"]
    scale = torch.logspace(-1, 1, batch, dtype=torch.float64, device=dev)[torch.randperm(
        batch, generator=torch.Generator().manual_seed(seed)).to(dev)]
    grads = {k: g * scale.view(-1, *([1] * (g.dim() - 1))) for k, g in grads.items()}
    return {k: p.detach().clone() for k, p in model.named_parameters()}, grads


def _dp_answers(refs, dev: torch.device, **case) -> dict:
    """Exercise 9's answers on :func:`_dp_case`: ``max_norm`` (the median of the samples' norms), and
    for every step of :data:`DP_STEPS` the step without its noise (``quiet``; the check adds the
    noise it draws from a generator on its own device) and what the usual slips in clipping
    give (``mistakes``, for the noise-free step)."""
    params, grads = _dp_case(**case, dev=dev)
    max_norm = float(refs.per_sample_norms(grads).median())
    quiet = [refs.dp_sgd_reference(params, grads, lr=lr, max_norm=max_norm, noise_multiplier=0.0,
                                   generator=torch.Generator(device=dev)) for _, lr in DP_STEPS]
    mistakes = [{} if noise_multiplier else refs.dp_clip_mistakes(params, grads, lr=lr, max_norm=max_norm)
                for noise_multiplier, lr in DP_STEPS]
    return {"max_norm": max_norm, "quiet": quiet, "mistakes": mistakes}


def _dp_variants(params, quiet, noise, mistakes, *, batch: int, lr: float, max_norm: float,
                 noise_multiplier: float) -> dict:
    """Results of common mistakes, to name the one a wrong answer matches: the clipping slips
    (``mistakes``), and from the step without noise (``quiet``) and the noise drawn, the scaling ones."""
    out = dict(mistakes)
    out["the clipped gradients were summed, not averaged (divide by the batch size)"] = {
        k: params[k] + (quiet[k] - params[k]) * batch for k in params}
    if noise_multiplier:
        out["the noise's standard deviation was noise_multiplier alone (it is noise_multiplier * max_norm)"] = {
            k: quiet[k] - lr * noise_multiplier * noise[k] / batch for k in params}
        out["the noise was not divided by the batch size"] = {
            k: quiet[k] - lr * noise_multiplier * max_norm * noise[k] for k in params}
    return out


def check_dp_sgd_step(dp_sgd_step: Callable, *, seed: int = 0, batch: int = 8, size: int = 8, channels=(3, 4),
                      classes: int = 5, device=None) -> None:
    """``dp_sgd_step(params, grads, lr=, max_norm=, noise_multiplier=, generator=)`` equals
    the reference (``dp_sgd_reference``) without noise and, for a fixed seed, with noise; it draws
    its noise from ``generator`` (exactly as many numbers as the parameters have) and leaves its
    inputs alone. The noise is the lesson's convention, drawn here on the device: the reference
    gives the step without it."""
    dev = pick_device(device)
    case = dict(seed=seed, batch=batch, size=size, channels=tuple(channels), classes=classes)
    params, grads = _dp_case(**case, dev=dev)
    answers = _answers("DP-SGD step", dev, **case)
    max_norm = answers["max_norm"]
    for (noise_multiplier, lr), quiet, mistakes in zip(DP_STEPS, answers["quiet"], answers["mistakes"]):
        kw = dict(lr=lr, max_norm=max_norm, noise_multiplier=noise_multiplier)
        expected_gen = device_generator(seed + 5, dev)
        noise = {k: torch.randn(p.shape, generator=expected_gen, device=p.device, dtype=p.dtype)
                 for k, p in params.items()}
        expected = {k: quiet[k] - lr * noise_multiplier * max_norm * noise[k] / batch for k in params}
        p_in = {k: v.clone() for k, v in params.items()}
        g_in = {k: v.clone() for k, v in grads.items()}
        gen = device_generator(seed + 5, dev)
        with mirrored(dp_sgd_step):  # across the boundary, what it did to its inputs and the generator comes back
            got = call(dp_sgd_step, p_in, g_in, generator=gen, name="dp_sgd_step", **kw)
        if not isinstance(got, Mapping) or set(got) != set(params):
            raise AssertionError(f"dp_sgd_step should return a dict with the same keys as params "
                                 f"({sorted(params)}), got {describe(got)}.")
        for what, before, after in (("params", params, p_in), ("grads", grads, g_in)):
            changed = [k for k in before if not torch.equal(before[k], after[k])]
            if changed:
                raise AssertionError(f"dp_sgd_step changed its input {what}[{changed[0]!r}] in place. Return new "
                                     "tensors and leave the inputs alone (the caller may still need them).")
        if any(got[k] is p_in[k] for k in got):
            raise AssertionError("dp_sgd_step returned an input tensor itself; return the updated parameters.")
        used = not torch.equal(gen.get_state(), device_generator(seed + 5, dev).get_state())
        if noise_multiplier and not used:
            raise AssertionError("dp_sgd_step did not draw from `generator`: the noise must come from it, so that a "
                                 "step is reproducible.\n  Hint: torch.randn(p.shape, generator=generator, "
                                 "device=p.device, dtype=p.dtype), one draw per parameter, in the order of params.")
        if noise_multiplier and not torch.equal(gen.get_state(), expected_gen.get_state()):
            raise AssertionError("dp_sgd_step drew a different amount of random numbers from `generator` than the "
                                 "reference: one torch.randn(p.shape, generator=generator, device=p.device, "
                                 "dtype=p.dtype) per parameter, nothing else (draw in the parameter's dtype: a "
                                 "float32 draw uses the generator differently from a float64 one).")
        label = "dp_sgd_step" + (" without noise" if not noise_multiplier else f" with noise (seed {seed + 5})")
        name_mistake(label, dict(got), expected, _dp_variants(params, quiet, noise, mistakes, batch=batch, **kw),
                     **CLOSE64)
        hint = ("clip each sample's whole gradient: factor_i = min(1, max_norm / (norm_i + 1e-6)), norm_i over "
                "all parameters together; sum the clipped gradients; add noise_multiplier * max_norm * "
                "torch.randn(p.shape, generator=generator, device=p.device, dtype=p.dtype) per parameter in "
                "the order of params; divide by the batch size; p - lr * that.")
        # Always, not only on a mismatch: the grading parent checks this comparison again.
        assert_close(dict(got), expected, name=label, **TIGHT, hint=hint)
    ok(f"dp_sgd_step equals the reference with and without noise, draws its noise from the generator, and "
       f"leaves its inputs alone (batch={batch}, seed {seed})")


# -- the answers, by the grader's references or stored -------------------------------------------

#: Every kind of answer the checks compare with: ``kind -> fn(references, device, **case)``.
ANSWERS = {"ensemble predictions": _predict_answers, "member KL": _kl_answers, "ensemble SGD step": _sgd_answers,
           "per-sample gradients": _grads_answers, "DP-SGD step": _dp_answers}

#: The visible checks that use each kind, at their own calls (their defaults): what a learner's copy stores.
VISIBLE = {"ensemble predictions": (check_ensemble_predict,), "member KL": (check_member_kl,),
           "ensemble SGD step": (check_ensemble_sgd_step,),
           "per-sample gradients": (check_per_sample_grads_loop, check_per_sample_grads, check_opacus_grads,
                                    check_dp_sgd_step),
           "DP-SGD step": (check_dp_sgd_step,)}


def reference_data() -> dict:
    """The answers of the visible checks' own calls, computed on the CPU by the grader's references:
    ``{kind: [{"case": seed and sizes, "answers": ...}]}``, one entry per distinct case."""
    refs = grader_references("vmap")
    data = {}
    for kind, checks in VISIBLE.items():
        cases = []
        for check in checks:
            case = visible_call(check)
            if case not in cases:
                cases.append(case)
        data[kind] = [{"case": case, "answers": ANSWERS[kind](refs, torch.device("cpu"), **case)} for case in cases]
    return data

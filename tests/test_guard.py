"""course.guard: under the grader, the course's references refuse to serve a learner's cell."""

from __future__ import annotations

import functools
import importlib
import pkgutil

import pytest
import torch

import course.grader_hooks as grader_hooks
import course.guard as guard
from course.references.rnn import layer_norm_lstm_cell_reference
from course.rnn import layer_norm_params


@pytest.fixture
def graded(tmp_path, monkeypatch):
    """Pretend to be the grading sandbox: cells written to ``learner_*.py`` files are the learner's."""
    refused = []
    monkeypatch.setattr(grader_hooks, "learner_prefix", str(tmp_path / "learner_"))
    monkeypatch.setattr(grader_hooks, "refused", lambda name, where: refused.append((name, where)))

    def run(source: str, kind: str = "learner", **names):
        path = tmp_path / f"{kind}_{len(list(tmp_path.iterdir())):03d}.py"
        path.write_text(source)
        namespace = dict(names)
        exec(compile(source, str(path), "exec"), namespace)
        return namespace

    return run, refused


def _args():
    p = layer_norm_params(3, 4, seed=0, dtype=torch.float64)
    return torch.randn(2, 3, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.float64), \
        torch.zeros(2, 4, dtype=torch.float64), p


@pytest.mark.parametrize("wrapping", [
    "def cell(x, h, c, p):\n    return ref(x, (h, c), p)",
    "cell = lambda x, h, c, p: ref(x, (h, c), p)",
    "import functools\ndef cell(x, h, c, p):\n    return functools.partial(ref, x)((h, c), p)",
    "from course.checks.common import call\ndef cell(x, h, c, p):\n    return call(ref, x, (h, c), p)",
])
def test_a_learner_cell_cannot_answer_with_a_reference_however_wrapped(graded, wrapping):
    run, refused = graded
    cell = run(wrapping, ref=layer_norm_lstm_cell_reference)["cell"]
    x, h, c, p = _args()
    with pytest.raises((guard.ReferenceRefused, AssertionError), match="course's references|ReferenceRefused"):
        cell(x, h, c, p)
    assert refused and refused[0][0] == "layer_norm_lstm_cell_reference"
    assert refused[0][1].startswith("learner_")


def test_an_alias_or_partial_of_a_reference_is_refused_when_a_check_calls_it(graded):
    from course.checks.common import call

    run, refused = graded
    x, h, c, p = _args()
    for answer in (layer_norm_lstm_cell_reference, functools.partial(layer_norm_lstm_cell_reference, x)):
        args = ((x, (h, c), p) if answer is layer_norm_lstm_cell_reference else ((h, c), p))
        with pytest.raises(AssertionError, match="course's references"):
            call(answer, *args, name="layer_norm_lstm_cell")
    assert len(refused) == 2 and refused[0][1] == "the answer a check called"
    layer_norm_lstm_cell_reference(x, (h, c), p)  # the check's own call, outside call(), still works


def test_checks_and_instructor_cells_may_call_references(graded):
    run, refused = graded
    x, h, c, p = _args()
    got = run("out = ref(x, (h, c), p)", kind="cell", ref=layer_norm_lstm_cell_reference, x=x, h=h, c=c, p=p)["out"]
    assert isinstance(got[0], torch.Tensor) and not refused
    # a check calls the learner, then the reference: no learner frame is on the stack any more
    learner = run("def mine(x, h, c, p):\n    return x.sum()")["mine"]
    learner(x, h, c, p)
    layer_norm_lstm_cell_reference(x, (h, c), p)
    assert not refused


def test_outside_the_grader_references_are_plain_functions(tmp_path):
    assert grader_hooks.learner_prefix is None
    x, h, c, p = _args()
    path = tmp_path / "learner_000.py"
    path.write_text("out = ref(x, (h, c), p)")
    ns = {"ref": layer_norm_lstm_cell_reference, "x": x, "h": h, "c": c, "p": p}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    assert isinstance(ns["out"][0], torch.Tensor)


def test_every_reference_the_checks_compare_with_is_guarded():
    """The references named here reproduce an exercise's answer; each must carry the guard (a
    second wall: they already live where the learner's process cannot import them)."""
    from course import jacobians as jac
    from course.references import broadcasting as bc_refs, fastpath as fastpath_refs, forward_ad as fad_refs
    from course.references import fx as fx_refs, jacobians as jac_refs, memory_format as mf_refs, rnn
    from course.references import vmap as vmap_refs

    guarded = [rnn.layer_norm_lstm_cell_reference, rnn.eager_lstm_layer,
               fx_refs.op_type_reference, fx_refs.legal_pairs, fx_refs.fold_reasons, fx_refs.fold_conv_bn_reference,
               fx_refs.fold_variants, fx_refs.affine_chains, fx_refs.affine_fold,
               mf_refs.format_losses, mf_refs.dense_strides,
               fad_refs.sinc_reference, fad_refs.sinc_derivative_reference, fad_refs.reverse_jacobian,
               fad_refs.wide_jacobian, fad_refs.param_jvp_reference,
               jac_refs.tanh_jacobian, jac_refs.tanh_parameter_jacobians, jac_refs.normed_batched_jacobian,
               jac_refs.energy_hessian, jac_refs.energy_hvp, jac_refs.sample_loop,
               jac_refs.largest_fitting_chunk,
               vmap_refs.loop_predictions, vmap_refs.loop_member_kl, vmap_refs.loop_sgd_step,
               vmap_refs.reference_per_sample_grads, vmap_refs.per_sample_norms, vmap_refs.dp_sgd_reference,
               vmap_refs.kl_mistakes, vmap_refs.dp_clip_mistakes,
               bc_refs.broadcast_shape_reference, bc_refs.mse_reference, bc_refs.sq_dists_reference,
               bc_refs.segment_sum_reference, bc_refs.segment_max_reference, bc_refs.penalty_reference,
               bc_refs.softplus_reference,
               fastpath_refs.reference_attention, fastpath_refs.naive_masked_attention]
    missing = [f.__qualname__ for f in guarded if not getattr(f, "__course_reference__", False)]
    assert not missing, missing
    # An input the learner must call is no reference: lesson 5 differentiates an Energy's gradient.
    assert not getattr(jac.Energy.gradient, "__course_reference__", False)


#: References that stay in the learner's reach, and why: the lessons' own cells use them. Lesson 7's
#: loops are the slow baselines its cells time (a loop earns no speed exercise). Lesson 9's watch for
#: the fast path wraps a PyTorch facility a learner could call as directly (it runs the encoder and
#: looks at the ops that ran). Lesson 8's ``stored_races`` computes nothing: it looks up the
#: sanitizer's reports stored for the lesson's own programs (its op table, diff and replay moved to
#: course.references: their source, copied into a cell, answered the exercises). Under the grader
#: they refuse to serve an answer (course.guard), a wall inside the learner's process
#: (docs/grading.md, "What it does not guarantee").
IN_REACH = {"course.broadcasting": {"naive_sq_dists", "row_loop_sq_dists", "loop_segment_sum", "loop_penalty"},
            "course.streams": {"stored_races"},
            "course.fastpath": {"run_config", "fast_path_taken"}}


def _references_in(module) -> set[str]:
    """Names of ``module`` (functions, and methods of its classes) that carry the guard."""
    found = set()
    for name, value in vars(module).items():
        if getattr(value, "__module__", None) != module.__name__:
            continue  # imported from elsewhere: judged in its own module
        if getattr(value, "__course_reference__", False):
            found.add(name)
        if isinstance(value, type):
            found |= {f"{name}.{attr}" for attr, member in vars(value).items()
                      if getattr(getattr(member, "__func__", member), "__course_reference__", False)}
    return found


def test_no_reference_that_answers_an_exercise_is_in_the_learners_reach():
    """The learner's process (and a learner's copy of the course) has every module of ``course``
    but ``course.references``: a reference left there can be unwrapped (its closure) and called as
    an answer. Every guarded function must live in ``course.references``, bar the few named above."""
    import course as package

    found = {}
    for info in pkgutil.walk_packages(package.__path__, "course."):
        if info.name.startswith("course.references") or info.name.endswith("__main__"):
            continue
        names = _references_in(importlib.import_module(info.name))
        if names:
            found[info.name] = names
    assert found == IN_REACH, found

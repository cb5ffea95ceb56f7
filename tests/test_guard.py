"""course.guard: under the grader, the course's references refuse to serve a learner's cell."""

from __future__ import annotations

import functools
import importlib
import pkgutil

import pytest
import torch

import course
import course.checks
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
    """The references named here reproduce an exercise's answer; each must carry the guard."""
    for info in pkgutil.iter_modules(course.checks.__path__, "course.checks."):
        importlib.import_module(info.name)
    from course.checks import forward_ad, fx, jacobians, memory_format, vmap
    from course import fastpath, forward_ad as fad, jacobians as jac
    from course.references import fastpath as fastpath_refs, rnn
    from course.references import jacobians as jac_refs

    guarded = [rnn.layer_norm_lstm_cell_reference, rnn.eager_lstm_layer, jac.TanhLayer.jacobian,
               jac.Energy.hessian, jac.Energy.hvp, fad.WideFunction.jacobian,
               vmap.loop_predictions, vmap.reference_per_sample_grads, vmap.dp_sgd_reference, vmap.per_sample_norms,
               forward_ad.sinc_reference, forward_ad.sinc_derivative_reference, fx._op_type, fx._legal_pairs,
               fx._fold_reference, fx._reasons, memory_format.format_losses, memory_format._dense,
               jac_refs.largest_fitting_chunk, fastpath_refs.reference_attention, fastpath_refs.naive_masked_attention,
               fastpath.fast_path_taken, fastpath.run_config]
    missing = [f.__qualname__ for f in guarded if not getattr(f, "__course_reference__", False)]
    assert not missing, missing
    # An input the learner must call is no reference: lesson 5 differentiates an Energy's gradient.
    assert not getattr(jac.Energy.gradient, "__course_reference__", False)
    assert isinstance(functools.wraps, object) and course is not None

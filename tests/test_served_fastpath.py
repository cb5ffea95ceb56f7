"""Lesson 9's checks across the judge/learner boundary (course.checks.fastpath): encoders cross as
recipes, configurations as data, the course's probes watch SDPA and autocast where the learner's
code lives; right answers pass, stubs fail with the usual message, planted mistakes fail, and the
course's references refuse to serve as answers."""

from __future__ import annotations

import pytest

import course.grader_hooks as hooks
from course.checks.fastpath import (check_autocast_guard, check_fast_path_predictions, check_jagged_mlp,
                                    check_masked_attention, check_sdpa_attention)
from served_helpers import served
from test_checks_fastpath import (always_slow, guarded, jagged, masked, packed, predict, sdpa, sdpa_both,
                                  sdpa_per_sample, stub)


def borrowed_prediction(c):
    from course.fastpath import fast_path_taken
    return fast_path_taken(c)


def borrowed_attention(q, k, v, attn_mask=None, key_padding_mask=None, is_causal=False):
    from course.fastpath import reference_attention
    return reference_attention(q, k, v, attn_mask, key_padding_mask, is_causal).to(q.dtype)


@pytest.fixture
def learner():
    yield from served(dict(masked=masked, sdpa=sdpa, predict=predict, guarded=guarded, stub=stub,
                           sdpa_both=sdpa_both, sdpa_per_sample=sdpa_per_sample, always_slow=always_slow,
                           borrowed_prediction=borrowed_prediction, borrowed_attention=borrowed_attention, jagged=jagged,
                           packed=packed))


def test_right_answers_pass_every_served_check(learner, capsys):
    check_masked_attention(learner("masked"))
    check_sdpa_attention(learner("sdpa"))
    check_fast_path_predictions(learner("predict"), n=3)
    check_autocast_guard(learner("guarded"))
    check_jagged_mlp(learner("jagged"))
    out = capsys.readouterr().out
    assert out.count("ok:") == 5, out


@pytest.mark.parametrize("check", [check_masked_attention, check_sdpa_attention, check_fast_path_predictions,
                                   check_autocast_guard, check_jagged_mlp])
def test_unwritten_answers_fail_with_a_friendly_message_across_the_boundary(learner, check):
    with pytest.raises(AssertionError, match="not written yet"):
        check(learner("stub"))


@pytest.mark.parametrize("check, name, says", [
    (check_sdpa_attention, "sdpa_both", "both an attn_mask and is_causal=True"),
    (check_sdpa_attention, "sdpa_per_sample", "times for one batch"),
    (check_autocast_guard, "always_slow", "no longer takes the fast path"),
    (check_jagged_mlp, "packed", "the MLP was given")])
def test_what_only_the_learners_process_sees_is_watched_there(learner, check, name, says):
    with pytest.raises(AssertionError, match=says):
        check(learner(name))


@pytest.mark.parametrize("check, name", [(check_fast_path_predictions, "borrowed_prediction"),
                                         (check_masked_attention, "borrowed_attention")])
def test_the_course_references_refuse_to_answer_under_the_grader(learner, monkeypatch, check, name):
    refused = []
    monkeypatch.setattr(hooks, "learner_prefix", "/nowhere/learner-cells/")
    monkeypatch.setattr(hooks, "refused", lambda what, where: refused.append(what))
    with pytest.raises(AssertionError, match="one of the course's references"):
        check(learner(name))
    assert refused

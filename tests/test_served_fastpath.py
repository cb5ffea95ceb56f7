"""Lesson 9's checks across the judge/learner boundary (course.checks.fastpath): encoders cross as
recipes, configurations as data, the course's probes watch SDPA and autocast where the learner's
code lives; right answers pass, stubs fail with the usual message, planted mistakes fail, and the
course's references refuse to serve as answers."""

from __future__ import annotations

import pytest

from course.checks.fastpath import (check_autocast_guard, check_fast_path_predictions, check_jagged_mlp,
                                    check_masked_attention, check_sdpa_attention, check_sdpa_encoder_layer)
from served_helpers import UNDECIDED, expect_refused, never_failed, served
from test_checks_fastpath import (always_slow, by_hand, guarded, jagged, masked, masked_by_sdpa, packed, predict, sdpa,
                                  sdpa_both, sdpa_per_sample, stub)


def borrowed_prediction(c):
    from course.fastpath import fast_path_taken
    return fast_path_taken(c)


def borrowed_attention(q, k, v, attn_mask=None, key_padding_mask=None, is_causal=False):
    from course.references.fastpath import reference_attention
    return reference_attention(q, k, v, attn_mask, key_padding_mask, is_causal).to(q.dtype)


def layer_itself(layer, x, key_padding_mask):
    return layer(x, src_key_padding_mask=key_padding_mask)


@pytest.fixture
def learner():
    yield from served(dict(masked=masked, sdpa=sdpa, predict=predict, guarded=guarded, stub=stub,
                           sdpa_both=sdpa_both, sdpa_per_sample=sdpa_per_sample, always_slow=always_slow,
                           borrowed_prediction=borrowed_prediction, borrowed_attention=borrowed_attention, jagged=jagged,
                           packed=packed, by_hand=by_hand, layer_itself=layer_itself,
                           masked_by_sdpa=masked_by_sdpa))


def test_right_answers_pass_every_served_check(learner, capsys):
    check_masked_attention(learner("masked"))
    check_sdpa_attention(learner("sdpa"))
    check_fast_path_predictions(learner("predict"), n=3)
    check_autocast_guard(learner("guarded"))
    check_jagged_mlp(learner("jagged"))
    check_sdpa_encoder_layer(learner("by_hand"))
    out = capsys.readouterr().out
    assert out.count("ok:") == 6, out


@pytest.mark.parametrize("check", [check_masked_attention, check_sdpa_attention, check_fast_path_predictions,
                                   check_autocast_guard, check_jagged_mlp, check_sdpa_encoder_layer])
def test_unwritten_answers_fail_with_a_friendly_message_across_the_boundary(learner, check):
    with pytest.raises(AssertionError, match="not written yet"):
        check(learner("stub"))


@pytest.mark.parametrize("check, name, says", [
    (check_sdpa_attention, "sdpa_both", "both an attn_mask and is_causal=True"),
    (check_sdpa_attention, "sdpa_per_sample", "times for one batch"),
    (check_autocast_guard, "always_slow", "no longer takes the fast path"),
    (check_jagged_mlp, "packed", "the MLP was given"),
    (check_sdpa_encoder_layer, "layer_itself", "the layer itself"),
    (check_masked_attention, "masked_by_sdpa", "it calls torch.nn.functional.scaled_dot_product_attention")])
def test_what_only_the_learners_process_sees_is_watched_there(learner, check, name, says):
    with pytest.raises(AssertionError, match=says):
        check(learner(name))


@pytest.mark.parametrize("check, name", [(check_fast_path_predictions, "borrowed_prediction"),
                                         (check_masked_attention, "borrowed_attention")])
def test_the_course_references_refuse_to_answer_under_the_grader(learner, monkeypatch, check, name):
    expect_refused(monkeypatch, lambda: check(learner(name)))


# Sizes where the work, not the crossing, decides (one thread, 2 CPU cores): SDPA with a padding mask
# measured 1.86x naive (1,024 tokens, 4 heads: 16 MiB score matrices, under the allocator's 32 MiB
# threshold, so naive is timed at its best); the jagged MLP 1.57x padded at half the tokens.
SDPA_SIZES = dict(batch=1, heads=4, length=1024, dim=64, valid=0.6, causal=False)
JAGGED_SIZES = dict(batch=8, length=512, dim=256, hidden=1024, valid=0.5)
QUICK = dict(num_threads=1, rounds=5, min_run_time=0.05, attempts=2)


def naive_served(q, k, v, key_padding_mask=None, is_causal=False):
    from course.references.fastpath import naive_masked_attention
    return naive_masked_attention(q, k, v, key_padding_mask, is_causal)


def padded_served(x, key_padding_mask, mlp):
    return mlp(x).masked_fill(key_padding_mask[..., None], 0.0)


@pytest.fixture
def timed_learner():
    yield from served(dict(sdpa=sdpa, jagged=jagged, naive=naive_served, padded=padded_served))


def test_the_fused_and_the_jagged_answers_pass_their_speed_checks(timed_learner):
    """A right answer is measured as the lesson's cells measure it: three attempts, not QUICK's two.
    (With two, the jagged MLP, 1.57x on a quiet machine, was left undecided once in a full CI run:
    1.43x, its 99% bound 1.17x against the 1.2x bar; with three, once more, 1.46x, its bound 1.10x,
    while CI's other work ran: so a busy machine may leave it undecided, and a decided miss fails.)"""
    from course.checks.fastpath import check_jagged_speed, check_sdpa_speed
    lesson_like = dict(QUICK, attempts=3)
    report = never_failed(lambda: check_sdpa_speed(timed_learner("sdpa"), bars={"cpu": 1.2, "cuda": 1.2},
                                                    **SDPA_SIZES, **lesson_like))
    assert report is UNDECIDED or report.names == ["naive", "sdpa"]
    never_failed(lambda: check_jagged_speed(timed_learner("jagged"), bars={"cpu": 1.2, "cuda": 1.2},
                                             **JAGGED_SIZES, **lesson_like))


def test_the_baselines_own_code_never_passes_a_speed_check(timed_learner):
    from course.checks.fastpath import check_jagged_speed, check_sdpa_speed
    with pytest.raises(AssertionError, match="called F.scaled_dot_product_attention 0 times"):  # by hand: no speed
        check_sdpa_speed(timed_learner("naive"), bars={"cpu": 1.2, "cuda": 1.2}, **SDPA_SIZES, **QUICK)
    with pytest.raises(AssertionError, match="as fast as padded"):
        check_jagged_speed(timed_learner("padded"), bars={"cpu": 1.2, "cuda": 1.2}, **JAGGED_SIZES, **QUICK)


# -- the jagged MLP is lent by the judge: what it was given is the judge's record ---------------------

def _offsets(keep):
    import torch
    return torch.cat([keep.new_zeros(1, dtype=torch.long), keep.sum(1).cumsum(0)])


def one_sequence(x, key_padding_mask, mlp):  # the tokens as one jagged sequence: the same numbers for a token MLP
    import torch
    keep = ~key_padding_mask
    values = x[keep]
    y = mlp(torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, values.shape[0]])))
    out = torch.zeros_like(x)
    out[keep] = y.values()
    return out


def dense_then_jagged(x, key_padding_mask, mlp):  # the numbers from a dense call, a jagged call for the record
    import torch
    keep = ~key_padding_mask
    out = mlp(x).masked_fill(key_padding_mask[..., None], 0.0)
    mlp(torch.nested.nested_tensor_from_jagged(x[keep], _offsets(keep)))
    return out


def weights_read(x, key_padding_mask, mlp):  # the MLP's weights, to compute the tokens without calling it
    import torch
    first, last = mlp[0], mlp[2]
    return torch.nn.functional.linear(torch.nn.functional.gelu(first(x)), last.weight, last.bias)


def holes(x, key_padding_mask, mlp):  # a jagged view of the padded batch: the padding computed too
    import torch
    keep = ~key_padding_mask
    lengths = keep.sum(1)
    offsets = torch.arange(x.shape[0] + 1) * x.shape[1]
    y = mlp(torch.nested.nested_tensor_from_jagged(x.reshape(-1, x.shape[-1]), offsets, lengths=lengths))
    return y.values().reshape(x.shape).masked_fill(key_padding_mask[..., None], 0.0)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("answer, says", [
    (packed, r"the MLP was given \['dense'\]"),
    (one_sequence, "is not the batch's real tokens, in order, one sequence after another"),
    (dense_then_jagged, r"the MLP was given \['dense', 'jagged'\]"),
    (weights_read, "'_Back' object is not subscriptable"),
    (holes, "it was given torch.Tensor \\(nested, jagged with holes"),
])
def test_the_jagged_mlp_is_the_judges_so_what_it_was_given_is_its_record(answer, says):
    """The MLP stays in the judge (lent): the learner's process holds no weights and no hook to
    forge, and the judge notes each call's input itself."""
    for learner in served({"answer": answer}):
        with pytest.raises(AssertionError, match=says):
            check_jagged_mlp(learner("answer"))


def int32_offsets(x, key_padding_mask, mlp):  # flash attention's habit: int32 offsets (cu_seqlens)
    import torch
    keep = ~key_padding_mask
    y = mlp(torch.nested.nested_tensor_from_jagged(x[keep], _offsets(keep).to(torch.int32)))
    out = torch.zeros_like(x)
    out[keep] = y.values()
    return out


def residual_read(x, key_padding_mask, mlp):  # uses what came back beside what it sent (one ragged size)
    import torch
    keep = ~key_padding_mask
    nt = torch.nested.nested_tensor_from_jagged(x[keep], _offsets(keep))
    y = mlp(nt)
    both = (y + nt) - nt  # the judge's reply shares nt's ragged dimension, as a local MLP's output does
    out = torch.zeros_like(x)
    out[keep] = both.values()
    return out


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_honest_jagged_answers_keep_their_marks_across_the_boundary():
    for learner in served({"int32_offsets": int32_offsets, "residual_read": residual_read}):
        check_jagged_mlp(learner("int32_offsets"))
        check_jagged_mlp(learner("residual_read"))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_the_lent_mlp_notes_a_call_it_refuses_and_its_weights_are_secret():
    """A jagged call of the wrong dtype is noted as what it was, and is no right call (the judge's
    MLP refused it); the MLP's weights come from the class's secret key as well as the check's seed
    (the same in the instructor's run and every submission), so a learner who finds the seed cannot
    rebuild them."""
    import torch

    from course.checks.fastpath import LentMLP, _jagged_input_right, secret_mlp
    from course.fastpath import ragged_batch

    x, pad = ragged_batch(0, batch=3, length=5, dim=16)
    keep = ~pad
    lent = LentMLP(secret_mlp(0, 16, 32), 15, 16)
    with pytest.raises(TypeError, match="float32; it was given"):
        lent(torch.nested.nested_tensor_from_jagged(x[keep].double(), _offsets(keep)))
    assert lent.seen[0].startswith("jagged a tensor of shape") and not lent.given
    with pytest.raises(AssertionError, match="the MLP was given"):
        _jagged_input_right(lent, x, pad, "label", "hint")
    from course import checks
    from course.fastpath import token_mlp

    outside = secret_mlp(0, 16, 32)
    assert torch.equal(outside[0].weight, secret_mlp(0, 16, 32)[0].weight)  # the same for the same seed
    assert not torch.equal(outside[0].weight, token_mlp(0, dim=16, hidden=32)[0].weight)
    before = list(checks._KEY)
    try:
        checks._KEY[:] = [b"a class key of sixteen bytes or more"]
        keyed = secret_mlp(0, 16, 32)  # the judge's: under the class key, not what a learner can compute
        assert torch.equal(keyed[0].weight, secret_mlp(0, 16, 32)[0].weight)
        assert not torch.equal(keyed[0].weight, outside[0].weight)
    finally:
        checks._KEY[:] = before

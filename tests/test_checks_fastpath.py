"""Lesson 9's checks (course.checks.fastpath): right answers written here independently pass, the
untouched stub fails, and each planted mistake fails, named where the check names it."""
import math

import pytest
import torch
import torch.nn.functional as F

TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])

from course.checks.fastpath import (check_autocast_guard, check_fast_path_predictions, check_masked_attention,
                                    check_sdpa_attention)


def stub(*args, **kwargs):
    raise NotImplementedError()


# -- masked attention by hand ---------------------------------------------------------------------

def masked(q, k, v, attn_mask=None, key_padding_mask=None, is_causal=False, *, scale=True, pad_rows=False,
           flip_pad=False, flip_attn=False, causal_up=False, always_causal=False, drop=()):
    s = q @ k.transpose(-2, -1)
    if scale:
        s = s / math.sqrt(q.shape[-1])
    if attn_mask is not None and "attn" not in drop:
        s = s.masked_fill(attn_mask if flip_attn else ~attn_mask, float("-inf"))
    if key_padding_mask is not None and "pad" not in drop:
        m = ~key_padding_mask if flip_pad else key_padding_mask
        s = s.masked_fill(m[:, None, :, None] if pad_rows else m[:, None, None, :], float("-inf"))
    if (is_causal and "causal" not in drop) or always_causal:
        n = s.shape[-1]
        future = torch.ones(n, n, dtype=torch.bool).tril(-1) if causal_up else torch.ones(n, n, dtype=torch.bool).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return torch.softmax(s, -1) @ v


def with_(**kw):
    return lambda *a, **m: masked(*a, **m, **kw)


def masked_by_sdpa(q, k, v, attn_mask=None, key_padding_mask=None, is_causal=False):
    """Right values, through SDPA (Exercise 2's tool): every mask folded into one boolean mask."""
    L, S = q.shape[-2], k.shape[-2]
    keep = torch.ones(L, S, dtype=torch.bool, device=q.device)
    if attn_mask is not None:
        keep = keep & attn_mask
    if key_padding_mask is not None:
        keep = keep & ~key_padding_mask[:, None, None, :]
    if is_causal:
        keep = keep & torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def test_right_masked_attention_passes():
    for seed in range(3):
        check_masked_attention(masked, seed=seed)


@pytest.mark.parametrize("wrong, named", [
    (stub, "not written yet"),
    (with_(scale=False), "not divided by sqrt(d)"),
    (with_(flip_pad=True), "read as SDPA's convention"),
    (with_(pad_rows=True), "instead of padded keys"),
    (with_(flip_attn=True), "True = ignore"),
    (with_(drop=("pad",)), "key_padding_mask was ignored"),
    (with_(drop=("attn",)), "attn_mask was ignored"),
    (with_(drop=("causal",)), "is_causal was ignored"),
    (with_(causal_up=True), "causal mask was flipped"),
    (with_(always_causal=True), "though is_causal=False"),
    (lambda q, k, v, **m: masked(q, k, v, **m).float(), None),
    (lambda q, k, v, **m: masked(q, k, v, **m)[..., :-1], "shape"),
    (masked_by_sdpa, "it calls torch.nn.functional.scaled_dot_product_attention"),  # (2026-11-30: it passed)
])
def test_masked_attention_mistakes_fail_and_are_named(wrong, named):
    with pytest.raises(AssertionError) as exc:
        check_masked_attention(wrong, seed=1)
    if named:
        assert named in str(exc.value), str(exc.value)


# -- a learner's copy of the course: no grader references, stored answers ---------------------------

def test_without_the_grader_references_the_visible_checks_use_stored_answers(learners_copy, capsys):
    """A learner's copy has no course.references: the visible calls (seed 0) compare with the stored
    float64 answers, still name a misreading of the masks, and refuse other seeds honestly."""
    import course.checks.fastpath as C

    C.check_masked_attention(masked)
    C.check_sdpa_attention(sdpa)
    assert capsys.readouterr().out.count("ok: ") == 2
    with pytest.raises(AssertionError, match="read as SDPA's convention"):
        C.check_masked_attention(with_(flip_pad=True))
    with pytest.raises(AssertionError, match="causal mask was flipped"):
        C.check_masked_attention(with_(causal_up=True))
    with pytest.raises(AssertionError, match="read as SDPA's convention"):
        C.check_sdpa_attention(sdpa_unflipped)
    with pytest.raises(AssertionError, match="reference data for seed 0 only"):
        C.check_masked_attention(masked, seed=2)


def test_without_the_grader_references_the_speed_baseline_is_the_learners_own(learners_copy, monkeypatch):
    import course.checks.fastpath as C

    seen = []
    monkeypatch.setattr(C, "served_speedup", lambda baseline, candidate, **kw: seen.append(
        baseline[1](*C.masked_attention_inputs(0, batch=1, heads=1, length=8, dim=4), True)))
    with pytest.raises(AssertionError, match="needs your masked_attention"):
        C.check_sdpa_speed(sdpa, bars={"cpu": 1.0}, batch=1, heads=1, length=8, dim=4)
    calls = []
    C.check_sdpa_speed(sdpa, lambda *a, **m: calls.append(sorted(m)) or masked(*a, **m), bars={"cpu": 1.0}, batch=1,
                       heads=1, length=8, dim=4)
    assert calls == [["is_causal", "key_padding_mask"]] * 2 and seen[0].shape == (1, 1, 8, 4)  # checked it runs, then timed


# -- SDPA, portably ---------------------------------------------------------------------------------

def sdpa(q, k, v, key_padding_mask=None, is_causal=False):
    if key_padding_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    attend = ~key_padding_mask[:, None, None, :]
    if is_causal:
        n = q.shape[-2]
        attend = attend & torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attend)


def sdpa_both(q, k, v, key_padding_mask=None, is_causal=False):  # fine on 2.13, an error from 2.14
    mask = None if key_padding_mask is None else ~key_padding_mask[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)


def sdpa_additive(q, k, v, key_padding_mask=None, is_causal=False):
    if key_padding_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    add = torch.zeros(key_padding_mask.shape, dtype=q.dtype).masked_fill(key_padding_mask, float("-inf"))
    add = add[:, None, None, :]
    if is_causal:
        n = q.shape[-2]
        add = add.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=add)


def sdpa_per_sample(q, k, v, key_padding_mask=None, is_causal=False):
    if key_padding_mask is None:
        return sdpa(q, k, v, None, is_causal)
    return torch.cat([sdpa(q[i:i + 1], k[i:i + 1], v[i:i + 1], key_padding_mask[i:i + 1], is_causal)
                      for i in range(q.shape[0])])


def sdpa_unflipped(q, k, v, key_padding_mask=None, is_causal=False):
    return sdpa(q, k, v, None if key_padding_mask is None else ~key_padding_mask, is_causal)


def test_right_sdpa_attention_passes():
    for seed in range(3):
        check_sdpa_attention(sdpa, seed=seed)


@pytest.mark.parametrize("wrong, named", [
    (stub, "not written yet"),
    (sdpa_both, "both an attn_mask and is_causal=True"),
    (sdpa_additive, "dtype float64"),
    (sdpa_per_sample, "times for one batch"),
    (sdpa_unflipped, "read as SDPA's convention"),
    (lambda q, k, v, key_padding_mask=None, is_causal=False: masked(q, k, v, key_padding_mask=key_padding_mask,
                                                                    is_causal=is_causal), "0 times"),
])
def test_sdpa_attention_mistakes_fail_and_are_named(wrong, named):
    with pytest.raises(AssertionError) as exc:
        check_sdpa_attention(wrong, seed=2)
    assert named in str(exc.value), str(exc.value)


# -- when the fast path runs ------------------------------------------------------------------------

def predict(c):
    return (not c["training"] and not c["grad"] and c["nhead"] % 2 == 0 and c["batch_first"] and c["bias"])


@pytest.mark.parametrize("seed", [0, 1])
def test_right_predictions_pass(seed):
    check_fast_path_predictions(predict, seed=seed)


@pytest.mark.parametrize("wrong", [
    stub,
    lambda c: True,
    lambda c: not c["training"] and not c["grad"],  # the two everyone knows
    lambda c: predict(c) and c["dropout"] == 0.0,  # dropout is off in eval mode anyway
    lambda c: predict(c) and c["dtype"] == "float32",
    lambda c: predict(c) and not c["padding_mask"],
    lambda c: int(predict(c)),  # not a bool
])
def test_wrong_predictions_fail(wrong):
    with pytest.raises(AssertionError):
        check_fast_path_predictions(wrong, seed=0)


# -- the autocast guard -----------------------------------------------------------------------------

def guarded(enc, x, key_padding_mask=None):
    if torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return enc(x.float(), src_key_padding_mask=key_padding_mask)
    return enc(x, src_key_padding_mask=key_padding_mask)


def unguarded(enc, x, key_padding_mask=None):
    return enc(x, src_key_padding_mask=key_padding_mask)


def cast_back(enc, x, key_padding_mask=None):  # no crash only where it did not crash; bf16 results
    try:
        return unguarded(enc, x, key_padding_mask).float()
    except RuntimeError:
        with torch.autocast("cpu", enabled=False):
            return enc(x, src_key_padding_mask=key_padding_mask)


def always_slow(enc, x, key_padding_mask=None):
    with torch.enable_grad():
        x = x.clone().requires_grad_()
        with torch.autocast("cpu", enabled=False):
            return enc(x, src_key_padding_mask=key_padding_mask).detach()


def test_right_guard_passes():
    check_autocast_guard(guarded, seed=0)


@pytest.mark.parametrize("wrong, named", [
    (stub, "not written yet"),
    (unguarded, None),  # bfloat16 or a crash, depending on the release and the mask
    (cast_back, "unpadded tokens"),
    (always_slow, "no longer takes the fast path"),
])
def test_guard_mistakes_fail(wrong, named):
    if wrong is cast_back and TORCH < (2, 13):
        pytest.skip("on torch 2.4 the fast path raises under autocast with or without a mask: there, falling back "
                    "on the error is a right guard")
    with pytest.raises(AssertionError) as exc:
        check_autocast_guard(wrong, seed=0)
    if named:
        assert named in str(exc.value), str(exc.value)


# -- a token MLP on a jagged batch ------------------------------------------------------------------

def jagged(x, key_padding_mask, mlp):
    keep = ~key_padding_mask
    offsets = torch.cat([keep.new_zeros(1, dtype=torch.long), keep.sum(1).cumsum(0)])
    y = mlp(torch.nested.nested_tensor_from_jagged(x[keep], offsets))
    out = x.new_zeros(x.shape[:-1] + (y.values().shape[-1],))
    out[keep] = y.values()
    return out


def packed(x, key_padding_mask, mlp):  # right numbers, no nested tensor
    out = torch.zeros_like(x)
    out[~key_padding_mask] = mlp(x[~key_padding_mask])
    return out


def strided(x, key_padding_mask, mlp):
    keep = ~key_padding_mask
    nt = torch.nested.nested_tensor([x[i, keep[i]] for i in range(x.shape[0])])
    ys = mlp(nt).unbind()
    out = torch.zeros_like(x)
    for i, y in enumerate(ys):
        out[i, keep[i]] = y
    return out


def per_sample(x, key_padding_mask, mlp):
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        keep = ~key_padding_mask[i]
        out[i, keep] = mlp(x[i, keep])
    return out


def padding_kept(x, key_padding_mask, mlp):
    keep = ~key_padding_mask
    offsets = torch.cat([keep.new_zeros(1, dtype=torch.long), keep.sum(1).cumsum(0)])
    y = mlp(torch.nested.nested_tensor_from_jagged(x[keep], offsets))
    out = torch.ones_like(x)  # padded rows left at one, not zeroed
    out[keep] = y.values()
    return out


def test_right_jagged_mlp_passes():
    from course.checks.fastpath import check_jagged_mlp
    for seed in range(2):
        check_jagged_mlp(jagged, seed=seed)


@pytest.mark.parametrize("wrong, named", [
    (stub, "not written yet"), (packed, "was given ['dense']"), (strided, "it was given a strided nested tensor"),
    (per_sample, "dense"), (padding_kept, "jagged_token_mlp on a"),
    (lambda x, m, mlp: mlp(x), "jagged_token_mlp on a")])  # padding not zeroed
def test_jagged_mlp_mistakes_fail(wrong, named):
    from course.checks.fastpath import check_jagged_mlp
    with pytest.raises(AssertionError) as exc:
        check_jagged_mlp(wrong, seed=0)
    assert named in str(exc.value), str(exc.value)


# -- the modern block -------------------------------------------------------------------------------

def by_hand(layer, x, key_padding_mask, *, mask=True, per_head=False, norm_order=True, out_bias=True):
    attn = layer.self_attn
    b, n, d = x.shape
    h = attn.num_heads

    def block(z):
        q, k, v = (t.reshape(b, n, h, d // h).transpose(1, 2)
                   for t in F.linear(z, attn.in_proj_weight, attn.in_proj_bias).chunk(3, -1))
        m = ~key_padding_mask[:, None, None, :] if mask else None
        if per_head:
            o = torch.cat([F.scaled_dot_product_attention(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], attn_mask=m)
                           for i in range(h)], 1)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        o = o.transpose(1, 2).reshape(b, n, d)
        return F.linear(o, attn.out_proj.weight, attn.out_proj.bias if out_bias else None)

    def ff(z):
        return layer.linear2(F.relu(layer.linear1(z)))

    if layer.norm_first and norm_order:
        x = x + block(layer.norm1(x))
        return x + ff(layer.norm2(x))
    x = layer.norm1(x + block(x))
    return layer.norm2(x + ff(x))


def test_right_encoder_layer_passes():
    from course.checks.fastpath import check_sdpa_encoder_layer
    for seed in range(2):
        check_sdpa_encoder_layer(by_hand, seed=seed)


@pytest.mark.parametrize("wrong, named", [
    (stub, "not written yet"),
    (lambda layer, x, m: layer(x, src_key_padding_mask=m), "the layer itself"),
    (lambda layer, x, m: layer.norm2(x + layer.linear2(F.relu(layer.linear1(layer.norm1(
        x + layer.self_attn(x, x, x, key_padding_mask=m, need_weights=False)[0]))))), "nn.MultiheadAttention"),
    (lambda layer, x, m: by_hand(layer, x, m, per_head=True), "times"),
    (lambda layer, x, m: by_hand(layer, x, m, mask=False), "what its SDPA call returned"),
    (lambda layer, x, m: by_hand(layer, x, m, norm_order=False), "what its SDPA call returned"),
    (lambda layer, x, m: by_hand(layer, x, m, out_bias=False), "unpadded tokens"),
])
def test_encoder_layer_mistakes_fail(wrong, named):
    from course.checks.fastpath import check_sdpa_encoder_layer
    with pytest.raises(AssertionError) as exc:
        check_sdpa_encoder_layer(wrong, seed=0)
    assert named in str(exc.value), str(exc.value)

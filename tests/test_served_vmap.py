"""Lesson 6's checks across the judge/learner boundary: models cross as recipes (the learner's side
builds the same seeded model with the course's code), a generator as its state, what a function
did to its inputs comes back only where a check asks (``mirrored``), and "a loop or not" is the
judge's clock against the course's own loop, never a watcher in the learner's process."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from torch.func import functional_call, grad, stack_module_state, vmap

from autograder import program as prog
from course import remote, wire
from course.checks.vmap import (SERVED, check_dp_sgd_step, check_ensemble_predict, check_ensemble_sgd_step,
                                check_member_kl, check_member_kl_speed,
                                check_opacus_grads, check_per_sample_grads, check_per_sample_grads_loop,
                                check_predict_dropout, check_stack_ensemble)
from served_helpers import UNDECIDED, clock_ratio, loop_named, memoised, never_failed, served
from course.vmap import member_kl_planted, meta_copy, mlp_ensemble, quiet_opacus, small_cnn

ROOT = Path(__file__).resolve().parents[1]
# the planted F.kl_div under vmap: PyTorch's warning is what the lesson is about
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")


# -- the wire: models, their meta copies, generators, what comes back ------------------------------

def test_models_cross_as_recipes_and_a_copy_of_one_as_what_it_is():
    models = mlp_ensemble(3, seed=2, features=5, hidden=4)
    base = meta_copy(models[0])
    sent = wire.decode(wire.encode([models, base]))
    built = remote.build(sent)
    x = torch.randn(2, 5)
    assert all(torch.equal(b(x), m(x)) for b, m in zip(built[0], models))
    assert built[1][1].weight.device.type == "meta"
    # a deep copy carries the mark of the recipe, but is not what the recipe built: it crosses as its state
    moved = copy.deepcopy(models[0]).to("meta")
    got = wire.decode(wire.encode(moved))
    assert isinstance(got, wire.ModuleState) and got.state["1.weight"].device.type == "meta"
    # and the learner's side never sends recipes: a model it returns is its state, as it is now
    assert isinstance(wire.decode(wire.encode(models[0], recipes=False)), wire.ModuleState)


def test_a_generator_crosses_as_its_state():
    g = torch.Generator().manual_seed(5)
    torch.randn(3, generator=g)
    there = remote.build(wire.decode(wire.encode(g)))
    assert torch.equal(torch.randn(4, generator=there), torch.randn(4, generator=g))
    with pytest.raises(wire.WireError):
        wire.decode(wire.encode({"g": 1}).replace(b'{"m"', b'{"g"'))


# -- lesson 6's answers, served from a thread --------------------------------------------------------

def stack_ensemble(models):
    params, buffers = stack_module_state(models)
    return params, buffers, copy.deepcopy(models[0]).to("meta")


def predict_each(params, buffers, base, xs):
    return vmap(lambda p, b, x: functional_call(base, (p, b), (x,)))(params, buffers, xs)


def predict_all(params, buffers, base, x):
    return vmap(lambda p, b: functional_call(base, (p, b), (x,)))(params, buffers)


def predict_dropout(params, buffers, base, x, randomness="different"):
    return vmap(lambda p, b: functional_call(base, (p, b), (x,)), randomness=randomness)(params, buffers)


def dropout_fixed_masks(params, buffers, base, x):
    """Each member's own mask, from a seed fixed per member: the same masks on every call."""
    def one(i, p, b):
        with torch.random.fork_rng():
            torch.manual_seed(1000 + i)
            return functional_call(base, (p, b), (x,))
    n = next(iter(params.values())).shape[0]
    return torch.stack([one(i, {k: v[i] for k, v in params.items()}, {k: v[i] for k, v in buffers.items()})
                        for i in range(n)])


def dropout_loop(params, buffers, base, x):
    """Each member in turn, drawing its own mask: right values, a loop."""
    n = next(iter(params.values())).shape[0]
    return torch.stack([functional_call(base, ({k: v[i] for k, v in params.items()},
                                               {k: v[i] for k, v in buffers.items()}), (x,)) for i in range(n)])


def dropout_only_small(wrong):
    """Right on the lesson's few members, ``wrong`` on an ensemble as large as the clock's."""
    def answer(params, buffers, base, x):
        n = next(iter(params.values())).shape[0]
        return predict_dropout(params, buffers, base, x) if n < 100 else wrong(params, buffers, base, x)
    return answer


def _dropout_layers(params, buffers, base):
    """The ensemble's state, as a hand-written forward pass needs it: ``(p, shift, scale, layers)``."""
    drop = next(m for m in base.modules() if isinstance(m, torch.nn.Dropout))
    names = sorted({k.split(".")[0] for k in params}, key=int)
    return drop.p, buffers["0.shift"], buffers["0.scale"], [(params[f"{i}.weight"], params[f"{i}.bias"])
                                                            for i in names]


def dropout_by_hand_loop(params, buffers, base, x):
    """Red team, 2026-12-01: a loop over the members with each forward pass in five ops (the standardisation
    folded into the first layer, the masks drawn at once beforehand). It read 0.16-0.32 of a course loop that
    sliced every member's model, and passed."""
    p, shift, scale, ((w1, b1), (w2, b2), (w3, b3)) = _dropout_layers(params, buffers, base)
    n = w1.shape[0]
    outs = torch.empty(n, x.shape[0], w3.shape[1], dtype=x.dtype)
    w1s = w1 / scale[:, None, :]
    w1t, b1f = w1s.transpose(1, 2).unbind(0), (b1 - (w1s * shift[:, None, :]).sum(2)).unbind(0)
    w2t, w3t, b2u, b3u, ou = w2.transpose(1, 2).unbind(0), w3.transpose(1, 2).unbind(0), b2.unbind(0), \
        b3.unbind(0), outs.unbind(0)
    masks = torch.empty(n, x.shape[0], w2.shape[1], dtype=x.dtype).bernoulli_(1 - p).div_(1 - p).unbind(0)
    for i in range(n):
        h = torch.addmm(b1f[i], x, w1t[i]).relu_()
        h = torch.addmm(b2u[i], h, w2t[i]).relu_().mul_(masks[i])
        torch.addmm(b3u[i], h, w3t[i], out=ou[i])
    return outs


def _numpy_layers(params, buffers, names):
    """Each member's layers as NumPy matrices with the bias (and the first layer's standardisation)
    folded in, acting on rows that end in a 1: ``[(n, in + 1, out (+ 1 to carry the 1)), ...]``, the
    last without the carried 1. Batched: only the loop that uses them goes member by member."""
    import numpy as np

    shift, scale = buffers["0.shift"].double().numpy(), buffers["0.scale"].double().numpy()
    mats = []
    for k, name in enumerate(names):
        w, b = params[f"{name}.weight"].double().numpy(), params[f"{name}.bias"].double().numpy()
        if k == 0:
            w, b = w / scale[:, None, :], b - np.einsum("noi,ni->no", w / scale[:, None, :], shift)
        last = k == len(names) - 1
        a = np.zeros((w.shape[0], w.shape[2] + 1, w.shape[1] + (0 if last else 1)))
        a[:, :-1, :w.shape[1]], a[:, -1, :w.shape[1]] = w.transpose(0, 2, 1), b
        if not last:
            a[:, -1, -1] = 1.0
        mats.append(list(a.astype(params[f"{name}.weight"].detach().numpy().dtype)))
    return mats


def _with_ones(x):
    import numpy as np

    x = x.detach().numpy()
    return np.concatenate([x, np.ones(x.shape[:-1] + (1,), x.dtype)], -1)


def numpy_each(params, buffers, base, xs):
    """Red team, round 11 (2026-12-01): a loop over the members in NumPy, five ops a member (about 1 us
    each, where a torch module call costs tens). It read 0.16-0.17 of the course's loop and passed every
    clock of grader version 40."""
    import numpy as np

    a1, a2, a3 = _numpy_layers(params, buffers, ("1", "3", "5"))
    return torch.from_numpy(np.stack([np.maximum(np.maximum(x @ m1, 0) @ m2, 0) @ m3
                                      for x, m1, m2, m3 in zip(_with_ones(xs), a1, a2, a3)]))


def numpy_all(params, buffers, base, x):
    return numpy_each(params, buffers, base, torch.as_tensor(x).expand(params["1.weight"].shape[0], *x.shape))


def numpy_dropout(params, buffers, base, x):
    """The same loop with dropout: the masks drawn at once, each member's forward in five ops."""
    import numpy as np

    p = next(m for m in base.modules() if isinstance(m, torch.nn.Dropout)).p
    a1, a2, a3 = _numpy_layers(params, buffers, ("1", "3", "6"))
    xo = _with_ones(x)
    keep = np.random.default_rng().random((len(a1), x.shape[0], a2[0].shape[1])) >= p
    keep = (keep / (1 - p)).astype(xo.dtype)
    keep[..., -1] = 1.0
    return torch.from_numpy(np.stack([(np.maximum(np.maximum(xo @ m1, 0) @ m2, 0) * k) @ m3
                                      for m1, m2, m3, k in zip(a1, a2, a3, keep)]))


def numpy_sgd_step(params, buffers, base, xs, ys, lr):
    """Each member's forward pass and gradient by hand in NumPy, member by member (red team, round 11:
    0.15 of the course's loop under the grader, beside a bar of a tenth)."""
    import numpy as np

    names = ("1.weight", "1.bias", "3.weight", "3.bias", "5.weight", "5.bias")
    w1, b1, w2, b2, w3, b3 = (params[k].detach().numpy() for k in names)
    shift, scale = buffers["0.shift"].numpy(), buffers["0.scale"].numpy()
    xn, yn = (xs.numpy() - shift[:, None, :]) / scale[:, None, :], ys.numpy()
    new = {k: params[k].detach().numpy().copy() for k in names}
    eye = np.eye(w3.shape[1], dtype=xn.dtype)
    for i in range(len(xn)):
        z1 = xn[i] @ w1[i].T + b1[i]
        z2 = np.maximum(z1, 0) @ w2[i].T + b2[i]
        h2 = np.maximum(z2, 0)
        e = np.exp(h2 @ w3[i].T + b3[i])
        g3 = (e / e.sum(1, keepdims=True) - eye[yn[i]]) / len(yn[i])
        g2 = (g3 @ w3[i]) * (z2 > 0)
        g1 = (g2 @ w2[i]) * (z1 > 0)
        for k, g in zip(names, (g1.T @ xn[i], g1.sum(0), g2.T @ np.maximum(z1, 0), g2.sum(0), g3.T @ h2, g3.sum(0))):
            new[k][i] -= lr * g
    return {k: torch.from_numpy(v) for k, v in new.items()}


@torch.jit.script
def _members_in_torchscript(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, w1: torch.Tensor,
                            b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, w3: torch.Tensor, b3: torch.Tensor,
                            p: float) -> torch.Tensor:
    outs = []
    for i in range(w1.shape[0]):
        h = torch.relu(F.linear((x - shift[i]) / scale[i], w1[i], b1[i]))
        h = F.dropout(torch.relu(F.linear(h, w2[i], b2[i])), p, True)
        outs.append(F.linear(h, w3[i], b3[i]))
    return torch.stack(outs)


def dropout_torchscript_loop(params, buffers, base, x):
    """Red team, 2026-12-01: the loop over the members in TorchScript, each drawing its own mask (0.26, passed)."""
    p, shift, scale, ((w1, b1), (w2, b2), (w3, b3)) = _dropout_layers(params, buffers, base)
    return _members_in_torchscript(x, shift, scale, w1, b1, w2, b2, w3, b3, p)


def dropout_mostly_shared(params, buffers, base, x):
    """Red team, 2026-12-01: batched by hand, one mask drawn for all, each member redrawing a quarter of its
    units: the members' masks agreed on 81% of their units (independent: about 50%), under the old bar of 85%."""
    p, shift, scale, ((w1, b1), (w2, b2), (w3, b3)) = _dropout_layers(params, buffers, base)
    h = (x[None] - shift[:, None, :]) / scale[:, None, :]
    h = torch.baddbmm(b1[:, None, :], h, w1.transpose(1, 2)).relu_()
    h = torch.baddbmm(b2[:, None, :], h, w2.transpose(1, 2)).relu_()
    k = h.shape[1] * h.shape[2]
    shared = (torch.randperm(k) < round(p * k)).view(h.shape[1:])
    dropped = torch.where(torch.rand(h.shape) < 0.25, torch.rand(h.shape) < p, shared[None].expand(h.shape))
    h = torch.where(dropped, torch.zeros_like(h), h / (1 - p))
    return torch.baddbmm(b3[:, None, :], h, w3.transpose(1, 2))


def _batched_dropout_by_hand(params, buffers, base, x, masks):
    """Every member on ``x`` batched by hand, with the keep-masks ``masks`` (``(n, batch, hidden)``, 1 kept)."""
    p, shift, scale, ((w1, b1), (w2, b2), (w3, b3)) = _dropout_layers(params, buffers, base)
    h = torch.baddbmm(b1[:, None, :], (x[None] - shift[:, None, :]) / scale[:, None, :], w1.transpose(1, 2)).relu_()
    h = torch.baddbmm(b2[:, None, :], h, w2.transpose(1, 2)).relu_()
    return torch.baddbmm(b3[:, None, :], h * masks / (1 - p), w3.transpose(1, 2))


def dropout_kept_masks(roll: bool):
    """Red team, round 11: masks drawn once per shape and kept across calls, either for the same member
    with its first row redrawn, or handed round the members, one place further each call (17/17 each)."""
    store: dict = {}

    def answer(params, buffers, base, x):
        p = _dropout_layers(params, buffers, base)[0]
        shape = (next(iter(params.values())).shape[0], x.shape[0], params["3.bias"].shape[1])
        masks = store.setdefault((shape, p), (torch.rand(shape, dtype=x.dtype) >= p).to(x.dtype))
        store["calls"] = store.get("calls", 0) + 1
        if roll:
            masks = masks.roll(store["calls"], 0)
        else:
            masks[:, 0] = (torch.rand(masks[:, 0].shape, dtype=x.dtype) >= p).to(x.dtype)
        return _batched_dropout_by_hand(params, buffers, base, x, masks)
    return answer


def loop_each(params, buffers, base, xs):
    return torch.stack([functional_call(base, ({k: v[i] for k, v in params.items()},
                                               {k: v[i] for k, v in buffers.items()}), (xs[i],))
                        for i in range(xs.shape[0])])


def loop_all(params, buffers, base, x):
    n = next(iter(params.values())).shape[0]
    return loop_each(params, buffers, base, x.expand(n, *x.shape))


def each_by_hand(params, buffers, base, xs):
    """A loop over the models with each forward pass written out by hand: six small ops a model, no
    module call."""
    shift, scale = buffers["0.shift"], buffers["0.scale"]
    (w1, b1), (w2, b2), (w3, b3) = ((params[f"{i}.weight"], params[f"{i}.bias"]) for i in (1, 3, 5))
    return torch.stack([F.linear(F.linear(F.linear((xs[m] - shift[m]) / scale[m], w1[m], b1[m]).relu_(), w2[m],
                                          b2[m]).relu_(), w3[m], b3[m]) for m in range(xs.shape[0])])


def member_kl(params, buffers, base, x, target):
    def one(p, b):
        log_q = F.log_softmax(functional_call(base, (p, b), (x,)), dim=-1)
        return (torch.xlogy(target, target) - target * log_q).sum(-1).mean()
    return vmap(one)(params, buffers)


def member_kl_hidden(params, buffers, base, x, target):
    """The planted kl_div, with PyTorch's fallback warning switched off: the probe sees nothing."""
    torch._C._functorch._set_vmap_fallback_warning_enabled(False)
    try:
        return member_kl_planted(params, buffers, base, x, target)
    finally:
        torch._C._functorch._set_vmap_fallback_warning_enabled(True)


def token_vmap_each(params, buffers, base, xs):
    """A loop dressed with one token vmap call."""
    vmap(torch.sin)(xs)
    return loop_each(params, buffers, base, xs)


def psg_loop(model, x, y):
    names, params = zip(*model.named_parameters())
    rows = [torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params) for i in range(len(x))]
    return {n: torch.stack([r[j] for r in rows]) for j, n in enumerate(names)}


def _patches(channels: int, size: int):
    """Where each 3x3 patch of a zero-padded ``(channels, size + 2, size + 2)`` image lies, flattened:
    ``(channels * 9, size * size)`` indices (a convolution as one matrix product)."""
    import numpy as np

    c, ki, kj, i, j = np.meshgrid(*map(np.arange, (channels, 3, 3, size, size)), indexing="ij")
    return (c * (size + 2) ** 2 + (i + ki) * (size + 2) + (j + kj)).reshape(channels * 9, size * size)


def _numpy_cnn_per_sample_grads(model, x, y):
    """The lesson's SmallCNN, each sample's forward and backward by hand in NumPy, sample by sample
    (about 40 ops a sample): 0.11 of the course's loop on grader version 40's clock (256 images, 8x8)."""
    import numpy as np

    P = {k: p.detach().double().numpy() for k, p in model.named_parameters()}
    w1, b1, w2, b2, wf, bf = (P[k] for k in ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc.weight",
                                             "fc.bias"))
    c1, c2, size = w1.shape[0], w2.shape[0], x.shape[-1]
    half, i1, i2 = size // 2, _patches(1, size), _patches(c1, size // 2)
    w1m, w2m = w1.reshape(c1, 9), w2.reshape(c2, -1)
    back = np.zeros(((half + 2) ** 2 * c1, i2.size))  # a patch matrix's gradient, back onto the padded image
    back[i2.ravel(), np.arange(i2.size)] = 1
    inner = np.zeros((c1, half + 2, half + 2), bool)
    inner[:, 1:-1, 1:-1] = True
    back = back[inner.ravel()]
    padded = np.pad(x.detach().double().numpy()[:, 0], ((0, 0), (1, 1), (1, 1))).reshape(len(x), -1)
    eye, out = np.eye(wf.shape[0]), {k: np.empty((len(x),) + v.shape) for k, v in P.items()}

    def pool(a, c, s):
        return a.reshape(c, s // 2, 2, s // 2, 2).mean((2, 4))

    def unpool(g, c, s):
        return np.broadcast_to(g.reshape(c, s // 2, 1, s // 2, 1) / 4, (c, s // 2, 2, s // 2, 2)).reshape(c, s * s)

    for t, yt in enumerate(y.numpy()):
        cols1 = padded[t][i1]
        z1 = w1m @ cols1 + b1[:, None]
        s1 = 1 / (1 + np.exp(-z1))
        cols2 = np.pad(pool(z1 * s1, c1, size), ((0, 0), (1, 1), (1, 1))).ravel()[i2]
        z2 = w2m @ cols2 + b2[:, None]
        s2 = 1 / (1 + np.exp(-z2))
        f = pool(z2 * s2, c2, half).ravel()
        e = np.exp(wf @ f + bf)
        g = e / e.sum() - eye[yt]
        gz2 = unpool(wf.T @ g, c2, half) * s2 * (1 + z2 * (1 - s2))
        gz1 = unpool(back @ (w2m.T @ gz2).ravel(), c1, size) * s1 * (1 + z1 * (1 - s1))
        out["fc.weight"][t], out["fc.bias"][t] = np.outer(g, f), g
        out["conv2.weight"][t], out["conv2.bias"][t] = (gz2 @ cols2.T).reshape(w2.shape), gz2.sum(1)
        out["conv1.weight"][t], out["conv1.bias"][t] = (gz1 @ cols1.T).reshape(w1.shape), gz1.sum(1)
    return {k: torch.from_numpy(v).to(x.dtype) for k, v in out.items()}


def numpy_per_sample_grads(model, x, y):
    """Each sample's forward and gradient by hand, in NumPy, sample by sample, for an MLP (the clock's
    model since grader version 41) or the lesson's CNN (the clock's before, where it read 0.11 of the
    course's loop and right answers 0.11-0.15, under a bar of a third: it passed; 2026-12-02). On the MLP
    it reads 0.14-0.15, right answers about 0.02."""
    import numpy as np

    if "1.weight" not in dict(model.named_parameters()):
        return _numpy_cnn_per_sample_grads(model, x, y)
    P = {k: p.detach().numpy() for k, p in model.named_parameters()}
    w1, b1, w2, b2, w3, b3 = (P[k] for k in ("1.weight", "1.bias", "3.weight", "3.bias", "5.weight", "5.bias"))
    xs = (x.numpy() - model[0].shift.numpy()) / model[0].scale.numpy()
    eye, out = np.eye(w3.shape[0], dtype=xs.dtype), {k: np.empty((len(xs),) + v.shape, xs.dtype) for k, v in P.items()}
    for t, (xt, yt) in enumerate(zip(xs, y.numpy())):
        z1 = w1 @ xt + b1
        z2 = w2 @ np.maximum(z1, 0) + b2
        e = np.exp(w3 @ np.maximum(z2, 0) + b3)
        g3 = e / e.sum() - eye[yt]
        g2 = (w3.T @ g3) * (z2 > 0)
        g1 = (w2.T @ g2) * (z1 > 0)
        for k, g in (("5", (g3, np.maximum(z2, 0))), ("3", (g2, np.maximum(z1, 0))), ("1", (g1, xt))):
            out[f"{k}.weight"][t], out[f"{k}.bias"][t] = np.outer(*g), g[0]
    return {k: torch.from_numpy(v) for k, v in out.items()}


def psg_vmap(model, x, y):
    params = {k: p.detach() for k, p in model.named_parameters()}

    def loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


def psg_opacus(model, x, y):
    quiet_opacus()
    gsm = GradSampleModule(model, loss_reduction="mean")
    try:
        F.cross_entropy(gsm(x), y).backward()
        return {k: p.grad_sample for k, p in model.named_parameters()}
    finally:
        gsm.remove_hooks()
        gsm.zero_grad(set_to_none=True)


def psg_sleepy_loop(model, x, y):
    """A loop that sleeps on small batches, to look as flat as a vmap."""
    time.sleep(max(0.0, 0.05 - 0.0004 * len(x)))
    return psg_loop(model, x, y)


def dp_sgd(params, grads, *, lr, max_norm, noise_multiplier, generator, in_place=False, draw=True):
    batch = next(iter(grads.values())).shape[0]
    norms = torch.stack([g.reshape(batch, -1).norm(dim=1) for g in grads.values()]).norm(dim=0)
    factor = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    new = {}
    for name, p in params.items():
        clipped = torch.tensordot(factor, grads[name], dims=1)
        noise = (torch.randn(p.shape, generator=generator, device=p.device, dtype=p.dtype) if draw
                 else torch.randn(p.shape, device=p.device, dtype=p.dtype))
        step = lr * (clipped + noise_multiplier * max_norm * noise) / batch
        new[name] = p.sub_(step) if in_place else p - step
    return new


def ens_step(params, buffers, base, xs, ys, lr):
    def member_loss(p, b, x, y):
        return F.cross_entropy(functional_call(base, (p, b), (x,)), y)
    g = vmap(grad(member_loss))(params, buffers, xs, ys)
    return {k: p - lr * g[k] for k, p in params.items()}


def ens_step_loop(params, buffers, base, xs, ys, lr):
    out = []
    for i in range(xs.shape[0]):
        p = {k: v[i].requires_grad_() for k, v in params.items()}
        b = {k: v[i] for k, v in buffers.items()}
        g = torch.autograd.grad(F.cross_entropy(functional_call(base, (p, b), (xs[i],)), ys[i]), list(p.values()))
        out.append({k: (p[k] - lr * gi).detach() for k, gi in zip(p, g)})
    return {k: torch.stack([o[k] for o in out]) for k in params}


def ens_step_by_hand(params, buffers, base, xs, ys, lr):
    """A loop over the members with each forward pass and gradient written out by hand, in a score of
    small ops and no module or autograd (red team, 2026-12-01: 0.19-0.31 of the course's loop)."""
    shift, scale = buffers["0.shift"], buffers["0.scale"]
    w = [params[f"{i}.weight"] for i in (1, 3, 5)]
    b = [params[f"{i}.bias"] for i in (1, 3, 5)]
    rows = torch.arange(xs.shape[1])
    out = {k: [] for k in params}
    for m in range(xs.shape[0]):
        h0 = (xs[m] - shift[m]) / scale[m]
        z1 = F.linear(h0, w[0][m], b[0][m])
        a1 = z1.clamp_min(0)
        z2 = F.linear(a1, w[1][m], b[1][m])
        a2 = z2.clamp_min(0)
        d3 = torch.softmax(F.linear(a2, w[2][m], b[2][m]), 1)
        d3[rows, ys[m]] -= 1
        d3 /= xs.shape[1]
        d2 = (d3 @ w[2][m]) * (z2 > 0)
        d1 = (d2 @ w[1][m]) * (z1 > 0)
        for k, g in (("1.weight", d1.t() @ h0), ("1.bias", d1.sum(0)), ("3.weight", d2.t() @ a1),
                     ("3.bias", d2.sum(0)), ("5.weight", d3.t() @ a2), ("5.bias", d3.sum(0))):
            out[k].append(g)
    return {k: params[k] - lr * torch.stack(g) for k, g in out.items()}


LEARNER = {
    "stack_ensemble": stack_ensemble, "predict_each": predict_each, "predict_all": predict_all,
    "per_sample_grads_loop": psg_loop, "per_sample_grads": psg_vmap, "opacus_per_sample_grads": psg_opacus,
    "dp_sgd_step": dp_sgd, "ensemble_sgd_step": ens_step, "ens_step_loop": ens_step_loop, "member_kl": member_kl,
    "member_kl_planted": member_kl_planted, "member_kl_hidden": member_kl_hidden,
    "predict_all_dropout": predict_dropout,
    "dropout_same": lambda *a: predict_dropout(*a, randomness="same"),
    "dropout_eval": lambda params, buffers, base, x: predict_dropout(params, buffers, base.eval(), x),
    "ens_step_in_place": lambda params, *a: {k: params[k].copy_(v) for k, v in ens_step(params, *a).items()},
    # wrong structure: loops, dressed or not
    "loop_each": loop_each, "loop_all": loop_all, "token_vmap_each": token_vmap_each, "each_by_hand": each_by_hand,
    "psg_as_loop": psg_loop, "psg_sleepy_loop": psg_sleepy_loop, "ens_step_by_hand": ens_step_by_hand,
    # side effects the judge sees only because the check asked
    "stack_moves_models": lambda models: (*stack_module_state(models), models[0].to("meta")),
    "stack_real_base": lambda models: (*stack_module_state(models), copy.deepcopy(models[0])),
    # red team, 2026-12-01: the last model moved in place, then dropped from the caller's list (the
    # list came back shorter, and the moved model went unseen)
    "stack_pops_moved": lambda models: (*stack_module_state(models), models[-1].to("meta"), models.pop())[:3],
    "dropout_fixed_masks": dropout_fixed_masks,
    "dropout_loop": dropout_loop, "dropout_by_hand_loop": dropout_by_hand_loop,
    "dropout_torchscript_loop": dropout_torchscript_loop, "dropout_mostly_shared": dropout_mostly_shared,
    "numpy_each": numpy_each, "numpy_all": numpy_all, "numpy_dropout": numpy_dropout,
    "numpy_sgd_step": numpy_sgd_step, "numpy_per_sample_grads": numpy_per_sample_grads,
    "dropout_kept_masks": dropout_kept_masks(roll=False), "dropout_masks_handed_round": dropout_kept_masks(roll=True),
    # right where the values are checked, wrong only where the clock times it
    "dropout_eval_when_timed": dropout_only_small(lambda p, b, base, x: predict_dropout(p, b, base.eval(), x)),
    "dropout_same_when_timed": dropout_only_small(lambda *a: predict_dropout(*a, randomness="same")),
    "dp_sgd_in_place": lambda *a, **k: dp_sgd(*a, **k, in_place=True),
    "dp_sgd_global_rng": lambda *a, **k: dp_sgd(*a, **k, draw=False),
    "psg_memo_loop": lambda model, x, y: memoised(psg_loop)(model, x, y),
    "psg_fast_garbage": lambda model, x, y: psg_vmap(model, x, y) if len(x) < 100 else {
        k: torch.zeros(len(x), *p.shape) for k, p in model.named_parameters()},
    "psg_zeroes_x": lambda model, x, y: (x.zero_(), psg_vmap(model, x, y))[1],
}


@pytest.fixture
def learner():
    yield from served(LEARNER)


def test_right_answers_pass_every_served_check(learner, capsys):
    """Every check passes, or (those read by the judge's clock) a busy machine leaves it undecided:
    never a decided miss. Each check's line names the grader's clock once per clock it read (the
    ensemble predictions read two), none a count of ops."""
    checks = [  # (check, how many clocks its line names)
        (lambda: check_stack_ensemble(learner("stack_ensemble")), 0),
        (lambda: check_ensemble_predict(learner("predict_each"), learner("predict_all")), 2),
        (lambda: check_per_sample_grads_loop(learner("per_sample_grads_loop")), 0),
        (lambda: check_per_sample_grads(learner("per_sample_grads")), 1),
        (lambda: check_opacus_grads(learner("opacus_per_sample_grads")), 1),
        (lambda: check_dp_sgd_step(learner("dp_sgd_step")), 0),
        (lambda: check_ensemble_sgd_step(learner("ensemble_sgd_step")), 1),
        (lambda: check_member_kl(learner("member_kl")), 0),
        (lambda: check_predict_dropout(learner("predict_all_dropout")), 1),
    ]
    results = [never_failed(check) for check, _ in checks]
    passed = [clocks for (_, clocks), r in zip(checks, results) if r is not UNDECIDED]
    assert all(r is not UNDECIDED for (_, clocks), r in zip(checks, results) if not clocks)  # no clock, no doubt
    out = capsys.readouterr().out
    assert out.count("ok:") == len(passed), out
    assert out.count("the grader's clock") == sum(passed) and "ops for" not in out, out


def test_the_hidden_tests_of_a_cell_read_its_clock_once_on_members_built_once(learner, monkeypatch):
    """A cell's hidden tests check its answer on other seeds, sizes, rates and dropout probabilities;
    the clock is the judge's yardstick, not the case's: it reads each learner function once (the
    Remote keeps the reading), on members built once per judge. Built per case, a lesson-6 grade
    built 4,096 members seven times and ran three more clocks: 15 of its 55 s."""
    import course.timing as T
    from course.checks import vmap as CV
    from course.grading import SpeedUndecided

    timed, real, real_members = [], T.best_times, CV._clock_members
    monkeypatch.setattr(T, "best_times", lambda *a, **k: timed.append(1) or real(*a, **k))
    built = []
    monkeypatch.setattr(CV, "_clock_members", lambda *a: built.append(a) or real_members(*a))
    CV._clock_state.cache_clear()
    each, every, dropout, step = (learner(n) for n in ("predict_each", "predict_all", "predict_all_dropout",
                                                        "ensemble_sgd_step"))
    cells = [  # the solution notebook's test cells: the visible call, then the hidden ones
        [lambda: check_ensemble_predict(each, every),
         lambda: check_ensemble_predict(each, every, seed=4, n=6, batch=6, features=9, hidden=11, classes=3),
         lambda: check_ensemble_predict(each, every, seed=8, n=2, batch=1)],
        [lambda: check_predict_dropout(dropout),
         lambda: check_predict_dropout(dropout, seed=7, n=3, batch=24, features=9, hidden=12, p=0.3)],
        [lambda: check_ensemble_sgd_step(step),
         lambda: check_ensemble_sgd_step(step, seed=5, n=3, batch=4, features=9, hidden=7, classes=3, lr=0.05),
         lambda: check_ensemble_sgd_step(step, seed=9, n=1, batch=2)],
    ]
    for calls in cells:
        before = None
        for run in calls:
            try:
                run()
            except SpeedUndecided:  # the reading stands for the hidden tests too: undecided, as it was
                pass
            if before is None:
                before = len(timed)
                assert before > 0
        assert len(timed) == before, "a hidden test of the cell read the clock again"
    assert len(built) == 1  # dropout's members: built once, for the one reading
    assert CV._clock_state.cache_info().misses == 2  # the prediction and SGD clocks' stacked state: drawn once


@pytest.mark.parametrize("each, every, message", [
    ("loop_each", "predict_all", loop_named("model", "predict_each took .*")),
    ("token_vmap_each", "predict_all", loop_named("model", "predict_each took .*")),
    ("predict_each", "loop_all", loop_named("model", "predict_all took .*")),
    ("dropout_loop", None, loop_named("model", "predict_all_dropout took .*")),
])
def test_an_ensemble_loop_fails_by_the_judges_clock(learner, each, every, message):
    """A loop over the members, even one that draws each member's dropout mask in turn (its values are
    right: until grader version 40 predict_all_dropout had no clock, and it passed)."""
    with pytest.raises(AssertionError, match=message):
        if every is None:
            check_predict_dropout(learner(each))
        else:
            check_ensemble_predict(learner(each), learner(every))


@pytest.mark.parametrize("check, names, label", [
    # under the general bar of a third the step passed (0.19-0.31 of the course's loop, which runs modules
    # and autograd; red team, 2026-12-01); right answers read 0.017-0.028, and the step's bar is a tenth
    (check_ensemble_sgd_step, ("ens_step_by_hand",), "ensemble_sgd_step took"),
    (check_ensemble_predict, ("each_by_hand", "predict_all"), "predict_each took"),  # read 0.71; right: 0.09
    # against a course loop that sliced each member's model these read 0.16-0.32 and passed (red team,
    # 2026-12-01); against the prediction clock's loop about 0.5; right answers about 0.1
    (check_predict_dropout, ("dropout_by_hand_loop",), "predict_all_dropout took"),
    (check_predict_dropout, ("dropout_torchscript_loop",), "predict_all_dropout took"),
    # loops in NumPy (about 1 us an op): 0.13-0.17 of the course's loops, and they passed every clock of
    # grader version 40 (red team, round 11); with the state kept and 4,096 members, 0.09-0.15
    (check_predict_dropout, ("numpy_dropout",), "predict_all_dropout took"),
])
def test_a_loop_written_by_hand_model_by_model_never_passes_the_clock(learner, check, names, label):
    from course.grading import SpeedUndecided

    with pytest.raises((AssertionError, SpeedUndecided)) as caught:
        check(*map(learner, names))
    assert label in str(caught.value), caught.value  # the clock refused it, not the numerics


@pytest.mark.parametrize("check, names, label", [
    # against the course's loops of module calls these read 0.09-0.16: undecided (graded twice), never a pass
    # (grader version 44); timed as blocks against the leanest loops (version 45), 0.99-1.7
    (check_ensemble_predict, ("numpy_each", "predict_all"), "predict_each took"),
    (check_ensemble_predict, ("predict_each", "numpy_all"), "predict_all took"),
    (check_ensemble_sgd_step, ("numpy_sgd_step",), "ensemble_sgd_step took"),
    (check_per_sample_grads, ("numpy_per_sample_grads",), "per_sample_grads took"),
    (check_opacus_grads, ("numpy_per_sample_grads",), "opacus_per_sample_grads took"),
])
def test_a_numpy_loop_never_passes_the_clocks_timed_as_blocks_and_reads_far_above_the_bar(learner, check, names,
                                                                                          label):
    """The prediction, SGD and per-sample clocks time blocks (a seed in, checksums out) against the
    leanest loops we know: a loop in NumPy, as lean as the red team's, reads about 1 (0.99-1.7 in a
    fresh judge: failed outright). Here the judge is the test process, whose heap holds the whole
    suite's tensors, and a NumPy loop runs slower beside many live tensors (the yardstick read 0.7 so):
    never a pass, and at least one and a half times the bar."""
    from course.checks.vmap import BLOCK_NO_LOOP
    from course.grading import SpeedUndecided

    with pytest.raises((AssertionError, SpeedUndecided)) as caught:
        check(*map(learner, names))
    assert label in str(caught.value), caught.value
    assert clock_ratio(str(caught.value)) >= 1.5 * BLOCK_NO_LOOP, caught.value


@pytest.mark.parametrize("check, name, message", [
    (check_per_sample_grads, "psg_as_loop", loop_named("sample")),
    (check_per_sample_grads, "psg_sleepy_loop", loop_named("sample")),
    (check_opacus_grads, "psg_as_loop", loop_named("sample")),
    (check_per_sample_grads, "psg_memo_loop", loop_named("sample")),
    (check_per_sample_grads, "psg_fast_garbage", "timed beside the course's loop"),
    (check_stack_ensemble, "stack_moves_models", "changed models\\[0\\]"),
    (check_stack_ensemble, "stack_real_base", "base holds real tensors"),
    (check_dp_sgd_step, "dp_sgd_in_place", "changed its input params"),
    (check_dp_sgd_step, "dp_sgd_global_rng", "did not draw from `generator`"),
    (check_ensemble_sgd_step, "ens_step_loop", loop_named("member")),
    (check_ensemble_sgd_step, "ens_step_in_place", "changed its input params"),
    (check_member_kl, "member_kl_planted", "vmap ran aten::kl_div member by member"),
    (check_predict_dropout, "dropout_same", "every member dropped the same units"),
    (check_predict_dropout, "dropout_eval", "no unit was dropped"),
    (check_stack_ensemble, "stack_pops_moved", "changed the list of models it was given: it held 4, it now holds 3"),
    (check_predict_dropout, "dropout_fixed_masks", "a second call on the same inputs dropped exactly the same units"),
    (check_predict_dropout, "dropout_eval_when_timed", "while timed beside the course's loop: member 0's output on "
                                                       "row 0 is not its own output with any dropout mask"),
    (check_predict_dropout, "dropout_same_when_timed", "while timed beside the course's loop: the members' masks "
                                                       "agree on 100% of the units"),
    (check_predict_dropout, "dropout_mostly_shared", "dropped the same units more often than chance"),
    (check_predict_dropout, "dropout_kept_masks", "a second call on the same inputs gave member 0 .* of the same mask"),
    (check_predict_dropout, "dropout_masks_handed_round", "while timed beside the course's loop: .* of the members' "
                                                          "masks were masks of the previous call"),
])
def test_wrong_answers_across_the_boundary_fail_with_their_cause(learner, check, name, message):
    with pytest.raises(AssertionError, match=message):
        check(learner(name))


def test_only_a_check_that_asks_sees_what_a_function_did_to_its_inputs(learner):
    """Mirroring is opt-in: a function that zeroes its input gets no say over the judge's copy,
    where a check computes its reference."""
    x = torch.randn(4, 1, 8, 8)
    before = x.clone()
    model = small_cnn(seed=0, channels=(3, 4), size=8, classes=5)
    learner("psg_zeroes_x")(model, x, torch.tensor([0, 1, 2, 3]))
    assert torch.equal(x, before)
    with remote.mirrored(fn := learner("psg_zeroes_x")):
        fn(model, x, torch.tensor([0, 1, 2, 3]))
    assert not x.any()


def test_the_speed_checks_time_the_answer_across_the_boundary_against_the_courses_loop(learner, capsys):
    # many small members: vmap's loop for kl_div pays per member, the repair once (the lesson's CPU sizes)
    sizes = dict(n=256, batch=8, features=32, hidden=32, num_threads=1, rounds=5, min_run_time=0.05)
    # (the lesson's bar is 1.5x, and the repair measured about 2.1x in the learner's own process; across the
    # boundary, on a busy machine, the margin is thinner: this test is about the boundary, test_checks_vmap
    # about the bar)
    never_failed(lambda: check_member_kl_speed(learner("member_kl"), bars={"cpu": 1.3}, **sizes))
    with pytest.raises(AssertionError, match="the bar on this device is 1.50x"):
        check_member_kl_speed(learner("member_kl_planted"), bars={"cpu": 1.5}, attempts=1, **sizes)
    # hidden from the probe (the warning switched off), the planted op still misses the bar: the clock decides
    check_member_kl(learner("member_kl_hidden"))
    with pytest.raises(AssertionError, match="the bar on this device is 1.50x"):
        check_member_kl_speed(learner("member_kl_hidden"), bars={"cpu": 1.5}, attempts=1, **sizes)


def test_lesson_6_routes_every_graded_cell_to_the_judge():
    program = prog.instructor_program("06_vmap_ensembles",
                                      ROOT / "solutions/06_vmap_ensembles/06_vmap_ensembles.ipynb")
    assert program.graded and all(c.served for c in program.graded), [c.grade_id for c in program.graded if not c.served]
    assert set(SERVED) >= {"check_member_kl", "check_member_kl_speed", "check_predict_dropout", "check_dp_sgd_step",
                           "check_ensemble_sgd_step"}
    setup = "\n".join(program.judge_setup)
    assert "from course.checks.vmap import" in setup and "S = course.sizes(" in setup

"""Lesson 6's references, the grader's alone (see :mod:`course.references`): the loops over an
ensemble's members (exercises 2, 3 and 5), the loop of single-sample backward passes (exercise 6,
and the yardstick of exercises 7 and 8), the DP-SGD step (exercise 9), and what the usual slips in
exercises 3 and 9 compute (they hold the answer's formula too). Under the grader they also time
the loops the judge's clock compares a learner's function with.

In a learner's copy the visible checks use the answers stored for their own calls
(``course/reference_data/06_vmap.pt``); exercise 4's check needs none (it reads every member's
dropout mask back from the learner's own output)."""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from course.guard import reference

__all__ = ["DATA_FILES", "EPS", "dp_clip_mistakes", "dp_sgd_reference", "kl_mistakes", "loop_member_kl",
           "loop_predictions", "loop_sgd_step", "per_sample_grads_loop", "per_sample_norms", "predictions_loop",
           "reference_per_sample_grads", "sgd_step_loop", "vmap_data"]

#: Added to every norm before dividing by it, as Opacus does, so that a zero gradient is no problem.
EPS = 1e-6


# -- ensembles -----------------------------------------------------------------------------------

@reference
def loop_predictions(models, x: torch.Tensor, *, same_minibatch: bool) -> torch.Tensor:
    """The baseline: each model on its own minibatch ``x[i]``, or every model on ``x``."""
    if same_minibatch:
        return torch.stack([m(x) for m in models])
    return torch.stack([m(xi) for m, xi in zip(models, x)])


@reference
def loop_member_kl(models, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The reference: member ``i``'s ``KL(target || member)`` on ``x``, averaged over the
    minibatch, model by model (``xlogy``: a target of 0 adds 0)."""
    terms = torch.xlogy(target, target)
    return torch.stack([(terms - target * F.log_softmax(m(x), dim=-1)).sum(-1).mean() for m in models])


@reference
def kl_mistakes(models, x: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the usual slips in exercise 3 compute from every member's outputs on ``x``, to name the
    one a wrong answer matches."""
    with torch.no_grad():
        logits = torch.stack([m(x) for m in models])
    log_q = F.log_softmax(logits, dim=-1)
    per_row = (torch.xlogy(target, target) - target * log_q).sum(-1)  # (N, batch)
    classes = target.shape[-1]
    return {
        "it was averaged over the classes too (F.kl_div's reduction='mean' divides by every element, batch x "
        "classes): a KL divergence sums over the classes, then this one averages over the minibatch "
        "(reduction='batchmean')": per_row.mean(-1) / classes,
        "it was summed over the minibatch: average over it (reduction='batchmean')": per_row.sum(-1),
        "the members' raw outputs (logits) stood where log-probabilities belong: log_softmax them first":
            (torch.xlogy(target, target) - target * logits).sum(-1).mean(-1),
        "the divergence runs the other way round, KL(member || target): the lesson's is KL(target || member), "
        "sum over classes of target * (log target - log member)":
            (log_q.exp() * (log_q - target.log())).sum(-1).mean(-1),
        "it is one number for the whole ensemble, repeated: each member gets its own divergence":
            per_row.mean().expand(logits.shape[0]),
    }


@reference
def loop_sgd_step(models, xs: torch.Tensor, ys: torch.Tensor, lr: float) -> dict[str, torch.Tensor]:
    """The baseline: model ``i`` takes one SGD step on its own minibatch's mean cross-entropy,
    ``cross_entropy(models[i](xs[i]), ys[i])``; the new parameters stacked, ``{name: (n, *shape)}``."""
    rows = []
    for model, x, y in zip(models, xs, ys):
        names, params = zip(*model.named_parameters())
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), params)
        rows.append({k: (p - lr * g).detach() for k, p, g in zip(names, params, grads)})
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


# -- per-sample gradients ------------------------------------------------------------------------

@reference
def reference_per_sample_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The trusted baseline: one backward pass per sample (cross-entropy of that sample alone),
    gradients stacked into ``{name: (batch, *param.shape)}``."""
    names, params = zip(*[(k, p) for k, p in model.named_parameters()])
    per_sample = [torch.autograd.grad(F.cross_entropy(model(xi[None]), yi[None]), params)
                  for xi, yi in zip(x, y)]
    return {k: torch.stack(g) for k, g in zip(names, zip(*per_sample))}


# -- the clocks' yardsticks ----------------------------------------------------------------------
# The judge's clocks (course.checks.vmap) time a learner's function against the leanest loop we know
# over the same work: NumPy on each member's (or sample's) few numbers, a handful of calls a step,
# everything that is not the step's own work done once for all (each layer's bias folded into its
# matrix, acting on rows that end in a 1; the standardisation done for every row at once; the updates
# written after the loop). Against it a loop of the learner's reads about 1 and fails outright, while
# a batched answer reads a small fraction; the course's loops of module calls cost several times as
# much, and left NumPy loops undecided. They take the lesson's small MLP (Standardize, Linear, ReLU,
# Linear, ReLU, Linear: ``course.vmap.mlp``) as stacked state or as a module.

_LAYERS = ("1", "3", "5")


def _augmented(params: Mapping[str, torch.Tensor]) -> list:
    """Each layer as one matrix ``[W^T; b]`` (members, or nothing, in front), the hidden layers with a
    last column that carries the rows' 1 through: ``row @ A`` is the layer's output, and a 1."""
    import numpy as np

    mats = []
    for k, layer in enumerate(_LAYERS):
        w, b = params[f"{layer}.weight"].detach().numpy(), params[f"{layer}.bias"].detach().numpy()
        carry = k < len(_LAYERS) - 1
        a = np.zeros(w.shape[:-2] + (w.shape[-1] + 1, w.shape[-2] + carry), w.dtype)
        a[..., :-1, :w.shape[-2]] = np.swapaxes(w, -1, -2)
        a[..., -1, :w.shape[-2]] = b
        if carry:
            a[..., -1, -1] = 1.0
        mats.append(a)
    return mats


def _rows(x: torch.Tensor, buffers: Mapping[str, torch.Tensor], members: bool) -> "np.ndarray":
    """``x`` standardised (each member's own buffers where ``members``), every row ending in a 1."""
    import numpy as np

    shift, scale = buffers["0.shift"].numpy(), buffers["0.scale"].numpy()
    if members and x.dim() == 3:
        shift, scale = shift[:, None, :], scale[:, None, :]
    z = (x.detach().numpy() - shift) / scale
    return np.concatenate([z, np.ones(z.shape[:-1] + (1,), z.dtype)], -1)


def _unaugmented(grads: list, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Gradients of the augmented matrices (stacked) as the parameters' own (the carried 1's column
    dropped), named as in ``params``."""
    out = {}
    for layer, g in zip(_LAYERS, grads):
        size = params[f"{layer}.weight"].shape[-2]
        w = torch.from_numpy(g[:, :-1, :size]).transpose(-1, -2)
        b = torch.from_numpy(g[:, -1, :size])
        out[f"{layer}.weight"], out[f"{layer}.bias"] = w, b
    return out


@reference
def predictions_loop(params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor], x: torch.Tensor, *,
                     same_minibatch: bool) -> torch.Tensor:
    """Every member's predictions on ``x`` (or on its own ``x[i]``), member by member in NumPy: five
    calls a member."""
    import numpy as np

    a1, a2, a3 = (list(a) for a in _augmented(params))
    shift, scale = buffers["0.shift"].numpy(), buffers["0.scale"].numpy()
    xs = x.detach().numpy()
    xs = (xs[None] if same_minibatch else xs) - shift[:, None, :]
    rows = list(np.concatenate([xs / scale[:, None, :], np.ones(xs.shape[:-1] + (1,), xs.dtype)], -1))
    return torch.from_numpy(np.stack([np.maximum(np.maximum(z @ m1, 0) @ m2, 0) @ m3
                                      for z, m1, m2, m3 in zip(rows, a1, a2, a3)]))


def _gradient_loop(rows, ys, mats, shared: bool) -> list:
    """The augmented matrices' gradients of each item's cross-entropy (an item: a member's minibatch,
    its mean, or one sample), item by item, by hand; ``shared``: one model for every item."""
    import numpy as np

    n = len(rows)
    scale = 1.0 / ys.shape[-1] if ys.ndim == 2 else 1.0  # a minibatch's mean
    onehot = np.eye(mats[2].shape[-1], dtype=rows.dtype)[ys] * scale
    grads = [np.empty((n,) + a.shape[-2:], rows.dtype) for a in mats]
    g1s, g2s, g3s = grads
    if shared:
        m1, m2, m3 = mats
        t2, t3 = m2.T.copy(), m3.T.copy()
        items = zip(rows, onehot, [m1] * n, [m2] * n, [m3] * n, [t2] * n, [t3] * n)
    else:
        items = zip(rows, onehot, *mats, *(list(np.swapaxes(a, -1, -2).copy()) for a in mats[1:]))
    for i, (z, y, m1, m2, m3, t2, t3) in enumerate(items):
        a1 = z @ m1
        h1 = np.maximum(a1, 0)
        a2 = h1 @ m2
        h2 = np.maximum(a2, 0)
        e = np.exp(h2 @ m3)
        d = e / (e.sum(-1, keepdims=True) / scale) - y
        g2 = (d @ t3) * (a2 > 0)
        g1 = (g2 @ t2) * (a1 > 0)
        if shared:
            g3s[i], g2s[i], g1s[i] = np.outer(h2, d), np.outer(h1, g2), np.outer(z, g1)
        else:
            g3s[i], g2s[i], g1s[i] = h2.T @ d, h1.T @ g2, z.T @ g1
    return grads


@reference
def sgd_step_loop(params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor], xs: torch.Tensor,
                  ys: torch.Tensor, lr: float) -> dict[str, torch.Tensor]:
    """Each member's SGD step on its own minibatch's mean cross-entropy, member by member in NumPy,
    the gradient by hand (about twenty calls a member; the updates after the loop, for all at once)."""
    grads = _unaugmented(_gradient_loop(_rows(xs, buffers, True), ys.numpy(), _augmented(params), shared=False),
                         params=params)
    return {k: params[k].detach() - lr * g for k, g in grads.items()}


@reference
def per_sample_grads_loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each sample's gradient of its own cross-entropy, sample by sample in NumPy, by hand (about
    twenty calls a sample)."""
    params = {k: p.detach()[None] for k, p in model.named_parameters()}
    mats = [a[0] for a in _augmented(params)]
    return _unaugmented(_gradient_loop(_rows(x, dict(model.named_buffers()), False), y.numpy(), mats, shared=True),
                        params=params)


# -- DP-SGD --------------------------------------------------------------------------------------

@reference
def per_sample_norms(grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The L2 norm of each sample's whole gradient (all parameters together): shape ``(batch,)``."""
    return torch.stack([g.reshape(g.shape[0], -1).norm(dim=1) for g in grads.values()]).norm(dim=0)


@reference
def dp_sgd_reference(params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor], *, lr: float,
                     max_norm: float, noise_multiplier: float, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One DP-SGD step, the lesson's conventions:

    1. clip: sample ``i``'s gradient (all parameters) is scaled by ``min(1, max_norm / (norm_i + 1e-6))``;
    2. sum the clipped gradients over the batch;
    3. noise: for each parameter *in the order of* ``params``, draw
       ``torch.randn(p.shape, generator=generator, device=p.device, dtype=p.dtype)`` and add it
       times ``noise_multiplier * max_norm``;
    4. average: divide by the batch size;
    5. update: ``p - lr * that``, as new tensors (the inputs are left alone).
    """
    norms = per_sample_norms(grads)
    factor = (max_norm / (norms + EPS)).clamp(max=1.0)
    batch = norms.shape[0]
    out = {}
    for name, p in params.items():
        clipped_sum = torch.tensordot(factor, grads[name], dims=1)
        noise = torch.randn(p.shape, generator=generator, device=p.device, dtype=p.dtype)
        out[name] = p - lr * (clipped_sum + noise_multiplier * max_norm * noise) / batch
    return out


@reference
def dp_clip_mistakes(params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor], *, lr: float,
                     max_norm: float) -> dict[str, dict[str, torch.Tensor]]:
    """What the usual slips in the clipping of a noise-free DP-SGD step give, to name the one a
    wrong answer matches."""
    batch = next(iter(grads.values())).shape[0]
    shape = lambda g: (-1,) + (1,) * (g.dim() - 1)  # noqa: E731 - broadcast a per-sample factor over g
    per_param = {k: g * (max_norm / (g.reshape(batch, -1).norm(dim=1) + EPS)).clamp(max=1.0).view(shape(g))
                 for k, g in grads.items()}
    norms = per_sample_norms(grads)
    scaled = {k: g * (max_norm / (norms + EPS)).view(shape(g)) for k, g in grads.items()}

    def unclipped(g):  # nothing clipped, no noise: a step on the mean of the gradients as given
        return dp_sgd_reference(params, g, lr=lr, max_norm=1e30, noise_multiplier=0.0,
                                generator=torch.Generator(device=next(iter(params.values())).device))

    return {"each parameter's gradient was clipped on its own (clip a sample's whole gradient, all parameters "
            "together)": unclipped(per_param),
            "every sample's gradient was scaled to max_norm, the small ones too (the factor is min(1, ...))":
            unclipped(scaled),
            "nothing was clipped": unclipped(grads)}


def vmap_data() -> dict:
    """Lesson 6's visible checks at their own calls (seed 0, default sizes): every answer they
    compare with, and what the slips they name give."""
    from course.checks.vmap import reference_data

    return reference_data()


#: Written by ``python -m course.references``.
DATA_FILES = {"06_vmap.pt": vmap_data}

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
           "loop_predictions", "loop_sgd_step", "per_sample_norms", "reference_per_sample_grads", "vmap_data"]

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

"""The course's fast solutions that failed speed checks are compared with (the profile of one call
of each, against the learner's: :mod:`course.checks.why_slow`). They answer exercises of lessons 3
to 9, so they are the grader's alone (see :mod:`course.references`); a check names them by string
(``"course.references.explain.segment_sum"``), and where this folder is absent (the learners'
bundle) a failed check simply gives no profile."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import functional_call, jacfwd, vmap

__all__ = ["attention", "coord_conv", "gradient_penalty", "jacobian_fwd", "jagged_token_mlp", "member_kl",
           "sdpa_attention", "sq_dists_identity", "segment_sum"]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def coord_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    from course.memory_format import coordinate_planes

    ys, xs = coordinate_planes(x)
    fmt = torch.channels_last if x.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
    planes = torch.cat([ys, xs], dim=1).contiguous(memory_format=fmt)
    return F.conv2d(torch.cat([x, planes], dim=1), weight, bias)


def sq_dists_identity(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ((a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2 * a @ b.T).clamp_min(0)


def segment_sum(values: torch.Tensor, index: torch.Tensor, num_segments: int) -> torch.Tensor:
    return values.new_zeros((num_segments, *values.shape[1:])).index_add_(0, index, values)


def gradient_penalty(model, x: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_()
    g, = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    return ((g.flatten(1).norm(dim=1) - 1) ** 2).mean()


def jacobian_fwd(f, x: torch.Tensor) -> torch.Tensor:
    return jacfwd(f)(x)


def member_kl(params, buffers, base, x, target):
    def one(p, b):
        log_q = F.log_softmax(functional_call(base, (p, b), (x,)), dim=-1)
        return (torch.xlogy(target, target) - target * log_q).sum(-1).mean()

    return vmap(one)(params, buffers)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
                   is_causal: bool = False) -> torch.Tensor:
    if key_padding_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    attend = ~key_padding_mask[:, None, None, :]
    if is_causal:
        attend = attend & torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attend)


def jagged_token_mlp(x: torch.Tensor, key_padding_mask: torch.Tensor, mlp) -> torch.Tensor:
    keep = ~key_padding_mask
    offsets = torch.cat([keep.new_zeros(1, dtype=torch.long), keep.sum(1).cumsum(0)])
    y = mlp(torch.nested.nested_tensor_from_jagged(x[keep], offsets)).values()
    out = x.new_zeros(*x.shape[:-1], y.shape[-1])
    out[keep] = y
    return out

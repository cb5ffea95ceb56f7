"""Lesson 9's masked attention: a float64 reference and the naive baseline of its speed check. They
answer the lesson's first exercise, so they are the grader's alone (see :mod:`course.references`)."""

from __future__ import annotations

import math

import torch

from course.fastpath import causal_mask
from course.guard import reference

__all__ = ["jagged_loop", "naive_masked_attention", "reference_attention"]


@reference
def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                        key_padding_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d) + masks) v`` in float64, the whole score matrix materialised.
    ``attn_mask``: boolean (``True`` = attend) or additive, broadcastable to ``(B, H, Lq, Lk)``;
    ``key_padding_mask``: ``(B, Lk)``, ``True`` = ignore that key; ``is_causal``: top-left aligned."""
    q, k, v = (t.double() for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask.double())
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask.bool()[:, None, None, :], float("-inf"))
    if is_causal:
        scores = scores.masked_fill(~causal_mask(*scores.shape[-2:], device=scores.device), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@reference(in_cells=False)
def naive_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor,
                           is_causal: bool = False) -> torch.Tensor:
    """The baseline of the speed check: the whole ``(B, H, L, L)`` score matrix, padded keys and (if
    ``is_causal``) later keys filled with -inf, softmax, times ``v``; in the inputs' dtype."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    hide = key_padding_mask[:, None, None, :]
    if is_causal:
        hide = hide | ~causal_mask(*scores.shape[-2:], device=q.device)
    return torch.softmax(scores.masked_fill(hide, float("-inf")), dim=-1) @ v


@reference(in_cells=False)
def jagged_loop(x: torch.Tensor, key_padding_mask: torch.Tensor, mlp: torch.nn.Module) -> torch.Tensor:
    """The yardstick of the token MLP's clock: the leanest loop over the sequences we know, the MLP
    once per sequence on its real tokens, written into zeros (what a jagged answer does in one call)."""
    out = torch.zeros_like(x)
    for i, n in enumerate((~key_padding_mask).sum(1).tolist()):
        out[i, :n] = mlp(x[i, :n])
    return out

"""How an answer called ``F.scaled_dot_product_attention``: the watcher lessons 8 and 9 share.

Two records of one call, kept side by side: a ``TorchFunctionMode`` (:class:`SDPACalls`) sees the
arguments (the mask's dtype, ``is_causal``, the shapes of query, key and value) and what the call
returned; the dispatcher (:class:`course.checks.witnesses.DispatcherOps`) counts the SDPA ops that
ran, also those the mode could not see (a call made inside another torch function's arguments runs
where the mode is off the stack). :func:`watched` runs an answer under both and says, per call,
whether the answer returned exactly what that call returned: an SDPA call on a slice, or beside a
result computed another way, is not the answer's.

These run where the answer runs: in the learner's process (its word), and again in the program host
on the program the judge read (:func:`course.hand.again`), where nothing can blind them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from course.checks.common import call
from course.checks.witnesses import DispatcherOps

__all__ = ["BOTH", "SDPACalls", "every_sdpa_call", "watched"]

#: Why an ``attn_mask`` beside ``is_causal=True`` is refused before the call (``{label}``: the answer).
BOTH = ("{label} passed SDPA both an attn_mask and is_causal=True. PyTorch 2.4 to 2.13 combine them; 2.14 and later "
        "raise 'Explicit attn_mask should not be set when is_causal=True'. Fold the causal mask into the boolean mask "
        "yourself, and pass is_causal=False.")

_SDPA_OP = "aten::scaled_dot_product_attention"


class SDPACalls(TorchFunctionMode):
    """Notes how ``F.scaled_dot_product_attention`` was called: whether with an ``attn_mask`` (and
    its dtype) and ``is_causal``, the shapes of query, key and value, and (``outputs``) what it
    returned. ``label`` names the answer in the message about a mask beside ``is_causal``."""

    def __init__(self, label: str = "your function"):
        super().__init__()
        self.label = label
        self.calls: list[dict] = []
        self.outputs: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention or getattr(func, "__name__", "") == "scaled_dot_product_attention":
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
            qkv = [kwargs.get(n, args[i] if len(args) > i else None) for i, n in enumerate(("query", "key", "value"))]
            self.calls.append(dict(mask=None if mask is None else str(getattr(mask, "dtype", type(mask).__name__))
                                   .replace("torch.", ""),
                                   causal=bool(causal), shapes=[list(getattr(t, "shape", ())) for t in qkv]))
            if mask is not None and causal:  # before the call: some releases raise, others run it
                raise AssertionError(BOTH.format(label=self.label))
            out = func(*args, **kwargs)
            self.outputs.append(out)
            return out
        return func(*args, **kwargs)


def every_sdpa_call(calls: SDPACalls, ops: DispatcherOps, label: str) -> list[dict]:
    """The SDPA calls the mode saw, and one ``{"mask": "unseen"}`` for each the dispatcher ran that it
    did not: code of the answer's that runs inside a torch function (a generator read there) runs where
    a ``TorchFunctionMode`` is off the stack, and the dispatcher's record is what counts."""
    if ops.blocked:
        raise AssertionError(f"{label} could not be watched: {ops.blocked}.")
    ran = ops.counts.get(_SDPA_OP, 0)
    return calls.calls + [{"mask": "unseen", "causal": None}] * max(0, ran - len(calls.calls))


def watched(fn: Callable, label: str, *args: Any, **kwargs: Any) -> tuple[Any, list[dict]]:
    """``fn(*args, **kwargs)`` once, watched: its result, and every SDPA call it made, each with
    ``result``: whether the answer is exactly what that call returned (NaN where NaN: rows that see
    no key are NaN on some releases)."""
    with DispatcherOps() as ops, SDPACalls(label) as calls:
        got = call(fn, *args, name=label, **kwargs)
    for seen, out in zip(calls.calls, calls.outputs):
        seen["result"] = bool(isinstance(got, torch.Tensor) and isinstance(out, torch.Tensor)
                              and got.shape == out.shape and got.dtype == out.dtype
                              and torch.allclose(got.detach(), out.detach(), rtol=0, atol=0, equal_nan=True))
    return got, every_sdpa_call(calls, ops, label)

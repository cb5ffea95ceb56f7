"""Lesson 4's shared pieces: a small model and a wide function to differentiate, functions that
allow only one mode of differentiation, and a chart of Jacobian times as the outputs grow.

None of this is an exercise. The one-mode functions exist so that a check can tell *how* a
Jacobian was computed: a function whose backward raises can only be differentiated in forward
mode, one whose ``jvp`` raises only in reverse mode. The wide function's Jacobian has a closed
form, so the grader's reference needs no autodiff at all; that reference answers an exercise, so it
lives with the grader's (``course.references.forward_ad.wide_jacobian``), not here.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Sequence

import torch
from torch import nn

from course.devices import pick_device
from course.remote import recipe


from course.quiet import load_forward_ad_quietly

load_forward_ad_quietly()  # the first forward-mode call would show TorchScript's deprecation (torch 2.14+)

__all__ = ["ForwardOnlyTanh", "ModeNotAllowed", "ReverseOnlyTanh", "WideFunction", "mlp",
           "plot_jacobian_sweep", "tall_jacobian_planted", "transform_in_use", "unwrapped", "watching",
           "wide_function"]


class ModeNotAllowed(RuntimeError):
    """Raised when a one-mode function is differentiated in the other mode."""


#: The differentiation rules of the tanh functions below that ran, in order (``"forward"``: a ``jvp``;
#: ``"reverse"``: a ``backward``), refused ones included: the checks clear it before a call and read
#: it after. A one-mode function's refusal is recorded before it raises, so an answer that catches
#: the error and tries the other mode is still seen to have tried (red team, 2026-12-01).
RULES_RAN: list[str] = []

#: While a check watches (:func:`watching`), what reached each rule above: ``(mode, values)``, the
#: tangents (``"forward"``) or cotangents (``"reverse"``) as a float64 matrix, one row per vector (a
#: vmapped rule's batch unwrapped). A Jacobian by forward mode pushes ``k`` independent tangents through
#: ``f``, one by reverse mode ``m`` cotangents: a Jacobian computed another way (finite differences, a
#: closed form from ``f``'s weights) beside one token transform with zero or a single tangent is seen
#: here to span too few directions (red team, 2026-12-05).
TANGENTS_SEEN: list[tuple[str, torch.Tensor | None]] = []
_WATCHING: list[bool] = [False]


@contextlib.contextmanager
def watching():
    """Note in :data:`TANGENTS_SEEN` what reaches the rules while the block runs (cleared first). Off
    otherwise, so that timed calls keep nothing."""
    del TANGENTS_SEEN[:]
    _WATCHING[0] = True
    try:
        yield TANGENTS_SEEN
    finally:
        _WATCHING[0] = False


def unwrapped(t: torch.Tensor) -> torch.Tensor | None:
    """The plain values of a tensor seen inside transforms, batch dimensions first: the wrappers of
    ``torch.func``'s transforms and of the legacy vmap (``torch.autograd.functional``'s
    ``vectorize=True``) taken off, detached. None if they cannot be read. It reads PyTorch internals
    (``torch._C._functorch``), pinned by the course's tests, because no public call tells."""
    functorch = torch._C._functorch
    try:
        for _ in range(64):
            if functorch.is_batchedtensor(t):
                bdim = functorch.maybe_get_bdim(t)
                t = functorch.get_unwrapped(t)
                t = t.movedim(bdim, 0) if bdim >= 0 else t
            elif functorch.is_functorch_wrapped_tensor(t):
                t = functorch.get_unwrapped(t)
            elif getattr(functorch, "is_legacy_batchedtensor", lambda t: False)(t):
                level = torch._C._vmapmode_increment_nesting() - 1
                torch._C._vmapmode_decrement_nesting()
                while functorch.is_legacy_batchedtensor(t) and level > 0:
                    t = torch._remove_batch_dim(t, level, 1, 0)
                    level -= 1
                if functorch.is_legacy_batchedtensor(t):
                    return None
            else:
                return t.detach()
    except (RuntimeError, ValueError, TypeError):
        return None
    return None


def _values(t: torch.Tensor) -> torch.Tensor | None:
    """What reached a rule, as float64 rows of its last dimension (None if it cannot be read)."""
    t = unwrapped(t)
    return None if t is None else t.reshape(-1, t.shape[-1] if t.dim() else 1).to("cpu", torch.float64)


def _note(mode: str, t: torch.Tensor) -> None:
    RULES_RAN.append(mode)
    if _WATCHING[0]:
        TANGENTS_SEEN.append((mode, _values(t)))


class _Tanh(torch.autograd.Function):
    """``tanh``, its output saved for both rules; each subclass says which rules it allows. A rule
    that runs is noted in :data:`RULES_RAN` first (a refusal too, before it raises)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return torch.tanh(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def backward(ctx, grad):
        _note("reverse", grad)
        y, = ctx.saved_tensors
        return grad * (1 - y * y)

    @staticmethod
    def jvp(ctx, tangent):
        _note("forward", tangent)
        y, = ctx.saved_tensors
        return tangent * (1 - y * y)


class WatchedTanh(_Tanh):
    """``tanh`` with both rules, each noted in :data:`RULES_RAN` when it runs: which mode a Jacobian used."""


class ForwardOnlyTanh(_Tanh):
    """``tanh`` with a forward-mode rule (``jvp``) and a backward that refuses to run."""

    @staticmethod
    def backward(ctx, grad):
        _note("reverse", grad)
        raise ModeNotAllowed("this function supports forward mode only: reverse mode (backward, vjp, "
                             "jacrev, autograd.grad) was used on it")


class ReverseOnlyTanh(_Tanh):
    """``tanh`` with a backward and a ``jvp`` that refuses to run."""

    @staticmethod
    def jvp(ctx, tangent):
        _note("forward", tangent)
        raise ModeNotAllowed("this function supports reverse mode only: forward mode (jvp, jacfwd, "
                             "dual numbers) was used on it")


_TANH = {"both": torch.tanh, "forward": ForwardOnlyTanh.apply, "reverse": ReverseOnlyTanh.apply,
         "watched": WatchedTanh.apply}


class WideFunction:
    """``f(x) = W2 @ tanh(W1 @ x + b1) + b2`` from R^k to R^m, with ``hidden`` units.

    ``mode`` picks which differentiation modes it allows: ``"both"``, ``"forward"`` or
    ``"reverse"``; ``"watched"`` allows both and notes which ran (:data:`RULES_RAN`). ``calls`` counts the Python calls (a vmapped Jacobian calls ``f`` once; a loop
    over basis vectors calls it once per vector)."""

    def __init__(self, k: int, m: int, hidden: int, *, seed: int, mode: str = "both",
                 dtype: torch.dtype = torch.float32, device=None):
        if mode not in _TANH:
            raise ValueError(f"mode must be one of {sorted(_TANH)}, got {mode!r}.")
        dev = pick_device(device)
        g = torch.Generator().manual_seed(seed)
        draw = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
        self.W1 = (draw(hidden, k) / math.sqrt(k)).to(dev, dtype)
        self.b1 = (0.1 * draw(hidden)).to(dev, dtype)
        self.W2 = (draw(m, hidden) / math.sqrt(hidden)).to(dev, dtype)
        self.b2 = (0.1 * draw(m)).to(dev, dtype)
        self.k, self.m, self.hidden, self.mode = k, m, hidden, mode
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if x.shape[-1:] != (self.k,):
            raise ValueError(f"this function takes a vector of {self.k} numbers, got shape {tuple(x.shape)}.")
        return self.W2 @ _TANH[self.mode](self.W1 @ x + self.b1) + self.b2

    def __repr__(self) -> str:
        return f"WideFunction(R^{self.k} -> R^{self.m}, hidden={self.hidden}, mode={self.mode!r})"


@recipe
def wide_function(k: int, m: int, hidden: int, *, seed: int, mode: str = "both", dtype: torch.dtype = torch.float32,
                  device=None) -> WideFunction:
    """A :class:`WideFunction` that crosses the grader's process boundary as how it was built (a
    check hands it to the learner's function, whose process builds the same one)."""
    return WideFunction(k, m, hidden, seed=seed, mode=mode, dtype=dtype, device=device)


def tall_jacobian_planted(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Exercise 6's planted slow block: the full Jacobian by the legacy
    ``torch.autograd.functional.jacobian``, called as most code calls it, with its defaults
    (``strategy="reverse-mode"``, ``vectorize=False``): one backward pass per output, in a
    Python loop. On a tall function (few inputs, many outputs) the wrong mode, unbatched."""
    return torch.autograd.functional.jacobian(f, x)


@recipe
def mlp(sizes: Sequence[int] = (6, 16, 16, 4), *, seed: int, norm: bool = True,
        dtype: torch.dtype = torch.float64, device=None) -> nn.Sequential:
    """A seeded MLP: Linear layers with tanh between them (and a LayerNorm after the first, with
    ``norm``). Smooth everywhere, so central finite differences are an honest reference."""
    if len(sizes) < 2:
        raise ValueError(f"mlp needs at least an input and an output size, got {tuple(sizes)}.")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.Tanh())
                if norm and i == 0:
                    layers.append(nn.LayerNorm(b))
        model = nn.Sequential(*layers)
        for m in model.modules():  # LayerNorm starts at weight 1, bias 0: make a mistake there visible
            if isinstance(m, nn.LayerNorm):
                with torch.no_grad():
                    m.weight.copy_(torch.rand(m.weight.shape) + 0.5)
                    m.bias.copy_(torch.randn(m.bias.shape) * 0.2)
    return model.to(pick_device(device), dtype)


def transform_in_use() -> str | None:
    """The innermost ``torch.func`` transform running right now (``"Jvp"``, ``"Grad"``,
    ``"Vmap"``...), or None outside any. It reads functorch's interpreter stack, an internal of
    PyTorch (pinned by the course's tests), because no public call tells."""
    top = torch._C._functorch.peek_interpreter_stack()
    return None if top is None else top.key().name


def plot_jacobian_sweep(ms: Sequence[int], forward_s: Sequence[float], reverse_s: Sequence[float], *, k: int,
                        ax=None, title: str | None = None):
    """Time of a full Jacobian by forward mode (k JVPs) and by reverse mode (m VJPs) against the
    number of outputs m, on log-log axes, with the line m = k where they should cross."""
    import matplotlib.pyplot as plt

    if not (len(ms) == len(forward_s) == len(reverse_s)):
        raise ValueError("ms, forward_s and reverse_s need one entry per output size.")
    if ax is None:
        _, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.loglog(ms, [t * 1e3 for t in forward_s], "o-", label=f"forward: {k} JVPs (vmapped)")
    ax.loglog(ms, [t * 1e3 for t in reverse_s], "s-", label="reverse: m VJPs (vmapped)")
    ax.axvline(k, color="gray", lw=1, ls="--")
    ax.annotate(f"m = k = {k}: equal work", (k, ax.get_ylim()[1]), xytext=(4, -14), textcoords="offset points", color="gray")
    ax.set(xlabel="number of outputs m", ylabel="time per Jacobian (ms)",
           title=title or f"Full Jacobian of R^{k} -> R^m")
    ax.legend()
    return ax

"""Lesson 5's helpers (Jacobians, Hessians, HVPs): the functions the lesson differentiates, a
watcher that counts ops and finds the largest tensor a call creates, and two pictures.

Their derivatives are worked out by hand, so that the checks compare the learner's autodiff
results with formulas evaluated in float64, not with another autodiff run; the formulas answer the
lesson's exercises, so they live with the grader (:mod:`course.references.jacobians`), not here,
where a learner's process builds these functions too:

- :class:`TanhLayer` ``y = tanh(W x + b)``: its Jacobian is ``diag(1 - y**2) @ W``
  (:func:`tanh_layer` draws a dense ``W``, :func:`banded_layer` a banded one whose Jacobian
  makes a telling heatmap);
- :class:`NormedLayer` ``y = tanh(BatchNorm1d(W x + b))`` (eval mode), a function of a batch that
  refuses a single sample, as ``nn.BatchNorm1d`` does: ``vmap`` cannot run it, the summation trick can;
- :class:`Energy`, a scalar ``f(x) = sum(softplus(A x + c)) + sum(d * cos(x)) + sum(x[:-1] * x[1:])``
  with ``A`` of only ``k`` rows: its Hessian ``A^T diag(s) A - diag(d cos x) + (ones beside the
  diagonal)`` is dense, yet a Hessian-vector product needs only vectors and ``k x n`` matrices.
  That gap (``n * n`` numbers against ``k * n``) is what the HVP exercise is about. Its gradient
  (``Energy.gradient``) is here: an input the lesson differentiates, not an answer.

:class:`TensorWatch` is a ``TorchDispatchMode``: it sees every ATen op that runs, below autograd
and below ``vmap`` (so it sees the real, batched tensors), which makes it a fair judge of two
questions a result cannot answer: "was there a Python loop?" (the op count grows with the loop)
and "was an ``n x n`` matrix built?" (the largest tensor says so). It works on the ``meta``
device too, where tensors have shapes but no memory: a check can ask what a learner's function
*would* allocate at a size that would not fit.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from course.data import randn
from course.devices import pick_device
from course.remote import recipe


from course.quiet import load_forward_ad_quietly

load_forward_ad_quietly()  # the first forward-mode call would show TorchScript's deprecation (torch 2.14+)

__all__ = ["Energy", "NormedLayer", "TanhLayer", "TensorWatch", "banded_layer", "energy", "format_bytes",
           "normed_layer", "plot_crossover", "plot_matrix", "tanh_layer", "watch"]


def _device(device) -> torch.device:
    """``meta`` is allowed here (shapes without memory); anything else goes through pick_device."""
    if device is not None and torch.device(device).type == "meta":
        return torch.device("meta")
    return pick_device(device)


class TanhLayer:
    """``y = tanh(W x + b)`` for a vector ``x`` of ``n_in`` values (``n_out`` outputs).

    A plain callable holding its weights: ``torch.func`` transforms differentiate it with
    respect to ``x`` only, as a function of one argument."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        self.weight, self.bias = weight, bias

    @property
    def n_out(self) -> int:
        return self.weight.shape[0]

    @property
    def n_in(self) -> int:
        return self.weight.shape[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.linear(x, self.weight, self.bias))

    def to(self, *args, **kwargs) -> "TanhLayer":
        return TanhLayer(self.weight.to(*args, **kwargs), self.bias.to(*args, **kwargs))

    def __repr__(self) -> str:
        return f"TanhLayer({self.n_out} outputs x {self.n_in} inputs, {self.weight.dtype}, {self.weight.device})"


class NormedLayer:
    """``y = tanh(BatchNorm1d(W x + b))`` with the normalisation in eval mode (its running statistics
    drawn, as a trained model holds them): a function of a **batch** ``(B, n_in)`` whose samples do
    not mix, which, like ``nn.BatchNorm1d`` itself, refuses a single sample (a 1-D input). So
    ``vmap``, which hands the function one sample at a time, cannot run it, and the summation
    trick can. Per sample, its Jacobian is ``diag(1 - y**2) diag(gamma / sqrt(var + eps)) W``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, norm: torch.nn.BatchNorm1d):
        self.weight, self.bias, self.norm = weight, bias, norm.eval()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(F.linear(x, self.weight, self.bias)))

    def to(self, *args, **kwargs) -> "NormedLayer":
        import copy

        return NormedLayer(self.weight.to(*args, **kwargs), self.bias.to(*args, **kwargs),
                           copy.deepcopy(self.norm).to(*args, **kwargs))

    def __repr__(self) -> str:
        n_out, n_in = self.weight.shape
        return (f"NormedLayer({n_out} outputs x {n_in} inputs, BatchNorm1d in eval mode, "
                f"{self.weight.dtype}, {self.weight.device})")


@recipe
def normed_layer(n_out: int, n_in: int, *, seed: int = 0, device=None, dtype: torch.dtype = torch.float32) -> NormedLayer:
    """A seeded :class:`NormedLayer`: a dense layer as :func:`tanh_layer` draws it, then a
    ``BatchNorm1d`` in eval mode with drawn scale, shift and running statistics."""
    dev = _device(device)
    layer = tanh_layer(n_out, n_in, seed=seed, device="cpu", dtype=torch.float64)
    norm = torch.nn.BatchNorm1d(n_out).double()
    with torch.no_grad():
        norm.weight.copy_(0.5 + torch.rand(n_out, generator=torch.Generator().manual_seed(seed + 2), dtype=torch.float64))
        norm.bias.copy_(0.3 * randn(n_out, seed=seed + 3, device="cpu", dtype=torch.float64))
        norm.running_mean.copy_(0.3 * randn(n_out, seed=seed + 4, device="cpu", dtype=torch.float64))
        norm.running_var.copy_(0.5 + torch.rand(n_out, generator=torch.Generator().manual_seed(seed + 5),
                                                dtype=torch.float64))
    return NormedLayer(layer.weight.to(dev, dtype), layer.bias.to(dev, dtype), norm.to(dev, dtype))


@recipe
def tanh_layer(n_out: int, n_in: int, *, seed: int = 0, device=None, dtype: torch.dtype = torch.float32) -> TanhLayer:
    """A seeded ``TanhLayer`` with a dense weight scaled by ``1/sqrt(n_in)`` (outputs of order 1)."""
    if n_out < 1 or n_in < 1:
        raise ValueError(f"a layer needs at least one output and one input, got {n_out} x {n_in}.")
    dev = _device(device)
    w = randn(n_out, n_in, seed=seed, device="cpu", dtype=torch.float64) / n_in ** 0.5
    b = randn(n_out, seed=seed + 1, device="cpu", dtype=torch.float64) * 0.5
    return TanhLayer(w.to(dev, dtype), b.to(dev, dtype))


@recipe
def banded_layer(n: int, *, width: int = 5, seed: int = 0, device=None, dtype: torch.dtype = torch.float32) -> TanhLayer:
    """A square ``TanhLayer`` whose output ``i`` reads only the inputs ``i - width//2 .. i + width//2``
    (a 1-D convolution written as a banded matrix): its Jacobian is banded."""
    w = tanh_layer(n, n, seed=seed, device="cpu", dtype=torch.float64).weight * n ** 0.5
    i = torch.arange(n)
    band = ((i[:, None] - i[None, :]).abs() <= width // 2).to(torch.float64)
    b = randn(n, seed=seed + 1, device="cpu", dtype=torch.float64) * 0.5
    dev = _device(device)
    return TanhLayer((w * band / width ** 0.5).to(dev, dtype), b.to(dev, dtype))


class Energy:
    """A scalar function of a vector ``x`` of ``n`` values::

        f(x) = sum(softplus(A x + c)) + sum(d * cos(x)) + sum(x[:-1] * x[1:])

    ``A`` has ``k`` rows (``k`` much smaller than ``n``). Its gradient is written out by hand below
    (torch ops, so it also runs on ``meta``); its Hessian and Hessian-vector product, the answers of
    the lesson's exercises, are the grader's (:mod:`course.references.jacobians`)."""

    def __init__(self, A: torch.Tensor, c: torch.Tensor, d: torch.Tensor):
        self.A, self.c, self.d = A, c, d

    @property
    def n(self) -> int:
        return self.A.shape[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.softplus(self.A @ x + self.c).sum() + (self.d * torch.cos(x)).sum() + (x[:-1] * x[1:]).sum()

    @staticmethod
    def _neighbours(v: torch.Tensor) -> torch.Tensor:
        """``T @ v`` for ``T`` with ones just above and below the diagonal."""
        out = torch.zeros_like(v)
        out[:-1] += v[1:]
        out[1:] += v[:-1]
        return out

    def gradient(self, x: torch.Tensor) -> torch.Tensor:  # not a reference: lesson 5 differentiates it
        """``A^T sigmoid(A x + c) - d sin(x) + T x`` (a function of ``x`` you can differentiate too)."""
        return self.A.T @ torch.sigmoid(self.A @ x + self.c) - self.d * torch.sin(x) + self._neighbours(x)

    def to(self, *args, **kwargs) -> "Energy":
        return Energy(self.A.to(*args, **kwargs), self.c.to(*args, **kwargs), self.d.to(*args, **kwargs))

    def __repr__(self) -> str:
        return f"Energy(n={self.n}, k={self.A.shape[0]}, {self.A.dtype}, {self.A.device})"


#: How each evaluation of a :class:`WatchedEnergy` was differentiated, outermost first: "forward"
#: (a ``torch.func.jvp`` level, or a forward-AD dual) and "reverse" (a ``grad`` or ``vjp`` level, or
#: autograd); ``vmap`` levels are left out. A plain ``torch.autograd.grad`` taken again through the
#: gradient appends ``["reverse", "reverse"]`` when its second pass runs. Cleared by the check that
#: reads it (:func:`course.checks.jacobians.hvp_modes_case`); a program the grader runs again cannot name it.
MODES_SEEN: list[list[str]] = []

_LEVELS = {"Jvp": "forward", "Grad": "reverse"}


class _Again(torch.autograd.Function):
    """The identity on a gradient; its backward is a second reverse pass through that gradient."""

    @staticmethod
    def forward(ctx, g):
        return g.clone()

    @staticmethod
    def backward(ctx, gg):
        MODES_SEEN.append(["reverse", "reverse"])
        return gg


class _Once(torch.autograd.Function):
    """The identity on ``x``, whose gradient comes back through :class:`_Again`."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _Again.apply(g)


def _levels() -> list[str]:
    stack = torch._C._functorch.get_interpreter_stack() or []
    return [_LEVELS[k] for k in (getattr(i.key(), "name", str(i.key())).rsplit(".", 1)[-1] for i in stack)
            if k in _LEVELS]


class WatchedEnergy(Energy):
    """An :class:`Energy` that notes, each time it is evaluated, how it is being differentiated
    (:data:`MODES_SEEN`): the functorch levels around the call, or beneath them plain autograd
    and forward AD. Lesson 5's HVP check asks of it whether ``hvp_fwd_rev`` really pushed ``v``
    forward through a reverse-mode gradient and ``hvp_rev_rev`` took a gradient of a gradient,
    which values cannot tell: finite differences, a formula written out, or the other exercise's
    mode give the same ``H @ v``.

    With a *mark* (:class:`HvpMark`), it also ties the value returned to that differentiation: an
    evaluation at the mark's point exactly, differentiated in the mark's mode, adds the term
    ``sum(w * (y - x0)**2) / 2``, whose value and gradient are zero there, so nothing of first order
    (a gradient, finite differences of it, f's values) sees it, but whose Hessian ``diag(w)`` adds
    ``w * v`` to an HVP taken that way at ``x0``, and only to one taken that way."""

    def __init__(self, A: torch.Tensor, c: torch.Tensor, d: torch.Tensor, mark: "HvpMark | None" = None):
        super().__init__(A, c, d)
        self.mark = mark

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        levels = _levels()
        if not levels and isinstance(x, torch.Tensor) and x.device.type != "meta":
            import torch.autograd.forward_ad as fwAD

            if fwAD.unpack_dual(x).tangent is not None:
                levels.append("forward")
            if x.requires_grad and torch.is_grad_enabled():
                levels.append("reverse")
                if "forward" not in levels:
                    x = _Once.apply(x)  # a second pass of autograd through the gradient says so
        MODES_SEEN.append(list(levels))
        out = super().__call__(x)
        if self.mark is not None and hvp_mode_matches(self.mark.exercise, levels):
            out = out + self.mark.term(x)
        return out

    def to(self, *args, **kwargs) -> "WatchedEnergy":
        mark = self.mark.to(*args, **kwargs) if self.mark is not None else None
        return WatchedEnergy(self.A.to(*args, **kwargs), self.c.to(*args, **kwargs), self.d.to(*args, **kwargs),
                             mark)


#: Each HVP exercise's mode, as the levels around an evaluation of ``f`` show it (outermost first).
HVP_EXERCISES = ("hvp_fwd_rev", "hvp_rev_rev")


def hvp_mode_matches(exercise: str, levels: list[str]) -> bool:
    """Whether one evaluation of ``f`` under ``levels`` may be differentiated as ``exercise`` says, so
    that its :class:`HvpMark` applies: ``hvp_fwd_rev``, a forward level holding a reverse one;
    ``hvp_rev_rev``, reverse levels and no forward one (plain autograd shows one reverse level while
    ``f`` runs: its second pass, if any, comes later and is noted then)."""
    if exercise == "hvp_fwd_rev":
        return "forward" in levels and "reverse" in levels[levels.index("forward"):]
    if exercise == "hvp_rev_rev":
        return "reverse" in levels and "forward" not in levels
    raise ValueError(f"no HVP exercise {exercise!r}: expected one of {HVP_EXERCISES}")


def hvp_run_matches(exercise: str, seen: list[list[str]]) -> bool:
    """Whether a whole HVP, whose evaluations of ``f`` were differentiated as ``seen`` says (the levels
    of each, as :data:`MODES_SEEN` notes them), was taken the way ``exercise`` says: ``hvp_fwd_rev``,
    some evaluation under a forward level holding a reverse one (:func:`hvp_mode_matches`);
    ``hvp_rev_rev``, some evaluation under two reverse levels (plain autograd's second pass, noted when
    it comes, counts) and none under a forward one. The rule the check applies to a run, where
    :func:`hvp_mode_matches` is the one the mark applies to each evaluation as it happens."""
    if exercise == "hvp_fwd_rev":
        return any(hvp_mode_matches(exercise, levels) for levels in seen)
    if exercise == "hvp_rev_rev":
        return any(levels.count("reverse") >= 2 for levels in seen) and not any("forward" in levels for levels in seen)
    raise ValueError(f"no HVP exercise {exercise!r}: expected one of {HVP_EXERCISES}")


class HvpMark:
    """The term a :class:`WatchedEnergy` adds, for one exercise, at one point: ``sum(w * (y - x0)**2) / 2``
    times ``y == x0`` (a comparison, which autograd does not differentiate), with every ``w`` between
    0.5 and 1.5, so that what it adds to an HVP, ``w * v``, is never small beside ``v``. Drawn by the
    grader from a seed the learner's code never sees; a program the grader runs again cannot read it
    (``mark``, ``x0`` and ``w`` are on no list of :mod:`course.allowed_ops`)."""

    def __init__(self, exercise: str, x0: torch.Tensor, w: torch.Tensor):
        hvp_mode_matches(exercise, [])  # a known exercise
        self.exercise, self.x0, self.w = exercise, x0, w

    def term(self, y: torch.Tensor) -> torch.Tensor:
        at = (y == self.x0).all().to(y.dtype)
        return 0.5 * (self.w * (y - self.x0) ** 2).sum() * at

    def hv(self, v: torch.Tensor) -> torch.Tensor:
        """What the term adds to ``H(x0) @ v``: ``w * v``."""
        return self.w.to(v.dtype) * v

    def to(self, *args, **kwargs) -> "HvpMark":
        return HvpMark(self.exercise, self.x0.to(*args, **kwargs), self.w.to(*args, **kwargs))


@recipe
def energy(n: int, *, k: int = 8, seed: int = 0, device=None, dtype: torch.dtype = torch.float32,
           watched: bool = False, mark: tuple | None = None) -> Energy:
    """A seeded ``Energy`` of ``n`` variables with a rank-``k`` coupling (``device='meta'`` works);
    ``watched``: a :class:`WatchedEnergy`; ``mark``: ``(exercise, point_seed, mark_seed)``, its
    :class:`HvpMark` for ``exercise`` at ``randn(n, seed=point_seed)`` (watched energies only)."""
    if n < 2 or k < 1:
        raise ValueError(f"an Energy needs n >= 2 variables and k >= 1 rows, got n={n}, k={k}.")
    dev = _device(device)
    kind = WatchedEnergy if watched else Energy
    if mark is not None and not (watched and isinstance(mark, (tuple, list)) and len(mark) == 3
                                 and isinstance(mark[0], str) and all(type(m) is int for m in mark[1:])):
        raise ValueError(f"an Energy's mark is (exercise, point_seed, mark_seed) on a watched Energy, got {mark!r}.")
    if dev.type == "meta":  # shapes only: draw nothing (n may be in the millions)
        return kind(*(torch.empty(shape, device=dev, dtype=dtype) for shape in ((k, n), (k,), (n,))))
    A = randn(k, n, seed=seed, device="cpu", dtype=torch.float64) / n ** 0.5
    c = randn(k, seed=seed + 1, device="cpu", dtype=torch.float64)
    d = randn(n, seed=seed + 2, device="cpu", dtype=torch.float64)
    parts = A.to(dev, dtype), c.to(dev, dtype), d.to(dev, dtype)
    if mark is None:
        return kind(*parts)
    x0 = randn(n, seed=mark[1], device=dev, dtype=dtype)  # the point the check passes, drawn as it draws it
    w = (1 + 0.5 * torch.tanh(randn(n, seed=mark[2], device="cpu", dtype=torch.float64))).to(dev, dtype)
    return WatchedEnergy(*parts, HvpMark(mark[0], x0, w))


# -- watching what a call does --------------------------------------------------------------

def format_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


class TensorWatch(TorchDispatchMode):
    """While active (``with TensorWatch() as w:``), counts the ATen ops that run (``w.ops``) and
    remembers the largest block of memory any op returned (``w.largest_bytes``, with its tensor's
    ``w.largest_shape`` and ``w.largest_dtype``). Memory is measured by storage, so a broadcast
    view (``expand``) counts as the small tensor it really is.

    It sits below autograd and ``torch.func`` transforms, so it sees backward passes, and under
    ``vmap`` it sees the batched tensors that really exist."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.largest_bytes = 0
        self.largest_shape: tuple[int, ...] = ()
        self.largest_dtype: torch.dtype | None = None
        self.largest_op = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                size = t.untyped_storage().nbytes()
                if size > self.largest_bytes:
                    self.largest_bytes, self.largest_shape, self.largest_dtype = size, tuple(t.shape), t.dtype
                    self.largest_op = str(func.overloadpacket.__name__)
        return out

    def summary(self) -> str:
        return (f"{self.ops} ops; largest tensor {self.largest_shape} "
                f"{str(self.largest_dtype).replace('torch.', '')} ({format_bytes(self.largest_bytes)}, "
                f"made by {self.largest_op or 'no op'})")


def watch(fn: Callable, *args: Any, **kwargs: Any) -> tuple[Any, TensorWatch]:
    """``fn(*args, **kwargs)`` under a fresh :class:`TensorWatch`: ``(result, watch)``."""
    with TensorWatch() as w:
        out = fn(*args, **kwargs)
    return out, w


# -- pictures ---------------------------------------------------------------------------------

def plot_matrix(m: torch.Tensor, ax=None, title: str | None = None, xlabel: str = "input j",
                ylabel: str = "output i"):
    """A heatmap of a matrix (a Jacobian, a Hessian) on a colour scale centred on zero."""
    import matplotlib.pyplot as plt

    if not isinstance(m, torch.Tensor) or m.dim() != 2:
        raise ValueError(f"plot_matrix draws a 2-D tensor, got {type(m).__name__} {tuple(getattr(m, 'shape', ()))}.")
    data = m.detach().to("cpu", torch.float64)
    if ax is None:
        _, ax = plt.subplots(figsize=(4.4, 3.8))
    lim = float(data.abs().max()) or 1.0
    im = ax.imshow(data.numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
    ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title or f"{tuple(data.shape)} matrix")
    return ax


def plot_crossover(shapes: Sequence[tuple[int, int]], fwd: Sequence[Any], rev: Sequence[Any], ax=None,
                   title: str | None = None):
    """Time of ``jacfwd`` and ``jacrev`` (medians in seconds, or ``Ratio``-free floats) over shapes
    ``(n_out, n_in)``, on a log scale, with the square shape marked: where the lines cross, the
    better mode changes."""
    import matplotlib.pyplot as plt

    if not (len(shapes) == len(fwd) == len(rev)) or not shapes:
        raise ValueError("plot_crossover needs as many forward and reverse times as shapes (at least one).")
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 3.4))
    labels = [f"{m}x{n}" for m, n in shapes]
    ax.plot(labels, [1e3 * float(t) for t in fwd], marker="o", label="jacfwd (one JVP per input)")
    ax.plot(labels, [1e3 * float(t) for t in rev], marker="s", label="jacrev (one VJP per output)")
    square = [i for i, (m, n) in enumerate(shapes) if m == n]
    if square:
        ax.axvline(square[0], color="gray", ls="--", lw=1)
    ax.set_yscale("log")
    ax.set(xlabel="shape: outputs x inputs (tall on the left, wide on the right)", ylabel="time per Jacobian (ms)",
           title=title or "jacfwd against jacrev")
    ax.legend()
    ax.tick_params(axis="x", rotation=30)
    return ax

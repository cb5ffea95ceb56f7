"""Lesson 6's pieces (ensembles and per-sample gradients with ``vmap``): the models and data the
lesson works on, a watcher that tells whether a model ran under ``vmap``, and Opacus's warning
explained.

- :func:`mlp` / :func:`mlp_ensemble`: small classifiers with *buffers* as well as parameters
  (a :class:`Standardize` layer holds a per-feature shift and scale), so that stacking an
  ensemble has both to stack and forgetting the buffers shows;
  (with ``dropout=p``, a ``Dropout`` before the last layer: a random op under ``vmap``);
- :func:`small_cnn`: a two-convolution classifier for single-channel images, small enough for a
  2-core CPU, smooth (SiLU, average pooling: see :class:`SmallCNN`), with no BatchNorm (a
  per-sample gradient is not defined through batch statistics: each sample's output would depend
  on the others);
- :func:`toy_images` / :func:`toy_features` / :func:`teacher_task`: seeded synthetic data (never
  downloaded); the images are class templates plus noise, so that a few training steps visibly
  lower the loss, and the features' labels come from a fixed random teacher;
- :class:`ForwardWatch`: a forward pre-hook that records, for every call of a module, which
  ``torch.func`` transforms were active. A Python loop calls the model once per sample (or per
  ensemble member) with no transform; ``vmap`` calls it once, with ``vmap`` active. That is how
  the checks tell the two apart without reading the learner's code;
- :func:`member_kl_planted`: each member's KL divergence from a target distribution, written with
  ``F.kl_div`` inside ``vmap``, an op with no batching rule: ``vmap`` runs it in a loop over the
  members (the planted slow op the lesson repairs); :func:`vmap_fallbacks` names such ops.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from course.data import device_generator
from course.devices import pick_device
from course.remote import recipe

__all__ = ["ForwardWatch", "SmallCNN", "Standardize", "member_kl_planted", "meta_copy", "meta_mlp", "mlp",
           "mlp_ensemble",
           "plot_speedup_by_batch", "quiet_opacus", "small_cnn", "teacher_task", "toy_features", "toy_images",
           "transform_levels", "transforms_active", "vmap_fallbacks"]


# -- models ------------------------------------------------------------------------------------

class Standardize(nn.Module):
    """``(x - shift) / scale`` with ``shift`` and ``scale`` held as buffers (state that is not
    trained), as an input normalisation layer fitted to a data set would hold them."""

    def __init__(self, features: int):
        super().__init__()
        self.register_buffer("shift", torch.zeros(features))
        self.register_buffer("scale", torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.shift) / self.scale


def _seeded(seed: int, build):
    """``build()`` on the CPU's generator seeded with ``seed``, which is given back afterwards. Only the
    CPU's: everything here is built on the CPU (and moved after), and ``torch.manual_seed`` would also
    queue a seed for every lazy accelerator, formatting the stack each time (a third of the cost of
    building a tiny model, and the judge's clocks build thousands)."""
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        return build()


def _mlp_layers(features: int, hidden: int, classes: int, dropout: float | None = None) -> nn.Sequential:
    layers = [Standardize(features), nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
              nn.Linear(hidden, classes)]
    if dropout is not None:  # before the last layer, as an ensemble trained with dropout has it
        layers.insert(-1, nn.Dropout(dropout))
    return nn.Sequential(*layers)


@recipe
def mlp(*, seed: int, features: int = 64, hidden: int = 64, classes: int = 10, dropout: float | None = None,
        device=None, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """``Standardize -> Linear -> ReLU -> Linear -> ReLU -> Linear``, seeded; the standardisation
    buffers are drawn too (a fresh one would be the identity, and hide a forgotten buffer). With
    ``dropout=p``, a ``Dropout(p)`` before the last layer (the model comes in training mode, so it
    drops: a random op under ``vmap``, lesson 6's Exercise 4)."""
    def build():
        model = _mlp_layers(features, hidden, classes, dropout)
        model[0].shift.copy_(torch.randn(features) * 0.3)
        model[0].scale.copy_(torch.rand(features) + 0.5)
        return model
    return _seeded(seed, build).to(pick_device(device), dtype)


def mlp_ensemble(n: int, *, seed: int, **kwargs: Any) -> list[nn.Sequential]:
    """``n`` MLPs of the same shape with different weights and buffers (member ``i`` is
    ``mlp(seed=1000 * seed + i)``), as independently initialised members of an ensemble are."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"an ensemble needs at least one model, got n={n!r}.")
    return [mlp(seed=1000 * seed + i, **kwargs) for i in range(n)]


class SmallCNN(nn.Module):
    """Two 3x3 convolutions (SiLU, 2x2 average pooling after each) and a linear classifier, for
    ``(N, 1, size, size)`` images (``size`` divisible by 4).

    Smooth on purpose: with ReLU and max-pooling, a value within float32 rounding of a kink (a
    pre-activation next to 0, two near-equal values in a pooling window) can send a gradient down
    another path in a batched kernel than in a per-sample one, and a float32 comparison of
    per-sample gradients then fails now and then for no fault of the code. SiLU and average
    pooling have no kinks, so float32 results stay within rounding of float64 everywhere."""

    def __init__(self, channels: Sequence[int] = (8, 16), size: int = 16, classes: int = 10):
        super().__init__()
        c1, c2 = channels
        self.conv1 = nn.Conv2d(1, c1, 3, padding=1)
        self.conv2 = nn.Conv2d(c1, c2, 3, padding=1)
        self.fc = nn.Linear(c2 * (size // 4) ** 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.avg_pool2d(F.silu(self.conv1(x)), 2)
        x = F.avg_pool2d(F.silu(self.conv2(x)), 2)
        return self.fc(torch.flatten(x, 1))


@recipe
def small_cnn(*, seed: int, channels: Sequence[int] = (8, 16), size: int = 16, classes: int = 10, device=None,
              dtype: torch.dtype = torch.float32) -> SmallCNN:
    """A seeded :class:`SmallCNN`."""
    if size % 4 or size < 4:
        raise ValueError(f"small_cnn pools twice by 2: the image size must be a multiple of 4, got {size}.")
    return _seeded(seed, lambda: SmallCNN(tuple(channels), size, classes)).to(pick_device(device), dtype)


def meta_copy(model: nn.Module) -> nn.Module:
    """A stateless copy of ``model``'s architecture on the ``meta`` device (shapes, no memory): the
    ``base`` that ``functional_call`` runs with stacked state. For an :func:`mlp`, built by the
    :func:`meta_mlp` recipe, so that a check can hand the learner's function the very base it holds
    (cheaply: nothing is drawn or copied)."""
    import copy

    if isinstance(model, nn.Sequential) and len(model) == 6 and isinstance(model[0], Standardize):
        base = meta_mlp(features=model[1].in_features, hidden=model[1].out_features,
                        classes=model[5].out_features, dtype=model[1].weight.dtype)
        if [(k, t.shape) for k, t in base.state_dict().items()] == [(k, t.shape) for k, t in model.state_dict().items()]:
            return base
    return copy.deepcopy(model).to("meta")


@recipe
def meta_mlp(*, features: int, hidden: int, classes: int, dropout: float | None = None,
             dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """The :func:`mlp` architecture on the ``meta`` device, with no state (in training mode)."""
    with torch.device("meta"):
        return _mlp_layers(features, hidden, classes, dropout).to(dtype)


# -- data --------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=8)
def _templates(classes: int, size: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    """The class templates of :func:`toy_images` (fixed, the same for every seed), kept per device."""
    return _seeded(12345, lambda: F.interpolate(torch.randn(classes, 1, 4, 4, dtype=torch.float64),
                                                size=(size, size), mode="bilinear", align_corners=False)).to(device, dtype)


def toy_images(n: int, *, seed: int, size: int = 16, classes: int = 10, noise: float = 2.0, device=None,
               dtype: torch.dtype = torch.float32, draw_on_device: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` single-channel images ``(n, 1, size, size)`` and their labels ``(n,)``: each class
    has a fixed smooth template (the same for every seed), and each image is its class's
    template plus Gaussian noise. Drawn on the CPU, so every device sees the same numbers;
    ``draw_on_device``: drawn on ``device`` (other numbers on a GPU, no copy: for timed calls,
    see :func:`course.data.device_generator`)."""
    dev = pick_device(device)
    if draw_on_device:
        g = device_generator(seed, dev)
        labels = torch.randint(0, classes, (n,), generator=g, device=dev)
        noisy = torch.randn(n, 1, size, size, generator=g, device=dev, dtype=dtype)
        return _templates(classes, size, str(dev), dtype)[labels] * 1.5 + noise * noisy, labels
    templates = _templates(classes, size, "cpu", torch.float64)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    x = templates[labels] * 1.5 + noise * torch.randn(n, 1, size, size, generator=g, dtype=torch.float64)
    return x.to(dev, dtype), labels.to(dev)


def toy_features(*shape: int, seed: int, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Features of the given shape (last dimension: features), drawn on the CPU, then moved."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(pick_device(device), dtype)



#: The hidden rule behind :func:`teacher_task`'s labels, fixed once for the course.
TEACHER_SEED = 123


def teacher_task(*shape: int, features: int, seed: int, classes: int = 10, device=None,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable toy classification task: features as :func:`toy_features` draws them (shape
    ``(*shape, features)``), and labels (shape ``shape``) from one fixed random teacher,
    ``argmax(tanh(2 x A) B)`` with ``A`` and ``B`` drawn from :data:`TEACHER_SEED` (``B``'s
    columns centred and of unit length). The rule is the same for every ``seed`` (a seed picks the
    draw of examples, not the task); at the lesson's sizes (64 features and more) the classes come
    out within 20% of balanced; a small MLP learns it in a few dozen SGD steps, not perfectly."""
    x = toy_features(*shape, features, seed=seed, device="cpu", dtype=torch.float64)
    g = torch.Generator().manual_seed(TEACHER_SEED)
    a = torch.randn(features, 32, generator=g, dtype=torch.float64) / features ** 0.5
    b = torch.randn(32, classes, generator=g, dtype=torch.float64)
    b = b - b.mean(1, keepdim=True)  # centred, unit columns: no class favoured by its scale
    b = b / b.norm(dim=0)
    labels = (torch.tanh(2 * x @ a) @ b).argmax(-1)
    dev = pick_device(device)
    return x.to(dev, dtype), labels.to(dev)

# -- watching how a model is called ------------------------------------------------------------

def transform_levels() -> list[tuple[str, int | None]]:
    """The ``torch.func`` transforms active right now, outermost first, as functorch names them, each
    with its batch size where it is a ``vmap`` (``[("Vmap", 6), ("Grad", None)]`` inside
    ``vmap(grad(f))`` over 6 samples; ``[]`` in plain eager code). Reads functorch's interpreter stack
    (a private API, pinned by the course's tests)."""
    from torch._C import _functorch

    levels = []
    for level in _functorch.get_interpreter_stack() or []:
        name = str(level.key()).rsplit(".", 1)[-1]
        levels.append((name, _functorch.CVmapInterpreterPtr(level).batchSize() if name == "Vmap" else None))
    return levels


def transforms_active() -> tuple[str, ...]:
    """The ``torch.func`` transforms active right now, outermost first (``('vmap', 'grad')``
    inside ``vmap(grad(f))``; ``()`` in plain eager code): :func:`transform_levels`' names."""
    return tuple(name.lower() for name, _ in transform_levels())


class ForwardWatch:
    """``with ForwardWatch(model) as watch: ...`` records every call of ``model`` (directly or
    through ``torch.func.functional_call``): ``watch.calls`` is a list of the transforms that
    were active at each call (see :func:`transforms_active`)."""

    def __init__(self, module: nn.Module):
        if not isinstance(module, nn.Module):
            raise TypeError(f"ForwardWatch watches an nn.Module, got {type(module).__name__}.")
        self.module = module
        self.calls: list[tuple[str, ...]] = []
        self._handle = None

    def _hook(self, module, args):
        self.calls.append(transforms_active())

    def __enter__(self) -> "ForwardWatch":
        self._handle = self.module.register_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()

    @property
    def under_vmap(self) -> bool:
        """True if every call ran inside ``vmap`` (and there was at least one)."""
        return bool(self.calls) and all("vmap" in c for c in self.calls)

    def summary(self) -> str:
        if not self.calls:
            return "the model was never called"
        kinds = sorted({" > ".join(c) or "no transform" for c in self.calls})
        return f"the model was called {len(self.calls)} time(s), under: {', '.join(kinds)}"


# -- an op without a batching rule -------------------------------------------------------------

def member_kl_planted(params: dict, buffers: dict, base: nn.Module, x: torch.Tensor,
                      target: torch.Tensor) -> torch.Tensor:
    """``(N,)``: member ``i``'s KL divergence from ``target`` on the minibatch ``x``,
    ``KL(target || member) = sum_c target * (log target - log softmax(member(x)))``, averaged over
    the minibatch (``F.kl_div``'s ``reduction="batchmean"``; a ``target`` of 0 adds 0). ``target``
    is ``(batch, classes)`` probabilities shared by every member: the ensemble's vote, or a
    teacher's. Written as anyone would, with ``F.kl_div`` inside the vmapped function; on the torch
    versions the course supports ``aten::kl_div`` has no batching rule, so ``vmap`` runs it member by
    member in a loop (PyTorch warns: "There is a performance drop because we have not yet
    implemented the batching rule for aten::kl_div"). The lesson's exercise repairs it; this
    version is the baseline its speed check times."""
    from torch.func import functional_call, vmap

    def divergence(state, extra):
        logits = functional_call(base, (state, extra), (x,))
        return F.kl_div(logits.log_softmax(-1), target, reduction="batchmean")

    return vmap(divergence)(params, buffers)


FALLBACK_WARNING = "we have not yet implemented the batching rule for "


def vmap_fallbacks(fn, *args: Any, **kwargs: Any) -> list[str]:
    """The ops (``'aten::kl_div'``...) that ``vmap`` ran in a loop, slice by slice, while
    ``fn(*args, **kwargs)`` ran: PyTorch warns for each such call ("There is a performance drop
    because we have not yet implemented the batching rule for ..."). Each op once, in order.
    The warning can be switched off process-wide, so an empty list is a hint, not a proof."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn(*args, **kwargs)
    ops: list[str] = []
    for w in seen:
        text = str(w.message)
        if FALLBACK_WARNING in text:
            op = text.split(FALLBACK_WARNING, 1)[1].split()[0].rstrip(".")
            if op not in ops:
                ops.append(op)
    return ops


# -- Opacus ------------------------------------------------------------------------------------

OPACUS_NOTE = (
    "Note: Opacus computes per-sample gradients with a full backward hook on every layer. On the first "
    "layer no input requires a gradient (the images are data), and PyTorch warns that such a hook then "
    "fires for the layer's output gradients only; those are exactly what Opacus needs. That warning is "
    "silenced from here on."
)
_opacus_explained = False


def quiet_opacus(explain: bool = True) -> None:
    """Silence the one warning Opacus's hooks trigger in this lesson (only that one); say why, once."""
    global _opacus_explained
    warnings.filterwarnings("ignore", message=r"Full backward hook is firing when gradients are computed with "
                            r"respect to module outputs", category=UserWarning)
    if explain and not _opacus_explained:
        print(OPACUS_NOTE)
        _opacus_explained = True


# -- a picture ---------------------------------------------------------------------------------

def plot_speedup_by_batch(batches: Sequence[int], ratios: dict[str, Sequence[Any]], ax=None,
                          title: str | None = None):
    """Speedup over the loop (median, quartile whiskers) against the batch size, one line per
    method; ``ratios[name]`` holds one ``course.timing.Ratio`` per batch size."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(5.5, 3.4))
    for name, rs in ratios.items():
        med = [r.median for r in rs]
        err = [[r.median - r.low for r in rs], [r.high - r.median for r in rs]]
        ax.errorbar(list(batches), med, yerr=err, marker="o", capsize=4, label=name)
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(batches), [str(b) for b in batches])
    ax.set(xlabel="batch size", ylabel="speedup over the loop (x)", title=title or "Per-sample gradients")
    ax.legend()
    return ax

"""Lesson 3's helpers (channels-last): read a tensor's memory format, walk an op's arguments,
name an op, draw how a tensor lies in memory, build models with a planted op that loses
the channels-last format, and the timing inputs of the CoordConv block whose format loss the
lesson's last exercise repairs.

Two questions about a 4-D tensor's strides are easy to mix up, and PyTorch asks both:

- ``x.is_contiguous(memory_format=torch.channels_last)``: is it dense in exactly the N, H, W, C
  order? Dimensions of size 1 are skipped, so an ``(N, 1, H, W)`` or ``(N, C, 1, 1)`` tensor is
  "contiguous" in both formats at once;
- which dimension is innermost (PyTorch calls it ``suggest_memory_format``): kernels such as
  convolution use this one to choose the format of their output.

:func:`memory_format_of` answers the second question, and says ``None`` where the strides
cannot tell (not 4-D, one channel, or one pixel). The planted models hide an op that takes a
channels-last tensor and returns an NCHW one somewhere in a ``small_resnet``; the learner's
checker must name it. Which op it is lives with the checks, not here.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from course.data import device_generator, grid_uniform
from course.devices import pick_device
from course.models import small_resnet
from course.remote import factory, recipe

__all__ = ["PLANTED_VARIANTS", "WEIGHTS_WITNESS_OUT", "autocast_witness", "float32_weights_witness", "channels_last_strides_of", "coord_conv_inputs", "coord_conv_planted",
           "coordinate_planes", "cpu_has_native_bf16", "list_probe", "memory_format_of", "op_name", "planted_model", "plot_layout",
           "plot_layouts", "tensors_in"]

CL = torch.channels_last


def memory_format_of(t: Any) -> torch.memory_format | None:
    """``torch.channels_last`` if a 4-D tensor keeps its channels innermost (the channel stride
    is smaller than every spatial stride that matters), ``torch.contiguous_format`` if not, and
    ``None`` where the strides say nothing: not a 4-D tensor, one channel (C == 1), or one pixel
    (H == W == 1). Views count too: a slice of a channels-last tensor is still channels-last."""
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        return None
    _, c, h, w = t.shape
    spatial = [t.stride(d) for d, size in ((2, h), (3, w)) if size > 1]
    if c <= 1 or not spatial:
        return None
    return CL if t.stride(1) < min(spatial) else torch.contiguous_format


def channels_last_strides_of(shape) -> tuple[int, ...]:
    """The strides PyTorch gives a dense channels-last tensor of ``shape`` (what ``.to`` makes)."""
    return tuple(torch.empty(tuple(shape), memory_format=CL, device="meta").stride())


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj``, however nested in tuples, lists and dicts: an op's ``args`` and
    ``kwargs`` (``torch.cat`` takes a *list* of tensors) or its output."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item)


def op_name(func: Callable) -> str:
    """A readable, stable name for what ``__torch_function__`` receives: ``'torch.cat'``,
    ``'torch.Tensor.reshape'``, ``'torch.nn.functional.conv2d'``..."""
    name = torch.overrides.resolve_name(func)
    if name:
        return name
    owner = getattr(func, "__objclass__", None) or getattr(func, "__self__", None)
    base = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    return f"{getattr(owner, '__name__', '')}.{base}".lstrip(".") if owner is not None else base


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN finds native BF16 instructions on this CPU (AVX512-BF16, AMX...): without
    them BF16 convolutions are emulated, and BF16 autocast is slower than float32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


# -- drawing ---------------------------------------------------------------------------------

def plot_layout(x: torch.Tensor, ax=None, title: str | None = None):
    """Draw the storage of a small dense 4-D tensor as one strip, slot by slot in memory order:
    each slot is coloured by its channel and labelled with its ``(c, h, w)`` index."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"plot_layout draws a 4-D tensor, got {type(x).__name__} "
                         f"{tuple(getattr(x, 'shape', ()))}.")
    if x.numel() > 64:
        raise ValueError(f"plot_layout draws small tensors (64 elements at most), got {x.numel()}: "
                         "try a shape such as (1, 3, 2, 3).")
    n_, c_, h_, w_ = x.shape
    slots: dict[int, tuple[int, int, int, int]] = {}
    for n in range(n_):
        for c in range(c_):
            for h in range(h_):
                for w in range(w_):
                    offset = n * x.stride(0) + c * x.stride(1) + h * x.stride(2) + w * x.stride(3)
                    slots[offset] = (n, c, h, w)
    if len(slots) != x.numel():
        raise ValueError("plot_layout needs a tensor whose elements do not share memory (no expand).")
    if ax is None:
        _, ax = plt.subplots(figsize=(0.55 * len(slots) + 0.6, 1.2))
    colors = plt.get_cmap("tab10")
    for i, offset in enumerate(sorted(slots)):
        n, c, h, w = slots[offset]
        ax.add_patch(Rectangle((i, 0), 1, 1, facecolor=colors(c % 10), alpha=0.55, edgecolor="black"))
        ax.text(i + 0.5, 0.5, f"{c},{h},{w}" if n_ == 1 else f"{n},{c},{h},{w}", ha="center", va="center",
                fontsize=7)
    ax.set_xlim(0, len(slots))
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ax.set_xticks([i + 0.5 for i in range(len(slots))], [str(i) for i in range(len(slots))], fontsize=6)
    ax.set_xlabel("memory offset (labels: c,h,w; colour: channel)", fontsize=8)
    ax.set_title(title or f"shape {tuple(x.shape)}, strides {x.stride()}", fontsize=9)
    return ax


def plot_layouts(shape=(1, 3, 2, 3)):
    """NCHW and channels-last (NHWC) storage of the same small tensor, one above the other."""
    import matplotlib.pyplot as plt

    x = torch.zeros(shape)
    y = x.to(memory_format=CL)
    fig, axes = plt.subplots(2, 1, figsize=(0.55 * x.numel() + 0.6, 3.0))
    plot_layout(x, axes[0], f"NCHW (contiguous): strides {x.stride()}: a whole channel, then the next")
    plot_layout(y, axes[1], f"NHWC (channels-last): strides {y.stride()}: every channel of a pixel, then the next")
    fig.tight_layout()
    return fig


# -- models with a planted op that loses channels-last ---------------------------------------

def coordinate_planes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ys, xs)``, each ``(N, 1, H, W)`` (expanded views, in the default format) for ``x`` of
    shape ``(N, C, H, W)``: every pixel's row and column coordinate, from -1 to 1."""
    n, _, h, w = x.shape
    ys = torch.linspace(-1, 1, h, device=x.device, dtype=x.dtype).view(1, 1, h, 1).expand(n, 1, h, w)
    xs = torch.linspace(-1, 1, w, device=x.device, dtype=x.dtype).view(1, 1, 1, w).expand(n, 1, h, w)
    return ys, xs


def coord_conv_planted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """CoordConv as :class:`CoordChannels` computes it: append two planes holding each pixel's y
    (row) and x (column) coordinate, from -1 to 1, after ``x``'s channels, then a 1x1 convolution
    with ``weight`` (``(C_out, C + 2, 1, 1)``) and ``bias``. The planes are made fresh, and NCHW,
    on every call: for a channels-last ``x`` the ``cat`` of the two formats returns NCHW, and the
    convolution reorders it back. The lesson's last exercise repairs it; this version is the
    baseline its speed check times."""
    ys, xs = coordinate_planes(x)
    return F.conv2d(torch.cat([x, torch.cat([ys, xs], dim=1)], dim=1), weight, bias)


class CoordChannels(nn.Module):
    """CoordConv: append two planes holding each pixel's y and x coordinate, then mix back to
    ``channels`` with a 1x1 convolution (:func:`coord_conv_planted`)."""

    def __init__(self, channels: int):
        super().__init__()
        self.mix = nn.Conv2d(channels + 2, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return coord_conv_planted(x, self.mix.weight, self.mix.bias)


@factory
def coord_conv_inputs(seed: int, *, device: str = "cpu", batch: int = 8, channels: int = 64,
                      size: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, weight, bias)`` for a CoordConv block in a channels-last network: ``x``
    ``(batch, channels, size, size)`` and the 1x1 ``weight`` ``(channels, channels + 2, 1, 1)``,
    both channels-last, as a converted model's activations and weights are (each drawn in NHWC
    order and permuted: no copy, and real channels-last strides for the 1x1 kernel, which is
    "contiguous" in both formats already); ``bias`` ``(channels,)``."""
    g = device_generator(seed, device)
    dev = pick_device(device)
    # NHWC in memory; drawn on a grid (grid_uniform): randn of half a million numbers cost twice the
    # repaired block itself, and it is paid in every timed call, on both sides
    x = grid_uniform((batch, size, size, channels), g, device=dev).permute(0, 3, 1, 2)
    weight = torch.randn(channels, 1, 1, channels + 2, generator=g, device=dev).permute(0, 3, 1, 2)
    bias = torch.randn(channels, generator=g, device=dev)
    return x, weight / (channels + 2) ** 0.5, bias


class Tidy(nn.Module):
    """"Make it contiguous, to be safe": a habit from NCHW days."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x).contiguous()


class ChannelGate(nn.Module):
    """Weigh every pixel's channels by a softmax over the channels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x.softmax(dim=1) * x.shape[1]


class ChannelPermute(nn.Module):
    """Reorder the channels with a fixed permutation (drawn from the model's seed)."""

    def __init__(self, channels: int, seed: int):
        super().__init__()
        self.register_buffer("perm", torch.randperm(channels, generator=torch.Generator().manual_seed(seed)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.perm]


class CircularConv(nn.Module):
    """A 3x3 convolution that wraps around the image edges (``padding_mode='circular'``)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, padding_mode="circular", bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


@recipe
def autocast_witness(*, device=None) -> nn.Module:
    """A 1x1 convolution that computes ``x - 1`` (weight 1, bias -1). On ``x = 1 + 2**-12`` it
    returns about 2.4e-4 in float32 and exactly 0 when it runs under autocast (bfloat16 or float16
    round its input to 1 first), whatever is done to its output afterwards: how a check sees from
    outside that a model ran under autocast."""
    conv = nn.Conv2d(1, 1, 1)
    with torch.no_grad():
        conv.weight.fill_(1.0)
        conv.bias.fill_(-1.0)
    return nn.Sequential(conv).eval().to(pick_device(device))


#: What :func:`float32_weights_witness` returns on an input of ones while its weights are float32.
WEIGHTS_WITNESS_OUT = -0.25


@recipe
def float32_weights_witness(*, device=None) -> nn.Module:
    """A 1x1 convolution that passes its input through, then a BatchNorm (eval mode, epsilon ``2**-40``,
    nothing beside the variance; torch 2.10 and 2.11 refuse an epsilon of 0) whose running mean is
    ``1 + 2**-12`` and running variance ``2**-20``. On an input of ones it returns
    ``(1 - mean) / sqrt(var) = -2**-12 * 2**10 = -0.25`` while its weights are float32, under autocast
    or not (autocast runs the convolution in low precision, whose output is 1 exactly, and keeps the
    BatchNorm's float32 statistics); with the model cast to bfloat16 or float16 the mean rounds to 1
    and it returns 0: how a check sees from outside that the weights stayed float32."""
    conv = nn.Conv2d(1, 1, 1)
    norm = nn.BatchNorm2d(1, eps=2.0 ** -40)
    with torch.no_grad():
        conv.weight.fill_(1.0)
        conv.bias.fill_(0.0)
        norm.running_mean.fill_(1.0 + 2.0 ** -12)
        norm.running_var.fill_(2.0 ** -20)
    return nn.Sequential(conv, norm).eval().to(pick_device(device))



@recipe
def list_probe(*, seed: int = 0, width: int = 8, device=None) -> nn.Module:
    """A convolution, then :class:`CoordChannels`: the one op that loses channels-last is a
    ``torch.cat``, whose tensors arrive in a list. How a check tells a watcher blind to lists (it
    reports nothing here) from one that reports some other loss than the first (it names the cat)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), CoordChannels(width))
    return model.eval().to(pick_device(device))

#: variant -> (first planted module, second planted module, later in the network)
_VARIANTS: dict[str, tuple[str, str]] = {
    "coords": ("coords", "tidy"),
    "permute": ("permute", "coords"),
    "circular": ("circular", "gate"),
    "gate": ("gate", "permute"),
}
PLANTED_VARIANTS = tuple(_VARIANTS)


def _make(kind: str, channels: int, seed: int) -> nn.Module:
    if kind == "coords":
        return CoordChannels(channels)
    if kind == "tidy":
        return Tidy()
    if kind == "gate":
        return ChannelGate()
    if kind == "permute":
        return ChannelPermute(channels, seed)
    if kind == "circular":
        return CircularConv(channels)
    raise ValueError(kind)


@recipe
def planted_model(variant: str = "coords", *, seed: int = 0, width: int = 16, blocks: tuple[int, ...] = (1, 1, 1),
                  device=None) -> nn.Module:
    """A seeded ``small_resnet`` (in eval mode) with two format-losing modules planted between
    its residual blocks: one early (after a block that ``seed`` picks, never the last) and one
    after the last block, so that a checker must report the *first* loss. Variants:
    ``PLANTED_VARIANTS``."""
    if variant not in _VARIANTS:
        raise ValueError(f"No planted variant {variant!r}; there are {list(PLANTED_VARIANTS)}.")
    model = small_resnet(seed=seed, width=width, blocks=blocks, device="cpu")
    first, second = _VARIANTS[variant]
    stages = list(model.stages)
    where = seed % max(len(stages) - 1, 1)
    channels = [b.second.conv.out_channels for b in stages]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 17)
        early = _make(first, channels[where], seed)
        late = _make(second, channels[-1], seed + 1)
    layers = stages[: where + 1] + [early] + stages[where + 1:] + [late]
    model.stages = nn.Sequential(*layers)
    return model.eval().to(pick_device(device))

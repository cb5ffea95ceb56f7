"""Checks for lesson 03_channels_last: strides by hand, the channels-last contiguity rule, the
conversion of a model and its input, a checker that names the first op losing the format, BF16 /
FP16 autocast, and the measured speedup of channels-last over contiguous (NCHW) inference.

Shapes and stride patterns come from ``seed``; models are ``course.models`` ResNets and
``course.memory_format`` planted models, so the learner chooses none of the inputs."""

from __future__ import annotations

import contextlib
import copy
import random
from typing import Callable, Mapping

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from course.checks.common import call, ok, record
from course.data import randn
from course.devices import pick_device
from course.grading import best_of, expect_speedup, speed_bar
from course.memory_format import (PLANTED_VARIANTS, channels_last_strides_of, memory_format_of, op_name,
                                  planted_model, tensors_in)
from course.models import small_resnet, small_resnet_channels
from course.numerics import assert_close, describe
from course.timing import SpeedReport, compare
from course.guard import reference

__all__ = ["check_autocast_inference", "check_channels_last_speed", "check_format_finder",
           "check_is_channels_last_contiguous", "check_strides", "check_to_channels_last"]

CL = torch.channels_last
FIXED_SHAPES = [(1, 1, 1, 1), (2, 3, 4, 5), (8, 3, 224, 224), (4, 1, 8, 8), (4, 16, 1, 1), (1, 64, 7, 1)]


# -- stride arithmetic ---------------------------------------------------------------------

class _TorchCalls(TorchFunctionMode):
    """Records the torch functions a learner's 'by hand' function calls (it should call none)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(op_name(func))
        return func(*args, **(kwargs or {}))


def _by_hand(fn: Callable, *args, name: str):
    with _TorchCalls() as seen:
        got = call(fn, *args, name=name)
    if seen.names:
        raise AssertionError(f"{name} called torch ({', '.join(sorted(set(seen.names)))}). Work it out by hand: "
                             "plain Python arithmetic on the shape (and strides), no tensors.")
    return got


def _shapes(seed: int, cases: int) -> list[tuple[int, int, int, int]]:
    rng = random.Random(seed)
    sizes = [1, 1, 2, 3, 4, 5, 7, 16]
    return FIXED_SHAPES + [tuple(rng.choice(sizes) for _ in range(4)) for _ in range(cases)]


def _as_strides(got, fn_name: str, shape) -> tuple[int, ...]:
    if isinstance(got, torch.Tensor) or not isinstance(got, (tuple, list)) or \
            not all(isinstance(s, int) and not isinstance(s, bool) for s in got):
        raise AssertionError(f"{fn_name}({shape}) should return a tuple of 4 ints, got {describe(got)}.")
    return tuple(got)


def check_strides(nchw_strides: Callable, nhwc_strides: Callable, *, seed: int = 0, cases: int = 25) -> None:
    """``nchw_strides(shape)`` and ``nhwc_strides(shape)`` return the strides (in elements) of a
    dense ``(N, C, H, W)`` tensor in NCHW (contiguous) and NHWC (channels-last) order."""
    seen, wanted = [], []
    for shape in _shapes(seed, cases):
        for fn, label, fmt, hint in (
                (nchw_strides, "nchw_strides", torch.contiguous_format,
                 "in NCHW, W is innermost (stride 1); each dimension's stride is the product of the sizes "
                 "to its right: (C*H*W, H*W, W, 1)."),
                (nhwc_strides, "nhwc_strides", CL,
                 "in NHWC the order in memory is N, H, W, C: C is innermost (stride 1), then W steps over "
                 "C elements, H over W*C, N over H*W*C. Strides stay in (N, C, H, W) order.")):
            expected = tuple(torch.empty(shape, memory_format=fmt, device="meta").stride())
            got = _as_strides(_by_hand(fn, shape, name=label), label, shape)
            seen.append(list(got))
            wanted.append(list(expected))
            if got != expected:
                raise AssertionError(f"{label}({shape}) returned {got}; PyTorch's strides are {expected}.\n"
                                     f"  Hint: {hint}")
    record(seen, wanted, "strides by hand")
    ok(f"nchw_strides and nhwc_strides match PyTorch on {len(FIXED_SHAPES) + cases} shapes (seed {seed})")


@reference
def _dense(shape, order):
    strides, acc = [0] * 4, 1
    for d in reversed(order):
        strides[d] = acc
        acc *= shape[d]
    return strides


def _stride_cases(seed: int, cases: int):
    rng = random.Random(seed)
    out = [((4, 1, 8, 8), [64, 64, 8, 1]), ((4, 16, 1, 1), [16, 1, 1, 1]), ((2, 3, 4, 5), [60, 20, 5, 1]),
           ((2, 3, 4, 5), [60, 1, 15, 3]), ((1, 3, 4, 5), [7, 1, 15, 3]), ((2, 3, 4, 5), [60, 1, 3, 12])]
    for _ in range(cases):
        shape = tuple(rng.choice([1, 1, 2, 3, 4, 6]) for _ in range(4))
        kind = rng.randrange(5)
        if kind == 0:
            strides = _dense(shape, [0, 1, 2, 3])
        elif kind == 1:
            strides = _dense(shape, [0, 2, 3, 1])
        elif kind == 2:
            strides = _dense(shape, rng.sample(range(4), 4))
        elif kind == 3:  # a slice: one stride stretched
            strides = _dense(shape, rng.choice([[0, 1, 2, 3], [0, 2, 3, 1]]))
            strides[rng.randrange(4)] *= rng.choice([2, 3])
        else:  # an odd stride: broadcast (0) or arbitrary
            strides = _dense(shape, [0, 2, 3, 1])
            strides[rng.randrange(4)] = rng.choice([0, 7])
        out.append((shape, strides))
    return out


def check_is_channels_last_contiguous(fn: Callable, *, seed: int = 0, cases: int = 80) -> None:
    """``fn(shape, strides) -> bool`` equals ``x.is_contiguous(memory_format=torch.channels_last)``
    for a tensor with that shape and those strides, on generated cases (NCHW, NHWC, permuted,
    sliced, broadcast) including the ambiguous ``(N, 1, H, W)`` and ``(N, C, 1, 1)``."""
    gots, wants = [], []
    for shape, strides in _stride_cases(seed, cases):
        expected = torch.empty_strided(shape, strides, device="meta").is_contiguous(memory_format=CL)
        got = _by_hand(fn, tuple(shape), tuple(strides), name="is_channels_last_contiguous")
        gots.append(got)
        wants.append(bool(expected))
        if not isinstance(got, bool):
            raise AssertionError(f"is_channels_last_contiguous{(tuple(shape), tuple(strides))} should return "
                                 f"True or False, got {describe(got)}.")
        if got != expected:
            amb = " This shape is one of the ambiguous ones." if (shape[1] == 1 or shape[2] == shape[3] == 1) else ""
            raise AssertionError(
                f"is_channels_last_contiguous(shape={tuple(shape)}, strides={tuple(strides)}) returned {got}; "
                f"PyTorch says {expected}.{amb}\n"
                "  Hint: walk the dimensions from innermost to outermost in NHWC order (C, W, H, N) with an "
                "expected stride starting at 1; skip dimensions of size 1 (their stride never matters); every "
                "other dimension must have exactly the expected stride, which then grows by its size.")
    record(gots, wants, "is_channels_last_contiguous on every case")
    ok(f"is_channels_last_contiguous agrees with PyTorch on {cases + 6} shapes and strides (seed {seed})")


# -- converting a model and its input ------------------------------------------------------

@contextlib.contextmanager
def _full_float32():
    """Full float32 on CUDA for a numerics check: TF32 (on by default for cuDNN convolutions)
    rounds differently in NCHW and NHWC kernels, which would blur a 1e-4 tolerance."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _expect_channels_last(t: torch.Tensor, what: str) -> None:
    expected = channels_last_strides_of(t.shape)
    if tuple(t.stride()) != expected:
        amb = ""
        if t.is_contiguous(memory_format=CL):
            amb = (f" x.is_contiguous(memory_format=torch.channels_last) says True, but only because the shape "
                   f"{tuple(t.shape)} is ambiguous (C == 1 or H == W == 1): these are NCHW strides, and "
                   "kernels will treat it as NCHW. .contiguous(memory_format=...) keeps such a tensor as "
                   "it is; .to(memory_format=...) gives it real channels-last strides.")
        raise AssertionError(f"{what} of shape {tuple(t.shape)} has strides {tuple(t.stride())}; channels-last "
                             f"strides are {expected}.{amb}\n"
                             "  Hint: model.to(memory_format=torch.channels_last) converts every 4-D parameter "
                             "and buffer; x.to(memory_format=torch.channels_last) the input.")


def check_to_channels_last(to_channels_last: Callable, *, seed: int = 0, width: int = 16,
                           blocks: tuple[int, ...] = (1, 1, 1), batch: int = 2, size: int = 32,
                           in_channels: int = 3, tap: bool = False, device=None) -> None:
    """``to_channels_last(model, x) -> (model, x)``: every 4-D weight and buffer and the input have
    channels-last strides (real ones, also where the shape is ambiguous), and the output equals
    the contiguous model's within float32 tolerance."""
    dev = pick_device(device)
    if in_channels == 3:
        model = small_resnet(seed=seed, width=width, blocks=blocks, tap=tap, device=dev)
    else:
        model = small_resnet_channels(seed=seed, in_channels=in_channels, width=width, blocks=blocks, tap=tap,
                                      device=dev)
    reference = copy.deepcopy(model)
    x = randn(batch, in_channels, size, size, seed=seed + 1, device=dev)
    got = call(to_channels_last, model, x.clone(), name="to_channels_last")
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise AssertionError(f"to_channels_last should return (model, x), got {describe(got)}.")
    got_model, got_x = got
    if not isinstance(got_model, nn.Module) or not isinstance(got_x, torch.Tensor):
        raise AssertionError(f"to_channels_last should return (model, x): a module and a tensor, got "
                             f"({describe(got_model)}, {describe(got_x)}).")
    four_d = [(f"parameter {n}", p) for n, p in got_model.named_parameters() if p.dim() == 4]
    four_d += [(f"buffer {n}", b) for n, b in got_model.named_buffers() if b.dim() == 4]
    if not four_d:
        raise AssertionError("the returned model has no 4-D weights at all: return the model you were given.")
    for what, t in four_d:
        _expect_channels_last(t, what)
    if tuple(got_x.shape) != tuple(x.shape):
        raise AssertionError(f"the returned input has shape {tuple(got_x.shape)}, expected {tuple(x.shape)}: "
                             "change its memory format, not its shape (no permute).")
    _expect_channels_last(got_x, "the returned input")
    with torch.no_grad(), _full_float32():
        expected = reference(x)
        out = got_model(got_x)
    assert_close(out, expected, rtol=1e-4, atol=1e-5, name="the channels-last model's output",
                 hint="only the memory format may change: same weights, same eval mode, same values.")
    ok(f"to_channels_last: {len(four_d)} weights and the input are channels-last, output equals the NCHW "
       f"model's (in_channels={in_channels}, width={width}, seed {seed})")


# -- the format checker ----------------------------------------------------------------------

class _ReferenceWatcher(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.losses: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if CL in [memory_format_of(t) for t in tensors_in((args, kwargs))] and \
                torch.contiguous_format in [memory_format_of(t) for t in tensors_in(out)]:
            self.losses.append(op_name(func))
        return out


@reference
def format_losses(model: nn.Module, x: torch.Tensor) -> list[str]:
    """The ops that lose channels-last when ``model`` (converted, as is ``x``) runs, in order."""
    model = model.to(memory_format=CL)
    with torch.no_grad(), _ReferenceWatcher() as watcher:
        model(x.to(memory_format=CL))
    return watcher.losses


def _same_op(got: str, expected: str) -> bool:
    return got == expected or expected.endswith("." + got)


def check_format_finder(find_format_loss: Callable, *, variant: str = "coords", seed: int = 0, width: int = 16,
                        batch: int = 2, size: int = 32, device=None) -> None:
    """``find_format_loss(model, x) -> str | None`` names the first op that turns a channels-last
    tensor into an NCHW one (as ``course.memory_format.op_name`` writes it; a dotted suffix such
    as ``'cat'`` is accepted too) in a model with a planted op, and returns None on a clean one."""
    if variant not in PLANTED_VARIANTS:
        raise ValueError(f"variant must be one of {PLANTED_VARIANTS}, got {variant!r}.")
    dev = pick_device(device)
    x = randn(batch, 3, size, size, seed=seed + 1, device=dev)
    losses = format_losses(planted_model(variant, seed=seed, width=width, device=dev), x)
    if not losses:  # pragma: no cover - a PyTorch that preserves the format everywhere
        raise RuntimeError(f"course bug: the planted model {variant!r} loses no format on {dev} "
                           f"with torch {torch.__version__}; please report it.")
    got = call(find_format_loss, planted_model(variant, seed=seed, width=width, device=dev), x.clone(),
               name="find_format_loss")
    if got is not None and not isinstance(got, str):
        raise AssertionError(f"find_format_loss should return the op's name (a str) or None, got {describe(got)}.")
    if got is None:
        raise AssertionError("find_format_loss returned None, but this model has an op that turns a channels-last "
                             "tensor into an NCHW one.\n  Hint: convert the model and the input to channels-last "
                             "first (to_channels_last), then run the model inside `with FormatWatcher() as w:`; "
                             "look at every tensor in args and kwargs (torch.cat takes a list).")
    if not _same_op(got, losses[0]):
        later = any(_same_op(got, name) for name in losses[1:])
        raise AssertionError(
            f"find_format_loss named {got!r}, but the first op that loses channels-last in this model is "
            f"another one.\n  Hint: " + ("that op loses the format too, but later: report the first one." if later
                                         else "an op loses the format when one of its inputs is channels-last and "
                                              "one of its 4-D outputs is NCHW (memory_format_of tells both; "
                                              "it returns None where the shape is ambiguous)."))
    clean = small_resnet(seed=seed, width=width, tap=True, device=dev)
    got_clean = call(find_format_loss, clean, x.clone(), name="find_format_loss")
    if got_clean is not None:
        raise AssertionError(f"find_format_loss named {got_clean!r} on a clean small_resnet, which keeps "
                             "channels-last all the way: no op should be reported (return None).\n  Hint: only "
                             "4-D outputs with C > 1 and H*W > 1 can lose the format (memory_format_of returns "
                             "None for the rest: pooled (N, C, 1, 1) maps, flattened features, logits).")
    record([_same_op(got, losses[0]), got_clean is None], [True, True],
           "find_format_loss: the first op that loses the format, and none in a clean model")
    ok(f"find_format_loss names {got!r} in planted model {variant!r} and nothing in a clean one "
       f"(width={width}, seed {seed})")


# -- autocast ----------------------------------------------------------------------------------

def _low_precision(dev: torch.device) -> tuple[torch.dtype, ...]:
    return (torch.bfloat16,) if dev.type == "cpu" else (torch.float16, torch.bfloat16)


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def check_autocast_inference(autocast_inference: Callable, *, seed: int = 0, width: int = 16, batch: int = 4,
                             size: int = 48, device=None) -> None:
    """``autocast_inference(model, x)`` runs the model under ``torch.autocast`` (bfloat16 on a CPU,
    float16 or bfloat16 on CUDA), with no autograd graph, leaving the model's weights in float32;
    its output is within low-precision tolerance of float32."""
    dev = pick_device(device)
    model = small_resnet(seed=seed, width=width, device=dev).to(memory_format=CL)
    x = randn(batch, 3, size, size, seed=seed + 1, device=dev).to(memory_format=CL)
    with torch.no_grad():
        ref = model(x)
    seen = []
    hook = model.stem.register_forward_pre_hook(
        lambda *_: seen.append((torch.is_autocast_enabled(dev.type), torch.get_autocast_dtype(dev.type))))
    try:
        out = call(autocast_inference, model, x, name="autocast_inference")
    finally:
        hook.remove()
    allowed = _low_precision(dev)
    names = " or ".join(str(d).replace("torch.", "") for d in allowed)
    if not isinstance(out, torch.Tensor):
        raise AssertionError(f"autocast_inference should return the model's output, got {describe(out)}.")
    if not seen:
        raise AssertionError("autocast_inference never ran the model it was given.")
    enabled, dtype = seen[0]
    if not enabled:
        raise AssertionError(f"the model ran without autocast on {dev.type}.\n  Hint: with torch.autocast("
                             f"device_type=x.device.type, dtype=...): return model(x)")
    if dtype not in allowed:
        raise AssertionError(f"autocast ran in {dtype}; on {dev.type} this lesson uses {names}.")
    wrong = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
    if wrong:
        dtype_now = model.get_parameter(wrong[0]).dtype
        raise AssertionError(f"the model's weights are no longer float32 ({wrong[0]} is {dtype_now}). Autocast "
                             "picks each op's precision on the fly; leave the model as it is.")
    if out.requires_grad:
        raise AssertionError("the output carries an autograd graph: for inference, run under torch.inference_mode() "
                             "(or torch.no_grad()), which saves memory and time.")
    if out.dtype not in allowed:
        raise AssertionError(f"the output is {out.dtype}; under autocast the final linear layer returns {names}.")
    err = _relative_error(out, ref)
    bar = 3e-2 if dtype == torch.bfloat16 else 1e-2
    if err > bar:
        raise AssertionError(f"the output differs from float32 by {err:.2%} (relative, whole tensor); "
                             f"{dtype} should stay within {bar:.0%}.")
    assert_close(float(err), 0.0, atol=float(bar), rtol=0.0, name="autocast_inference's relative error")
    ok(f"autocast_inference runs in {str(dtype).replace('torch.', '')}, weights stay float32, output within "
       f"{err:.2%} of float32 (width={width}, seed {seed})")


# -- speed -----------------------------------------------------------------------------------

def check_channels_last_speed(to_channels_last: Callable, autocast_inference: Callable, *,
                              bars: Mapping[str, float], width: int, blocks: tuple[int, ...], batch: int, size: int,
                              seed: int = 0, amp: bool | None = None, rounds: int = 9, min_run_time: float = 0.2,
                              attempts: int = 3, device=None) -> SpeedReport:
    """Channels-last inference (model and input converted with the learner's ``to_channels_last``)
    beats the same model in NCHW by the device's bar, timed side by side on fresh inputs every
    round, with every output checked. With ``amp`` (default: on CUDA) both run under the
    learner's ``autocast_inference``; without it, in float32 under ``torch.no_grad()``.

    A shared machine (Binder, a CI runner) can stall one side of a round; a measurement below
    the bar is repeated, up to ``attempts`` in all, and the best one is judged. A technique
    that is really slower stays below the bar in every attempt."""
    dev = pick_device(device)
    amp = dev.type == "cuda" if amp is None else amp
    model = small_resnet(seed=seed, width=width, blocks=blocks, device=dev)
    reference = copy.deepcopy(model)
    model_cl, _ = call(to_channels_last, copy.deepcopy(model), randn(1, 3, size, size, seed=seed, device=dev),
                       name="to_channels_last")
    counter = iter(range(10**9))

    def inputs():
        x = randn(batch, 3, size, size, seed=seed + 7 * next(counter), device=dev)
        _, x_cl = to_channels_last(model_cl, x.clone())
        return x, x_cl

    if amp:
        contiguous = lambda x, x_cl: call(autocast_inference, model, x, name="autocast_inference")  # noqa: E731
        channels_last = lambda x, x_cl: autocast_inference(model_cl, x_cl)  # noqa: E731
    else:
        contiguous = lambda x, x_cl: model(x)  # noqa: E731
        channels_last = lambda x, x_cl: model_cl(x_cl)  # noqa: E731

    def check(name, out, args):
        ref = reference(args[0])
        if amp or dev.type == "cuda":  # AMP, or TF32 convolutions: compare the whole tensor's error
            err, limit = _relative_error(out, ref), (3e-2 if amp else 5e-3)
            if err > limit:
                raise AssertionError(f"{name} output while timing differs from float32 by {err:.2%} "
                                     f"(at most {limit:.1%} expected).")
        else:
            assert_close(out, ref, rtol=1e-4, atol=1e-5, name=f"{name} output while timing")

    if memory_format_of(next(p for p in model_cl.parameters() if p.dim() == 4)) is not CL:
        raise AssertionError("to_channels_last returned a model whose weights are not channels-last.")
    bar = speed_bar(bars, dev)
    def measure():
        with torch.no_grad():
            return compare({"NCHW": contiguous, "channels-last": channels_last}, inputs=inputs, check=check,
                           rounds=rounds, min_run_time=min_run_time, device=dev,
                           until=("channels-last", "NCHW", bar))

    best = best_of(measure, "channels-last", bar, attempts)
    best.show()
    expect_speedup(best, "channels-last", over="NCHW", bars=bars,
                   hint="convert both the model and the input; check with the FormatWatcher that no op falls "
                        "back to NCHW on the way.")
    return best

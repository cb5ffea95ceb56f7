"""Checks for lesson 03_channels_last: strides by hand, the channels-last contiguity rule, the
conversion of a model and its input, a checker that names the first op losing the format, BF16 /
FP16 autocast, and the repair of the op that loses the format in a CoordConv block, with its
measured speedup over the planted block.

Shapes and stride patterns come from ``seed``; models are ``course.models`` ResNets and
``course.memory_format`` planted models, so the learner chooses none of the inputs.

Under the grader every check here runs in the judge (``SERVED``). Models cross as recipes and
tensors with their exact strides (:mod:`course.wire`), so the learner's process builds the same
model and sees the same layouts; a converted model comes back as its state, which the judge
loads into its own copy of the architecture (``load_state_dict(assign=True)`` keeps the learner's
tensors, strides and all) and inspects and runs itself. The speed check times the learner's
repaired CoordConv in the learner's process against the course's planted one in the judge, never
at once, on fresh inputs drawn from seeds on both sides (:func:`course.checks.common.served_speedup`).
What only the learner's process can see runs there as the course's probes
(:func:`course.remote.probe`): which torch functions a "by hand" answer called, whether autocast
was on at every forward of the model (and on how many images), which ops the repaired CoordConv ran
and the strides of the 4-D tensors they wrote; those facts are that process's word, while every
value (strides, booleans, outputs, their dtype and memory format) is compared here. Whether the
repaired CoordConv keeps the format on the way is asked twice: before the clock, on inputs of the
timed sizes (its output's format, checked here, and the ops that process saw: a convolution, and no
tensor of x's size written in NCHW), and by the judge's clock (a block that writes NCHW inside and
converts back is as slow as the planted one, unless it replaces the convolution)."""

from __future__ import annotations

import contextlib
import random
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from course.checks.common import TorchCalls, call, grader_references, ok, record, served_speedup, stored_answers
from course.checks.witnesses import alone
from course.data import randn
from course.devices import pick_device
from course.memory_format import (PLANTED_VARIANTS, WEIGHTS_WITNESS_OUT, ChannelGate, ChannelPermute, CircularConv,
                                  CoordChannels, Tidy, autocast_witness, channels_last_strides_of, coord_conv_inputs,
                                  coord_conv_planted, coordinate_planes, float32_weights_witness, list_probe,
                                  memory_format_of, planted_model, tensors_in)
from course.remote import recipe
from course.models import small_resnet, small_resnet_channels
from course.numerics import assert_close, describe
from course.bare import as_tuples, outcome_said, outcome_value, run_bare
from course.remote import probe, prober
from course.timing import SpeedReport
from course.wire import ModuleState

#: Checks the grader runs in its judge process, calling the learner's code across the boundary.
SERVED = ("check_strides", "check_is_channels_last_contiguous", "check_to_channels_last", "check_format_finder",
          "check_autocast_inference", "check_coord_conv", "check_coord_conv_speed")

__all__ = ["autocast_case", "by_hand_cases", "coord_conv_case", "check_autocast_inference", "check_coord_conv",
           "check_coord_conv_speed",
           "check_format_finder", "check_is_channels_last_contiguous", "check_strides", "check_to_channels_last",
           "format_decoy"]

CL = torch.channels_last
FIXED_SHAPES = [(1, 1, 1, 1), (2, 3, 4, 5), (8, 3, 224, 224), (4, 1, 8, 8), (4, 16, 1, 1), (1, 64, 7, 1)]

#: What the lesson's own calls compare with in a learner's copy (``python -m course.references`` writes it).
DATA_FILE = "03_memory_format.pt"


# -- stride arithmetic ---------------------------------------------------------------------

@prober
def by_hand_cases(fn: Callable, name: str, cases: list) -> list:
    """The learner's side of the "by hand" checks: ``fn(*case)`` for every case, each with the
    names of the torch functions and ops that call used (it should use none), made while no other
    thread of the process works (:func:`course.checks.witnesses.alone`)."""
    def run() -> list:
        out = []
        for case in cases:
            with TorchCalls(name) as seen:
                got = call(fn, *case, name=name)
            out.append((got, sorted(set(seen.names))))
            if seen.names:  # the verdict is in: the larger shapes need not be tried with torch
                break
        return out

    return alone(run, label=name)


def _by_hand(fn: Callable, cases: list, *, name: str) -> list:
    """What ``fn`` returned for every case (run where ``fn`` lives, see :func:`by_hand_cases`),
    after checking that no call used torch."""
    results = probe(fn, by_hand_cases, name, [tuple(c) for c in cases])
    if not (isinstance(results, list) and 0 < len(results) <= len(cases)
            and all(isinstance(r, tuple) and len(r) == 2 and isinstance(r[1], list) for r in results)):
        raise AssertionError(f"{name}: the answers came back malformed (expected one per case).")
    for got, used in results:
        if used:
            raise AssertionError(f"{name} called torch ({', '.join(map(str, used))[:300]}). Work it out by hand: "
                                 "plain Python arithmetic on the shape (and strides), no tensors.")
    if len(results) != len(cases):
        raise AssertionError(f"{name}: the answers came back malformed (expected one per case).")
    answers = [got for got, _ in results]
    # Under the grader, the same function run again where there is no torch to call (the bare host):
    # the watcher above is the learner's process's word, this is the kernel's.
    bare = run_bare(fn, [list(c) for c in cases], name=name)
    for case, got, outcome in zip(cases, answers, bare or []):
        if "raised" in outcome:
            raise AssertionError(f"{name}{tuple(case)}, run without torch: {outcome_said(outcome)}")
        if outcome_value(outcome) != as_tuples(got):
            raise AssertionError(f"{name}{tuple(case)} returned {got!r} in your notebook's process, and "
                                 f"{outcome_value(outcome)!r} run without torch: work it out by hand, the same way "
                                 "every time.")
    return answers



def _shapes(seed: int, cases: int) -> list[tuple[int, int, int, int]]:
    """The fixed shapes, ``cases`` drawn from small sizes (the 1s that make channels-last
    ambiguous), and a fifth as many again with sizes up to 4096: a table of strides worked out
    with torch before the call (every shape of small sizes is only a few thousand) cannot hold them."""
    rng = random.Random(seed)
    sizes = [1, 1, 2, 3, 4, 5, 7, 16]
    small = [tuple(rng.choice(sizes) for _ in range(4)) for _ in range(cases)]
    large = [tuple(rng.randint(1, 4096) for _ in range(4)) for _ in range(max(2, cases // 5))]
    return FIXED_SHAPES + small + large


def _as_strides(got, fn_name: str, shape) -> tuple[int, ...]:
    if isinstance(got, torch.Tensor) or not isinstance(got, (tuple, list)) or \
            not all(isinstance(s, int) and not isinstance(s, bool) for s in got):
        raise AssertionError(f"{fn_name}({shape}) should return a tuple of 4 ints, got {describe(got)}.")
    return tuple(got)


def check_strides(nchw_strides: Callable, nhwc_strides: Callable, *, seed: int = 0, cases: int = 25) -> None:
    """``nchw_strides(shape)`` and ``nhwc_strides(shape)`` return the strides (in elements) of a
    dense ``(N, C, H, W)`` tensor in NCHW (contiguous) and NHWC (channels-last) order."""
    seen, wanted = [], []
    shapes = _shapes(seed, cases)
    answers = {label: _by_hand(fn, [(shape,) for shape in shapes], name=label)
               for fn, label in ((nchw_strides, "nchw_strides"), (nhwc_strides, "nhwc_strides"))}
    for i, shape in enumerate(shapes):
        for label, fmt, hint in (
                ("nchw_strides", torch.contiguous_format,
                 "in NCHW, W is innermost (stride 1); each dimension's stride is the product of the sizes "
                 "to its right: (C*H*W, H*W, W, 1)."),
                ("nhwc_strides", CL,
                 "in NHWC the order in memory is N, H, W, C: C is innermost (stride 1), then W steps over "
                 "C elements, H over W*C, N over H*W*C. Strides stay in (N, C, H, W) order.")):
            expected = tuple(torch.empty(shape, memory_format=fmt, device="meta").stride())
            got = _as_strides(answers[label][i], label, shape)
            seen.append(list(got))
            wanted.append(list(expected))
            if got != expected:
                raise AssertionError(f"{label}({shape}) returned {got}; PyTorch's strides are {expected}.\n"
                                     f"  Hint: {hint}")
    record(seen, wanted, "strides by hand")
    ok(f"nchw_strides and nhwc_strides match PyTorch on {len(shapes)} shapes (seed {seed})")


def _stride_cases(seed: int, cases: int) -> list:
    """Exercise 2's ``(shape, strides)`` cases (:func:`course.references.memory_format.stride_cases`);
    in a learner's copy, the stored ones of the lesson's own call."""
    refs = grader_references("memory_format")
    if refs is None:
        return stored_answers(DATA_FILE, seed=seed, cases=cases)["stride_cases"]
    return refs.stride_cases(seed, cases)


def check_is_channels_last_contiguous(fn: Callable, *, seed: int = 0, cases: int = 80) -> None:
    """``fn(shape, strides) -> bool`` equals ``x.is_contiguous(memory_format=torch.channels_last)``
    for a tensor with that shape and those strides, on generated cases (NCHW, NHWC, permuted,
    sliced, broadcast) including the ambiguous ``(N, 1, H, W)`` and ``(N, C, 1, 1)``."""
    gots, wants = [], []
    stride_cases = _stride_cases(seed, cases)
    answers = _by_hand(fn, [(tuple(shape), tuple(strides)) for shape, strides in stride_cases],
                       name="is_channels_last_contiguous")
    for (shape, strides), got in zip(stride_cases, answers):
        expected = torch.empty_strided(shape, strides, device="meta").is_contiguous(memory_format=CL)
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
    ok(f"is_channels_last_contiguous agrees with PyTorch on {len(stride_cases)} shapes and strides (seed {seed})")


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


def _converted(got, like: nn.Module, build: Callable[[], nn.Module]) -> tuple[nn.Module, torch.Tensor]:
    """``to_channels_last``'s ``(model, x)`` as a module and a tensor here. A model that crossed
    the boundary comes as its state (:class:`course.wire.ModuleState`): it must be the architecture
    it was given (same type, same names, shapes and dtypes), and is loaded into a fresh copy of it
    with its own tensors (``assign=True``: their strides are what the learner's code made)."""
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise AssertionError(f"to_channels_last should return (model, x), got {describe(got)}.")
    got_model, got_x = got
    if not isinstance(got_model, (nn.Module, ModuleState)) or not isinstance(got_x, torch.Tensor):
        raise AssertionError(f"to_channels_last should return (model, x): a module and a tensor, got "
                             f"({describe(got_model)}, {describe(got_x)}).")
    kind = f"{type(like).__module__}.{type(like).__qualname__}"
    got_kind = (got_model.type_name if isinstance(got_model, ModuleState)
                else f"{type(got_model).__module__}.{type(got_model).__qualname__}")
    if got_kind != kind:
        raise AssertionError(f"to_channels_last returned a {got_kind.rpartition('.')[2]}, not the "
                             f"{type(like).__name__} it was given: convert the model itself (its memory format), "
                             "don't wrap or replace it.")
    if isinstance(got_model, nn.Module):
        return got_model, got_x
    expected = like.state_dict()
    state = got_model.state
    if sorted(state) != sorted(expected):
        missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        raise AssertionError(f"the returned model's weights are not the ones it was given (missing {missing[:3]}, "
                             f"unexpected {extra[:3]}): convert the model, don't rebuild it.")
    for name, t in expected.items():
        if state[name].shape != t.shape or state[name].dtype != t.dtype or state[name].device.type == "meta":
            raise AssertionError(f"the returned model's {name} is {describe(state[name])}; it was "
                                 f"{describe(t)}. Only the memory format may change.")
    model = build()
    dev = next(iter(expected.values())).device
    model.load_state_dict({k: t.to(dev) for k, t in state.items()}, assign=True, strict=True)
    return model, got_x.to(dev)


def _four_d(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    four_d = [(f"parameter {n}", p) for n, p in model.named_parameters() if p.dim() == 4]
    four_d += [(f"buffer {n}", b) for n, b in model.named_buffers() if b.dim() == 4]
    if not four_d:
        raise AssertionError("the returned model has no 4-D weights at all: return the model you were given.")
    return four_d


def check_to_channels_last(to_channels_last: Callable, *, seed: int = 0, width: int = 16,
                           blocks: tuple[int, ...] = (1, 1, 1), batch: int = 2, size: int = 32,
                           in_channels: int = 3, tap: bool = False, device=None) -> None:
    """``to_channels_last(model, x) -> (model, x)``: every 4-D weight and buffer and the input have
    channels-last strides (real ones, also where the shape is ambiguous), and the output equals
    the contiguous model's within float32 tolerance."""
    dev = pick_device(device)
    if in_channels == 3:
        build = lambda: small_resnet(seed=seed, width=width, blocks=blocks, tap=tap, device=dev)  # noqa: E731
    else:
        build = lambda: small_resnet_channels(seed=seed, in_channels=in_channels, width=width,  # noqa: E731
                                              blocks=blocks, tap=tap, device=dev)
    reference = build()
    x = randn(batch, in_channels, size, size, seed=seed + 1, device=dev)
    got_model, got_x = _converted(call(to_channels_last, build(), x.clone(), name="to_channels_last"),
                                  reference, build)
    four_d = _four_d(got_model)
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

#: Ops whose tensors arrive in a list or tuple: a watcher that reads only direct arguments misses them.
LIST_OPS = {"cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack", "cartesian_prod",
            "block_diag", "broadcast_tensors", "meshgrid"}


def _same_op(got: str, expected: str) -> bool:
    return got == expected or expected.endswith("." + got)


def finder_input(*, seed: int, batch: int, size: int, device=None) -> torch.Tensor:
    """The input :func:`check_format_finder` runs the models on."""
    return randn(batch, 3, size, size, seed=seed + 1, device=pick_device(device))


def _finder_answers(x: torch.Tensor, *, variant: str, seed: int, width: int, batch: int,
                    size: int) -> tuple[list[str], list[str]]:
    """The ops that lose the format on ``x`` (:func:`finder_input`), in order, in the planted model and
    in :func:`course.memory_format.list_probe` (:func:`course.references.memory_format.format_losses`);
    in a learner's copy, the stored ones of the lesson's own call."""
    refs = grader_references("memory_format")
    if refs is None:
        data = stored_answers(DATA_FILE, variant=variant, seed=seed, width=width, batch=batch, size=size)
        return data["losses"], data["list_probe_losses"]
    dev = x.device
    return (refs.format_losses(planted_model(variant, seed=seed, width=width, device=dev), x),
            refs.format_losses(list_probe(device=dev), x))


def _blind_to_lists(find_format_loss: Callable, x: torch.Tensor, expected: str, dev: torch.device) -> bool:
    """Whether ``find_format_loss`` misses the loss of a model whose only loss is a ``torch.cat``
    (:func:`course.memory_format.list_probe`, where the course's watcher sees ``expected``); a
    finder that sees lists names the cat there."""
    seen = call(find_format_loss, list_probe(device=dev), x.clone(), name="find_format_loss")
    return not (isinstance(seen, str) and _same_op(seen, expected))


class _OutOfOrder(nn.Module):
    """The planted modules, listed in one order and run in another (drawn from ``seed``: the first
    run is the gate, the permutation or the circular convolution, never the first listed nor the
    CoordConv of the default planted model): the first op that loses the format is the first one *run*, which only a
    watcher of the running model sees (a table from the modules' classes to their ops answers the
    first one listed)."""

    def __init__(self, channels: int, seed: int):
        super().__init__()
        self.tidy, self.gate = Tidy(), ChannelGate()
        self.permute, self.circular = ChannelPermute(channels, seed), CircularConv(channels)
        self.coords = CoordChannels(channels)
        rng = random.Random(seed)
        first = rng.choice(["gate", "permute", "circular"])  # never the coords of the default planted model
        later = [name for name in ("gate", "permute", "circular", "coords") if name != first]
        rng.shuffle(later)
        self._calls = tuple([first] + later + ["tidy"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self._calls:
            x = getattr(self, name)(x)
        return x


@recipe
def format_decoy(*, seed: int = 0, width: int = 16, device=None) -> nn.Module:
    """A seeded ``small_resnet`` (eval mode) with :class:`_OutOfOrder` after a block that ``seed`` picks:
    every planted module at once, run in another order than they are listed. How
    :func:`check_format_finder` tells a watcher from a lookup of the modules' classes."""
    model = small_resnet(seed=seed, width=width, blocks=(1, 1, 1), device="cpu")
    stages = list(model.stages)
    where = seed % max(len(stages) - 1, 1)
    channels = [b.second.conv.out_channels for b in stages]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 29)
        decoy = _OutOfOrder(channels[where], seed)
    model.stages = nn.Sequential(*(stages[: where + 1] + [decoy] + stages[where + 1:]))
    return model.eval().to(pick_device(device))


def _decoy_loss(find_format_loss: Callable, x: torch.Tensor, *, seed: int, width: int, dev: torch.device) -> None:
    """Under the grader (and in the tests), where the course's watcher is at hand: ``find_format_loss``
    names the first op that loses the format in :func:`format_decoy`, whose format-losing modules run
    in another order than they are listed. (A learner's copy has no answer stored for it: skipped.)"""
    refs = grader_references("memory_format")
    if refs is None:
        return
    decoy_seed = seed + 1
    expected = refs.format_losses(format_decoy(seed=decoy_seed, width=width, device=dev), x)
    if not expected:  # pragma: no cover - a PyTorch that preserves the format everywhere
        raise RuntimeError(f"course bug: the decoy model loses no format on {dev} with torch {torch.__version__}.")
    got = call(find_format_loss, format_decoy(seed=decoy_seed, width=width, device=dev), x.clone(),
               name="find_format_loss")
    if not (isinstance(got, str) and _same_op(got, expected[0])):
        later = isinstance(got, str) and any(_same_op(got, name) for name in expected[1:])
        raise AssertionError(
            f"find_format_loss named {got!r} in a second planted model, where the first op that loses channels-last "
            f"is {expected[0]!r}: expected the first op that loses the format when the model runs. This model holds "
            "several format-losing modules and runs them in another order than they are listed"
            + (f", so {got!r} loses the format too, but later" if later else "") + ".\n  Hint: convert the model "
            "and x, run the model inside `with FormatWatcher() as w:` and report w.losses[0]; which modules a "
            "model holds, or their classes, does not tell which op runs first.")


def check_format_finder(find_format_loss: Callable, *, variant: str = "coords", seed: int = 0, width: int = 16,
                        batch: int = 2, size: int = 32, device=None) -> None:
    """``find_format_loss(model, x) -> str | None`` names the first op that turns a channels-last
    tensor into an NCHW one (as ``course.memory_format.op_name`` writes it; a dotted suffix such
    as ``'cat'`` is accepted too) in a model with a planted op, and returns None on a clean one; under
    the grader also in :func:`format_decoy`, whose format-losing modules run in another order than they
    are listed (a lookup of the modules' classes, watching no op, names the wrong one)."""
    if variant not in PLANTED_VARIANTS:
        raise ValueError(f"variant must be one of {PLANTED_VARIANTS}, got {variant!r}.")
    dev = pick_device(device)
    x = finder_input(seed=seed, batch=batch, size=size, device=dev)
    losses, (list_loss,) = _finder_answers(x, variant=variant, seed=seed, width=width, batch=batch, size=size)
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
        listed = losses[0].rsplit(".", 1)[-1] in LIST_OPS
        if later and listed and _blind_to_lists(find_format_loss, x, list_loss, dev):  # the evidence: missed a listed op
            raise AssertionError(
                f"find_format_loss named {got!r}, an op that loses the format later. The first one takes its "
                "tensors in a list (as torch.cat does), and your watcher did not see them: it looks only at "
                "tensors passed directly.\n  Hint: look inside lists and tuples in args and kwargs too "
                "(course.memory_format.tensors_in(args, kwargs) gives every tensor).")
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
    _decoy_loss(find_format_loss, x, seed=seed, width=width, dev=dev)
    record([_same_op(got, losses[0]), got_clean is None], [True, True],
           "find_format_loss: the first op that loses the format, and none in a clean model")
    ok(f"find_format_loss names {got!r} in planted model {variant!r} and nothing in a clean one "
       f"(width={width}, seed {seed})")


# -- autocast ----------------------------------------------------------------------------------

def _low_precision(dev: torch.device) -> tuple[torch.dtype, ...]:
    return (torch.bfloat16,) if dev.type == "cpu" else (torch.float16, torch.bfloat16)


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


#: How many module forwards :func:`autocast_case` reports (a small_resnet's forward runs about thirty).
AUTOCAST_NOTES = 400


@prober
def autocast_case(autocast_inference: Callable, model: nn.Module, x: torch.Tensor) -> tuple:
    """The learner's side of :func:`check_autocast_inference`: runs ``autocast_inference`` on the
    model (converted to channels-last, as the check built it) while hooks note, for *every* forward
    of the model and of each of its modules during the call (the first ``AUTOCAST_NOTES``), whether
    autocast was on and in which dtype, the module's name (``""`` for the model itself) and how many
    images its input held; returns the output, whether it carries an autograd graph, those notes,
    and the first parameter that is no longer float32."""
    model = model.to(memory_format=CL)  # a model that crossed as its recipe arrives in NCHW
    seen: list = []
    kind = x.device.type

    def note(name: str):
        def hook(_module, args, kwargs):
            if len(seen) < AUTOCAST_NOTES:
                first = next(iter(list(args) + list(kwargs.values())), None)
                images = int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() > 0 else -1
                seen.append((torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind), name, images))
        return hook

    hooks = [m.register_forward_pre_hook(note(n), with_kwargs=True) for n, m in model.named_modules()]
    try:
        out = call(autocast_inference, model, x, name="autocast_inference")
    finally:
        for hook in hooks:
            hook.remove()
    if not isinstance(out, torch.Tensor):
        raise AssertionError(f"autocast_inference should return the model's output, got {describe(out)}.")
    wrong = [(n, p.dtype) for n, p in model.named_parameters() if p.dtype != torch.float32][:1]
    return out.detach(), bool(out.requires_grad), seen, wrong


def _autocast_notes(seen: list, batch: int, allowed: tuple, dev: torch.device) -> torch.dtype:
    """What :func:`autocast_case` noted of the model's forwards (``(autocast on, its dtype, module
    name, images)`` for each), judged: every forward of the model and of its modules ran under
    autocast in one of the ``allowed`` dtypes (a token forward under autocast beside the real work
    in float32 fails), and the model's own forwards held the whole batch between them. Returns the
    dtype autocast ran in. (Notes of two fields, autocast on and its dtype, are judged on those.)"""
    names = " or ".join(str(d).replace("torch.", "") for d in allowed)
    if not seen:
        raise AssertionError("autocast_inference never ran the model it was given.")
    notes = [(n + ("", -1))[:4] if isinstance(n, tuple) and len(n) == 2 else n for n in seen]
    if not all(isinstance(n, tuple) and len(n) == 4 and isinstance(n[2], str) and type(n[3]) is int for n in notes):
        raise AssertionError("autocast_inference: the answer came back malformed.")
    hint = ("  Hint: run the whole batch through the model once, inside the autocast block:\n"
            "    with torch.inference_mode(), torch.autocast(device_type=x.device.type, dtype=...):\n"
            "        return model(x)")
    for enabled, dtype, name, images in notes:
        where = f"its module {name!r}" if name else "the model"
        if enabled is not True:
            on = [n for n in notes if n[0] is True]
            raise AssertionError(
                f"{where} ran on {images} image(s) without autocast on {dev.type}: expected every forward of the "
                f"model during the call to run under torch.autocast ({names}), and this one ran outside it"
                + (f" (a forward on {on[0][3]} image(s) did run under autocast: an autocast call beside the real "
                   "work does not make the real work autocast)" if on else "") + ".\n" + hint)
        if dtype not in allowed:
            raise AssertionError(f"autocast ran in {dtype}; on {dev.type} this lesson uses {names}.")
    model_notes = [images for _, _, name, images in notes if name == "" and images >= 0]
    if model_notes and sum(model_notes) < batch:
        raise AssertionError(
            f"under autocast the model ran on {sum(model_notes)} image(s) in all, and the input holds {batch}: "
            "expected the model to process the whole batch under autocast (the output for every image comes "
            "from such a forward).\n" + hint)
    return notes[0][1]


def check_autocast_inference(autocast_inference: Callable, *, seed: int = 0, width: int = 16, batch: int = 4,
                             size: int = 48, device=None) -> None:
    """``autocast_inference(model, x)`` runs the model under ``torch.autocast`` (bfloat16 on a CPU,
    float16 or bfloat16 on CUDA), with no autograd graph, leaving the model's weights in float32;
    its output is within low-precision tolerance of float32."""
    dev = pick_device(device)
    reference = small_resnet(seed=seed, width=width, device=dev).to(memory_format=CL)
    x = randn(batch, 3, size, size, seed=seed + 1, device=dev).to(memory_format=CL)
    with torch.no_grad():
        ref = reference(x)
    got = probe(autocast_inference, autocast_case, small_resnet(seed=seed, width=width, device=dev), x)
    if not (isinstance(got, tuple) and len(got) == 4 and isinstance(got[0], torch.Tensor) and type(got[1]) is bool
            and isinstance(got[2], list) and isinstance(got[3], list)):
        raise AssertionError("autocast_inference: the answer came back malformed.")
    out, carries_graph, seen, wrong = got
    allowed = _low_precision(dev)
    names = " or ".join(str(d).replace("torch.", "") for d in allowed)
    dtype = _autocast_notes(seen, x.shape[0], allowed, dev)
    if wrong:
        name, dtype_now = wrong[0] if isinstance(wrong[0], tuple) and len(wrong[0]) == 2 else ("a weight", "?")
        raise AssertionError(f"the model's weights are no longer float32 ({name} is {dtype_now}). Autocast "
                             "picks each op's precision on the fly; leave the model as it is.")
    if carries_graph:
        raise AssertionError("the output carries an autograd graph: for inference, run under torch.inference_mode() "
                             "(or torch.no_grad()), which saves memory and time.")
    if out.dtype not in allowed:
        raise AssertionError(f"the output is {out.dtype}; under autocast the final linear layer returns {names}.")
    if out.shape != ref.shape:
        raise AssertionError(f"autocast_inference returned {describe(out)}; the model's output is "
                             f"{describe(ref)}.")
    err = _relative_error(out, ref)
    bar = 3e-2 if dtype == torch.bfloat16 else 1e-2
    if err > bar:
        raise AssertionError(f"the output differs from float32 by {err:.2%} (relative, whole tensor); "
                             f"{dtype} should stay within {bar:.0%}.")
    assert_close(float(err), 0.0, atol=float(bar), rtol=0.0, name="autocast_inference's relative error")
    # From outside, whatever the learner's process reports: a convolution that computes x - 1 on
    # x = 1 + 2**-12 gives 0 under autocast (its input rounds to 1) and 2**-12 in float32.
    probe_x = torch.full((1, 1, 4, 4), 1.0 + 2.0 ** -12, device=dev)
    witness = call(autocast_inference, autocast_witness(device=dev), probe_x, name="autocast_inference")
    if not isinstance(witness, torch.Tensor) or witness.shape != probe_x.shape:
        raise AssertionError(f"autocast_inference should return the model's output, got {describe(witness)}.")
    if float(witness.detach().double().abs().max()) > 2.0 ** -13:
        raise AssertionError(
            f"the model's convolutions did not run in {names}: a convolution computing x - 1 on x = 1 + 2**-12 "
            f"returned {float(witness.detach().double().abs().max()):.2e} (float32 keeps the difference; under "
            "autocast the input rounds to 1 and the result is 0).\n  Hint: run the model itself inside "
            "torch.autocast(...); casting its output (or its input) afterwards is not autocast.")
    # From outside too: float32 statistics that bfloat16 or float16 would round away (float32_weights_witness),
    # and the autograd flag every output crosses with (the witnesses' parameters require grad).
    ones = torch.ones(1, 1, 4, 4, device=dev)
    weights = call(autocast_inference, float32_weights_witness(device=dev), ones, name="autocast_inference")
    if not isinstance(weights, torch.Tensor) or weights.shape != ones.shape:
        raise AssertionError(f"autocast_inference should return the model's output, got {describe(weights)}.")
    value = float(weights.detach().double().flatten()[0])
    if not abs(value - WEIGHTS_WITNESS_OUT) <= 2.0 ** -6:
        raise AssertionError(
            f"the model's weights did not stay float32: a BatchNorm whose running mean is 1 + 2**-12 (variance "
            f"2**-20) returned {value:.4g} on an input of ones, where its float32 statistics give "
            f"{WEIGHTS_WITNESS_OUT} (in {names} the mean rounds to 1, and the output to 0). Autocast picks each "
            "op's precision on the fly and keeps the weights as they are; leave the model as it is.")
    if witness.requires_grad or weights.requires_grad:
        raise AssertionError("the output carries an autograd graph (it came back requiring grad): for inference, "
                             "run under torch.inference_mode() (or torch.no_grad()), which saves memory and time.")
    ok(f"autocast_inference runs in {str(dtype).replace('torch.', '')}, weights stay float32, output within "
       f"{err:.2%} of float32 (width={width}, seed {seed})")


# -- the op that costs the speed, repaired ------------------------------------------------------

def _coord_cases(seed: int) -> list[tuple[tuple[int, int, int, int], bool]]:
    """Shapes ``(N, C, H, W)`` with C, H, W > 1 (formats that the strides can tell apart), and
    whether ``x`` is channels-last; the first case always is, one case is NCHW."""
    rng = random.Random(seed)
    cases = [((rng.randint(1, 3), rng.randint(2, 16), rng.randint(2, 9), rng.randint(2, 9)), i != 1)
             for i in range(4)]
    return cases


def _coord_variants(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the usual slips compute, in float64, to name the one a wrong answer matches."""
    ys, xs = coordinate_planes(x)
    y01, x01 = (ys + 1) / 2, (xs + 1) / 2
    return {
        "the y and x planes are swapped: the row coordinate (y, along H) comes first, then the column (x, along W)":
            F.conv2d(torch.cat([x, xs, ys], 1), weight, bias),
        "the coordinate planes come before x's channels: they go after them (torch.cat([x, planes], dim=1))":
            F.conv2d(torch.cat([ys, xs, x], 1), weight, bias),
        "the coordinates run from 0 to 1: they run from -1 to 1 (torch.linspace(-1, 1, steps))":
            F.conv2d(torch.cat([x, y01, x01], 1), weight, bias),
        "the bias is missing": F.conv2d(torch.cat([x, ys, xs], 1), weight),
    }


#: How many ops :func:`coord_conv_case` reports (the course's repair runs about a dozen).
COORD_OPS = 200


@prober
def coord_conv_case(coord_conv: Callable, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> tuple:
    """The learner's side of :func:`check_coord_conv` and :func:`check_coord_conv_speed`: runs
    ``coord_conv(x, weight, bias)`` while a ``TorchDispatchMode`` notes every ATen op it ran, with the
    shape and strides of each 4-D tensor the op returned; returns the output and those notes (the
    first ``COORD_OPS``, after how many ops ran in all)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: list = []
    count = [0]

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            count[0] += 1
            if len(ops) < COORD_OPS:
                ops.append((str(func._schema.name), [(tuple(t.shape), tuple(t.stride())) for t in tensors_in(out)
                                                      if isinstance(t, torch.Tensor) and t.dim() == 4]))
            return out

    with Ops():
        out = call(coord_conv, x, weight, bias, name="coord_conv")
    return (out.detach() if isinstance(out, torch.Tensor) else out), [count[0]] + ops


def _format_name(fmt) -> str:
    return {CL: "channels-last", torch.contiguous_format: "NCHW"}.get(fmt, "either (its shape is ambiguous)")


def _coord_structure(ops: list, x_shape: tuple, what: str) -> None:
    """What :func:`coord_conv_case` noted of a call on a channels-last ``x`` of ``x_shape``, judged:
    a convolution ran and returned the block's output shape, and no op wrote a tensor of x's
    size or more (as many channels as x, or more, and three at least; the two coordinate planes
    are not that) in NCHW: the format loss the exercise repairs, wherever it is converted back."""
    if not (ops and type(ops[0]) is int and all(
            isinstance(o, tuple) and len(o) == 2 and isinstance(o[0], str) and isinstance(o[1], list)
            and all(isinstance(t, tuple) and len(t) == 2 and len(t[0]) == 4 and len(t[1]) == 4
                    and all(type(v) is int for v in t[0] + t[1]) for t in o[1]) for o in ops[1:])):
        raise AssertionError("coord_conv: the answer came back malformed.")
    n, c, h, w = x_shape
    names = [name for name, _ in ops[1:]]
    if not any(("conv" in name) and any(shape == tuple(x_shape) for shape, _ in outs) for name, outs in ops[1:]):
        ran = ", ".join(dict.fromkeys(names))[:300] or "none"
        raise AssertionError(
            f"coord_conv ran no convolution returning the block's output (shape {tuple(x_shape)}) for {what}; the "
            f"ops it ran: {ran}. Expected the block's 1x1 convolution (F.conv2d(..., weight, bias)), kept in x's "
            "memory format: this exercise repairs the op that loses the format, not the convolution.\n"
            "  Hint: keep F.conv2d(torch.cat([x, planes], dim=1), weight, bias), and make the planes "
            "channels-last before the cat.")
    for name, outs in ops[1:]:
        for shape, stride in outs:
            if shape[0] != n or shape[2:] != (h, w) or shape[1] < max(c, 3):
                continue
            fmt = memory_format_of(torch.empty_strided(shape, stride, device="meta"))
            if fmt == torch.contiguous_format:
                raise AssertionError(
                    f"coord_conv wrote an NCHW tensor of shape {shape} (strides {stride}, from {name}) for {what}: "
                    "expected every tensor of x's size on the way (the concatenation first of all) to stay "
                    "channels-last, as x is. Writing NCHW and reading it back in another order is the format "
                    "loss this exercise repairs, even where the output is channels-last again.\n"
                    "  Hint: make the coordinate planes in x's memory format before the cat "
                    "(planes.contiguous(memory_format=torch.channels_last)), so that torch.cat and the "
                    "convolution both stay channels-last.")


def check_coord_conv(coord_conv: Callable, *, seed: int = 0, device=None) -> None:
    """``coord_conv(x, weight, bias)``: what :func:`course.memory_format.coord_conv_planted`
    computes (append the y and x coordinate planes after ``x``'s channels, then a 1x1 convolution),
    returned in ``x``'s memory format: channels-last in, channels-last out, NCHW in, NCHW out. On
    shapes and formats drawn from ``seed``, against a float64 reference; a wrong value is matched
    against the usual slips. Whether an op on the way turned channels-last into NCHW (the output
    may be channels-last again: a convolution with channels-last weights converts back) is for
    :func:`check_coord_conv_speed` to tell: such a block is as slow as the planted one."""
    dev = pick_device(device)
    hint = ("make the two coordinate planes in x's memory format before the cat (torch.cat of a channels-last "
            "tensor and NCHW ones returns NCHW, and the convolution then reorders it): planes.contiguous("
            "memory_format=torch.channels_last) when x.is_contiguous(memory_format=torch.channels_last).")
    g = torch.Generator().manual_seed(seed)
    cases = _coord_cases(seed)
    for (n, c, h, w), channels_last in cases:
        fmt = CL if channels_last else torch.contiguous_format
        x = torch.randn(n, c, h, w, generator=g, dtype=torch.float64)
        weight = torch.randn(c, c + 2, 1, 1, generator=g, dtype=torch.float64) / (c + 2) ** 0.5
        bias = torch.randn(c, generator=g, dtype=torch.float64)
        expected = coord_conv_planted(x, weight, bias)
        args = [t.float().to(dev).to(memory_format=fmt) for t in (x, weight)] + [bias.float().to(dev)]
        what = f"x of shape {(n, c, h, w)}, {'channels-last' if channels_last else 'NCHW'}"
        out = call(coord_conv, *(a.clone().to(memory_format=fmt) if a.dim() == 4 else a.clone() for a in args),
                   name="coord_conv")
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (n, c, h, w) or out.dtype != torch.float32:
            raise AssertionError(f"coord_conv returned {describe(out)} for {what}; expected a float32 tensor of shape "
                                 f"{(n, c, h, w)}: the 1x1 convolution maps C + 2 channels back to C.")
        got = out.detach().double().cpu()
        if not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
            cause = next((k for k, v in _coord_variants(x, weight, bias).items()
                          if torch.allclose(got, v, rtol=1e-4, atol=1e-5)), None)
            assert_close(got, expected, rtol=1e-4, atol=1e-5, name=f"coord_conv on {what}",
                         hint=cause or "compute what course.memory_format.coord_conv_planted computes; only the "
                                       "memory format may differ.")
        if memory_format_of(out) != fmt:
            if channels_last:
                raise AssertionError(f"coord_conv returned NCHW for a channels-last input ({what}): every layer "
                                     f"after it would pay for a reorder.\n  Hint: {hint}")
            raise AssertionError(f"coord_conv returned channels-last for an NCHW input ({what}): keep the format "
                                 "you were given, as PyTorch's own ops do, rather than converting everything: "
                                 "ask x.is_contiguous(memory_format=torch.channels_last).")
    record([True] * len(cases), [True] * len(cases), "coord_conv: values and memory format")
    ok(f"coord_conv equals the float64 CoordConv and keeps the input's memory format on {len(cases)} inputs "
       f"(seed {seed})")


def _coord_before_the_clock(coord_conv: Callable, dev: torch.device, *, bar: float, batch: int, channels: int,
                            size: int, num_threads: int | None = None) -> None:
    """Before :func:`check_coord_conv_speed` times anything: ``coord_conv`` on inputs of the timed sizes
    (channels-last, as the clock's are; drawn from another seed) returns an output in the memory format
    the planted block's has (channels-last), and the learner's process saw it run a convolution and
    write nothing of x's size in NCHW on the way (:func:`coord_conv_case`, :func:`_coord_structure`).
    A block that loses the format and converts back may be fast where it replaces the convolution
    (one matrix product that reads the NCHW data transposed), so the clock alone does not tell. A
    failure here also says what the profiler saw the block run against the course's solution, as a
    failure on the clock does."""
    x, weight, bias = coord_conv_inputs(1, device=str(dev), batch=batch, channels=channels, size=size)
    with torch.no_grad():
        expected = memory_format_of(coord_conv_planted(x, weight, bias))
    what = f"the timed inputs (x of shape {tuple(x.shape)}, channels-last)"
    got = probe(coord_conv, coord_conv_case, x, weight, bias)
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], list)):
        raise AssertionError("coord_conv: the answer came back malformed.")
    out, ops = got
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype:
        raise AssertionError(f"coord_conv returned {describe(out)} for {what}; expected a float32 tensor of shape "
                             f"{tuple(x.shape)}.")
    context = (f"(Checked before the clock, and the bar on this device is {bar:.2f}x: a block where an op on the "
               "way turns channels-last into NCHW, or that is not the CoordConv it repairs, is not timed.)")
    try:
        if memory_format_of(out) != expected:
            raise AssertionError(
                f"coord_conv returned {_format_name(memory_format_of(out))} for {what}, where the planted block "
                f"returns {_format_name(expected)}: expected the output in x's memory format on every input, the "
                "timed sizes too.\n  Hint: make the coordinate planes in x's memory format before the cat, so "
                "that torch.cat and the convolution stay channels-last; don't branch on the input's size.")
        _coord_structure(ops, tuple(x.shape), what)
    except AssertionError as exc:
        from course.checks.why_slow import why_slower
        from course.devices import threads

        said, hint, rest = str(exc).partition("\n  Hint:")
        with threads(num_threads if dev.type == "cpu" else None):
            lines = why_slower(coord_conv, "course.references.explain.coord_conv", factory=coord_conv_inputs,
                               sizes=dict(batch=batch, channels=channels, size=size), device=dev)
        seen = ("\n  What the profiler saw your code run, against the course's solution on the same inputs: "
                + "; ".join(lines) + ".") if lines else ""
        raise AssertionError(f"{said} {context}{hint}{rest}{seen}") from None


#: How far apart the grader believes two processes run lesson 3's block (``compare_served``'s
#: ``calibrate``): graded on a 2-core Xeon, the learner's process ran the course's code up to 13%
#: slower than the judge's, and the net ratio magnified that to a quarter. At 10%, a learner who slows
#: the planted block in their own process lifts a planted-speed repair to about 1.15x (net), below the bar.
CALIBRATE = 0.1


def check_coord_conv_speed(coord_conv: Callable, *, bars: Mapping[str, float], batch: int, channels: int, size: int,
                           num_threads: int | None = None, rounds: int = 7, min_run_time: float = 0.1,
                           attempts: int = 3, device=None) -> SpeedReport:
    """The repaired CoordConv block (``coord_conv``) at least ``bars[device]`` times as fast as the
    planted one (:func:`course.memory_format.coord_conv_planted`) on channels-last activations and
    weights, side by side on fresh inputs, every output checked (:func:`served_speedup`); under the
    grader the learner's side runs in its process, the baseline in the judge's, never at once.
    A block that writes NCHW on the way and converts back, whose output :func:`check_coord_conv`
    accepts, fails here: before the clock (:func:`_coord_before_the_clock`: its output on the timed
    sizes, a convolution run, nothing of x's size written in NCHW), and on it, since it does the
    planted block's extra reorder."""
    from course.grading import speed_bar

    dev = pick_device(device)
    _coord_before_the_clock(coord_conv, dev, bar=speed_bar(bars, dev), batch=batch, channels=channels, size=size,
                            num_threads=num_threads)
    return served_speedup(("planted", coord_conv_planted), ("repaired", coord_conv), factory=coord_conv_inputs,
                          sizes=dict(batch=batch, channels=channels, size=size), bars=bars, device=dev,
                          num_threads=num_threads, rounds=rounds, min_run_time=min_run_time, attempts=attempts,
                          explain="course.references.explain.coord_conv", net=True, calibrate=CALIBRATE,
                          hint="most likely an op on the way turns channels-last into NCHW, and the convolution "
                               "after it reorders the data back, which costs about as much as the block's own work: "
                               "torch.cat of the channels-last x with coordinate planes in the default format "
                               "(it writes NCHW when its inputs disagree), or a .contiguous() without "
                               "memory_format. Make the planes in x's memory format, so that the cat and the "
                               "convolution stay channels-last; if the machine is busy, run the cell again.")

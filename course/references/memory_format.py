"""Lesson 3's references (channels-last): strides of a dense tensor in any dimension order (what
exercise 1 writes by hand), the cases of exercise 2 built with them, and the ops that lose the
channels-last format in a model (what exercise 4's ``find_format_loss`` reports). They answer the
lesson's exercises, so they are the grader's alone (see :mod:`course.references`), and so is
:class:`FormatLossWatcher`, the watcher that :func:`format_losses` runs: it is most of exercise 4's
answer. No check runs it in the learner's process: exercise 6's repair is judged by its output and
by the judge's clock (:func:`course.checks.memory_format.check_coord_conv_speed`)."""

from __future__ import annotations

import random

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from course.checks.memory_format import finder_input
from course.guard import reference
from course.memory_format import list_probe, memory_format_of, op_name, planted_model, tensors_in

__all__ = ["DATA_FILES", "FormatLossWatcher", "dense_strides", "format_losses", "stride_cases", "visible_data"]

CL = torch.channels_last


@reference
def dense_strides(shape, order) -> list[int]:
    """The strides of a dense tensor of ``shape`` whose dimensions lie in memory in ``order``,
    outermost first: ``[0, 1, 2, 3]`` is NCHW, ``[0, 2, 3, 1]`` NHWC."""
    strides, acc = [0] * 4, 1
    for d in reversed(order):
        strides[d] = acc
        acc *= shape[d]
    return strides


def stride_cases(seed: int, cases: int) -> list[tuple[tuple[int, ...], list[int]]]:
    """Exercise 2's ``(shape, strides)`` cases: six fixed ones (the ambiguous shapes among them),
    then ``cases`` drawn from ``seed``: NCHW, NHWC, permuted, sliced (a stride stretched) and odd
    (a stride of 0 or 7), with many dimensions of size 1; then a tenth as many again with sizes up
    to 4096, which no table of answers worked out with torch before the call can hold."""
    rng = random.Random(seed)
    out = [((4, 1, 8, 8), [64, 64, 8, 1]), ((4, 16, 1, 1), [16, 1, 1, 1]), ((2, 3, 4, 5), [60, 20, 5, 1]),
           ((2, 3, 4, 5), [60, 1, 15, 3]), ((1, 3, 4, 5), [7, 1, 15, 3]), ((2, 3, 4, 5), [60, 1, 3, 12])]
    for _ in range(cases):
        out.append(_stride_case(rng, tuple(rng.choice([1, 1, 2, 3, 4, 6]) for _ in range(4))))
    for _ in range(max(2, cases // 10)):
        out.append(_stride_case(rng, tuple(rng.choice([1, rng.randint(2, 4096)]) for _ in range(4))))
    return out


def _stride_case(rng: random.Random, shape: tuple[int, ...]) -> tuple[tuple[int, ...], list[int]]:
    kind = rng.randrange(5)
    if kind == 0:
        strides = dense_strides(shape, [0, 1, 2, 3])
    elif kind == 1:
        strides = dense_strides(shape, [0, 2, 3, 1])
    elif kind == 2:
        strides = dense_strides(shape, rng.sample(range(4), 4))
    elif kind == 3:  # a slice: one stride stretched
        strides = dense_strides(shape, rng.choice([[0, 1, 2, 3], [0, 2, 3, 1]]))
        strides[rng.randrange(4)] *= rng.choice([2, 3])
    else:  # an odd stride: broadcast (0) or arbitrary
        strides = dense_strides(shape, [0, 2, 3, 1])
        strides[rng.randrange(4)] = rng.choice([0, 7])
    return shape, strides


class FormatLossWatcher(TorchFunctionMode):
    """The course's watcher: lists (in ``losses``, in order) every op that took a channels-last
    tensor and returned an NCHW one."""

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
    with torch.no_grad(), FormatLossWatcher() as watcher:
        model(x.to(memory_format=CL))
    return watcher.losses


def visible_data(*, seed: int = 0, cases: int = 80, variant: str = "coords", width: int = 16, batch: int = 2,
                 size: int = 32) -> dict:
    """What the lesson's own calls of the checks need in a learner's copy (their default arguments):
    exercise 2's cases, and exercise 4's losses in the planted model and in
    :func:`course.memory_format.list_probe`. One flat dict, so that
    :func:`course.checks.common.stored_answers` can refuse other arguments by name."""
    x = finder_input(seed=seed, batch=batch, size=size, device="cpu")
    return {"seed": seed, "cases": cases, "stride_cases": stride_cases(seed, cases),
            "variant": variant, "width": width, "batch": batch, "size": size,
            "losses": format_losses(planted_model(variant, seed=seed, width=width, device="cpu"), x),
            "list_probe_losses": format_losses(list_probe(device="cpu"), x)}


#: Written by ``python -m course.references``; read by :mod:`course.checks.memory_format`.
DATA_FILES = {"03_memory_format.pt": visible_data}

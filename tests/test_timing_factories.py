"""Timing inputs are made where they are used.

A speed check's inputs are made inside every timed block, on both sides of the boundary
(``course.timing.compare_served``). A factory that draws on the CPU and copies to a GPU puts a
host draw and a copy into every call, which squeezed the first H200 run's ratios towards 1
(lesson 7's distances: 1.63x against a bar of 2; lesson 6's ensemble: 1.58x against 1.5, where the
notebook measured 20x). Here every registered factory is called at its lesson's GPU sizes on
the CPU, with ``Tensor.to`` watched: nothing larger than a few thousand numbers may be moved
in a call (models built once and cached are made in the first call, which is not watched).
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

import course
from course.remote import FACTORIES, factory

for _module in pkgutil.walk_packages(course.__path__, "course."):  # every module registers its factories
    if not _module.name.endswith("__main__"):
        importlib.import_module(_module.name)

#: Each factory's sizes: the GPU sizes of its lesson's speed check.
SIZES = {
    "course.rnn.timing_inputs": dict(seq_len=100, batch=64, input_size=512, hidden_size=512),
    "course.checks.broadcasting.distance_inputs": dict(n=2048, m=2048, d=64),
    "course.checks.broadcasting.segment_inputs": dict(nodes=5000, edges=20000, d=4),
    "course.checks.broadcasting.penalty_inputs": dict(n=512, features=64, hidden=256, model_seed=0),
    # the judge's clock on gradient_penalty_func (on the CPU, at these sizes, on every device)
    "course.checks.broadcasting.penalty_func_inputs": dict(n=2048, features=8, hidden=32, model_seed=0),
    "course.checks.forward_ad.jacobian_speed_inputs": dict(k=16, m=1024, hidden=256, f_seed=0),
    # the judge's clocks of lesson 6 (on the CPU, at these sizes, on every device)
    "course.checks.vmap.ensemble_clock_inputs": dict(members=8192, same=False),
    "course.checks.vmap.sgd_clock_inputs": dict(members=2048, lr=0.1),
    "course.checks.vmap.per_sample_clock_inputs": dict(samples=2048),
    "course.checks.vmap.member_kl_inputs": dict(n=256, batch=64, features=128, hidden=128, classes=10,
                                                model_seed=0),
    "course.profiling.attention_inputs": dict(batch=8, heads=16, length=2048, dim=64),
    "course.fastpath.masked_attention_inputs": dict(batch=8, heads=16, length=2048, dim=64, valid=0.6),
    "course.fastpath.ragged_batch": dict(batch=32, length=1024, dim=512, valid=0.5),
    "course.memory_format.coord_conv_inputs": dict(batch=32, channels=64, size=112),
}
MOVED_LIMIT = 4096


def moved_in_call(fn, sizes) -> list[tuple[int, str]]:
    fn(1, device="cpu", **sizes)  # builds what is cached
    moved, original = [], torch.Tensor.to

    def watched(self, *args, **kwargs):
        if self.numel() > MOVED_LIMIT:
            moved.append((self.numel(), str(args or kwargs)))
        return original(self, *args, **kwargs)

    torch.Tensor.to = watched
    try:
        fn(2, device="cpu", **sizes)
    finally:
        torch.Tensor.to = original
    return moved


def test_every_factory_has_its_sizes_here():
    course_factories = {name for name in FACTORIES if name.startswith("course.")}  # (tests register their own)
    assert course_factories == set(SIZES), "a new timing factory needs its GPU sizes in SIZES"


@pytest.mark.parametrize("name", sorted(SIZES))
def test_a_factory_draws_on_the_device(name):
    moved = moved_in_call(FACTORIES[name], SIZES[name])
    assert not moved, f"{name} moves {moved[:3]} in every call: draw with course.data.device_generator"


def test_the_watch_sees_a_cpu_draw():
    def cpu_draw(seed, *, device, n):
        return (torch.randn(n, 64, generator=torch.Generator().manual_seed(seed)).to(device),)

    assert moved_in_call(cpu_draw, dict(n=512))
    try:
        factory(cpu_draw)  # registered: the first test names every factory of the course
        assert f"{cpu_draw.__module__}.{cpu_draw.__qualname__}" in FACTORIES
    finally:
        FACTORIES.pop(f"{cpu_draw.__module__}.{cpu_draw.__qualname__}")

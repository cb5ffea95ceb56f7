"""Lesson 8's pieces (profiling and trace comparison): the workloads the lesson profiles, what the
machine can do natively, and the lesson's plots. The trace reading and diffing itself is
:mod:`course.traces`; the stream happens-before model is :mod:`course.streams`.

- :func:`attention_inputs`: seeded ``q, k, v`` for attention (a registered timing factory, drawn
  on the device that runs them);
- :func:`naive_attention`: attention as a first version writes it (two matrix products and a
  softmax, the ``(B, H, L, L)`` score matrix built in full): the baseline the lesson measures;
- :func:`bf16_native`: whether this CPU has bfloat16 arithmetic of its own, and why the lesson
  can predict from it whether bfloat16 is faster here;
- :func:`accumulate`: the profiler argument that keeps every scheduled cycle's events, where it exists;
- :func:`run_sanitized_race`: on a GPU, a real stream race under the CUDA Stream Sanitizer, in a
  process of its own;
- :func:`plot_op_times`: the ops two traces spend their time in, side by side.
"""

from __future__ import annotations

import math
import platform
from typing import Mapping

import torch

from course.data import device_generator
from course.devices import pick_device
from course.remote import factory

__all__ = ["accumulate", "attention_inputs", "bf16_native", "cpu_flags", "naive_attention", "plot_op_times",
           "run_sanitized_race"]


@factory
def attention_inputs(seed: int, *, device: str = "cpu", batch: int = 4, heads: int = 8, length: int = 256,
                     dim: int = 64, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)``, each ``(batch, heads, length, dim)``, standard normal, drawn on ``device``."""
    g = device_generator(seed, device)
    dev = pick_device(device)
    return tuple(torch.randn(batch, heads, length, dim, generator=g, device=dev, dtype=dtype) for _ in range(3))


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d)) v`` with the whole ``(..., L, L)`` score matrix materialised (and, if
    ``causal``, positions after the query masked out): what SDPA's fused kernels avoid."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        length, keys = scores.shape[-2], scores.shape[-1]
        future = torch.ones(length, keys, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def accumulate() -> dict:
    """``{"acc_events": True}`` where ``torch.profiler.profile`` takes it (torch 2.5 and later: without
    it, ``key_averages()`` after a scheduled profile holds only the last cycle), else ``{}`` (torch
    2.4 kept every cycle)."""
    import inspect

    from torch.profiler import profile

    return {"acc_events": True} if "acc_events" in inspect.signature(profile.__init__).parameters else {}


RACE = """
import torch
side = torch.cuda.Stream()
x = torch.zeros(1 << 20, device="cuda")
torch.cuda.synchronize()
with torch.cuda.stream(side):
    x.add_(1)                                  # written on the side stream
{wait}y = x * 2                                    # read on the default stream
torch.cuda.synchronize()
print("ran to the end")
"""


def run_sanitized_race(*, fixed: bool = False, timeout: float = 120.0) -> str:
    """On a GPU: run a tensor written on a side stream and read on the default stream, with
    (``fixed``) or without ``wait_stream`` between them, in a fresh Python process with the CUDA
    Stream Sanitizer on (``TORCH_CUDA_SANITIZER=1``); return what it found. Without CUDA, say so and
    run nothing: the sanitizer must never be switched on without a GPU."""
    import os
    import subprocess
    import sys

    if not torch.cuda.is_available():
        return "no GPU here: nothing run (the sanitizer must never be switched on without CUDA)"
    source = RACE.replace("{wait}", "torch.cuda.current_stream().wait_stream(side)\n" if fixed else "")
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    done = subprocess.run([sys.executable, "-c", source], env=env, capture_output=True, text=True, timeout=timeout)
    text = done.stdout + done.stderr
    if "CSAN detected a possible data race" in text:
        return "the sanitizer found a race: " + next(line for line in text.splitlines() if "CSAN" in line).strip()
    if done.returncode == 0 and "ran to the end" in text:
        return "no race found"
    return f"the process failed (exit {done.returncode}): {text.strip()[-300:]}"


def cpu_flags() -> set[str]:
    """The instruction-set flags the kernel reports for this CPU (``/proc/cpuinfo``; empty where
    there is none, as on macOS or Windows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


#: Flags of CPUs with bfloat16 arithmetic in hardware (x86: AVX512-BF16 and AMX; Arm: BF16).
BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


def bf16_native() -> tuple[bool, str]:
    """``(native, why)``: whether this CPU computes in bfloat16 natively. Without it, every bfloat16
    kernel converts to float32 and back around float32 arithmetic, and is slower than float32;
    with it (AVX512-BF16, AMX, Arm's BF16), bfloat16 matrix products can be faster. PyTorch's own
    vector level (``torch.backends.cpu.get_cpu_capability()``, e.g. "AVX2", "AVX512") does not say
    which: AVX512 machines exist with and without BF16."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = cpu_flags() & BF16_FLAGS
    if flags:
        return True, f"{capability} vectors; the CPU reports {', '.join(sorted(flags))}"
    if not cpu_flags():
        probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        if probe is not None:
            native = bool(probe())
            return native, f"{capability} vectors; oneDNN says bfloat16 is {'' if native else 'not '}supported " \
                           f"({platform.machine()})"
    return False, f"{capability} vectors, and no bfloat16 instructions among the CPU's flags"


def plot_op_times(tables: Mapping[str, Mapping[str, tuple[int, float]]], *, top: int = 8, calls: int = 1, ax=None,
                  title: str = "Where the time goes"):
    """A horizontal bar per op, one colour per trace: total time per call (microseconds) of the
    ``top`` ops that take longest in any of ``tables`` (``{label: {op: (count, total_us)}}``, as
    the lesson's op_table exercise returns them)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.45 * top + 1.2))
    names = sorted({n for t in tables.values() for n in t},
                   key=lambda n: -max(t.get(n, (0, 0.0))[1] for t in tables.values()))[:top][::-1]
    height = 0.8 / max(1, len(tables))
    for i, (label, table) in enumerate(tables.items()):
        ys = [j + i * height for j in range(len(names))]
        ax.barh(ys, [table.get(n, (0, 0.0))[1] / calls for n in names], height=height, label=label)
    ax.set_yticks([j + 0.4 - height / 2 for j in range(len(names))], names)
    ax.set_xlabel("microseconds per call (CPU ops, totals include the ops they call)")
    ax.set_title(title)
    ax.legend()
    return ax

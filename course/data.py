"""Synthetic data for the lessons: seeded, made on the spot, never downloaded.

Every maker takes a ``seed`` so that a check can draw inputs the learner did not choose and a
re-run draws the same ones.
"""

from __future__ import annotations

import torch

from course.devices import pick_device

__all__ = ["device_generator", "generator", "grid_uniform", "padded_batch", "randn", "random_lengths"]


def generator(seed: int) -> torch.Generator:
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}.")
    return torch.Generator().manual_seed(seed)


def device_generator(seed: int, device) -> torch.Generator:
    """A generator *on* ``device``, for the inputs of timed calls (``course.remote.factory``).

    Making the inputs is part of every timed block, on both sides (the judge cannot trust inputs
    the learner's process made ahead). Drawn on the CPU and copied, a GPU's inputs cost more than
    the call they feed (64 minibatches of 784 features: about 8 ms against 0.5 ms for the vmapped
    ensemble on an H200), and every ratio is squeezed towards 1. Drawn where they are used, they
    cost microseconds. The numbers then differ between devices, which timing does not mind."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}.")
    return torch.Generator(device=pick_device(device)).manual_seed(seed)


def grid_uniform(shape: tuple[int, ...], generator: torch.Generator, *, device=None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values spread evenly over ``[-2, 2)`` on a grid of ``2**-14`` (65536 levels; spread 1.15,
    mean 0), four for each 64-bit draw of ``generator`` (on ``device``).

    For the inputs of timed calls, which are drawn in every call on both sides of the boundary:
    the CPU's generator spends about as long on one normal or uniform number as on 64 random
    bits, so a large input drawn with ``randn`` cost more than the call it fed (lesson 3's CoordConv
    input, half a million numbers: 1.9 ms against the repaired block's 0.9), and every ratio was
    squeezed towards 1. Drawn this way, the same input costs a fifth of that."""
    n = 1
    for s in shape:
        n *= int(s)
    bits = torch.randint(-2**63, 2**63 - 1, ((n + 3) // 4,), dtype=torch.int64, generator=generator,
                         device=pick_device(device))
    out = torch.empty(n, dtype=dtype, device=bits.device).copy_(bits.view(torch.int16)[:n])
    return out.mul_(2.0**-14).view(*shape)


def randn(*shape: int, seed: int, device=None, dtype: torch.dtype = torch.float32,
          scale: float = 1.0, requires_grad: bool = False) -> torch.Tensor:
    """Standard normal values drawn on the CPU (same numbers on every device), then moved."""
    x = torch.randn(*shape, generator=generator(seed), dtype=torch.float64) * scale
    return x.to(pick_device(device), dtype).requires_grad_(requires_grad)


def random_lengths(batch: int, max_len: int, *, seed: int, min_len: int = 1) -> torch.Tensor:
    """``batch`` lengths in ``[min_len, max_len]``, unsorted, with ``max_len`` present once at
    least (so the padded tensor is exactly ``max_len`` long) and ``min_len`` present when
    ``batch > 1`` (so the shortest case is always tried)."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}.")
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}.")
    g = generator(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=g)
    lengths[torch.randint(0, batch, (1,), generator=g)] = max_len
    if batch > 1:
        free = (lengths != max_len).nonzero().flatten()
        if len(free):
            lengths[free[torch.randint(0, len(free), (1,), generator=g)]] = min_len
    return lengths


def padded_batch(lengths: torch.Tensor, features: int, *, seed: int, pad_value: float = 0.0,
                 device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A time-major batch ``(max(lengths), B, features)`` of random steps; every step past a
    sequence's length holds ``pad_value`` (a checker passes garbage there to catch leaks)."""
    lengths = torch.as_tensor(lengths)
    T, B = int(lengths.max()), len(lengths)
    x = randn(T, B, features, seed=seed, dtype=torch.float64, device="cpu")
    pad = torch.arange(T)[:, None] >= lengths[None, :]
    x[pad] = pad_value
    return x.to(pick_device(device), dtype)

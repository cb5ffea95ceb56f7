"""Pick the device, and let a lesson declare its CPU and CUDA sizes once.

A lesson writes its sizes in one place::

    S = course.sizes(cpu=dict(T=50, B=32, hidden=256), cuda=dict(T=100, B=64, hidden=512))
    S.T, S.B, S.hidden, S.device

and runs small on a laptop CPU or Binder, and at the figures the technique exists for on a GPU.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from types import MappingProxyType
from typing import Any, Iterator, Mapping

import torch

__all__ = ["Sizes", "device_kind", "exact_float32", "pick_device", "sizes", "synchronize", "threads"]

#: Set ``COURSE_DEVICE=cpu`` to run a lesson on the CPU even where CUDA is present.
DEVICE_ENV = "COURSE_DEVICE"


def pick_device(prefer: str | torch.device | None = None) -> torch.device:
    """The device lessons run on: ``prefer`` if given, else ``$COURSE_DEVICE``, else CUDA if
    present, else the CPU (MPS is reported by ``course.doctor()`` but not picked: several ops
    the course measures have no MPS kernel)."""
    choice = prefer if prefer is not None else os.environ.get(DEVICE_ENV) or None
    if choice is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(choice)
    except (RuntimeError, TypeError):
        raise ValueError(f"The course runs on 'cpu' or 'cuda', not {str(choice)!r}. "
                         "Try: course.pick_device('cpu').") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"The device {str(dev)!r} was asked for, but this PyTorch sees no CUDA GPU "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}).\n"
            f"Try: leave the device out (the CPU is used), or unset ${DEVICE_ENV}, "
            "or run on a machine with a GPU."
        )
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(
            f"The course runs on 'cpu' or 'cuda', not {str(dev)!r}. Try: course.pick_device('cpu')."
        )
    return dev


def exact_float32() -> None:
    """Make float32 on a GPU mean float32: no TensorFloat-32 in cuDNN (convolutions, RNNs) or
    cuBLAS (matrix products). ``import course`` calls it.

    On Ampere and newer GPUs cuDNN may by default compute float32 convolutions and RNNs with
    TF32, which keeps 10 bits of mantissa: results then differ from the CPU's, and from each
    other, by about 1e-3 relative, far above the tolerances the course's checks compare float32
    at. Speed in this course comes from the techniques it teaches, not from lowering precision
    behind the learner's back; reduced precision is asked for openly (autocast, lesson 3)."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    # torch.compile then warns, on such a GPU, that TF32 "is available but not enabled" and suggests
    # turning it on (seen in lesson 1 on an H200, torch 2.11): the course's choice, not the learner's.
    warnings.filterwarnings("ignore", message="TensorFloat32 tensor cores for float32 matrix multiplication "
                            "available but not enabled", category=UserWarning)


def device_kind(device: str | torch.device | None = None) -> str:
    """``'cuda'`` or ``'cpu'``: the key of device-aware figures such as speed bars."""
    return pick_device(device).type


def synchronize(device: str | torch.device | None = None) -> None:
    """Wait for queued GPU work (a no-op on the CPU): call it before reading a clock."""
    dev = torch.device(device) if device is not None else pick_device()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Sizes(Mapping[str, Any]):
    """A lesson's sizes for the device it runs on, read as attributes or keys."""

    def __init__(self, values: Mapping[str, Any], device: torch.device):
        self._values = MappingProxyType(dict(values))
        self.device = device

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(
                f"This lesson declares no size named {name!r}; it has: {', '.join(self._values)}."
            ) from None

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._values.items())
        return f"Sizes({inner}; device={self.device})"


def sizes(*, cpu: Mapping[str, Any], cuda: Mapping[str, Any] | None = None,
          device: str | torch.device | None = None) -> Sizes:
    """Declare a lesson's sizes once; get those for the device in use.

    ``cuda`` may name only the sizes that change on a GPU; the others keep their CPU value.
    Every CUDA key must also be a CPU key, so a lesson cannot silently lack a size on a laptop.
    """
    cuda = dict(cuda or {})
    unknown = sorted(set(cuda) - set(cpu))
    if unknown:
        raise ValueError(
            f"CUDA sizes {unknown} have no CPU value. Every size needs a CPU value "
            "(the course must run on a 2-core CPU); add them to cpu=dict(...)."
        )
    dev = pick_device(device)
    values = dict(cpu)
    if dev.type == "cuda":
        values.update(cuda)
    return Sizes(values, dev)


def asked_threads(n: Any, device: str) -> int | None:
    """The thread count another process asked a block to run with (the judge's, sent as data): ``n``
    where it is a sane count on a CPU, else None (leave the setting alone)."""
    return n if device == "cpu" and type(n) is int and 1 <= n <= 4096 else None


@contextlib.contextmanager
def threads(n: int | None) -> Iterator[None]:
    """Run a block with ``n`` intra-op threads (``None``: leave the setting alone), then restore it.

    Batch-1 inference on a CPU is usually served one request per core, and one thread keeps a
    measurement steady on a small machine that other work shares."""
    if n is None:
        yield
        return
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"threads takes a positive int or None, got {n!r}.")
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)

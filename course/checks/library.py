"""PyTorch's own implementation of an exercise, refused while a check calls the answer.

Lesson 2 asks for a conv/BatchNorm fuser written on ``torch.fx``; PyTorch ships one
(``torch.fx.experimental.optimization.fuse``, ``torch.nn.utils.fusion``, the quantization
fusers, TorchScript's freezing, Inductor's passes). An answer that calls them earned 7 of the
lesson's 13 points without writing a rule (red team, 2026-12-05). :class:`LibraryCalls` notes,
while a probe runs the answer in the learner's process, every call into those files (a profile
function sees each Python call, by the code object's file, whatever name or alias reached it) and
every call of TorchScript's C++ graph passes, and fails the call naming them. It is that process's
word, as every probe is: it makes the shortcut fail for a learner who takes it, and it refuses a
profile function replaced or a thread started while it watched.
"""

from __future__ import annotations

import os
from sys import getprofile as _getprofile, setprofile as _setprofile  # held here: sealed with the module
from typing import Any

import torch

__all__ = ["FUSERS", "LibraryCalls"]


def _torch_dir() -> str:
    """torch's folder, read off a torch function's code (which the grader's seal holds)."""
    return os.path.dirname(torch.overrides.handle_torch_function.__code__.co_filename) + os.sep


#: PyTorch's conv/BatchNorm (and affine) folding, by file or folder under torch's own, with what
#: each is: what lesson 2's fusion exercises may not call.
FUSERS: dict[str, str] = {
    "fx/experimental/optimization.py": "torch.fx.experimental.optimization (fuse)",
    "nn/utils/fusion.py": "torch.nn.utils.fusion (fuse_conv_bn_eval, fuse_conv_bn_weights)",
    "ao/": "torch.ao (the quantization fusers, fuse_modules)",
    "jit/_freeze.py": "torch.jit.freeze / optimize_for_inference (TorchScript folds BatchNorm)",
    "_inductor/": "torch._inductor (Inductor's folding passes)",
    "_export/": "torch._export",
}


class LibraryCalls:
    """While active, notes calls into ``refused`` (paths relative to torch's folder, a trailing
    ``/`` for a folder, each with what it is) and of TorchScript's graph passes
    (``torch._C._jit_pass_*``); on leaving without an error, fails if any ran, naming them."""

    def __init__(self, label: str, refused: dict[str, str] | None = None, *, hint: str = ""):
        base = _torch_dir()
        self.label, self.hint = label, hint
        self._files = {base + p.replace("/", os.sep): what for p, what in (refused or FUSERS).items()}
        self.seen: list[str] = []
        self.blinded: list[str] = []
        self._before: Any = None
        self._profile = self._watch  # (one bound method, to know it again)

    def __enter__(self) -> "LibraryCalls":
        self._before = _getprofile()
        _setprofile(self._profile)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None and _getprofile() is not self._profile:
            self.blinded.append("the profile function the course set was replaced")
        _setprofile(self._before)
        if exc_type is not None:
            return False
        if self.blinded:
            raise AssertionError(f"{self.label}: the course watches which of PyTorch's functions an answer calls, "
                                 f"and while it ran {'; '.join(self.blinded[:3])}. Write the answer as plain calls "
                                 "(no sys.setprofile, no threads), and run its cell again.")
        if self.seen:
            raise AssertionError(f"{self.label} calls PyTorch's own implementation of this exercise: "
                                 f"{'; '.join(self.seen[:3])}. The exercise is to write it yourself."
                                 + (f"\n  Hint: {self.hint}" if self.hint else ""))
        return False

    def _note(self, what: str) -> None:
        if what not in self.seen:
            self.seen.append(what)

    def _watch(self, frame, event, arg) -> None:
        if event == "call":
            path = frame.f_code.co_filename
            for where, what in self._files.items():
                if path == where or (where.endswith(os.sep) and path.startswith(where)):
                    self._note(what)
                    break
        elif event == "c_call":
            name = str(getattr(arg, "__name__", "") or "")
            owner = str(getattr(arg, "__module__", None) or getattr(getattr(arg, "__self__", None), "__name__", None)
                        or "")
            if name.startswith("_jit_pass"):
                self._note(f"torch._C.{name} (a TorchScript graph pass)")
            elif owner == "_thread" and name.startswith("start"):
                if "a thread was started" not in self.blinded:
                    self.blinded.append("a thread was started")
        if self._before is not None:
            self._before(frame, event, arg)

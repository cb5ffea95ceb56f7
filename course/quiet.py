"""Deprecation warnings, explained once and then kept out of the learner's way.

PyTorch 2.13 and 2.14 warn on every ``torch.jit.script`` call::

    DeprecationWarning: `torch.jit.script` is deprecated. Please switch to `torch.compile` or `torch.export`.

The course still teaches TorchScript (it shows how a graph compiler sees a program) and ends each
such lesson with ``torch.compile``; repeating the warning on every cell would only be noise.
"""

from __future__ import annotations

import warnings

__all__ = ["quiet_torchscript", "TORCHSCRIPT_NOTE"]

TORCHSCRIPT_NOTE = (
    "Note: TorchScript (torch.jit.script / trace) is deprecated in PyTorch 2.13+: it still works, "
    "but gets no new features. This lesson uses it to show how a graph compiler sees your code, "
    "then moves to torch.compile, its successor. The deprecation warning is silenced from here on."
)

# Matches "`torch.jit.script` is deprecated", "`torch.jit.trace` is deprecated", ...
_PATTERN = r".*torch\.jit.*is deprecated"
_explained = False


def quiet_torchscript(explain: bool = True) -> None:
    """Silence TorchScript's deprecation warnings (only those); print why, once per session."""
    global _explained
    warnings.filterwarnings("ignore", message=_PATTERN, category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=_PATTERN, category=FutureWarning)
    warnings.filterwarnings("ignore", message=_PATTERN, category=UserWarning)
    if explain and not _explained:
        print(TORCHSCRIPT_NOTE)
        _explained = True

"""Deprecation warnings, explained once and then kept out of the learner's way.

PyTorch 2.13 to 2.15 warn on every ``torch.jit.script`` call (a FutureWarning from 2.14)::

    DeprecationWarning: `torch.jit.script` is deprecated. Please switch to `torch.compile` or `torch.export`.

The course still teaches TorchScript (it shows how a graph compiler sees a program) and ends each
such lesson with ``torch.compile``; repeating the warning on every cell would only be noise.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["load_forward_ad_quietly", "quiet_cuda_home", "quiet_fx_tracing_notice", "quiet_profiler_cycle_notice",
           "quiet_torchscript", "TORCHSCRIPT_NOTE"]

TORCHSCRIPT_NOTE = (
    "Note: TorchScript (torch.jit.script / trace) is deprecated in recent PyTorch releases: it still works, "
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


def load_forward_ad_quietly() -> None:
    """Load PyTorch's forward-mode decompositions now, without TorchScript's deprecation warning.

    PyTorch imports ``torch._decomp.decompositions_for_jvp`` on the first forward-mode call
    (``forward_ad.make_dual``, and so ``torch.func.jvp``, ``jacfwd``), and that module compiles its
    helpers with ``torch.jit.script``: the first call warns that TorchScript is deprecated (a
    ``DeprecationWarning``, hidden, in 2.13; a ``FutureWarning``, shown, in 2.14 and 2.15). It is
    PyTorch's own use, nothing a learner did: lessons 4 and 5 load it here, once, with only that
    warning filtered; any other warning still shows."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_PATTERN)
        try:
            from torch._decomp import decompositions_for_jvp  # noqa: F401
        except Exception:  # noqa: BLE001 - a torch without it loads nothing here and warns as it will
            pass


class _NoCudaHomeNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No CUDA runtime is found")


def quiet_cuda_home() -> None:
    """Drop PyTorch's "No CUDA runtime is found, using CUDA_HOME=..." notice (only that record).

    A CUDA build of torch on a machine without a GPU (Colab's CPU runtime) logs it when
    ``torch.utils.cpp_extension`` is first imported: it is about building C++ extensions, which no
    lesson does, and ``course.doctor()`` already says that no GPU is visible. Installed once, when
    the course is imported; idempotent."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    if not any(isinstance(f, _NoCudaHomeNotice) for f in logger.filters):
        logger.addFilter(_NoCudaHomeNotice())


class _FxTracingNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("is_fx_tracing will return true")


def quiet_fx_tracing_notice() -> None:
    """Drop PyTorch's "is_fx_tracing will return true for both fx.symbolic_trace and torch.export"
    notice (only that record). Torch 2.13 to 2.15 log it, once per process, when their own code asks
    ``torch.fx._symbolic_trace.is_fx_tracing()``, as a jagged nested tensor's first op does (lesson 9):
    advice to PyTorch's developers about an internal function no lesson calls. Idempotent."""
    logger = logging.getLogger("torch.fx._symbolic_trace")
    if not any(isinstance(f, _FxTracingNotice) for f in logger.filters):
        logger.addFilter(_FxTracingNotice())


#: The profiler's cycle warning as torch 2.10 to 2.12 word it (sentences run together, no space after the stops).
PROFILER_CYCLE_NOTICE = r"Warning: Profiler clears events at the end of each cycle\.Only events"


def quiet_profiler_cycle_notice() -> None:
    """Drop the "Profiler clears events at the end of each cycle" warning as torch 2.10 to 2.12 give it:
    they warn at the first cycle of every ``torch.profiler.profile`` without ``acc_events=True``, a
    plain ``with profile(...)`` of one cycle too, where nothing is cleared. Torch 2.13 and later warn
    only when a second cycle begins, in words with a space after each stop, which this filter leaves
    alone (lesson 8 teaches ``acc_events``). Idempotent."""
    warnings.filterwarnings("ignore", message=PROFILER_CYCLE_NOTICE, category=UserWarning)


def quiet_kineto() -> None:
    """Keep the profiler's own log lines ("USDT: ... profiler_start", "STAGE: ...") out of the
    lessons' outputs: Kineto prints them on stderr for every profile, at a level above its errors,
    so only its highest setting hides them. The profiler's warnings still reach Python's
    ``warnings``. Read when a profile starts; a value already set (``KINETO_LOG_LEVEL``) is kept."""
    import os

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")

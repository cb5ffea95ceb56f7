"""References that only the course may call, under the grader.

The checks compare a learner's answer with the course's own references (closed-form
Jacobians, a loop over samples, a DP-SGD step...). In a learner's notebook those references
are ordinary functions. Under the autograder (which sets ``course.grader_hooks.learner_prefix``), a function marked ``@reference`` refuses to run while any frame of the
learner's own cells is on the call stack, or while a check is calling the learner's answer
(:func:`answering`, used by ``course.checks.common.call``): a check may call it, an exercise may
not answer with it, however it is wrapped (an alias, a lambda, ``functools.partial``, passed
through a course helper).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable, TypeVar

from course import grader_hooks

__all__ = ["ReferenceRefused", "answering", "reference"]

F = TypeVar("F", bound=Callable)


_answering = 0


class answering:
    """The block in which a check calls the learner's answer: references refuse to run in it."""

    def __enter__(self):
        global _answering
        _answering += 1

    def __exit__(self, *exc):
        global _answering
        _answering -= 1


class ReferenceRefused(PermissionError):
    """A submission called one of the course's references."""


def _learner_frame():
    frame = sys._getframe(2)  # 0: here, 1: the guarded wrapper, 2: whoever called the reference
    prefix = grader_hooks.learner_prefix
    while frame is not None:
        if frame.f_code.co_filename.startswith(prefix):
            return frame
        frame = frame.f_back
    return None


def reference(fn: F | None = None, *, in_cells: bool = True) -> F:
    """Mark ``fn`` as a reference of the course's checks (see the module's docstring).

    ``in_cells=False`` (``@reference(in_cells=False)``): refuse only while a check is calling the
    learner's answer, so that a lesson may still use the reference in its own cells, as a
    demonstration, under the grader too. Enough where a check's inputs are data the learner has
    never seen (a trace, a program): nothing computed in a cell beforehand can answer them."""
    if fn is None:
        return functools.partial(reference, in_cells=in_cells)  # type: ignore[return-value]
    name = getattr(fn, "__qualname__", getattr(fn, "__name__", "a reference"))

    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        if grader_hooks.learner_prefix is not None:
            frame = _learner_frame() if in_cells else None
            if frame is not None or _answering:
                where = (f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}" if frame is not None
                         else "the answer a check called")
                if grader_hooks.refused is not None:
                    grader_hooks.refused(name, where)
                raise ReferenceRefused(
                    f"{name} is one of the course's references, which the checks compare your work with; "
                    "the grader does not let submitted code call it. Write the computation yourself.")
        return fn(*args, **kwargs)

    # functools.wraps would leave the unguarded function one attribute away (``__wrapped__``).
    del guarded.__wrapped__
    guarded.__course_reference__ = True
    return guarded  # type: ignore[return-value]

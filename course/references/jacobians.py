"""Lesson 5's search for the largest ``chunk_size`` under a memory budget: the answer to its
exercise 3, so the grader's alone (see :mod:`course.references`). In a learner's copy the check
uses the answers stored for its visible call (``course/reference_data/05_largest_chunk.pt``)."""

from __future__ import annotations

from typing import Callable

from course.guard import reference

__all__ = ["largest_fitting_chunk"]


@reference
def largest_fitting_chunk(peak_bytes: Callable[[int], int], m: int, budget: int) -> int | None:
    """The largest chunk in ``1..m`` whose peak (``peak_bytes(c)``, which never falls as ``c``
    grows) is at most ``budget``; None when not even a chunk of 1 fits."""
    if peak_bytes(1) > budget:
        return None
    fits, over = 1, m + 1  # bisection: peak(fits) is within the budget, every chunk from `over` is not
    while over - fits > 1:
        middle = (fits + over) // 2
        if peak_bytes(middle) <= budget:
            fits = middle
        else:
            over = middle
    return fits

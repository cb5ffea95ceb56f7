"""Checks for lesson 10_data_parallel (groundwork; the lesson's notebook is not written yet).

A ring all-reduce written by hand runs in real worker processes joined by gloo, started by the
course (:func:`course.parallel.launch`); each rank draws its own input inside its worker, so no rank
can see another's. The check compares every rank's result with the sum computed here, and counts,
where the traffic is sent, what each rank moved: a ring moves ``2 (n - 1) / n`` of the tensor per
rank (a reduce-scatter and an all-gather, ``n - 1`` steps each, one ``1/n`` chunk per step), on any
machine, so the count is a fair test where a timing on two shared CPU cores would not be.

Not served yet: under the grader these checks would run the learner's module in workers started
from the learner's sandboxed process (see the closing note of the session that wrote this).
"""

from __future__ import annotations

import torch

from course.checks.common import ok
from course.numerics import assert_close
from course.parallel import WorkersFailed, launch, rank_input

__all__ = ["check_ring_all_reduce"]

SERVED = ()


def _explain_traffic(n: int, numel: int, itemsize: int, sent: int, collectives: list) -> str | None:
    ring = 2 * (n - 1) * numel * itemsize // n
    full = numel * itemsize
    if collectives:
        return (f"it called {', '.join(sorted(set(collectives)))}; write the ring from send and recv (or isend and "
                "irecv) only")
    if sent == ring:
        return None
    if sent == (n - 1) * full:
        return (f"each rank sent its whole tensor {n - 1} times ({sent} bytes); a ring sends one 1/{n} chunk per step: "
                f"{n - 1} steps of reduce-scatter, then {n - 1} of all-gather, {ring} bytes in all")
    if sent == (n - 1) * full // n:
        return (f"each rank sent {sent} bytes, half a ring: the reduce-scatter ran, the all-gather that gives every "
                "rank every reduced chunk did not")
    return f"each rank should send 2 (n - 1) / n of the tensor, {ring} bytes for n = {n}; this one sent {sent}"


def check_ring_all_reduce(target: str, *, seed: int = 0, world_sizes: tuple[int, ...] = (2, 3, 4), numel: int = 24,
                          timeout_s: float = 60.0) -> None:
    """``target`` (``"module:function"``, a function in a module file) is ``ring_all_reduce(tensor)``:
    called on every rank of a gloo group, it leaves in ``tensor`` (or returns) the sum of every rank's
    tensor, as ``dist.all_reduce`` does, using only point-to-point calls, and each rank sends and
    receives exactly ``2 (n - 1) / n`` of the tensor's bytes. ``numel`` must divide by every world size."""
    hint = ("split the tensor into n chunks; reduce-scatter: at step s, rank r sends chunk (r - s) mod n to rank r + 1 "
            "and adds the chunk (r - s - 1) mod n it receives from rank r - 1; after n - 1 steps rank r holds the "
            "full sum of chunk (r + 1) mod n; all-gather: n - 1 more steps pass the finished chunks around the ring.")
    for n in world_sizes:
        if numel % n:
            raise ValueError(f"numel={numel} does not divide by world size {n}")
        label = f"ring_all_reduce on {n} ranks ({numel} float64 values each, seed {seed})"
        try:
            results = launch("course.parallel:all_reduce_case", n, target, seed, numel, timeout_s=timeout_s)
        except WorkersFailed as e:
            raise AssertionError(f"{label} did not finish: {e}\n  Hint: {hint}") from None
        want = sum(rank_input(seed, r, numel) for r in range(n))
        itemsize = want.element_size()
        for r, res in enumerate(results):
            got = res.get("value") if isinstance(res, dict) else None
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                raise AssertionError(f"{label}: rank {r} ended with {type(got).__name__} "
                                     f"{tuple(got.shape) if isinstance(got, torch.Tensor) else ''}; it should hold "
                                     f"the sum, a tensor of shape {tuple(want.shape)}.")
            why = _explain_traffic(n, numel, itemsize, res["sent"], res["collectives"])
            if why is not None:
                raise AssertionError(f"{label}: rank {r}: {why}.\n  Hint: {hint}")
            if res["received"] != res["sent"]:
                raise AssertionError(f"{label}: rank {r} sent {res['sent']} bytes but received {res['received']}; "
                                     f"in a ring every rank sends and receives the same.\n  Hint: {hint}")
            assert_close(got, want, name=f"{label}, rank {r}'s result", rtol=1e-12, atol=1e-12, hint=hint)
    ok(f"ring_all_reduce equals the sum on {', '.join(map(str, world_sizes))} ranks, moving 2 (n - 1) / n of the tensor "
       f"per rank (seed {seed})")

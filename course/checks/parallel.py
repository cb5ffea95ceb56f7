"""Checks for lesson 10_data_parallel: point-to-point, a ring all-reduce, DDP, ``no_sync`` and a
communication hook, each run in real worker processes joined by gloo.

The learner's answer is a function written in a cell. Under the grader the judge reads its program
(:func:`course.hand.hosted`: what it may call is a list) and the program host starts the workers, which
define that program and nothing else of the learner's (:func:`run_workers` there); in a notebook the
program is read the same way and the learner's process copies the function's source into a worker
module and starts the workers itself. Every worker
draws its own inputs inside its own process, from the check's seed and, for a part, from the system's
randomness (:func:`course.parallel.private_part`), so no rank sees another's or can compute it; each
reports that part. The check compares what comes back with what it computes here from the reports (a
sum, one process training on every rank's share), records for the parent what the seed alone decides,
and counts what only the workers can see where it happens: the bytes each rank sent,
the collectives it called, the gradient synchronisations per step, the dtype a hook all-reduced.
Counts are exact on any machine, where a timing on two shared CPU cores would not be.
"""

from __future__ import annotations

import re
import shutil
import tempfile

import torch

from course.checks.common import not_written, ok, record
from course.numerics import assert_close, observing_paused
from course.parallel import (WorkersFailed, _written, launch, rank_input, regression_model, train_full_batch,
                             write_worker)
from course import allowed_ops
from course.hand import hosted
from course.remote import is_remote, probe, prober, serving_host

__all__ = ["check_accumulation", "check_comm_hook", "check_ddp_training", "check_ring_all_reduce", "check_shift",
           "run_case", "run_workers"]

SERVED = ("check_shift", "check_ring_all_reduce", "check_ddp_training", "check_accumulation", "check_comm_hook")

CASES = ("shift_case", "all_reduce_case", "ddp_case", "accumulate_case", "hook_case")


def run_case(target: "str | dict", case: str, world_size: int, *args, timeout_s: float = 60.0,
             path: str | None = None, **launching) -> list:
    """Run the course's worker ``case`` on ``world_size`` ranks with ``target`` (``"module:function"``,
    importable by the workers, first from ``path``, or a program the judge read,
    :func:`course.parallel._target`); their results in rank order, a failed launch as an
    ``AssertionError``. ``launching``: more of :func:`course.parallel.launch`'s keywords."""
    if case not in CASES:
        raise ValueError(f"unknown worker case {case!r}")
    try:
        return launch(f"course.parallel:{case}", world_size, target, *args, timeout_s=timeout_s, path=path,
                      **launching)
    except WorkersFailed as e:
        raise AssertionError(str(e)) from None


#: What each exercise's program may not call (words in the names, as the judge reads it): the point-to-point
#: exercises, the library's collective, which would do them in one call; the DDP exercises, every message of
#: their own (DDP's are the only traffic: a rank that received the other shares point to point could train
#: alone, beside the model, to the same parameters); the hook, point-to-point messages (float32 gradients
#: sent that way beside a float16 all-reduce for the record would pass its counts).
NOT_HERE = {"shift_case": ("all_reduce",), "all_reduce_case": ("all_reduce",), "ddp_case": ("send", "recv", "all_reduce"),
            "accumulate_case": ("send", "recv", "all_reduce"), "hook_case": ("send", "recv")}


def uses(case: str) -> str:
    """What a program for ``case`` may use, as a refusal's advice says it: read from the lists the judge
    holds it to (:mod:`course.allowed_ops`), less what the exercise refuses (:data:`NOT_HERE`)."""
    calls = [n for n in sorted(allowed_ops.DISTRIBUTED) if not any(word in n for word in NOT_HERE[case])]
    return (f"torch (torch.distributed's {', '.join(calls)}; "
            f"{', '.join(f'torch.nn.parallel.{n}' for n in sorted(allowed_ops.PARALLEL))}; "
            f"{', '.join(f'torch.optim.{n}' for n in sorted(allowed_ops.OPTIM))}; "
            f"{', '.join(f'torch.futures.{n}' for n in sorted(allowed_ops.FUTURES))}; "
            f"{', '.join(f'contextlib.{n}' for n in sorted(allowed_ops.CONTEXTLIB))}), math, plain Python and the values "
            "it is given")


@prober
def run_workers(answer, case: str, world_size: int, *args, timeout_s: float = 60.0) -> list:
    """:func:`run_case` with the learner's function ``answer``: its source copied into a module in a
    fresh folder, which the workers import. Only a function defined with ``def`` is an answer (never a
    name of something importable: the workers run the code the learner wrote).

    In the program host (under the grader), ``answer`` is a program the judge read and the host defined
    (:func:`course.hand.define` keeps it on the function): the workers define that same program, and
    nothing else of the learner's runs in them; their results are read back as plain data."""
    program = getattr(answer, "course_program", None) if serving_host() else None
    if isinstance(program, dict):
        return run_case(dict(program), case, world_size, *args, timeout_s=timeout_s, echo=False, plain=True)
    name = getattr(answer, "__name__", "")
    if not callable(answer) or isinstance(answer, type) or not str(name).isidentifier():
        raise AssertionError(f"the answer should be a function defined with def in a cell; got "
                             f"{type(answer).__name__}")
    folder = tempfile.mkdtemp(prefix="course-answer-")
    try:
        write_worker(f"answer_{name}", answer, folder=folder)
        return run_case(f"answer_{name}:{name}", case, world_size, *args, timeout_s=timeout_s, path=folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


#: Bytes a process may write beyond what its counted sends account for: gloo's message headers
#: (under 100 bytes a message), a barrier, and some printing of the learner's own.
WIRE_SLACK = 64 * 1024


def _wire(label: str, r: int, res: dict, hint: str) -> None:
    """The kernel's count of what rank ``r`` wrote must be what its counted sends account for: a
    transfer through the process group's own methods (or a collective called around the counter)
    shows up here, whatever route it took."""
    wire = res.get("wire", -1)
    if not (isinstance(wire, int) and wire >= 0) and _written() >= 0:
        raise AssertionError(f"{label}: rank {r}'s process could not read the kernel's count of what it wrote "
                             "(/proc/self/io), which this machine keeps: something in it stood in the way.")
    if isinstance(wire, int) and wire >= 0 and wire > res["sent"] + WIRE_SLACK:
        raise AssertionError(f"{label}: rank {r}'s process wrote {wire} bytes while its sends account for {res['sent']}: "
                             "something sent data the counted send, recv, isend and irecv did not (a collective, or "
                             f"a process group's own methods), or it printed a lot.\n  Hint: {hint}")


def _run(answer, case: str, n: int, *args, label: str, hint: str, timeout_s: float = 60.0) -> list:
    """The workers' results for ``answer`` in ``case`` on ``n`` ranks. Under the grader's judge the
    learner's process only sends the answer's program: the judge reads it (:func:`course.hand.hosted`: a
    short list of what a program may call, ``torch.distributed``'s messages among them, nothing that
    reaches the course's counters) and the workers that run it are started by the program host, where
    nothing else of the learner's runs. What they count (bytes, collectives, synchronisations, rows) is
    then counted out of the learner's reach. In a notebook the program is read all the same (a refusal
    is told there first) and the learner's process starts the workers."""
    program = None
    if not isinstance(answer, str):
        program = hosted(answer, getattr(answer, "__name__", None) or "the answer", forbidden=NOT_HERE[case],
                         uses=uses(case), vocabulary="workers")
        if program is None and is_remote(answer):
            raise AssertionError(f"{label}: the grader could not run your program again in a process of its own.")
    try:
        if isinstance(answer, str):  # a module the caller wrote ("module:function"): here, never under the grader
            return run_case(answer, case, n, *args, timeout_s=timeout_s)
        return probe(program if program is not None else answer, run_workers, case, n, *args, timeout_s=timeout_s)
    except AssertionError as e:
        text = str(e)
        if re.search(r"^NotImplementedError\s*$", text, re.MULTILINE):  # the stub's bare raise, in a worker
            raise not_written(getattr(answer, "__name__", None) or str(answer)) from None
        raise AssertionError(f"{label} did not finish: {text}\n  Hint: {hint}") from None


def _inputs(results: list, seed: int, numel: int, label: str) -> tuple[list, list]:
    """Each rank's input in a point-to-point check, and the private part of it that rank drew and
    reported (:func:`course.parallel.private_input`)."""
    drawn = []
    for r, res in enumerate(results):
        own = res.get("drawn") if isinstance(res, dict) else None
        if not (isinstance(own, torch.Tensor) and own.dtype == torch.float64 and tuple(own.shape) == (numel,)
                and bool(((own >= -1) & (own < 1)).all())):
            raise AssertionError(f"{label}: rank {r}'s report has no private part of its input as the course's worker "
                                 "draws it: the worker's result was altered.")
        drawn.append(own)
    return [rank_input(seed, r, numel) + own for r, own in enumerate(drawn)], drawn


def _tensor(value, label: str, shape) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
        got = f"{type(value).__name__} {tuple(value.shape) if isinstance(value, torch.Tensor) else ''}".strip()
        raise AssertionError(f"{label} ended with {got}; it should be a tensor of shape {tuple(shape)}.")
    return value


# -- point to point -----------------------------------------------------------------------------------

def check_shift(shift, *, seed: int = 0, world_sizes: tuple[int, ...] = (2, 3), numel: int = 65536,
                timeout_s: float = 30.0) -> None:
    """``shift(tensor)`` on every rank returns the tensor of the rank before it (rank ``r`` gets rank
    ``r - 1``'s, rank 0 the last rank's), sending its own to the rank after it, point to point only,
    and on any number of ranks."""
    hint = ("gloo's send waits until the other side receives: if every rank sends first, every rank waits. Start "
            "the receive and the send together (dist.irecv and dist.isend, then wait on both), or let even ranks "
            "send first and odd ranks receive first.")
    for n in world_sizes:
        label = f"shift on {n} ranks ({numel} float64 values each, seed {seed})"
        results = _run(shift, "shift_case", n, seed, numel, label=label, hint=hint, timeout_s=timeout_s)
        inputs, drawn = _inputs(results, seed, numel, label)
        for r, res in enumerate(results):
            got = _tensor(res.get("value"), f"{label}: rank {r}", (numel,))
            if res["collectives"]:
                raise AssertionError(f"{label}: rank {r} called {', '.join(sorted(set(res['collectives'])))}; "
                                     "use send and recv (or isend and irecv) only.")
            before = (r - 1) % n
            if torch.equal(got, inputs[(r + 1) % n]) and n > 2:
                raise AssertionError(f"{label}: rank {r} holds rank {(r + 1) % n}'s tensor, the rank *after* it: "
                                     "the shift runs the wrong way round (send to r + 1, receive from r - 1).")
            if torch.equal(got, inputs[r]):
                raise AssertionError(f"{label}: rank {r} returned its own tensor: return the one you received.")
            name = f"{label}, rank {r}'s result"
            with observing_paused():  # the inputs hold parts only their ranks drew: each run's own
                assert_close(got, inputs[before], name=name, rtol=0, atol=0, hint=hint)
            record(got - drawn[before], rank_input(seed, before, numel), name)  # the seeded part, as the parent knows it
            full = numel * 8
            if res["sent"] != full:
                raise AssertionError(f"{label}: rank {r} sent {res['sent']} bytes; one tensor is {full}.")
            _wire(label, r, res, hint)
    ok(f"shift passes every tensor to the next rank, without deadlock, on {', '.join(map(str, world_sizes))} ranks")


# -- the ring all-reduce ------------------------------------------------------------------------------

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


def check_ring_all_reduce(ring_all_reduce, *, seed: int = 0, world_sizes: tuple[int, ...] = (2, 3, 4),
                          numel: int = 122880, timeout_s: float = 60.0) -> None:
    """``ring_all_reduce(tensor)`` (a function, or ``"module:function"``): called on every rank of a
    gloo group, it leaves in ``tensor`` (or returns) the sum of every rank's tensor, as
    ``dist.all_reduce`` does, using only point-to-point calls, and each rank sends and receives
    exactly ``2 (n - 1) / n`` of the tensor's bytes, as the kernel's count of what each process wrote
    confirms (so the tensor is large: ~1 MB by default). ``numel`` must divide by every world size."""
    hint = ("split the tensor into n chunks; reduce-scatter: at step s, rank r sends chunk (r - s) mod n to rank r + 1 "
            "and adds the chunk (r - s - 1) mod n it receives from rank r - 1; after n - 1 steps rank r holds the "
            "full sum of chunk (r + 1) mod n; all-gather: n - 1 more steps pass the finished chunks around the ring.")
    for n in world_sizes:
        if numel % n:
            raise ValueError(f"numel={numel} does not divide by world size {n}")
        label = f"ring_all_reduce on {n} ranks ({numel} float64 values each, seed {seed})"
        results = _run(ring_all_reduce, "all_reduce_case", n, seed, numel, label=label, hint=hint,
                       timeout_s=timeout_s)
        inputs, drawn = _inputs(results, seed, numel, label)
        want, seeded, spread = sum(inputs), sum(rank_input(seed, r, numel) for r in range(n)), sum(drawn)
        itemsize = want.element_size()
        for r, res in enumerate(results):
            got = _tensor(res.get("value") if isinstance(res, dict) else None, f"{label}: rank {r}", want.shape)
            why = _explain_traffic(n, numel, itemsize, res["sent"], res["collectives"])
            if why is not None:
                raise AssertionError(f"{label}: rank {r}: {why}.\n  Hint: {hint}")
            if res["received"] != res["sent"]:
                raise AssertionError(f"{label}: rank {r} sent {res['sent']} bytes but received {res['received']}; "
                                     f"in a ring every rank sends and receives the same.\n  Hint: {hint}")
            _wire(label, r, res, hint)
            name = f"{label}, rank {r}'s result"
            with observing_paused():  # the inputs hold parts only their ranks drew: each run's own
                assert_close(got, want, name=name, rtol=1e-12, atol=1e-12, hint=hint)
            record(got - spread, seeded, name)  # the seeded part, as the parent knows it
    ok(f"ring_all_reduce equals the sum on {', '.join(map(str, world_sizes))} ranks, moving 2 (n - 1) / n of the tensor "
       f"per rank (seed {seed})")


# -- DDP -----------------------------------------------------------------------------------------------

#: How close a result must be to a known mistake's to be named as it. Looser than the verdict's
#: tolerance: the mistakes diverge (the sum of squared errors takes steps 32 times too long and reaches
#: 1e6-1e7 in five), and there the ranks' and the one process's orders of summing part by up to 3e-6
#: of the values (300 drawn batches). The verdict does not depend on it, only the message.
MISTAKE_RTOL = 1e-5


def _same_as(got: dict, candidates: dict, tol: float) -> str | None:
    tol = max(tol, MISTAKE_RTOL)
    for name, params in candidates.items():
        if all(torch.allclose(got[k], v, rtol=tol, atol=tol) for k, v in params.items()):
            return name
    return None


def _batch(results: list, label: str, world_size: int, rows: int, dtype: torch.dtype) -> tuple:
    """The full batch of a data-parallel check: every rank's share, drawn in that rank's process and
    reported (:func:`course.parallel.private_batch`), in rank order, as float64."""
    xs, ys = [], []
    for r, res in enumerate(results):
        share = res.get("share") if isinstance(res, dict) else None
        size = len(range(rows)[r * -(-rows // world_size):(r + 1) * -(-rows // world_size)])
        if not (isinstance(share, tuple) and len(share) == 2 and all(
                isinstance(t, torch.Tensor) and t.dtype == dtype and bool(t.isfinite().all()) for t in share)
                and tuple(share[0].shape) == (size, 8) and tuple(share[1].shape) == (size, 1)):
            raise AssertionError(f"{label}: rank {r}'s report has no share of the batch as the course's worker draws "
                                 "it: the worker's result was altered.")
        xs.append(share[0].double())
        ys.append(share[1].double())
    return torch.cat(xs), torch.cat(ys)


def _compare_params(label: str, got: dict, want: dict, mistakes: dict, tol: float, hint: str) -> None:
    """Every parameter as one process trained on the full batch; the mistakes named. The batch holds
    rows only their ranks drew, so the parameters are each run's own: the comparisons are not
    reported to the grading parent, their verdict is."""
    if not isinstance(got, dict) or set(got) != set(want):
        raise AssertionError(f"{label}: the model's parameters came back as {sorted(got) if isinstance(got, dict) else got!r}"
                             f"; expected {sorted(want)} (train the model you were given).")
    if not all(torch.allclose(got[k], v, rtol=tol, atol=tol) for k, v in want.items()):
        why = _same_as(got, mistakes, tol)
        if why is not None:
            raise AssertionError(f"{label}: the parameters are those of {why}.\n  Hint: {hint}")
    with observing_paused():
        for k in sorted(want):
            assert_close(got[k], want[k], name=f"{label}, parameter {k}", rtol=tol, atol=tol, hint=hint)
    record([True], [True], f"{label}: every parameter equals one process's on the full batch")


def check_ddp_training(train_ddp, *, seed: int = 0, world_size: int = 2, rows: int = 64, steps: int = 5,
                       lr: float = 0.1, timeout_s: float = 60.0) -> None:
    """``train_ddp(model, inputs, targets, steps, lr)``, run on every rank with the same model and a
    batch of the full batch's shape (the rows of this rank's share drawn in its own process, the others
    stand-ins: :func:`course.parallel.private_batch`), wraps the model in DDP and takes ``steps`` SGD
    steps (mean squared error) on this rank's share of the rows; afterwards every rank's model equals
    one process trained on the full batch, every rank's share together."""
    hint = ("wrap the model in DDP(model); take this rank's rows, inputs.chunk(world_size)[rank] (and the same rows "
            "of targets); each step: zero the gradients, F.mse_loss(ddp_model(x), y).backward(), optimizer.step(). "
            "DDP averages the ranks' gradients, so the mean loss on equal shares gives the full batch's gradient.")
    label = f"train_ddp on {world_size} ranks ({rows} rows, {steps} steps, seed {seed})"
    results = _run(train_ddp, "ddp_case", world_size, seed, rows, steps, lr, label=label, hint=hint,
                   timeout_s=timeout_s)
    data = _batch(results, label, world_size, rows, torch.float64)
    want = train_full_batch(seed, rows, steps, lr, data=data)
    mistakes = {"training with the sum of the squared errors instead of their mean (each rank's gradient is its "
                f"share's sum, {rows // world_size} times too large)": train_full_batch(
                    seed, rows, steps, lr, loss_scale=rows // world_size, data=data),
                "gradients summed over the ranks instead of averaged": train_full_batch(seed, rows, steps, lr,
                                                                                       grad_scale=world_size, data=data),
                "gradients never zeroed between steps (each step adds to the last)":
                    train_full_batch(seed, rows, steps, lr, accumulate=True, data=data)}
    share = rows // world_size
    for r, res in enumerate(results):
        if not isinstance(res, dict) or not isinstance(res.get("rows"), list):
            raise AssertionError(f"{label}: rank {r} sent back {type(res).__name__}")
        seen = res["rows"]
        if seen and set(seen) != {share}:
            raise AssertionError(f"{label}: rank {r}'s forward passes saw {sorted(set(seen))} rows; each rank should "
                                 f"run on its share, {rows} / {world_size} = {share} rows (the full batch on every "
                                 "rank does the same work twice).\n  Hint: " + hint)
        if len(seen) != steps:
            raise AssertionError(f"{label}: rank {r} ran the model {len(seen)} times; expected one forward per step, "
                                 f"{steps}.")
        _compare_params(f"{label}: rank {r}", res.get("params"), want, mistakes, 1e-9, hint)
    ok(f"train_ddp: {world_size} ranks on {share} rows each equal one process on {rows} rows after {steps} steps")


def check_accumulation(accumulate, *, seed: int = 0, world_size: int = 2, rows: int = 64, micro: int = 4,
                       steps: int = 3, lr: float = 0.1, timeout_s: float = 60.0) -> None:
    """``accumulate(ddp_model, optimizer, micro_inputs, micro_targets)`` takes one optimizer step from
    ``len(micro_inputs)`` micro-batches of this rank's share, synchronising gradients once (under
    ``ddp_model.no_sync()`` for all but the last backward): the result equals one process on the full
    batch, with one synchronisation per step."""
    hint = ("for every micro-batch but the last, run forward and backward inside `with ddp_model.no_sync():`; the "
            "last backward runs outside it, and DDP averages the accumulated gradients then. Divide each "
            "micro-batch's loss by the number of micro-batches, step once, and zero the gradients.")
    label = f"accumulate on {world_size} ranks ({micro} micro-batches of {rows // world_size // micro} rows, seed {seed})"
    results = _run(accumulate, "accumulate_case", world_size, seed, rows, micro, steps, lr, label=label, hint=hint,
                   timeout_s=timeout_s)
    data = _batch(results, label, world_size, rows, torch.float64)
    want = train_full_batch(seed, rows, steps, lr, data=data)
    mistakes = {f"each micro-batch's loss not divided by {micro} (the accumulated gradient is {micro} times too "
                "large)": train_full_batch(seed, rows, steps, lr, loss_scale=micro, data=data),
                "gradients never zeroed between steps (each step adds to the last)":
                    train_full_batch(seed, rows, steps, lr, accumulate=True, data=data)}
    for r, res in enumerate(results):
        syncs = res.get("syncs") if isinstance(res, dict) else None
        if syncs != [1] * steps:
            extra = ("every micro-batch's backward synchronised the gradients: wrap all but the last in no_sync()"
                     if syncs == [micro] * steps else
                     "no backward synchronised them: the last micro-batch must run outside no_sync(), or the ranks "
                     "drift apart" if syncs == [0] * steps else f"{syncs} synchronisations in the {steps} steps")
            raise AssertionError(f"{label}: rank {r}: {extra} (expected one per step).\n  Hint: {hint}")
        size = rows // world_size // micro
        if res.get("rows") != [[size] * micro] * steps:
            raise AssertionError(f"{label}: rank {r}'s forward passes saw {res.get('rows')} rows per step; expected one "
                                 f"forward per micro-batch, {micro} of {size} rows (accumulating is what lets a "
                                 f"batch that does not fit run in pieces).\n  Hint: {hint}")
        _compare_params(f"{label}: rank {r}", res.get("params"), want, mistakes, 1e-9, hint)
    ok(f"accumulate: one gradient synchronisation per step of {micro} micro-batches, and the full batch's result")


def check_comm_hook(fp16_hook, *, seed: int = 0, world_size: int = 2, rows: int = 64, steps: int = 5, lr: float = 0.1,
                    timeout_s: float = 60.0) -> None:
    """``fp16_hook(state, bucket)``, registered with ``ddp_model.register_comm_hook(None, fp16_hook)``,
    all-reduces the bucket's gradients as float16 (half the bytes) and returns a future of their
    float32 average: training equals the full batch's in float32 within float16's rounding."""
    hint = ("buffer = bucket.buffer(); all-reduce buffer.to(torch.float16) / world_size with async_op=True; return "
            "fut.get_future().then(lambda f: f.value()[0].to(buffer.dtype)) (a hook returns a Future of the "
            "bucket's averaged gradients, in the bucket's dtype).")
    label = f"fp16_hook on {world_size} ranks ({steps} steps, seed {seed})"
    results = _run(fp16_hook, "hook_case", world_size, seed, rows, steps, lr, label=label, hint=hint,
                   timeout_s=timeout_s)
    data = _batch(results, label, world_size, rows, torch.float32)
    want = train_full_batch(seed, rows, steps, lr, data=data)
    mistakes = {"gradients summed over the ranks instead of averaged (divide by the world size)":
                    train_full_batch(seed, rows, steps, lr, grad_scale=world_size, data=data)}
    numel = sum(p.numel() for p in regression_model(seed).parameters())
    for r, res in enumerate(results):
        tensors = res.get("tensors") if isinstance(res, dict) else None
        if not tensors:
            raise AssertionError(f"{label}: rank {r}: the hook never called dist.all_reduce; it must all-reduce the "
                                 f"bucket itself.\n  Hint: {hint}")
        others = sorted(set(res.get("collectives") or ()) - {"all_reduce"})
        if others:
            raise AssertionError(f"{label}: rank {r}'s hook called {', '.join(others)}; it must send the gradients with "
                                 f"one float16 all_reduce per bucket, nothing else.\n  Hint: {hint}")
        dtypes = sorted({d for d, _ in tensors})
        if dtypes != ["float16"]:
            raise AssertionError(f"{label}: rank {r} all-reduced {', '.join(dtypes)} tensors; compress the bucket to "
                                 f"float16 first (half the bytes of float32).\n  Hint: {hint}")
        if sum(k for _, k in tensors) != numel * steps:
            raise AssertionError(f"{label}: rank {r} all-reduced {sum(k for _, k in tensors)} values in {steps} steps; "
                                 f"the model's gradients are {numel} values per step.")
        got = {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in (res.get("params") or {}).items()}
        _compare_params(f"{label}: rank {r}", got, want, mistakes, 2e-3, hint)
    ok(f"fp16_hook: gradients all-reduced as float16 (half the bytes), training within float16's rounding of the full "
       f"batch's")

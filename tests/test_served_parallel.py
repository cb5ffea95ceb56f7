"""Lesson 10 under the grader's judge: the learner's process only sends each answer's program; the judge
reads it (``course.hand.read_program``) and the program host starts the workers that run it, so what the
workers count (bytes sent, collectives, synchronisations, rows) is counted where no learner code reaches.

In grader version 45 the workers were the learner's: the counts lived in the course's wrappers there,
reachable through their closures, and a ring that let the library's all-reduce do the sum, its counter
set by hand to a ring's bytes, earned the ring's three points (the kernel's count of bytes written agreed:
the library's ring writes what a ring writes)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest

from course.hand import read_program
from served_helpers import forging, served as _served

sys.path.insert(0, str(Path(__file__).parent))
import parallel_answers as answers  # noqa: E402

served = contextlib.contextmanager(_served)
from test_parallel import no_worker_left  # noqa: E402

#: The counters forged through the course's wrappers' closures: the sum by the library, the counts by hand.
CLOSURE_RING = '''
import torch
import torch.distributed as dist


def ring_all_reduce(tensor):
    n = dist.get_world_size()
    counting = [c.cell_contents for c in dist.send.__closure__ if hasattr(c.cell_contents, "traffic")][0]
    dist.all_reduce.__wrapped__(tensor)
    ring = 2 * (n - 1) * tensor.numel() * tensor.element_size() // n
    counting.traffic["sent"] += ring
    counting.traffic["received"] += ring
'''


@pytest.fixture
def learner_workers(monkeypatch):
    """Counts the launches that the learner's side starts (through ``write_worker``, as the learner's
    process does); under the judge there are none."""
    import course.checks.parallel as checks

    started = []
    real = checks.write_worker

    def counted(*args, **kwargs):
        started.append(args[0])
        return real(*args, **kwargs)
    monkeypatch.setattr(checks, "write_worker", counted)
    return started


@pytest.mark.parametrize("check, answer, kwargs", [
    ("check_shift", "shift", {"world_sizes": (3,)}),
    ("check_ring_all_reduce", "ring_all_reduce", {"world_sizes": (3,)}),
    ("check_ddp_training", "train_ddp", {}),
    ("check_accumulation", "accumulate", {}),
    ("check_comm_hook", "fp16_hook", {}),
])
def test_every_lesson_10_answer_keeps_its_marks_run_by_the_program_hosts_workers(program_host, learner_workers, capsys,
                                                                                 check, answer, kwargs):
    import course.checks.parallel as checks

    with served({answer: getattr(answers, answer)}) as remote:
        getattr(checks, check)(remote(answer), **kwargs)
    assert "ok: " in capsys.readouterr().out
    assert learner_workers == []  # no worker of the learner's process ran: only its program crossed
    assert no_worker_left()


def test_a_mistake_is_still_named_run_by_the_program_hosts_workers(program_host):
    from course.checks.parallel import check_ddp_training

    with served({"train_ddp": answers.train_ddp_sum}) as remote:
        with pytest.raises(AssertionError, match="the sum of the squared errors instead of their mean"):
            check_ddp_training(remote("train_ddp"))
    assert no_worker_left()


def test_counts_forged_through_the_wrappers_closures_earn_nothing(tmp_path, monkeypatch, program_host):
    """Red team, round 16 (ours, against version 45): the counter reached through ``dist.send``'s closure,
    the sum by the library's all-reduce. In the learner's workers it passes (the module run as before, no
    program read); as an answer the judge reads, it cannot be written."""
    from course.checks.parallel import check_ring_all_reduce
    from course.parallel import write_worker

    monkeypatch.syspath_prepend(str(tmp_path))
    write_worker("closure_ring", CLOSURE_RING.split("\n\n\n", 1)[1], folder=tmp_path)
    check_ring_all_reduce("closure_ring:ring_all_reduce", world_sizes=(3,))  # what version 45 believed
    namespace: dict = {}
    exec(compile(CLOSURE_RING, str(tmp_path / "cell.py"), "exec"), namespace)  # noqa: S102
    (tmp_path / "cell.py").write_text(CLOSURE_RING)
    with served({"ring_all_reduce": namespace["ring_all_reduce"]}) as remote:
        with pytest.raises(AssertionError, match=r"read by the grader: it reads \.(cell_contents|__closure__)"):
            check_ring_all_reduce(remote("ring_all_reduce"), world_sizes=(3,))
    assert no_worker_left()


def test_a_program_forged_by_the_learners_process_is_still_read(monkeypatch, program_host):
    """The learner's process may send any text as the program (its word): what runs is what the judge
    read, and a program that calls the library is refused, whatever the function in the notebook was."""
    import course.bare
    from course.checks.parallel import check_ring_all_reduce

    forged = {"source": "import torch.distributed as dist\n\n\ndef ring_all_reduce(tensor):\n"
                        "    dist.all_reduce(tensor)\n", "name": "ring_all_reduce", "left": []}
    forging(monkeypatch, course.bare, "bare_program", lambda real, *args, **kwargs: forged)
    with served({"ring_all_reduce": answers.ring_all_reduce}) as remote:
        with pytest.raises(AssertionError, match="read by the grader: it calls torch.distributed.all_reduce, which "
                                                 "this exercise's answer may not use"):
            check_ring_all_reduce(remote("ring_all_reduce"), world_sizes=(2,))


def test_a_refusals_advice_names_what_the_exercise_may_use():
    """The advice is read from the lists the judge holds the program to, less what the exercise refuses:
    a point-to-point exercise is not told of all_reduce, the DDP ones of no message of their own, the
    hook of all_reduce but of no point-to-point message."""
    from course import allowed_ops
    from course.checks.parallel import NOT_HERE, uses

    said = {case: uses(case) for case in NOT_HERE}
    assert "all_reduce" not in said["shift_case"] and "isend" in said["shift_case"], said
    assert "get_rank, get_world_size;" in said["ddp_case"] and "send" not in said["ddp_case"], said
    assert "all_reduce" in said["hook_case"] and "recv" not in said["hook_case"], said
    for case, text in said.items():
        named = {n for n in allowed_ops.DISTRIBUTED if f" {n}," in text or f" {n};" in text}
        assert named == {n for n in allowed_ops.DISTRIBUTED if not any(w in n for w in NOT_HERE[case])}, (case, text)
        assert "DistributedDataParallel" in text and "SGD" in text, text


@pytest.mark.parametrize("body, refused", [
    ("dist.all_reduce(tensor)", r"torch\.distributed\.all_reduce, which this exercise's answer may not use"),
    ("dist.all_gather([tensor], tensor)", r"torch\.distributed\.all_gather"),
    ("dist.batch_isend_irecv([])", r"torch\.distributed\.batch_isend_irecv"),
    ("dist.new_group([0, 1])", r"torch\.distributed\.new_group"),
    ("dist.group.WORLD.allreduce([tensor])", r"torch\.distributed\.group"),
    ("dist.send.__wrapped__(tensor, 1)", r"\.__wrapped__"),
    ("dist.send.__closure__", r"\.__closure__"),
    ("getattr(dist, 'all_reduce')(tensor)", r"the builtin getattr"),
    ("torch.from_file('/tmp/x', shared=True, size=4)", r"torch\.from_file"),
    ("open('/tmp/x', 'w').write('1')", r"the builtin open"),
    ("dist.init_process_group('gloo')", r"torch\.distributed\.init_process_group"),
])
def test_the_reading_refuses_every_route_around_the_workers_counters(body, refused):
    """What a program for lesson 10's point-to-point exercises may call is a list (send, recv, isend,
    irecv, who this rank is): collectives, process groups, the course's wrappers' insides, files."""
    source = f"import torch\nimport torch.distributed as dist\n\n\ndef ring(tensor):\n    {body}\n"
    with pytest.raises(AssertionError, match=refused):
        read_program(source, forbidden=("all_reduce",), vocabulary="workers")


def test_the_with_statement_a_program_may_use_sets_no_mode_of_torchs():
    """``with model.no_sync():`` and a name the program bound are read; a context manager of torch's
    held in a name (which could be left entered) is not, nor a with that binds its value."""
    ok = ("import contextlib\n\n\ndef f(m, xs):\n    for i, x in enumerate(xs):\n"
          "        quiet = m.no_sync() if i else contextlib.nullcontext()\n        with quiet:\n            m(x)\n"
          "        with m.no_sync():\n            m(x)\n")
    read_program(ok, vocabulary="workers")
    for bad, why in [("q = torch.no_grad()\n    with q:\n        pass", r"torch\.no_grad .* other than"),
                     ("with m.no_sync() as s:\n        pass", "with statement"),
                     ("with torch.no_sync():\n        pass", r"torch\.no_sync")]:
        with pytest.raises(AssertionError, match=why):
            read_program(f"import torch\n\n\ndef f(m):\n    {bad}\n", vocabulary="workers")


#: A hook that all-reduces float16 zeros for the record and averages the float32 gradients by messages of
#: its own; a DDP answer that trains alone on every share, received point to point (no DDP traffic at all).
AROUND = '''
import torch
import torch.distributed as dist
import torch.nn.functional as F


def fp16_hook(state, bucket):
    buffer = bucket.buffer()
    rank, n = dist.get_rank(), dist.get_world_size()
    total = buffer.clone()
    for other in range(n):
        if other != rank:
            got = torch.empty_like(buffer)
            requests = [dist.isend(buffer.clone(), other), dist.irecv(got, other)]
            for request in requests:
                request.wait()
            total.add_(got)
    work = dist.all_reduce(torch.zeros_like(buffer, dtype=torch.float16), async_op=True)
    return work.get_future().then(lambda fut: total / n)


def train_ddp(model, inputs, targets, steps, lr):
    rank, n = dist.get_rank(), dist.get_world_size()
    xs, ys = list(inputs.chunk(n)), list(targets.chunk(n))
    for other in range(n):
        if other != rank:
            requests = [dist.isend(xs[rank].clone(), other), dist.isend(ys[rank].clone(), other),
                        dist.irecv(xs[other], other), dist.irecv(ys[other], other)]
            for request in requests:
                request.wait()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        model(xs[rank])
        first, last = model[0], model[2]
        out = F.linear(torch.tanh(F.linear(inputs, first.weight, first.bias)), last.weight, last.bias)
        F.mse_loss(out, targets).backward()
        optimizer.step()
'''


@pytest.mark.parametrize("check, name, refused", [
    ("check_comm_hook", "fp16_hook", r"it calls torch\.distributed\.isend, which this exercise's answer may not use"),
    ("check_ddp_training", "train_ddp", r"it calls torch\.distributed\.isend, which this exercise's answer may not use"),
])
def test_messages_of_an_answers_own_around_what_the_exercise_asks_are_refused(tmp_path, monkeypatch, program_host,
                                                                              check, name, refused):
    """Ours, round 16: the hook's counts see only collectives, and the DDP check compares parameters and
    rows: messages sent point to point beside them passed both in the learner's workers (the module, run as
    before). As answers, the judge's reading refuses the messages."""
    import course.checks.parallel as checks
    from course.parallel import write_worker

    monkeypatch.syspath_prepend(str(tmp_path))
    write_worker("around", AROUND.split("\n\n\n", 1)[1], folder=tmp_path)
    getattr(checks, check)(f"around:{name}")  # what version 45 believed
    namespace: dict = {}
    (tmp_path / "cell.py").write_text(AROUND)
    exec(compile(AROUND, str(tmp_path / "cell.py"), "exec"), namespace)  # noqa: S102
    with served({name: namespace[name]}) as remote:
        with pytest.raises(AssertionError, match=refused):
            getattr(checks, check)(remote(name))
    assert no_worker_left()


def test_a_hook_that_makes_its_own_future_after_a_blocking_all_reduce_is_read_and_passes(tmp_path, program_host):
    """Another right hook than the lesson's: a blocking float16 all-reduce, the future made by hand."""
    from course.checks.parallel import check_comm_hook

    source = ("import torch\nimport torch.distributed as dist\n\n\ndef fp16_hook(state, bucket):\n"
              "    buffer = bucket.buffer()\n    half = buffer.to(torch.float16).div_(dist.get_world_size())\n"
              "    dist.all_reduce(half)\n    fut = torch.futures.Future()\n    fut.set_result(half.to(buffer.dtype))\n"
              "    return fut\n")
    (tmp_path / "cell.py").write_text(source)
    namespace: dict = {}
    exec(compile(source, str(tmp_path / "cell.py"), "exec"), namespace)  # noqa: S102
    with served({"fp16_hook": namespace["fp16_hook"]}) as remote:
        check_comm_hook(remote("fp16_hook"), world_size=2, steps=2)
    assert no_worker_left()

"""Lesson 10's groundwork (course.parallel): workers started from module files join one process group
and hand their results back in rank order; a worker that raises, dies or hangs ends the launch with
its rank named, and no worker is ever left running."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch

from course.parallel import WorkersFailed, launch, write_worker

sys.path.insert(0, str(Path(__file__).parent))
import parallel_answers as answers  # noqa: E402


def no_worker_left() -> bool:
    """No process that course.parallel.launch started from this test session is still running (a scan
    of /proc: a worker with the session's PYTEST_CURRENT_TEST in its environment; a grade running
    beside the tests has workers of its own, whose environment the sandbox made)."""
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if (b"_worker_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
                        and b"PYTEST_CURRENT_TEST=" in Path(f"/proc/{pid}/environ").read_bytes()):
                    return False
            except OSError:
                continue
    return True

WORKER = '''
import os
import torch
import torch.distributed as dist


def all_reduce(rank, world_size, base):
    t = torch.tensor([float(rank + base)])
    dist.all_reduce(t)
    return t


def ring_pass(rank, world_size):
    """Each rank sends its rank to the next and receives from the previous one."""
    out, got = torch.tensor([float(rank)]), torch.zeros(1)
    if rank % 2 == 0:
        dist.send(out, (rank + 1) % world_size)
        dist.recv(got, (rank - 1) % world_size)
    else:
        dist.recv(got, (rank - 1) % world_size)
        dist.send(out, (rank + 1) % world_size)
    return int(got.item())


def raises(rank, world_size):
    if rank == 1:
        raise ValueError("rank one is broken")
    return rank


def waits(rank, world_size):
    if rank == 0:
        dist.recv(torch.zeros(1), 1)  # rank 1 never sends, and ends
    return rank


def deadlock(rank, world_size):
    dist.recv(torch.zeros(1), 1 - rank)  # both wait for the other: a real hang
    return rank


def dies(rank, world_size):
    if rank == 1:
        os._exit(3)
    dist.barrier()
    return rank


def napping(rank, world_size, folder):
    import time
    open(os.path.join(folder, f"napping-{rank}"), "w").close()
    for _ in range(4):
        time.sleep(0.5)
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    return int(t.item())
'''


@pytest.fixture()
def worker(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    write_worker("course_test_worker", WORKER, folder=tmp_path)
    return "course_test_worker"


def test_workers_join_one_group_and_return_in_rank_order(worker):
    assert launch(f"{worker}:all_reduce", 2, 10) == [torch.tensor([21.0]), torch.tensor([21.0])]
    assert launch(f"{worker}:ring_pass", 4, rendezvous="tcp") == [3, 0, 1, 2]
    assert no_worker_left()


def test_a_rank_that_raises_is_named_with_its_error(worker):
    with pytest.raises(WorkersFailed, match=r"rank 1 raised:(.|\n)*ValueError: rank one is broken"):
        launch(f"{worker}:raises", 2, timeout_s=60)
    assert no_worker_left()


def test_each_result_file_is_read_once_however_long_the_others_take(worker, monkeypatch):
    import course.parallel

    reads, read = [], course.parallel._read
    monkeypatch.setattr(course.parallel, "_read", lambda path, key, rank, plain=False: reads.append(rank) or read(path, key, rank, plain))
    with pytest.raises(WorkersFailed, match=r"rank 1: finished"):  # rank 1's file waits while rank 0 hangs
        launch(f"{worker}:waits", 2, timeout_s=6)
    # each file read once; rank 0 may have raised (its peer gone; then both files can appear within one poll,
    # read in rank order) or been stopped
    assert sorted(reads) in ([0, 1], [1])
    reads.clear()
    assert launch(f"{worker}:ring_pass", 4) == [3, 0, 1, 2]
    assert sorted(reads) == [0, 1, 2, 3]
    assert no_worker_left()


@pytest.mark.parametrize("target, why", [
    ("deadlock", r"ranks 0, 1 did not finish in 6 s"),
    ("waits", r"rank 0 lost its connection to a peer that had ended(.|\n)*rank 1: finished"),
    ("dies", r"rank 1 died \(exit code 3\)"),
])
def test_a_hung_or_dead_worker_ends_the_launch_and_nothing_is_left_running(worker, target, why):
    start = time.monotonic()
    with pytest.raises(WorkersFailed, match=why):
        launch(f"{worker}:{target}", 2, timeout_s=6)
    assert time.monotonic() - start < 30
    assert no_worker_left()


def test_a_launch_held_still_whole_longer_than_its_limit_still_finishes(worker, tmp_path):
    """Under the grader, another submission's timing turn freezes this one whole, the launcher and its
    workers, for up to ten minutes; the launcher's limit counted wall time, so lesson 10's workers
    failed "did not finish" for a classmate's measurement (an audit, 2026-12-04). Its clock now counts
    only the time it lived (course.parallel.HELD_GAP_S). Here the whole launch is stopped (SIGSTOP)
    mid-run for longer than its limit, then let go: it finishes, its all_reduce after the pause too."""
    import signal
    import subprocess

    from autograder.proc import descendants

    code = ("import sys; sys.path[:0] = [sys.argv[1]]; from course.parallel import launch; "
            "print(launch('course_test_worker:napping', 2, sys.argv[1], timeout_s=10, path=sys.argv[1]))")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=Path(__file__).parents[1],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"napping-{r}").exists() for r in range(2)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, proc.communicate()[0]
        held = [proc.pid, *descendants(proc.pid)]
        for pid in held:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(11)  # longer than the launch's limit
        for pid in held:
            os.kill(pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and out.strip().splitlines()[-1] == "[2, 2]", out[-2000:]
    assert no_worker_left()


def test_the_launchers_clock_counts_a_long_gap_as_a_pause_not_as_time(monkeypatch):
    import course.parallel as P

    now = [100.0]
    monkeypatch.setattr(P.time, "monotonic", lambda: now[0])
    awake = P._AwakeClock()
    for step in (0.02, 0.5, 300.0, 0.02):  # looks every few hundredths, and one pause of five minutes
        now[0] += step
        spent = awake()
    assert spent == pytest.approx(0.02 + 0.5 + P.HELD_GAP_S + 0.02)


def test_a_function_from_a_notebook_cell_is_refused_with_the_reason():
    def cell_function(rank, world_size):
        return rank

    cell_function.__module__ = "__main__"
    with pytest.raises(WorkersFailed, match="cannot import a notebook's cells"):
        launch(cell_function, 2)
    with pytest.raises(ValueError, match="plain Python name"):
        write_worker("my-worker", "")
    with pytest.raises(ValueError, match="'module:function'"):
        launch("no_function_named", 2)


# -- the ring all-reduce check -----------------------------------------------------------------------

RINGS = '''
import torch
import torch.distributed as dist


def _pass(chunks, out, into, add):
    # send chunk `out` to the next rank; receive the previous rank's into chunk `into` (added, or copied)
    r, n = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(chunks[into])
    req = dist.isend(chunks[out].clone(), (r + 1) % n)
    dist.recv(buf, (r - 1) % n)
    req.wait()
    chunks[into].add_(buf) if add else chunks[into].copy_(buf)


def _reduce_scatter(chunks):
    r, n = dist.get_rank(), dist.get_world_size()
    for s in range(n - 1):
        _pass(chunks, (r - s) % n, (r - s - 1) % n, add=True)


def ring(tensor):
    r, n = dist.get_rank(), dist.get_world_size()
    chunks = list(tensor.chunk(n))
    _reduce_scatter(chunks)
    for s in range(n - 1):  # all-gather
        _pass(chunks, (r + 1 - s) % n, (r - s) % n, add=False)


def library(tensor):
    dist.all_reduce(tensor)


def everyone(tensor):  # right sums, (n - 1) whole tensors sent per rank
    r, n = dist.get_rank(), dist.get_world_size()
    total = tensor.clone()
    for k in range(1, n):
        req = dist.isend(tensor.clone(), (r + k) % n)
        buf = torch.empty_like(tensor)
        dist.recv(buf, (r - k) % n)
        req.wait()
        total += buf
    tensor.copy_(total)


def half(tensor):  # the reduce-scatter only
    _reduce_scatter(list(tensor.chunk(dist.get_world_size())))


def off_by_one(tensor):  # the all-gather passes the wrong chunks: right traffic, wrong values
    r, n = dist.get_rank(), dist.get_world_size()
    chunks = list(tensor.chunk(n))
    _reduce_scatter(chunks)
    for s in range(n - 1):
        _pass(chunks, (r - s) % n, (r - s - 1) % n, add=False)
'''


@pytest.fixture()
def rings(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    write_worker("course_test_rings", RINGS, folder=tmp_path)
    return "course_test_rings"


def test_a_right_ring_passes(rings, capsys):
    from course.checks.parallel import check_ring_all_reduce

    check_ring_all_reduce(f"{rings}:ring", world_sizes=(2, 3))
    assert "ok: ring_all_reduce equals the sum" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, named", [
    ("library", "it called all_reduce"),
    ("everyone", "sent its whole tensor 2 times"),
    ("half", "half a ring"),
    ("off_by_one", "rank 0's result"),
])
def test_ring_mistakes_fail_and_are_named(rings, wrong, named):
    from course.checks.parallel import check_ring_all_reduce

    with pytest.raises(AssertionError, match=named):
        check_ring_all_reduce(f"{rings}:{wrong}", world_sizes=(3,))  # with 2 ranks a ring sends one whole tensor too


def test_a_ring_that_hides_its_traffic_from_the_counter_is_caught_by_the_kernels_count():
    """The sum by the library, called around the counting wrapper (``__wrapped__``) or through the
    process group's own C++ method, plus a ring of dummy chunks for the count: the bytes the process
    wrote (``/proc/self/io``) are twice what its counted sends account for."""
    from course.checks.parallel import check_ring_all_reduce

    for cheat in ("ring_hidden", "ring_group"):  # the module, as such a worker imports it: no program read
        with pytest.raises(AssertionError, match="wrote .* bytes while its sends account for"):
            check_ring_all_reduce(f"parallel_answers:{cheat}", world_sizes=(2,))
    # as an answer, a program the judge reads: neither route can be written (tests/test_served_parallel.py)
    with pytest.raises(AssertionError, match=r"read by the grader: it calls torch\.distributed\.all_reduce, which this"):
        check_ring_all_reduce(answers.ring_hidden, world_sizes=(2,))
    with pytest.raises(AssertionError, match=r"read by the grader: it reads torch\.distributed\.group"):
        check_ring_all_reduce(answers.ring_group, world_sizes=(2,))


def test_no_rank_can_compute_the_others_inputs_from_the_seed():
    """Every rank could read the seed the launcher gave them all (the launch's spec file) and compute
    each rank's seeded input, so a point-to-point answer passed with traffic of the right size that
    carried nothing. Each rank's input now holds a part only its process drew
    (``course.parallel.private_part``): computed from the seed, the result misses it."""
    from course.checks.parallel import check_ring_all_reduce, check_shift

    with pytest.raises(AssertionError, match="rank 0's result"):
        check_ring_all_reduce("parallel_answers:ring_from_seed", world_sizes=(2,))
    with pytest.raises(AssertionError, match="rank 0's result"):
        check_shift("parallel_answers:shift_from_seed", world_sizes=(2,))
    with pytest.raises(AssertionError, match="read by the grader: it uses an import inside a function"):
        check_shift(answers.shift_from_seed, world_sizes=(2,))  # as an answer: the spec file cannot be opened
    assert no_worker_left()


def test_no_rank_can_train_on_the_full_batch_alone():
    """Every rank was given the full batch, so a rank could compute the full batch's step itself (by hand
    beside the model, whose forward hook counted only the share it was also run on) and never send a
    byte. The rows of each rank's share are now drawn in its own process, the others stand-ins: alone,
    a rank trains on the wrong batch."""
    from course.checks.parallel import check_ddp_training

    with pytest.raises(AssertionError, match="rank 0, parameter"):
        check_ddp_training(answers.train_ddp_alone)
    assert no_worker_left()


def test_under_the_grader_no_rank_shares_memory_or_makes_a_socket(tmp_path, monkeypatch):
    """Writes the kernel counts (``wchar``) are files, pipes and gloo's sockets; memory shared through
    a file (``torch.from_file(..., shared=True)``) and a socket's own sends are not among them, so
    ranks could pass their inputs that way beside ring-shaped dummy traffic. Under the grader a worker
    loads a seccomp filter of its own before any learner code (file-backed shared mappings, other
    processes' memory, ``vmsplice``, asynchronous writes: EPERM) and the audit hook refuses a socket
    made by learner code."""
    import course.parallel as parallel
    from course.checks.parallel import check_ring_all_reduce

    root = Path(__file__).resolve().parent.parent
    monkeypatch.setenv(parallel.GUARD_ENV, str(root / "autograder" / "sandbox" / "child.py"))
    monkeypatch.setattr(parallel, "WORKER_FLAGS", [])
    monkeypatch.syspath_prepend(str(tmp_path))  # the cheats as a learner's cell would leave them (no program read)
    write_worker("course_test_cheats", answers.ring_shared_memory, answers.ring_by_datagrams, folder=tmp_path)
    with pytest.raises(AssertionError, match="unable to mmap .* Operation not permitted"):
        check_ring_all_reduce("course_test_cheats:ring_shared_memory", world_sizes=(2,))
    with pytest.raises(AssertionError, match="socket.__new__ is not allowed"):
        check_ring_all_reduce("course_test_cheats:ring_by_datagrams", world_sizes=(2,))
    assert [name for name, _ in parallel.WORKER_FLAGS] == ["introspection"] * 2
    check_ring_all_reduce(answers.ring_all_reduce, world_sizes=(2,))  # the right ring runs, filter and all
    assert no_worker_left()


# -- every check against the right answer and the usual mistakes, each named -------------------------

@pytest.mark.parametrize("check, answer, named", [
    ("check_shift", "shift", None),
    ("check_shift", "shift_naive", "did not finish(.|\n)*every rank sends first"),
    ("check_ring_all_reduce", "ring_all_reduce", None),
    ("check_ddp_training", "train_ddp", None),
    ("check_ddp_training", "train_ddp_full", "saw \\[64\\] rows; each rank should run on its share"),
    ("check_ddp_training", "train_ddp_sum", "the sum of the squared errors instead of their mean"),
    ("check_accumulation", "accumulate", None),
    ("check_accumulation", "accumulate_every", "every micro-batch's backward synchronised the gradients"),
    ("check_accumulation", "accumulate_nodiv", "loss not divided by 4"),
    ("check_comm_hook", "fp16_hook", None),
    ("check_comm_hook", "fp16_hook_nodiv", "summed over the ranks instead of averaged"),
    ("check_comm_hook", "hook32", "all-reduced float32 tensors; compress the bucket to float16"),
    ("check_comm_hook", "hook_gathered", "read by the grader: it reads torch.distributed.all_gather"),
    ("check_accumulation", "accumulate_concat", "forward passes saw \\[\\[32\\], \\[32\\], \\[32\\]\\] rows per step"),
])
def test_lesson_10_checks_pass_the_answer_and_name_each_mistake(check, answer, named, capsys):
    import course.checks.parallel as checks

    fn = getattr(checks, check)
    kwargs = {"world_sizes": (2,), "timeout_s": 8} if check == "check_shift" else {}
    if check == "check_ring_all_reduce":
        kwargs = {"world_sizes": (3,)}
    if named is None:
        fn(getattr(answers, answer), **kwargs)
        assert "ok: " in capsys.readouterr().out
    else:
        with pytest.raises(AssertionError, match=named):
            fn(getattr(answers, answer), **kwargs)
    assert no_worker_left()


def test_a_diverged_mistake_is_named_whatever_the_order_of_summing():
    # the sum of squared errors reaches 1e6-1e7 in five steps, where DDP's and one process's sums part by
    # up to 3e-6 of the values: the mistake was named only now and then (this file failed 1 run in 5)
    from course.checks.parallel import _same_as

    mistake = {"0.bias": torch.tensor([3.65904e6, -3.1e5], dtype=torch.float64)}
    assert _same_as({"0.bias": mistake["0.bias"] * (1 + 3e-6)}, {"the sum": mistake}, 1e-9) == "the sum"
    assert _same_as({"0.bias": mistake["0.bias"] * 1.01}, {"the sum": mistake}, 1e-9) is None


def test_an_unwritten_answer_says_so():
    from course.checks.parallel import check_shift

    def shift(tensor):
        raise NotImplementedError()
    with pytest.raises(AssertionError, match="not written yet"):
        check_shift(shift, world_sizes=(2,))


# -- under the grader every worker confines itself -----------------------------------------------------

CHEATS = '''
import sys

import course.parallel


def patches(rank, world_size):
    course.parallel.rank_input = lambda *a: None  # a forged input for every later case
    return rank


def forges(rank, world_size):
    """Writes the result file itself, as the course's worker would (a value, no flags), and ends."""
    import io
    import os
    import pickle

    import torch

    with open(sys.argv[1], "rb") as fh:
        out = pickle.load(fh)["out"].format(rank=rank)
    buffer = io.BytesIO()
    torch.save({"ok": True, "value": "made up", "flags": []}, buffer)
    with open(out + ".x", "wb") as fh:
        fh.write(bytes(32) + buffer.getvalue())
    os.replace(out + ".x", out)
    sys.stdout.flush()
    os._exit(0)


def blinds(rank, world_size):
    """An audit hook of its own, to keep the course from reading the kernel's count of bytes written."""
    def hook(event, args):
        if event == "open" and "io" in str(args[0]):
            raise PermissionError(args[0])
    sys.addaudithook(hook)  # a hook that refuses it keeps it out, silently (Python's rule)
    try:
        open("/proc/self/io").close()
    except PermissionError:
        return "hook added"
    return "hook not added"


def reads_its_memory(rank, world_size):
    """Opens its own memory by the names /proc gives it beside /proc/self/mem (a key read there
    signed any result; red team, 2026-12-01)."""
    import os

    refused = []
    folder = os.open("/proc/self", os.O_RDONLY)
    for open_it in (lambda: open("/proc/thread-self/mem", "rb"), lambda: open("/proc/self//mem", "rb"),
                    lambda: open(f"/proc/self/task/{os.getpid()}/mem", "rb"),
                    lambda: os.fdopen(os.open("mem", os.O_RDONLY, dir_fd=folder), "rb")):
        try:
            open_it().close()
        except PermissionError:
            refused.append(True)
    os.close(folder)
    return len(refused)


def looks_around(rank, world_size):
    try:
        sys._getframe(1)
    except RuntimeError as e:
        return str(e)
    return "not refused"
'''


def test_workers_under_the_grader_are_sealed_and_report_what_they_saw(tmp_path, monkeypatch):
    """With the harness's guard named in the environment (as the sandbox's learner process names it),
    each worker seals the guarded modules and installs the audit hook before it imports learner code:
    introspection from a worker module is refused, a patched course function is reported, and both
    come back to the launching process (course.parallel.WORKER_FLAGS) for the harness to flag."""
    import course.parallel as parallel

    root = Path(__file__).resolve().parent.parent
    monkeypatch.setenv(parallel.GUARD_ENV, str(root / "autograder" / "sandbox" / "child.py"))
    monkeypatch.setattr(parallel, "WORKER_FLAGS", [])
    write_worker("course_test_cheats", CHEATS, folder=tmp_path)
    assert launch("course_test_cheats:looks_around", 2, path=tmp_path) == ["grading: sys._getframe is not allowed "
                                                                           "in submitted code"] * 2
    assert [name for name, _ in parallel.WORKER_FLAGS] == ["introspection", "introspection"]
    parallel.WORKER_FLAGS.clear()
    assert launch("course_test_cheats:patches", 2, path=tmp_path) == [0, 1]
    assert [name for name, _ in parallel.WORKER_FLAGS] == ["tampered", "tampered"]
    assert "course.parallel.rank_input replaced" in parallel.WORKER_FLAGS[0][1]


def test_a_result_file_not_written_by_the_course_is_refused(tmp_path, monkeypatch):
    """A rank's result travels in a file its process writes, and learner code in that process could
    write one itself (a value it made up, its flags emptied; red team, 2026-12-01: 11/11). The worker
    signs its result with a key the launcher sent it through a pipe, read and closed before any
    learner code runs; the launcher reads only a signed file. Nor may learner code add an audit hook
    of its own (one that hid ``/proc/self/io`` made the byte count -1, which passed)."""
    import course.parallel as parallel

    write_worker("course_test_cheats", CHEATS, folder=tmp_path)
    with pytest.raises(WorkersFailed, match="not written by the course's worker"):
        launch("course_test_cheats:forges", 2, path=tmp_path)
    root = Path(__file__).resolve().parent.parent
    monkeypatch.setenv(parallel.GUARD_ENV, str(root / "autograder" / "sandbox" / "child.py"))
    monkeypatch.setattr(parallel, "WORKER_FLAGS", [])
    with pytest.raises(WorkersFailed, match="not written by the course's worker"):
        launch("course_test_cheats:forges", 2, path=tmp_path)
    assert [name for name, _ in parallel.WORKER_FLAGS] == ["tampered", "tampered"]
    parallel.WORKER_FLAGS.clear()
    assert launch("course_test_cheats:blinds", 2, path=tmp_path) == ["hook not added"] * 2
    assert [name for name, _ in parallel.WORKER_FLAGS] == ["introspection"] * 2
    parallel.WORKER_FLAGS.clear()
    assert launch("course_test_cheats:reads_its_memory", 2, path=tmp_path) == [4, 4]
    assert {name for name, _ in parallel.WORKER_FLAGS} == {"probing"}
    assert no_worker_left()


def test_torchrun_runs_a_script_in_processes_of_one_thread_each(tmp_path):
    from course.parallel import torchrun

    script = write_worker("course_test_torchrun", """
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([1.0])
dist.all_reduce(t)
print(f"rank {dist.get_rank()}: threads {torch.get_num_threads()}, sum {t.item():g}", flush=True)
dist.destroy_process_group()
""", folder=tmp_path)
    out = torchrun(script, 2)
    assert "rank 0: threads 1, sum 2" in out and "rank 1: threads 1, sum 2" in out
    broken = write_worker("course_test_torchrun_fails", "raise SystemExit('no group today')\n", folder=tmp_path)
    with pytest.raises(WorkersFailed, match="failed \\(exit code"):
        torchrun(broken, 2)


def test_only_a_function_written_by_the_learner_is_an_answer():
    """Under the grader the probe receives whatever the learner bound to the answer's name: the name
    of something importable (torch's own float16 hook, the course's all_reduce) is refused, so the
    workers only ever run code the learner wrote."""
    from course.checks.parallel import run_workers

    for answer in ("torch.distributed.algorithms.ddp_comm_hooks.default_hooks:fp16_compress_hook",
                   "course.parallel:library_all_reduce", 3, torch.nn.Linear):
        with pytest.raises(AssertionError, match="should be a function defined with def"):
            run_workers(answer, "hook_case", 2, 0, 64, 1, 0.1)

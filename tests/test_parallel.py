"""Lesson 10's groundwork (course.parallel): workers started from module files join one process group
and hand their results back in rank order; a worker that raises, dies or hangs ends the launch with
its rank named, and no worker is ever left running."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

from course.parallel import WorkersFailed, launch, write_worker

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
'''


@pytest.fixture()
def worker(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    write_worker("course_test_worker", WORKER, folder=tmp_path)
    return "course_test_worker"


def test_workers_join_one_group_and_return_in_rank_order(worker):
    assert launch(f"{worker}:all_reduce", 2, 10) == [torch.tensor([21.0]), torch.tensor([21.0])]
    assert launch(f"{worker}:ring_pass", 4, rendezvous="tcp") == [3, 0, 1, 2]
    assert not multiprocessing.active_children()


def test_a_rank_that_raises_is_named_with_its_error(worker):
    with pytest.raises(WorkersFailed, match=r"rank 1 raised:(.|\n)*ValueError: rank one is broken"):
        launch(f"{worker}:raises", 2, timeout_s=60)
    assert not multiprocessing.active_children()


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
    assert not multiprocessing.active_children()


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

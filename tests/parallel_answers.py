"""Lesson 10's answers for the tests: the right ones, the usual mistakes and two cheats. Each function
is copied into a worker module by the checks' probe, as a learner's cell function is: each must stand
alone (the worker module's header imports torch, dist, F, DDP and contextlib)."""
import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def shift(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(tensor)
    reqs = [dist.isend(tensor, (rank + 1) % n), dist.irecv(received, (rank - 1) % n)]
    for r in reqs:
        r.wait()
    return received


def shift_naive(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(tensor)
    dist.send(tensor, (rank + 1) % n)
    dist.recv(received, (rank - 1) % n)
    return received


def ring_all_reduce(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(tensor.chunk(n))
    buf = torch.empty_like(chunks[0])
    right, left = (rank + 1) % n, (rank - 1) % n
    for s in range(n - 1):
        send = dist.isend(chunks[(rank - s) % n].clone(), right)
        dist.recv(buf, left)
        send.wait()
        chunks[(rank - s - 1) % n] += buf
    for s in range(n - 1):
        send = dist.isend(chunks[(rank + 1 - s) % n].clone(), right)
        dist.recv(buf, left)
        send.wait()
        chunks[(rank - s) % n].copy_(buf)


def train_ddp(model, inputs, targets, steps, lr):
    rank, n = dist.get_rank(), dist.get_world_size()
    ddp = DDP(model)
    x, y = inputs.chunk(n)[rank], targets.chunk(n)[rank]
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        opt.step()


def train_ddp_full(model, inputs, targets, steps, lr):
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(ddp(inputs), targets).backward()
        opt.step()


def train_ddp_sum(model, inputs, targets, steps, lr):
    rank, n = dist.get_rank(), dist.get_world_size()
    ddp = DDP(model)
    x, y = inputs.chunk(n)[rank], targets.chunk(n)[rank]
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(ddp(x), y, reduction="sum").backward()
        opt.step()


def accumulate(ddp_model, optimizer, micro_inputs, micro_targets):
    m = len(micro_inputs)
    optimizer.zero_grad()
    for i, (x, y) in enumerate(zip(micro_inputs, micro_targets)):
        ctx = ddp_model.no_sync() if i < m - 1 else contextlib.nullcontext()
        with ctx:
            (F.mse_loss(ddp_model(x), y) / m).backward()
    optimizer.step()


def accumulate_every(ddp_model, optimizer, micro_inputs, micro_targets):
    m = len(micro_inputs)
    optimizer.zero_grad()
    for x, y in zip(micro_inputs, micro_targets):
        (F.mse_loss(ddp_model(x), y) / m).backward()
    optimizer.step()


def accumulate_nodiv(ddp_model, optimizer, micro_inputs, micro_targets):
    m = len(micro_inputs)
    optimizer.zero_grad()
    for i, (x, y) in enumerate(zip(micro_inputs, micro_targets)):
        ctx = ddp_model.no_sync() if i < m - 1 else contextlib.nullcontext()
        with ctx:
            F.mse_loss(ddp_model(x), y).backward()
    optimizer.step()


def fp16_hook(state, bucket):
    buffer = bucket.buffer()
    half = buffer.to(torch.float16).div_(dist.get_world_size())
    fut = dist.all_reduce(half, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].to(buffer.dtype))


def fp16_hook_nodiv(state, bucket):
    buffer = bucket.buffer()
    half = buffer.to(torch.float16)
    fut = dist.all_reduce(half, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].to(buffer.dtype))


def hook32(state, bucket):
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])


def ring_hidden(tensor):
    """A cheat: the sum by the library, hidden from the counter; a ring of dummy chunks for the count."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dist.all_reduce.__wrapped__(tensor)
    chunk = torch.empty_like(tensor.chunk(n)[0])
    for _ in range(2 * (n - 1)):
        req = dist.isend(chunk.clone(), (rank + 1) % n)
        dist.recv(chunk, (rank - 1) % n)
        req.wait()


def ring_group(tensor):
    """A cheat: the sum through the process group's C++ method; a ring of dummy chunks for the count."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dist.group.WORLD.allreduce([tensor]).wait()
    chunk = torch.empty_like(tensor.chunk(n)[0])
    for _ in range(2 * (n - 1)):
        req = dist.isend(chunk.clone(), (rank + 1) % n)
        dist.recv(chunk, (rank - 1) % n)
        req.wait()

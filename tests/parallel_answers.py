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



def ring_from_seed(tensor):
    """A cheat: every rank's input computed from the seed the launcher gave every rank (in the
    launch's spec file, which each worker can read), the sum taken here; ring-shaped dummy traffic."""
    import pickle
    import sys

    from course.parallel import rank_input

    with open(sys.argv[1], "rb") as fh:
        seed = pickle.load(fh)["args"][1]
    rank, n = dist.get_rank(), dist.get_world_size()
    total = sum(rank_input(seed, r, tensor.numel()) for r in range(n))
    chunk = torch.empty_like(tensor.chunk(n)[0])
    for _ in range(2 * (n - 1)):
        req = dist.isend(chunk.clone(), (rank + 1) % n)
        dist.recv(chunk, (rank - 1) % n)
        req.wait()
    tensor.copy_(total)


def shift_from_seed(tensor):
    """A cheat: the rank before's input computed from the launch's seed; a dummy tensor sent."""
    import pickle
    import sys

    from course.parallel import rank_input

    with open(sys.argv[1], "rb") as fh:
        seed = pickle.load(fh)["args"][1]
    rank, n = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(tensor)
    req = dist.isend(torch.zeros_like(tensor), (rank + 1) % n)
    dist.recv(buf, (rank - 1) % n)
    req.wait()
    return rank_input(seed, (rank - 1) % n, tensor.numel())


def ring_shared_memory(tensor):
    """A cheat: every rank writes its input into memory shared through a file (not a byte written
    that the kernel counts), waits for the others' and sums them; ring-shaped dummy traffic."""
    import os
    import time

    rank, n = dist.get_rank(), dist.get_world_size()
    path, numel = os.path.join(os.path.dirname(__file__), "shared.bin"), tensor.numel()
    if rank == 0:
        with open(path + ".tmp", "wb") as fh:
            fh.truncate((n * numel + n) * 8)
        os.replace(path + ".tmp", path)
    while not os.path.exists(path):
        time.sleep(0.01)
    shared = torch.from_file(path, shared=True, size=n * numel + n, dtype=torch.float64)
    shared[rank * numel:(rank + 1) * numel] = tensor
    shared[n * numel + rank] = 1
    while shared[n * numel:].sum() < n:
        time.sleep(0.01)
    chunk = torch.empty_like(tensor.chunk(n)[0])
    for _ in range(2 * (n - 1)):
        req = dist.isend(chunk.clone(), (rank + 1) % n)
        dist.recv(chunk, (rank - 1) % n)
        req.wait()
    tensor.copy_(shared[:n * numel].view(n, -1).sum(0))


def ring_by_datagrams(tensor):
    """A cheat: the inputs passed by UDP datagrams (a socket's sends are not among the bytes the kernel
    counts as written), never bound nor connected: each rank's port in a file; dummy ring traffic."""
    import os
    import socket
    import time

    rank, n = dist.get_rank(), dist.get_world_size()
    folder = os.path.dirname(__file__)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.sendto(b"", ("127.0.0.1", 9))  # bound to a port of the kernel's choosing by the first send
    with open(os.path.join(folder, f"port{rank}"), "w") as fh:
        fh.write(str(s.getsockname()[1]))
    return s.getsockname()[1]


def train_ddp_alone(model, inputs, targets, steps, lr):
    """A cheat: no DDP, nothing sent: one forward on this rank's share for the row count, and each
    step taken from the whole batch it was given, computed by hand beside the model (whose forward
    hook never sees the full batch)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    first, last = model[0], model[2]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        model(inputs.chunk(n)[rank])
        out = F.linear(torch.tanh(F.linear(inputs, first.weight, first.bias)), last.weight, last.bias)
        F.mse_loss(out, targets).backward()
        optimizer.step()


def accumulate_concat(ddp_model, optimizer, micro_inputs, micro_targets):
    """A mistake: the micro-batches put back together, one forward and backward (one sync, the same
    gradient): nothing accumulated."""
    optimizer.zero_grad()
    F.mse_loss(ddp_model(torch.cat(micro_inputs)), torch.cat(micro_targets)).backward()
    optimizer.step()


def hook_gathered(state, bucket):
    """A cheat: float16 zeros all-reduced for the record, the float32 gradients gathered and averaged."""
    buffer = bucket.buffer()
    dist.all_reduce(torch.zeros_like(buffer, dtype=torch.float16))
    parts = [torch.empty_like(buffer) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, buffer)
    fut = torch.futures.Future()
    fut.set_result(torch.stack(parts).mean(0))
    return fut

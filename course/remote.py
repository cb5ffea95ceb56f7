"""Calling a learner's code across a process boundary, for checks that run outside its reach.

Under the grader, a *served* check (see ``SERVED`` in a lesson's check module) runs in the
trusted *judge* process, not in the learner's. The learner's process runs its notebook, and at
each served test cell it serves requests (:func:`serve`) until the judge is done. In the judge,
every name the test cell uses that the instructor's set-up cells did not bind (the learner's
answers) is a :class:`Remote`: calling it sends the inputs the check chose to the learner's
process (:mod:`course.wire`: data, never pickles) and returns the outputs. Gradients cross too:
outputs that carry a gradient in the learner's process are joined to the judge's inputs by an
autograd function whose backward asks the learner's process for the vector-Jacobian product
with the judge's own ``grad_outputs``. A function the check hands the learner's code (:func:`lend`:
a layer to call) stays in the judge: the learner's side gets a handle, and each call of it comes
back across the boundary, so what that function sees and does is the judge's to record. So a
check written for a local function works unchanged
on a remote one, and every value it compares was computed by the judge or returned, as data, by
the learner's code on inputs the judge chose.

A TorchScript answer crosses as its archive (``torch.jit.save``) and runs in the script host,
a third confined process with nothing of the grader's to read (:func:`local_script`,
:class:`Scripted`): what was compiled is what the judge tests, and TorchScript never runs in the judge.
"""

from __future__ import annotations

import builtins
import contextlib
import contextvars
import errno
import io
import os
import itertools
import select
import struct
from typing import Any, Callable

import torch
from torch import nn

from course import wire

__all__ = ["FACTORIES", "PROBES", "RECIPES", "Described", "Link", "Remote", "RemoteError", "build", "checksum",
           "course_function", "disturbances", "factory", "is_remote", "lend", "Lending", "local_script", "mirrored", "serve_in_thread",
           "probe", "prober", "recipe", "Scripted", "serve", "serving_host"]

_FRAME = struct.Struct(">Q")


#: Input factories a timed block may name (``module.function``), registered with :func:`factory`.
FACTORIES: dict[str, Callable[..., tuple]] = {}


def factory(fn: Callable[..., tuple]) -> Callable[..., tuple]:
    """Register ``fn(seed, device=..., **sizes) -> args`` as a maker of timing inputs that both
    sides of the boundary can run from a seed (see :func:`course.timing.compare_served`)."""
    FACTORIES[f"{fn.__module__}.{fn.__qualname__}"] = fn
    return fn


#: Course functions the judge may run on a learner's name where that name lives (see :func:`probe`).
PROBES: dict[str, Callable[..., Any]] = {}


def prober(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Register ``fn(answer, *args, **kwargs)``, course code that exercises a learner's answer the
    way a call cannot: it builds instances of a learner's class, runs a learner's
    ``autograd.Function`` forward and backward, watches how a function used a model. See :func:`probe`."""
    PROBES[f"{fn.__module__}.{fn.__qualname__}"] = fn
    return fn


def probe(answer: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(answer, *args, **kwargs)`` run where ``answer`` lives: here for a local answer; for a
    :class:`Remote`, by the course's code (``fn``, registered with :func:`prober`) in the learner's
    process, arguments and result crossing as data. What comes back is that process's word: a check
    compares the values with its own references; facts it reports about structure (how often a
    model ran, which transform was active) are evidence the learner's process could forge, never a
    replacement for outputs checked here. An ``AssertionError`` the probe raises there (a friendly
    message about the learner's code) is raised here with its message."""
    if not isinstance(answer, Remote):
        return fn(answer, *args, **kwargs)
    name = f"{fn.__module__}.{fn.__qualname__}"
    if PROBES.get(name) is not fn:
        raise ValueError(f"{name} is not a registered probe (course.remote.prober)")
    device = _call_device((args, kwargs))
    answer._link.probes += 1  # the judge reports it: this cell's verdict rests partly on that process's word
    try:
        reply = _lending(answer._link, {"op": "probe", "name": answer.__name__, "probe": name,
                                        "grad_mode": torch.is_grad_enabled(), "device": device}, args, kwargs)
    except NameError as exc:  # the notebook never bound the name
        raise AssertionError(f"{answer.__name__} is not defined in your notebook ({exc}). Run the cell that "
                             "defines it, and keep its name.") from None
    return _to_device(_map_tensors(reply, lambda t: t.detach()), device)


#: Builders of objects that cross the boundary as recipes (``module.function``), see :func:`recipe`.
RECIPES: dict[str, Callable[..., Any]] = {}


def recipe(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Register the builder ``fn`` (plain values in: sizes, seeds, dtypes, device names, other
    recipes; an object out), and mark what it builds with how it was built. Such an object (a
    seeded layer, an energy) crosses the boundary as its recipe, and the learner's process builds
    its own copy with the course's code (:func:`build`): a check can hand the learner's function a
    function to differentiate without sending code."""
    import functools
    import inspect

    name = f"{fn.__module__}.{fn.__qualname__}"
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def built(*args: Any, **kwargs: Any) -> Any:
        obj = fn(*args, **kwargs)
        values = {}
        for k, v in signature.bind(*args, **kwargs).arguments.items():
            kind = signature.parameters[k].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:  # not expressible by name: no recipe
                return obj
            for key, value in (v.items() if kind is inspect.Parameter.VAR_KEYWORD else [(k, v)]):
                values[key] = str(value) if isinstance(value, torch.device) else value
        try:
            obj.__recipe__ = (name, values, id(obj))  # a copy of obj is not what the recipe built
        except AttributeError:  # an object without a __dict__ crosses as its description
            pass
        return obj

    RECIPES[name] = built
    return built


def build(value: Any, device: str = "cpu", back: Callable[[wire.Lent], Any] | None = None,
          kept: Callable[[wire.Kept], Any] | None = None) -> Any:
    """``value`` with every :class:`course.wire.Recipe` in it built here by its registered builder,
    and every tensor moved to ``device``: what the learner's process makes of a request's arguments.
    ``back(lent)``: the stand-in for a function the judge lent, given its :class:`course.wire.Lent` (in the
    arguments of a call or a probe only); ``kept(k)``: what this side keeps for a :class:`course.wire.Kept`
    (in a call's arguments only)."""
    if isinstance(value, wire.Recipe):
        obj = _registered(RECIPES, value.name, "recipe")(**{k: build(v, device) for k, v in value.args.items()})
        return getattr(obj, value.attr) if value.attr else obj
    if isinstance(value, torch.Tensor):
        return _arrive(value, device)
    if isinstance(value, wire.GeneratorState):
        return value.generator()
    if isinstance(value, wire.Lent):
        if back is None:
            raise ValueError("a lent function outside the arguments of a call or a probe")
        return back(value)
    if isinstance(value, wire.Kept):
        if kept is None:
            raise ValueError("a kept value outside the arguments of a call")
        return kept(value)
    if type(value) is list:
        return [build(v, device, back, kept) for v in value]
    if isinstance(value, tuple):
        return tuple(build(v, device, back, kept) for v in value)
    if type(value) is dict:
        return {k: build(v, device, back, kept) for k, v in value.items()}
    return value


def _registered(table: dict[str, Callable[..., Any]], name: Any, kind: str) -> Callable[..., Any]:
    """The function registered in ``table`` (RECIPES, PROBES) under ``name``, importing the course
    module that registers it when this process has not yet (a check's own helpers); nothing outside
    ``course`` is ever imported for a name the other side sent."""
    if name not in table and isinstance(name, str):
        module = name.rpartition(".")[0]
        if module.startswith("course.") and module.replace(".", "").isidentifier():
            import importlib

            importlib.import_module(module)
    if not isinstance(name, str) or name not in table:
        raise ValueError(f"no {kind} named {name!r}")
    import sys

    module, _, attr = name.rpartition(".")
    if getattr(sys.modules.get(module), attr, None) is not table[name]:  # the registry entry was swapped
        raise ValueError(f"the {kind} {name} is not the course's own in this process")
    return table[name]


_CHECK_WEIGHTS: dict[tuple, torch.Tensor] = {}


def _in_memory_order(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``t``'s elements as one flat view in the order they lie in memory, and the permutation of
    its dimensions that reads them so, where ``t`` is dense (any layout: channels-last, a
    transpose); else a contiguous copy and the identity. A channels-last output read in logical
    order (``reshape(-1)``) is a whole reorder of it: in lesson 3's timed block that copy alone
    cost as much as the repaired block's own work."""
    order = tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.size(d), d)))
    view = t.permute(order)
    if view.is_contiguous():
        return view.reshape(-1), order
    return t.reshape(-1), tuple(range(t.dim()))


def _check_weights(t: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """The fixed random weights of ``t``'s elements (by logical position, the same in every
    process and for every layout), laid out in the memory order ``order`` reads: made once per
    shape, layout, dtype and device."""
    key = (tuple(t.shape), order, t.dtype, str(t.device))
    w = _CHECK_WEIGHTS.get(key)
    if w is None:
        n = t.numel()
        w = torch.randn(n, generator=torch.Generator().manual_seed(n % 9973), dtype=torch.float64)
        w = w.view(t.shape).permute(order).reshape(-1).to(t.device, t.dtype)
        _CHECK_WEIGHTS[key] = w
    return w


def checksum(value: Any) -> torch.Tensor:
    """Four numbers (float64, on the outputs' device) that depend on every element of every
    floating tensor in ``value``: a weighted sum with fixed random weights and the 2-norm of all
    elements (for outputs off by ``e``, the weighted sums differ by about ``|e|_2``), then the plain
    sum and the sum of absolute values (for outputs off by at most ``rtol`` of each element, the sums
    differ by at most ``rtol`` times it). The plain sum sees what one fixed set of weights may be
    blind to, an offset shared by every element: for some sizes the random weights add up to almost
    nothing. All four are compared (:func:`course.timing.checksums_differ` says why each). Timed
    blocks report these instead of their outputs, so checking must cost little beside the call it
    checks: every tensor is read where it lies, in its own memory order (each element keeps its
    weight whatever the layout), in its own precision, with sums accumulated in float32 (float64 for
    float64 outputs); reordering a channels-last output, or widening it to float64, cost more than
    lesson 3's repaired block."""
    dot, squares, total, absolute, device = 0.0, 0.0, 0.0, 0.0, None
    for t in _tensors(value):
        if not (t.is_floating_point() or t.is_complex()):
            continue
        t = t.detach() if not t.is_complex() else torch.view_as_real(t.detach())
        flat, order = _in_memory_order(t)
        acc = torch.float64 if flat.dtype == torch.float64 else torch.float32
        dot = dot + (flat @ _check_weights(t, order)).to(torch.float64)
        squares = squares + torch.linalg.vector_norm(flat).to(torch.float64) ** 2
        total = total + flat.sum(dtype=acc).to(torch.float64)
        absolute = absolute + flat.abs().sum(dtype=acc).to(torch.float64)
        device = flat.device
    if device is None:
        return torch.zeros(4, dtype=torch.float64)
    return torch.stack([dot, squares.sqrt(), total, absolute])


class RemoteError(Exception):
    """An exception raised by the learner's code in its own process (only its type's name and its
    message cross)."""


def _uninterrupted():
    """The grader's guard around a few lines of the channel that a time limit must not cut in two
    (``course.grader_hooks.uninterrupted``); nothing outside the grader."""
    from course import grader_hooks

    hook = grader_hooks.uninterrupted
    return hook() if hook is not None else contextlib.nullcontext()


def _wait(fd: int, event: int) -> None:
    """Until ``fd`` is ready for ``event`` (``select.POLLIN``, ``select.POLLOUT``), or has hung up
    or failed (the read or write that follows then says so). ``poll``, not ``select``: ``select``
    refuses a descriptor numbered 1,024 or more, which a process with many files open has."""
    poller = select.poll()
    poller.register(fd, event)
    poller.poll()


def _widen(fd: int) -> None:
    """Let the pipe ``fd`` hold up to a megabyte (Linux's usual ceiling for anyone): where it cannot
    (not a pipe, another system, a lower ceiling), it stays as it is; only the number of turns changes."""
    import fcntl

    try:
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except OSError:
        pass


class Link:
    """One end of the judge/learner channel: framed :mod:`course.wire` values over two fds.

    A time limit (the grader's alarm, raised as an exception wherever the process is) must never
    cut a frame in two, nor lose bytes read and not yet kept: every later message would be read
    from the wrong place (CI met it on a busy machine: the parent interrupts both processes at a
    cell's limit, the judge's alarm landed just as its read of the learner's reply returned, and
    the next receive read a message of 436,146 MB from the middle of that frame). So the channel
    waits for its pipes (:func:`_wait`), where a time limit may land, and writes or reads only what the pipe can take or give at once, inside
    :func:`_uninterrupted` together with the note of how far it got. A send cut short in its
    wait keeps the rest of its frame, and the next send writes that first; a receive keeps what it
    read."""

    def __init__(self, send_fd: int, recv_fd: int, codec: tuple[Callable, Callable] | None = None):
        self.send_fd, self.recv_fd, self.seq = send_fd, recv_fd, 0
        # How a value becomes bytes and back: course.wire's format, or (the bare host, which has no
        # torch to decode it) the judge's JSON (``codec``: encode, decode).
        self._encode, self._decode = codec or (lambda value: wire.encode(value, recipes=self.recipes), wire.decode)
        self.probes = 0  # probes asked for on this link (see probe)
        self.busy = False  # a request sent and its reply not yet read (still so after a time limit cut it)
        self.broken = ""  # why the other side is no longer heard (a frame over the size limit)
        self.recipes = True  # the learner's side (serve) sends objects as what they are, never as recipes
        self.lent: dict[int, tuple[Callable, str]] = {}  # the judge's: functions lent for the calls in flight,
        # each with the device of its call's tensors (see lend)
        self.serving: Any = None  # the learner's: the seq of the request being answered (see _Back)
        self.pending: list = []  # the learner's: a request that arrived while a lent function waited
        self._buffer = bytearray()  # bytes read and not yet taken: a read cut short keeps its place
        self._unsent = bytearray()  # bytes of frames not yet written: a send cut short keeps its place
        os.set_blocking(send_fd, False)  # a write takes what the pipe holds, and never waits inside the guard
        for fd in (send_fd, recv_fd):  # a megabyte a turn rather than 64 kB: a model's state crosses in a few
            _widen(fd)

    def send(self, value: Any) -> None:
        data = self._encode(value)
        if len(data) > wire.MAX_BYTES:  # the other side would refuse it: say so instead of sending it
            raise wire.WireError(f"a value of {len(data) / 2**20:.0f} MB, over the {wire.MAX_BYTES // 2**20} MB "
                                 "that can cross between the grader's processes")
        if self.send_fd < 0:
            raise OSError(errno.EBADF, "the channel to the other process is closed")
        with _uninterrupted():
            self._unsent += _FRAME.pack(len(data))
            self._unsent += data
        while self._unsent:
            _wait(self.send_fd, select.POLLOUT)  # the wait: where a time limit may land
            with _uninterrupted():
                try:
                    written = os.write(self.send_fd, self._unsent)
                except BlockingIOError:
                    written = 0
                del self._unsent[:written]

    def receive(self) -> Any:
        """The next value. A receive interrupted part-way (a time limit) loses nothing: the bytes
        it read stay buffered, so the next receive resumes the same frame."""
        if self.broken:
            raise RemoteError(self.broken)
        self._fill(_FRAME.size)
        (size,) = _FRAME.unpack_from(self._buffer)
        if size > wire.MAX_BYTES:
            # The stream cannot be followed past a frame it will not read: nothing more is heard.
            self.broken = (f"the learner's process sent a message of {size / 2**20:.0f} MB, over the "
                           f"{wire.MAX_BYTES // 2**20} MB limit; nothing it sends is heard any more")
            raise RemoteError(self.broken)
        self._fill(_FRAME.size + size)
        with _uninterrupted():
            if len(self._buffer) == _FRAME.size + size:  # the usual case: this frame and nothing after it
                data, self._buffer = memoryview(self._buffer)[_FRAME.size:], bytearray()
            else:
                data = self._buffer[_FRAME.size:_FRAME.size + size]
                del self._buffer[:_FRAME.size + size]
        return self._decode(data)

    def _fill(self, n: int) -> None:
        while len(self._buffer) < n:
            _wait(self.recv_fd, select.POLLIN)  # the wait: where a time limit may land
            with _uninterrupted():
                chunk = os.read(self.recv_fd, min(n - len(self._buffer), 1 << 22))  # readable: never waits
                self._buffer += chunk
            if not chunk:
                raise EOFError("the other process closed the channel")

    def request(self, message: dict) -> Any:
        """Send ``message``; the value of the reply, or the learner's exception raised here.
        Replies to earlier requests (one interrupted by a time limit) are skipped."""
        if self.broken:
            raise RemoteError(self.broken)
        self.seq += 1
        seq = self.seq
        self.busy = True
        self.send({**message, "seq": seq})
        while True:
            reply = self.receive()
            if not isinstance(reply, dict):
                raise RemoteError("the learner's process answered with something that is not a reply")
            if reply.get("seq") == seq and "back" in reply:  # the learner's code calls a lent function
                self._call_lent(reply, seq)
                continue
            if reply.get("seq") == seq:
                break
            if not (isinstance(reply.get("seq"), int) and reply["seq"] < seq):
                raise RemoteError("the learner's process answered a request that was never made")
        self.busy = False
        if "ok" in reply:
            return reply["ok"]
        raise _exception(reply.get("raised"), reply.get("message"))

    def _call_lent(self, message: dict, seq: int) -> None:
        """Run the lent function the learner's code called, here, on the arguments it sent (data),
        and send back its value or its exception (type name and message): the judge's code, run by
        the judge, on what the learner's code chose to pass."""
        handle, args, kwargs = message.get("back"), message.get("args"), message.get("kwargs")
        try:
            lent = self.lent.get(handle) if type(handle) is int else None
            if lent is None or type(args) is not list or type(kwargs) is not dict:
                raise RuntimeError("the learner's process called a function the grader did not lend it for this call")
            fn, device = lent
            value = fn(*_to_device(args, device), **_to_device(kwargs, device))
            reply = {"returned": value}
        except Exception as exc:  # noqa: BLE001 - the lent function's error is the caller's to see
            reply = {"raised": type(exc).__name__, "message": str(exc)[:4000]}
        self.send({**reply, "seq": seq})


def _exception(type_name: Any, message: Any) -> BaseException:
    """The learner's exception, as a builtin exception of the same name where there is one
    (``NotImplementedError``, ``AssertionError``...), else a :class:`RemoteError` subclass so named."""
    name = type_name if isinstance(type_name, str) and type_name.isidentifier() else "Exception"
    text = str(message)[:4000] if isinstance(message, str) else ""
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception) and cls.__module__ == "builtins":
        try:
            return cls(text)
        except Exception:  # noqa: BLE001 - builtins with other signatures
            pass
    return type(name[:60], (RemoteError,), {})(text)


class Lending:
    """A function a check hands the learner's code (see :func:`lend`). Called here, it is the
    function; passed to a :class:`Remote`, it stays here and the learner's side calls it back."""

    def __init__(self, fn: Callable):
        self.fn = fn
        name = getattr(fn, "__name__", None)  # the stand-in's name in the learner's process (wire.Lent)
        self.__name__ = name[:60] if isinstance(name, str) and name.isidentifier() else "lent"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def lend(fn: Callable) -> Lending:
    """``fn``, to be passed to a learner's function (or a probe), for checks that must see how the
    learner's code uses it (lesson 1's bucketing: the layer it calls, how often, on how many steps;
    lesson 2's profiler: a node whose time only the judge knows). For a local answer, ``fn`` itself in
    effect; for a :class:`Remote`, ``fn`` never crosses: the learner's code gets a stand-in whose calls
    run ``fn`` here (tensors in and out, as data), while that one call of the learner's function (or
    that probe) lasts. What ``fn`` records is the judge's evidence."""
    return Lending(fn)


def _lent_out(value: Any, link: Link, device: str, handles: list, depth: int = 0) -> Any:
    """``value`` with every :class:`Lending` in it registered on ``link`` (to run on ``device``, the
    call's) and replaced by its handle."""
    if isinstance(value, Lending):
        handle = next(_HANDLES)
        link.lent[handle] = (value.fn, device)
        handles.append(handle)
        return wire.Lent(handle, value.__name__)
    if depth > wire.MAX_DEPTH:
        return value
    if type(value) is list:
        return [_lent_out(v, link, device, handles, depth + 1) for v in value]
    if type(value) is tuple:
        return tuple(_lent_out(v, link, device, handles, depth + 1) for v in value)
    if type(value) is dict:
        return {k: _lent_out(v, link, device, handles, depth + 1) for k, v in value.items()}
    return value


_HANDLES = itertools.count(1)

#: The intra-op threads a learner's calls are asked to run with while a judge's clock reads them
#: (:func:`pinned_calls`), in the calling thread's context; ``None``: the learner's process keeps its own.
_PINNED: contextvars.ContextVar[int | None] = contextvars.ContextVar("course_pinned_calls", default=None)


@contextlib.contextmanager
def pinned_calls(n: int):
    """Within this block every call of a learner's function across the boundary asks to run with ``n``
    intra-op threads (as a block request does): a clock that charges the learner's CPU time over ``n``
    threads must not find an honest answer's own spare threads there."""
    token = _PINNED.set(n)
    try:
        yield
    finally:
        _PINNED.reset(token)


def _lending(link: Link, message: dict, args: tuple, kwargs: dict) -> Any:
    """``link.request`` of ``message`` with ``args`` and ``kwargs`` (a call's or a probe's), every
    :class:`Lending` in them lent for this request only: registered for the learner's side to call
    back while it lasts, and forgotten when it ends, however it ends."""
    device, handles = message.get("device", "cpu"), []
    try:
        sent = _lent_out((list(args), dict(kwargs)), link, device, handles)
        return link.request({**message, "args": sent[0], "kwargs": sent[1]})
    finally:
        for handle in handles:
            link.lent.pop(handle, None)


def _arguments(message: dict, link: Link | None, staged: dict | None = None) -> tuple[Any, Any]:
    """In the learner's process: a call's or a probe's arguments built (:func:`build`), each function
    the judge lent replaced by a stand-in (:class:`_Back`) good while this request is answered, and
    (a call's) each kept value by what ``staged`` holds for it."""
    device, seq = message.get("device", "cpu"), message.get("seq")
    back = (lambda lent: _Back(link, lent, seq, device)) if link is not None else None
    kept = (lambda k: _kept(staged, k, device)) if staged is not None else None
    return build(message.get("args", []), device, back, kept), build(message.get("kwargs", {}), device, back, kept)


def _kept(staged: dict, k: wire.Kept, device: str) -> Any:
    """What the judge staged as item ``k.index`` of ``k.handle``, on ``device``: the same object on
    every call (the learner's side's own copy; what it does to it is its own answers' business)."""
    values = staged.get(k.handle)
    if values is None or not 0 <= k.index < len(values):
        raise ValueError(f"nothing staged as item {k.index} of {k.handle}")
    return _to_device(values[k.index], device)


class _Back:
    """In the learner's process: the stand-in for a function the judge lent for one call. Calling
    it sends the arguments to the judge, which runs its function and sends the value back. Only
    while that call is being answered: kept and called later, it refuses."""

    def __init__(self, link: Link, lent: wire.Lent, seq: Any, device: str):
        self._link, self._handle, self._seq, self._device = link, lent.handle, seq, device
        self.__name__ = self.__qualname__ = lent.name

    def __repr__(self) -> str:
        return "<a function the grader lent for this call>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        link = self._link
        if link.serving != self._seq:
            raise RuntimeError("this function was lent by the grader for one call of yours, which has returned: "
                               "call it inside the call it was given to, and keep no copy of it")
        link.send({"back": self._handle, "seq": self._seq, "args": list(args), "kwargs": dict(kwargs)})
        reply = link.receive()
        if not (isinstance(reply, dict) and reply.get("seq") == self._seq and ("returned" in reply or "raised" in reply)):
            link.pending.append(reply)  # the judge moved on (a time limit): its request is served next
            raise RemoteError("the grader's process stopped waiting for this call")
        if "returned" in reply:
            return _share_offsets(build(reply["returned"], self._device), (args, kwargs))
        raise _exception(reply.get("raised"), reply.get("message"))


def _share_offsets(value: Any, args: Any) -> Any:
    """``value`` with every jagged tensor whose offsets equal a jagged argument's rebuilt on that
    argument's offsets tensor: torch matches ragged dimensions by that tensor, so what a lent function
    sends back has its argument's ragged size (``y = mlp(nt); y + nt`` works, as it would locally)."""
    given = [a for a in _tensors(args) if a.is_nested and a.layout == torch.jagged]

    def same(t: torch.Tensor) -> torch.Tensor:
        if given and t.is_nested and t.layout == torch.jagged:
            for a in given:
                if a.offsets().shape == t.offsets().shape and torch.equal(a.offsets().long().cpu(), t.offsets().cpu()):
                    return torch.nested.nested_tensor_from_jagged(t.values(), a.offsets())
        return t

    return _map_tensors(value, same) if given else value


def is_remote(obj: Any) -> bool:
    return isinstance(obj, Remote)


class Remote:
    """A name bound in the learner's process, seen from the judge: call it, or fetch its
    TorchScript archive (:func:`local_script`)."""

    def __init__(self, link: Link, name: str):
        self._link, self.__name__ = link, name
        self.__qualname__ = name

    def __repr__(self) -> str:
        return f"<the learner's {self.__name__}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves = [t for t in _tensors((args, kwargs)) if t.requires_grad]
        device = _call_device((args, kwargs))
        grad = bool(leaves) and torch.is_grad_enabled()
        mirror = self.__dict__.get("mirror", False)
        message = {"op": "call", "name": self.__name__, "grad": grad, "grad_mode": torch.is_grad_enabled(),
                   "device": device, "after": mirror}
        pinned = _PINNED.get()
        if pinned is not None:
            message["threads"] = pinned
        reply = _lending(self._link, message, args, kwargs)
        if not (isinstance(reply, dict) and isinstance(reply.get("id"), int) and "value" in reply
                and isinstance(reply.get("differentiable"), list)):
            raise RemoteError("the learner's process sent a malformed result")
        after = reply.get("after")
        if mirror and isinstance(after, list) and len(after) == 2:
            _mirror(list(args), after[0])
            _mirror(dict(kwargs), after[1])
        # Only what this process joins below carries a gradient here.
        value = _to_device(_map_tensors(reply["value"], lambda t: t.detach()), device)
        if not grad:
            return value
        outs = _tensors(value)
        diff = [i for i in reply["differentiable"] if isinstance(i, int) and 0 <= i < len(outs)]
        if not diff:
            return value
        joined = _Joined.apply(self._link, reply["id"], len(leaves), *leaves, *[outs[i] for i in diff])
        replace = dict(zip(diff, joined))
        counter = iter(range(len(outs)))
        return _map_tensors(value, lambda t: replace.get(next(counter), t))

    def describe(self) -> dict:
        """What the learner's process says the name holds: its type, and whether it is compiled
        (``torch.compile``) or TorchScript. A claim of that process, not evidence."""
        reply = self._link.request({"op": "describe", "name": self.__name__})
        if not isinstance(reply, dict):
            raise RemoteError("the learner's process sent a malformed description")
        return {"type": str(reply.get("type", "?"))[:200], "compiled": reply.get("compiled") is True,
                "scripted": reply.get("scripted") is True}

    def stage(self, constants: list) -> int:
        """Send ``constants`` (weights: the same in every timed call) ahead of the timing."""
        handle = self._link.request({"op": "stage", "constants": list(constants)})
        if type(handle) is not int:
            raise RemoteError("the learner's process sent a malformed handle")
        return handle

    def block(self, handle: int, factory_name: str, sizes: dict, seeds: list[int], device: str,
              grad: bool = False, lead: bool = False) -> torch.Tensor:
        """Run the learner's function once per seed, on ``factory(seed) + constants`` (with ``lead``,
        ``constants + factory(seed)``), and return the checksums of its outputs (``len(seeds)`` x 4,
        :func:`checksum`): the call the judge times."""
        message = self._block(handle, factory_name, sizes, seeds, device, grad)
        return _checked(self._link.request({**message, "lead": True} if lead else message), seeds)

    def course_block(self, handle: int, factory_name: str, sizes: dict, seeds: list[int], device: str,
                     grad: bool = False, *, course_fn: str) -> tuple[torch.Tensor, list[str]]:
        """:meth:`block` with the course's function ``course_fn`` (a baseline, :func:`course_function`)
        in place of the learner's: how fast the learner's process runs the course's code. Also
        returns what in that process could have run the learner's code meanwhile
        (:func:`disturbances`, before and after the block)."""
        reply = self._link.request({**self._block(handle, factory_name, sizes, seeds, device, grad),
                                    "course": course_fn})
        if not (isinstance(reply, dict) and isinstance(reply.get("disturbed"), list)
                and all(isinstance(x, str) for x in reply["disturbed"])):
            raise RemoteError("the learner's process sent a malformed reply to a block of the course's function")
        return _checked(reply.get("sums"), seeds), [x[:200] for x in reply["disturbed"][:8]]

    def _block(self, handle, factory_name, sizes, seeds, device, grad) -> dict:
        return {"op": "block", "name": self.__name__, "handle": handle,
                "factory": factory_name, "sizes": dict(sizes), "seeds": list(seeds),
                "device": device, "grad_mode": bool(grad),
                # the CPU threads the judge's side runs with: the learner's side the same
                "threads": torch.get_num_threads()}


def _checked(reply: Any, seeds: list) -> torch.Tensor:
    if not (isinstance(reply, torch.Tensor) and reply.dtype == torch.float64
            and tuple(reply.shape) == (len(seeds), 4)):
        raise RemoteError("the learner's process sent checksums of the wrong kind or number")
    return reply


class _Joined(torch.autograd.Function):
    """Outputs computed in the learner's process, made to depend on the judge's inputs: the
    backward asks that process for its gradients with the judge's ``grad_outputs``."""

    @staticmethod
    def forward(ctx, link, call_id, n_leaves, *tensors):
        ctx.link, ctx.call_id, ctx.n_leaves = link, call_id, n_leaves
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in tensors[:n_leaves]]
        ctx.set_materialize_grads(False)
        return tuple(t.detach().clone() for t in tensors[n_leaves:])

    @staticmethod
    def backward(ctx, *grads):
        answer = ctx.link.request({"op": "backward", "id": ctx.call_id,
                                   "grads": [None if g is None else g.detach() for g in grads]})
        if not isinstance(answer, list) or len(answer) != ctx.n_leaves:
            raise RemoteError("the learner's process sent gradients of the wrong number")
        out = []
        for g, (shape, dtype, device) in zip(answer, ctx.shapes):
            if g is None:
                out.append(None)
            elif isinstance(g, torch.Tensor) and g.shape == shape and not g.requires_grad:
                out.append(g.to(device=device, dtype=dtype) if g.dtype != dtype and g.is_floating_point()
                           else g.to(device))
            else:
                raise RemoteError(f"the learner's process sent a gradient of shape "
                                  f"{tuple(getattr(g, 'shape', ()))} for an input of shape {tuple(shape)}")
        return (None, None, None, *out, *[None] * (len(grads)))


def local_script(obj: Any, *, compile: bool = False) -> Any:
    """``obj`` itself where it is local; for a :class:`Remote`, the TorchScript function the
    learner's process holds under that name (or compiles from it, with ``compile=True``): its
    archive, loaded and run by the script host (:class:`Scripted`), never in this process. What is
    not TorchScript comes back as a description string."""
    if not isinstance(obj, Remote):
        return torch.jit.script(obj) if compile and not isinstance(
            obj, (torch.jit.ScriptFunction, torch.jit.ScriptModule)) else obj
    reply = obj._link.request({"op": "script", "name": obj.__name__, "compile": compile})
    if isinstance(reply, str):
        return Described(reply)
    if not isinstance(reply, torch.Tensor) or reply.dtype != torch.uint8 or reply.dim() != 1:
        raise RemoteError("the learner's process sent a malformed TorchScript archive")
    from course import grader_hooks

    if grader_hooks.script_host is None:  # a Remote outside the grader's judge (a test): loaded here
        return torch.jit.load(io.BytesIO(reply.numpy().tobytes()), map_location="cpu")
    host = grader_hooks.script_host()
    try:
        facts = host.request({"op": "load", "archive": reply})
    except (EOFError, OSError) as exc:
        raise RemoteError(f"the process that runs your TorchScript ended while loading it ({exc})") from None
    if not (isinstance(facts, dict) and isinstance(facts.get("name"), str) and isinstance(facts.get("type"), str)
            and isinstance(facts.get("ops"), list) and all(isinstance(o, str) for o in facts["ops"])
            and isinstance(facts.get("scripted"), bool)):
        raise RemoteError("the script host sent a malformed description of the archive")
    return Scripted(host, facts["name"], facts["type"], facts["ops"], facts["scripted"], obj.__name__)


class Scripted(Remote):
    """A learner's TorchScript, seen from the judge: its archive loaded in the script host
    (``autograder/sandbox/script_host.py``), a process confined as the learner's is and holding
    nothing of the grader's, because TorchScript runs with all the reach of the process it is in
    (it reads files by name, sets torch's global state, loops without returning to Python). Called
    like any :class:`Remote`; ``type_name`` and ``ops`` (its graph's op kinds) are what the host's
    own code read off the loaded object: only the TorchScript itself ran there, no learner Python."""

    def __init__(self, link: Link, name: str, type_name: str, ops: list[str], scripted: bool, label: str):
        super().__init__(link, name)
        self.type_name, self.ops, self.scripted, self.label = type_name, list(ops), scripted, label

    def __repr__(self) -> str:
        return f"<the learner's TorchScript {self.label}>"

    def describe(self) -> dict:
        return {"type": self.type_name, "compiled": False, "scripted": self.scripted}


class Described:
    """What a learner's name holds when it is not TorchScript (only its type crosses)."""

    def __init__(self, type_name: str):
        self.type_name = type_name

    def __repr__(self) -> str:
        return f"<{self.type_name}>"


# -- helpers on nested values ---------------------------------------------------------------

def _call_device(value: Any) -> str:
    """Where a call's arguments live, so that its result lands there too: the first tensor's
    device, else the first module's (a list of models crosses as recipes and holds no tensor
    itself), else the CPU."""
    found = _tensors(value)
    if found:
        return str(found[0].device)
    modules: list[nn.Module] = []
    _map_any(value, lambda v: modules.append(v) if isinstance(v, nn.Module) else None)
    for m in modules:
        for t in itertools.chain(m.parameters(), m.buffers()):
            if t.device.type != "meta":
                return str(t.device)
    return "cpu"


def _map_any(value: Any, fn: Callable[[Any], Any]) -> None:
    fn(value)
    if type(value) in (list, tuple) or isinstance(value, tuple):
        for v in value:
            _map_any(v, fn)
    elif type(value) is dict:
        for v in value.values():
            _map_any(v, fn)


def _tensors(value: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    _map_tensors(value, lambda t: out.append(t) or t)
    return out


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if type(value) is list:
        return [_map_tensors(v, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(_map_tensors(v, fn) for v in value)
    if type(value) is dict:
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


@contextlib.contextmanager
def mirrored(fn: Any):
    """Within it, a call of the learner's ``fn`` (a :class:`Remote`) changes the judge's own
    arguments as the learner's code changed its copies: for the checks that ask what a function
    did to its inputs (left them alone? drew from the generator?). Those checks pass copies made
    for the purpose; the others never let the learner's process write into the judge's objects.
    A local ``fn`` changes its arguments itself."""
    if not isinstance(fn, Remote):
        yield
        return
    fn.mirror = True
    try:
        yield
    finally:
        fn.mirror = False


def _mirror(mine: Any, after: Any, depth: int = 0) -> None:
    """Make the judge's own arguments what the learner's process reports its copies became after a
    call (a tensor changed in place, an entry added to a dict, a generator drawn from, a module
    moved or changed), so that a check written for a local function sees the same side effects.
    Only where ``after`` has the shape of what was sent; anything else is left alone."""
    if depth > wire.MAX_DEPTH:
        return
    if isinstance(mine, torch.Tensor) and isinstance(after, torch.Tensor):
        _mirror_tensor(mine, after)
        # an argument whose requires_grad the learner's code switched (a module's state is not
        # mirrored this way: state_dict's tensors never require grad)
        if mine.is_leaf and after.requires_grad != mine.requires_grad and after.dtype.is_floating_point:
            mine.requires_grad_(after.requires_grad)
    elif isinstance(mine, torch.Generator) and isinstance(after, wire.GeneratorState):
        if str(mine.device) == after.device:
            try:
                mine.set_state(after.state)
            except (RuntimeError, TypeError, ValueError):
                pass
    elif isinstance(mine, torch.nn.Module) and isinstance(after, wire.ModuleState):
        state = mine.state_dict(keep_vars=True)
        if any(after.state.get(k) is not None and after.state[k].device.type == "meta" and t.device.type != "meta"
               for k, t in state.items()):
            mine.to("meta")  # moved by the learner's code (the one move a check looks for)
            return
        for k, t in state.items():
            if isinstance(after.state.get(k), torch.Tensor):
                _mirror_tensor(t, after.state[k])
    elif type(mine) is dict and type(after) is dict:
        for k in [k for k in mine if k not in after]:
            del mine[k]
        for k, v in after.items():
            if k in mine and isinstance(mine[k], torch.Tensor) and isinstance(v, torch.Tensor) \
                    and (mine[k].shape != v.shape or mine[k].dtype != v.dtype):
                mine[k] = v.to(mine[k].device)
            elif k in mine:
                _mirror(mine[k], v, depth + 1)
            else:
                mine[k] = _to_device(v, str(next(iter(_tensors(list(mine.values()))), torch.empty(0)).device))
    elif type(mine) is list and type(after) is list:
        for m, a in zip(mine, after):
            _mirror(m, a, depth + 1)
        if len(after) < len(mine):
            del mine[len(after):]
    elif isinstance(mine, tuple) and isinstance(after, tuple):
        for m, a in zip(mine, after):
            _mirror(m, a, depth + 1)


def _mirror_tensor(mine: torch.Tensor, after: torch.Tensor) -> None:
    if after.device.type == "meta" or mine.device.type == "meta":
        return
    with torch.no_grad():
        if mine.shape == after.shape and mine.dtype == after.dtype:
            theirs = after.to(mine.device)
            if not torch.equal(mine, theirs):
                mine.copy_(theirs)


def _to_device(value: Any, device: str) -> Any:
    if device == "cpu":
        return value
    return _map_tensors(value, lambda t: t.to(device))


# -- the learner's side ---------------------------------------------------------------------


@contextlib.contextmanager
def serve_in_thread(namespace: dict, *, host: bool = False):
    """``namespace`` served (:func:`serve`) from a thread of this process, as the grader serves a
    learner's from a process of its own; yields the judge's end of the channel, on which to make
    :class:`Remote` names. For the course's tests and tools: a thread shares everything with its
    caller, so nothing here is confined. The thread hands the interpreter lock over as often as a
    separate process would not need to, or every crossing of the pipe would wait for it. ``host``:
    served as the script host serves (archives and programs too)."""
    import sys
    import threading

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    a_r, a_w = os.pipe()
    b_r, b_w = os.pipe()
    judge, learner = Link(a_w, b_r), Link(b_w, a_r)
    thread = threading.Thread(target=serve, args=(learner, dict(namespace)), kwargs={"host": host}, daemon=True)
    thread.start()
    try:
        yield judge
    finally:
        if host:  # a host serves until its channel closes
            os.close(a_w)
        else:
            judge.send({"op": "end"})
        thread.join(10)
        for fd in (a_r, b_r, b_w) if host else (a_r, a_w, b_r, b_w):
            os.close(fd)
        sys.setswitchinterval(interval)


#: Whether the code running now was called by :func:`serve` as the program host (``host=True``), in this
#: thread's context: a prober there may trust what only the host's own :func:`course.hand.define` set on a
#: program (lesson 10's workers define the program the judge read). Elsewhere, a learner's process or a
#: thread serving one in a test, it is False.
_SERVING_HOST: contextvars.ContextVar[bool] = contextvars.ContextVar("course_serving_host", default=False)


def serving_host() -> bool:
    """True inside :func:`serve` with ``host=True`` (the program host), else False."""
    return _SERVING_HOST.get()


def serve(link: Link, namespace: dict, *, host: bool = False) -> int:
    """Answer the judge's requests on ``link`` from ``namespace`` until it says ``end``; return
    how many were answered. Runs in the learner's process: nothing here is trusted. ``host``: in
    the script host (``autograder/sandbox/script_host.py``), which also loads archives (:func:`_load`)
    and serves until the judge closes the channel; what it calls knows it (:func:`serving_host`)."""
    token = _SERVING_HOST.set(host)
    try:
        return _serve(link, namespace, host)
    finally:
        _SERVING_HOST.reset(token)


def _serve(link: Link, namespace: dict, host: bool) -> int:
    link.recipes = False
    calls: dict[int, tuple[list, list]] = {}
    calls_staged: dict[int, list] = {}
    answered = 0
    while True:
        try:
            message = link.pending.pop(0) if link.pending else link.receive()
        except (EOFError, OSError):
            return answered
        except wire.WireError:
            return answered
        if not isinstance(message, dict) or (message.get("op") == "end" and not host):
            return answered
        try:
            if host and message.get("op") == "load":
                reply = {"ok": _load(message.get("archive"), namespace)}
            elif host and message.get("op") == "program":
                reply = {"ok": _define(message, namespace)}
            elif host and message.get("op") == "end":
                reply = {"ok": None}
            else:
                if host and message.get("op") in ("call", "probe"):
                    from course.hand import host_state_untouched

                    host_state_untouched()  # nothing an earlier program left behind (autocast on, a mode)
                link.serving = message.get("seq")
                reply = {"ok": _answer(message, namespace, calls, calls_staged, link)}
        except BaseException as exc:  # noqa: BLE001 - the learner's exception (or a timeout) is the answer
            name = _text(lambda: type(exc).__name__, "Exception")
            if name == "CellTimeout":  # the grader's time limit interrupted the call
                name, exc = "TimeoutError", TimeoutError("interrupted at the cell's time limit")
            reply = {"raised": name,
                     "message": _text(lambda: str(exc), "(its message could not be read)")}
        finally:
            link.serving = None
        reply["seq"] = message.get("seq")
        try:
            link.send(reply)
        except OSError:
            return answered
        except BaseException as exc:  # noqa: BLE001 - a value that would not encode is a wrong answer
            link.send({"raised": "RuntimeError", "seq": message.get("seq"),
                       "message": "the result could not be sent: " + _text(lambda: str(exc), "")})
        answered += 1


def _load(archive: Any, namespace: dict) -> dict:
    """In the script host: the TorchScript archive ``archive`` (bytes as a uint8 tensor) loaded
    into ``namespace`` under a name of its own; that name, and what this process's code reads off
    the loaded object: its type and its graph's ops (see :class:`Scripted`)."""
    if not (isinstance(archive, torch.Tensor) and archive.dtype == torch.uint8 and archive.dim() == 1):
        raise ValueError("an archive is a 1-d uint8 tensor")
    obj = torch.jit.load(io.BytesIO(archive.numpy().tobytes()), map_location="cpu")
    name = f"script_{len(namespace)}"
    namespace[name] = obj
    from course.grading import script_ops

    ops = script_ops(obj) or []
    return {"name": name, "type": type(obj).__name__, "ops": ops,
            "scripted": isinstance(obj, (torch.jit.ScriptFunction, torch.jit.ScriptModule))}


def _define(message: dict, namespace: dict) -> str:
    """In the script host: a program the judge read (:mod:`course.hand`) defined into ``namespace``
    under a name of its own; that name."""
    from course.hand import define

    fn = define(message.get("source"), message.get("bindings"), message.get("name"))
    name = f"program_{len(namespace)}"
    namespace[name] = fn
    return name


def _text(get: Callable[[], Any], default: str) -> str:
    """``get()`` as text of at most 4000 characters; ``default`` if learner code makes it fail."""
    try:
        text = get()
        return text[:4000] if type(text) is str else default
    except BaseException:  # noqa: BLE001
        return default


def _answer(message: dict, namespace: dict, calls: dict, staged: dict, link: Link | None = None) -> Any:
    from course.guard import answering  # the course's references refuse to serve as the answer here too

    op, name = message.get("op"), message.get("name")
    if op in ("call", "script", "describe", "block", "probe") and name not in namespace:
        raise NameError(f"name {name!r} is not defined")
    if op == "call":
        from course.devices import asked_threads, threads

        args, kwargs = _arguments(message, link, staged)
        # autograd on as in the judge's call (an answer may differentiate inside, whatever its inputs)
        with torch.set_grad_enabled(message.get("grad_mode", message.get("grad")) is True), answering(), \
                threads(asked_threads(message.get("threads"), str(message.get("device")))):
            value = namespace[name](*args, **kwargs)
        call_id = len(calls)
        leaves = [t for t in _tensors((args, kwargs)) if t.requires_grad]
        outs = _tensors(value)
        differentiable = [i for i, t in enumerate(outs) if t.requires_grad]
        calls[call_id] = (leaves, [outs[i] for i in differentiable])
        reply = {"id": call_id, "value": value, "differentiable": differentiable}
        if message.get("after") is True:  # the arguments as the call left them (see mirrored)
            reply["after"] = [args, kwargs]
        return reply
    if op == "probe":
        fn = _registered(PROBES, message.get("probe"), "probe")
        args, kwargs = _arguments(message, link)
        # every line of a probe may run the learner's code (a property, an operator): the course's
        # references refuse to serve anywhere inside it
        with torch.set_grad_enabled(message.get("grad_mode") is True), answering():
            return fn(namespace[name], *args, **kwargs)
    if op == "backward":
        leaves, outs = calls[message["id"]]
        grads = message["grads"]
        pairs = [(o, g.to(o.device)) for o, g in zip(outs, grads) if isinstance(g, torch.Tensor)]
        if not pairs or not leaves:
            return [None] * len(leaves)
        result = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs],
                                     allow_unused=True, retain_graph=True)
        return list(result)
    if op == "script":
        obj = namespace[name]
        if message.get("compile") and not isinstance(obj, (torch.jit.ScriptFunction, torch.jit.ScriptModule)):
            obj = torch.jit.script(obj)
        if not isinstance(obj, (torch.jit.ScriptFunction, torch.jit.ScriptModule)):
            module = type(obj).__module__
            return type(obj).__qualname__ if module == "builtins" else f"{module}.{type(obj).__qualname__}"
        buf = io.BytesIO()
        torch.jit.save(obj, buf)
        return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    if op == "describe":
        from course.grading import is_compiled, is_scripted

        obj = namespace[name]
        module = type(obj).__module__
        kind = type(obj).__qualname__ if module == "builtins" else f"{module}.{type(obj).__qualname__}"
        return {"type": kind, "compiled": is_compiled(obj), "scripted": is_scripted(obj)}
    if op == "stage":
        staged[len(staged)] = [build(c) for c in message["constants"]]  # a recipe (a model) built once, here
        return len(staged) - 1
    if op == "block":
        from course.devices import asked_threads, synchronize, threads

        fn = course_function(message["course"]) if "course" in message else namespace[name]
        make = FACTORIES[message["factory"]]
        device, constants = message["device"], [_arrive(t, message["device"]) if isinstance(t, torch.Tensor) else t
                                                for t in staged[message["handle"]]]
        sums, ours = [], "course" in message
        disturbed = disturbances() if ours else []
        pinned = asked_threads(message.get("threads"), device)
        with torch.set_grad_enabled(message.get("grad_mode") is True), threads(pinned), \
                (collector_off() if ours else contextlib.nullcontext()):
            for seed in message["seeds"]:
                args = make(seed, device=device, **message["sizes"])
                with answering():
                    out = fn(*constants, *args) if message.get("lead") is True else fn(*args, *constants)
                sums.append(checksum(out))
            synchronize(device)
        result = torch.stack(sums).cpu() if sums else torch.zeros(0, 2, dtype=torch.float64)
        if ours:
            return {"sums": result, "disturbed": sorted(set(disturbed + disturbances()))}
        return result
    raise ValueError(f"unknown request {op!r}")


def course_function(name: Any) -> Callable:
    """The course's module-level function ``name`` (``"course.module.function"``), as this process
    has it: what a block runs when the judge times the course's baseline in the learner's process.
    Only a function of an already imported ``course`` module (never a reference: they are not in
    that process), defined there. In the learner's process the learner may have patched it; the
    judge believes what that timing says only within a bound (``compare_served``'s ``calibrate``)."""
    import sys
    import types

    module, _, attr = name.rpartition(".") if isinstance(name, str) else ("", "", "")
    mod = sys.modules.get(module)
    fn = getattr(mod, attr, None) if module.startswith("course.") and not module.startswith("course.references") else None
    if not isinstance(fn, types.FunctionType) or fn.__module__ != module:
        raise ValueError(f"no course function named {name!r} here")
    return fn


@contextlib.contextmanager
def collector_off():
    """The garbage collector off for a block of the course's code (on again after, if it was): a
    collection there would run whatever finalizers the learner's garbage holds, learner code
    between the course's bytecodes. The judge times its own side of such a comparison the same
    way (``course.timing.compare_served(calibrate=...)``)."""
    import gc

    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


#: Python's own switch interval: how long a thread may hold the interpreter's lock while another
#: waits for it (``sys.setswitchinterval``).
SWITCH_INTERVAL = 0.005


def disturbances() -> list[str]:
    """What in this process could run code in its main thread while the course's own function is
    timed there (``compare_served(calibrate=...)``), besides that function: a torch function or
    dispatch mode left active, a profile or trace function, an interval timer or a handler of a
    signal other than the harness's (code that runs between the function's bytecodes), a
    garbage-collector callback, a switch interval other than Python's (a thread of the learner's
    that takes the interpreter's lock often makes the course's code switch often: work that a
    reading of its thread's CPU time would count as the process's slowness). (Finalizers of the learner's garbage are not run there: the block
    runs with the collector off.)
    Patching the course's code is the seal's to see; threads and processes that work beside it, the
    judge's CPU reading. A timing taken with any of these present says nothing about how fast the
    process runs the course's code, so the judge does not believe it is slow (``course.timing``)."""
    import gc
    import signal
    import sys

    found = []
    if torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack():
        found.append("a torch function or dispatch mode was active")
    if sys.getprofile() is not None or sys.gettrace() is not None:
        found.append("a profile or trace function was set")
    if sys.getswitchinterval() != SWITCH_INTERVAL:  # (how often a thread that wants the lock gets it)
        found.append(f"the interpreter's switch interval was {sys.getswitchinterval():g} s, not {SWITCH_INTERVAL:g}")
    for timer in ("ITIMER_REAL", "ITIMER_VIRTUAL", "ITIMER_PROF"):
        if signal.getitimer(getattr(signal, timer)) != (0.0, 0.0):
            found.append(f"an interval timer ({timer}) was set")
    # Any Python handler of any signal (a thread of the learner's can send one whenever it likes)
    # but Python's own for SIGINT and the harness's for SIGALRM, its time limit.
    from course import grader_hooks

    own = {signal.SIGINT: signal.default_int_handler, signal.SIGALRM: grader_hooks.alarm}
    for sig in sorted(signal.valid_signals()):
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):  # pragma: no cover - a number the platform does not handle
            continue
        if callable(handler) and handler != own.get(sig):
            found.append(f"a handler of a signal ({_signal_name(sig)}) was set")
    if any(str(getattr(cb, "__module__", "")).split(".")[0] not in ("torch", "course") for cb in gc.callbacks):
        found.append("a garbage-collector callback was set")
    return found


def _signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _arrive(t: torch.Tensor, device: str) -> torch.Tensor:
    grad = t.requires_grad
    t = t.detach().to(device) if device != "cpu" else t.detach()
    return t.requires_grad_(grad)

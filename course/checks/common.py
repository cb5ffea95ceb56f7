"""Pieces every lesson's checks share: calling learner code with friendly errors, and
comparing gradients."""

from __future__ import annotations

import contextlib
import os
from sys import getprofile as _getprofile, setprofile as _setprofile  # held here: sealed with the module
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch.overrides import TorchFunctionMode

from course.checks.witnesses import DispatcherOps
from course.guard import ReferenceRefused, answering
from course.numerics import assert_close, describe

__all__ = ["TorchCalls", "call", "clock_against_loop", "expect_grads", "ok", "record", "served_speedup", "weighted_sum"]


def ok(message: str) -> None:
    print(f"ok: {message}")


def record(actual: Any, expected: Any, name: str) -> None:
    """Report a value a check decided by its own comparison (names, strides, a choice), so that
    the grading parent can check it again; outside the grader, one more comparison."""
    assert_close(actual, expected, name=name)


def _is_stub(exc: NotImplementedError) -> bool:
    """The stub's bare ``raise NotImplementedError()``: no message, or only the one an FX
    ``Interpreter`` puts in front of an error raised while it ran a node ("While executing %x ...",
    where a message of the error's own would come first)."""
    text = str(exc)
    return not text or text.startswith("While executing ")


def not_written(label: str) -> AssertionError:
    """What a check says of an answer that is still the stub (its bare ``raise NotImplementedError()``)."""
    return AssertionError(f"{label} is not written yet: replace `raise NotImplementedError()` with your code, then run "
                          "its cell again.")


class TorchCalls(TorchFunctionMode):
    """Records, by name (``course.memory_format.op_name``), the torch functions code calls while it
    is active: the course's watcher of how an answer was computed (a probe under the grader: that
    process's word). Every Python route to a torch function arrives here, whatever alias the code
    used (``torch.lstm_cell``, ``torch._VF``, ``torch.ops.aten``, a module's forward).

    A mode sees only what reaches it, so while it is active a profile function on the same thread
    watches that it stays the one handling torch functions: torch function handling switched off
    (``torch._C.DisableTorchFunction``), a mode of the code's own inside it, the course's mode taken
    off the stack, torch's switches of that machinery called, or a thread started (modes are each
    thread's own) all make the call fail on leaving, with ``label`` and what was seen.

    Beside it, :class:`course.checks.witnesses.DispatcherOps` records the ATen ops the dispatcher
    ran on this thread (``aten::lstm_cell``): TorchScript's too, which no mode hears; its names join
    ``names``, and stopping it fails the call as the rest does. A thread the notebook started
    before the call is :func:`course.checks.witnesses.alone`'s to see (the probes run this watcher
    inside it); code written in C is not seen: that is why this stays a probe."""

    def __init__(self, label: str = "your function"):
        super().__init__()
        self.names: list[str] = []
        self.complex_results = 0  # torch functions that returned a complex tensor (lesson 4: a complex step)
        self.label = label
        self.blinded: list[str] = []  # how the watcher was kept from seeing, in the order first seen
        self._inside = 0  # in this mode's own handler, where torch has taken the mode off its stack
        self._before = None
        self._profile = self._watch  # (one bound method, to know it again)
        self._ops: DispatcherOps | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self._inside += 1  # first: what runs here (the name's lookup included) is not the answer's
        try:
            from course.memory_format import op_name

            self.names.append(op_name(func))
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.is_complex():
                self.complex_results += 1
            return out
        finally:
            self._inside -= 1

    def __enter__(self):
        self._ops = DispatcherOps().__enter__()
        out = super().__enter__()
        self._before = _getprofile()
        _setprofile(self._profile)
        return out

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None and _getprofile() is not self._profile:  # (an error raised in it also takes it off)
            self._saw("the profile function the course set was replaced")
        _setprofile(self._before)
        self._ops.__exit__(None, None, None)
        self.names.extend(self._ops.names)
        if self._ops.blocked:
            self._saw(self._ops.blocked)
        depth = torch._C._len_torch_function_stack()
        if depth and torch._C._get_function_stack_at(depth - 1) is self:
            super().__exit__(exc_type, exc, tb)
        else:  # taken off, or a mode of the code's own left on top of it
            self._saw("the course's mode was not left on top of torch's mode stack")
            _leave_mode(self)
        if self._inside:  # the count this mode keeps of its own handler, changed from outside it
            self._saw("the course's watcher was changed")
        if self.blinded and exc_type is None:  # (an answer that raised fails as it is)
            raise AssertionError(f"{self.label}: the course watches which torch functions an answer calls, and while "
                                 f"it ran {'; '.join(self.blinded[:3])}. Write the answer as plain calls (no "
                                 "torch._C.DisableTorchFunction, TorchFunctionMode of your own or threads), and run its "
                                 "cell again.") from None
        return False

    def _saw(self, what: str) -> None:
        if what not in self.blinded:
            self.blinded.append(what)

    def _watch(self, frame, event, arg):
        if self._inside or frame.f_code is TorchCalls.__torch_function__.__code__:
            return  # this mode's own handler, where torch has taken the mode off its stack
        if _all_off():
            self._saw("torch function handling was switched off")
        name = owner = ""
        if event == "c_call":
            name = str(getattr(arg, "__name__", "") or "")
            owner = str(getattr(arg, "__module__", None) or getattr(getattr(arg, "__self__", None), "__name__", None) or "")
            if owner == "_thread" and name.startswith("start"):
                self._saw("a thread was started")
            elif name == "_disabled_torch_function_impl":
                self._saw("torch._C._disabled_torch_function_impl was called")
            elif "profiler" in name.lower() and owner.startswith("torch") and \
                    not frame.f_code.co_filename.startswith(_dispatch_files()[2]):
                self._saw(f"{owner}.{name} was called (the course's profiler watches the answer)")
        overrides, helper, torch_dir = _dispatch_files()
        here = frame.f_code.co_filename
        if here == overrides or (here == helper and frame.f_back is not None
                                 and frame.f_back.f_code.co_filename == overrides):
            # torch's own dispatch to a mode, which takes the mode off the stack meanwhile; called
            # from outside torch, its helpers hand out the modes themselves
            if event == "call" and frame.f_code.co_name.startswith("_"):
                caller = frame.f_back
                while caller is not None and caller.f_code.co_filename == helper:
                    caller = caller.f_back
                if caller is not None and not caller.f_code.co_filename.startswith(torch_dir):
                    self._saw(f"torch.overrides.{frame.f_code.co_name} was called")
            return
        depth = torch._C._len_torch_function_stack()
        if depth == 0 or torch._C._get_function_stack_at(depth - 1) is not self:
            self._saw("the course's mode was not the one handling torch functions")
        if owner.startswith("torch._C") and name in ("_set_torch_function_state", "_pop_torch_function_stack",
                                                     "_push_on_torch_function_stack", "_set_skip_next_torch_function",
                                                     "_skip_one_hop_torch_function", "_get_function_stack_at",
                                                     "_len_torch_function_stack"):
            if not here.startswith(torch_dir):
                self._saw(f"torch._C.{name} was called")


def _dispatch_files() -> tuple[str, str, str]:
    """The files of torch's own dispatch to modes (``torch.overrides``, and ``contextlib``'s helper
    it enters a mode's handler with), and torch's folder: read off torch's functions, which the
    grader's seal holds, not off names a notebook could rebind."""
    overrides = torch.overrides.handle_torch_function.__code__.co_filename
    helper = getattr(torch.overrides, "_pop_mode_temporarily", contextlib.contextmanager).__code__.co_filename
    return overrides, helper, os.path.dirname(overrides) + os.sep


def _all_off() -> bool:
    """Whether all torch function handling is off now (``torch._C.DisableTorchFunction``; not the
    switch for subclasses alone, which torch's own code uses)."""
    off = getattr(torch._C, "_is_torch_function_all_disabled", None)
    return bool(off()) if off is not None else not torch._C._is_torch_function_enabled()


def _leave_mode(mode: TorchFunctionMode) -> None:
    """Take ``mode``, and any mode pushed on top of it, off torch's stack (after code that left
    them in disorder)."""
    stack = [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
    if any(m is mode for m in stack):
        while torch._C._len_torch_function_stack():
            if torch._C._pop_torch_function_stack() is mode:
                break


def call(fn: Callable, *args: Any, name: str | None = None, **kwargs: Any) -> Any:
    """Call the learner's ``fn``, turning the usual first-day mistakes into clear messages."""
    label = name or getattr(fn, "__name__", None) or "your function"
    if fn is None or not callable(fn):
        raise AssertionError(f"{label} should be a function, but it is {describe(fn)}. "
                             "Run the cell that defines it first.")
    try:
        with answering():  # under the grader, the course's references refuse to serve as the answer
            return fn(*args, **kwargs)
    except ReferenceRefused as exc:
        raise AssertionError(f"{label}: {exc}") from None
    except NotImplementedError as exc:
        if not _is_stub(exc):  # PyTorch's own (a missing jvp, an op with no kernel), not the stub's bare raise
            raise _learner_error(label, exc, args) from exc
        raise not_written(label) from None
    except AssertionError:
        raise
    except NameError as exc:
        if type(fn).__name__ == "Remote":  # under the grader: the notebook never bound the name
            raise AssertionError(f"{label} is not defined in your notebook ({exc}). Run the cell that "
                                 "defines it, and keep its name.") from None
        raise _learner_error(label, exc, args) from exc
    except Exception as exc:  # the learner's own error: name it, keep its traceback below
        raise _learner_error(label, exc, args) from exc


#: A batched answer (vmap, one batched pass) measured 0.04-0.2 of the course's loop on the same work;
#: a loop, however dressed, about 1. "No loop" is at most this fraction.
NO_LOOP = 1 / 3
#: ...and "a loop" at least this fraction. In between, the clock cannot tell (a busy machine slows the
#: learner's side: a right answer under load measured 0.76): undecided, measured again, never a pass.
LOOP_LIKE = 0.8
#: ...and a first reading (each side's best of five) this many times the loop's, a loop at once
#: (:func:`clock_against_loop`): loops of module calls read 3 to 40 of the leanest loops, and the
#: further readings cost them a minute a clock; a right answer reads at most a third, and would need
#: every one of its five timed calls slowed ten times more than the loop's.
LOOP_FAST = 3.0


def clock_verdict(shows_asked: bool, shows_other: bool, *, text: str, fail: str, between: str,
                  or_else: str = "") -> None:
    """A structure verdict read from the clock: returns when the reading shows what the lesson asks,
    raises ``AssertionError(text + fail)`` when it clearly shows the other, and
    :class:`course.grading.SpeedUndecided` in between (``between``: where the reading fell; ``or_else``:
    what else than a busy machine puts a reading there): a busy machine slows either side of a
    reading, so a reading in the gap is measured again, never passed."""
    from course.grading import SpeedUndecided

    if shows_asked:
        return
    if shows_other:
        raise AssertionError(text + fail)
    raise SpeedUndecided(f"Undecided: {text}: {between}. The machine was probably busy{or_else}. This is not a "
                         "pass: run the cell again, with other programs closed.")


def expect_loop_verdict(mine: float, loop: float, *, want_loop: bool, text: str, fail: str,
                        unit: str = "sample", no_loop: float = NO_LOOP, loop_like: float = LOOP_LIKE) -> None:
    """:func:`clock_verdict` on the learner's time ``mine`` beside the course's ``loop`` (one step per ``unit``):
    a batched answer takes at most ``no_loop`` of it, a loop at least ``loop_like`` (:data:`NO_LOOP` and
    :data:`LOOP_LIKE` unless a check measured tighter bars for its own work)."""
    batched, looped = mine <= no_loop * loop, mine >= loop_like * loop
    between = (f"{mine / loop:.2g} of the loop, between a batched answer (at most {no_loop:.2g}) and a loop (at "
               f"least {loop_like:.2g})")
    net = getattr(mine, "net", None)
    if not want_loop and looped and net is not None and net < loop_like * loop:
        # the time of a loop only with the machine's waiting in it: undecided, never passed
        looped = False
        between = (f"{mine / loop:.2g} of the loop, but {net / loop:.2g} of it net of the time your process and the "
                   f"grader waited, ready, for a CPU (the operating system's count)")
    clock_verdict(looped if want_loop else batched, batched if want_loop else looped, text=text, fail=fail,
                  between=between,
                  # a loop whose every step is already batched (the rows of one sample in one backward
                  # pass, say) reads about 0.6 of the course's loop on a quiet machine
                  or_else="" if want_loop else f", or the answer still loops over the {unit}s in Python, with "
                                               "less work in each step than the course's loop: no loop at all is "
                                               "what the lesson asks")


def clock_against_loop(fn: Callable, name: str, make: Callable[[int], tuple] | None, loop: Callable, *,
                       attempts: int = 3, key: Any = None, rtol: float = 1e-3, atol: float = 1e-4,
                       no_loop: float = NO_LOOP, loop_like: float = LOOP_LIKE,
                       agree: Callable[[Any, Any], None] | None = None, kept: int = 0,
                       factory: Callable | None = None, sizes: Mapping[str, Any] | None = None,
                       grad: bool = False, constants: tuple = (), lead: bool = True,
                       record: dict | None = None) -> tuple[float, float]:
    """The best wall times of the learner's ``fn`` and of the course's ``loop`` (the same work done
    by a Python loop), by the grader's clock (:func:`course.timing.best_times`: in turn, the
    learner's process stopped while the loop runs), on ``make(seed)``: fresh arguments for every
    repetition from a seed drawn at random then, the same for both sides, so nothing can be
    memoised; every output of ``fn`` is compared with the loop's (a fast wrong answer is refused).
    Two to ``attempts`` readings, each side's best kept across them: noise only ever adds time,
    so a further reading refines the estimate and is taken only while the learner's side is not
    yet below ``no_loop`` of the loop (nor, after ``attempts``, above ``loop_like``); it is not a new
    chance. A reading still between the two verdicts after ``attempts`` (a busy machine slowed one
    side) is refined by up to ``attempts`` more: undecided is the last resort, not the answer to one
    noisy run. With ``key``, the reading is made once per learner function (a remote one keeps it:
    the hidden tests of a cell ask again).
    ``agree(mine, loops)`` replaces the comparison where the two sides cannot be equal (random ops:
    the loop then returns what the check needs to tell a right output) and raises when ``mine`` is wrong.
    ``kept``: how many of ``make``'s leading arguments are the same objects in every call (a model's
    state): a learner's function across the boundary gets them sent once, ahead of the clock, and
    kept there (:meth:`course.remote.Remote.stage`), so that what the clock reads is the learner's
    work, not the state crossing again on every call (which, for thousands of tiny models, cost a
    batched answer more than its work and narrowed its lead over a lean loop).

    ``factory`` (a registered :func:`course.remote.factory`, with ``sizes``): a remote ``fn`` is timed
    as :func:`course.timing.compare_served` times it, one block request per call in which the
    learner's process makes the inputs from the seed sent and answers with its output's checksums;
    the loop's side makes the same inputs here. Nothing crosses but a seed and four numbers, so the
    clock reads the learner's work, not the data crossing: that crossing had cost a right answer
    more than its work, and left room under a bar for a loop whose steps are each a few Python
    operations (``grad``: both sides run with autograd on). ``constants`` (a model's state, the same in
    every call) come ahead of the factory's arguments (``lead=False``: after them): the learner's process
    gets them once, ahead of the clock, and both sides call ``fn(*constants, *factory(seed))`` (or
    ``fn(*factory(seed), *constants)``). ``record``: what
    :func:`course.timing.best_times` records of the learner's calls (their CPU time, their memory's
    growth), every reading's appended (not with ``factory``)."""
    import secrets

    from course.devices import threads
    from course.remote import is_remote, pinned_calls
    from course.timing import best_times
    from course.wire import Kept

    cache = fn.__dict__.setdefault("clock_readings", {}) if key is not None and hasattr(fn, "__dict__") else {}
    if key is not None and key in cache:
        return cache[key]
    learner = lambda *a: call(fn, *a, name=name)  # noqa: E731
    if kept and is_remote(fn):
        constants = tuple(make(secrets.randbits(31)))[:kept]
        handle = fn.stage(list(constants))

        def learner(*a):
            if any(x is not c for x, c in zip(a[:kept], constants)):
                raise ValueError(f"make's first {kept} arguments change from call to call: they cannot be kept")
            return call(fn, *(Kept(handle, i) for i in range(kept)), *a[kept:], name=name)

    def fresh() -> tuple:
        return tuple(make(secrets.randbits(31)))

    def check(outputs: list) -> None:
        if agree is not None:
            return agree(outputs[0], outputs[1])
        assert_close(outputs[0], outputs[1], name=f"{name} while timed beside the course's loop", rtol=rtol,
                     atol=atol, hint="a timed answer must be right on every input it is given.")

    if factory is not None and is_remote(fn):
        learner, loop, fresh, check = _blocks(fn, name, loop, factory, dict(sizes or {}), rtol, grad, constants,
                                              lead)
    elif factory is not None:  # a local function (the lesson's own run): the factory's inputs, passed as they are
        make = lambda seed: _in_order(constants, factory(seed, device="cpu", **(sizes or {})), lead)  # noqa: E731

    best = [float("inf"), float("inf")]
    attempts = max(attempts, 2)
    record = record if record is not None else {}  # (read below for the learner's calls net of waiting)
    # One thread on both sides, and the learner's CPU time charged over one (best_times charges it over
    # the judge's thread count): the yardstick is a loop in one thread, and a loop spread over many
    # processes or threads of the learner's must not read a fraction of it for the machine's cores.
    with threads(1), pinned_calls(1):
        for attempt in range(2 * attempts):
            times = best_times([(learner, fresh), (loop, fresh)], held=[1], check=check, warm=[0], record=record)
            best = [min(b, t) for b, t in zip(best, times)]
            batched, looped = best[0] <= no_loop * best[1], best[0] >= loop_like * best[1]
            if attempt >= 1 and (batched or (attempt >= attempts - 1 and looped)):
                break
            if best[0] >= LOOP_FAST * best[1]:  # a loop of module calls: decided by the first reading
                break
    mine = Clocked(best[0], best_net(record, 0))
    if key is not None:
        cache[key] = (mine, best[1])
    return mine, best[1]


def best_net(record: Mapping[str, Any], entry: int) -> float | None:
    """The best time of the learner's calls at ``entry`` of ``course.timing.best_times``' calls, net of
    the crossing's waiting for a CPU, over every reading ``record`` holds (its ``"net"``); None where
    there is none, or one was not counted."""
    nets = [n for reading in record.get("net", []) if len(reading) > entry for n in reading[entry]]
    return min(nets) if nets and None not in nets else None


class Clocked(float):
    """The learner's best time by the judge's clock (a float), with ``net``: its best time less what the
    threads its request and reply pass through waited, ready to run, for a CPU (the scheduler's count;
    None: not known). A busy machine adds that waiting to every crossing; a loop's own work it does not
    take away (:func:`expect_loop_verdict` decides "a loop" only where the time net of it says so too)."""

    net: float | None

    def __new__(cls, value: float, net: float | None = None):
        obj = super().__new__(cls, value)
        obj.net = net
        return obj


def _in_order(constants: Sequence[Any], args: Sequence[Any], lead: bool) -> tuple:
    """A call's arguments: ``constants`` ahead of ``args`` (``lead``) or after them."""
    return (*constants, *args) if lead else (*args, *constants)


def _blocks(fn: Callable, name: str, loop: Callable, factory: Callable, sizes: dict, rtol: float,
            grad: bool, constants: tuple, lead: bool = True) -> tuple:
    """:func:`clock_against_loop`'s two sides on a registered ``factory``: the learner's as one block
    request per call (a seed in, checksums out; ``constants`` staged once, ahead of the factory's
    arguments, or after them where ``lead`` is False), the loop's on the same inputs made here; a fresh seed for each repetition, and the
    check that compares the checksums."""
    import secrets

    from course.remote import checksum
    from course.timing import checksums_differ

    factory_name = f"{factory.__module__}.{factory.__qualname__}"
    handle = fn.stage(list(constants))

    def learner(seed: int) -> torch.Tensor:
        return fn.block(handle, factory_name, sizes, [seed], "cpu", grad=grad, lead=bool(constants) and lead)

    def course_loop(seed: int) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            return checksum(loop(*_in_order(constants, factory(seed, device="cpu", **sizes), lead)))[None]

    def fresh() -> tuple:
        return (secrets.randbits(31),)

    def check(outputs: list) -> None:
        if bool(checksums_differ(outputs[0], outputs[1], rtol).any()):
            raise AssertionError(f"{name}: the output of a call timed beside the course's loop differs from the "
                                 "loop's on the same inputs. A timed answer must be right on every input it is given.")

    return learner, course_loop, fresh, check


def expect_no_loop_by_clock(fn: Callable, label: str, setup: Callable[[], dict], *, count: int, unit: str,
                            key: tuple, no_loop: float = NO_LOOP, hint: str = "") -> str:
    """Across the boundary: ``fn`` must take at most ``no_loop`` of the course's loop on the same work
    (``count`` units: models, samples, segments), by the judge's clock (:func:`clock_against_loop`, with
    what ``setup()`` returns: ``make``, ``loop``, and ``agree``, ``kept``, ``rtol``, ``atol`` where they
    apply). The reading is made once per function and ``key``: a hidden test asking again gets it, and
    ``setup`` (which builds the clock's inputs) is not called then. ``hint``: what to write instead of a
    loop. Returns the evidence, as text."""
    from course.timing import format_time

    reading = clock_reading(fn, key)
    mine, theirs = reading if reading is not None else clock_against_loop(fn, label, key=key, no_loop=no_loop,
                                                                          **setup())
    text = (f"took {format_time(mine)} for {count} {unit}s, where the course's loop over them takes "
            f"{format_time(theirs)} (the grader's clock)")
    expect_loop_verdict(mine, theirs, want_loop=False, text=f"{label} {text}", unit=unit, no_loop=no_loop,
                        fail=f": the work of a Python loop over the {unit}s (a batched answer takes a fraction of "
                             f"it).\n  Hint: {hint}")
    return text


def clock_reading(fn: Callable, key: Any) -> tuple[float, float] | None:
    """The reading :func:`clock_against_loop` made of ``fn`` under ``key`` earlier (kept on the
    function: a hidden test asks again), or ``None``."""
    return getattr(fn, "__dict__", {}).get("clock_readings", {}).get(key)


def _learner_error(label: str, exc: Exception, args: tuple) -> AssertionError:
    from course.checks.hints import torch_hint

    shapes = ", ".join(describe(a) for a in args if hasattr(a, "shape"))[:400]
    hint = torch_hint(exc)
    return AssertionError(f"{label} raised {type(exc).__name__}: {exc}\n"
                          f"  It was called with: {shapes or 'no tensor arguments'}.\n"
                          + (f"  Hint: {hint}\n" if hint else "")
                          + "  The traceback above shows the line in your code.")


def grader_references(name: str):
    """``course.references.<name>``, where it exists: with the grader (the judge) and in the tests; a
    learner's copy of the course (the bundle) has no ``course/references``, and gets ``None``."""
    import importlib

    try:
        return importlib.import_module(f"course.references.{name}")
    except ImportError:
        return None


def visible_call(check: Callable, leave_out: Iterable[str] = ("device",), only: Iterable[str] | None = None) -> dict:
    """The arguments of the lesson's own call of ``check``: its defaults (what a learner's copy stores
    answers for), less the names in ``leave_out``, and, where ``only`` is given, only those names."""
    import inspect

    leave_out, only = set(leave_out), None if only is None else set(only)
    return {name: p.default for name, p in inspect.signature(check).parameters.items()
            if p.default is not inspect.Parameter.empty and name not in leave_out and (only is None or name in only)}


def stored_answers(file: str, **expected: Any) -> dict:
    """The reference data a visible check uses without the grader's references
    (``course/reference_data/<file>``, written by ``python -m course.references``), refused when it was
    stored for other arguments than ``expected`` (the lesson's own call): the grader checks others."""
    from pathlib import Path

    data = torch.load(Path(__file__).resolve().parents[1] / "reference_data" / file, weights_only=True)
    for key, want in expected.items():
        if data[key] != want:
            raise AssertionError(f"This check has reference data for {key} {data[key]} only (the lesson's own call); "
                                 f"the grader checks others ({key} {want} asked for here).")
    return data


def weighted_sum(outputs: Any, seed: int = 1234) -> torch.Tensor:
    """A scalar that depends on every element of ``outputs`` with a distinct random weight, so
    that gradients through it test every element (a plain sum would hide swapped ones)."""
    flat = [t for t in _flatten(outputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    g = torch.Generator().manual_seed(seed)
    total = 0.0
    for t in flat:
        w = torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.device, t.dtype)
        total = total + (t * w).sum()
    return total


def _flatten(x: Any) -> list:
    if isinstance(x, (tuple, list)):
        return [y for item in x for y in _flatten(item)]
    if isinstance(x, dict):
        return [y for item in x.values() for y in _flatten(item)]
    return [x]


def same_values(a: Any, b: Any, **tol) -> bool:
    """Whether ``a`` and ``b`` (tensors, or tuples, lists and dicts of them) hold the same values,
    tensor by tensor, within ``tol`` (default: float64-tight), compared in ``b``'s dtype."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):  # by key, whatever the order
        return set(a) == set(b) and all(same_values(a[k], b[k], **tol) for k in b)
    fa, fb = _flatten(a), _flatten(b)
    if len(fa) != len(fb) or not all(isinstance(t, torch.Tensor) for t in fa + fb):
        return False
    tol = tol or dict(rtol=1e-7, atol=1e-9)
    return all(x.shape == y.shape and torch.allclose(x.detach().to(y.dtype), y.detach(), **tol) for x, y in zip(fa, fb))


def name_mistake(label: str, got: Any, want: Any, variants: Mapping[str, Any], *,
                 same: Callable[[Any, Any], bool] | None = None, **tol) -> None:
    """Raise naming the mistake when ``got`` is not ``want`` but equals the result of one of
    ``variants`` (``{"what the learner likely did": its result}``); a variant that gives the right
    answer on these inputs names nothing. Does nothing when no variant matches: the usual
    comparison then says what differs. ``same(a, b)`` compares results that are not tensors
    (default: :func:`same_values` within ``tol``)."""
    same = same or (lambda a, b: same_values(a, b, **tol))
    if same(got, want):
        return
    for mistake, result in variants.items():
        if same(result, want):
            continue
        if same(got, result):
            raise AssertionError(f"{label} is wrong; it looks as if {mistake}.")


def expect_grads(outputs: Any, ref_outputs: Any, inputs: Sequence[torch.Tensor],
                 ref_inputs: Sequence[torch.Tensor] | None, names: Sequence[str], *, label: str,
                 expected: Sequence[torch.Tensor | None] | None = None, **tol: Any) -> None:
    """Gradients of a weighted sum of ``outputs`` w.r.t. ``inputs`` equal the reference's (or
    ``expected``: gradients from reference data)."""
    loss = weighted_sum(outputs)
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        raise AssertionError(f"{label}: the outputs carry no gradient at all. Did the function use "
                             "torch.no_grad(), .detach(), .item() or .data? Autograd must see every op.")
    grads = torch.autograd.grad(loss, list(inputs), allow_unused=True)
    ref = (list(expected) if expected is not None
           else torch.autograd.grad(weighted_sum(ref_outputs), list(ref_inputs), allow_unused=True))
    for g, r, n in zip(grads, ref, names):
        if g is None and r is not None:
            raise AssertionError(f"{label}: no gradient reaches {n}. Is it used, and used without "
                                 ".detach()/.data?")
        if r is not None:
            assert_close(g, r, name=f"{label}: gradient w.r.t. {n}", **tol)


#: The name the course's own solution is timed under, beside a learner's (:func:`served_speedup`).
WITNESS = "course's solution"


def served_speedup(baseline: tuple[str, Callable], candidate: tuple[str, Callable], *, factory: Callable,
                   sizes: dict, bars: Any, hint: str, device: torch.device, num_threads: int | None = None,
                   constants: Sequence[Any] = (), rounds: int = 7, min_run_time: float = 0.2, attempts: int = 3,
                   rtol: float = 1e-4, grad: bool = False, explain: Callable | str | None = None,
                   net: bool = False, calibrate: float | None = None):
    """Every graded speed check of a learner's function against the course's baseline, in one
    place: :func:`course.timing.compare_served` (fresh inputs from ``factory`` in every timed call,
    every output checked), repeated while below the device's bar (``attempts`` in all) and the best
    judged; ``num_threads`` pinned on a CPU. Shows the report, then passes or raises with ``hint``.
    ``explain``: the course's own fast solution (or its name in ``course.references.explain``, where
    it answers an exercise); below the bar, the message then also names what the profiler saw the
    learner's code run that it does not (:mod:`course.checks.why_slow`). Under the grader it is also
    timed beside the others (``compare_served``'s ``witness``). ``net``: the times are net of the
    harness's own work per call (``compare_served``'s ``net``); ``calibrate``: under the grader, the
    course's sides count at the speed the learner's process runs the baseline, within that bound
    (``compare_served``'s ``calibrate``)."""
    from course import grader_hooks
    from course.checks.why_slow import course_solution
    from course.devices import threads
    from course.grading import best_of, expect_speedup, speed_bar
    from course.timing import compare_served

    bar = speed_bar(bars, device)
    # Under the grader, the course's own solution is timed in the same rounds: the witness of what a
    # right answer costs on this machine now, against which the parent judges an implausible ratio.
    solution = course_solution(explain) if explain is not None and grader_hooks.observer is not None else None
    witness = (WITNESS, solution) if solution is not None else None
    with threads(num_threads if device.type == "cpu" else None):
        report = best_of(lambda: compare_served(baseline, candidate, factory=factory, sizes=sizes, constants=constants,
                                                device=device, rounds=rounds, min_run_time=min_run_time, until=bar,
                                                rtol=rtol, grad=grad, witness=witness, net=net,
                                                calibrate=calibrate),
                             candidate[0], bar, attempts)
    report.show()
    seen = ""
    if explain is not None and report.speedup(candidate[0], baseline[0]).verdict(bar) != "pass":
        from course.checks.why_slow import why_slower

        with threads(num_threads if device.type == "cpu" else None):
            lines = why_slower(candidate[1], explain, factory=factory, sizes=sizes, constants=constants,
                               device=device, grad=grad, seconds_per_call=report.median(candidate[0]))
        if lines:
            seen = ("\n  What the profiler saw your code run, against the course's solution on the same inputs: "
                    + "; ".join(lines) + ".")
    expect_speedup(report, candidate[0], over=baseline[0], bars=bars, hint=hint, seen=seen)
    return report


def names_with(names: Iterable[str], words: Iterable[str]) -> list[str]:
    """The names (a watcher's record: ``torch.lstm_cell``, ``aten::lstm_cell``) in which any of
    ``words`` appears, once each: what the code called first, then the ATen ops it ran."""
    words = [w.lower() for w in words]
    found = {n for n in names if any(w in n.lower() for w in words)}
    return sorted(found, key=lambda n: (n.startswith("aten::"), n))


def probed_names(answer: Any, prober: Callable, *args: Any, label: str) -> list[str]:
    """What a course probe that lists op names (lesson 6's ``kl_fallbacks``) reported from
    where ``answer`` lives (:func:`course.remote.probe`): a list of strings, or a failed check
    naming ``label`` if that process sent anything else."""
    from course.remote import probe

    names = probe(answer, prober, *args)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise AssertionError(f"{label} could not be watched (got {describe(names)}).")
    return names

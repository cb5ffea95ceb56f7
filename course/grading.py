"""What graded checks share: device-aware speed bars and structure checks.

A speed bar is the least speedup a technique must show, per device kind::

    expect_speedup(report, "compiled", bars={"cpu": 1.0, "cuda": 2.0})

On a CPU the bar is what two cores can honestly show (1.0 means "not slower"); on a GPU it is
the figure the technique exists for. A device with no bar is an error, never a silent pass.

A verdict has three outcomes. It passes when the speedup's 99% lower confidence bound clears
the bar, fails when even its 99% upper bound is below it, and is otherwise *undecided*
(:class:`SpeedUndecided`): the rounds were too noisy to tell, which a busy machine does to a right
answer as easily as to a wrong one. Undecided never earns the points; the grader measures again.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch

from course.devices import device_kind
from course.numerics import observing_paused, report_at_least
from course.timing import SpeedReport

__all__ = ["SpeedUndecided", "best_of", "count_ops", "expect_compiled", "expect_constant_work", "expect_ops_absent",
           "expect_scripted", "expect_speedup", "graph_ops", "is_compiled", "is_scripted", "script_ops", "speed_bar"]


def speed_bar(bars: Mapping[str, float], device: str | torch.device | None = None) -> float:
    kind = device_kind(device)
    if kind not in bars:
        raise KeyError(f"No speed bar for device kind {kind!r} (bars given: {dict(bars)}). "
                       "Every graded speed check names a bar for 'cpu' and for 'cuda'.")
    return float(bars[kind])


class SpeedUndecided(AssertionError):
    """A speed check that could not decide: the bar lies between the 99% lower and upper bounds
    of the measured speedup. Not a pass; run the cell again (on a quieter machine)."""


def expect_speedup(report: SpeedReport, name: str, *, bars: Mapping[str, float], over: str | None = None,
                   hint: str | None = None, seen: str = "", trusted: bool = False) -> float:
    """Assert that ``name`` is at least ``bars[device kind]`` times faster than ``over``.

    Passes on the ratio's lower confidence bound (``Ratio.bound``), not its median: a slower
    candidate must not pass because a few rounds were lucky on a busy machine. Fails when the
    upper bound (``Ratio.ceiling``) is below the bar; in between, raises :class:`SpeedUndecided`.
    ``seen``: what the profiler saw (``course.checks.why_slow``), added to either message.
    ``trusted``: every side timed is the course's or torch's own (see ``report_at_least``)."""
    if not isinstance(report, SpeedReport):
        raise TypeError(f"expect_speedup needs the SpeedReport that course.timing.compare returns, "
                        f"got {type(report).__name__}.")
    bar = speed_bar(bars, report.device)
    over = over or report.baseline
    ratio = report.speedup(name, over)
    witness = report.speedup(name, report.witness).bound if report.witness not in (None, name, over) else None
    report_at_least(f"speed: {name} over {over}", ratio.bound, bar, ceiling=ratio.ceiling, witness=witness,
                    trusted=trusted)
    verdict = ratio.verdict(bar)
    if verdict != "pass":
        rounds = len(report.times[name])
        bounds = (f"between {ratio.bound:.2f}x and {ratio.ceiling:.2f}x with 99% confidence" if ratio.bound > 0
                  else "too few rounds for a confidence bound")
        measured = (f"{name} is {ratio.median:.2f}x as fast as {over} on {report.device} (quartiles "
                    f"{ratio.low:.2f}-{ratio.high:.2f}; {bounds} over {rounds} rounds); the bar on this "
                    f"device is {bar:.2f}x.\n"
                    f"  {name}: {report.median(name) * 1e3:.3g} ms per call, {over}: "
                    f"{report.median(over) * 1e3:.3g} ms.\n")
        if verdict == "undecided":
            raise SpeedUndecided(
                f"Undecided: {measured}  The rounds varied too much to tell whether the bar is cleared (other "
                "work on this machine?). This is not a pass: run the cell again, with other programs closed."
                + seen)
        raise AssertionError(
            measured + f"  Hint: {hint or 'check that the fast path really runs (no fallback to eager), and warm it up.'}"
            + seen)
    print(f"ok: {name} is {ratio} as fast as {over} on {report.device}, at least {ratio.bound:.2f}x with 99% "
          f"confidence (bar {bar:.2f}x)")
    return ratio.median


def best_of(measure: Callable[[], SpeedReport], name: str, bar: float, attempts: int = 3) -> SpeedReport:
    """Call ``measure()`` until ``name``'s speedup reaches ``bar`` (``attempts`` calls at most);
    return the best report. A shared machine can stall one side of a round, but a technique that
    is really slower stays below the bar in every attempt, so retrying is fair and never lenient
    to a wrong answer (every output is still checked in every round). Where none reaches it, an
    attempt that could not decide is kept before one that failed: a miss is decided only when every
    attempt decided it (the highest lower bound could belong to a busy attempt's narrow fail)."""
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}.")
    with observing_paused():  # how many attempts run depends on the machine, not the answer
        return _best_of(measure, name, bar, attempts)


def _best_of(measure, name, bar, attempts):
    best = None

    def rank(report):  # a pass first, then undecided, then a fail; within each, the higher lower bound
        ratio = report.speedup(name)
        return ({"pass": 2, "undecided": 1}.get(ratio.verdict(bar), 0), ratio.bound)

    for attempt in range(1, attempts + 1):
        report = measure()
        if best is None or rank(report) > rank(best):
            best = report
        if best.speedup(name).bound >= bar:
            break
        if attempt < attempts:
            print(f"attempt {attempt}: {name} at {report.speedup(name)} is below the bar {bar:.2f}x; measuring "
                  "again (other work on a shared machine can slow one side of a round)")
    return best


def is_scripted(obj: Any) -> bool:
    """What ``torch.jit.script`` returns; under the grader's judge, a learner's archive the script
    host loaded (:class:`course.remote.Scripted`), whose type that host's own code read."""
    from course.remote import Scripted

    if isinstance(obj, Scripted):
        return obj.scripted
    return isinstance(obj, (torch.jit.ScriptFunction, torch.jit.ScriptModule))


def script_ops(obj: Any) -> list[str] | None:
    """The op kinds a TorchScript function runs (``'prim::Loop'``, ``'aten::mm'``...): every node of
    its graph with the functions it calls inlined, loop and branch bodies included; wherever it
    runs (under the grader, read by the script host, :class:`course.remote.Scripted`). None where it
    has no graph."""
    from course.remote import Scripted

    if isinstance(obj, Scripted):
        return obj.ops
    try:
        graph = obj.inlined_graph
    except (AttributeError, RuntimeError):  # not TorchScript, or a scripted module with no forward
        return None

    def walk(block) -> list[str]:
        return [kind for node in block.nodes()
                for kind in [node.kind(), *(k for sub in node.blocks() for k in walk(sub))]]

    return walk(graph)


_COMPILE_WRAPPER = []


def _compile_wrapper_code():
    """The code object every function ``torch.compile`` returns shares (found by compiling a
    dummy: nothing is compiled until it is called)."""
    if not _COMPILE_WRAPPER:
        _COMPILE_WRAPPER.append(torch.compile(lambda x: x, backend="eager").__code__)
    return _COMPILE_WRAPPER[0]


def is_compiled(obj: Any) -> bool:
    """True for what ``torch.compile`` returns: an ``OptimizedModule``, or dynamo's own wrapper
    function around the original (its code object, not an attribute anyone could set)."""
    import types

    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(obj, OptimizedModule):
        return True
    return (isinstance(obj, types.FunctionType) and obj.__code__ is _compile_wrapper_code()
            and callable(getattr(obj, "_torchdynamo_orig_callable", None)))


def _kind(obj: Any) -> str:
    if obj is None:
        return "None"
    if type(obj).__name__ == "Described" and type(obj).__module__ == "course.remote":
        return f"a {obj.type_name}"
    if is_scripted(obj):
        return "a TorchScript function/module"
    if is_compiled(obj):
        return "a torch.compile'd function/module"
    return f"a plain {type(obj).__name__}"


def expect_scripted(obj: Any, name: str = "the object") -> None:
    if not is_scripted(obj):
        raise AssertionError(f"{name} should be what torch.jit.script returns, but it is {_kind(obj)}.\n"
                             f"  Hint: {name} = torch.jit.script(your_function)")


def expect_compiled(obj: Any, name: str = "the object") -> None:
    """``obj`` is what ``torch.compile`` returns. Under the grader's judge, ``obj`` lives in the
    learner's process, which says what it is: a claim, which the served checks back with what the
    judge measures itself (outputs on its inputs, speed by its own clock)."""
    from course.remote import is_remote

    if is_remote(obj):
        what = obj.describe()
        if not what["compiled"]:
            raise AssertionError(f"{name} should be what torch.compile returns, but it is "
                                 f"{'a TorchScript function/module' if what['scripted'] else 'a ' + what['type']}.\n"
                                 f"  Hint: {name} = torch.compile(your_function)")
        return
    if not is_compiled(obj):
        raise AssertionError(f"{name} should be what torch.compile returns, but it is {_kind(obj)}.\n"
                             f"  Hint: {name} = torch.compile(your_function)")


def graph_ops(graph: Any) -> list[str]:
    """The op names of a TorchScript graph (``'aten::mm'``...) or an FX graph/GraphModule
    (``'call_function:add'``, ``'call_module:BatchNorm2d'``...)."""
    if isinstance(graph, torch.fx.GraphModule):
        graph = graph.graph
    if isinstance(graph, torch.fx.Graph):
        mods = dict(graph.owning_module.named_modules()) if graph.owning_module is not None else {}
        out = []
        for n in graph.nodes:
            if n.op == "call_module":
                out.append(f"call_module:{type(mods[n.target]).__name__}" if n.target in mods else f"call_module:{n.target}")
            elif n.op in ("call_function", "call_method"):
                out.append(f"{n.op}:{getattr(n.target, '__name__', n.target)}")
            else:
                out.append(n.op)
        return out
    if hasattr(graph, "nodes"):
        return [n.kind() for n in graph.nodes()]
    raise TypeError(f"graph_ops takes a TorchScript graph or an FX Graph/GraphModule, got {type(graph).__name__}.")


def expect_ops_absent(graph: Any, ops: Iterable[str], what: str = "the graph") -> None:
    found = [o for o in graph_ops(graph) if any(o == op or o.endswith(":" + op) for op in ops)]
    if found:
        raise AssertionError(f"{what} still contains {sorted(set(found))} ({len(found)} node(s)); "
                             f"expected none of {sorted(ops)}.")


def count_ops(fn: Callable[[], Any]) -> int:
    """How many ATen ops ``fn()`` runs, counted below autograd and ``torch.func`` (a
    ``TorchDispatchMode``): under ``vmap`` a batched op counts once, in a loop every call counts."""
    from course.jacobians import TensorWatch

    with observing_paused(), TensorWatch() as watch:
        fn()
    return watch.ops


def expect_constant_work(prepare: Callable[[int], Callable[[], Any]], small: int, large: int, *, what: str,
                         unit: str) -> tuple[int, int]:
    """``prepare(n)`` makes the inputs for ``n`` items and returns the call to measure. Assert that
    the call runs (nearly) as many ATen ops for ``large`` as for ``small`` items: the
    behaviour of one batched computation, which a Python loop over the items cannot imitate (its
    op count grows with the number of items), however the loop is dressed (a token ``vmap`` call
    beside it, a copy of the model, a different function under the transform)."""
    few, many = count_ops(prepare(small)), count_ops(prepare(large))
    if many > few * (1 + 0.5 * (large - small) / small) or many > few + 4 * (large - small):
        raise AssertionError(
            f"{what} ran {few} ops for {small} {unit}s and {many} for {large}: the work grows with the number of "
            f"{unit}s, as a Python loop over them does.\n  Hint: one vmap over all the {unit}s runs the same ops "
            "whatever their number; no loop inside or around it.")
    return few, many

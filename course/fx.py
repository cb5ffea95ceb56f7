"""Lesson 2's shared pieces: look at an FX graph, show a node profile, pin the thread count, and
read the code Inductor generated, and put the profiler's view beside the interpreter's.

None of these is an exercise: they print and plot what the learner's code produces, so the
notebook stays short. ``torch.fx.Graph.print_tabular`` needs the ``tabulate`` package, which the
course does not install; ``show_graph`` prints the same facts without it.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter, defaultdict
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
from torch import fx

from course.devices import threads  # noqa: F401  (re-exported as course.fx.threads)

__all__ = ["ATEN_OP_TYPES", "InductorCode", "capture_inductor_code", "plot_profile", "print_profile", "profiler_shares",
           "show_graph", "threads"]


def _short(value: Any, width: int = 34) -> str:
    text = str(value)
    text = re.sub(r"<built-in (?:method|function) (\w+)[^>]*>", r"\1", text)
    text = re.sub(r"<function (\w+) at 0x[0-9a-f]+>", r"\1", text)
    return text if len(text) <= width else text[: width - 3] + "..."


def show_graph(gm: fx.GraphModule | fx.Graph, limit: int | None = None) -> None:
    """Print one line per node: op, name, target, args and how many nodes use its output."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    if not isinstance(graph, fx.Graph):
        raise TypeError(f"show_graph takes a GraphModule or a Graph, got {type(gm).__name__}. "
                        "Try: show_graph(torch.fx.symbolic_trace(model)).")
    nodes = list(graph.nodes)
    print(f"{'op':<14}{'name':<24}{'target':<24}{'args':<36}users")
    print("-" * 102)
    for n in nodes[:limit]:
        print(f"{n.op:<14}{_short(n.name, 23):<24}{_short(n.target, 23):<24}{_short(n.args):<36}{len(n.users)}")
    if limit is not None and len(nodes) > limit:
        print(f"... {len(nodes) - limit} more nodes")


def _check_rows(rows: Sequence[Sequence[Any]]) -> list[tuple[str, str, float, float]]:
    try:
        return [(str(op), str(name), float(mean), float(share)) for op, name, mean, share in rows]
    except (TypeError, ValueError):
        raise TypeError("A profile is a list of rows (op type, node name, mean seconds, share of the "
                        "total), as ProfilingInterpreter.rows() returns.") from None


def print_profile(rows: Sequence[Sequence[Any]], top: int | None = 15) -> None:
    """Print a profile's rows (already sorted, slowest first) as a table, then the total."""
    rows = _check_rows(rows)
    print(f"{'op type':<20}{'node':<28}{'mean':>11}{'share':>9}")
    print("-" * 68)
    for op, name, mean, share in rows[:top]:
        print(f"{op[:19]:<20}{name[:27]:<28}{mean * 1e6:>8.1f} us{share:>9.1%}")
    if top is not None and len(rows) > top:
        rest = rows[top:]
        print(f"{f'... {len(rest)} more nodes':<48}{sum(r[2] for r in rest) * 1e6:>8.1f} us"
              f"{sum(r[3] for r in rest):>9.1%}")
    print(f"{'total':<48}{sum(r[2] for r in rows) * 1e6:>8.1f} us{sum(r[3] for r in rows):>9.1%}")


def plot_profile(rows: Sequence[Sequence[Any]], ax=None, title: str | None = None):
    """A horizontal bar chart of the shares summed by op type (Conv2d, BatchNorm2d, relu...)."""
    import matplotlib.pyplot as plt

    by_op: dict[str, float] = defaultdict(float)
    count: Counter = Counter()
    for op, _, _, share in _check_rows(rows):
        by_op[op] += share
        count[op] += 1
    ops = sorted(by_op, key=by_op.get)
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 0.35 * len(ops) + 1.2))
    bars = ax.barh([f"{op} (x{count[op]})" for op in ops], [100 * by_op[op] for op in ops], color="#1f77b4")
    for bar, op in zip(bars, ops):
        ax.annotate(f"{100 * by_op[op]:.1f}%", (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                    va="center", xytext=(3, 0), textcoords="offset points")
    ax.set_xlabel("share of the time spent in nodes (%)")
    ax.set_title(title or "Where the time goes, by op type")
    ax.margins(x=0.15)
    return ax


#: The top-level ATen op of each module type or function in the lesson's models (what
#: ``torch.profiler`` sees), named as :func:`op_type` names the nodes, in lower case (a ``ReLU``
#: module and ``torch.relu`` both run ``aten::relu``).
ATEN_OP_TYPES = {"aten::conv2d": "conv2d", "aten::batch_norm": "batchnorm2d", "aten::relu": "relu",
                 "aten::relu_": "relu", "aten::add": "add", "aten::add_": "add", "aten::mean": "mean",
                 "aten::linear": "linear", "aten::max_pool2d": "maxpool2d", "aten::flatten": "flatten",
                 "aten::adaptive_avg_pool2d": "adaptive_avg_pool2d", "aten::sigmoid": "sigmoid", "aten::mul": "mul"}


def profiler_shares(model: Callable, *args: Any, runs: int = 10) -> tuple[dict[str, float], float]:
    """``torch.profiler``'s view of ``model(*args)`` over ``runs`` calls: ``({op type in lower case:
    share of the time of the top-level ops}, seconds per call of those ops)``. Top-level only (an op's children,
    such as the ``aten::mkldnn_convolution`` inside ``aten::conv2d``, are inside its time), named by
    :data:`ATEN_OP_TYPES`, anything else as ``"other"``."""
    from torch.profiler import ProfilerActivity, profile

    from course.quiet import quiet_kineto

    quiet_kineto()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(runs):
            model(*args)
    totals: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.cpu_parent is None and e.name.startswith("aten::"):
            totals[ATEN_OP_TYPES.get(e.name, "other")] += e.cpu_time_total
    whole = sum(totals.values()) or 1.0
    return {k: v / whole for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}, whole / runs / 1e6


class InductorCode(NamedTuple):
    """What Inductor wrote while a call ran: its source, and the calls it makes, counted."""

    code: str
    generated: list[str]     # kernels Inductor generated (C++ on a CPU, Triton on a GPU)
    library: list[str]       # calls into vendor libraries (convolutions, matrix products)

    @property
    def mentions_batch_norm(self) -> int:
        return self.code.count("batch_norm")

    def __str__(self) -> str:
        if not self.code:
            return "no code was generated during this call (nothing compiled: was it compiled before?)"
        lines = [f"{len(self.generated)} generated kernel(s), {len(self.library)} library call(s); "
                 f"'batch_norm' appears {self.mentions_batch_norm} time(s) in the code"]
        lines += [f"  library:   {k} x{n}" for k, n in Counter(self.library).most_common()]
        lines += [f"  generated: {k}" for k in self.generated]
        return "\n".join(lines)


def capture_inductor_code(fn: Callable, *args: Any, **kwargs: Any) -> tuple[Any, InductorCode]:
    """Call ``fn(*args, **kwargs)`` and return its result with the code Inductor generated during
    the call (empty when nothing was compiled). Wraps ``torch._inductor.utils.run_and_get_code``."""
    from torch._inductor.utils import run_and_get_code

    result, codes = run_and_get_code(fn, *args, **kwargs)
    code = "\n".join(codes)
    generated = list(dict.fromkeys(re.findall(r"\b((?:cpp|triton)_\w*fused\w*)\(", code)))
    library = re.findall(r"\b(extern_kernels\.\w+|torch\.ops\.(?:mkldnn|mkl|aten)\.[\w.]+)\(", code)
    return result, InductorCode(code, generated, library)

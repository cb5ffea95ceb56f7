"""Checks for lesson 02_fx_transforms. Models come from ``course.models.small_resnet`` (seeded,
BatchNorm statistics randomised) and inputs from the check's ``seed``, so the learner never
chooses them. Numerics are compared in float64 where the algebra is checked, and in float32
with a tolerance relative to the output's scale where the speed matters.

Under the grader every check here runs in the judge (``SERVED``). Models cross as recipes
(``small_resnet``, with ``train_bn`` for a BatchNorm left in training mode), so the learner's
process traces the same graph, with the same node names, as the judge. What the learner's code
does to a graph runs there as the course's probes (:func:`course.remote.probe`), which send back
data: ``op_type``'s answer per node name, ``conv_bn_pairs``'s pairs as module paths, the profiler's
output and rows, what Inductor generated and the compiled outputs. A fused graph comes back as a
description (:mod:`course.graph_wire`: nodes, tensor operations and ``torch.nn`` layers from short
lists, the learner's weights) and is rebuilt in the judge, which looks for BatchNorms left, runs it
against its own model and times it against the original, all in its own process. The profiler's
planted slow node is the judge's (:class:`Sleeper`, lent): how long it slept is the judge's to know,
and the learner's rows must find it. Facts only the learner's process can see (the graph was left
unchanged, the profile's other rows, what Inductor generated) are that process's word.

What a check compares with is the grader's (:mod:`course.references.fx`: which pairs are legal, the
folds and what each slip folds instead), reached through :func:`_answer`; a learner's copy of the
course has the same answers for the lesson's own visible calls only (``course/reference_data/02_fx.pt``)."""

from __future__ import annotations

import operator
import random
import time
from collections import Counter
from typing import Any, Callable, Mapping

import torch
from torch import fx, nn

from course import graph_wire
from course.checks.common import call, grader_references, name_mistake, ok, record, stored_answers
from course.checks.library import LibraryCalls
from course.data import generator, randn
from course.devices import pick_device
from course.devices import threads
from course.fx import capture_inductor_code
from course.grading import expect_compiled, expect_speedup, graph_ops, speed_bar
from course.models import exported_resnet, small_resnet
from course.numerics import assert_close, describe
from course.remote import lend, probe, prober
from course.timing import SpeedReport, compare, machine_to_itself, waited_for_cpu

#: Checks the grader runs in its judge process, calling the learner's code across the boundary.
SERVED = ("check_op_type", "check_conv_bn_pairs", "check_fold_conv_bn", "check_fuse", "check_profiler",
          "check_compile_frozen", "check_fold_affine", "check_fusion_speed")

__all__ = ["check_compile_frozen", "check_conv_bn_pairs", "check_fold_affine", "check_fold_conv_bn", "check_fuse",
           "check_fusion_speed", "check_op_type", "check_profiler", "compile_frozen_case", "conv_bn_pairs_case",
           "fuse_case", "op_type_cases", "profiler_case"]

F64 = torch.float64
FOLD_HINT = ("scale = gamma / sqrt(var + eps) has one value per output channel: multiply the weight "
             "of output channel k (w[k], shape (C_in, kH, kW)) by scale[k], e.g. w * scale.reshape(-1, 1, 1, 1); "
             "b' = (b - mean) * scale + beta, with b = 0 when the conv has no bias.")


# ---------------------------------------------------------------- the grader's answers

#: What a learner's copy compares the visible calls with (``python -m course.references`` writes it).
DATA_FILE = "02_fx.pt"


def case_key(kind: str, args: Mapping[str, Any]) -> str:
    """How an answer is stored: its kind and the check's arguments, e.g.
    ``"op_types(blocks=(1, 1), seed=0, width=8)"``."""
    norm = {k: tuple(v) if isinstance(v, list) else v for k, v in args.items()}
    return f"{kind}({', '.join(f'{k}={norm[k]!r}' for k in sorted(norm))})"


def _answer(kind: str, **args: Any) -> Any:
    """The grader's answer of kind ``kind`` for a check's arguments
    (:func:`course.references.fx.answer`); in a learner's copy, where the grader's references are
    not, the answer stored for the lesson's own call, and a refusal for other arguments."""
    refs = grader_references("fx")
    if refs is not None:
        return refs.answer(kind, **args)
    key = case_key(kind, args)
    data = stored_answers(DATA_FILE)
    if key not in data:
        raise AssertionError(f"This check has reference data for the lesson's own calls only; the grader checks "
                             f"others (asked for {key}).")
    return data[key]


def bn_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The BatchNorm module nodes of ``gm``, in graph order."""
    return [n for n in gm.graph.nodes if n.op == "call_module"
            and isinstance(gm.get_submodule(n.target), nn.modules.batchnorm._BatchNorm)]


def conv_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The Conv2d module nodes of ``gm``, in graph order."""
    return [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Conv2d)]


# ---------------------------------------------------------------- helpers

def _traced(seed: int, width: int, blocks, tap: bool = True, train_bn: str | None = None,
            dtype=torch.float32, device=None) -> tuple[nn.Module, fx.GraphModule]:
    model = small_resnet(seed=seed, width=width, blocks=tuple(blocks), tap=tap, dtype=dtype, device=device,
                         train_bn=train_bn)
    return model, fx.symbolic_trace(model)


def _scaled_tol(ref: torch.Tensor, rel: float) -> float:
    return rel * max(float(ref.detach().abs().max()), 1e-12)


def _expect_graph_module(obj: Any, label: str) -> fx.GraphModule:
    if not isinstance(obj, fx.GraphModule):
        raise AssertionError(f"{label} should return a torch.fx.GraphModule, but it returned {describe(obj)}.\n"
                             "  Hint: trace a copy with torch.fx.symbolic_trace, edit gm.graph, call "
                             "gm.recompile(), and return gm.")
    return obj


# ---------------------------------------------------------------- exercise checks

@prober
def op_type_cases(op_type: Callable, model: nn.Module) -> list[tuple[str, Any]]:
    """The learner's side of :func:`check_op_type`: ``op_type(gm, node)`` for every node of the
    traced model, by node name."""
    gm = fx.symbolic_trace(model)
    return [(node.name, call(op_type, gm, node, name="op_type")) for node in gm.graph.nodes]


def check_op_type(op_type: Callable, *, seed: int = 0, width: int = 8, blocks=(1, 1)) -> None:
    """``op_type(gm, node)`` names what a node computes: the module's class for ``call_module``,
    the function's ``__name__`` for ``call_function``, the method's name for ``call_method``, and
    the op itself (``'placeholder'``, ``'output'``, ``'get_attr'``) for the rest."""
    model, gm = _traced(seed, width, blocks, tap=True)
    answers = probe(op_type, op_type_cases, model)
    if not (isinstance(answers, list) and all(isinstance(a, tuple) and len(a) == 2 for a in answers)):
        raise AssertionError("op_type: the answers came back malformed.")
    by_name = dict(answers)
    expected = dict(_answer("op_types", seed=seed, width=width, blocks=blocks))
    seen, gots, wants = set(), [], []
    for node in gm.graph.nodes:
        want = expected[node.name]
        got = by_name.get(node.name)
        gots.append(got)
        wants.append(want)
        if got != want:
            raise AssertionError(
                f"op_type(gm, node) for node {node.name!r} (op {node.op!r}, target {node.target!r}) "
                f"returned {got!r}; expected {want!r}.\n"
                "  Hint: call_module -> type(gm.get_submodule(node.target)).__name__; call_function -> "
                "node.target.__name__; call_method -> node.target (already a string); otherwise node.op.")
        seen.add(node.op)
    record(gots, wants, "op_type of every node")
    ok(f"op_type names all {len(gm.graph.nodes)} nodes right (ops {sorted(seen)}; seed {seed})")


@prober
def conv_bn_pairs_case(conv_bn_pairs: Callable, model: nn.Module) -> tuple[list[tuple[str, str]], bool]:
    """The learner's side of :func:`check_conv_bn_pairs`: the pairs it finds in the traced model,
    as (conv target, BatchNorm target), and whether the graph changed while it looked."""
    gm = fx.symbolic_trace(model)
    before = str(gm.graph)
    with LibraryCalls("conv_bn_pairs", hint=PAIRS_HINT):
        got = call(conv_bn_pairs, gm, name="conv_bn_pairs")
    if not isinstance(got, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in got):
        raise AssertionError(f"conv_bn_pairs should return a list of (conv_node, bn_node) pairs, got {describe(got)}.")
    for pair in got:
        if not all(isinstance(n, fx.Node) and n.graph is gm.graph for n in pair):
            raise AssertionError(f"conv_bn_pairs returned {pair!r}: each pair must hold two fx.Node of the "
                                 "graph it was given (not module names or modules).")
    return [(str(c.target), str(b.target)) for c, b in got], str(gm.graph) != before


def check_conv_bn_pairs(conv_bn_pairs: Callable, *, seed: int = 0, width: int = 8, blocks=(1, 1),
                        train_bn: str | None = None) -> None:
    """``conv_bn_pairs(gm)`` lists exactly the legal (conv node, BatchNorm node) pairs of a traced
    model, in graph order: a Conv2d module node feeding an eval-mode BatchNorm module node as its
    only input, with no other user of the conv's output. ``train_bn`` puts one BatchNorm in
    training mode."""
    model, _ = _traced(seed, width, blocks, tap=True, train_bn=train_bn)
    reply = probe(conv_bn_pairs, conv_bn_pairs_case, model)
    if not (isinstance(reply, tuple) and len(reply) == 2 and isinstance(reply[0], list) and type(reply[1]) is bool
            and all(isinstance(p, tuple) and len(p) == 2 and all(isinstance(t, str) for t in p) for p in reply[0])):
        raise AssertionError("conv_bn_pairs: the answer came back malformed.")
    got, changed = reply
    got_set = set(got)
    legality = _answer("conv_bn_legality", seed=seed, width=width, blocks=blocks, train_bn=train_bn)
    want, reasons = set(legality["pairs"]), legality["reasons"]
    extra = sorted(got_set - want)
    if extra:
        why = "; ".join(f"{c} -> {b}: " + (reasons[b] or "not a conv feeding that BatchNorm")
                        if b in reasons else f"{c} -> {b}: not a BatchNorm node" for c, b in extra)
        raise AssertionError(f"conv_bn_pairs lists pairs that must not be fused: {why}.\n"
                             "  Hint: check bn.training, that the BN's only argument is a Conv2d call_module "
                             "node, and len(conv_node.users) == 1.")
    missing = sorted(want - got_set)
    if missing:
        raise AssertionError(f"conv_bn_pairs misses {len(missing)} legal pair(s) of {len(want)}: {missing}.\n"
                             "  Hint: conv/BN pairs hide inside nn.Sequential (stem.0 -> stem.1) and inside "
                             "wrapper modules (stages.0.first.conv -> stages.0.first.bn); walk gm.graph.nodes, "
                             "not the module tree.")
    if len(got) != len(got_set):
        raise AssertionError("conv_bn_pairs lists a pair more than once.")
    if changed:
        raise AssertionError("conv_bn_pairs changed the graph: it should only look.")
    record(sorted([list(p) for p in got_set]), sorted([list(p) for p in want]), "conv_bn_pairs (conv, bn) targets")
    left = len(reasons) - len(want)
    ok(f"conv_bn_pairs finds all {len(want)} legal pairs and leaves the other {left} BatchNorm(s) alone "
       f"(seed {seed}{', ' + train_bn + ' in training mode' if train_bn else ''})")


def fold_case(*, seed: int, c_in: int, c_out: int, kernel: int, bias: bool, eps: float, groups: int) -> tuple:
    """:func:`check_fold_conv_bn`'s arguments of ``fold_conv_bn``, drawn from ``seed`` in float64 on
    the CPU: ``(w, b or None, mean, var, gamma, beta, eps)``."""
    g = generator(seed)

    def r(*shape, lo=-1.0, hi=1.0):
        return torch.rand(*shape, generator=g, dtype=F64) * (hi - lo) + lo

    w = r(c_out, c_in // groups, kernel, kernel)
    b = r(c_out) if bias else None
    mean, var = r(c_out, lo=-0.5, hi=0.5), r(c_out, lo=0.3, hi=2.0)
    gamma, beta = r(c_out, lo=0.5, hi=1.5), r(c_out, lo=-0.5, hi=0.5)
    return w, b, mean, var, gamma, beta, eps


#: What the fusion exercises are written with, when an answer reached for PyTorch's own fuser.
PAIRS_HINT = ("walk gm.graph.nodes: a call_module node whose module is a BatchNorm2d in eval mode, whose only "
              "argument is a call_module Conv2d node with no other user.")
FUSE_HINT = ("trace the model (torch.fx.symbolic_trace), fold each pair conv_bn_pairs finds with your "
             "fold_conv_bn into a copy of the conv, and erase the BatchNorm node.")


@prober
def fold_conv_bn_case(fold_conv_bn: Callable, *args: Any) -> tuple[Any, list[str]]:
    """The learner's side of :func:`check_fold_conv_bn`: ``fold_conv_bn(*args)`` with PyTorch's own
    folding refused, and which of its inputs it changed in place."""
    copies = [None if t is None else t.clone() for t in args[:6]]
    with LibraryCalls("fold_conv_bn", hint=FOLD_HINT):
        got = call(fold_conv_bn, *args, name="fold_conv_bn")
    names = ("w", "b", "mean", "var", "gamma", "beta")
    return got, [n for t, c, n in zip(args[:6], copies, names) if t is not None and not torch.equal(t, c)]


def check_fold_conv_bn(fold_conv_bn: Callable, *, seed: int = 0, c_in: int = 3, c_out: int = 5, kernel: int = 3,
                       bias: bool = True, eps: float = 1e-5, groups: int = 1) -> None:
    """``fold_conv_bn(w, b, mean, var, gamma, beta, eps) -> (w', b')`` in float64: equal to the
    folding formula, and conv(x, w', b') equals BatchNorm(conv(x, w, b)) on a random input."""
    args = fold_case(seed=seed, c_in=c_in, c_out=c_out, kernel=kernel, bias=bias, eps=eps, groups=groups)
    w, b, mean, var, gamma, beta, _ = args
    got, changed = probe(fold_conv_bn, fold_conv_bn_case, *args)
    if changed:
        raise AssertionError(f"fold_conv_bn changed its input {changed[0]} in place; return new tensors instead "
                             "(the conv and BN of the original model must stay as they were).")
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise AssertionError(f"fold_conv_bn should return a pair (w', b'), got {describe(got)}.")
    if got[1] is None:
        raise AssertionError("fold_conv_bn returned b' = None. The fused conv always needs a bias: "
                             "with no conv bias, b' = (0 - mean) * scale + beta.")
    answers = _answer("fold_conv_bn", seed=seed, c_in=c_in, c_out=c_out, kernel=kernel, bias=bias, eps=eps,
                      groups=groups)
    want = answers["want"]
    label = f"fold_conv_bn(...) [conv {'with' if bias else 'without'} bias, eps={eps:g}]"
    name_mistake(label, tuple(got), want, answers["variants"])
    assert_close(tuple(got), want, name=label + " -> (w', b')", hint=FOLD_HINT)
    x = randn(2, c_in, 7, 6, seed=seed + 1, dtype=F64, device="cpu")  # where the weights above are
    pad = kernel // 2
    ref = nn.functional.batch_norm(nn.functional.conv2d(x, w, b, padding=pad, groups=groups), mean, var,
                                   gamma, beta, training=False, eps=eps)
    assert_close(nn.functional.conv2d(x, got[0], got[1], padding=pad, groups=groups), ref,
                 name=label + ": conv with (w', b') vs BatchNorm(conv(x))", hint=FOLD_HINT)
    ok(f"fold_conv_bn: conv with the folded weights equals BatchNorm(conv) in float64 "
       f"({c_out}x{c_in // groups}x{kernel}x{kernel}, {'with' if bias else 'no'} bias, eps={eps:g}, seed {seed})")


#: Ops that are one op however a graph calls them: a module, its function, an ATen overload.
_SAME_OP = {"conv2d": "conv", "batchnorm2d": "batch norm", "batch_norm": "batch norm",
            "_native_batch_norm_legit_no_training": "batch norm", "native_batch_norm": "batch norm"}


def op_kinds(gm: fx.GraphModule) -> Counter:
    """How many times ``gm`` runs each kind of op (:func:`course.grading.graph_ops`' names): a module by
    its type, a function or method by its name (``torch.add``, ``operator.add``, ``Tensor.add`` and
    ``aten.add.Tensor`` are all ``add``; a ``Conv2d`` module and ``F.conv2d`` are both ``conv``, a
    ``BatchNorm2d`` and ``F.batch_norm`` both ``batch norm``)."""
    return Counter(_kind(op.split(":", 1)[1]) for op in graph_ops(gm) if ":" in op)


def _kind(name: str) -> str:
    name = str(name).split(".")[0].lower()
    return _SAME_OP.get(name, name)


def _only_removed(got: fx.GraphModule, was: fx.GraphModule, removed: Counter, label: str, what: str) -> None:
    """``got`` runs exactly the ops of ``was`` less ``removed`` (by :func:`op_kinds`): a fold takes
    nodes away and adds none, and every other node stays (red team, round 18: a BatchNorm written as
    ``F.batch_norm`` passed as fused, and an op merged elsewhere paid for a chain left as a BatchNorm)."""
    want, have = op_kinds(was) - removed, op_kinds(got)
    if have != want:
        more = ", ".join(f"{k} x{c}" for k, c in sorted((have - want).items())) or "nothing"
        fewer = ", ".join(f"{k} x{c}" for k, c in sorted((want - have).items())) or "nothing"
        raise AssertionError(f"{label}: besides {what}, the graph changed: it runs more of {more}, and less of "
                             f"{fewer}, than the model's graph would. A fold puts the numbers into the conv's "
                             "weight and bias and removes nodes; it adds none (a BatchNorm written as a function, "
                             "a multiply and an add on constants are not folds), and leaves every other node as "
                             "it was.")


def _check_fused_graph(fused: fx.GraphModule, legality: Mapping[str, Any], label: str,
                       original: fx.GraphModule | None = None) -> tuple[int, int]:
    """The BatchNorms left in ``fused`` against ``legality`` (the grader's ``conv_bn_legality``
    answer for the model it came from): every legal one gone, every other one kept; with
    ``original`` (the model's graph), every other op left as it was (:func:`_only_removed`)."""
    left = {str(n.target) for n in bn_nodes(fused)}
    reasons = legality["reasons"]
    legal = {bn for _, bn in legality["pairs"]}
    must_stay = set(reasons) - legal
    wrongly_left = sorted(left & legal)
    if wrongly_left:
        raise AssertionError(f"{label}: BatchNorm node(s) {wrongly_left} are still in the graph, though fusing "
                             "them was legal.\n  Hint: after folding, bn_node.replace_all_uses_with(conv_node), "
                             "gm.graph.erase_node(bn_node), and gm.recompile() at the end.")
    removed = sorted(must_stay - left)
    if removed:
        why = "; ".join(f"{t}: {reasons[t]}" for t in removed)
        raise AssertionError(f"{label}: BatchNorm node(s) were removed that had to stay: {why}.\n"
                             "  Hint: fuse only the pairs conv_bn_pairs returns.")
    if original is not None:
        _only_removed(fused, original, Counter({"batch norm": len(legal)}), label, "the legal BatchNorms folded")
    return len(legal), len(must_stay)


@prober
def fuse_case(fuse: Callable, model: nn.Module, name: str = "fuse") -> dict:
    """The learner's side of :func:`check_fuse`, :func:`check_fold_affine` and
    :func:`check_fusion_speed`: ``fuse(model)`` (``name``: the learner's function, for messages),
    checked to be a new GraphModule that left the model alone, sent back as a description
    (:func:`course.graph_wire.describe`)."""
    name = str(name)[:40]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with LibraryCalls(name, hint=FUSE_HINT):
        fused = _expect_graph_module(call(fuse, model, name=name), f"{name}(model)")
    changed = [k for k, v in model.state_dict().items() if k not in state or not torch.equal(v, state[k])]
    if changed or len(state) != len(model.state_dict()):
        raise AssertionError(f"{name} changed the original model ({', '.join(changed[:4]) or 'its modules'}). "
                             "Work on a copy: copy.deepcopy(model) first.")
    if fused is model:
        raise AssertionError(f"{name} returned the model it was given; return a new GraphModule.")
    try:
        return graph_wire.describe(fused)
    except graph_wire.GraphError as exc:
        raise AssertionError(f"{name}(model) returned a graph the grader cannot rebuild: {exc}.") from None


def _fused(fuse: Callable, model: nn.Module, device, name: str = "fuse") -> fx.GraphModule:
    """What ``fuse(model)`` made, rebuilt here from its description: the graph the checks judge."""
    desc = probe(fuse, fuse_case, model, name)
    try:
        return graph_wire.rebuild(desc, device)
    except graph_wire.GraphError as exc:
        raise AssertionError(f"{name}(model) returned a graph the grader cannot rebuild: {exc}.") from None


#: The BatchNorm :func:`check_fuse` puts in training mode: its conv must keep it.
FUSE_TRAIN_BN = "stages.0.second.bn"


def check_fuse(fuse: Callable, *, seed: int = 0, width: int = 8, blocks=(1, 1), batch: int = 2,
               image: int = 16, device=None) -> None:
    """``fuse(model) -> GraphModule``: BatchNorm folded into every legal conv, nothing else
    changed, the original model untouched; equal to the model in eval mode (float64 to 1e-10 of
    the output's scale, float32 to 1e-5), on inputs drawn from ``seed``."""
    dev = pick_device(device)
    hint = "fold with fold_conv_bn into a copy of the conv; keep the conv's stride, padding and groups."
    legality = _answer("conv_bn_legality", seed=seed, width=width, blocks=blocks, train_bn=None)
    with torch.no_grad():
        for dtype, rel in ((F64, 1e-10), (torch.float32, 1e-5)):
            model, graph = _traced(seed, width, blocks, tap=True, dtype=dtype, device=dev)
            fused = _fused(fuse, model, dev)
            legal, kept = _check_fused_graph(fused, legality, "fuse(model)", graph)
            for s in (seed + 11, seed + 12):
                x = randn(batch, 3, image, image, seed=s, device=dev, dtype=dtype)
                ref = model(x)
                assert_close(fused(x), ref, atol=_scaled_tol(ref, rel), rtol=0,
                             name=f"fuse(model)(x) vs model(x) in {str(dtype).replace('torch.', '')}", hint=hint)
        # a BatchNorm in training mode must stay
        model, graph = _traced(seed, width, blocks, tap=True, train_bn=FUSE_TRAIN_BN, device=dev)
        fused = _fused(fuse, model, dev)
        _check_fused_graph(fused, _answer("conv_bn_legality", seed=seed, width=width, blocks=blocks,
                                          train_bn=FUSE_TRAIN_BN),
                           f"fuse(model) with {FUSE_TRAIN_BN} in training mode", graph)
    ok(f"fuse folds all {legal} legal BatchNorms, keeps the {kept} that must stay (and one in training mode), "
       f"and equals the model in float64 and float32 (width {width}, blocks {tuple(blocks)}, seed {seed})")


# ---------------------------------------------------------------- Exercise 6: the exported model

ELEMENTWISE = {operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/",
               torch.add: "+", torch.sub: "-", torch.mul: "*", torch.div: "/"}
ELEMENTWISE_METHODS = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
AFFINE_HINT = ("follow each conv's output through its chain of elementwise ops on constants and keep one "
               "affine map per output channel, y = a * conv(x) + b, starting from a = 1, b = 0: `- c` gives "
               "b - c; `* c` (either order) gives a * c and b * c; `+ c` gives b + c. Then w' = w * "
               "a.reshape(-1, 1, 1, 1) and b' = bias * a + b (bias = 0 when the conv has none).")


def constant_ops(gm: fx.GraphModule) -> list[tuple[fx.Node, str]]:
    """Every elementwise node (``+ - * /``, as an operator, a torch function or a method) with an
    operand read by a ``get_attr`` node, with that constant's name."""
    out = []
    for n in gm.graph.nodes:
        if not ((n.op == "call_function" and n.target in ELEMENTWISE)
                or (n.op == "call_method" and n.target in ELEMENTWISE_METHODS)):
            continue
        consts = [a.target for a in n.args if isinstance(a, fx.Node) and a.op == "get_attr"]
        if consts:
            out.append((n, str(consts[0])))
    return out


def _calls(gm: fx.GraphModule) -> int:
    """How many ops ``gm`` runs: its call nodes."""
    return sum(n.op in ("call_function", "call_method", "call_module") for n in gm.graph.nodes)


def _check_folded_graph(folded: fx.GraphModule, exported: fx.GraphModule, chains: Mapping[str, Any],
                        label: str) -> tuple[int, int]:
    """What is left of ``exported``'s chains in ``folded``, against ``chains`` (the grader's
    ``affine_chains`` answer: ``{"fold": {constant: conv}, "stay": {constant: conv}}``)."""
    fold, stay = chains["fold"], chains["stay"]
    left_ops = constant_ops(folded)
    left = {c for _, c in left_ops}
    wrongly_left = sorted({fold[c] for c in left & set(fold)})
    if wrongly_left:
        raise AssertionError(f"{label}: the elementwise ops after conv(s) {wrongly_left} are still in the graph, "
                             "though folding them was legal.\n  Hint: after folding a chain, point its last node's "
                             "users at the conv (last.replace_all_uses_with(conv_node)), erase the chain's nodes, "
                             "last first, and call gm.recompile().")
    expected = sum(1 for _, c in constant_ops(exported) if c in stay)
    if len(left_ops) > expected:
        raise AssertionError(f"{label}: {len(left_ops)} elementwise op(s) on constants are left in the graph; the "
                             f"chains that must stay have {expected}. A folded chain leaves no op behind, and a "
                             "constant copied under another name is still a constant.")
    runs = _calls(folded)
    leaves = _calls(exported) - sum(1 for _, c in constant_ops(exported) if c in fold)
    if runs > leaves:
        raise AssertionError(f"{label}: the graph runs {runs} ops, and folding every legal chain leaves {leaves}. "
                             "A folded chain becomes the conv's new weight and bias, not another op (a BatchNorm, "
                             "a 1x1 conv, a function on the constants).")
    removed = sorted({stay[c] for c in set(stay) - left})
    if removed and len(left_ops) < expected:
        raise AssertionError(f"{label}: the chain after {removed} was folded, but it had to stay: that conv's "
                             "output has another user, which would then see the folded values.\n  Hint: fold only "
                             "when the conv's output, and every node of the chain, has exactly one user.")
    chain_ops = Counter(_kind(getattr(n.target, "__name__", n.target)) for n, c in constant_ops(exported) if c in fold)
    _only_removed(folded, exported, chain_ops, label, "the legal chains folded")
    return len(set(fold.values())), len(set(stay.values()))


#: Plausible slips in folding a chain, with what each computes differently (see
#: :func:`course.references.fx.affine_fold`).
AFFINE_SLIPS = {
    "sub_as_add": "a `- c` was folded as `+ c`: x - c shifts b to b - c",
    "shift_unscaled": "a `* c` scaled a but not b: a multiply after a shift scales the shift too (b * c)",
    "bias_dropped": "the conv's own bias was left out: b' = bias * a + b",
    "bias_unscaled": "the conv's own bias was not scaled: b' = bias * a + b, not bias + b",
    "weight_unscaled": "the conv's weight was not scaled: w' = w * a.reshape(-1, 1, 1, 1)",
}


def _diagnose_fold(folded: fx.GraphModule, exported: fx.GraphModule, folds: list, label: str) -> None:
    """Compares each folded conv with its fold in float64 (``folds``: the grader's ``affine_folds``
    answer, one entry per conv of ``exported`` in graph order; convs matched in graph order, when the
    folded graph calls Conv2d modules as the exported one does) and raises, naming the conv and the
    slip, for the first one that equals a slip's result; silent when it cannot tell."""
    mine, theirs = conv_nodes(exported), conv_nodes(folded)
    if not len(mine) == len(theirs) == len(folds):
        return
    for ref_node, node, answer in zip(mine, theirs, folds):
        got = folded.get_submodule(node.target)
        if answer is None or got.weight.shape != answer["right"][0].shape:
            continue
        got_w = got.weight.detach().double().cpu()
        got_b = got.bias.detach().double().cpu() if got.bias is not None else torch.zeros_like(got_w[:, 0, 0, 0])

        def same(pair):
            return (torch.allclose(got_w, pair[0], rtol=1e-6, atol=1e-9)
                    and torch.allclose(got_b, pair[1], rtol=1e-6, atol=1e-9))

        if same(answer["right"]):
            continue
        for slip, why in AFFINE_SLIPS.items():
            if same(answer["slips"][slip]):
                raise AssertionError(f"{label}: the conv folded from {ref_node.target!r} does not match its chain: "
                                     f"{why}.\n  Hint: {AFFINE_HINT}")
        return


def check_fold_affine(fold_affine: Callable, *, seed: int = 0, width: int = 8, blocks=(1, 1), batch: int = 2,
                      image: int = 16, device=None) -> None:
    """``fold_affine(gm) -> GraphModule``: every chain of per-channel elementwise ops after a conv
    in an exported model (:func:`course.models.exported_resnet`, with a tap: one conv whose output
    has another user) folded into the conv, the tap's chain kept, the given graph untouched;
    equal to the exported model in float64 (to 1e-10 of the output's scale) and float32 (1e-5),
    on inputs drawn from ``seed``."""
    dev = pick_device(device)
    answers = _answer("affine_chains", seed=seed, width=width, blocks=blocks, tap=True)
    with torch.no_grad():
        for dtype, rel in ((F64, 1e-10), (torch.float32, 1e-5)):
            exported = exported_resnet(seed=seed, width=width, blocks=tuple(blocks), tap=True, dtype=dtype,
                                       device=dev)
            folded = _fused(fold_affine, exported, dev, "fold_affine")
            chains, kept = _check_folded_graph(folded, exported, answers, "fold_affine(gm)")
            if dtype == F64:  # a slip shows in float64 first; float32 then only repeats it, to its rounding
                _diagnose_fold(folded, exported, _answer("affine_folds", seed=seed, width=width, blocks=blocks),
                               "fold_affine(gm)")
            for s in (seed + 21, seed + 22):
                x = randn(batch, 3, image, image, seed=s, device=dev, dtype=dtype)
                ref = exported(x)
                assert_close(folded(x), ref, atol=_scaled_tol(ref, rel), rtol=0,
                             name=f"fold_affine(gm)(x) vs gm(x) in {str(dtype).replace('torch.', '')}",
                             hint=AFFINE_HINT)
    ok(f"fold_affine folds all {chains} legal chains of constants into their convs, keeps the {kept} that must "
       f"stay, and equals the exported model in float64 and float32 (width {width}, blocks {tuple(blocks)}, "
       f"seed {seed})")


class Sleeper:
    """The work of the planted slow node, done where the check runs (under the grader, in the judge,
    lent to the learner's code: :func:`course.remote.lend`). It sleeps a short and a long time on
    alternate calls, both drawn afresh for every check, so the learner's process can learn them only
    by timing its calls; and it keeps how long each call slept by its own clock (``slept``), which
    the learner's profile must find again."""

    __name__ = "slow"

    #: Where the short and the long sleep are drawn from, in seconds (uniformly).
    SHORT_S, LONG_S = (0.001, 0.004), (0.035, 0.200)

    def __init__(self, short_s: tuple[float, float] | None = None, long_s: tuple[float, float] | None = None):
        draw = random.SystemRandom()  # not the check's seed: the learner's process sees that
        self.cycle_s = (draw.uniform(*(short_s or self.SHORT_S)), draw.uniform(*(long_s or self.LONG_S)))
        self.slept: list[float] = []

    @property
    def mean(self) -> float:
        """The mean of what it slept, by its own clock (seconds)."""
        return sum(self.slept) / len(self.slept)

    def __call__(self, x):
        if not (isinstance(x, torch.Tensor) and tuple(x.shape) == (3, 6)):  # it sends back what it was given
            raise TypeError(f"the graph's node 'slow' takes the (3, 6) tensor the graph gives it, not {describe(x)}")
        start = time.perf_counter()
        time.sleep(self.cycle_s[len(self.slept) % 2])
        self.slept.append(time.perf_counter() - start)
        return x


def _unchanged(x):
    return x


class _SlowNode(nn.Module):
    """The graph's leaf node 'slow': calls the function it holds (a :class:`Sleeper`, or the
    stand-in for the judge's) on its input."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class _LeafTracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, _SlowNode) or super().is_leaf_module(m, qualname)


#: The second planted node's sleeps (seconds, drawn per check): longer than a crossing (CROSSING_S), so a
#: profile that gives 'slow' the whole run's time finds it too slow; shorter than any mean of 'slow'.
PAUSE_S = (0.013, 0.017)


class _Probe(nn.Module):
    def __init__(self, slow: Callable, pause: Callable = _unchanged):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.slow = _SlowNode(slow)
        self.pause = _SlowNode(pause)

    def forward(self, x):
        return self.pause(torch.relu(self.slow(self.lin(x)))).mean(dim=1) + 1.0


def _check_rows(rows: Any, gm: fx.GraphModule, label: str) -> list[tuple[str, str, float, float]]:
    if not isinstance(rows, (list, tuple)) or not all(isinstance(r, (list, tuple)) and len(r) == 4 for r in rows):
        raise AssertionError(f"{label}.rows() should return a list of (op type, node name, mean seconds, share) "
                             f"tuples, got {describe(rows)}.")
    names = [n.name for n in gm.graph.nodes]
    got = [r[1] for r in rows]
    if sorted(got) != sorted(names):
        missing, extra = sorted(set(names) - set(got)), sorted(set(got) - set(names))
        raise AssertionError(f"{label}.rows() should have one row per node of the graph ({len(names)} nodes), "
                             f"got {len(rows)} rows; missing {missing[:6]}, unexpected {extra[:6]}"
                             f"{', some twice' if len(set(got)) < len(got) else ''}.\n"
                             "  Hint: time every node in run_node and key the times by node.name.")
    for op, _, mean, share in rows:
        if not isinstance(op, str) or not op:
            raise AssertionError(f"{label}.rows(): the op type should be a non-empty string (use op_type), got {op!r}.")
        if not (isinstance(mean, float) and mean >= 0 and isinstance(share, float) and 0 <= share <= 1.0 + 1e-9):
            if isinstance(share, (int, float)) and share > 1:
                raise AssertionError(f"{label}.rows(): share {share!r} is above 1. Give shares as fractions of "
                                     "the total (they sum to 1.0, printed as 100%), not percentages.")
            raise AssertionError(f"{label}.rows(): means are seconds (floats >= 0) and shares fractions in [0, 1]; "
                                 f"got mean {mean!r}, share {share!r}.")
    means = [r[2] for r in rows]
    if means != sorted(means, reverse=True):
        raise AssertionError(f"{label}.rows() should be sorted slowest first (by mean time, descending).")
    total_share, total = sum(r[3] for r in rows), sum(means)
    if abs(total_share - 1.0) > 1e-6:
        raise AssertionError(f"{label}.rows(): the shares sum to {total_share:.4f}; they should sum to 1 "
                             "(share = a node's mean / the sum of all nodes' means).")
    for op, name, mean, share in rows:
        if total > 0 and abs(share - mean / total) > 1e-6:
            raise AssertionError(f"{label}.rows(): node {name!r} has share {share:.4f} but mean/total = "
                                 f"{mean / total:.4f}.")
    return list(rows)


def _profiled_graph(seed: int, slow: Callable = _unchanged,
                    pause: Callable = _unchanged) -> tuple[_Probe, fx.GraphModule, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):  # the same weights in every process (grading compares runs)
        torch.manual_seed(seed)
        root = _Probe(slow, pause)
    return root, fx.GraphModule(root, _LeafTracer().trace(root)), randn(3, 6, seed=seed, device="cpu")


def _profiled_resnet(seed: int, width: int, blocks) -> tuple[nn.Module, fx.GraphModule, torch.Tensor]:
    """The real model :func:`check_profiler` profiles, on the CPU on every machine, like the planted
    graph: the profile's output comes back to the judge on its arguments' device, and none of them is
    a tensor. (On an H200 the model sat on the GPU, its profile came back on the CPU, and the
    instructor's own run failed, 2026-12-04.)"""
    model, gm = _traced(seed, width, blocks, tap=True, device="cpu")
    return model, gm, randn(2, 3, 16, 16, seed=seed + 1, device="cpu")


@prober
def profiler_case(ProfilingInterpreter: type, slow: Callable, seed: int, runs: int, width: int, blocks,
                  pause: Callable = _unchanged) -> tuple:
    """The learner's side of :func:`check_profiler`: the learner's interpreter on the graph whose nodes
    'slow' and 'pause' call ``slow`` and ``pause`` (the judge's :class:`Sleeper` s, lent) for ``runs``
    runs, and on a traced ``small_resnet`` (2 runs); each run's output and rows."""
    if not isinstance(ProfilingInterpreter, type) or not issubclass(ProfilingInterpreter, fx.Interpreter):
        raise AssertionError(f"ProfilingInterpreter should be a subclass of torch.fx.Interpreter, got "
                             f"{describe(ProfilingInterpreter)}.")
    _, gm, x = _profiled_graph(seed, slow, pause)
    _, gm2, x2 = _profiled_resnet(seed, width, blocks)
    out = []
    with torch.no_grad():
        for graph, inp, n in ((gm, x, runs), (gm2, x2, 2)):
            interp = call(ProfilingInterpreter, graph, name="ProfilingInterpreter")
            out.append(call(interp.profile, inp, runs=n, name="ProfilingInterpreter.profile"))
            rows = call(interp.rows, name="ProfilingInterpreter.rows")
            out.append([tuple(r) for r in rows] if isinstance(rows, (list, tuple))
                       and all(isinstance(r, (list, tuple)) for r in rows) else rows)
    return tuple(out)


#: How much longer than the judge's own clock the learner's profile may find the node 'slow', on
#: average (seconds): the call's way to the judge and back, and the interpreter's own work around it
#: (about a millisecond on a quiet machine; up to 10 ms measured with busy processes on two cores).
CROSSING_S = 0.012


def _busy(node: str, mean: float, want: float, busy: float) -> None:
    """A node's row above its window (:data:`CROSSING_S`) by no more than ``busy``, the seconds per run
    that the learner's process and the judge waited, ready to run, for a CPU while the profile ran
    (:func:`course.timing.waited_for_cpu`): a busy machine may have put it there. Undecided, never a
    pass; on a quiet machine ``busy`` is about 0 and the window alone decides."""
    from course.grading import SpeedUndecided

    if busy > 0 and want + CROSSING_S < mean <= want + CROSSING_S + busy:
        raise SpeedUndecided(
            f"Undecided: rows() says {mean * 1e3:.3g} ms for the grader's node {node!r}, which slept {want * 1e3:.3g} "
            f"ms on average by the grader's clock: more than one crossing ({CROSSING_S * 1e3:.3g} ms) above it, but "
            f"your notebook and the grader waited {busy * 1e3:.3g} ms a run, ready, for a CPU (the operating "
            "system's count): the machine was busy. This is not a pass: run the cell again, with other programs "
            "closed.")


def _slow_mean(mean: float, sleeper: Sleeper, runs: int, busy: float = 0.0) -> None:
    """``mean`` (the learner's row for the node 'slow') against what ``sleeper`` slept: at least that
    (the learner's clock runs around the judge's sleep), at most :data:`CROSSING_S` more. The short
    and the long sleep are drawn afresh for every check (1-4 and 35-200 ms), so a number not measured
    falls in that window by chance about once in seven checks. The last or the first run alone, and
    the sum, fall outside it whatever was drawn: the long sleep exceeds the mean by at least 15.5 ms.
    Above the window by no more than what a busy machine explains (``busy``): undecided (:func:`_busy`)."""
    slept, want = sleeper.slept, sleeper.mean
    if want * (1 - 1e-3) - 1e-4 <= mean <= want + CROSSING_S:
        return
    _busy("slow", mean, want, busy)
    ms = lambda t: f"{t * 1e3:.3g} ms"  # noqa: E731
    told = (f"The grader's node 'slow' slept {ms(sleeper.cycle_s[0])} and {ms(sleeper.cycle_s[1])} on alternate "
            f"calls (drawn for this check); by the grader's clock its mean over the {runs} runs was {ms(want)}, and "
            f"rows() says {ms(mean)}.")
    hint = ("\n  Hint: keep every run's time (a list per node) and average them all; do not keep only the last or "
            "the first, and do not sum them.")
    # one run's time first: within one crossing of it, where the sum's allowance (a crossing per run) is wider
    if abs(mean - slept[-1]) <= CROSSING_S or abs(mean - slept[0]) <= CROSSING_S:
        which = "last" if abs(mean - slept[-1]) <= CROSSING_S else "first"
        raise AssertionError(f"{told} That is the {which} run's time alone, not the mean over {runs} runs.{hint}")
    if abs(mean - sum(slept)) <= runs * CROSSING_S:
        raise AssertionError(f"{told} That is the sum of the runs' times, not their mean over {runs} runs.{hint}")
    if mean < want:
        raise AssertionError(f"{told} Less than it slept: a node's time is measured around the call that runs it "
                             f"(time.perf_counter() before and after super().run_node(n)).{hint}")
    raise AssertionError(f"{told} Time only the node itself, as its mean over {runs} runs.{hint}")


def check_profiler(ProfilingInterpreter: type, *, seed: int = 0, runs: int = 4, width: int = 8,
                   blocks=(1, 1)) -> None:
    """``ProfilingInterpreter(gm).profile(*args, runs=n)`` runs the graph ``n`` times and returns
    its output; ``.rows()`` gives one (op type, node, mean seconds, share) row per node, slowest
    first, shares summing to 1. A planted node sleeps a short and a long time on alternate calls
    (a :class:`Sleeper`, drawn afresh for every check): the profile must find the mean of what it
    slept, by the check's clock, and give it the largest share.

    Under the grader the node's work is the judge's: it is lent to the learner's process
    (:func:`course.remote.lend`), whose graph holds a stand-in that calls back, so the times to find
    are known only to the judge, and only by timing those calls could the learner's process learn
    them; the judge also counts the calls (one per run). See :func:`_slow_mean` for the window."""
    if runs < 2 or runs % 2:
        raise ValueError("check_profiler needs an even number of runs (the slow node alternates short and long).")
    sleeper, pause = Sleeper(), Sleeper(PAUSE_S, PAUSE_S)
    with machine_to_itself():  # the rows are times: measured with no other submission running
        waited = waited_for_cpu()
        got = probe(ProfilingInterpreter, profiler_case, lend(sleeper), seed, runs, width, tuple(blocks), lend(pause))
        waited = waited_for_cpu() - waited if waited >= 0 else -1.0
    busy = max(waited, 0.0) / runs  # per run: what a busy machine may have added to a node's row
    if not (isinstance(got, tuple) and len(got) == 4):
        raise AssertionError("ProfilingInterpreter: the answers came back malformed.")
    out, rows, out2, rows2 = got
    root, gm, x = _profiled_graph(seed)
    with torch.no_grad():
        assert_close(out, gm(x), name="ProfilingInterpreter(gm).profile(x) (the graph's output)",
                     hint="profile should return what the last run returned: self.run(*args).")
    for node, planted in (("slow", sleeper), ("pause", pause)):
        if len(planted.slept) != runs:
            raise AssertionError(f"The graph's node {node!r} ran {len(planted.slept)} times while profile(x, "
                                 f"runs={runs}) ran; once per run is {runs}. Run the graph with self.run(*args), "
                                 "once per run, and nothing else.")
    rows = _check_rows(rows, gm, "ProfilingInterpreter")
    op, name, mean, share = rows[0]
    # 'pause' (13-17 ms) may read above a short mean of 'slow' (from 18 ms) by the crossings' noise alone:
    # the order is decided only where the judge's means lie a crossing apart; the windows below decide the rest
    if name != "slow" and sleeper.mean - (pause.mean if name == "pause" else 0.0) > CROSSING_S:
        raise AssertionError(f"The slowest node should be 'slow' (it slept {sleeper.mean * 1e3:.3g} ms "
                             f"on average), but rows() puts {name!r} first ({mean * 1e3:.3g} ms).")
    _, _, mean, share = next(r for r in rows if r[1] == "slow")
    _slow_mean(mean, sleeper, runs, busy)
    # the second planted node, its own row: a profile that times whole runs (red team, round 18) gives 'slow'
    # both nodes' time, over the window above, and cannot tell this one's
    paused = next(r[2] for r in rows if r[1] == "pause")
    if not pause.mean * (1 - 1e-3) - 1e-4 <= paused <= pause.mean + CROSSING_S:
        _busy("pause", paused, pause.mean, busy)
        raise AssertionError(f"The grader's node 'pause' slept {pause.mean * 1e3:.3g} ms on average by the grader's "
                             f"clock, and rows() says {paused * 1e3:.3g} ms. Time each node itself, in run_node: "
                             "time.perf_counter() before and after super().run_node(n), kept per node.name.")
    # the same on a real model: every node, shares summing to 1
    model, gm2, x2 = _profiled_resnet(seed, width, blocks)
    with torch.no_grad():
        assert_close(out2, model(x2), name="ProfilingInterpreter on small_resnet")
    rows2 = _check_rows(rows2, gm2, "ProfilingInterpreter (small_resnet)")
    ok(f"ProfilingInterpreter times all {len(rows)} + {len(rows2)} nodes, finds the slow one "
       f"({mean * 1e3:.2f} ms, {share:.0%}; by the check's clock it slept {sleeper.mean * 1e3:.2f} ms), "
       f"shares sum to {sum(r[3] for r in rows2):.0%} (seed {seed})")


def _model_shape(model: nn.Module) -> dict:
    """What :func:`_model_changed` compares: each module's class, its instance attributes that are
    callables (a ``forward`` of its own), its hooks, and the parameters and buffers (values)."""
    def own(m: nn.Module) -> list[str]:
        return sorted(k for k, v in vars(m).items() if callable(v) and not isinstance(v, nn.Module))

    return {"modules": [(n, type(m), own(m), tuple(len(getattr(m, h, {})) for h in _HOOKS))
                        for n, m in model.named_modules()],
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "global": tuple(len(getattr(nn.modules.module, h, {})) for h in _GLOBAL_HOOKS)}


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_state_dict_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_module_registration_hooks")


def _model_changed(model: nn.Module, before: dict) -> str:
    """How ``model`` is no longer what :func:`_model_shape` saw ("" if it is)."""
    after = _model_shape(model)
    if after["global"] != before["global"]:
        return "a global module hook was registered"
    old, new = {n: rest for n, *rest in before["modules"]}, {n: rest for n, *rest in after["modules"]}
    if old.keys() != new.keys():
        return f"its modules changed ({', '.join(sorted(old.keys() ^ new.keys())[:3]) or 'their order'})"
    for name, (cls, own, hooks) in new.items():
        where = name or "the model"
        if cls is not old[name][0]:
            return f"{where} became a {cls.__name__}"
        if own != old[name][1]:
            return (f"{where} got attributes of its own that are functions "
                    f"({', '.join(sorted(set(own) ^ set(old[name][1])))})")
        if hooks != old[name][2]:
            return f"{where} got hooks"
    if after["state"].keys() != before["state"].keys() or any(
            not torch.equal(v, before["state"][k]) for k, v in after["state"].items()):
        return "its parameters or buffers changed"
    return ""


@prober
def compile_frozen_case(compile_frozen: Callable, model: nn.Module, example: torch.Tensor, xs: list) -> tuple:
    """The learner's side of :func:`check_compile_frozen`: ``compile_frozen(model, example)`` while
    the code Inductor generates is captured; what that code holds, and the compiled model's
    outputs on ``xs``."""
    before = _model_shape(model)
    compiled, code = capture_inductor_code(lambda: call(compile_frozen, model, example, name="compile_frozen"))
    expect_compiled(compiled, "compile_frozen(model, example)")
    changed = _model_changed(model, before)
    if changed:  # red team, 2026-12-05: model.forward = fuse(model).forward, then torch.compile(model)
        raise AssertionError(f"compile_frozen changed the model it was given: {changed}. Freezing is what folds "
                             "the BatchNorms here: compile the model as it is (no forward of your own, no hooks, "
                             "no modules swapped), with freezing on.")
    if getattr(compiled, "_orig_mod", None) is not model:  # red team, round 18: a model folded first, compiled
        raise AssertionError("compile_frozen should return torch.compile(model) for the model it was given; it "
                             "returned a compiled version of another module. Freezing is what folds the "
                             "BatchNorms here: compile the model as it is, with freezing on.")
    called = sum("conv" in name.lower() for name in code.library)
    with torch.no_grad():
        outs = [compiled(x) for x in xs] if code.code and not code.mentions_batch_norm else []
    return bool(code.code), int(code.mentions_batch_norm), len(code.library), len(code.generated), outs, called


def check_compile_frozen(compile_frozen: Callable, *, seed: int = 0, batch: int = 1, image: int = 32,
                         width: int = 16, blocks=(1, 1, 1), device=None) -> None:
    """``compile_frozen(model, example)`` returns ``torch.compile(model)`` after its first call on
    ``example``, made with Inductor's freezing on: the code Inductor generates during that call has
    the BatchNorms folded away, and the result equals the model (float32, 1e-5 of the output's scale)
    on other inputs of the same shape."""
    dev = pick_device(device)
    model = small_resnet(seed=seed, width=width, blocks=tuple(blocks), tap=False, device=dev)
    example = randn(batch, 3, image, image, seed=seed + 1, device=dev)
    xs = [randn(batch, 3, image, image, seed=s, device=dev) for s in (seed + 2, seed + 3)]
    got = probe(compile_frozen, compile_frozen_case, model, example, xs)
    if not (isinstance(got, tuple) and len(got) == 6 and type(got[0]) is bool and type(got[1]) is int
            and isinstance(got[4], list) and type(got[5]) is int):
        raise AssertionError("compile_frozen: the answer came back malformed.")
    compiled_something, batch_norms, library, generated, outs, called = got
    convs = sum(isinstance(m, nn.Conv2d) for m in model.modules())  # the judge's own model, counted here
    if not compiled_something:
        raise AssertionError("Nothing was compiled while compile_frozen ran. Make the first call, "
                             "compiled(example), inside compile_frozen, with freezing on, under torch.no_grad().")
    if called < convs:  # red team, round 18: something else compiled by Inductor, the model by another backend
        raise AssertionError(f"The code Inductor generated while compile_frozen ran calls {called} convolution(s); "
                             f"the model has {convs}. Compile the model itself with Inductor (torch.compile's "
                             "default backend) and make its first call, compiled(example), inside compile_frozen.")
    if batch_norms:
        raise AssertionError(
            f"The code Inductor generated still computes BatchNorm ('batch_norm' appears "
            f"{batch_norms} times): freezing was not on when it compiled.\n"
            "  Hint: freezing applies only to inference (torch.no_grad()) and is read when the first call "
            "compiles: `with torch.no_grad(), torch._inductor.config.patch(freezing=True): compiled(example)`. "
            "In torch 2.13, torch.compile(model, options={'freezing': True}) does not switch it on.")
    if len(outs) != len(xs):
        raise AssertionError("compile_frozen: the compiled model's outputs came back malformed.")
    ref_model = small_resnet(seed=seed, width=width, blocks=tuple(blocks), tap=False, device=dev, dtype=F64)
    with torch.no_grad():
        for x, out in zip(xs, outs):
            ref = ref_model(x.double())
            assert_close(out, ref, atol=_scaled_tol(ref, 1e-5), rtol=1e-5, check_dtype=False,
                         name="compile_frozen(model, example)(x) vs the model in float64")
    ok(f"compile_frozen: Inductor folded the BatchNorms ({library} library calls, "
       f"{generated} generated kernels) and the result equals the model (seed {seed})")


def check_fusion_speed(fold_affine: Callable, *, bars: Mapping[str, float], batch: int, image: int, width: int,
                       blocks=(1, 1, 1), num_threads: int | None = None, seed: int = 0, rounds: int = 9,
                       min_run_time: float = 0.1, device=None, extra: Mapping[str, Callable] | None = None
                       ) -> SpeedReport:
    """``fold_affine(exported)`` is at least ``bars[device]`` times as fast as the exported model
    (:func:`course.models.exported_resnet`, every chain legal), measured side by side (interleaved
    rounds after warm-up, fresh inputs every round, every output compared with the exported
    model's). ``num_threads`` pins the CPU thread count while timing. The folded model timed is the
    graph ``fold_affine`` returned, rebuilt here from its description (under the grader, in the
    judge: nothing of the learner's process runs while the clock does)."""
    dev = pick_device(device)
    exported = exported_resnet(seed=seed, width=width, blocks=tuple(blocks), device=dev)
    with torch.no_grad():
        folded = _fused(fold_affine, exported, dev, "fold_affine")
        chains = _answer("affine_chains", seed=seed, width=width, blocks=blocks, tap=False)
        _check_folded_graph(folded, exported, chains, "fold_affine(gm), in the model the speed check times")
        counter = iter(range(10**9))

        def inputs():
            return (randn(batch, 3, image, image, seed=seed + 101 * next(counter), device=dev),)

        def check(name, out, args):
            ref = exported(*args)
            assert_close(out, ref, atol=_scaled_tol(ref, 1e-5), rtol=0, name=f"{name} output while timing")

        candidates = {"exported": exported, "folded": folded, **(extra or {})}
        with threads(num_threads if dev.type == "cpu" else None):
            report = compare(candidates, inputs=inputs, check=check, rounds=rounds, min_run_time=min_run_time,
                             device=dev, until=("folded", "exported", speed_bar(bars, dev)))
    report.show()
    # both sides are graphs of torch's ops the judge built and runs itself (the folded one from the answer's
    # checked description), on fresh inputs, every output compared: nothing cached or skipped can hide in a
    # ratio, so none is implausible (a busy machine slows the two sides unequally; the picker's was flagged so)
    expect_speedup(report, "folded", over="exported", bars=bars, trusted=True,
                   hint="fold every legal chain into its conv and erase its nodes; the folded model must run "
                        "fewer ops than the exported one. If the machine is busy, run the cell again.")
    return report

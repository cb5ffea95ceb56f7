"""Lesson 2's references: what a node computes (Exercise 1), which conv/BatchNorm pairs may be fused
and why the others may not (Exercise 2), a BatchNorm folded into its conv (Exercise 3) and an
exported model's chains of constants folded into theirs (Exercise 6). They answer the exercises, so
they are the grader's alone (see :mod:`course.references`).

The checks ask for an answer by its kind and their own arguments (:func:`answer`); in a learner's
copy they read the same answers, stored for the lesson's own calls (:data:`LESSON_CALLS`), from
``course/reference_data/02_fx.pt``: the named slips need nothing more there."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from course.checks.fx import (AFFINE_SLIPS, ELEMENTWISE, ELEMENTWISE_METHODS, FUSE_TRAIN_BN, bn_nodes, case_key,
                              constant_ops, conv_nodes, fold_case)
from course.guard import reference
from course.models import exported_resnet, small_resnet

__all__ = ["ANSWERS", "DATA_FILES", "LESSON_CALLS", "affine_chains", "affine_fold", "answer", "fold_conv_bn_reference",
           "fold_reasons", "fold_variants", "lesson_answers", "legal_pairs", "op_type_reference"]

F64 = torch.float64


# ---------------------------------------------------------------- the references

@reference
def op_type_reference(gm: fx.GraphModule, node: fx.Node) -> str:
    """Exercise 1: the module's class, the function's ``__name__``, the method's name, or the op."""
    kinds = {"call_module": lambda t: type(gm.get_submodule(t)).__name__,
             "call_function": lambda t: getattr(t, "__name__", str(t)), "call_method": str}
    return kinds[node.op](node.target) if node.op in kinds else node.op


@reference
def fold_reasons(gm: fx.GraphModule, bn_node: fx.Node) -> str | None:
    """Why the BatchNorm at ``bn_node`` may not be folded (None: it may)."""
    bn = gm.get_submodule(bn_node.target)
    if bn.training:
        return "the BatchNorm is in training mode (it normalises with the batch's statistics)"
    src = bn_node.args[0] if len(bn_node.args) == 1 and not bn_node.kwargs else None
    if not (isinstance(src, fx.Node) and src.op == "call_module"
            and isinstance(gm.get_submodule(src.target), nn.Conv2d)):
        return "its input is not a Conv2d module"
    if len(src.users) != 1:
        return f"the conv's output has {len(src.users)} users: folding would change what the others see"
    return None


@reference
def legal_pairs(gm: fx.GraphModule) -> set[tuple[str, str]]:
    """Exercise 2: the (conv target, BatchNorm target) pairs that may be fused."""
    return {(str(n.args[0].target), str(n.target)) for n in bn_nodes(gm) if fold_reasons(gm, n) is None}


@reference
def fold_conv_bn_reference(w, b, mean, var, gamma, beta, eps):
    """Exercise 3: ``(w', b')`` of a conv with the eval-mode BatchNorm after it folded in."""
    scale = gamma / torch.sqrt(var + eps)
    b = torch.zeros_like(mean) if b is None else b
    return w * scale.reshape(-1, *([1] * (w.dim() - 1))), (b - mean) * scale + beta


@reference
def fold_variants(w, b, mean, var, gamma, beta, eps) -> dict:
    """What plausible mistakes of folding return, ``(w', b')`` each, by what the learner likely did."""
    b0 = torch.zeros_like(mean) if b is None else b
    scale = gamma / torch.sqrt(var + eps)
    shape = (-1, *([1] * (w.dim() - 1)))
    right_w, right_b = w * scale.reshape(shape), (b0 - mean) * scale + beta
    out = {"eps was left out of the scale: gamma / sqrt(var + eps)":
               fold_conv_bn_reference(w, b, mean, var, gamma, beta, 0.0),
           "the mean was not subtracted: b' = (b - mean) * scale + beta": (right_w, b0 * scale + beta),
           "the scale divides by var, not by its square root: gamma / sqrt(var + eps)":
               (w * (gamma / (var + eps)).reshape(shape), (b0 - mean) * (gamma / (var + eps)) + beta),
           "beta was left out: b' = (b - mean) * scale + beta": (right_w, (b0 - mean) * scale)}
    if w.shape[0] == w.shape[1]:  # only then does the other axis broadcast at all
        out["the scale multiplied the input channels (dim 1); each output channel (dim 0) has its own: "
            "scale.reshape(-1, 1, 1, 1)"] = (w * scale.reshape(1, -1, *([1] * (w.dim() - 2))), right_b)
    return out


@reference
def affine_chains(gm: fx.GraphModule) -> tuple[dict[str, str], dict[str, str]]:
    """Exercise 6: the exported graph's constants, split into those whose chain may be folded into
    the conv before it and those whose chain must stay; each maps to its conv's path. A chain may be
    folded when it starts at a Conv2d module's output and every node on it, the conv included, has
    one user."""
    on_chain = {n for n, _ in constant_ops(gm)}
    fold, stay = {}, {}
    for node, const in constant_ops(gm):
        src, legal = node, True
        while src in on_chain:
            src = next(a for a in src.args if isinstance(a, fx.Node) and a.op != "get_attr")
            legal = legal and len(src.users) == 1
        conv = src.op == "call_module" and isinstance(gm.get_submodule(src.target), nn.Conv2d)
        (fold if conv and legal else stay)[const] = str(src.target)
    return fold, stay


def _chain_after(gm: fx.GraphModule, conv_node: fx.Node, fold: dict[str, str],
                 ops: dict[fx.Node, str]) -> list[tuple[str, torch.Tensor, bool]]:
    """The legal chain after ``conv_node`` (``fold``: the foldable constants, ``ops``: every
    elementwise node on a constant, with its constant): (symbol, constant as a vector, constant
    first) per op."""
    chain, last = [], conv_node
    while len(last.users) == 1 and next(iter(last.users)) in ops and ops[next(iter(last.users))] in fold:
        node = next(iter(last.users))
        symbol = ELEMENTWISE.get(node.target) if node.op == "call_function" else ELEMENTWISE_METHODS[node.target]
        const = getattr(gm, ops[node]) if "." not in ops[node] else gm.get_buffer(ops[node])
        chain.append((symbol, const.reshape(-1), node.args[0] is not last))
        last = node
    return chain


@reference
def affine_fold(w: torch.Tensor, bias: torch.Tensor | None, chain, slip: str | None = None):
    """Exercise 6: ``(w', b')`` for a conv with ``chain`` folded in; ``slip`` names one of
    :data:`course.checks.fx.AFFINE_SLIPS`, to give what that slip computes instead."""
    a = torch.ones(w.shape[0], dtype=w.dtype, device=w.device)
    b = torch.zeros_like(a)
    for symbol, c, first in chain:
        if symbol == "+":
            b = b + c
        elif symbol == "-":
            a, b = (-a, c - b) if first else (a, b + c if slip == "sub_as_add" else b - c)
        elif symbol == "*":
            a, b = a * c, (b if slip == "shift_unscaled" else b * c)
        else:
            a, b = a / c, b / c
    bias = torch.zeros_like(a) if bias is None else bias
    w2 = w if slip == "weight_unscaled" else w * a.reshape(-1, *([1] * (w.dim() - 1)))
    b2 = b if slip == "bias_dropped" else (bias + b if slip == "bias_unscaled" else bias * a + b)
    return w2, b2


# ---------------------------------------------------------------- the answers, by the checks' arguments

def _traced(seed: int, width: int, blocks, train_bn: str | None = None) -> fx.GraphModule:
    """The graph a check traces for these arguments (node names depend on nothing else)."""
    return fx.symbolic_trace(small_resnet(seed=seed, width=width, blocks=tuple(blocks), tap=True, device="cpu",
                                          train_bn=train_bn))


def op_types(*, seed: int, width: int, blocks) -> list[tuple[str, str]]:
    """``check_op_type``'s answers: (node name, op type) for every node, in graph order."""
    gm = _traced(seed, width, blocks)
    return [(node.name, op_type_reference(gm, node)) for node in gm.graph.nodes]


def conv_bn_legality(*, seed: int, width: int, blocks, train_bn: str | None) -> dict:
    """``check_conv_bn_pairs``'s and ``check_fuse``'s answers: ``{"pairs": the legal (conv, bn)
    targets, sorted; "reasons": {every BatchNorm's target: why it may not be folded, or None}}``."""
    gm = _traced(seed, width, blocks, train_bn)
    return {"pairs": sorted(legal_pairs(gm)), "reasons": {str(n.target): fold_reasons(gm, n) for n in bn_nodes(gm)}}


def fold_conv_bn_answers(*, seed: int, c_in: int, c_out: int, kernel: int, bias: bool, eps: float,
                         groups: int) -> dict:
    """``check_fold_conv_bn``'s answers on its inputs: ``{"want": (w', b'), "variants": {mistake: (w', b')}}``."""
    args = fold_case(seed=seed, c_in=c_in, c_out=c_out, kernel=kernel, bias=bias, eps=eps, groups=groups)
    return {"want": fold_conv_bn_reference(*args), "variants": fold_variants(*args)}


def affine_answers(*, seed: int, width: int, blocks, tap: bool) -> dict:
    """``check_fold_affine``'s and ``check_fusion_speed``'s structure answers for the exported model:
    ``{"fold": {constant: conv}, "stay": {constant: conv}}`` (see :func:`affine_chains`)."""
    fold, stay = affine_chains(exported_resnet(seed=seed, width=width, blocks=tuple(blocks), tap=tap, device="cpu"))
    return {"fold": fold, "stay": stay}


def affine_folds(*, seed: int, width: int, blocks) -> list[dict | None]:
    """``check_fold_affine``'s answers for naming a slip, in float64: for every conv of the exported
    model (with its tap), in graph order, None when no legal chain follows it, else
    ``{"right": (w', b'), "slips": {slip: (w', b')}}``."""
    gm = exported_resnet(seed=seed, width=width, blocks=tuple(blocks), tap=True, device="cpu", dtype=F64)
    fold, _ = affine_chains(gm)
    ops = dict(constant_ops(gm))
    out = []
    for node in conv_nodes(gm):
        chain = _chain_after(gm, node, fold, ops)
        conv = gm.get_submodule(node.target)
        w, bias = conv.weight.detach(), None if conv.bias is None else conv.bias.detach()
        right = affine_fold(w, bias, chain)
        out.append({"right": right, "slips": {slip: _sharing(affine_fold(w, bias, chain, slip), right)
                                              for slip in AFFINE_SLIPS}} if chain else None)
    return out


def _sharing(pair: tuple, right: tuple) -> tuple:
    """``pair``, where a tensor equals the right answer's, that very tensor: a file stores it once."""
    return tuple(r if torch.equal(t, r) else t for t, r in zip(pair, right))


ANSWERS = {"op_types": op_types, "conv_bn_legality": conv_bn_legality, "fold_conv_bn": fold_conv_bn_answers,
           "affine_chains": affine_answers, "affine_folds": affine_folds}


def answer(kind: str, **args: Any) -> Any:
    """The answer of kind ``kind`` (a key of :data:`ANSWERS`) for a check's arguments."""
    return ANSWERS[kind](**args)


_SPEED_SIZES = (dict(width=16, blocks=(1, 1, 1)), dict(width=64, blocks=(2, 2, 2, 2)))  # the `S` cell: CPU, CUDA

#: The answers the lesson's own visible calls ask for (its test cells; the speed check at the sizes
#: of its ``S = course.sizes(...)`` cell, on a CPU and on a GPU): what a learner's copy stores.
LESSON_CALLS = (
    ("op_types", dict(seed=0, width=8, blocks=(1, 1))),
    ("conv_bn_legality", dict(seed=0, width=8, blocks=(1, 1), train_bn=None)),
    ("conv_bn_legality", dict(seed=0, width=8, blocks=(1, 1), train_bn=FUSE_TRAIN_BN)),
    *(("fold_conv_bn", dict(seed=0, c_in=3, c_out=5, kernel=3, bias=bias, eps=1e-5, groups=1))
      for bias in (True, False)),
    ("affine_chains", dict(seed=0, width=8, blocks=(1, 1), tap=True)),
    ("affine_folds", dict(seed=0, width=8, blocks=(1, 1))),
    *(("affine_chains", dict(seed=0, **sizes, tap=False)) for sizes in _SPEED_SIZES),
)


def lesson_answers() -> dict:
    """What ``02_fx.pt`` holds: every answer of :data:`LESSON_CALLS`, by :func:`case_key`."""
    return {case_key(kind, args): answer(kind, **args) for kind, args in LESSON_CALLS}


DATA_FILES = {"02_fx.pt": lesson_answers}

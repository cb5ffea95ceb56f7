"""An FX ``GraphModule`` as data, and back: how lesson 2's answers (a fused graph) reach the judge.

A graph crosses as its nodes (name, op, target, arguments) and, for every module a node calls or
tensor a node reads, the module's kind, its constructor's settings and its state. Nothing in it
is code: functions a node calls are named from a short list of tensor operations, methods by
name from another, modules from a list of ``torch.nn`` layer types (exactly those types, built
here by their own constructors), and every argument is a plain value or a reference to an
earlier node. :func:`rebuild` makes a ``GraphModule`` from that in the judge, with the learner's
tensors as its state; what does not fit the lists is refused with a :class:`GraphError` that
says what was found. So the judge inspects, runs and times the graph the learner's transform
produced, in its own process, without running a line of the learner's code.
"""

from __future__ import annotations

import inspect
import operator
import re
from typing import Any, Callable

import torch
from torch import fx, nn

__all__ = ["FUNCTIONS", "GraphError", "METHODS", "MODULES", "describe", "rebuild"]

MAX_NODES = 5000
MAX_MODULES = 1000
F = nn.functional


class GraphError(ValueError):
    """A graph (or its description) that holds something this format does not carry."""


def _named(*fns: Callable) -> dict[str, Callable]:
    out = {}
    for fn in fns:
        module = "operator" if fn.__module__ in ("_operator", "operator") else fn.__module__ or "torch"
        out[f"{module}.{fn.__name__}"] = fn
    return out


#: Functions a ``call_function`` node may call, by name.
FUNCTIONS: dict[str, Callable] = {
    **_named(operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.getitem,
             operator.iadd, operator.imul),
    **{f"torch.{n}": getattr(torch, n) for n in ("relu", "sigmoid", "tanh", "flatten", "add", "sub", "mul", "div",
                                                   "cat", "mean", "sum", "conv2d", "batch_norm", "max_pool2d", "reshape")},
    **{f"torch.nn.functional.{n}": getattr(F, n) for n in ("relu", "relu6", "sigmoid", "conv2d", "batch_norm",
                                                             "max_pool2d", "adaptive_avg_pool2d", "linear")},
}
_FUNCTION_NAMES = {id(fn): name for name, fn in FUNCTIONS.items()}

#: Tensor methods a ``call_method`` node may call.
METHODS = frozenset({"relu", "sigmoid", "tanh", "mean", "sum", "flatten", "view", "reshape", "add", "mul", "sub",
                     "div", "size", "contiguous", "clone", "neg"})


def _conv(m: nn.Conv2d) -> dict:
    return dict(in_channels=m.in_channels, out_channels=m.out_channels, kernel_size=m.kernel_size, stride=m.stride,
                padding=m.padding, dilation=m.dilation, groups=m.groups, bias=m.bias is not None,
                padding_mode=m.padding_mode)


def _bn(m: nn.BatchNorm2d) -> dict:
    return dict(num_features=m.num_features, eps=m.eps, momentum=m.momentum, affine=m.affine,
                track_running_stats=m.track_running_stats)


#: Module kinds a ``call_module`` node may call: name -> (exact type, its constructor's settings).
MODULES: dict[str, tuple[type, Callable[[Any], dict]]] = {
    "Conv2d": (nn.Conv2d, _conv),
    "BatchNorm2d": (nn.BatchNorm2d, _bn),
    "ReLU": (nn.ReLU, lambda m: dict(inplace=m.inplace)),
    "Sigmoid": (nn.Sigmoid, lambda m: {}),
    "Identity": (nn.Identity, lambda m: {}),
    "MaxPool2d": (nn.MaxPool2d, lambda m: dict(kernel_size=m.kernel_size, stride=m.stride, padding=m.padding,
                                               dilation=m.dilation, ceil_mode=m.ceil_mode)),
    "AdaptiveAvgPool2d": (nn.AdaptiveAvgPool2d, lambda m: dict(output_size=m.output_size)),
    "Flatten": (nn.Flatten, lambda m: dict(start_dim=m.start_dim, end_dim=m.end_dim)),
    "Linear": (nn.Linear, lambda m: dict(in_features=m.in_features, out_features=m.out_features,
                                         bias=m.bias is not None)),
}
_PART = re.compile(r"(?!__)[A-Za-z_][A-Za-z0-9_]{0,63}|\d{1,6}")


def _path(target: Any) -> str:
    if not (isinstance(target, str) and target and len(target) <= 300
            and all(_PART.fullmatch(p) for p in target.split("."))):
        raise GraphError(f"a node's target {str(target)[:80]!r} is not a path of plain attribute names")
    return target


# -- the learner's side: a graph as data ----------------------------------------------------------

def _arg(value: Any, depth: int = 0) -> Any:
    if depth > 16:
        raise GraphError("a node's arguments are nested too deeply")
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if value is None or type(value) in (bool, int, float, str) or isinstance(value, torch.dtype):
        return value
    if type(value) is tuple or isinstance(value, torch.Size):
        return tuple(_arg(v, depth + 1) for v in value)
    if type(value) is list:
        return [_arg(v, depth + 1) for v in value]
    if type(value) is slice:
        return {"slice": [_arg(value.start, depth + 1), _arg(value.stop, depth + 1), _arg(value.step, depth + 1)]}
    if value is Ellipsis:
        return {"ellipsis": True}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if type(value) is dict and all(type(k) is str for k in value):
        return {"dict": {k: _arg(v, depth + 1) for k, v in value.items()}}
    raise GraphError(f"a node's argument is a {type(value).__name__}, which the grader cannot rebuild")


def describe(gm: fx.GraphModule) -> dict:
    """``gm`` as data: ``{"nodes": [[name, op, target, args, kwargs], ...], "modules": {path: [kind,
    settings, training, state]}, "tensors": {path: tensor}}``. Raises :class:`GraphError` for what
    this format does not carry (a module of another kind, a function off the list...)."""
    if not isinstance(gm, fx.GraphModule):
        raise GraphError(f"a {type(gm).__name__}, not a torch.fx.GraphModule")
    nodes, modules, tensors = [], {}, {}
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function":
            if id(target) not in _FUNCTION_NAMES:
                raise GraphError(f"node {node.name!r} calls {getattr(target, '__name__', target)!r}, which is not "
                                 "one of the tensor operations the grader rebuilds")
            target = _FUNCTION_NAMES[id(target)]
        elif node.op == "call_method":
            if target not in METHODS:
                raise GraphError(f"node {node.name!r} calls the method {str(target)[:40]!r}, which is not one the "
                                 "grader rebuilds")
        elif node.op == "call_module":
            module = gm.get_submodule(_path(target))
            kind = next((k for k, (cls, _) in MODULES.items() if type(module) is cls), None)
            if kind is None:
                raise GraphError(f"node {node.name!r} calls a {type(module).__name__} module; the grader rebuilds "
                                 f"only the layer types {sorted(MODULES)} (use the model's own kinds of modules)")
            modules[target] = [kind, MODULES[kind][1](module), bool(module.training),
                               {k: t.detach() for k, t in module.state_dict().items()}]
        elif node.op == "get_attr":
            value = gm
            for part in _path(target).split("."):
                value = getattr(value, part)
            if not isinstance(value, torch.Tensor):
                raise GraphError(f"node {node.name!r} reads {target!r}, which is not a tensor")
            tensors[target] = value.detach()
        elif node.op not in ("placeholder", "output"):
            raise GraphError(f"node {node.name!r} has op {node.op!r}")
        nodes.append([node.name, node.op, target, _arg(tuple(node.args)), _arg(dict(node.kwargs))])
        if len(nodes) > MAX_NODES or len(modules) > MAX_MODULES:
            raise GraphError(f"a graph of more than {MAX_NODES} nodes or {MAX_MODULES} modules")
    return {"nodes": nodes, "modules": modules, "tensors": tensors}


# -- the judge's side: data as a graph --------------------------------------------------------------

def _value(h: Any, env: dict, depth: int = 0) -> Any:
    if depth > 18:
        raise GraphError("arguments nested too deeply")
    if h is None or type(h) in (bool, int, float, str) or isinstance(h, torch.dtype):
        return h
    if type(h) is tuple:
        return tuple(_value(v, env, depth + 1) for v in h)
    if type(h) is list:
        return [_value(v, env, depth + 1) for v in h]
    if type(h) is dict and len(h) == 1:
        (kind, body), = h.items()
        if kind == "node":
            if body not in env:
                raise GraphError(f"an argument refers to {str(body)[:40]!r}, which is not an earlier node")
            return env[body]
        if kind == "slice" and type(body) is list and len(body) == 3:
            return slice(*(_value(v, env, depth + 1) for v in body))
        if kind == "ellipsis" and body is True:
            return Ellipsis
        if kind == "device" and isinstance(body, str) and re.fullmatch(r"cpu|cuda(:\d+)?|meta", body):
            return torch.device(body)
        if kind == "dict" and type(body) is dict:
            return {k: _value(v, env, depth + 1) for k, v in body.items()}
    raise GraphError("an argument of no known kind")


def _install(root: nn.Module, path: str, value: Any) -> None:
    parts = _path(path).split(".")
    owner = root
    for part in parts[:-1]:
        child = owner._modules.get(part)
        if child is None:
            if part in owner.__dict__ or part in owner._parameters or part in owner._buffers:
                raise GraphError(f"{path!r} passes through something that is not a module")
            child = nn.Module()
            owner.add_module(part, child)
        owner = child
    name = parts[-1]
    if name in owner._modules or name in owner._buffers or hasattr(type(owner), name):
        raise GraphError(f"{path!r} is used twice, or names an attribute every module has")
    if isinstance(value, nn.Module):
        owner.add_module(name, value)
    else:
        owner.register_buffer(name, value)


def _module(kind: Any, settings: Any, training: Any, state: Any) -> nn.Module:
    if kind not in MODULES or type(settings) is not dict or type(training) is not bool or type(state) is not dict:
        raise GraphError(f"a module described as {str(kind)[:40]!r} that the grader cannot build")
    cls, _ = MODULES[kind]
    for key, v in settings.items():
        if not (isinstance(key, str) and (v is None or type(v) in (bool, int, float, str)
                                          or (type(v) is tuple and all(type(i) is int for i in v)))):
            raise GraphError(f"a {kind}'s setting {str(key)[:30]!r} is not a plain value")
    try:
        module = cls(**settings)
        module.load_state_dict(state, strict=True, assign=True)
    except GraphError:
        raise
    except Exception as exc:  # noqa: BLE001 - settings or state that do not fit the layer
        raise GraphError(f"a {kind} could not be built from its settings and state ({type(exc).__name__}: "
                         f"{str(exc)[:200]})") from None
    return module.train(training)


def rebuild(desc: Any, device: torch.device | str = "cpu") -> fx.GraphModule:
    """The ``GraphModule`` that ``desc`` (from :func:`describe`, after crossing) describes, built
    here from the lists above, on ``device``; :class:`GraphError` for anything else."""
    if not (type(desc) is dict and type(desc.get("nodes")) is list and type(desc.get("modules")) is dict
            and type(desc.get("tensors")) is dict):
        raise GraphError("not a graph description")
    if len(desc["nodes"]) > MAX_NODES or len(desc["modules"]) > MAX_MODULES:
        raise GraphError("a graph over the size limits")
    root = nn.Module()
    for path, entry in desc["modules"].items():
        if not (type(entry) is list and len(entry) == 4):
            raise GraphError(f"module {str(path)[:60]!r} is malformed")
        _install(root, path, _module(*entry))
    for path, t in desc["tensors"].items():
        if not isinstance(t, torch.Tensor):
            raise GraphError(f"{str(path)[:60]!r} is not a tensor")
        _install(root, path, t)
    graph, env = fx.Graph(), {}
    for entry in desc["nodes"]:
        if not (type(entry) is list and len(entry) == 5 and isinstance(entry[0], str) and entry[0] not in env):
            raise GraphError("a malformed node")
        name, op, target, args, kwargs = entry
        args, kwargs = _value(args, env), _value(kwargs, env)
        if type(args) is not tuple or type(kwargs) is not dict:
            raise GraphError(f"node {name[:40]!r} has malformed arguments")
        if op == "placeholder" and isinstance(target, str) and target.isidentifier():
            node = graph.placeholder(target, default_value=args[0] if args else inspect.Signature.empty)
        elif op == "output" and len(args) == 1:
            node = graph.output(args[0])
        elif op == "call_function" and target in FUNCTIONS:
            node = graph.call_function(FUNCTIONS[target], args, kwargs)
        elif op == "call_method" and target in METHODS:
            node = graph.call_method(target, args, kwargs)
        elif op == "call_module" and target in desc["modules"]:
            node = graph.call_module(target, args, kwargs)
        elif op == "get_attr" and target in desc["tensors"]:
            node = graph.get_attr(target)
        else:
            raise GraphError(f"node {str(name)[:40]!r} ({str(op)[:20]} {str(target)[:60]!r}) cannot be rebuilt")
        env[name] = node
    try:
        graph.lint()
        gm = fx.GraphModule(root, graph)
    except Exception as exc:  # noqa: BLE001 - a graph that does not hold together
        raise GraphError(f"the graph does not hold together ({type(exc).__name__}: {str(exc)[:200]})") from None
    return gm.to(device)

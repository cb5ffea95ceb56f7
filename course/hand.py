"""Answers by hand that need torch: read by the judge, run again where nothing else of the learner's runs.

Some exercises ask for torch code written from small ops, and forbid PyTorch's one-call version
(lesson 1's LSTM from ``mm``, ``sigmoid`` and ``tanh``, not ``torch.lstm_cell``; lesson 9's attention
from ``softmax``, not SDPA). In the learner's process the course's watcher reports which ops an
answer called: that process's word, which a learner who forges from C controls. The bare host
(:mod:`course.bare`) cannot take these answers, since they need torch. Under the grader the judge
instead **reads** the answer's program itself and runs it again in the program host
(``autograder/sandbox/script_host.py`` run as a process of its own, confined, with torch, holding
nothing of the grader's and never loading the learner's TorchScript, which the script host does):

1. The learner's process sends the program: the answer's ``def``, the notebook's functions it
   calls, and the imports and constants it reads (:func:`course.bare.bare_program`). That text is
   its word, and it need not be believed: whatever comes is what runs.
2. The judge reads it (:func:`read_program`) against lists of what such a program may do: at its
   top level only imports of torch, its ``nn.functional``, ``linalg``, ``special``, ``fft``, ``func``
   and ``autograd.forward_ad``, ``math`` and the check's own helpers, plain constants and ``def``\\s without decorators; inside,
   only listed syntax (no class, ``match``, ``global``, import, ``yield``; ``with`` only as
   ``with torch.no_grad():`` or ``torch.autocast(...)``, never holding the object), the names the
   program binds (no ``__`` name), a short list of builtins, module members on the lists of
   :mod:`course.allowed_ops` (never the exercise's one-call op, by the words in its name), a module
   only as the object of such a member (never held as a value), and attributes of values by a list
   of names. No attribute assigned. What is not on the lists is refused with a message that names
   it: the lists are what makes forging impossible to write, not a search for the ways to forge.
3. The program host builds a namespace from the imports the judge read, with those builtins only,
   and defines the program there (annotations are not evaluated). The judge then calls it as it
   calls the learner's process, on its own inputs, compares the values, and runs the course's
   watcher there: in a process where nothing of the learner's ran before, on a program that
   cannot name what would blind it.

Outside the grader there is no script host, and :func:`hosted` returns None after reading the
program as the judge would (a learner hears of a refusal in the notebook): the watcher in the
learner's process decides alone.
"""

from __future__ import annotations

import __future__
import ast
import builtins
import importlib
import inspect
import types
from typing import Any, Callable

import torch

from course import allowed_ops
from course.cells import TooDeep, parse
from course.remote import Remote, is_remote, probe

__all__ = ["AGAIN", "Hosted", "again", "define", "hosted", "read_program"]

#: Modules some program may import (the reading holds each to its exercise's vocabulary,
#: :data:`course.allowed_ops.VOCABULARIES`; the program host defines what the judge read).
MODULES = tuple(sorted(frozenset().union(*(v.reach for v in allowed_ops.VOCABULARIES.values()))))

#: Builtins a program may read: plain Python on plain values. ``print`` prints nothing there.
BUILTINS = ("abs", "all", "any", "bool", "dict", "divmod", "enumerate", "filter", "float", "frozenset", "int",
            "isinstance", "iter", "len", "list", "map", "max", "min", "next", "pow", "print", "range", "reversed", "round", "set", "slice", "sorted", "str", "sum", "tuple", "zip",
            "ArithmeticError", "AssertionError", "Exception", "IndexError", "KeyError", "NotImplementedError",
            "RuntimeError", "TypeError", "ValueError", "ZeroDivisionError")

#: The syntax a program may use: everything else (a class, ``match``, ``global``, an import inside a
#: function, ``yield``, ``async``, and whatever a later Python adds) is refused. ``with`` only as
#: ``with torch.no_grad():`` and the like (:data:`course.allowed_ops.CONTEXTS`, no ``as``).
_SYNTAX = frozenset({
    ast.FunctionDef, ast.arguments, ast.arg, ast.Return, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For,
    ast.While, ast.If, ast.Expr, ast.Pass, ast.Break, ast.Continue, ast.Raise, ast.Assert, ast.Try, ast.ExceptHandler,
    ast.Delete, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Lambda, ast.IfExp, ast.Dict, ast.Set, ast.ListComp,
    ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.comprehension, ast.Compare, ast.Call, ast.keyword,
    ast.JoinedStr, ast.FormattedValue, ast.Constant, ast.Attribute, ast.Subscript, ast.Starred, ast.Name, ast.List,
    ast.Tuple, ast.Slice, ast.NamedExpr, ast.Load, ast.Store, ast.Del, ast.With, ast.withitem,
    *(getattr(ast, n) for n in ("And", "Or", "Add", "Sub", "Mult", "MatMult", "Div", "Mod", "Pow", "LShift", "RShift",
                                "BitOr", "BitXor", "BitAnd", "FloorDiv", "Invert", "Not", "UAdd", "USub", "Eq", "NotEq",
                                "Lt", "LtE", "Gt", "GtE", "Is", "IsNot", "In", "NotIn"))})
_NAMED = {ast.ClassDef: "a class", ast.Match: "a match statement",
          ast.Global: "a global statement", ast.Nonlocal: "a nonlocal statement", ast.Import: "an import inside a function",
          ast.ImportFrom: "an import inside a function", ast.Yield: "yield", ast.YieldFrom: "yield from",
          ast.AsyncFunctionDef: "async def", ast.Await: "await"}

MAX_PROGRAM_CHARS = 200_000
#: Keywords no listed function needs: some of PyTorch's constructors read ``cdata`` as a C++ pointer;
#: ``level`` picks forward AD's level by number (``dual_level()`` is the way in).
_KEYWORDS_REFUSED = frozenset({"cdata", "level"})


class Refused(AssertionError):
    """What the judge's reading of a program refused, and why."""


def _member_refusal(module: types.ModuleType, attr: str, forbidden: tuple,
                    vocab: allowed_ops.Vocabulary) -> str | None:
    """Why ``module.attr`` may not be read by a program (None: it may): it must be on the list
    (:mod:`course.allowed_ops`) and within the exercise's vocabulary, and never the exercise's one-call
    op (``forbidden``'s words)."""
    where = f"{module.__name__}.{attr}"
    if module.__name__ not in vocab.reach:
        return _out_of_reach(module.__name__)
    if any(word in attr.lower() for word in forbidden):
        return (f"it calls {where}, which this exercise's answer may not use (the one-call version of what it asks "
                "to write, or a way around what it asks)")
    member = vars(module).get(attr)  # what the module holds (no lazy import of a submodule here)
    if module.__name__ == "math" and not attr.startswith("_") and member is not None:
        return None  # arithmetic on numbers
    if module is torch and (isinstance(member, torch.dtype) or type(member) is float):
        return None  # torch.float64, torch.inf
    if member is not None and attr in allowed_ops.CLASSES.get(module.__name__, ()):
        return None  # only as isinstance's second argument (the walk sees to it)
    if member is not None and attr in allowed_ops.CONTEXTS.get(module.__name__, ()):
        return None  # only as the call of a with statement (the walk sees to it)
    if member is not None and (attr in allowed_ops.MEMBERS.get(module.__name__, ())
                               or attr in vocab.members.get(module.__name__, ())):
        return None
    if attr in allowed_ops.SUBMODULES.get(module.__name__, ()):
        return None if where in vocab.reach else _out_of_reach(where)
    return f"it reads {where}, which is not among the tensor functions a program may use"


def _out_of_reach(module: str) -> str:
    """Why a module on the lists is refused: another exercise's vocabulary has it, this one's does not."""
    return f"it reads {module}, which this exercise's programs may not use (another exercise's may)"


def _module_of(node: ast.AST, modules: dict, vocab: allowed_ops.Vocabulary) -> types.ModuleType | None:
    """The module an expression names (a module's alias, or an allowed submodule of one within the
    vocabulary's reach), else None."""
    if isinstance(node, ast.Name):
        return modules.get(node.id)
    if isinstance(node, ast.Attribute):
        parent = _module_of(node.value, modules, vocab)
        if (parent is not None and node.attr in allowed_ops.SUBMODULES.get(parent.__name__, ())
                and f"{parent.__name__}.{node.attr}" in vocab.reach):
            return vars(parent).get(node.attr)
    return None


def _context_arguments(call: ast.Call, modules: dict, contexts: dict, vocab: allowed_ops.Vocabulary) -> str | None:
    """Why the arguments of a ``with`` item's call are not allowed (None: they are): each a constant on
    the list for its context manager (:data:`course.allowed_ops.CONTEXT_ARGUMENTS`), a dtype as
    ``torch.<dtype>``. A value its ``__enter__`` would refuse halfway (``cache_enabled="no"``) could
    leave autocast switched on."""
    func = call.func
    name = contexts[func.id].rpartition(".")[2] if isinstance(func, ast.Name) else func.attr
    allowed = allowed_ops.CONTEXT_ARGUMENTS.get(name, {})
    order = list(allowed)
    if len(call.args) > len(order) or any(isinstance(a, ast.Starred) for a in call.args):
        return f"it passes {name} more positional arguments than it takes here"
    given = list(zip(order, call.args)) + [(k.arg, k.value) for k in call.keywords]
    for arg, value in given:
        if arg not in allowed:
            return f"it passes {name} the argument {arg}, which a program may not"
        if isinstance(value, ast.Constant) and type(value.value) in (str, bool) and value.value in allowed[arg]:
            continue
        module = _module_of(value.value, modules, vocab) if isinstance(value, ast.Attribute) else None
        if module is torch and f"torch.{value.attr}" in allowed[arg]:
            continue
        return f"it passes {name} a value of {arg} other than {', '.join(map(str, allowed[arg]))}"
    return None


def _context_of(node: ast.AST, modules: dict, contexts: dict, vocab: allowed_ops.Vocabulary) -> bool:
    """Whether ``node`` names a context manager of :data:`course.allowed_ops.CONTEXTS` (``torch.no_grad``,
    or a name imported as one)."""
    if isinstance(node, ast.Name):
        return node.id in contexts
    module = _module_of(node.value, modules, vocab) if isinstance(node, ast.Attribute) else None
    return module is not None and node.attr in allowed_ops.CONTEXTS.get(module.__name__, ())


def _switches(tree: ast.AST, modules: dict, bindings: dict, vocab: allowed_ops.Vocabulary) -> set[str]:
    """The names a program binds only ever to a switch a ``with`` may hold (:func:`_switch`): every
    binding of the name a plain assignment of one (``quiet = m.no_sync() if i < k else
    contextlib.nullcontext()``), never a parameter, a loop variable, an import or anything else. One
    walk over the tree."""
    assigned: dict[str, list] = {}
    stores: dict[str, int] = {}  # every binding of a name as a Name: assignments, loop targets, with ... as
    other: set[str] = set(bindings)  # names bound otherwise: imports, parameters, functions, except ... as
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            assigned.setdefault(node.targets[0].id, []).append(node.value)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            stores[node.id] = stores.get(node.id, 0) + 1
        elif isinstance(node, ast.arg):
            other.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ExceptHandler)) and node.name:
            other.add(node.name)
    return {name for name, values in assigned.items() if stores.get(name) == len(values) and name not in other
            and all(_switch(v, modules, bindings, vocab) for v in values)}


def _switch(expr: ast.AST, modules: dict, bindings: dict, vocab: allowed_ops.Vocabulary) -> bool:
    """Whether ``expr`` makes a switch a ``with`` may hold (lesson 10): DDP's ``<value>.no_sync()`` (a
    method of a value, not of a module), ``contextlib.nullcontext()``, or a conditional of them. None of
    them sets a mode of torch's; a program cut short inside one leaves only its own worker changed."""
    if isinstance(expr, ast.IfExp):
        return _switch(expr.body, modules, bindings, vocab) and _switch(expr.orelse, modules, bindings, vocab)
    if not (isinstance(expr, ast.Call) and not expr.args and not expr.keywords):
        return False
    func = expr.func
    if isinstance(func, ast.Name):
        return bindings.get(func.id) == "contextlib:nullcontext"
    if not isinstance(func, ast.Attribute):
        return False
    module = _module_of(func.value, modules, vocab)
    if module is None:
        return func.attr == "no_sync" and "no_sync" in vocab.attributes
    return module.__name__ == "contextlib" and func.attr == "nullcontext"


def _held_context(item: ast.withitem, modules: dict, bindings: dict, switches: set,
                  vocab: allowed_ops.Vocabulary) -> bool:
    """Whether a ``with`` item, without ``as``, is a switch (:func:`_switch`) or a name bound only to
    switches (:func:`_switches`)."""
    if item.optional_vars is not None:
        return False
    expr = item.context_expr
    return expr.id in switches if isinstance(expr, ast.Name) else _switch(expr, modules, bindings, vocab)


def _constant(node: ast.expr) -> bool:
    """Whether ``node`` is a plain constant that cannot change: a literal of numbers, strings, bytes,
    booleans, None and tuples or frozensets of them (not a list, dict or set: the same object would serve
    every call of the program, a state to tell one probe's call from another's; red team, 2026-12-01), or
    ``float("inf")``, ``-float("inf")``, ``float("nan")`` (how :func:`course.bare.bare_program` writes
    the floats a literal cannot)."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "float" and not node.keywords
            and len(node.args) == 1 and isinstance(node.args[0], ast.Constant)
            and node.args[0].value in ("inf", "-inf", "nan")):
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Call):
        return _constant(node.operand)
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return False
    return _immutable(value)


def _changeable_default(arguments: ast.arguments) -> int | str | None:
    """The line of the first default value of ``arguments`` that is not a constant that cannot change."""
    for default in [*arguments.defaults, *arguments.kw_defaults]:
        if default is not None and not _constant(default):
            return getattr(default, "lineno", "?")
    return None


def _immutable(value: Any) -> bool:
    if isinstance(value, (tuple, frozenset)):
        return all(_immutable(v) for v in value)
    return value is None or type(value) in (bool, int, float, complex, str, bytes)


def _children(node: ast.AST):
    """``node``'s children, without the annotations (never evaluated where the program runs)."""
    for field, value in ast.iter_fields(node):
        if field in ("annotation", "returns", "type_comment"):
            continue
        for child in value if isinstance(value, list) else [value]:
            if isinstance(child, ast.AST):
                yield child


def _bound_names(tree: ast.Module) -> set[str]:
    """Every name the program binds: parameters, assignment and loop targets, handlers' and
    patterns' names, comprehension variables, its functions."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            names.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            names.add(node.rest)
    return names


def _imports(stmt: ast.stmt, helpers: tuple) -> list[tuple[str, str, str | None]]:
    """``(alias, module, member)`` for each name a top-level import binds (``member`` None for a
    module); a guarded import (``try: import x / except ImportError: pass``, as
    :func:`course.bare.bare_program` writes them) counts as the import."""
    if (isinstance(stmt, ast.Try) and len(stmt.body) == 1 and isinstance(stmt.body[0], (ast.Import, ast.ImportFrom))
            and not stmt.orelse and not stmt.finalbody and len(stmt.handlers) == 1
            and isinstance(stmt.handlers[0].type, ast.Name) and stmt.handlers[0].type.id == "ImportError"
            and all(isinstance(s, ast.Pass) for s in stmt.handlers[0].body)):
        stmt = stmt.body[0]
    if isinstance(stmt, ast.Import):
        return [(a.asname or a.name.split(".")[0], a.name if a.asname else a.name.split(".")[0], None)
                for a in stmt.names]
    if isinstance(stmt, ast.ImportFrom) and stmt.level == 0 and stmt.module:
        return [(a.asname or a.name, stmt.module, a.name) for a in stmt.names]
    raise Refused("its top level has a statement other than an import, a constant or a def "
                  f"(line {getattr(stmt, 'lineno', '?')})")


def read_program(source: Any, *, forbidden: tuple = (), helpers: tuple = (),
                 vocabulary: str = "tensors") -> tuple[str, dict]:
    """See :func:`_read`; a program nested too deeply to read is refused as well."""
    try:
        return _read(source, forbidden=forbidden, helpers=helpers, vocab=allowed_ops.VOCABULARIES[vocabulary])
    except (RecursionError, MemoryError, TooDeep):
        raise Refused("its program is nested too deeply to read") from None


def _read(source: Any, *, forbidden: tuple, helpers: tuple, vocab: allowed_ops.Vocabulary) -> tuple[str, dict]:
    """The judge's reading of a program sent as an answer's (see the module's docstring): the
    program to define, without its imports, and what its names are bound to (``{alias: "module"
    or "module:member"}``). A :class:`Refused` (an ``AssertionError``) names the first thing that
    is not allowed. ``forbidden``: words no module member it reads may have in its name
    (``"lstm"``); ``helpers``: the check's own functions it may import (``"course.fastpath.causal_mask"``);
    ``vocab``: the modules and attributes the exercise's programs may reach (:class:`course.allowed_ops.Vocabulary`)."""
    if not isinstance(source, str) or len(source) > MAX_PROGRAM_CHARS:
        raise Refused(f"its program is not text of at most {MAX_PROGRAM_CHARS:,} characters")
    tree = parse(source, say_too_deep=True)  # TooDeep: caught by read_program
    if tree is None:
        raise Refused("its program could not be read (it is not Python)")
    bindings: dict[str, str] = {}
    modules: dict[str, types.ModuleType] = {}
    unavailable: dict[str, str] = {}  # names imported from elsewhere (typing's, for annotations): not read
    classes: dict[str, str] = {}  # names bound to a class of allowed_ops.CLASSES
    contexts: dict[str, str] = {}  # names bound to a context manager of allowed_ops.CONTEXTS
    kept: list[ast.stmt] = []
    for stmt in tree.body:
        if isinstance(stmt, ast.FunctionDef):
            if stmt.decorator_list:
                raise Refused(f"{stmt.name} has a decorator: define it with a plain def")
            kept.append(stmt)
            continue
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            if not _constant(stmt.value):
                raise Refused(f"it sets {stmt.targets[0].id} to something other than a plain constant")
            kept.append(stmt)
            continue
        for alias, module, member in _imports(stmt, helpers):
            full = f"{module}.{member}" if member else module
            if member is None and module in vocab.reach or member and full in vocab.reach:
                bindings[alias] = full
                modules[alias] = importlib.import_module(full)
            elif member is None and module in MODULES or member and full in MODULES:
                unavailable[alias] = f"{_out_of_reach(full)} (as {alias})"
            elif member and full in helpers:
                bindings[alias] = f"{module}:{member}"
            elif member and module in MODULES:
                why = _member_refusal(importlib.import_module(module), member, forbidden, vocab)
                if why is None:
                    bindings[alias] = f"{module}:{member}"
                    if member in allowed_ops.CLASSES.get(module, ()):
                        classes[alias] = full
                    if member in allowed_ops.CONTEXTS.get(module, ()):
                        contexts[alias] = full
                else:
                    unavailable[alias] = f"{why} (as {alias})"
            else:
                unavailable[alias] = f"it reads {alias} ({full}), which a program may not use"
    bound = _bound_names(ast.Module(body=kept, type_ignores=[]))
    for name in sorted(bound & (set(bindings) | set(unavailable))):
        raise Refused(f"it binds {name} again, a name it imports")
    for name in sorted(bound):
        if name.startswith("__"):
            raise Refused(f"it binds {name}: names that start with __ are not for a program")
        if name in BUILTINS:  # the reading relies on them (isinstance's second argument, float("inf"))
            raise Refused(f"it binds {name}, the name of a builtin: call the variable something else")
    problems: list[tuple[tuple, str]] = []  # every refusal; the first in reading order is reported

    def refuse(node: ast.AST, why: str) -> None:
        problems.append(((getattr(node, "lineno", 0), getattr(node, "col_offset", 0),
                          getattr(node, "end_col_offset", 0)), why))

    # a module may be read only as the object of an attribute the list allows (torch.sigmoid), never
    # held as a value (T = torch, a default argument, a list of it), whose attributes nothing would check
    everything = list(ast.walk(ast.Module(body=kept, type_ignores=[])))
    objects = {id(n.value) for n in everything if isinstance(n, ast.Attribute)}
    # a class only where isinstance reads it: isinstance(x, torch.Tensor), isinstance(x, (Tensor, list))
    slots = {id(s) for n in everything if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == "isinstance" and len(n.args) == 2 and not n.keywords
             for s in ([n.args[1], *n.args[1].elts] if isinstance(n.args[1], ast.Tuple) else [n.args[1]])}
    # a context manager only as the call of a with statement, never held: with torch.no_grad():
    entered = {id(item.context_expr.func) for n in everything if isinstance(n, ast.With) for item in n.items
               if isinstance(item.context_expr, ast.Call) and item.optional_vars is None}
    switches = _switches(ast.Module(body=kept, type_ignores=[]), modules, bindings, vocab)
    stack: list[ast.AST] = list(kept)
    while stack:
        node = stack.pop()
        line = getattr(node, "lineno", "?")
        if type(node) not in _SYNTAX:
            refuse(node, f"it uses {_NAMED.get(type(node)) or type(node).__name__} (line {line}), which a program may not")
            continue
        if isinstance(node, ast.keyword) and node.arg is None:
            refuse(node, f"it passes keywords from a dict (**, line {line}): name each keyword")
        elif isinstance(node, ast.keyword) and (node.arg.startswith("_") or node.arg in _KEYWORDS_REFUSED):
            refuse(node, f"it passes the keyword {node.arg} (line {line}), which is not for a program")
        elif isinstance(node, ast.withitem) and _held_context(node, modules, bindings, switches, vocab):
            pass  # DDP's no_sync(), or a context the program holds (lesson 10): no mode of torch's to leave set
        elif isinstance(node, ast.withitem) and not (isinstance(node.context_expr, ast.Call)
                                                     and id(node.context_expr.func) in entered
                                                     and _context_of(node.context_expr.func, modules, contexts, vocab)):
            refuse(node.context_expr, f"it uses a with statement (line {getattr(node.context_expr, 'lineno', '?')}) "
                                      "other than `with torch.no_grad():`, `torch.enable_grad()`, "
                                      "`torch.inference_mode()`, `torch.autocast(...)` or `model.no_sync()`, "
                                      "without `as`")
        elif isinstance(node, ast.withitem) and _context_arguments(node.context_expr, modules, contexts, vocab):
            refuse(node.context_expr, f"{_context_arguments(node.context_expr, modules, contexts, vocab)} "
                                      f"(line {getattr(node.context_expr, 'lineno', '?')})")
        elif isinstance(node, ast.arguments) and _changeable_default(node):
            refuse(node, f"a default value (line {_changeable_default(node)}) is not a constant that cannot change (a "
                         "number, a string, None, a tuple of them): a list or dict there would be one object kept "
                         "between calls")
        elif isinstance(node, ast.FunctionDef) and (node.decorator_list or getattr(node, "type_params", None)):
            refuse(node, f"{node.name} has a decorator: define it with a plain def")
        elif isinstance(node, ast.Name):
            if node.id.startswith("__"):
                refuse(node, f"it reads {node.id}: names that start with __ are not for a program")
            elif isinstance(node.ctx, ast.Load) and node.id not in bound | set(bindings) | set(BUILTINS):
                refuse(node, unavailable.get(node.id) or (
                    f"it uses the builtin {node.id}, which is not among those a program may use ({', '.join(BUILTINS)})"
                    if hasattr(builtins, node.id) else
                    f"it reads {node.id}, which the program does not define (only what it defines, imports of torch "
                    "and math, plain constants, and a few builtins are there)"))
            elif node.id in classes and id(node) not in slots:
                refuse(node, f"it uses {classes[node.id]} (line {line}) other than as isinstance's second argument")
            elif node.id in contexts and id(node) not in entered:
                refuse(node, f"it uses {contexts[node.id]} (line {line}) other than as `with {node.id}(...):`, without as")
            elif node.id in modules and id(node) not in objects:
                refuse(node, f"it uses the module {node.id} as a value (line {line}): call its functions, "
                             f"{node.id}.<function>(...), and hold nothing else of it")
        elif isinstance(node, ast.Attribute):
            module = _module_of(node.value, modules, vocab)
            if not isinstance(node.ctx, ast.Load):
                refuse(node, f"it assigns to an attribute (.{node.attr}, line {line})")
            elif module is not None:
                why = _member_refusal(module, node.attr, forbidden, vocab)
                if why:
                    refuse(node, why)
                elif node.attr in allowed_ops.CLASSES.get(module.__name__, ()) and id(node) not in slots:
                    refuse(node, f"it uses {module.__name__}.{node.attr} (line {line}) other than as isinstance's "
                                 "second argument")
                elif node.attr in allowed_ops.CONTEXTS.get(module.__name__, ()) and id(node) not in entered:
                    refuse(node, f"it uses {module.__name__}.{node.attr} (line {line}) other than as "
                                 f"`with {module.__name__}.{node.attr}(...):`, without as")
                elif _module_of(node, modules, vocab) is not None and id(node) not in objects:
                    refuse(node, f"it uses the module {module.__name__}.{node.attr} as a value (line {line}): call its "
                                 "functions, and hold nothing else of it")
            elif node.attr not in vocab.attributes or any(w in node.attr.lower() for w in forbidden):
                refuse(node, f"it reads .{node.attr} (line {line}), which is not among the attributes a program may use "
                             "(tensors' methods of the allowed functions, shape, dtype, device and the like, and those "
                             "of lists, dicts and strings)")
        stack.extend(_children(node))
    if problems:
        raise Refused(min(problems)[1])
    module_text = ast.unparse(ast.Module(body=kept, type_ignores=[]))
    return module_text, bindings


def _quiet_print(*args: Any, **kwargs: Any) -> None:
    """``print`` in a program run for the judge: nothing is shown."""


def _imported(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
    """``__import__`` where a program runs, for PyTorch's C++ (which imports ``torch`` through the
    running frame's builtins, e.g. ``masked_fill`` with a Python float): modules already imported
    only. The program cannot name it (the reading refuses ``__`` names and ``import``)."""
    import sys

    if level != 0 or not isinstance(name, str) or name not in sys.modules:
        raise ImportError(f"{name!r} may not be imported by a program")
    return sys.modules[name] if fromlist else sys.modules[name.partition(".")[0]]


def define(source: Any, bindings: Any, name: Any) -> Callable:
    """In the program host: the function ``name`` of a program the judge read (:func:`read_program`),
    defined in a namespace of its own with the imports the judge read and :data:`BUILTINS` only (and
    an ``__import__`` of modules already imported, for torch's C++), its annotations never evaluated."""
    if not (isinstance(source, str) and isinstance(name, str) and isinstance(bindings, dict)):
        raise ValueError("a program is its source, its bindings and its function's name")
    space: dict[str, Any] = {"__builtins__": {n: getattr(builtins, n) for n in BUILTINS} | {
        "print": _quiet_print, "__import__": _imported}, "__name__": "answer"}
    for alias, target in bindings.items():
        module, _, member = str(target).partition(":")
        if not (module in MODULES or module.startswith("course.")) or not str(alias).isidentifier():
            raise ValueError(f"a program may not bind {alias} to {target}")
        value = importlib.import_module(module)
        space[alias] = getattr(value, member) if member else value
    code = compile(source, "<your program>", "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, space)  # noqa: S102 - the program the judge read; this process holds nothing of the grader's
    fn = space.get(name)
    if not isinstance(fn, types.FunctionType):
        raise ValueError(f"the program does not define {name}")
    # What was read and defined, for a check that runs it again elsewhere (lesson 10's workers). The
    # program cannot read it: an attribute a program may read is on allowed_ops.ATTRIBUTES, and this is not.
    fn.course_program = {"source": source, "bindings": dict(bindings), "name": name}
    return fn


def _check_sdpa(query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: Any, is_causal: Any, scale: Any,
                more: dict) -> None:
    """What :func:`checked_sdpa` lets through to PyTorch's kernel: query, key and value strided tensors
    of one rank, dtype and device, the same leading dimensions (no broadcasting, no grouped heads), key
    and value of one length, query and key of one width; a mask that broadcasts to the scores."""
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_nested for t in tensors):
        raise ValueError("query, key and value must be plain tensors")
    q, k, v = (tuple(t.shape) for t in tensors)
    if not (len(q) == len(k) == len(v) >= 2 and q[:-2] == k[:-2] == v[:-2] and k[-2] == v[-2] and q[-1] == k[-1]):
        raise ValueError(f"query, key and value must have one rank and the same leading dimensions, key and value "
                         f"one length, query and key one width; got {q}, {k} and {v}")
    if len({t.dtype for t in tensors}) != 1 or len({t.device for t in tensors}) != 1:
        raise ValueError("query, key and value must have one dtype and one device")
    scores = (*q[:-1], k[-2])
    if attn_mask is not None:
        if not (isinstance(attn_mask, torch.Tensor) and attn_mask.layout == torch.strided and not attn_mask.is_nested
                and attn_mask.dtype in (torch.bool, query.dtype) and attn_mask.device == query.device):
            raise ValueError("attn_mask must be a boolean tensor, or one of query's dtype, on query's device")
        try:
            fits = torch.broadcast_shapes(tuple(attn_mask.shape), scores) == torch.Size(scores)
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the scores {scores}")
    if type(dropout_p) not in (int, float) or not 0 <= dropout_p < 1 or type(is_causal) is not bool:
        raise ValueError("dropout_p must be a number in [0, 1) and is_causal a bool")
    if scale is not None and type(scale) not in (int, float):
        raise ValueError("scale must be a number or None")
    if any(name != "enable_gqa" or value is not False for name, value in more.items()):
        raise ValueError(f"F.scaled_dot_product_attention takes no {', '.join(sorted(more))} here")


def checked_sdpa(real: Callable) -> Callable:
    """``F.scaled_dot_product_attention`` as the program host runs it for programs: the arguments checked
    first (:func:`_check_sdpa`). PyTorch's CPU kernel takes the number of keys from ``value``, not
    ``key`` (pytorch/pytorch#193728): with a shorter ``key`` it reads past its end, and its backward
    writes past a gradient's (red team, 2026-12-01). The name stays PyTorch's, so a watcher that
    knows SDPA by name knows this one; its TorchFunctionMode sees PyTorch's own, called inside."""
    import functools

    @functools.wraps(real)
    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                     **more):
        _check_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, more)
        return real(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    **more)

    scaled_dot_product_attention.course_checked = True
    return scaled_dot_product_attention


def guard_script_host() -> None:
    """In the program host, once, before any program is defined: SDPA checked (:func:`checked_sdpa`)."""
    import torch.nn.functional as F

    if not getattr(F.scaled_dot_product_attention, "course_checked", False):
        F.scaled_dot_product_attention = checked_sdpa(F.scaled_dot_product_attention)


def host_state_untouched() -> None:
    """Raise where torch's thread state is not as a request to the program host expects it: autocast off,
    no ``TorchFunctionMode`` or dispatch mode on the stack, torch functions dispatched, inference mode
    off. A program cut short inside a ``with`` (a ``RecursionError`` in ``autocast``'s ``__enter__``)
    could leave autocast on for the host's later requests; they then fail, saying so."""
    left = []
    if any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda")):
        left.append("autocast on")
    if torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack():
        left.append("a mode on torch's stack")
    if not torch._C._is_torch_function_enabled() or torch.is_inference_mode_enabled():
        left.append("torch functions' handling changed")
    if left:
        raise RuntimeError(f"an earlier program left the process that runs programs again changed ({', '.join(left)}); "
                           "leave every with block as you entered it (no recursion that ends inside one)")


class Hosted(Remote):
    """An answer's program, defined in the program host: called and probed like the learner's name."""

    def __init__(self, link, name: str, label: str):
        super().__init__(link, name)
        self.label = label

    def __repr__(self) -> str:
        return f"<your program for {self.label}, run again by the grader>"


#: What a program may use, as the advice of a refusal says it (:func:`hosted`'s ``uses``).
USES = "torch, math, plain Python and the values it is given"


def hosted(fn: Any, name: str, *, forbidden: tuple = (), helpers: tuple = (), uses: str = USES,
           vocabulary: str = "tensors") -> Hosted | None:
    """``fn``'s program read by the judge and defined in the program host, to be called there. None
    outside the grader's judge: there the program is read all the same (a learner's notebook hears
    of a refusal before the grader does) and the caller's watcher decides alone. A program that
    cannot be read, is refused, or fails to define is an ``AssertionError`` that says why and what to do.
    ``vocabulary``: what the exercise's programs may reach (:data:`course.allowed_ops.VOCABULARIES`)."""
    from course import grader_hooks
    from course.bare import bare_program

    if isinstance(fn, Hosted) or not (is_remote(fn) or isinstance(inspect.unwrap(fn), types.FunctionType)):
        return None  # a scripted function, a builtin: the caller's other checks decide
    roots = tuple(dict.fromkeys(["torch", *(h.rpartition(".")[0] for h in helpers)]))
    program = probe(fn, bare_program, list(roots))
    advice = (f"The grader reads {name}'s program and runs it again in a process of its own: define it (and the "
              f"functions it calls) with def in a cell, using {uses}.")
    if not isinstance(program, dict) or "error" in program or not isinstance(program.get("source"), str):
        if not is_remote(fn):
            return None  # a function with no source to read (made by exec): nothing to say before grading
        why = program.get("error") if isinstance(program, dict) else None
        raise AssertionError(f"{name}: {why or 'its program did not come back'}. {advice}")
    fname = program.get("name") if isinstance(program.get("name"), str) else name
    try:
        source, bindings = read_program(program["source"], forbidden=tuple(forbidden), helpers=tuple(helpers),
                                        vocabulary=vocabulary)
    except Refused as exc:
        raise AssertionError(f"{name}, read by the grader: {exc}. {advice}") from None
    if grader_hooks.program_host is None or not is_remote(fn):
        return None  # the learner's notebook: read as the grader will read it, and not run again
    host = grader_hooks.program_host()
    try:
        reply = host.request({"op": "program", "source": source, "bindings": bindings, "name": fname})
    except (EOFError, OSError) as exc:
        raise AssertionError(f"{name}: the process that runs your program again ended ({exc}).") from None
    except Exception as exc:  # noqa: BLE001 - defining it raised there (its message crossed as data)
        raise AssertionError(f"{name}: your program, defined again by the grader, raised {type(exc).__name__}: "
                             f"{str(exc)[:500]}. {advice}") from None
    if not isinstance(reply, str):
        raise AssertionError(f"{name}: the process that runs your program again answered malformed.")
    return Hosted(host, reply, name)


#: How a check's messages name an answer's program run again in the program host: "lstm_cell" + AGAIN.
AGAIN = ", its program run again by the grader,"


def again(fn: Any, name: str, check: Callable[[Hosted, str], Any], *, forbidden: tuple = (),
          helpers: tuple = (), vocabulary: str = "tensors") -> None:
    """Under the grader's judge, ``check(program, label)`` on ``fn``'s program read by the judge and
    defined in the program host (:func:`hosted`), ``label`` being ``name`` + :data:`AGAIN` for its
    messages: the check the learner's answer just passed, run again on what the judge read. Outside
    the grader the program is only read, and nothing runs again."""
    program = hosted(fn, name, forbidden=forbidden, helpers=helpers, vocabulary=vocabulary)
    if program is not None:
        check(program, name + AGAIN)

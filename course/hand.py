"""Answers by hand that need torch: read by the judge, run again where nothing else of the learner's runs.

Some exercises ask for torch code written from small ops, and forbid PyTorch's one-call version
(lesson 1's LSTM from ``mm``, ``sigmoid`` and ``tanh``, not ``torch.lstm_cell``; lesson 9's attention
from ``softmax``, not SDPA). In the learner's process the course's watcher reports which ops an
answer called: that process's word, which a learner who forges from C controls. The bare host
(:mod:`course.bare`) cannot take these answers, since they need torch. Under the grader the judge
instead **reads** the answer's program itself and runs it again in the script host
(``autograder/sandbox/script_host.py``, a confined process with torch that holds nothing of the
grader's):

1. The learner's process sends the program: the answer's ``def``, the notebook's functions it
   calls, and the imports and constants it reads (:func:`course.bare.bare_program`). That text is
   its word, and it need not be believed: whatever comes is what runs.
2. The judge reads it (:func:`read_program`) against a list of what such a program may do: at its
   top level only imports of torch, its ``nn.functional``, ``linalg``, ``special`` and ``fft``,
   ``math`` and the check's own helpers, plain constants and ``def``\\s without decorators; inside, names
   that the program binds, a short list of builtins, module members that are tensor functions
   (PyTorch's one-call ops for the exercise and anything that sets torch's global state, loads,
   saves or compiles are not), and attributes read on values by names public on tensors, lists,
   tuples, dicts and strings (hooks, storage, ``apply_``, ``format`` are not). No ``_`` name,
   no attribute assigned, no class, ``global``, ``import`` or ``with`` inside. What is not on the
   list is refused with a message that names it: the list is what makes forging impossible to
   write, not a search for the ways to forge.
3. The script host builds a namespace from the imports the judge read, with those builtins only,
   and defines the program there (annotations are not evaluated). The judge then calls it as it
   calls the learner's process, on its own inputs, compares the values, and runs the course's
   watcher there: in a process where nothing of the learner's ran before, on a program that
   cannot name what would blind it.

Outside the grader there is no script host, and :func:`hosted` returns None: the watcher in the
learner's process decides alone (the learner's own notebook).
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

from course.cells import TooDeep, parse
from course.remote import Remote, is_remote, probe

__all__ = ["Hosted", "define", "hosted", "read_program"]

#: Modules a program may import and read members of (and the check's named helpers).
MODULES = ("torch", "torch.nn", "torch.nn.functional", "torch.linalg", "torch.special", "torch.fft", "math")

#: Builtins a program may read: plain Python on plain values. ``print`` prints nothing there.
BUILTINS = ("abs", "all", "any", "bool", "dict", "divmod", "enumerate", "filter", "float", "frozenset", "int",
            "isinstance", "iter", "len", "list", "map", "max", "min", "next", "pow", "print", "range", "repr",
            "reversed", "round", "set", "slice", "sorted", "str", "sum", "tuple", "zip",
            "ArithmeticError", "AssertionError", "Exception", "IndexError", "KeyError", "NotImplementedError",
            "RuntimeError", "TypeError", "ValueError", "ZeroDivisionError")

#: Module members never allowed, whatever the exercise: torch's global state, files, compilers.
DENIED_MEMBERS = frozenset({"load", "save", "from_file", "compile", "manual_seed", "seed", "initial_seed", "cond",
                            "while_loop", "fork", "wait", "import_ir_module", "import_ir_module_from_buffer",
                            "export", "jit", "vmap", "library", "ops", "classes", "overrides", "frombuffer",
                            "from_dlpack", "from_numpy", "asarray"})
DENIED_PREFIXES = ("set_", "register", "use_", "sym_", "enable_", "disable_")

#: Attribute names never allowed on values: what reaches code, memory or autograd's machinery.
DENIED_ATTRIBUTES = frozenset({"register_hook", "register_post_accumulate_grad_hook", "backward", "grad_fn",
                               "data_ptr", "storage", "untyped_storage", "storage_type", "apply_", "map_", "map2_",
                               "as_subclass", "numpy", "share_memory_", "set_", "record_stream", "module_load",
                               "format", "format_map", "mro", "maketrans", "retain_grad", "new",
                               "pin_memory", "is_shared", "to_dlpack"})

#: Statements and expressions a program may not contain anywhere.
_REFUSED_NODES = {ast.Global: "a global statement", ast.Nonlocal: "a nonlocal statement",
                  ast.ClassDef: "a class", ast.AsyncFunctionDef: "an async def", ast.Await: "await",
                  ast.AsyncFor: "async for", ast.AsyncWith: "async with", ast.With: "a with statement",
                  ast.Yield: "yield", ast.YieldFrom: "yield from", ast.Import: "an import inside a function",
                  ast.ImportFrom: "an import inside a function"}

MAX_PROGRAM_CHARS = 200_000


def _public_attributes(*types_: type) -> frozenset:
    return frozenset(a for t in types_ for a in dir(t) if not a.startswith("_"))


#: Attribute names a program may read on a value.
ATTRIBUTES = _public_attributes(torch.Tensor, torch.Size, torch.dtype, torch.device, list, tuple, dict, str, int,
                                float) - DENIED_ATTRIBUTES


class Refused(AssertionError):
    """What the judge's reading of a program refused, and why."""


def _member_refusal(module: types.ModuleType, attr: str, forbidden: tuple) -> str | None:
    """Why ``module.attr`` may not be read by a program (None: it may)."""
    where = f"{module.__name__}.{attr}"
    if attr.startswith("_"):
        return f"it reads {where}: names that start with _ are not for a program"
    if any(word in attr.lower() for word in forbidden):
        return f"it calls {where}, the one-call version of what the exercise asks to write"
    if attr in DENIED_MEMBERS or attr.startswith(DENIED_PREFIXES):
        return f"it reads {where}, which is not among the tensor functions a program may use"
    member = vars(module).get(attr)  # what the module holds (no lazy import of a submodule here)
    if isinstance(member, types.ModuleType):
        return None if member.__name__ in MODULES else f"it reads the module {member.__name__}"
    if isinstance(member, (torch.dtype, bool, int, float)):
        return None
    if isinstance(member, types.BuiltinFunctionType) and (
            member.__self__ is None or getattr(member.__self__, "__name__", None) in _OP_HOMES):
        return None  # one of PyTorch's ops (torch.sigmoid, F.linear, torch.linalg.inv) or math's
    if isinstance(member, types.FunctionType) and member.__module__ in _FUNCTION_HOMES:
        return None  # written in Python from those ops (torch.einsum, F.softmax)
    return f"it reads {where}, which is not among the tensor functions a program may use"


#: Where the builtin functions a program may call are bound: PyTorch's op tables, and math.
_OP_HOMES = frozenset({"torch._C._nn", "torch._C._linalg", "torch._C._special", "torch._C._fft", "math"})
#: The modules whose Python functions a program may call.
_FUNCTION_HOMES = frozenset({"torch.functional", "torch.nn.functional", "torch._linalg_utils", "torch._lowrank",
                             "torch._lobpcg"})


def _module_of(node: ast.AST, modules: dict) -> types.ModuleType | None:
    """The module an expression names (a module's alias, or an allowed submodule of one), else None."""
    if isinstance(node, ast.Name):
        return modules.get(node.id)
    if isinstance(node, ast.Attribute) and not node.attr.startswith("_"):
        parent = _module_of(node.value, modules)
        member = vars(parent).get(node.attr) if parent is not None else None
        if isinstance(member, types.ModuleType) and member.__name__ in MODULES:
            return member
    return None


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


def read_program(source: Any, *, forbidden: tuple = (), helpers: tuple = ()) -> tuple[str, dict]:
    """See :func:`_read`; a program nested too deeply to read is refused as well."""
    try:
        return _read(source, forbidden=forbidden, helpers=helpers)
    except (RecursionError, MemoryError, TooDeep):
        raise Refused("its program is nested too deeply to read") from None


def _read(source: Any, *, forbidden: tuple = (), helpers: tuple = ()) -> tuple[str, dict]:
    """The judge's reading of a program sent as an answer's (see the module's docstring): the
    program to define, without its imports, and what its names are bound to (``{alias: "module"
    or "module:member"}``). A :class:`Refused` (an ``AssertionError``) names the first thing that
    is not allowed. ``forbidden``: words no module member it reads may have in its name
    (``"lstm"``); ``helpers``: the check's own functions it may import (``"course.fastpath.causal_mask"``)."""
    if not isinstance(source, str) or len(source) > MAX_PROGRAM_CHARS:
        raise Refused(f"its program is not text of at most {MAX_PROGRAM_CHARS:,} characters")
    tree = parse(source, say_too_deep=True)  # TooDeep: caught by read_program
    if tree is None:
        raise Refused("its program could not be read (it is not Python)")
    bindings: dict[str, str] = {}
    modules: dict[str, types.ModuleType] = {}
    unavailable: dict[str, str] = {}  # names imported from elsewhere (typing's, for annotations): not read
    kept: list[ast.stmt] = []
    for stmt in tree.body:
        if isinstance(stmt, ast.FunctionDef):
            if stmt.decorator_list:
                raise Refused(f"{stmt.name} has a decorator: define it with a plain def")
            kept.append(stmt)
            continue
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            try:
                ast.literal_eval(stmt.value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                raise Refused(f"it sets {stmt.targets[0].id} to something other than a plain constant") from None
            kept.append(stmt)
            continue
        for alias, module, member in _imports(stmt, helpers):
            full = f"{module}.{member}" if member else module
            if member is None and module in MODULES or member and full in MODULES:
                bindings[alias] = full
                modules[alias] = importlib.import_module(full)
            elif member and full in helpers:
                bindings[alias] = f"{module}:{member}"
            elif member and module in MODULES:
                why = _member_refusal(importlib.import_module(module), member, forbidden)
                if why is None:
                    bindings[alias] = f"{module}:{member}"
                else:
                    unavailable[alias] = f"{why} (as {alias})"
            else:
                unavailable[alias] = f"it reads {alias} ({full}), which a program may not use"
    bound = _bound_names(ast.Module(body=kept, type_ignores=[]))
    for name in bound & (set(bindings) | set(unavailable)):
        raise Refused(f"it binds {name} again, a name it imports")
    problems: list[tuple[tuple, str]] = []  # every refusal; the first in reading order is reported

    def refuse(node: ast.AST, why: str) -> None:
        problems.append(((getattr(node, "lineno", 0), getattr(node, "col_offset", 0),
                          getattr(node, "end_col_offset", 0)), why))

    stack: list[ast.AST] = list(kept)
    while stack:
        node = stack.pop()
        kind = _REFUSED_NODES.get(type(node))
        if kind:
            refuse(node, f"it uses {kind} (line {getattr(node, 'lineno', '?')})")
        elif isinstance(node, ast.FunctionDef) and node.decorator_list:
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
        elif isinstance(node, ast.Attribute):
            module = _module_of(node.value, modules)
            if not isinstance(node.ctx, ast.Load):
                refuse(node, f"it assigns to an attribute (.{node.attr}, line {node.lineno})")
            elif module is not None:
                why = _member_refusal(module, node.attr, forbidden)
                if why:
                    refuse(node, why)
            elif node.attr not in ATTRIBUTES:
                refuse(node, f"it reads .{node.attr} (line {node.lineno}), which is not among the attributes a "
                             "program may use (those of tensors, lists, tuples, dicts and strings)")
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
    """In the script host: the function ``name`` of a program the judge read (:func:`read_program`),
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
    return fn


class Hosted(Remote):
    """An answer's program, defined in the script host: called and probed like the learner's name."""

    def __init__(self, link, name: str, label: str):
        super().__init__(link, name)
        self.label = label

    def __repr__(self) -> str:
        return f"<your program for {self.label}, run again by the grader>"


def hosted(fn: Any, name: str, *, forbidden: tuple = (), helpers: tuple = ()) -> Hosted | None:
    """``fn``'s program read by the judge and defined in the script host, to be called there. None
    outside the grader's judge: there the program is read all the same (a learner's notebook hears
    of a refusal before the grader does) and the caller's watcher decides alone. A program that
    cannot be read, is refused, or fails to define is an ``AssertionError`` that says why and what to do."""
    from course import grader_hooks
    from course.bare import bare_program

    if isinstance(fn, Hosted) or not (is_remote(fn) or isinstance(inspect.unwrap(fn), types.FunctionType)):
        return None  # a scripted function, a builtin: the caller's other checks decide
    roots = tuple(dict.fromkeys(["torch", *(h.rpartition(".")[0] for h in helpers)]))
    program = probe(fn, bare_program, list(roots))
    advice = (f"The grader reads {name}'s program and runs it again in a process of its own: define it (and the "
              "functions it calls) with def in a cell, using torch, math, plain Python and the values it is given.")
    if not isinstance(program, dict) or "error" in program or not isinstance(program.get("source"), str):
        if not is_remote(fn):
            return None  # a function with no source to read (made by exec): nothing to say before grading
        why = program.get("error") if isinstance(program, dict) else None
        raise AssertionError(f"{name}: {why or 'its program did not come back'}. {advice}")
    fname = program.get("name") if isinstance(program.get("name"), str) else name
    try:
        source, bindings = read_program(program["source"], forbidden=tuple(forbidden), helpers=tuple(helpers))
    except Refused as exc:
        raise AssertionError(f"{name}, read by the grader: {exc}. {advice}") from None
    if grader_hooks.script_host is None or not is_remote(fn):
        return None  # the learner's notebook: read as the grader will read it, and not run again
    host = grader_hooks.script_host()
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

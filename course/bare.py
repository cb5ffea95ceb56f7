"""Answers by hand, run again where there is no torch: the grader's bare host.

Some exercises ask for a rule worked out by hand (lesson 7's broadcasting rule, lesson 3's strides),
and a library call would give the answer away (``torch.broadcast_shapes``, a meta tensor's
``.stride()``). In the learner's own process the course watches the calls the answer makes; that
is a report from a process a determined learner controls. Under the grader the judge also runs
the answer in the **bare host** (``autograder/sandbox/bare_host.py``): a confined Python with its
standard library and no installed package, so that neither torch nor NumPy can be imported,
loaded or read there. What it returns on the judge's inputs was computed without them.

What crosses is the answer's *program*: its ``def`` and what it needs, as source text read from the
notebook by :func:`bare_program` in the learner's process (the functions of the notebook it calls,
the standard-library modules and names it uses, plain constants). That text is the learner's
process's word, and it does not matter what it says: whatever program comes, it runs where torch
is not, on inputs it did not choose (drawn from the class's key; some sizes up to 4,096, so no
table fits), and its outputs are compared here.

Outside the grader (a learner's notebook, the course's tests), there is no bare host and
:func:`run_bare` returns None: the course's watcher in the learner's process decides alone.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import types
from typing import Any, Callable

from course.remote import is_remote, probe, prober

__all__ = ["Other", "as_tuples", "bare_program", "expect_value", "outcome_said", "outcome_value", "run_bare"]

#: Largest constant of the notebook's that a program carries (its ``repr``), and the program itself.
MAX_CONSTANT_CHARS = 20_000
MAX_PROGRAM_CHARS = 200_000


def _stdlib(module_name: str, modules: tuple = ()) -> bool:
    """Whether ``module_name`` is of the standard library, or one of ``modules`` (or inside one)."""
    return isinstance(module_name, str) and (module_name.split(".")[0] in sys.stdlib_module_names or any(
        module_name == m or module_name.startswith(m + ".") for m in modules))


def _global_names(code: types.CodeType) -> set[str]:
    """The names ``code`` (and the functions, lambdas and comprehensions inside it) may read as globals."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _definition_names(source: str) -> set[str]:
    """The names a ``def``'s decorators and default values read: evaluated where it is defined, so
    its code does not name them."""
    try:
        body = ast.parse(source).body
    except (SyntaxError, ValueError, RecursionError):
        return set()
    node = body[0] if body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return set()
    exprs = [*node.decorator_list, *node.args.defaults, *[d for d in node.args.kw_defaults if d is not None]]
    return {n.id for e in exprs for n in ast.walk(e) if isinstance(n, ast.Name)}


def _literal(value: Any) -> str | None:
    """``repr(value)`` if it is a plain constant that reads back as itself (numbers, strings,
    containers of them), short enough to carry; else None."""
    if not isinstance(value, (int, float, str, bytes, tuple, list, dict, set, frozenset, type(None))):
        return None
    if type(value) is float and value != value or value in (float("inf"), float("-inf")):
        return f"float({repr(value)!r})"  # NEG_INF = float("-inf"): no literal writes it
    try:
        text = repr(value)
        if len(text) > MAX_CONSTANT_CHARS or ast.literal_eval(text) != value:
            return None
    except Exception:  # noqa: BLE001 - a subclass with a repr of its own, a NaN, deep nesting...
        return None
    return text


def _import_line(name: str, value: Any, modules: tuple = ()) -> str | None:
    """The line that binds ``name`` to ``value`` from the standard library (or from one of
    ``modules``), if it comes from there."""
    if isinstance(value, types.ModuleType):
        return f"import {value.__name__} as {name}" if _stdlib(value.__name__, modules) else None
    module = getattr(value, "__module__", None)
    homes = [m for m in dict.fromkeys((module, *modules)) if _stdlib(m, modules) and m in sys.modules]
    for home in homes:  # torch.einsum's __module__ is torch.functional; it is imported from torch
        for attr in dict.fromkeys((name, getattr(value, "__name__", None))):
            if isinstance(attr, str) and attr.isidentifier() and getattr(sys.modules[home], attr, None) is value:
                return f"from {home} import {attr} as {name}"
    return None


@prober
def bare_program(fn: Callable, modules: list | tuple = ()) -> dict:
    """The learner's side: ``fn``'s program as text (``{"source": ..., "name": ...}``), or why
    there is none (``{"error": ...}``). The program binds what ``fn`` reads as globals, so that it
    runs in a fresh namespace: standard-library imports first, then plain constants, then the
    source of every function of the notebook it reaches. Anything else it reads (torch, NumPy,
    a tensor, an object) is left out, and the program fails where it reads it. ``modules``: more
    modules whose imports travel (``"torch"``: for :mod:`course.hand`, whose host has torch)."""
    modules = tuple(m for m in modules if isinstance(m, str))
    fn = inspect.unwrap(fn)
    if not isinstance(fn, types.FunctionType):
        return {"error": f"it is a {type(fn).__name__}, not a function defined with def"}
    home = fn.__globals__
    imports, constants, sources, left = [], [], [], []
    seen_names: set[str] = set()
    todo, done = [fn], set()
    while todo:
        f = todo.pop()
        if id(f) in done:
            continue
        done.add(id(f))
        try:
            sources.append(textwrap.dedent(inspect.getsource(f)))
        except (OSError, TypeError) as exc:
            return {"error": f"the source of {getattr(f, '__name__', '?')} could not be read ({exc})"}
        for name in sorted((_global_names(f.__code__) | _definition_names(sources[-1])) - seen_names):
            seen_names.add(name)
            if name not in home:
                continue  # a builtin, an attribute's name, or unbound: the program reads it as fn would
            value = home[name]
            if isinstance(value, types.FunctionType) and value.__globals__ is home:
                todo.append(value)
            elif (line := _import_line(name, value, modules)) is not None:
                imports.append(line)
            elif (text := _literal(value)) is not None:
                constants.append(f"{name} = {text}")
            else:  # torch, NumPy, a tensor, an object: the program fails where it reads it
                left.append(name)
    guarded = [f"try:\n    {line}\nexcept ImportError:\n    pass" for line in imports]
    source = "\n".join([*guarded, *constants, *reversed(sources)]) + "\n"
    if len(source) > MAX_PROGRAM_CHARS:
        return {"error": f"its program is {len(source):,} characters long, over {MAX_PROGRAM_CHARS:,}"}
    return {"source": source, "name": fn.__name__, "left": left[:50]}


class Other:
    """What an answer returned in the bare host that is not a plain value (only its description crossed)."""

    def __init__(self, text: str):
        self.text = str(text)[:300]

    def __repr__(self) -> str:
        return f"<{self.text}>"


def as_tuples(value: Any) -> Any:
    """``value`` with every list and tuple in it a tuple: an answer as the bare host's JSON carries
    it (lists) and as the learner's process returned it (either) compare alike."""
    return tuple(as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def outcome_value(outcome: dict) -> Any:
    """The value an outcome of the bare host carries (lists come back as tuples), or :class:`Other`."""
    return as_tuples(outcome["value"]) if "value" in outcome else Other(outcome.get("other", "?"))


def outcome_said(outcome: dict) -> str:
    """What an outcome of the bare host did, in words ("it raised ValueError: ..." or "it returned
    ..."), for a message about an answer that did not do what it should have."""
    if "raised" in outcome:
        return f"it raised {outcome.get('raised')}: {str(outcome.get('message'))[:300]}"
    return f"it returned {outcome_value(outcome)!r}"[:400]


def expect_value(outcome: dict, where: str, advice: str) -> Any:
    """The plain value an outcome of the bare host carries (lists as tuples); an outcome that raised,
    or returned what cannot travel, is an ``AssertionError``: ``where``, what it did, ``advice``."""
    if "value" in outcome:
        return outcome_value(outcome)
    raise AssertionError(f"{where}: {outcome_said(outcome)}. {advice}")


def _shown(case) -> tuple:
    return tuple(tuple(x) if isinstance(x, list) else x for x in case)


def run_bare(fn: Any, cases: list, *, name: str) -> list[dict] | None:
    """``fn(*case)`` for every case, run in the bare host (a Python without torch or NumPy), as
    outcomes: ``{"value": ...}`` (plain values; tuples as lists), ``{"raised": type name,
    "message": ...}`` or ``{"other": description}``. None where there is no bare host (outside the
    grader's judge, or ``fn`` is not the learner's name there): the caller's watcher decides alone.
    An answer whose program cannot be read or fails to run there is an ``AssertionError`` that says
    why and what to do."""
    from course import grader_hooks

    if grader_hooks.bare_host is None or not is_remote(fn):
        return None
    program = probe(fn, bare_program)
    advice = (f"The grader runs {name} again in a Python that has only its standard library (no torch, no "
              "NumPy), to confirm the rule is worked out by hand: define it with def in a cell, and let it (and the "
              "helpers it calls, defined with def too) use plain Python only.")
    if not isinstance(program, dict) or "error" in program or not isinstance(program.get("source"), str):
        why = program.get("error") if isinstance(program, dict) else None
        raise AssertionError(f"{name}: {why or 'its program did not come back'}. {advice}")
    host = grader_hooks.bare_host()
    try:
        with grader_hooks.learner_stopped():  # nothing runs beside it on the learner's side
            reply = host.request({"op": "run", "source": program["source"], "name": program.get("name") or name,
                                  "cases": [list(c) for c in cases]})
    except (EOFError, OSError) as exc:  # the program ended the process that ran it
        raise AssertionError(f"{name}: run without torch, the program ended the process that ran it ({exc}). "
                             f"{advice}") from None
    if isinstance(reply, dict) and isinstance(reply.get("error"), str):
        raise AssertionError(f"{name}: run without torch, the program failed ({reply['error']}). {advice}")
    outcomes = reply.get("outcomes") if isinstance(reply, dict) else None
    if not (isinstance(outcomes, list) and len(outcomes) == len(cases)
            and all(isinstance(o, dict) and len(o.keys() & {"value", "raised", "other"}) == 1 for o in outcomes)):
        raise AssertionError(f"{name}: the bare host's answers came back malformed.")
    left = [n for n in program.get("left") or [] if isinstance(n, str)]
    for case, outcome in zip(cases, outcomes):
        shown = str(_shown(case))
        shown = shown if len(shown) <= 160 else shown[:150] + " ...)"  # a trace or a program: its start
        message, call = str(outcome.get("message")), f"{name}{shown}, run without torch,"
        if outcome.get("raised") in ("NameError", "ModuleNotFoundError", "ImportError", "AttributeError") and \
                any(lib in message for lib in ("torch", "numpy", "'np'")):
            raise AssertionError(f"{call} raised {outcome['raised']}: {message}. {advice}")
        missing = [n for n in left if f"'{n}'" in message]
        if outcome.get("raised") == "NameError" and missing:
            raise AssertionError(
                f"{call} raised NameError: it reads {missing[0]}, a name of your notebook that the program could not "
                "carry (only functions defined with def, standard-library modules and names, and plain constants "
                f"of at most {MAX_CONSTANT_CHARS:,} characters travel). {advice}")
    return outcomes

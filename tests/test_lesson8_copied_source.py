"""Lesson 8's answers are not in the course a learner can read (red team, 2026-12-05).

A learner's cell read ``course/traces.py`` as text (``open(course.traces.__file__)``), stripped the
``@reference`` guard, ran it with ``exec`` and answered ``op_table`` and ``ops_diff`` with it; it
answered ``find_races`` with ``course.streams._replay``'s body beside torch's sanitizer. The bare host
proves only that the answer's program does not call torch or the course, not whose source it is,
so copied source passed. The op table, the diff and the sanitizer's replay now live in
``course.references`` (hidden from the learner's process and left out of a learner's copy): these
tests read every visible module as that cell did, and find nothing there that answers them.
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import pkgutil
from pathlib import Path

import pytest

import course
from course.checks.profiling import check_find_races, check_op_table, check_ops_diff

COURSE = Path(course.__file__).resolve().parent

#: The functions that answer lesson 8's exercises (and the private ones they are built of).
ANSWERS = {"op_table", "ops_diff", "compare_traces", "_rows", "_events", "_iteration_of", "_chosen",
           "find_races", "sanitizer_races_many", "_replay"}
#: What only code that converts the sanitizer's reports, or reads a trace as HTA does, is made of.
TELLTALES = ("_handle_kernel_launch", "current_access", "previous_access", "math.ceil(float(ts))")


def _visible_sources() -> dict[str, str]:
    """Every module of the course a learner's copy has (all but ``course/references``), by name."""
    found = {}
    for info in pkgutil.walk_packages([str(COURSE)], "course."):
        if info.name.startswith("course.references") or info.ispkg:
            continue
        path = COURSE.joinpath(*info.name.split(".")[1:]).with_suffix(".py")
        found[info.name] = path.read_text()
    return found


def test_no_visible_module_defines_or_holds_an_answer_to_lesson_8():
    """No function of a visible module is named as an answer (or its parts), and no visible source
    holds the code they are made of."""
    sources = _visible_sources()
    assert {"course.traces", "course.streams", "course.checks.profiling"} <= set(sources)
    defined = {}
    for name, text in sources.items():
        names = {n.name for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        if names & ANSWERS:
            defined[name] = sorted(names & ANSWERS)
        for telltale in TELLTALES:
            assert telltale not in text, f"{name} holds {telltale!r}: code that answers lesson 8 is visible"
    assert defined == {}, defined


def _learners_import(name, globals=None, locals=None, fromlist=(), level=0):
    """``import`` as in the learner's process under the grader: ``course.references`` is hidden."""
    if name == "course.references" or name.startswith("course.references."):
        raise ImportError(f"No module named {name!r} (hidden from the learner's process)")
    return builtins.__import__(name, globals, locals, fromlist, level)


def _copied(module_name: str) -> dict:
    """The module's source as the red team's cell ran it: read as text, every ``@reference`` line
    taken out, executed as a cell's code (where ``course.references`` cannot be imported)."""
    text = (COURSE / (module_name.split(".", 1)[1].replace(".", "/") + ".py")).read_text()
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("@reference"))
    namespace = {"__name__": f"copied_{module_name.replace('.', '_')}",
                 "__builtins__": {**vars(builtins), "__import__": _learners_import}}
    exec(compile(text, f"<copied {module_name}>", "exec"), namespace)
    return namespace


def _functions(namespace: dict, positional: int) -> dict:
    """The functions the copied source defines that can be called with ``positional`` arguments,
    and, where one takes ``rounding``, the same with ``rounding=False`` (the exercise's times: the
    old ``op_table`` answered so)."""
    out = {}
    for name, value in namespace.items():
        if not inspect.isfunction(value) or value.__globals__ is not namespace:
            continue
        signature = inspect.signature(value)
        try:
            signature.bind(*range(positional))
        except TypeError:
            continue
        out[name] = value
        if "rounding" in signature.parameters:
            out[f"{name}(rounding=False)"] = functools.partial(value, rounding=False)
    return out


@pytest.fixture(scope="module")
def copies():
    return {name: _copied(name) for name in ("course.traces", "course.streams")}


@pytest.mark.parametrize("exercise, check, positional, args", [
    ("op_table", check_op_table, 2, dict(seed=3, n=1)),
    ("ops_diff", check_ops_diff, 2, dict(seed=3, n=1)),
    ("find_races", check_find_races, 1, dict(seed=3, n=12)),
])
def test_no_function_of_the_copied_trace_or_stream_module_answers_lesson_8(copies, exercise, check, positional, args):
    """The attack itself, every function of the copied modules tried as the answer, on inputs the
    grader's hidden call makes (another seed than the lesson's own): each fails the check.
    ``sanitizer_races`` is still there for the lesson's cell, but in a learner's process it only
    looks up the reports stored for the lesson's own programs."""
    tried = []
    for module_name, namespace in copies.items():
        for name, fn in _functions(namespace, positional).items():
            tried.append(f"{module_name}.{name}")
            with pytest.raises(AssertionError):
                check(fn, **args)
    assert tried
    if exercise == "find_races":
        assert "course.streams.sanitizer_races" in tried
        assert "course.streams.stored_races" in tried


@pytest.fixture(scope="module")
def sol(tmp_path_factory):
    from autograder.solution_code import load_solution, solution_source

    return load_solution(solution_source("08_profiling_trace_diff"), tmp_path_factory.mktemp("sol8c") / "sol8c.py",
                         "copied_source_solution8")


def test_a_learners_copy_keeps_the_lessons_cells_and_visible_checks(learners_copy, sol, capsys):
    """Without ``course.references``: the visible checks compare with the answers stored for their
    own calls (and refuse others), ``sanitizer_races`` gives the planted race's reports, and
    ``explain_diff`` still names what SDPA deleted and added (its rough reading, not HTA's table)."""
    import torch
    import torch.nn.functional as F

    from course import streams, traces
    from course.profiling import attention_inputs, naive_attention

    check_op_table(sol.op_table)
    check_ops_diff(sol.ops_diff)
    check_find_races(sol.find_races)
    out = capsys.readouterr().out
    assert out.count("ok: ") == 3, out
    for check, answer in ((check_op_table, sol.op_table), (check_ops_diff, sol.ops_diff),
                          (check_find_races, sol.find_races)):
        with pytest.raises(AssertionError, match="reference data for .* only"):
            check(answer, seed=11, n=4)
    assert streams.sanitizer_races(streams.planted_race()) == [(1, "read-after-write", "x", 1)]
    assert streams.sanitizer_races(streams.planted_race_fixed()) == []
    with pytest.raises(LookupError, match="lesson's own"):
        streams.sanitizer_races([("launch", 5, (), ("z",)), ("launch", 6, ("z",), ())])
    q, k, v = attention_inputs(0, batch=1, heads=2, length=64, dim=16)
    with torch.no_grad():
        naive = traces.profile_steps(lambda: naive_attention(q, k, v), steps=2)
        sdpa = traces.profile_steps(lambda: F.scaled_dot_product_attention(q, k, v), steps=2)
    said = traces.explain_diff(sdpa, naive)
    assert any(line.startswith("no aten::_scaled_dot_product_flash_attention_for_cpu ran") for line in said), said
    assert any("aten::bmm" in line for line in said), said
    assert traces.iterations(naive) == [1, 2]
    with pytest.raises(RuntimeError, match="grader's"):
        traces.summary(naive)


def test_in_a_learners_process_the_stored_reports_show_the_demo_and_refuse_to_answer(learners_copy, monkeypatch):
    """Under the grader the learner's process is a learner's copy: the lesson's cell still prints the
    planted race's reports, and ``find_races = sanitizer_races`` (a lookup of the stored ones) is
    refused and reported, as the replay was when it lived in ``course.streams``."""
    import course.grader_hooks as hooks
    from course import streams
    from served_helpers import expect_refused

    monkeypatch.setattr(hooks, "learner_prefix", "/nowhere/learner-cells/")
    assert streams.sanitizer_races(streams.planted_race()) == [(1, "read-after-write", "x", 1)]
    expect_refused(monkeypatch, lambda: check_find_races(streams.sanitizer_races))


@pytest.mark.parametrize("wrong, named", [("every_iteration", "every iteration"),
                                          ("only_cpu_ops", "only 'cat' == 'cpu_op'"),
                                          ("with_gpu_work", "GPU work"), ("last_iteration", "last iteration")])
def test_a_learners_copy_names_a_misread_trace_from_the_stored_misreadings(learners_copy, wrong, named):
    """The known misreadings of a trace are stored beside the answers, so a learner's copy names them
    too (the misreadings are HTA's reading bent: the grader's, like the reading itself)."""
    import test_checks_profiling as T

    with pytest.raises(AssertionError, match=named):
        check_op_table(getattr(T, wrong))

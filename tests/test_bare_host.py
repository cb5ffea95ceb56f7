"""The bare host: an answer asked for by hand runs again where there is no torch (``course.bare``,
``autograder/sandbox/bare_host.py``). In the learner's process, "called no torch function" is the
course watcher's report, which a learner who forges from C controls; in the bare host it is the
kernel's fact: its filesystem has the interpreter and the standard library, and no installed package."""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import sys
import textwrap

import pytest

from served_helpers import BROADCAST_RULE, cell_module, forging, served as _served

served = contextlib.contextmanager(_served)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A notebook's functions, as a learner writes them: a helper, a standard-library module and name,
# a constant, and a table too large to travel (and torch, which must not).
_NOTEBOOK = BROADCAST_RULE.replace("def broadcast_shape", "def _unused") + textwrap.dedent('''
    import functools
    import math
    from functools import reduce
    from typing import Tuple

    import torch

    ONE = 1
    TABLE = {i: str(i) for i in range(5000)}
    x = torch.ones(3)


    def pad(shape, n):
        return (ONE,) * (n - len(shape)) + tuple(shape)


    def broadcast_shape(a: Tuple[int, ...], b: Tuple[int, ...]) -> Tuple[int, ...]:
        n = max(len(a), len(b))
        out = []
        for p, q in zip(pad(a, n), pad(b, n)):
            if p != q and ONE not in (p, q):
                raise ValueError(f"sizes {p} and {q} differ")
            out.append(q if p == ONE else p)
        assert reduce(lambda u, v: u * v, out, 1) == math.prod(out)
        return tuple(out)


    @functools.lru_cache(maxsize=None)
    def cached(a, b, one=ONE):
        return broadcast_shape(a, b)


    def with_torch(a, b):
        return tuple(torch.broadcast_shapes(a, b))


    def with_table(a, b):
        return TABLE[len(a)]


    def from_tensor(a, b):
        return tuple(x.shape)
    ''')


@pytest.fixture(scope="module")
def notebook(tmp_path_factory):
    """The functions above, defined from a file (as the grader's cells are: their source is readable)."""
    return cell_module(tmp_path_factory.mktemp("notebook"), _NOTEBOOK, "learner_cell")


@pytest.fixture(scope="module")
def bare_link(tmp_path_factory):
    """A bare host started as the grader starts it (bubblewrap where it works), and the judge's end."""
    from autograder.sandbox import bwrap_works, parent, protocol
    from course.remote import Link

    call_r, call_w = os.pipe()
    reply_r, reply_w = os.pipe()
    env = parent._env({})
    host = parent._Proc("bare_host.py", [str(call_r), str(reply_w), parent._limits(2000, env)],
                        sandbox="bwrap" if bwrap_works() else "none", env=env,
                        log=tmp_path_factory.mktemp("bare") / "log", token=secrets.token_hex(8),
                        extra_fds=(call_r, reply_w), scratch_bytes=64 * 2**20)
    os.close(call_r)
    os.close(reply_w)
    link = Link(call_w, reply_r, codec=(protocol.json_payload, protocol.json_value))
    link.confined = bwrap_works()
    yield link
    os.close(call_w)
    os.close(reply_r)
    host.close()


def test_a_program_carries_the_notebooks_functions_imports_and_constants_and_nothing_of_torch(notebook):
    from course.bare import bare_program

    program = bare_program(notebook.broadcast_shape)
    source = program["source"]
    assert program["name"] == "broadcast_shape"
    assert "import math as math" in source and "import reduce as reduce" in source, source
    assert "ONE = 1" in source and "def pad(" in source and "def broadcast_shape(" in source, source
    assert "torch" not in source.replace("Tuple", "") and "TABLE" not in source, source
    assert "def _unused" not in source and "def with_torch" not in source  # only what it reaches
    assert {"torch"} <= set(bare_program(notebook.with_torch)["left"])
    assert "TABLE" in bare_program(notebook.with_table)["left"]  # over 20,000 characters: not carried
    assert "x" in bare_program(notebook.from_tensor)["left"]
    namespace: dict = {}
    exec(source, namespace)  # the program stands alone
    assert namespace["broadcast_shape"]((3, 1), (4,)) == (3, 4)
    cached = bare_program(notebook.cached)  # a decorator and a default value are read where it is defined
    assert "import functools as functools" in cached["source"] and cached["name"] == "cached", cached
    namespace = {}
    exec(cached["source"], namespace)
    assert namespace["cached"]((2, 1), (3,)) == (2, 3)


def test_what_is_not_a_function_defined_with_def_has_no_program():
    from course.bare import bare_program

    assert "not a function defined with def" in bare_program(max)["error"]
    assert "not a function defined with def" in bare_program(functools.partial(max, 1))["error"]
    namespace: dict = {}
    exec("def f(a, b):\n    return a\n", namespace)  # no file behind it: its source cannot be read
    assert "could not be read" in bare_program(namespace["f"])["error"]


def test_an_outcome_is_its_value_or_a_message_saying_what_it_did_instead():
    from course.bare import Other, expect_value, outcome_said

    assert expect_value({"value": [1, [2, 3]]}, "f(1)", "advice") == (1, (2, 3))  # lists come back as tuples
    assert expect_value({"value": {"a": [1, 2.5]}}, "f(1)", "advice") == {"a": [1, 2.5]}
    with pytest.raises(AssertionError, match=r"^f\(1\): it raised ValueError: no steps\. Write it by hand\.$"):
        expect_value({"raised": "ValueError", "message": "no steps"}, "f(1)", "Write it by hand.")
    with pytest.raises(AssertionError, match=r"^f\(1\): it returned <a tensor>\. advice$"):
        expect_value({"other": "a tensor"}, "f(1)", "advice")
    assert outcome_said({"value": [1]}) == "it returned (1,)"
    assert outcome_said({"raised": "KeyError", "message": "x" * 1000}) == "it raised KeyError: " + "x" * 300
    assert isinstance(expect_value({"value": None}, "f", ""), type(None)) and repr(Other("y" * 999)) == f"<{'y' * 300}>"


def test_the_bare_host_runs_a_rule_and_reports_each_outcome(notebook, bare_link):
    from course.bare import bare_program

    program = bare_program(notebook.broadcast_shape)
    reply = bare_link.request({"op": "run", "source": program["source"], "name": "broadcast_shape",
                               "cases": [[[3, 1], [4]], [[2], [3]], [[], [2, 3]]]})
    assert reply["outcomes"][0] == {"value": [3, 4]}, reply
    assert reply["outcomes"][1]["raised"] == "ValueError", reply
    assert reply["outcomes"][2] == {"value": [2, 3]}, reply
    broken = bare_link.request({"op": "run", "source": "def f(:\n", "name": "f", "cases": []})
    assert broken["error"].startswith("SyntaxError"), broken


# What a learner's program could try, in the bare host, to reach torch or NumPy anyway: every
# folder of packages the grader's own interpreter knows put back on the path, the shared library
# loaded by its path, and the whole filesystem searched.
_REACH = '''
import ctypes, os, sys
def reach(paths, libraries):
    found, walked = [], 0
    sys.path[:0] = [p for p in paths if p not in sys.path]
    for name in ("torch", "numpy"):
        try:
            __import__(name)
            found.append("imported " + name)
        except ImportError:
            pass
    for lib in libraries:
        try:
            ctypes.CDLL(lib)
            found.append("loaded " + lib)
        except OSError:
            pass
    for top in ("/usr", "/lib", "/lib64", "/opt", "/root", "/home", "/work", "/tmp", "/etc", sys.prefix):
        for folder, dirs, files in os.walk(top):
            walked += len(files)
            for name in files:
                if name.startswith(("libtorch", "libnumpy", "_multiarray_umath")):
                    found.append(os.path.join(folder, name))
            if os.path.basename(folder) in ("torch", "numpy") and "__init__.py" in files:
                found.append(folder)
            if len(found) > 20:
                return found
    return found or walked
'''


def test_the_bare_host_has_no_torch_or_numpy_to_import_load_or_find(bare_link):
    import site

    import numpy
    import torch

    if not bare_link.confined:
        pytest.skip("bubblewrap does not work here: the bare host is not confined (its run is flagged unconfined)")
    paths = sorted({*sys.path, *site.getsitepackages(), site.getusersitepackages(),
                    os.path.dirname(os.path.dirname(torch.__file__)), os.path.dirname(os.path.dirname(numpy.__file__))})
    libraries = [os.path.join(os.path.dirname(torch.__file__), "lib", name)
                 for name in ("libtorch.so", "libtorch_cpu.so", "libtorch_python.so")]
    reply = bare_link.request({"op": "run", "source": _REACH, "name": "reach", "cases": [[paths, libraries]]})
    outcome = reply["outcomes"][0]
    assert isinstance(outcome.get("value"), int) and outcome["value"] > 1000, reply  # files seen, none of theirs




@pytest.fixture
def judged(monkeypatch, bare_link):
    """The judge's hook to the bare host, as ``judge.py`` installs it."""
    from course import grader_hooks

    monkeypatch.setattr(grader_hooks, "bare_host", lambda: bare_link)


def test_a_forged_watcher_report_is_not_enough_for_lesson_7(monkeypatch, notebook, judged):
    """``torch.broadcast_shapes`` with the watcher's report made clean passes in the learner's
    process and fails run without torch; the rule by hand passes both (the control)."""
    from course.checks import broadcasting

    forging(monkeypatch, broadcasting, "shapes_by_hand", lambda real, *args: {**real(*args), "used": []})
    with served({"broadcast_shape": notebook.with_torch, "rule": notebook.broadcast_shape}) as remote:
        with pytest.raises(AssertionError, match=r"run without torch.*name 'torch' is not defined"):
            broadcasting.check_broadcast_shape(remote("broadcast_shape"), seed=11, n=20)
        broadcasting.check_broadcast_shape(remote("rule"), seed=11, n=20)


def test_a_forged_watcher_report_is_not_enough_for_lesson_3(monkeypatch, judged, tmp_path):
    """Lesson 3's strides from a meta tensor, the watcher's report made clean: fails run without torch."""
    from course.checks import memory_format

    cell = cell_module(tmp_path, "import torch\n\ndef nchw(shape):\n    return tuple(torch.empty(shape, device='meta').stride())"
                                 "\n\ndef nhwc(shape):\n    n, c, h, w = shape\n    return (h * w * c, 1, w * c, c)\n",
                       "learner_cell3")
    forging(monkeypatch, memory_format, "by_hand_cases", lambda real, fn, name, cases: [(fn(*c), []) for c in cases])
    with served({"nchw_strides": cell.nchw, "nhwc_strides": cell.nhwc}) as remote:
        with pytest.raises(AssertionError, match=r"nchw_strides.*run without torch.*'torch' is not defined"):
            memory_format.check_strides(remote("nchw_strides"), remote("nhwc_strides"), seed=5, cases=10)


def test_an_answer_that_hangs_only_without_torch_costs_its_cells_not_the_run(tmp_path):
    """Across the real sandbox: a rule that loops forever where torch is not loaded passes the
    watcher and hangs in the bare host; the cell's time limit ends it (the host is stopped, a later
    cell that needs it says so) and the notebook goes on."""
    from autograder.sandbox import bwrap_works, run_program

    hang = ("import sys\n" + BROADCAST_RULE.replace(
        "def broadcast_shape(a, b):\n", "def broadcast_shape(a, b):\n    while 'torch' not in sys.modules:\n        pass\n"))
    assert "while 'torch'" in hang
    setup = "import torch\nfrom course.checks.broadcasting import check_broadcast_shape\n"
    check = "check_broadcast_shape(broadcast_shape, seed=7, n=20)\n"
    cells = [
        {"index": 0, "id": "a", "kind": "instructor", "source": setup, "grade_id": ""},
        {"index": 1, "id": "b", "kind": "solution", "source": hang, "grade_id": "sol", "answers": ["broadcast_shape"]},
        {"index": 2, "id": "c", "kind": "test", "source": check, "grade_id": "t1", "served": True},
        {"index": 3, "id": "d", "kind": "test", "source": check, "grade_id": "t2", "served": True},
        {"index": 4, "id": "e", "kind": "instructor", "source": "print('after', broadcast_shape((2, 1), (3,)))",
         "grade_id": ""},
    ]
    out = run_program(cells, judge_setup=[setup], sandbox="bwrap" if bwrap_works() else "none", cell_timeout=8,
                      timeout=240, memory_mb=2000, log=tmp_path / "log")
    assert out.status == "ok", out
    assert "TimeoutError" in out.cells[2].error, out.cells[2]
    assert "answer by hand was stopped" in out.cells[3].error, out.cells[3]
    assert out.cells[4].output.strip() == "after (2, 3)", out.cells[4]


# Lesson 8's answers are plain Python over a trace or a program: the course's own tables and its
# sanitizer compute them. The guard that refuses the course's references while an answer runs lives
# in the learner's process (a counter there, which an answer can set back to zero: red team,
# 2026-12-01; here, outside the grader, the guard is off, as if so reset), so the judge runs each
# answer again in the bare host, where there is no course to call.
_LESSON_8 = '''
import course.streams
import course.references.traces
from course.references.traces import _events, _iteration_of, _steps


def from_reference(trace, iteration=None):
    return course.references.traces.op_table(trace, iteration, rounding=False)


def from_helpers(trace, iteration=None):
    events = _events(trace, rounding=False)
    steps = _steps(events)
    chosen = min(n for _, _, n in steps) if iteration is None else iteration
    if chosen not in {n for _, _, n in steps}:
        raise ValueError(f"no iteration {iteration}")
    table = {}
    for name, _, ts, dur, stream in events:
        if stream == -1 and _iteration_of(ts, steps) == chosen:
            count, total = table.get(name, (0, 0.0))
            table[name] = (count + 1, total + dur)
    return table


def diff_from_reference(control, test):
    return course.references.traces.ops_diff(control, test, rounding=False)


def races_from_sanitizer(program):
    return course.streams.sanitizer_races(program)
'''


@pytest.fixture(scope="module")
def lesson_8(tmp_path_factory):
    """Lesson 8's solutions and the answers above, defined from files as the grader's cells are."""
    from autograder.solution_code import solution_source

    folder = tmp_path_factory.mktemp("lesson8")
    return (cell_module(folder, solution_source("08_profiling_trace_diff"), "learner_solution8"),
            cell_module(folder, _LESSON_8, "learner_cell8"))


def test_lesson_8s_answers_from_the_course_pass_in_the_learners_process_and_fail_without_it(lesson_8, judged):
    from course.checks import profiling

    solution, cheats = lesson_8
    names = {"op_table": solution.op_table, "ops_diff": solution.ops_diff, "find_races": solution.find_races,
             "from_reference": cheats.from_reference, "from_helpers": cheats.from_helpers,
             "diff_from_reference": cheats.diff_from_reference, "races_from_sanitizer": cheats.races_from_sanitizer}
    carried = r"run without torch.*(name 'course' is not defined|could not carry|No module named 'course')"
    with served(names) as remote:
        profiling.check_op_table(remote("op_table"), seed=3, n=2)  # the controls: plain Python passes both
        profiling.check_ops_diff(remote("ops_diff"), seed=3, n=2)
        profiling.check_find_races(remote("find_races"), seed=3, n=20)
        for cheat in ("from_reference", "from_helpers"):
            with pytest.raises(AssertionError, match=carried):
                profiling.check_op_table(remote(cheat), seed=3, n=2)
        with pytest.raises(AssertionError, match=carried):
            profiling.check_ops_diff(remote("diff_from_reference"), seed=3, n=2)
        with pytest.raises(AssertionError, match=carried):
            profiling.check_find_races(remote("races_from_sanitizer"), seed=3, n=20)

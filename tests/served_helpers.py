"""What the served-check tests share: a learner's namespace served from a thread, as the grader
serves it from a process, and answers that remember their inputs."""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from course.remote import Remote, serve_in_thread


def served(namespace: dict) -> Iterator[Callable[[str], Remote]]:
    """Serve ``namespace`` from a thread for the length of a fixture; yields ``name -> Remote``."""
    with serve_in_thread(namespace) as judge:
        yield lambda name: Remote(judge, name)


def untouched(source: str) -> str:
    """A lesson's solution code as the student version has it: every solution block a stub."""
    import re

    return re.sub(r"( *)### BEGIN SOLUTION\n.*?### END SOLUTION", r"\1raise NotImplementedError()", source,
                  flags=re.S)


#: What :func:`never_failed` returns for a check a busy machine left undecided every time.
UNDECIDED = object()


def never_failed(check: Callable, runs: int = 2):
    """``check()``'s value when it passes, or :data:`UNDECIDED` when a busy machine leaves it undecided
    every time (``SpeedUndecided``: no points, measured again, never a pass); a decided miss, or any
    other failure, fails the test. A positive speed test that needed a quiet machine would fail CI for
    the machine's sake: the graded notebooks' test allows an undecided speed cell and nothing else
    (``tests/test_lessons.py``)."""
    from course.grading import SpeedUndecided

    for _ in range(runs):
        try:
            return check()
        except SpeedUndecided as exc:
            assert "Undecided:" in str(exc)
    return UNDECIDED


def loop_named(unit: str, prefix: str = "") -> str:
    """What a check may say of a loop as lean as the course's own (about 1.0 of its time, quiet): that
    it is a loop, or, when a busy machine pulled the reading below the loop's bar, undecided (no
    points) with the loop named as a cause. Never a pass: the tests' ``pytest.raises`` sees to that."""
    return f"{prefix}(the work of a Python loop over the {unit}s|still loops over the {unit}s in Python)"


def clock_ratio(message: str) -> float:
    """The reading a clock's verdict states: the learner's time over the yardstick's ("took X for N
    ..., where the course's loop over them takes Y")."""
    import re

    units = {"s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6, "ns": 1e-9}
    found = re.search(r"took ([\d.]+) (\w+) for \d+ \w+, where the course's loop over them takes ([\d.]+) (\w+)",
                      message)
    assert found, message
    return float(found[1]) * units[found[2]] / (float(found[3]) * units[found[4]])


_MEMO: dict = {}


def memoised(fn: Callable) -> Callable:
    """``fn``, answering again from memory when the same input values come again (what a timing
    that reuses its inputs would reward)."""
    def answer(*args):
        key = (fn.__name__, b"".join(a.detach().numpy().tobytes() for a in args if isinstance(a, torch.Tensor)))
        if key not in _MEMO:
            _MEMO[key] = fn(*args)
        return _MEMO[key]
    return answer


def expect_refused(monkeypatch, run: Callable[[], object]) -> None:
    """``run()`` (a check on an answer that calls a course reference), under the grader: refused with
    the guard's message, and the refusal reported to the grading parent."""
    import pytest

    import course.grader_hooks as hooks

    refused = []
    monkeypatch.setattr(hooks, "learner_prefix", "/nowhere/learner-cells/")
    monkeypatch.setattr(hooks, "refused", lambda what, where: refused.append(what))
    with pytest.raises(AssertionError, match="one of the course's references"):
        run()
    assert refused


#: Lesson 7's broadcasting rule written by hand, as a learner's cell would hold it (a source, so that
#: sandboxed tests can send it as a cell); :func:`broadcast_rule` gives the function.
BROADCAST_RULE = """def broadcast_shape(a, b):
    a, b = tuple(a), tuple(b)
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            raise ValueError(f"sizes {x} and {y} do not broadcast")
        out.append(y if x == 1 else x)
    return tuple(out)
"""


def broadcast_rule() -> Callable:
    namespace: dict = {}
    exec(BROADCAST_RULE, namespace)
    return namespace["broadcast_shape"]


def cell_module(directory, source: str, name: str):
    """``source`` defined as a module from a file in ``directory``, as the grader's cells are
    defined: their functions' source can be read (``inspect.getsource``), so they have a program."""
    import importlib.util

    path = directory / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def forging(monkeypatch, module, name: str, forge: Callable) -> None:
    """The course's probe ``module.name`` replaced, in the (thread-served) learner's side, by
    ``forge(real, *args)``, whose report is clean: what a learner who forges from C could make it say."""
    import functools

    from course import remote

    real = getattr(module, name)

    @functools.wraps(real)
    def forged(*args, **kwargs):
        return forge(real, *args, **kwargs)

    monkeypatch.setattr(module, name, forged)
    monkeypatch.setitem(remote.PROBES, f"{module.__name__}.{name}", forged)

"""A speed bar that the machine cannot decide, end to end through ``grade``.

A toy course whose speed cell judges per-round times that the notebook itself states, so that
each verdict is known in advance: a clear pass, a clear fail, and rounds too noisy to tell
(undecided). Lesson ``01_speedy``'s instructor clears the bar; ``02_unproven``'s does not
(a machine that cannot show the speedup at all). What must hold: undecided is never a pass nor
a fail; it is measured again (in the same run, then by the next run, which keeps every cell
already decided); an instructor's miss leaves the lesson gradable instead of losing the batch.
"""

from __future__ import annotations

import subprocess
import sys

import nbformat
import pytest

from test_autograder import _cell, _solution, _tests, read_csv

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]

CHECK = ("from course.grading import expect_speedup\nfrom course.timing import SpeedReport\n"
         "from course.numerics import assert_close\n"
         "assert_close(add(2, 3), 5)\n"
         "report = SpeedReport({'eager': [1.0] * len(times), 'fast': list(times)}, baseline='eager', "
         "device='cpu', threads=1)\n"
         "expect_speedup(report, 'fast', bars={'cpu': 1.4, 'cuda': 1.4})")

FAST = [0.5] * 9                                  # 2x every round: a pass
SLOW = [1.0] * 9                                  # 1x every round: a fail (upper bound below the bar)
BUSY = [1.0, 1.0, 1.0] + [0.625] * 6              # 1x or 1.6x: the bar 1.4x lies between the bounds


def notebook(times: list[float]) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells = [
        _cell("markdown", "# Speed toy", "intro"),
        _cell("code", "def add(a, b):\n    ### BEGIN SOLUTION\n    return a + b\n    ### END SOLUTION",
              "add-solution", _solution("add_solution")),
        _cell("code", f"### BEGIN SOLUTION\ntimes = {times!r}\n### END SOLUTION", "times-solution",
              _solution("times_solution")),
        _cell("code", CHECK, "speed-tests", _tests("speed_tests", 2)),
    ]
    return nb


def autograder(*args):
    return subprocess.run([sys.executable, "-m", "autograder", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=900)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("speedcourse")
    for lesson, times in (("01_speedy", FAST), ("02_unproven", SLOW)):
        (root / "solutions" / lesson).mkdir(parents=True)
        nbformat.write(notebook(times), root / "solutions" / lesson / f"{lesson}.ipynb")
    subs = root / "submissions"
    for student, lesson, times in (("fast", "01_speedy", FAST), ("slow", "01_speedy", SLOW),
                                   ("busy", "01_speedy", BUSY), ("fast", "02_unproven", FAST),
                                   ("slow", "02_unproven", SLOW)):
        (subs / student / lesson).mkdir(parents=True)
        nbformat.write(notebook(times), subs / student / lesson / f"{lesson}.ipynb")

    def grade(out):
        proc = autograder("grade", subs, "--out", root / out, "--solutions", root / "solutions", "--work",
                          root / "work", "--jobs", 2, "--cell-timeout", 60)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        rows = {(r["student_id"], r["lesson_id"]): r for r in read_csv(root / out / "grades.csv")}
        cells = {(r["student_id"], r["lesson_id"]): r for r in read_csv(root / out / "cells.csv")}
        return proc, rows, cells

    first, second = grade("out1"), grade("out2")
    return {"root": root, "first": first, "second": second}


def test_each_verdict_is_what_the_rounds_say_and_undecided_earns_nothing_yet(run):
    proc, rows, cells = run["first"]
    verdicts = {key: (c["verdict"], float(c["score"])) for key, c in cells.items()}
    assert verdicts == {("fast", "01_speedy"): ("passed", 2.0), ("slow", "01_speedy"): ("failed", 0.0),
                        ("busy", "01_speedy"): ("undecided", 0.0), ("fast", "02_unproven"): ("passed", 2.0),
                        ("slow", "02_unproven"): ("undecided", 0.0)}
    busy = rows[("busy", "01_speedy")]
    assert busy["status"] == "graded" and float(busy["score"]) == 0
    assert "undecided: the speed bar of speed_tests" in busy["detail"]
    assert "undecided" not in rows[("slow", "01_speedy")]["detail"]
    page = (run["root"] / "out1" / "feedback" / "busy" / "01_speedy" / "01_speedy.html").read_text()
    assert "not decided yet" in page and "between 1.00x and 1.60x" in page
    assert "undecided: 2 speed cell(s)" in proc.stdout and "busy/01_speedy/speed_tests" in proc.stdout


def test_an_undecided_submission_is_measured_again_in_the_same_run(run):
    proc, _, _ = run["first"]
    # only busy: slow's miss on 02_unproven is the machine's (the instructor missed too), not to retry
    assert "measuring again (1 of 1): 1 submission(s)" in proc.stdout
    assert "again [1/1] busy/01_speedy" in proc.stdout


def test_a_bar_the_instructor_misses_leaves_the_lesson_gradable_and_is_measured_again_next_run(run):
    proc, _, _ = run["first"]
    assert "warning: 02_unproven: the instructor's own solution did not clear the speed bar of speed_tests" \
        in proc.stderr
    assert proc.stdout.count("preparing 02_unproven: running the instructor's solution") == 2  # one retry
    second, _, _ = run["second"]
    assert "preparing 02_unproven: running the instructor's solution" in second.stdout  # no cached transcript
    assert "preparing 01_speedy: running the instructor's solution" not in second.stdout  # cached


def test_the_next_run_measures_only_what_is_undecided(run):
    _, rows, cells = run["second"]
    for key in (("fast", "01_speedy"), ("slow", "01_speedy")):
        assert "resumed" in rows[key]["detail"], rows[key]
    for key in (("busy", "01_speedy"), ("slow", "02_unproven")):
        assert "resumed" not in rows[key]["detail"] and cells[key]["verdict"] == "undecided", rows[key]


def test_measuring_again_settles_only_what_was_undecided():
    """A cell decided in an earlier run keeps that verdict: a submission whose answers change from
    run to run gains nothing by having a speed cell measured again."""
    from autograder.grade import _keep_decided
    from autograder.verdict import CellVerdict

    earlier = [CellVerdict("a", 0.0, 1.0, "wrong", "failed"), CellVerdict("b", 0.0, 2.0, "undecided: ...", "undecided"),
               CellVerdict("c", 3.0, 3.0, "", "passed")]
    now = [CellVerdict("a", 1.0, 1.0, "", "passed"), CellVerdict("b", 2.0, 2.0, "", "passed"),
           CellVerdict("c", 0.0, 3.0, "wrong", "failed")]
    merged = _keep_decided(earlier, now)
    assert [(v.grade_id, v.status, v.points) for v in merged] == [("a", "failed", 0.0), ("b", "passed", 2.0),
                                                                  ("c", "passed", 3.0)]
    assert _keep_decided(None, now) == now

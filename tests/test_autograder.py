"""Tests of ``python -m autograder`` on a toy course built in a temporary folder.

One ``grade`` run covers all the interesting students at once (module-scoped fixture),
because every submission costs a Jupyter kernel start.
"""

from __future__ import annotations

import csv
import os
import shutil
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course import cells

LESSON = "01_toy"
NOTEBOOK = f"{LESSON}.ipynb"
REPO = Path(__file__).resolve().parents[1]


def _cell(kind, source, cell_id, nbgrader=None):
    make = nbformat.v4.new_code_cell if kind == "code" else nbformat.v4.new_markdown_cell
    cell = make(source)
    cell.id = cell_id
    if nbgrader is not None:
        cell.metadata["nbgrader"] = {"schema_version": 3, **nbgrader}
    return cell


def _solution(grade_id):
    return {"solution": True, "grade": False, "locked": False, "grade_id": grade_id}


def _tests(grade_id, points):
    return {"solution": False, "grade": True, "locked": True, "grade_id": grade_id,
            "points": points}


def toy_source_notebook():
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells = [
        _cell("markdown", "# Toy lesson\nWrite two small functions.", "intro"),
        _cell("code", "def add(a, b):\n    ### BEGIN SOLUTION\n    return a + b\n"
                      "    ### END SOLUTION", "add-solution", _solution("add_solution")),
        _cell("code", "from course.numerics import assert_close", "imports"),
        _cell("code", "assert_close(add(1, 2), 3)\n### BEGIN HIDDEN TESTS\n"
                      "assert_close(add(-5, 5), 0)\nassert_close(add(0.5, 0.25), 0.75)\n"
                      "### END HIDDEN TESTS", "add-tests", _tests("add_tests", 2)),
        _cell("code", "def mul(a, b):\n    ### BEGIN SOLUTION\n    return a * b\n"
                      "    ### END SOLUTION", "mul-solution", _solution("mul_solution")),
        _cell("code", "assert_close(mul(2, 3), 6)\n### BEGIN HIDDEN TESTS\n"
                      "assert_close(mul(-1, 4), -4)\n### END HIDDEN TESTS",
              "mul-tests", _tests("mul_tests", 1)),
    ]
    return nb


def autograder(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "autograder", *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:\n{proc.stdout}\n"
                             f"stderr:\n{proc.stderr}")
    return proc


def read_csv(path):
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """A toy course: solutions/, a release of it in lessons/, and a work folder."""
    root = tmp_path_factory.mktemp("course")
    src = root / "solutions" / LESSON
    src.mkdir(parents=True)
    nbformat.write(toy_source_notebook(), src / NOTEBOOK)
    (src / "data.txt").write_text("1 2 3\n")
    proc = autograder("release", "--solutions", root / "solutions", "--lessons",
                      root / "lessons", "--work", root / "work")
    return {"root": root, "solutions": root / "solutions", "lessons": root / "lessons",
            "work": root / "work", "release_stdout": proc.stdout}


def student_version(course):
    return nbformat.read(course["lessons"] / LESSON / NOTEBOOK, as_version=4)


def solution_version(course):
    return nbformat.read(course["solutions"] / LESSON / NOTEBOOK, as_version=4)


def with_answer(nb, grade_id, source):
    cells.find(nb.cells, grade_id).source = source
    return nb


@pytest.fixture(scope="module")
def graded(course):
    """Grade one submission per case in a single ``grade`` run."""
    subs = course["root"] / "submissions"

    def put(student, nb=None, name=NOTEBOOK, text=None):
        folder = subs / student / LESSON
        folder.mkdir(parents=True)
        if nb is not None:
            nbformat.write(nb, folder / name)
        if text is not None:
            (folder / name).write_text(text)

    put("perfect", solution_version(course))
    put("untouched", student_version(course))
    put("wrong_mul", with_answer(solution_version(course), "mul_solution",
                                 "def mul(a, b):\n    return a + b"))
    put("hardcoded", with_answer(solution_version(course), "add_solution",
                                 "def add(a, b):\n    return 3"))  # passes only the visible test
    put("missing")
    put("invalid", text="{ this is not json")
    put("renamed", solution_version(course), name=f"Copy of {NOTEBOOK}")
    put("looping", with_answer(solution_version(course), "add_solution",
                               "def add(a, b):\n    while True:\n        pass"))
    for student, (nb, _score, _flags) in hostile_cases(course).items():
        put(student, nb)
    (subs / "shadow" / LESSON / "course").mkdir(parents=True)
    (subs / "shadow" / LESSON / "course" / "__init__.py").write_text("assert_close = lambda *a, **k: None\n")
    (subs / "shadow" / LESSON / "torch.py").write_text("raise SystemExit\n")
    (subs / ".hidden").mkdir()
    (subs / "notes.txt").write_text("not a student")

    out = course["root"] / "out"
    proc = autograder("grade", subs, "--out", out, "--solutions", course["solutions"],
                      "--work", course["work"], "--cell-timeout", 5, "--timeout", 120,
                      "--memory-mb", 1500, "--jobs", 2, check=False)
    assert (out / "grades.csv").exists(), f"{proc.stdout}\n{proc.stderr}"
    rows = {r["student_id"]: r for r in read_csv(out / "grades.csv")}
    cells = read_csv(out / "cells.csv")
    return {"proc": proc, "out": out, "rows": rows, "cells": cells, "subs": subs, "work": Path(course["work"])}


# -- release ----------------------------------------------------------------------------

def test_release_strips_solutions_and_hidden_tests(course):
    text = (course["lessons"] / LESSON / NOTEBOOK).read_text()
    assert "BEGIN SOLUTION" not in text and "return a + b" not in text
    assert "HIDDEN TESTS" not in text and "add(-5, 5)" not in text
    assert "assert_close(add(1, 2), 3)" in text  # visible tests stay
    assert "raise NotImplementedError()" in text
    nb = student_version(course)
    assert all(c.get("outputs", []) == [] for c in nb.cells)
    assert (course["lessons"] / LESSON / "data.txt").read_text() == "1 2 3\n"
    assert not list(course["lessons"].rglob("*.db"))


def test_release_is_deterministic(course, tmp_path):
    again = tmp_path / "lessons"
    autograder("release", "--solutions", course["solutions"], "--lessons", again,
               "--work", tmp_path / "work", "--lesson", LESSON)
    first = sorted(p.relative_to(course["lessons"]) for p in course["lessons"].rglob("*"))
    second = sorted(p.relative_to(again) for p in again.rglob("*"))
    assert first == second
    for rel in first:
        if (course["lessons"] / rel).is_file():
            assert (course["lessons"] / rel).read_bytes() == (again / rel).read_bytes(), rel


def test_release_unknown_lesson_fails_clearly(course, tmp_path):
    proc = autograder("release", "--solutions", course["solutions"], "--lessons",
                      tmp_path / "l", "--work", tmp_path / "w", "--lesson", "99_nope",
                      check=False)
    assert proc.returncode == 2
    assert "99_nope" in proc.stderr and LESSON in proc.stderr


# -- grading ------------------------------------------------------------------------------

def test_grade_exits_zero_with_one_row_per_submission(graded):
    assert graded["proc"].returncode == 0, graded["proc"].stderr
    assert list(graded["rows"]) == sorted(["perfect", "untouched", "wrong_mul", "hardcoded",
                                           "missing", "invalid", "renamed", "looping",
                                           *hostile_cases(None)])
    header = (graded["out"] / "grades.csv").read_text().splitlines()[0]
    assert header == ("student_id,lesson_id,score,max_score,status,cell_errors,seconds,"
                      "peak_rss_mb,flags,detail,device")
    for row in graded["rows"].values():
        assert row["lesson_id"] == LESSON and float(row["max_score"]) == 3
    # one line per submission: no warning from nbgrader's gradebook (it warned three times per row)
    assert "Warning" not in graded["proc"].stderr + graded["proc"].stdout, graded["proc"].stderr[-2000:]


def test_solution_gets_full_marks(graded):
    row = graded["rows"]["perfect"]
    assert (row["status"], float(row["score"]), int(row["cell_errors"])) == ("graded", 3, 0)
    assert float(row["peak_rss_mb"]) > 0 and float(row["seconds"]) > 0
    # where its time went: each code cell's own seconds, by its index among the code cells, adding up
    timings = json.loads((graded["work"] / "results" / "perfect" / f"{LESSON}.json").read_text())["timings"]
    assert timings["per_cell"] and all(s >= 0 for s in timings["per_cell"].values())
    assert sum(timings["per_cell"].values()) == pytest.approx(timings["cells"], abs=0.01 * len(timings["per_cell"]))


def test_untouched_student_version_gets_zero_everywhere(graded):
    row = graded["rows"]["untouched"]
    assert (row["status"], float(row["score"])) == ("graded", 0)
    assert int(row["cell_errors"]) >= 2
    cells = [c for c in graded["cells"] if c["student_id"] == "untouched"]
    assert [c["grade_id"] for c in cells] == ["add_tests", "mul_tests"]
    assert all(float(c["score"]) == 0 for c in cells)
    assert [float(c["max_score"]) for c in cells] == [2, 1]


def test_wrong_answer_loses_exactly_its_points(graded):
    row = graded["rows"]["wrong_mul"]
    assert (row["status"], float(row["score"]), int(row["cell_errors"])) == ("graded", 2, 1)
    cells = {c["grade_id"]: float(c["score"]) for c in graded["cells"]
             if c["student_id"] == "wrong_mul"}
    assert cells == {"add_tests": 2, "mul_tests": 0}


def test_hidden_tests_are_restored_for_grading(graded):
    row = graded["rows"]["hardcoded"]
    assert (row["status"], float(row["score"])) == ("graded", 1)
    cells = {c["grade_id"]: float(c["score"]) for c in graded["cells"]
             if c["student_id"] == "hardcoded"}
    assert cells == {"add_tests": 0, "mul_tests": 1}


def test_missing_and_invalid_rows(graded):
    missing, invalid = graded["rows"]["missing"], graded["rows"]["invalid"]
    assert (missing["status"], float(missing["score"])) == ("missing", 0)
    assert (invalid["status"], float(invalid["score"])) == ("invalid", 0)
    assert "JSON" in invalid["detail"]


def test_renamed_notebook_is_graded(graded):
    row = graded["rows"]["renamed"]
    assert (row["status"], float(row["score"])) == ("graded", 3)
    assert "Copy of" in row["detail"]


def test_endless_loop_costs_only_its_tests(graded):
    row = graded["rows"]["looping"]
    assert row["status"] in {"graded", "timeout"}
    if row["status"] == "graded":
        cells = {c["grade_id"]: float(c["score"]) for c in graded["cells"]
                 if c["student_id"] == "looping"}
        assert cells == {"add_tests": 0, "mul_tests": 1}


def test_feedback_for_graded_rows(graded):
    for student, row in graded["rows"].items():
        html = graded["out"] / "feedback" / student / LESSON / f"{LESSON}.html"
        assert html.exists() == (row["status"] not in ("missing", "invalid")), student


def test_progress_and_summary_printed(graded):
    stdout = graded["proc"].stdout
    assert f"/{len(graded['rows'])}] invalid/01_toy: invalid" in stdout
    assert "perfect" in stdout.split("student", 1)[1]


def test_regrade_survives_hang_and_dead_kernel(course, graded, tmp_path):
    """A second run on the same work folder (and gradebook) works; --timeout kills a hung
    submission and a dead kernel gives an error row, while the next student is graded."""
    subs = tmp_path / "subs"
    cases = {
        "a_hang": with_answer(solution_version(course), "mul_solution",
                              "import time\ntime.sleep(600)"),
        "b_crash": with_answer(solution_version(course), "mul_solution",
                               "import os\nos._exit(1)"),
        "c_fine": solution_version(course),
    }
    for student, nb in cases.items():
        (subs / student / LESSON).mkdir(parents=True)
        nbformat.write(nb, subs / student / LESSON / NOTEBOOK)
    out = tmp_path / "out"
    autograder("grade", subs, "--out", out, "--solutions", course["solutions"],
               "--work", course["work"], "--lesson", LESSON, "--timeout", 15)
    rows = {r["student_id"]: r for r in read_csv(out / "grades.csv")}
    # Killed in mul's cell: add's points, earned before it, are kept.
    assert rows["a_hang"]["status"] == "timeout" and float(rows["a_hang"]["score"]) == 2
    assert float(rows["a_hang"]["seconds"]) < 30
    # The crash comes in mul's cell: add's points, earned before it, are kept.
    assert rows["b_crash"]["status"] == "crashed" and float(rows["b_crash"]["score"]) == 2
    assert "died" in rows["b_crash"]["detail"]
    assert (rows["c_fine"]["status"], float(rows["c_fine"]["score"])) == ("graded", 3)


def test_missing_submissions_folder_fails_clearly(course, tmp_path):
    proc = autograder("grade", tmp_path / "nowhere", "--out", tmp_path / "out",
                      "--solutions", course["solutions"], "--work", tmp_path / "w",
                      check=False)
    assert proc.returncode == 2
    assert "nowhere" in proc.stderr and "SUBMISSIONS" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_submissions_without_course_lessons_fail_clearly(course, tmp_path):
    (tmp_path / "subs" / "alice" / "99_other").mkdir(parents=True)
    proc = autograder("grade", tmp_path / "subs", "--out", tmp_path / "out",
                      "--solutions", course["solutions"], "--work", tmp_path / "w",
                      check=False)
    assert proc.returncode == 2
    assert "alice" in proc.stderr and LESSON in proc.stderr and "Traceback" not in proc.stderr


def test_cells_without_ids_get_stable_ids(tmp_path):
    """Source notebooks without cell ids must not get random ones (release determinism)."""
    from autograder.workspace import normalise_cell_ids

    nb = toy_source_notebook()
    raw = json.loads(nbformat.writes(nb))
    raw["nbformat_minor"] = 4
    for cell in raw["cells"]:
        del cell["id"]
    paths = [tmp_path / "a.ipynb", tmp_path / "b.ipynb"]
    for path in paths:
        path.write_text(json.dumps(raw))
        normalise_cell_ids(path)
    assert paths[0].read_bytes() == paths[1].read_bytes()
    ids = [c["id"] for c in json.loads(paths[0].read_text())["cells"]]
    assert ids == ["cell-0", "add_solution", "cell-2", "add_tests", "mul_solution", "mul_tests"]
    nbformat.validate(nbformat.read(paths[0], as_version=4))


# -- hostile and faulty submissions ---------------------------------------------------------------

WRONG_ADD = "def add(a, b):\n    return a - b\n"
RIGHT_MUL = "def mul(a, b):\n    return a * b\n"


def hostile_cases(course):
    """student -> (notebook, expected score, flags that must be named). Each tries one way of
    earning points without the work; ``add`` is wrong in all of them (2 points it must not get),
    ``mul`` is right unless the attack takes it down too."""
    if course is None:
        return ["h_patch_assert", "h_patch_torch_time", "h_ipython_hooks", "h_edit_tests", "h_delete_tests",
                "h_duplicate_ids", "shadow", "h_grader_aware", "h_probe_files", "h_frames", "h_forge_pipe",
                "h_oom", "h_crash", "h_exit", "h_retype_tests", "h_too_deep_to_read"]
    sol = lambda: solution_version(course)  # noqa: E731
    cases = {}

    def case(name, nb, score, flags):
        cases[name] = (nb, score, flags)

    # Patched comparisons: local checks pass, but the grader compares again itself.
    case("h_patch_assert", with_answer(sol(), "add_solution", WRONG_ADD +
         "import course.numerics, builtins\ncourse.numerics.assert_close = lambda *a, **k: None\n"), 0, {"tampered", "patching"})
    case("h_patch_torch_time", with_answer(sol(), "add_solution", WRONG_ADD +
         "import torch, time\ntorch.allclose = lambda *a, **k: True\ntime.perf_counter = lambda: 0.0\n"),
         0, {"tampered", "patching"})
    # Changing how later cells run or report errors: there is no IPython to hook.
    case("h_ipython_hooks", with_answer(sol(), "add_solution", WRONG_ADD +
         "import sys\nsys.excepthook = lambda *a: None\ntry:\n    get_ipython().set_custom_exc((Exception,), lambda *a, **k: None)\n"
         "except NameError:\n    pass\n"), 1, {"introspection"})
    # Edited, deleted, retyped and duplicated test cells: the instructor's are graded.
    nb = with_answer(sol(), "add_solution", WRONG_ADD)
    for cell in nb.cells:
        if cells.is_test(cell):
            cell.source = "pass"
    case("h_edit_tests", nb, 1, {"edited-tests"})
    nb = with_answer(sol(), "add_solution", WRONG_ADD)
    nb.cells = [c for c in nb.cells if not cells.is_test(c)]
    case("h_delete_tests", nb, 1, {"deleted-tests"})
    nb = with_answer(sol(), "add_solution", WRONG_ADD)
    for cell in nb.cells:
        if cells.is_test(cell):
            cell.cell_type, cell.outputs, cell.execution_count = "markdown", None, None
            del cell["outputs"], cell["execution_count"]
    case("h_retype_tests", nb, 1, {"retyped-cells"})
    nb = with_answer(sol(), "add_solution", WRONG_ADD)
    dup = nbformat.v4.new_code_cell("def add(a, b):\n    return a + b\n")
    dup.id = nb.cells[1].id
    dup.metadata = nb.cells[1].metadata
    nb.cells.insert(1, dup)  # a right answer under the same id, defined first...
    case("h_duplicate_ids", nb, 3, {"duplicate-ids"})  # ...is graded: first one wins, flagged
    # Files beside the notebook that would shadow modules are never copied in.
    case("shadow", with_answer(sol(), "add_solution", WRONG_ADD), 1, {"extra-files"})
    case("h_grader_aware", with_answer(sol(), "add_solution",
         "import os\nGRADING = 'NBGRADER_EXECUTION' in os.environ\n" + WRONG_ADD), 1, {"grader-aware"})
    case("h_probe_files", with_answer(sol(), "add_solution", WRONG_ADD +
         "import glob\nfound = glob.glob('/**/solutions/**/*.ipynb', recursive=True)[:3]\n"
         "for p in ['../../solutions/01_toy/01_toy.ipynb', '/work/main/.autograder/gradebook.db']:\n"
         "    try:\n        open(p).read()\n    except OSError:\n        pass\n"), 1, {"probing"})
    case("h_frames", with_answer(sol(), "add_solution",
         "import sys\ndef add(a, b):\n    sys._getframe(1).f_globals\n    return a + b\n"), 1, {"introspection"})
    case("h_forge_pipe", with_answer(sol(), "add_solution", WRONG_ADD +
         "import os\nfor fd in sorted(int(f) for f in os.listdir('/proc/self/fd')):\n    if fd < 3:\n        continue\n"
         "    try:\n        os.write(fd, b'\\x00' * 8 + b'forged')\n    except OSError:\n        pass\n"), 0, {"tampered"})
    # Code nested deeper than the grader's parser goes, run after raising the recursion limit: the
    # learner's process runs it, the grader cannot read it and says so (before, its parse error was
    # the grader's own: the row was "error" with no points).
    deep = "import os\nx = " + "-" * 4000 + "1\nGRADING = os.environ.get('NBGRADER_EXECUTION')\n"
    nb = with_answer(sol(), "add_solution", WRONG_ADD + "import sys\nsys.setrecursionlimit(100000)\n")
    case("h_too_deep_to_read", with_answer(nb, "mul_solution", deep + RIGHT_MUL), 1, {"unreadable", "grader-aware"})
    # Faults: each costs this submission only, with the points earned before it kept.
    case("h_oom", with_answer(sol(), "mul_solution", "blob = bytearray(3 * 2**30)\n" + RIGHT_MUL), 2, set())
    case("h_crash", with_answer(sol(), "mul_solution", "import os\nos._exit(3)\n"), 2, set())
    case("h_exit", with_answer(sol(), "add_solution", "raise SystemExit(0)\n"), 1, set())
    return cases


HOSTILE_STATUS = {"h_oom": "oom", "h_crash": "crashed", "h_forge_pipe": "crashed"}


@pytest.mark.parametrize("student", hostile_cases(None))
def test_hostile_submission_gets_only_what_it_earned_and_is_named(graded, course, student):
    _, score, flags = hostile_cases(course)[student]
    row = graded["rows"][student]
    assert row["status"] == HOSTILE_STATUS.get(student, "graded"), row
    assert float(row["score"]) == score, row
    named = set(filter(None, row["flags"].split(",")))
    assert flags <= named, row


def test_feedback_never_shows_hidden_tests(graded):
    for page in graded["out"].glob("feedback/*/*/*.html"):
        text = page.read_text()
        assert "HIDDEN" not in text and "add(-5, 5)" not in text and "mul(-1, 4)" not in text, page


#: One of each way a submission ends (graded right, wrong, untouched; a time limit, memory, a crash, a
#: forged pipe; invalid, missing, renamed; flagged): what grading two at a time could change.
SERIAL = ("perfect", "untouched", "wrong_mul", "looping", "invalid", "missing", "renamed", "shadow", "h_oom",
          "h_crash", "h_forge_pipe", "h_duplicate_ids", "h_patch_assert")


def test_serial_grading_gives_the_same_grades_as_parallel(course, graded):
    """The fixture graded with --jobs 2; --jobs 1 --force grades one of each kind of submission
    again, one at a time."""
    subs, out = course["root"] / "subs-serial", course["root"] / "out-serial"
    for student in SERIAL:
        shutil.copytree(graded["subs"] / student, subs / student)
    autograder("grade", subs, "--out", out, "--solutions", course["solutions"], "--work",
               course["work"], "--cell-timeout", 5, "--timeout", 120, "--memory-mb", 1500, "--jobs", 1, "--force")
    serial = {r["student_id"]: r for r in read_csv(out / "grades.csv")}
    assert {s: (r["score"], r["status"], r["flags"]) for s, r in serial.items()} == \
        {s: (r["score"], r["status"], r["flags"]) for s, r in graded["rows"].items() if s in SERIAL}
    assert len(serial) == len(SERIAL) and "resumed" not in serial["perfect"]["detail"]


def test_rerun_resumes_instead_of_grading_again(course, graded):
    out = course["root"] / "out-again"
    autograder("grade", graded["subs"], "--out", out, "--solutions", course["solutions"],
               "--work", course["work"], "--cell-timeout", 5, "--timeout", 120, "--memory-mb", 1500)
    again = {r["student_id"]: r for r in read_csv(out / "grades.csv")}
    assert {s: (r["score"], r["status"]) for s, r in again.items()} == \
        {s: (r["score"], r["status"]) for s, r in graded["rows"].items()}
    assert "resumed" in again["perfect"]["detail"] and float(again["perfect"]["seconds"]) < 5


# -- a PostgreSQL gradebook ------------------------------------------------------------------------

def _pg_url():
    import os
    url = os.environ.get("COURSE_TEST_PG_URL")
    if not url:
        if os.environ.get("COURSE_REQUIRE_PG"):
            pytest.fail("COURSE_REQUIRE_PG is set but COURSE_TEST_PG_URL is not: .ci/run should start PostgreSQL")
        pytest.skip("no PostgreSQL server (set COURSE_TEST_PG_URL; .ci/run starts one)")
    return url


def test_postgresql_gradebook_gets_the_same_grades(course, graded, tmp_path):
    import uuid

    import psycopg2
    from nbgrader.api import Gradebook

    admin = _pg_url()
    name = f"course_test_{uuid.uuid4().hex[:10]}"
    conn = psycopg2.connect(admin)
    conn.autocommit = True
    conn.cursor().execute(f"CREATE DATABASE {name}")
    url = admin.rsplit("/", 1)[0] + "/" + name
    try:
        subs = tmp_path / "subs"
        for student in ("perfect", "wrong_mul", "untouched"):
            shutil.copytree(graded["subs"] / student, subs / student)
        out = tmp_path / "out"
        autograder("grade", subs, "--out", out, "--solutions", course["solutions"], "--work",
                   tmp_path / "work", "--db", url, "--jobs", 2, "--cell-timeout", 5)
        rows = {r["student_id"]: r for r in read_csv(out / "grades.csv")}
        assert {s: r["score"] for s, r in rows.items()} == {s: graded["rows"][s]["score"] for s in rows}
        from autograder.workspace import _driver
        with Gradebook(_driver(url)) as gb:
            scores = {s.student.id: s.score for s in gb.assignment_submissions(LESSON)}
        assert scores == {s: float(r["score"]) for s, r in rows.items()}
    finally:
        cur = conn.cursor()
        cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        cur.execute(f"DROP DATABASE IF EXISTS {name}")
        conn.close()


def test_sandbox_is_required_where_ci_asks_for_it():
    import os

    from autograder.sandbox import bwrap_works
    if not os.environ.get("COURSE_REQUIRE_SANDBOX"):
        pytest.skip("COURSE_REQUIRE_SANDBOX not set (.ci/run sets it where bubblewrap is installed)")
    assert bwrap_works()


def test_sandboxed_code_cannot_see_instructor_files(course, tmp_path):
    """Run a program directly in the sandbox: the work folder, solutions/ and the network are absent."""
    from autograder.sandbox import bwrap_works, run_program
    if not bwrap_works():
        pytest.skip("bubblewrap is not available here")
    probe = ("import os, socket\n"
             f"print('solutions', os.path.exists({str(course['solutions'])!r}))\n"
             f"print('work', os.path.exists({str(course['work'])!r}))\n"
             f"print('repo', os.path.exists({str(REPO / 'solutions')!r}))\n"
             "print('uid', os.getuid())\n"
             "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=2); print('net True')\n"
             "except OSError:\n    print('net False')\n")
    outcome = run_program([{"index": 0, "id": "probe", "kind": "instructor", "source": probe, "grade_id": ""}],
                          sandbox="bwrap", cell_timeout=60, timeout=120, memory_mb=2000, log=tmp_path / "log")
    assert outcome.status == "ok", outcome
    text = outcome.cells[0].output
    assert "solutions False" in text and "work False" in text and "repo False" in text, text
    uid = int(text.split("uid ")[1].split()[0])
    assert "net False" in text and uid != 0 and (uid == 65534 or os.geteuid() == 0), text

"""The learner's self-check (`course.self_check`, `python -m course check`, `python -m course
progress`) and the launch cells every lesson carries (Colab set-up, links, self-check)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import course
from autograder import launch
from autograder.release import exercise_table
from autograder.solution_code import solved_notebook
from course import progress, selfcheck
from course.lessons import catalog
from launch_helpers import write_solved

ROOT = Path(__file__).resolve().parents[1]
LESSON_IDS = [item["id"] for item in catalog()]
FAST = "04_forward_ad"  # the quickest lesson to run whole (well under a minute)
# A planted mistake in lesson 4: the dual numbers' product rule loses a term.
PLANTED = ("Dual(self.primal * other.primal, self.tangent * other.primal + self.primal * other.tangent)",
           "Dual(self.primal * other.primal, self.primal * other.tangent)")


@pytest.fixture(autouse=True)
def private_progress(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_PROGRESS_FILE", str(tmp_path / "progress.json"))
    monkeypatch.delenv(selfcheck.SKIP_ENV, raising=False)


def run_cells(nb: dict, tmp_path: Path, *, skip_last: bool = True) -> dict:
    """Execute a notebook's code cells in one namespace, each from a file (TorchScript reads
    source from disk); the Colab set-up cell and, by default, the self-check cell left out."""
    ns: dict = {"__name__": "__main__"}
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    here = os.getcwd()
    os.chdir(tmp_path)  # what a lesson writes beside itself (lesson 10's worker modules) stays out of the checkout
    try:
        for n, cell in enumerate(code[:-1] if skip_last else code):
            src = "".join(cell["source"])
            path = tmp_path / f"cell_{n:03d}.py"
            path.write_text(src)
            try:
                exec(compile(src, str(path), "exec"), ns)
            except Exception:  # noqa: BLE001 - the untouched version raises in its exercise cells
                pass
    finally:
        os.chdir(here)
    return ns


# -- what release writes is committed, and complete ---------------------------------------------

def test_exercises_json_matches_the_committed_lessons():
    shipped = json.loads((ROOT / "course" / "exercises.json").read_text())
    assert shipped == exercise_table(ROOT / "lessons"), "course/exercises.json is stale: run `make release`"
    for item in catalog():
        assert sum(e["points"] for e in shipped[item["id"]]) == item["points"], item["id"]


def joined(nb: dict) -> list:
    """The cells with each source as one string (nbformat writes lists of lines)."""
    return [{**c, "source": "".join(c["source"])} for c in nb["cells"]]


@pytest.mark.parametrize("lesson_id", LESSON_IDS)
def test_launch_cells_of_every_lesson_are_up_to_date(lesson_id):
    for folder in ("solutions", "lessons"):
        nb = json.loads((ROOT / folder / lesson_id / f"{lesson_id}.ipynb").read_text())
        assert joined(launch.apply(nb, lesson_id)) == joined(nb), f"{folder}/{lesson_id}: run `make release`"
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        assert "course-setup" in code[0]["metadata"].get("tags", []), "the set-up cell must come first"
        assert "".join(code[-1]["source"]) == f'checked = course.self_check("{lesson_id}")'
        calls = [c for c in code if "self_check(" in "".join(c["source"])]
        assert len(calls) == 1, f"{folder}/{lesson_id}: {len(calls)} self-check cells; the notebook runs it once"
        intro = "".join(nb["cells"][0]["source"])
        assert launch.colab_url(lesson_id) in intro and launch.binder_url(lesson_id) in intro


def test_a_self_check_written_by_hand_is_replaced_by_the_tagged_one_not_kept_beside_it():
    lesson_id = LESSON_IDS[0]
    text = launch.CHECK_TEMPLATE.format(lesson_id=lesson_id)
    nb = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": "# Title"},
                    {"cell_type": "markdown", "metadata": {}, "source": launch.CHECK_MARKDOWN},
                    {"cell_type": "code", "metadata": {}, "source": text + "\n", "outputs": [], "execution_count": None}]}
    out = launch.apply(nb, lesson_id)
    calls = [c for c in out["cells"] if "self_check(" in "".join(c["source"])]
    intros = [c for c in out["cells"] if "".join(c["source"]).strip() == launch.CHECK_MARKDOWN.strip()]
    assert len(calls) == 1 and len(intros) == 1
    assert launch.CHECK_TAG in calls[0]["metadata"]["tags"]


@pytest.mark.parametrize("lesson_id", LESSON_IDS)
def test_every_lesson_opens_with_objectives_prerequisites_time_and_doctor(lesson_id):
    nb = json.loads((ROOT / "lessons" / lesson_id / f"{lesson_id}.ipynb").read_text())
    intro = "".join(nb["cells"][0]["source"])
    for part in ("**You will**", "**Prerequisites**", "**Time**", "**Grading**"):
        assert part in intro, f"{lesson_id}: the opening cell lacks {part}"
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert "course.doctor()" in "".join(code[1]["source"]), "the first cell after set-up runs course.doctor()"


def test_release_pins_the_package_version_and_the_readme_links():
    s = launch.settings()
    assert s["release"] == f"v{s['version']}", "[tool.course] release must be the tag of project.version"
    assert f"@{s['release']}" in launch.requirement()
    readme = (ROOT / "README.md").read_text()
    assert launch.binder_url() in readme and launch.colab_url(LESSON_IDS[0]) in readme
    for lesson_id in LESSON_IDS:
        assert launch.colab_url(lesson_id) in readme and launch.binder_url(lesson_id) in readme


def test_setup_cell_does_nothing_where_the_course_is_installed(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"the set-up cell ran a command: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)
    exec(compile(launch.setup_source(), "<setup cell>", "exec"), {"__name__": "__main__"})


def _run_setup_cell(monkeypatch, torch_version: str, course_spec) -> list[list[str]]:
    """The set-up cell run where ``find_spec("course")`` gives ``course_spec`` and torch is
    ``torch_version``: the commands it ran (none of them really run)."""
    import importlib.metadata
    import importlib.util

    ran: list[list[str]] = []
    real_find_spec, real_version = importlib.util.find_spec, importlib.metadata.version
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: course_spec if name == "course" else real_find_spec(name, *a))
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: torch_version if name == "torch" else real_version(name))
    def run(cmd, *args, **kwargs):  # the constraints file as pip would read it: the cell removes it afterwards
        ran.append([*cmd, "constraints:", open(cmd[cmd.index("-c") + 1]).read()])
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", run)
    exec(compile(launch.setup_source(), "<setup cell>", "exec"), {"__name__": "__main__"})
    return ran


@pytest.mark.parametrize("torch_version", ["2.13.0", "2.15.0+cu126", "3.0.0"])
def test_setup_cell_installs_beside_any_newer_torch_and_past_a_course_folder(monkeypatch, torch_version):
    """A torch newer than the tested range is kept, not refused (the day Colab moves on, lessons
    still start; course.doctor() says it is untested), and a folder named `course` in the working
    directory (a clone of this repository: a namespace package, no origin) is not the package."""
    import importlib.machinery

    folder = importlib.machinery.ModuleSpec("course", None, is_package=True)  # what a plain folder gives
    for spec in (None, folder):
        ran = _run_setup_cell(monkeypatch, torch_version, spec)
        assert len(ran) == 2, ran
        package, needs = ran
        assert "--no-deps" in package and launch.requirement() in package
        assert package[-1] == needs[-1] == f"torch=={torch_version}\n"
        assert not os.path.exists(package[package.index("-c") + 1]), "the constraints file was left behind"
        needs = needs[needs.index("-c") + 2:-2]
        assert not any(r.startswith("torch") for r in needs), needs
        assert any(r.startswith("opacus") for r in needs) and any(r.startswith("numpy") for r in needs)


def test_setup_cell_refuses_a_torch_older_than_the_range_with_what_to_do(monkeypatch):
    with pytest.raises(RuntimeError, match=r"needs torch 2.4 or newer; you have 2.3.1.*pytorch.org"):
        _run_setup_cell(monkeypatch, "2.3.1", None)


def test_setup_cell_keeps_torch_by_constraint():
    src = launch.setup_source()
    assert "torch==" in src and '"-c", keep' in src, "the installed torch must be pinned while pip runs"
    assert "--upgrade" not in src and "--force-reinstall" not in src


# -- the cell helper ---------------------------------------------------------------------------

def test_self_check_on_nothing_done_reports_every_exercise_not_run(capsys):
    """A fresh kernel (nothing run yet): every exercise is 'not run', none is a crash."""
    report = course.self_check(FAST, namespace={})
    assert report.n_passed == 0 and {r.status for r in report.results} == {"not run"}
    assert "0 of 6 exercises pass, 0 of 13 points" in capsys.readouterr().out


def test_self_check_passes_a_finished_lesson_and_names_a_planted_mistake(tmp_path, capsys):
    nb = solved_notebook(FAST)
    namespace = run_cells(nb, tmp_path)
    capsys.readouterr()  # the notebook's own output
    report = course.self_check(FAST, namespace=namespace)
    out = capsys.readouterr().out
    # (a busy machine may leave the speed bar undecided: said so, never a pass, never a FAIL)
    undecided = {r.grade_id for r in report.results if r.status == "undecided"}
    assert undecided <= {"test_jacobian_speed"}, str(report)
    assert report.complete or undecided, str(report)
    assert "FAIL" not in out and ("6 of 6 exercises pass, 13 of 13 points" in out or "run that test cell again" in out)
    assert "ok:" not in out, "the tests' own chatter stays out of the report"
    assert progress.load()[FAST].earned == 13 - (2 if undecided else 0)

    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if PLANTED[0] in src:
            cell["source"] = src.replace(PLANTED[0], PLANTED[1])
            break
    else:
        pytest.fail("the planted mistake's anchor is not in lesson 4's solution")
    (tmp_path / "wrong").mkdir()
    namespace = run_cells(nb, tmp_path / "wrong")
    capsys.readouterr()
    wrong = course.self_check(FAST, namespace=namespace)
    failed = [r.grade_id for r in wrong.results if not r.passed and r.status != "undecided"]
    assert failed == ["test_dual"], str(wrong)
    assert "FAIL  Exercise 1" in capsys.readouterr().out


def test_an_undecided_speed_check_is_reported_as_such_neither_pass_nor_fail(capsys):
    from course.grading import SpeedUndecided
    from course.selfcheck import Exercise, _run_test

    ex = Exercise("test_x", 2.0, "Exercise 9: speed", "raise SpeedUndecided('Undecided: 1.3x, bar 1.4x')")
    result = _run_test(ex, {"SpeedUndecided": SpeedUndecided})
    assert result.status == "undecided" and not result.passed and "Undecided" in result.message
    report = selfcheck.Report(FAST, [result], how="self_check")
    text = str(report)
    assert "????  Exercise 9" in text and "run that test cell again" in text and "FAIL" not in text
    assert not report.complete


@pytest.mark.parametrize("lesson_id", LESSON_IDS)
def test_self_check_on_an_untouched_lesson_fails_every_exercise_and_says_what_to_do(lesson_id, tmp_path):
    nb = json.loads((ROOT / "lessons" / lesson_id / f"{lesson_id}.ipynb").read_text())
    report = course.self_check(lesson_id, namespace=run_cells(nb, tmp_path), show=False)
    assert report.n_passed == 0 and len(report.results) == len(selfcheck.exercises(lesson_id)), str(report)
    for r in report.results:  # each names the function and the next step
        assert ("is not written yet: replace `raise NotImplementedError()`" in r.message
                or "does not exist yet: write the cell that defines it" in r.message), (r.title, r.message)


def test_self_check_is_skipped_under_the_grader(monkeypatch, capsys):
    monkeypatch.setenv(selfcheck.SKIP_ENV, "1")
    assert course.self_check(FAST, namespace={}) is None
    assert "skipped" in capsys.readouterr().out


def test_self_check_of_an_unknown_lesson_says_which_exist():
    with pytest.raises(ValueError, match="01_custom_rnns"):
        course.self_check("07_nope", namespace={})


# -- the commands ------------------------------------------------------------------------------

def course_cli(*args: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "course", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.notebooks
def test_check_and_progress_commands(tmp_path):
    env = dict(os.environ, COURSE_PROGRESS_FILE=str(tmp_path / "progress.json"))
    lessons = tmp_path / "lessons"
    solved = write_solved(lessons, FAST)
    proc = course_cli("check", str(solved), cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "6 of 6 exercises pass, 13 of 13 points" in proc.stdout
    assert "WARNING" not in proc.stderr, proc.stderr[-2000:]

    proc = course_cli("progress", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "13 of 13 points, 6 of 6 exercises pass" in proc.stdout
    assert "not checked yet" in proc.stdout and "changed since" not in proc.stdout

    # The learner breaks exercise 1: progress notices the edit, --run checks again.
    nb = json.loads(solved.read_text())
    for cell in nb["cells"]:
        cell["source"] = "".join(cell["source"]).replace(PLANTED[0], PLANTED[1])
    solved.write_text(json.dumps(nb))
    assert "notebook changed since" in course_cli("progress", cwd=tmp_path, env=env).stdout
    proc = course_cli("progress", "--run", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "10 of 13 points, 5 of 6 exercises pass" in proc.stdout, proc.stdout
    assert "to do: Exercise 1" in proc.stdout

    proc = course_cli("check", str(solved), cwd=tmp_path, env=env)
    assert proc.returncode == 1 and "FAIL  Exercise 1: a dual-number class" in proc.stdout


def test_check_command_explains_bad_input(tmp_path):
    env = dict(os.environ, COURSE_PROGRESS_FILE=str(tmp_path / "progress.json"))
    proc = course_cli("check", "nope.ipynb", cwd=tmp_path, env=env)
    assert proc.returncode == 2 and "no such notebook" in proc.stderr and "lessons/01_custom_rnns" in proc.stderr
    (tmp_path / "notes.ipynb").write_text("not json")
    proc = course_cli("check", "notes.ipynb", cwd=tmp_path, env=env)
    assert proc.returncode == 2 and "Could not read" in proc.stderr
    (tmp_path / "07_other.ipynb").write_text(json.dumps({"cells": [], "metadata": {}}))
    proc = course_cli("check", "07_other.ipynb", cwd=tmp_path, env=env)
    assert proc.returncode == 2 and "Which lesson" in proc.stderr


def test_check_explains_a_kernel_that_cannot_start(tmp_path):
    solved = write_solved(tmp_path / "lessons", FAST)
    with pytest.raises(RuntimeError, match="could not run .* in a Python kernel .*pip install ipykernel"):
        selfcheck.check_notebook(solved, kernel_name="no-such-kernel", record=False)


def test_progress_survives_a_damaged_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "progress.json").write_text("{broken")
    assert progress.load() == {}
    text = progress.summary(tmp_path)
    total = sum(item["points"] for item in catalog())
    assert f"0 of {total:g} points" in text and text.count("not checked yet") == len(LESSON_IDS)

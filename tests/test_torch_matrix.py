"""The torch matrix (make torch-matrix): its runner sees the warnings a learner would see in
Jupyter and stops at the first failing cell, its versions come from pyproject.toml and the pins,
and its page says what ran where. (The matrix itself downloads torch builds: run by hand, its
result committed as docs/compatibility.md.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch_matrix as TM  # noqa: E402


def _notebook(path: Path, *cells: str) -> Path:
    path.write_text(json.dumps({"cells": [{"cell_type": "code", "source": c} for c in cells]}))
    return path


def test_the_runner_shows_what_jupyter_shows_and_stops_at_an_error(tmp_path):
    (tmp_path / "runner.py").write_text(TM.RUNNER)
    (tmp_path / "lib_mod.py").write_text("import warnings\n"
                                         "def old():\n    warnings.warn('library deprecation', DeprecationWarning)\n"
                                         "def future():\n    warnings.warn('changes soon', FutureWarning)\n")
    nb = _notebook(tmp_path / "nb.ipynb",
                   "import sys; sys.path.insert(0, '.')\nimport lib_mod\nlib_mod.old()\nlib_mod.future()",
                   "import warnings\nwarnings.warn('from the notebook', DeprecationWarning)",
                   "raise ValueError('planted')", "print('never')")
    proc = subprocess.run([sys.executable, "runner.py", str(nb), str(tmp_path / "cells")], cwd=tmp_path,
                          capture_output=True, text=True)
    cells = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("CELL ")]
    assert proc.returncode == 1 and len(cells) == 3
    assert cells[0]["warnings"] == ["FutureWarning: changes soon"]  # a library's DeprecationWarning is hidden
    assert cells[1]["warnings"] == ["DeprecationWarning: from the notebook"]
    assert cells[2]["error"] == "ValueError: planted"


def test_the_versions_are_the_range_and_the_pins(monkeypatch):
    low, cap = TM.accepted_range()
    assert (low, cap) == ("2.4", "2.16")
    monkeypatch.setattr(TM, "_newest_below", lambda cap: "2.15.0")
    monkeypatch.setattr(TM, "gpu_versions", lambda: [])
    assert TM.default_versions() == ["2.4.0", TM.pinned(), "2.15.0"]
    monkeypatch.setattr(TM, "gpu_versions", lambda: ["2.11.0"])
    assert TM.default_versions() == ["2.4.0", "2.11.0", TM.pinned(), "2.15.0"]


def test_the_gpu_acceptances_torch_is_a_version_of_the_matrix(tmp_path):
    record = tmp_path / "acceptance-cuda.json"
    env = lambda torch: {"environment": {"torch": torch}}  # noqa: E731
    record.write_text(json.dumps({"lessons": {"a": env("2.11.0+cu130"), "b": env("2.11.0+cu130"),
                                              "c": env("2.16.1+cu130"), "d": env("2.3.1"), "e": {}}}))
    assert TM.gpu_versions(record) == ["2.11.0"]  # outside the range: not a promise of the package
    assert TM.gpu_versions(tmp_path / "none.json") == []


def test_the_page_names_every_version_lesson_and_warning():
    results = {"2.4.0": {"04_forward_ad": {"ok": True, "seconds": 40.0, "error": None, "warnings": []}},
               "2.14.1": {"04_forward_ad": {"ok": False, "seconds": 12.0, "error": "cell 3: ValueError: x",
                                            "warnings": ["FutureWarning: y"]}}}
    text = TM.markdown(results, ["04_forward_ad"], "a test machine", "2026-11-25")
    assert "| 04_forward_ad | passes (40 s) | FAILS (12 s, 1 warning(s)) |" in text
    assert "fails at cell 3: ValueError: x" in text and "04_forward_ad: FutureWarning: y" in text
    results["2.4.0"]["04_forward_ad"]["seconds"] = 181.0  # a lesson runs in 3 minutes on 2 cores, or says not
    text = TM.markdown(results, ["04_forward_ad"], "a test machine", "2026-11-25")
    assert "| 04_forward_ad | passes (181 s, over the lesson's 180 s budget) |" in text


def test_the_committed_matrix_covers_the_declared_range():
    """pyproject.toml declares what docs/compatibility.json shows: every lesson passing on the lowest
    release it accepts, on the pinned one, on a release of the newest minor version below its cap,
    and on each release the GPU acceptance ran on, each on the lesson as it is now. Changing the range, or a lesson, without running the
    matrix again fails here."""
    from course.lessons import catalog

    runs = json.loads((ROOT / "docs" / "compatibility.json").read_text())["runs"]
    low, cap = TM.accepted_range()
    major, minor = (int(p) for p in cap.split(".")[:2])
    newest = [v for v in runs if tuple(int(p) for p in v.split(".")[:2]) == (major, minor - 1)]
    assert TM._full(low) in runs and TM.pinned() in runs and newest, sorted(runs)
    assert all(v in runs for v in TM.gpu_versions()), (TM.gpu_versions(), sorted(runs))
    for version in (TM._full(low), TM.pinned(), *newest, *TM.gpu_versions()):
        results = runs[version]
        assert set(results) == {item["id"] for item in catalog()}, version
        assert all(r["ok"] and not r["warnings"] for r in results.values()), (version, results)
        stale = sorted(lesson for lesson, r in results.items() if r.get("lesson") != TM.lesson_print(lesson))
        assert not stale, (f"torch {version}: figures of an earlier version of {stale}: "
                           f"python benchmarks/torch_matrix.py --versions {version} " +
                           " ".join(f"--lesson {lesson}" for lesson in stale))
    # every figure the page shows, in or beside the declared range: the lesson ran within its CPU budget (3 min
    # on 2 cores), as the README promises
    budgets = {item["id"]: item["cpu_budget_s"] for item in catalog()}
    slow = sorted((version, lesson, r["seconds"]) for version, results in runs.items() for lesson, r in results.items()
                  if lesson in budgets and r["seconds"] > budgets[lesson])
    assert not slow, f"over the lesson's budget (run again on a quiet machine, or make the lesson lighter): {slow}"


def test_a_figure_of_an_earlier_lesson_says_so(tmp_path):
    now = TM.lesson_print("04_forward_ad")
    results = {"2.4.0": {"04_forward_ad": {"ok": True, "seconds": 40.0, "error": None, "warnings": [],
                                           "lesson": "0" * 12, "machine": "m1", "date": "2026-11-25"}},
               "2.15.0": {"04_forward_ad": {"ok": True, "seconds": 30.0, "error": None, "warnings": [],
                                            "lesson": now, "machine": "m2", "date": "2026-11-28"}}}
    text = TM.markdown(results, ["04_forward_ad"], "m2", "2026-11-28", {"04_forward_ad": now})
    assert "| 04_forward_ad | passes (40 s, on an earlier version of the lesson) | passes (30 s) |" in text
    assert "Ran on m1, 2026-11-25." in text and "Ran on m2, 2026-11-28." in text


def test_a_run_on_another_python_is_a_column_of_its_own(monkeypatch):
    assert TM.column("2.15.0") == "2.15.0"                       # this interpreter: the version alone
    monkeypatch.setattr(TM, "python_version", lambda python: "3.12")
    assert TM.column("2.15.0", "/some/python3.12") == "2.15.0 (Python 3.12)"
    results = {"2.15.0 (Python 3.12)": {"04_forward_ad": {"ok": True, "seconds": 30.0, "error": None, "warnings": []}}}
    text = TM.markdown(results, ["04_forward_ad"], "a test machine", "2026-11-25")
    assert "| lesson | torch 2.15.0 (Python 3.12) |" in text and "unless a column names another" in text


@pytest.mark.parametrize("learners_copy", [True, False])
def test_a_learners_run_has_no_course_references_as_a_learners_copy_has_none(tmp_path, learners_copy):
    """The learner's run is the bundle's: course.references cannot be imported, so each visible check
    runs on its stored data (and a lesson cell that used a reference would fail); run_lesson asks for it."""
    import inspect

    (tmp_path / "runner.py").write_text(TM.RUNNER)
    nb = _notebook(tmp_path / "nb.ipynb",
                   f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
                   "from course.checks.common import grader_references\n"
                   "print('REFS', grader_references('rnn') is not None)",
                   "import course.references.vmap")
    env = {"COURSE_LEARNERS_COPY": "1" if learners_copy else "0", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "runner.py", str(nb), str(tmp_path / "cells")], cwd=tmp_path,
                          capture_output=True, text=True, env=env)
    cells = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("CELL ")]
    assert f"REFS {not learners_copy}" in proc.stdout, proc.stdout + proc.stderr
    if learners_copy:
        assert proc.returncode == 1 and cells[1]["error"].startswith("ModuleNotFoundError"), cells
    else:
        assert proc.returncode == 0 and cells[1]["error"] is None, cells
    assert inspect.signature(TM.run_lesson).parameters["learners_copy"].default is True

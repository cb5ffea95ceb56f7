"""The instructor's report (``python -m autograder report OUT``): every number on it is checked
against the cells.csv and grades.csv it was made from, and it renders in headless Chromium."""

from __future__ import annotations

import csv
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from autograder.report import CellRow, Row, write_cells, write_grades
from autograder.verdict import REASONS

REPO = Path(__file__).resolve().parents[1]
EXERCISES = {"test_a": 2.0, "test_b": 1.0, "test_speed": 2.0}


def _class(out: Path, seed: int = 3) -> tuple[list[Row], list[CellRow]]:
    """A made-up class of 40 learners of two lessons, with every kind of verdict and status."""
    rng = random.Random(seed)
    rows, cells = [], []
    for n in range(40):
        student = f"s{n:02d}"
        for lesson in ("01_a", "02_b"):
            status = rng.choices(["graded", "missing", "invalid", "timeout"], [30, 3, 2, 2])[0]
            mine = []
            if status in ("graded", "timeout"):
                for g, pts in EXERCISES.items():
                    verdict = rng.choices(["passed", "failed", "undecided"], [6, 3, 1 if g == "test_speed" else 0])[0]
                    reason = "" if verdict == "passed" else "speed" if verdict == "undecided" else rng.choice(REASONS)
                    mine.append(CellRow(student, lesson, lesson, g, pts if verdict == "passed" else 0.0, pts,
                                        verdict, reason))
            flags = rng.choice(["", "", "", "tampered,patching"])
            rows.append(Row(student, lesson, sum(c.score for c in mine), 5.0, status, 0, rng.uniform(5, 90),
                            rng.uniform(300, 1500), flags, "", rng.choice(["cpu", "cuda"])))
            cells += mine
    out.mkdir(parents=True, exist_ok=True)
    write_grades(out, rows)
    write_cells(out, cells)
    return rows, cells


def _csv(path: Path) -> list[dict]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def test_every_number_of_the_report_is_what_the_csv_files_say(tmp_path):
    _class(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "autograder", "report", tmp_path], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "report" / "data.json").read_text())
    rows, cells = _csv(tmp_path / "grades.csv"), _csv(tmp_path / "cells.csv")
    assert data["students"] == 40
    for lesson in ("01_a", "02_b"):
        d = data["lessons"][lesson]
        mine = [r for r in rows if r["lesson_id"] == lesson]
        graded = [r for r in mine if r["status"] in ("graded", "timeout")]
        assert d["submissions"] == len(mine)
        assert d["status"] == {s: sum(r["status"] == s for r in mine) for s in {r["status"] for r in mine}}
        scores = sorted(float(r["score"]) for r in graded)
        assert sorted(d["scores"]) == scores
        assert d["mean"] == pytest.approx(sum(scores) / len(scores))
        assert d["full_marks"] == sum(s == 5.0 for s in scores)
        assert d["devices"] == {k: sum(r["device"] == k for r in graded) for k in {r["device"] for r in graded}}
        assert [f["student"] for f in d["flagged"]] == [r["student_id"] for r in mine if r["flags"]]
        for g, ex in d["exercises"].items():
            these = [c for c in cells if c["lesson_id"] == lesson and c["grade_id"] == g]
            assert ex["submissions"] == len(these)
            assert ex["passed"] == sum(c["verdict"] == "passed" for c in these)
            assert ex["undecided"] == sum(c["verdict"] == "undecided" for c in these)
            assert ex["failed"] == {r: sum(c["verdict"] == "failed" and c["reason"] == r for c in these) for r in REASONS}
            assert ex["pass_rate"] == pytest.approx(ex["passed"] / len(these))
        page = (tmp_path / "report" / f"{lesson}.html").read_text()
        # what the page shows is data.json's
        assert f"<b id=mean>{_fmt(d['mean'])}</b>" in page and f"<b id=full>{d['full_marks']}</b>" in page
        for g, ex in d["exercises"].items():
            row = re.search(rf"<tr id='ex-{g}'>(.*?)</tr>", page).group(1)
            numbers = re.findall(r"<td class=n>([^<]*)</td>", row)
            assert numbers[:4] == [_fmt(ex["max_points"]), str(ex["submissions"]),
                                   f"{100 * ex['pass_rate']:.0f}%", str(ex["undecided"])]
            assert numbers[4:] == [str(ex["failed"][r] or "") for r in REASONS]
        for png in re.findall(r"src='([^']+\.png)'", page):
            assert (tmp_path / "report" / png).read_bytes()[:4] == b"\x89PNG"
    index = (tmp_path / "report" / "index.html").read_text()
    assert "01_a.html" in index and "02_b.html" in index


def _fmt(x):
    return f"{x:.2f}".rstrip("0").rstrip(".") if x != int(x) else str(int(x))


def test_a_folder_without_grades_gets_a_clear_message(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "autograder", "report", tmp_path], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "expected grades.csv" in proc.stderr and "grade --out" in proc.stderr


@pytest.mark.timeout(300)
def test_the_report_renders_in_headless_chromium(tmp_path):
    from launch_helpers import system_package

    chromium = system_package("chromium", "chromium", "COURSE_REQUIRE_BROWSER")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")
    _class(tmp_path)
    subprocess.run([sys.executable, "-m", "autograder", "report", tmp_path], cwd=REPO, check=True,
                   capture_output=True)
    errors = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page()
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto((tmp_path / "report" / "index.html").as_uri())
            page.click("text=01_a")
            page.wait_for_selector("#mean")
            loaded = page.evaluate("() => [...document.images].map(i => i.complete && i.naturalWidth > 0)")
            assert loaded == [True, True]
            assert page.inner_text("#full") == str(json.loads((tmp_path / "report" / "data.json").read_text())
                                                   ["lessons"]["01_a"]["full_marks"])
            page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        finally:
            browser.close()
    assert errors == []

"""The Canvas export: a roster exported from Canvas comes back with the lessons' scores filled in,
matched by a column of the roster; missing work stays blank; strangers are named."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

from autograder.report import Row, write_grades

REPO = Path(__file__).resolve().parents[1]


def _grades(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = [Row("ada", "01_custom_rnns", 14.0, 14.0, "graded", 0, 30.0, 900.0, "", ""),
            Row("ada", "02_fx_transforms", 7.5, 13.0, "graded", 0, 30.0, 900.0, "", ""),
            Row("bo", "01_custom_rnns", 0.0, 14.0, "missing", 0, 0.0, 0.0, "", ""),
            Row("bo", "02_fx_transforms", 0.0, 13.0, "invalid", 0, 0.0, 0.0, "", ""),
            Row("zed", "01_custom_rnns", 3.0, 14.0, "graded", 0, 30.0, 900.0, "", "")]
    write_grades(out, rows)


def _run(*args):
    return subprocess.run([sys.executable, "-m", "autograder", "canvas", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True)


def _read(path: Path) -> list[list[str]]:
    with path.open(newline="") as fh:
        return list(csv.reader(fh))


def test_a_canvas_roster_comes_back_with_the_scores(tmp_path):
    _grades(tmp_path)
    roster = tmp_path / "export.csv"
    roster.write_text(
        "Student,ID,SIS User ID,SIS Login ID,Section,Lesson 1: 01_custom_rnns (881),Quiz 3 (882)\n"
        "    Points Possible,,,,,14,10\n"
        "\"Lovelace, Ada\",101,u101,ada,A,,9\n"
        "\"Bo, Bo\",102,u102,bo,A,,7\n"
        "\"Cy, Cy\",103,u103,cy,B,,8\n", encoding="utf-8")
    proc = _run(tmp_path, "--roster", roster, "--title", "02_fx_transforms=Lesson 2 (883)")
    assert proc.returncode == 0, proc.stderr
    got = _read(tmp_path / "canvas.csv")
    assert got[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "Lesson 1: 01_custom_rnns (881)",
                      "Lesson 2 (883)"]  # the quiz is left alone: Canvas keeps what a file does not name
    assert got[1][0] == "Points Possible" and got[1][5:] == ["14", "13"]
    assert got[2] == ["Lovelace, Ada", "101", "u101", "ada", "A", "14", "7.5"]
    assert got[3][5:] == ["", "0"]        # missing stays blank; invalid is 0
    assert got[4][5:] == ["", ""]         # on the roster, nothing graded
    assert "zed" in proc.stderr and "cy" in proc.stderr


def test_without_a_roster_the_student_id_is_the_sis_login_and_bad_input_is_explained(tmp_path):
    _grades(tmp_path)
    assert _run(tmp_path).returncode == 0
    got = _read(tmp_path / "canvas.csv")
    assert got[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "01_custom_rnns", "02_fx_transforms"]
    assert [r[3] for r in got[2:]] == ["ada", "bo", "zed"]
    proc = _run(tmp_path, "--roster", tmp_path / "export.csv")
    assert proc.returncode == 2 and "no such file" in proc.stderr
    (tmp_path / "r.csv").write_text("Student,ID\nA,1\n")
    proc = _run(tmp_path, "--roster", tmp_path / "r.csv")
    assert proc.returncode == 2 and "--match 'SIS Login ID'" in proc.stderr
    proc = _run(tmp_path / "nowhere")
    assert proc.returncode == 2 and "expected" in proc.stderr
    assert _run(tmp_path, "--title", "x").returncode == 2

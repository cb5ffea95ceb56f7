"""Colab, simulated: a bare Python with only PyTorch (as Colab has its own), the lesson's set-up
cell installing the helper package from a local copy of this repository, then lesson 1 to the
end. The set-up cell must leave torch alone, and do nothing once the package is there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from course import cells

from launch_helpers import ROOT, fresh_venv, pip, write_solved

pytestmark = [pytest.mark.notebooks, pytest.mark.timeout(1800)]

TORCH = "torch==2.13.0"  # the CPU build on disk here; Colab brings its own

# Runs a notebook's code cells in one namespace, as a kernel would, each cell from a file of its
# own (TorchScript reads functions' source from disk); prints a line per cell, exits 1 on an error.
# Guarded: a lesson that starts processes with torch.multiprocessing (lesson 10) re-imports this
# script in each child (spawn), which must not run the notebook again.
RUNNER = "if __name__ == '__main__':\n" + textwrap.indent(textwrap.dedent('''
    import json, os, sys, time, traceback
    nb = json.load(open(sys.argv[1]))
    cells_dir = sys.argv[2]
    # a third argument: run only the first cell ("first-only") or the first N cells
    limit = (int(sys.argv[3]) if sys.argv[3].isdigit() else 1) if len(sys.argv) > 3 else None
    os.makedirs(cells_dir, exist_ok=True)
    ns = {"__name__": "__main__"}
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for n, cell in enumerate(code[:limit]):
        src = "".join(cell["source"])
        path = os.path.join(cells_dir, f"cell_{n:03d}.py")
        with open(path, "w") as f:
            f.write(src)
        start = time.time()
        try:
            exec(compile(src, path, "exec"), ns)
        except BaseException:
            traceback.print_exc()
            print(f"CELL {n} FAILED", flush=True)
            sys.exit(1)
        print(f"CELL {n} ok {time.time() - start:.1f}s", flush=True)
'''), "    ")


def package_copy(dest: Path) -> Path:
    """What `pip install` from the repository at the release tag would see, minus tests/."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    for name in ("course", "autograder"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def torch_record(python: Path) -> str:
    """torch's installed version and the modification time of its RECORD: a reinstall changes it."""
    out = subprocess.run([str(python), "-c", "import importlib.metadata as m, os; d = m.distribution('torch');"
                          "print(d.version, os.path.getmtime(d._path / 'RECORD'))"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.fixture(scope="module")
def colab(tmp_path_factory):
    base = tmp_path_factory.mktemp("colab")
    log = base / "pip.log"
    python = fresh_venv(base / "venv", log)
    pip(python, ["install", "--quiet", TORCH], log)
    solved = write_solved(base / "work", "01_custom_rnns")
    write_solved(base / "work", "08_profiling_trace_diff")
    write_solved(base / "work", "09_attention_fast_paths")
    write_solved(base / "work", "10_data_parallel")
    (base / "runner.py").write_text(RUNNER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env.update(COURSE_PIP_SOURCE=str(package_copy(base / "package")), MPLBACKEND="Agg",
               COURSE_PROGRESS_FILE=str(base / "progress.json"), PIP_DISABLE_PIP_VERSION_CHECK="1",
               PATH=f"{python.parent}:{env.get('PATH', '')}")
    yield {"python": python, "base": base, "solved": solved, "env": env, "log": log}
    shutil.rmtree(base / "venv", ignore_errors=True)


def run(colab, *args: str, timeout: int = 1200, cwd: Path | None = None, **env) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(colab["python"]), str(colab["base"] / "runner.py"), *args],
                          cwd=cwd or colab["solved"].parent, env=dict(colab["env"], **env),
                          capture_output=True, text=True, timeout=timeout)
    with colab["log"].open("a") as f:
        f.write(proc.stdout + proc.stderr)
    return proc


def test_bare_python_has_torch_and_no_course(colab):
    proc = subprocess.run([str(colab["python"]), "-c", "import torch, importlib.util as u;"
                           "print(u.find_spec('course') is None, u.find_spec('matplotlib') is None)"],
                          capture_output=True, text=True, env=colab["env"], cwd=colab["base"])
    assert proc.stdout.split() == ["True", "True"], proc.stdout + proc.stderr


def test_a_course_folder_in_the_working_directory_does_not_fool_the_setup_cell(colab):
    """Cloning this repository on Colab makes a folder named `course` (no __init__.py: Python sees
    a namespace package). The set-up cell must install the package anyway, and the lesson's
    import cell then find `course.checks`. Runs first, while nothing is installed."""
    here = colab["base"] / "clone-beside"
    (here / "course" / "lessons").mkdir(parents=True)
    (here / "course" / "README.md").write_text("a clone of the course's repository\n")
    before = torch_record(colab["python"])
    scratch = colab["base"] / "scratch"  # the process's temporary folder: the cell leaves nothing there
    scratch.mkdir()
    proc = run(colab, str(colab["solved"]), str(colab["base"] / "cells-folder"), "2", cwd=here, TMPDIR=str(scratch))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CELL 1 ok" in proc.stdout
    assert torch_record(colab["python"]) == before, "the set-up cell reinstalled torch"
    assert not list(scratch.rglob("keep-torch.txt")), "the set-up cell left its constraints file behind"


def test_setup_cell_installs_the_package_and_keeps_torch(colab):
    before = torch_record(colab["python"])
    proc = run(colab, str(colab["solved"]), str(colab["base"] / "cells-setup"), "first-only")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert torch_record(colab["python"]) == before, "the set-up cell reinstalled torch"
    check = subprocess.run([str(colab["python"]), "-c", "import course, opacus, matplotlib, tqdm; print('ok')"],
                           capture_output=True, text=True, env=colab["env"], cwd=colab["base"])
    assert check.stdout.strip() == "ok", check.stderr[-2000:]


def test_setup_cell_does_nothing_once_the_package_is_there(colab):
    # A source pip could not install from: the cell must not even try.
    proc = run(colab, str(colab["solved"]), str(colab["base"] / "cells-again"), "first-only",
               COURSE_PIP_SOURCE=str(colab["base"] / "no-such-package"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "pip" not in proc.stderr.lower(), proc.stderr[-2000:]


def test_lesson_1_runs_to_the_end_with_every_exercise_passing(colab):
    proc = run(colab, str(colab["solved"]), str(colab["base"] / "cells"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "9 of 9 exercises pass, 14 of 14 points" in proc.stdout, proc.stdout[-3000:]
    progress = json.loads((colab["base"] / "progress.json").read_text())
    assert progress["lessons"]["01_custom_rnns"]["how"] == "self_check"


@pytest.mark.parametrize("lesson_id, also", [
    # without Holistic Trace Analysis (not a dependency of the package): its one cell says so, the lesson goes on
    ("08_profiling_trace_diff", "HTA is not installed here"),
    ("09_attention_fast_paths", None),
    # workers from the installed package (site-packages), the learner's functions copied from the notebook
    ("10_data_parallel", None),
])
def test_a_later_lesson_runs_to_the_end_with_every_exercise_passing(colab, lesson_id, also):
    solved = colab["solved"].parent.parent / lesson_id / f"{lesson_id}.ipynb"
    assert solved.is_file(), solved
    nb = json.loads((ROOT / "solutions" / lesson_id / f"{lesson_id}.ipynb").read_text())
    graded = [cells.points(c) for c in nb["cells"] if cells.is_test(c)]
    proc = run(colab, str(solved), str(colab["base"] / f"cells-{lesson_id[:2]}"), cwd=solved.parent)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    n, points = len(graded), f"{sum(graded):g}"
    assert f"{n} of {n} exercises pass, {points} of {points} points" in proc.stdout, proc.stdout[-3000:]
    assert also is None or also in proc.stdout, proc.stdout[-3000:]
    progress = json.loads((colab["base"] / "progress.json").read_text())
    assert progress["lessons"][lesson_id]["how"] == "self_check"

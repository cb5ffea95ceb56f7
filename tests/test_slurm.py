"""A class graded as a Slurm job array with the shipped job file, on a real (single-node) Slurm.

`.ci/run` starts slurmctld and slurmd on the CI machine (`.ci/slurm.sh`) and sets
COURSE_REQUIRE_SLURM; elsewhere, without `sbatch`, the test is skipped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_autograder import LESSON, course, read_csv  # noqa: F401
from test_shards import _class, database  # noqa: F401

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(900)
def test_a_job_array_of_shards_grades_the_class_into_one_gradebook(course, database, tmp_path):
    if shutil.which("sbatch") is None:
        if os.environ.get("COURSE_REQUIRE_SLURM"):
            pytest.fail("COURSE_REQUIRE_SLURM is set but sbatch is missing: .ci/run should start Slurm")
        pytest.skip("no Slurm here (.ci/run starts a single-node cluster)")
    subs = _class(course, tmp_path)
    env = {**os.environ, "COURSE_DB": database, "COURSE_DIR": str(REPO), "TMPDIR": str(tmp_path),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    # (the job file's own --mem and --cpus-per-task are for a real partition: this node is 2 cores)
    proc = subprocess.run(["sbatch", "--wait", "--array=0-1", "--cpus-per-task=1", "--mem=0", "--time=15",
                           f"--output={tmp_path}/grade-%a.log", str(REPO / "deploy" / "slurm-cpu.sbatch"),
                           str(subs), str(tmp_path / "out"), "--solutions", str(course["solutions"]),
                           "--cell-timeout", "30"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=880)
    logs = "".join(p.read_text()[-1500:] for p in sorted(tmp_path.glob("grade-*.log")))
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    for k in (1, 2):
        assert f"shard {k}/2 (from Slurm's SLURM_ARRAY_TASK_ID)" in logs
    done = subprocess.run([sys.executable, "-m", "autograder", "collect", "--db", database, "--out",
                           tmp_path / "class", "--work", tmp_path / "collect-work"], cwd=REPO, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    scores = {r["student_id"]: float(r["score"]) for r in read_csv(tmp_path / "class" / "grades.csv")}
    # right, right, untouched, mul wrong (loses its 1 point), add hard-coded (loses its 2), right, untouched
    assert scores == {"ada": 3, "bo": 3, "cy": 0, "di": 2, "ed": 1, "fay": 3, "gus": 0}
    assert "from 2 shard(s)" in done.stdout and LESSON

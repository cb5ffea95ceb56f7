"""A class graded in shards (``grade --shard K/N``) into one gradebook, gathered by ``collect``.

The shards here run at once on this machine, each with a work folder of its own (as separate
machines would have), writing one database: PostgreSQL where CI starts one, else one SQLite
file. What must hold: every submission is graded by exactly one shard; ``collect`` gives the
same grades as one serial run; a shard started again, even on a fresh machine, resumes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from autograder import UsageError
from autograder.shard import Shard, from_environment, parse, share
from test_autograder import (LESSON, NOTEBOOK, _pg_url, course, read_csv, solution_version,  # noqa: F401
                                   student_version, with_answer)

REPO = Path(__file__).resolve().parents[1]


# -- which shard, and which share ------------------------------------------------------------

def test_a_shard_is_read_from_the_flag_or_from_the_engine_that_started_the_job():
    assert parse("2/4") == Shard(1, 4) and str(parse(" 4 / 4 ")) == "4/4"
    for bad in ("0/4", "5/4", "2/0", "2", "a/b", ""):
        with pytest.raises(UsageError, match="K/N"):
            parse(bad)
    assert from_environment({}) is None
    assert from_environment({"COURSE_SHARD": "3/5"}) == Shard(2, 5, "COURSE_SHARD")
    slurm = {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "0"}
    assert from_environment(slurm).index == 3 and from_environment(slurm).count == 4
    assert from_environment({**slurm, "SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_MIN": "1"}).index == 3
    with pytest.raises(UsageError, match="step"):
        from_environment({**slurm, "SLURM_ARRAY_TASK_STEP": "2"})
    with pytest.raises(UsageError, match="does not exist"):
        from_environment({**slurm, "SLURM_ARRAY_TASK_ID": "9"})
    with pytest.raises(UsageError, match="COURSE_SHARDS"):
        from_environment({"JOB_COMPLETION_INDEX": "0"})
    assert from_environment({"JOB_COMPLETION_INDEX": "2", "COURSE_SHARDS": "3"}) == Shard(2, 3, "Kubernetes' JOB_COMPLETION_INDEX")
    assert from_environment({"CI_NODE_INDEX": "1", "CI_NODE_TOTAL": "2"}).index == 0
    with pytest.raises(UsageError, match="whole number"):
        from_environment({"SLURM_ARRAY_TASK_ID": "x", "SLURM_ARRAY_TASK_COUNT": "2"})


def test_shares_are_disjoint_complete_deterministic_and_balanced_by_cost():
    import random

    rng = random.Random(7)
    costs = {"l1": 35.0, "l2": 26.0, "l5": 44.0, "l6": 25.0}
    items = [(f"s{i:03d}", lesson) for i in range(97) for lesson in costs if rng.random() < 0.8]
    for n in (1, 2, 3, 5):
        shares = [share(items, Shard(k, n), key=lambda t: (t[1], t[0]), cost=lambda t: costs[t[1]])
                  for k in range(n)]
        flat = [t for s in shares for t in s]
        assert sorted(flat) == sorted(items) and len(flat) == len(set(flat))  # each exactly once
        for s in shares:
            assert s == [t for t in items if t in set(s)]  # in the class's order
        shuffled = items[:]
        rng.shuffle(shuffled)
        again = [sorted(share(shuffled, Shard(k, n), key=lambda t: (t[1], t[0]), cost=lambda t: costs[t[1]]))
                 for k in range(n)]
        assert again == [sorted(s) for s in shares]  # the deal does not depend on the listing order
        loads = [sum(costs[t[1]] for t in s) for s in shares]
        assert max(loads) - min(loads) <= max(costs.values())


# -- shards for real -------------------------------------------------------------------------

def _grade(*args, env=None):
    return subprocess.Popen([sys.executable, "-m", "autograder", *map(str, args)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})})


def _finish(proc):
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    return out, err


@pytest.fixture
def database(tmp_path):
    """One gradebook for the class: a fresh PostgreSQL database where a server is configured, else
    one SQLite file outside every shard's work folder."""
    if not os.environ.get("COURSE_TEST_PG_URL") and not os.environ.get("COURSE_REQUIRE_PG"):
        yield f"sqlite:///{tmp_path / 'class.db'}"
        return
    import psycopg2

    admin = _pg_url()
    name = f"course_shards_{uuid.uuid4().hex[:10]}"
    conn = psycopg2.connect(admin)
    conn.autocommit = True
    conn.cursor().execute(f"CREATE DATABASE {name}")
    try:
        yield admin.rsplit("/", 1)[0] + "/" + name
    finally:
        cur = conn.cursor()
        cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        cur.execute(f"DROP DATABASE IF EXISTS {name}")
        conn.close()


def _class(course, root: Path) -> Path:
    """Seven learners of the toy lesson: right, wrong, untouched, half right."""
    import nbformat

    subs = root / "subs"
    cases = {"ada": solution_version(course), "bo": solution_version(course), "cy": student_version(course),
             "di": with_answer(solution_version(course), "mul_solution", "def mul(a, b):\n    return a + b"),
             "ed": with_answer(solution_version(course), "add_solution", "def add(a, b):\n    return 3"),
             "fay": solution_version(course), "gus": student_version(course)}
    for student, nb in cases.items():
        (subs / student / LESSON).mkdir(parents=True)
        nbformat.write(nb, subs / student / LESSON / NOTEBOOK)
    return subs


@pytest.mark.timeout(900)
def test_shards_at_once_into_one_gradebook_collect_what_one_serial_run_grades(course, database, tmp_path):
    subs = _class(course, tmp_path)
    common = ["--solutions", course["solutions"], "--db", database, "--cell-timeout", 10, "--out", tmp_path / "out"]
    serial = _grade("grade", subs, "--solutions", course["solutions"], "--work", tmp_path / "serial-work",
                    "--out", tmp_path / "serial", "--cell-timeout", 10)
    _finish(serial)
    # three shards started together, each on a "machine" of its own (its own work folder); the
    # second reads its shard from a Slurm job array's variables, the third from COURSE_SHARD
    shards = [_grade("grade", subs, *common, "--work", tmp_path / "w1", "--shard", "1/3"),
              _grade("grade", subs, *common, "--work", tmp_path / "w2",
                     env={"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_MIN": "0"}),
              _grade("grade", subs, *common, "--work", tmp_path / "w3", env={"COURSE_SHARD": "3/3"})]
    outs = [_finish(p)[0] for p in shards]
    graded = []
    for k, out in enumerate(outs, 1):
        assert f"shard {k}/3" in out
        graded += [(r["student_id"], r["lesson_id"]) for r in read_csv(tmp_path / "out" / "shards" / f"shard-{k}-of-3" / "grades.csv")]
    assert sorted(graded) == sorted((s, LESSON) for s in ("ada", "bo", "cy", "di", "ed", "fay", "gus"))

    proc = subprocess.run([sys.executable, "-m", "autograder", "collect", "--db", database, "--out",
                           tmp_path / "class", "--work", tmp_path / "w1"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "collected 7 graded submission(s) from 3 shard(s)" in proc.stdout
    want = {r["student_id"]: (r["score"], r["status"]) for r in read_csv(tmp_path / "serial" / "grades.csv")}
    got = {r["student_id"]: (r["score"], r["status"]) for r in read_csv(tmp_path / "class" / "grades.csv")}
    assert got == want and want["ada"][0] == "3" and want["cy"][0] == "0"
    cells = {(r["student_id"], r["grade_id"]): r["score"] for r in read_csv(tmp_path / "class" / "cells.csv")}
    assert cells == {(r["student_id"], r["grade_id"]): r["score"] for r in read_csv(tmp_path / "serial" / "cells.csv")}
    for student in want:
        assert (tmp_path / "class" / "feedback" / student / LESSON / f"{LESSON}.html").read_text().startswith("<!doctype")

    # shard 2 started again on a fresh machine (a new work folder): it resumes from the gradebook
    again = _grade("grade", subs, *common, "--work", tmp_path / "w2-again", "--shard", "2/3")
    out, _ = _finish(again)
    rows = read_csv(tmp_path / "out" / "shards" / "shard-2-of-3" / "grades.csv")
    assert rows and all("resumed" in r["detail"] for r in rows), out[-2000:]


def test_collect_says_what_is_wrong_with_an_empty_or_unreadable_gradebook(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "autograder", "collect", "--out", tmp_path / "o", "--work",
                           tmp_path / "w"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "holds no graded submission yet" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "autograder", "grade", tmp_path, "--out", tmp_path / "o",
                           "--shard", "4/3"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "1 <= K <= N" in proc.stderr

"""Grading in shards on one machine: submissions per minute with 1, 2 and 3 shards, what grading
adds to a submission's own cells, and the gradebook's write rate under concurrent shards.

    .venv/bin/python benchmarks/grading_shards.py [--lesson 04_forward_ad] [--copies 6] [--shards 1,2,3]

The shards share this machine's cores, so the figure is the cost of sharding (each shard runs
the instructor's solution once, and they compete for the cores), not a speed-up: on a cluster
each shard has a machine of its own. Every shard gets a work folder of its own, as separate
machines would, and all write one gradebook (SQLite here; `--db URL` for PostgreSQL). Writes
benchmarks/results/grading-shards-<lesson>-cpu.md and .json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _grade(subs: Path, out: Path, work: Path, db: str, shard: str | None) -> subprocess.Popen:
    args = [sys.executable, "-m", "autograder", "grade", str(subs), "--out", str(out), "--work", str(work),
            "--db", db, "--jobs", "1", "--device", "cpu"] + (["--shard", shard] if shard else [])
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _writer(db: str, n: int, k: int, q) -> None:
    from autograder import classdb

    start = time.perf_counter()
    for i in range(n):
        classdb.store(db, f"w{k}-s{i}", "lesson", "key", {"row": {}, "cells": []}, "<p>page</p>", f"shard-{k}")
    q.put(time.perf_counter() - start)


def write_rate(db: str, shards: int, rows: int = 200) -> float:
    """Rows per second that ``shards`` processes upsert into the results table at once."""
    q = multiprocessing.get_context("spawn").Queue()
    procs = [multiprocessing.get_context("spawn").Process(target=_writer, args=(db, rows, k, q)) for k in range(shards)]
    start = time.perf_counter()
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    took = time.perf_counter() - start
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit("a gradebook writer failed (see above)")
    return shards * rows / took


def _fresh_database(url: str, n: int) -> str:
    """A new, empty database on the server of ``url`` (each shard count grades from scratch)."""
    import psycopg2

    name = f"grading_shards_{n}_{os.getpid()}"
    conn = psycopg2.connect(url)
    conn.autocommit = True
    conn.cursor().execute(f"DROP DATABASE IF EXISTS {name}")
    conn.cursor().execute(f"CREATE DATABASE {name}")
    conn.close()
    from autograder.workspace import _driver

    return _driver(url.rsplit("/", 1)[0] + "/" + name)  # the driver the grader itself uses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lesson", default="04_forward_ad")
    parser.add_argument("--copies", type=int, default=6, help="submissions (the instructor's solution, copied)")
    parser.add_argument("--shards", default="1,2,3")
    parser.add_argument("--db", default=None,
                        help="a PostgreSQL server URL: a fresh database is made on it per shard count (default: "
                             "one SQLite file per shard count)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    from course.doctor import machine_name

    tmp = Path(tempfile.mkdtemp(prefix="shards-"))
    src = ROOT / "solutions" / args.lesson / f"{args.lesson}.ipynb"
    subs = tmp / "subs"
    for i in range(args.copies):
        (subs / f"learner{i:02d}" / args.lesson).mkdir(parents=True)
        shutil.copy(src, subs / f"learner{i:02d}" / args.lesson / src.name)
    results = {"lesson": args.lesson, "copies": args.copies, "machine": machine_name(), "cores": os.cpu_count(),
               "date": time.strftime("%Y-%m-%d"), "runs": {}}
    for n in [int(x) for x in args.shards.split(",")]:
        db = _fresh_database(args.db, n) if args.db else f"sqlite:///{tmp / f'class-{n}.db'}"
        start = time.monotonic()
        procs = [_grade(subs, tmp / f"out-{n}", tmp / f"work-{n}-{k}", db, f"{k}/{n}" if n > 1 else None)
                 for k in range(1, n + 1)]
        for p in procs:
            out, err = p.communicate()
            if p.returncode != 0:
                print(out[-2000:], err[-2000:])
                return 1
        wall = time.monotonic() - start
        timings = [json.loads(f.read_text())["timings"] for k in range(1, n + 1)
                   for f in (tmp / f"work-{n}-{k}" / "results").glob(f"*/{args.lesson}.json")]
        total = [t["staging"] + t["run"] + t["after"] for t in timings]
        results["runs"][n] = {"wall_s": round(wall, 1), "per_minute": round(60 * args.copies / wall, 2),
                              "submission_s": round(statistics.median(total), 1),
                              "cells_s": round(statistics.median(t["cells"] for t in timings), 1),
                              "added": round(statistics.median((a - t["cells"]) / t["cells"]
                                                               for a, t in zip(total, timings)), 3),
                              "db_rows_per_s": round(write_rate(db, n), 1)}
        print(n, results["runs"][n], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"grading-shards-{args.lesson}-cpu"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [f"# Grading in shards on one machine: {args.lesson}", "",
             f"{results['machine']}, {results['cores']} cores, {results['date']}; {args.copies} submissions (the "
             "instructor's solution), `--jobs 1` per shard, each shard with a work folder of its own (as separate "
             f"machines), one {'PostgreSQL' if args.db else 'SQLite'} gradebook. Written by "
             "`benchmarks/grading_shards.py`. The shards share these cores, so more shards cost time here "
             "(each runs the instructor's solution once, and they compete): on a cluster each has a machine.", "",
             "| shards | wall | submissions per minute | one submission (median) | its cells | added by grading "
             "| gradebook upserts per second, all shards at once |", "|---|---|---|---|---|---|---|"]
    for n, r in results["runs"].items():
        lines.append(f"| {n} | {r['wall_s']} s | {r['per_minute']} | {r['submission_s']} s | {r['cells_s']} s | "
                     f"{100 * r['added']:.0f}% | {r['db_rows_per_s']} |")
    lines += ["", "\"Added by grading\" is a submission's time beyond its cells' own: vetting, the sandbox's start, "
              "the parent's verdicts, the gradebook and the feedback page (the target is at most 20%)."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(stem.with_suffix(".md").read_text())
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

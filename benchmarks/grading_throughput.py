"""Grading throughput: submissions per minute for one lesson with --jobs 1 and --jobs 2.

    python benchmarks/grading_throughput.py                 # lesson 1, 4 submissions per run
    python benchmarks/grading_throughput.py --lesson 02_fx_transforms --count 6
    python benchmarks/grading_throughput.py --lesson 03_channels_last --against dd623c3^   # beside grader 7

Every submission is the instructor's notebook under a new student id (so nothing is resumed).
A warm-up run with one student first makes the lesson's instructor transcript, which every later
run reuses from the work folder; the figure is the wall time of a whole `grade` command over
``count`` submissions, sandbox start-up, set-up cells and speed checks included. Results go to
benchmarks/results/grading-throughput-<lesson>-<device>.md/.json with the machine named.

``--against REV`` also grades with the grader of git revision ``REV`` (its files, unpacked in a
temporary folder, with its own ``course``), on this machine in the same run, the two graders'
runs interleaved: the one comparison that is not also a comparison of two machines or two days.
It is kept in the results until the next ``--against``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from course.doctor import machine_name  # noqa: E402


def run(subs: Path, out: Path, work: Path, lesson: str, jobs: int, root: Path = ROOT) -> tuple[float, list[str]]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "autograder", "grade", str(subs), "--out", str(out), "--work",
                           str(work), "--lesson", lesson, "--jobs", str(jobs)], cwd=root, capture_output=True,
                          text=True)
    took = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
    lines = (out / "grades.csv").read_text().splitlines()[1:]
    return took, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lesson", default="01_custom_rnns")
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--against", metavar="REV", help="also grade with the grader of git revision REV, "
                        "on this machine, in the same run")
    args = parser.parse_args()
    source = ROOT / "solutions" / args.lesson / f"{args.lesson}.ipynb"
    tmp = Path(tempfile.mkdtemp(prefix="throughput-"))
    work = tmp / "work"

    def students(prefix: str, n: int) -> Path:
        subs = tmp / f"subs-{prefix}"
        for i in range(n):
            (subs / f"{prefix}{i}" / args.lesson).mkdir(parents=True)
            shutil.copy(source, subs / f"{prefix}{i}" / args.lesson / source.name)
        return subs

    against = None
    if args.against:
        against = tmp / "against"
        against.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.against], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(against)], input=archive.stdout, check=True)
        text = (against / "autograder" / "grade.py").read_text()
        version = text.split('GRADER_VERSION = "', 1)[1].split('"', 1)[0] if "GRADER_VERSION" in text else "?"
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.against], capture_output=True,
                                text=True, check=True).stdout.strip()
    print("warm-up: the instructor transcript and one submission", flush=True)
    run(students("warm", 1), tmp / "out-warm", work, args.lesson, 1)
    if against is not None:
        run(students("warm-against", 1), tmp / "out-warm-against", tmp / "work-against", args.lesson, 1, against)
    results, theirs = {}, {}
    for jobs in (1, 2):
        for side in ("now", "against") if against is not None else ("now",):
            mine = side == "now"
            took, lines = run(students(f"j{jobs}-{side}-", args.count), tmp / f"out-{jobs}-{side}",
                              work if mine else tmp / "work-against", args.lesson, jobs, ROOT if mine else against)
            scores = sorted({line.split(",")[2] + "/" + line.split(",")[3] for line in lines})
            result = {"seconds": round(took, 1), "per_minute": round(args.count / took * 60, 2), "scores": scores}
            (results if mine else theirs)[jobs] = result
            print(f"--jobs {jobs} ({'this grader' if mine else args.against}): {args.count} submissions in "
                  f"{took:.1f} s = {result['per_minute']} per minute; scores {scores}", flush=True)
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from autograder.grade import GRADER_VERSION

    record = {"lesson": args.lesson, "count": args.count, "machine": machine_name(), "date": dt.date.today().isoformat(),
              "torch": torch.__version__, "grader": GRADER_VERSION, "jobs": results}
    out_dir = ROOT / "benchmarks" / "results"
    path = out_dir / f"grading-throughput-{args.lesson}-{device}.json"
    before = json.loads(path.read_text()) if path.exists() else None
    if before and before.get("grader", "2") != GRADER_VERSION:
        record["previous_grader"] = {k: before[k] for k in ("grader", "date", "count", "jobs", "machine") if k in before}
        record["previous_grader"].setdefault("grader", "2")
        # The first figures ever recorded stay as the baseline every later grader is held to.
        first = before.get("baseline_grader") or before.get("previous_grader")
        if first:
            record["baseline_grader"] = first
    elif before:
        for key in ("previous_grader", "baseline_grader"):
            if key in before:
                record[key] = before[key]
    if against is not None:
        record["same_run"] = {"rev": args.against, "commit": commit, "grader": version, "date": record["date"],
                              "machine": record["machine"], "count": args.count,
                              "jobs": {str(j): r for j, r in theirs.items()}}
    elif before and "same_run" in before:
        record["same_run"] = before["same_run"]  # measured beside an earlier run of this grader: dated below
    path.write_text(json.dumps(record, indent=1) + "\n")
    rows = "\n".join(f"| {j} | {r['seconds']} | {r['per_minute']} | {', '.join(r['scores'])} |" for j, r in results.items())
    for prev in [p for p in (record.get("baseline_grader"), record.get("previous_grader")) if p][::-1]:
        change = "\n".join(
            f"| {j} | {prev['jobs'][str(j)]['per_minute']} | {results[j]['per_minute']} | "
            f"{results[j]['per_minute'] / prev['jobs'][str(j)]['per_minute']:.2f}x |"
            for j in results if str(j) in prev["jobs"])
        which = "the previous grader" if prev is record.get("previous_grader") else "the first grader measured"
        where = (f"on {prev['machine']}" if prev.get("machine") else "on the machine then recorded")
        if prev.get("machine") and prev["machine"] != record["machine"]:
            where += " (another machine: the ratio mixes the two machines with the two graders)"
        rows += (f"\n\nAgainst {which} (version {prev['grader']}, measured {prev['date']} {where}, "
                 f"{prev['count']} submissions per run):\n\n| --jobs | before, per minute | now, per minute | "
                 f"now / before |\n|---|---|---|---|\n{change}")
    same = record.get("same_run")
    if same:
        now_or_then = ("in this run, the two graders' runs interleaved" if against is not None else
                       f"beside an earlier run of this page's grader, {same['date']}, on {same['machine']}")
        change = "\n".join(
            f"| {j} | {same['jobs'][str(j)]['per_minute']} | {results[j]['per_minute']} | "
            f"{results[j]['per_minute'] / same['jobs'][str(j)]['per_minute']:.2f}x |"
            for j in results if str(j) in same["jobs"])
        rows += (f"\n\nAgainst grader version {same['grader']} (`{same['rev']}`, commit {same['commit']}: its own "
                 f"checkout and `course`), on this machine {now_or_then}, {same['count']} submissions per run:\n\n"
                 "| --jobs | that grader, per minute | this grader, per minute | this / that |\n|---|---|---|---|\n"
                 + change)
    (out_dir / f"grading-throughput-{args.lesson}-{device}.md").write_text(
        f"# Grading throughput, {args.lesson}\n\n{record['machine']}, torch {record['torch']}, {record['date']}.\n"
        f"{args.count} submissions per run (the instructor's notebook under new ids), sandboxed with "
        "bubblewrap, after a warm-up that made the instructor transcript.\n\n"
        f"Grader version {GRADER_VERSION}.\n\n"
        "| --jobs | seconds | submissions per minute | scores |\n|---|---|---|---|\n" + rows + "\n\n"
        f"Speedup of --jobs 2 over --jobs 1: {results[1]['seconds'] / results[2]['seconds']:.2f}x. Speed checks take "
        "turns (the other submission is paused while one measures), which caps the gain.\n")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

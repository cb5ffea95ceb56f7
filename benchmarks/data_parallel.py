"""Lesson 10: what data parallelism costs on this machine, as ratios. Two gloo ranks on the CPU run,
round after round and interleaved (``course.parallel.timing_case``), four kinds of training step on
the lesson's MLP: one process on the full batch (with the threads of both ranks), DDP on two ranks
(one thread each), and gradient accumulation over micro-batches synchronising every micro-batch or
once (``no_sync``). Then the bytes a ring all-reduce sends per rank, by the kernel's count, against
the library's ``all_reduce``.

    python benchmarks/data_parallel.py                   # the lesson's CPU sizes
    python benchmarks/data_parallel.py --size reference  # the lesson's larger sizes (default on CUDA machines)

Nothing here is graded: the lesson grades counts (bytes, synchronisations), never a clock, because
on two shared CPU cores DDP is slower than one process. Results are printed and written as JSON and
Markdown under benchmarks/results/, with the machine named.
"""

from __future__ import annotations

import datetime as dt
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import course  # noqa: E402
from _shared import parser  # noqa: E402  (benchmarks/_shared.py)
from autograder.solution_code import load_solution, solution_source  # noqa: E402
from course.doctor import machine_name as machine  # noqa: E402
from course.parallel import launch  # noqa: E402

LESSON = "10_data_parallel"
#: The notebook's sizes (course.sizes in its sizes cell): cpu, and reference for a CUDA machine.
SIZES = {"cpu": dict(width=512, depth=4, rows=512, micro=4),
         "reference": dict(width=1024, depth=4, rows=1024, micro=4)}


def main(argv=None) -> int:
    args = parser(__doc__, SIZES).parse_args(argv)
    dev = course.pick_device(args.device)
    size = args.size or ("reference" if dev.type == "cuda" else "cpu")
    S = SIZES[size]
    rounds = max(args.rounds, 3)
    r = launch("course.parallel:timing_case", 2, 0, S["width"], S["depth"], S["rows"], S["micro"], rounds,
               timeout_s=600)[0]
    med = {k: statistics.median(v) * 1e3 for k, v in r["times"].items()}
    quart = {k: statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3 for k, v in r["times"].items()}
    results = {"machine": machine(), "device": "cpu (gloo ranks)", "torch": torch.__version__, "size": size, "sizes": S,
               "date": dt.date.today().isoformat(), "rounds": rounds, "grad_mb": round(r["grad_bytes"] / 1e6, 2),
               "median_ms": {k: round(v, 2) for k, v in med.items()},
               "ddp_vs_one_process": round(med["one process"] / med["DDP"], 3),
               "no_sync_vs_every_micro_batch": round(med["every micro-batch"] / med["no_sync"], 3)}
    # the ring's bytes per rank, by the kernel's count, against the library's all_reduce
    folder = Path(tempfile.mkdtemp())
    sol = load_solution(solution_source(LESSON), folder / "l10.py", "l10")
    from course.checks.parallel import run_case, run_workers

    numel = 122880
    traffic = {}
    for n in (2, 4):
        ring = run_workers(sol.ring_all_reduce, "all_reduce_case", n, 0, numel)
        library = run_case("course.parallel:library_all_reduce", "all_reduce_case", n, 0, numel)
        traffic[n] = {"tensor_bytes": numel * 8, "ring_wire": ring[0]["wire"], "library_wire": library[0]["wire"]}
    results["all_reduce_bytes_per_rank"] = traffic
    print(json.dumps(results, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"data_parallel-{size}-{dev.type}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [f"# Lesson 10 benchmark ({size} sizes)", "",
             f"{results['machine']}; torch {results['torch']}; two gloo ranks on the CPU, one thread each (one process: "
             f"two threads); {results['date']}; {rounds} interleaved rounds.", "",
             f"MLP 64 -> {S['width']} x {S['depth']} -> 1, {S['rows']} rows, {S['micro']} micro-batches; "
             f"{results['grad_mb']} MB of gradients per synchronisation.", "",
             "| training step | median (ms) | quartiles (ms) |", "|---|---|---|"]
    for k, v in med.items():
        lines.append(f"| {k} | {v:.1f} | {quart[k][0] * 1e3:.1f}-{quart[k][2] * 1e3:.1f} |")
    lines += ["", f"DDP on 2 ranks against one process: {results['ddp_vs_one_process']}x (below 1: the ranks share the "
              f"cores). no_sync against synchronising every micro-batch: {results['no_sync_vs_every_micro_batch']}x.", "",
              "| ranks | tensor (bytes) | ring_all_reduce wrote per rank | dist.all_reduce wrote per rank |",
              "|---|---|---|---|"]
    for n, t in traffic.items():
        lines.append(f"| {n} | {t['tensor_bytes']} | {t['ring_wire']} | {t['library_wire']} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

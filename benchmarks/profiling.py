"""Lesson 8: profiling and trace comparison, as ratios and sizes: attention written naively against
the solution's fused ``attention`` (scaled_dot_product_attention), with and without a causal mask;
the memory the naive score matrix costs (the profiler's per-op allocations); bfloat16 against
float32 matrix products, beside what the CPU's flags predict; and what the lesson's tools cost: the
solution's op table and trace diff on real traces, and its happens-before checker against the
replay through PyTorch's CUDA Stream Sanitizer.

    python benchmarks/profiling.py                     # CPU, the lesson's CPU sizes
    python benchmarks/profiling.py --threads 1         # pinned to one thread, as the lesson's graded checks
    python benchmarks/profiling.py --size reference    # the lesson's GPU sizes (default on CUDA)

Implementations are the instructor notebook's own solutions (``attention``, ``op_table``,
``ops_diff``, ``find_races``); the baseline and inputs come from ``course.profiling``. Everything
timed goes through course.timing.compare: interleaved rounds after warm-up, fresh inputs per
round, CUDA synchronised, every output compared with the baseline's. Results are printed and written
as JSON and Markdown under benchmarks/results/, with the machine named and the lesson's targets
marked met or not.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import course  # noqa: E402
from _shared import cell, parser, rows  # noqa: E402  (benchmarks/_shared.py)
from autograder.solution_code import load_solution, solution_source  # noqa: E402
from course import streams, traces  # noqa: E402
from course.devices import threads  # noqa: E402
from course.doctor import machine_name as machine  # noqa: E402
from course.profiling import attention_inputs, bf16_native, naive_attention  # noqa: E402
from course.references import streams as stream_refs, traces as reading  # noqa: E402  (the grader's alone)
from course.timing import compare  # noqa: E402

LESSON = "08_profiling_trace_diff"

SIZES = {
    "cpu": dict(batch=1, heads=1, length=2048, dim=64, matrix=1024, programs=300),
    "reference": dict(batch=8, heads=16, length=2048, dim=64, matrix=4096, programs=300),
}
#: The lesson's bars for the fused attention over the naive one, both causal (Exercise 4).
TARGETS = {"cpu": 2.0, "cuda": 2.0}


def allocations(fn, args, dev) -> dict:
    """The three ops that allocate most in one call, MiB (CPU and device memory together)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with torch.no_grad(), profile(activities=acts, profile_memory=True) as p:
        fn(*args)
    ka = sorted(p.key_averages(), key=lambda e: -(e.self_cpu_memory_usage + e.self_device_memory_usage))[:3]
    return {e.key: round((e.self_cpu_memory_usage + e.self_device_memory_usage) / 2**20, 2) for e in ka}


def best_ms(fn, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e3, 3)


def main(argv=None) -> int:
    args = parser(__doc__, SIZES).parse_args(argv)
    dev = course.pick_device(args.device)
    size = args.size or ("reference" if dev.type == "cuda" else "cpu")
    S = SIZES[size]
    sol = load_solution(solution_source(LESSON), Path(tempfile.mkdtemp()) / "l08.py", "l08")
    timing = dict(rounds=args.rounds, min_run_time=args.min_run_time, device=dev, progress=False)
    pinned = args.threads if dev.type == "cpu" else None
    shape = dict(batch=S["batch"], heads=S["heads"], length=S["length"], dim=S["dim"])
    with threads(pinned):
        results = {"machine": machine(), "device": str(dev), "torch": torch.__version__, "size": size,
                   "sizes": S, "date": dt.date.today().isoformat(), "rounds": args.rounds,
                   "threads": torch.get_num_threads()}
        # 1. attention, naive against fused, plain and causal
        seeds = iter(range(10**6))
        for causal in (False, True):
            candidates = {"naive": lambda q, k, v: naive_attention(q, k, v, causal=causal),
                          "attention (SDPA)": lambda q, k, v: sol.attention(q, k, v, causal=causal)}

            def check(name, out, args_, candidates=candidates):
                if name != "naive":
                    course.assert_close(out, candidates["naive"](*args_), rtol=1e-3, atol=1e-4, name=name)

            with torch.no_grad():
                rep = compare(candidates, inputs=lambda: attention_inputs(next(seeds), device=str(dev), **shape),
                              check=check, **timing)
            print(f"attention{' (causal)' if causal else ''}, {shape}")
            rep.show()
            results["causal" if causal else "attention"] = {"rows": rows(rep)}
        # 2. memory
        q, k, v = attention_inputs(0, device=str(dev), **shape)
        results["memory_mib"] = {"naive": allocations(naive_attention, (q, k, v), dev),
                                 "SDPA": allocations(F.scaled_dot_product_attention, (q, k, v), dev),
                                 "score_matrix": round(S["batch"] * S["heads"] * S["length"] ** 2 * 4 / 2**20, 2)}
        print("allocations (MiB):", results["memory_mib"])
        # 3. bfloat16 against float32
        a32 = torch.randn(S["matrix"], S["matrix"], device=dev)
        a16 = a32.bfloat16()
        rep = compare({"float32": lambda: a32 @ a32, "bfloat16": lambda: a16 @ a16}, **timing)
        print(f"matrix product {S['matrix']}x{S['matrix']}")
        rep.show()
        native, why = bf16_native()
        results["bf16"] = {"rows": rows(rep), "native": native, "why": why,
                           "capability": torch.backends.cpu.get_cpu_capability()}
        # 4. what the tools cost
        with torch.no_grad():
            small = attention_inputs(1, device=str(dev), batch=2, heads=4, length=128, dim=64)
            control = traces.profile_steps(lambda: F.scaled_dot_product_attention(*small), steps=3)
            test = traces.profile_steps(lambda: naive_attention(*small), steps=3)
        programs = [streams.random_events(i, n=S["programs"] // 10) for i in range(S["programs"])]
        results["tools_ms"] = {
            "trace events": len(test["traceEvents"]),
            "op_table (solution)": best_ms(lambda: sol.op_table(test)),
            "ops_diff (solution)": best_ms(lambda: sol.ops_diff(control, test)),
            "op_table (course, HTA's reading)": best_ms(lambda: reading.op_table(test)),
            f"find_races (solution), {len(programs)} programs": best_ms(lambda: [sol.find_races(p) for p in programs]),
            f"sanitizer replay, {len(programs)} programs":
                best_ms(lambda: stream_refs.sanitizer_races_many(programs), 2),
        }
        results["explain"] = traces.explain_diff(control, test)
        print("tools (ms):", results["tools_ms"])
    bar = TARGETS[dev.type if dev.type in TARGETS else "cpu"]
    got = results["causal"]["rows"]["attention (SDPA)"]["vs_baseline"]
    results["target"] = {"attention": bar, "measured": got, "met": got >= bar}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"profiling-{size}-{dev.type}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [f"# Lesson 8 benchmark ({size} sizes, {dev.type})", "",
             f"{results['machine']}; torch {results['torch']}; {results['threads']} thread(s); {results['date']}; "
             f"{args.rounds} rounds.", "",
             "| what | naive | attention (SDPA) |", "|---|---|---|"]
    for key, label in (("attention", "attention"), ("causal", "causal attention")):
        r = results[key]["rows"]
        lines.append(f"| {label} | {cell(r['naive'])} | {cell(r['attention (SDPA)'])} |")
    m = results["memory_mib"]
    lines += ["", f"Allocations of one call (MiB; one (B, H, L, L) float32 score matrix is {m['score_matrix']}): "
              f"naive {m['naive']}, SDPA {m['SDPA']}.", "",
              f"bfloat16 against float32 ({S['matrix']}x{S['matrix']} product): "
              f"{cell(results['bf16']['rows']['bfloat16'])}; native bfloat16: {results['bf16']['native']} "
              f"({results['bf16']['why']}).", "",
              "What the lesson's tools cost (best of 5, ms): "
              + ", ".join(f"{k} {v}" for k, v in results["tools_ms"].items()) + ".", "",
              "The diff of naive attention against SDPA, as a failed speed check explains it: "
              + "; ".join(results["explain"]) + ".", "",
              f"Target: causal attention at least {bar}x the naive version: measured {got}x, "
              f"{'met' if got >= bar else 'NOT met'}."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

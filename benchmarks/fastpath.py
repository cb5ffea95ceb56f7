"""Lesson 9: attention fast paths, as ratios and sizes. SDPA with a key-padding mask against the naive
masked attention (and their allocations), a token MLP on a jagged nested tensor against the padded
batch, attention on a jagged tensor against padded SDPA (the CPU's slower fallback), and the
``nn.TransformerEncoder`` fast path against the slow path as the share of padding grows.

    python benchmarks/fastpath.py                     # CPU, the lesson's CPU sizes
    python benchmarks/fastpath.py --threads 1         # pinned to one thread, as the lesson's graded checks
    python benchmarks/fastpath.py --size reference    # the lesson's GPU sizes (default on CUDA)

Implementations are the instructor notebook's own solutions (``sdpa_attention``,
``jagged_token_mlp``); the baselines and inputs come from ``course.fastpath`` and the grader's
``course.references.fastpath``. Everything timed goes through course.timing.compare: interleaved
rounds after warm-up, fresh inputs per round, CUDA synchronised, every output compared with the
baseline's (on the real tokens, where padding is left undefined). Results are printed and written
as JSON and Markdown under benchmarks/results/, with the machine named and the lesson's bars
marked met or not.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import course  # noqa: E402
from _shared import cell, parser, rows  # noqa: E402  (benchmarks/_shared.py)
from autograder.solution_code import load_solution, solution_source  # noqa: E402
from course.devices import threads  # noqa: E402
from course.doctor import machine_name as machine  # noqa: E402
from course.fastpath import (encoder, masked_attention_inputs, padded_token_mlp, ragged_batch, slow_path,  # noqa: E402
                             split_heads, token_mlp, valid_tokens)
from course.references.fastpath import naive_masked_attention  # noqa: E402
from course.timing import compare  # noqa: E402

LESSON = "09_attention_fast_paths"

SIZES = {
    "cpu": dict(batch=1, heads=4, length=1024, dim=64, valid=0.6, mlp_batch=8, mlp_length=512, mlp_dim=256,
                hidden=1024, mlp_valid=0.4, enc_batch=8, enc_length=128, d_model=256, nhead=8),
    "reference": dict(batch=8, heads=16, length=2048, dim=64, valid=0.6, mlp_batch=32, mlp_length=1024, mlp_dim=512,
                      hidden=2048, mlp_valid=0.4, enc_batch=32, enc_length=512, d_model=512, nhead=8),
}
#: The lesson's bars (Exercises 3 and 5).
TARGETS = {"cpu": {"sdpa": 1.2, "jagged": 1.2}, "cuda": {"sdpa": 2.0, "jagged": 1.2}}
SHARES = (0.0, 0.3, 0.5, 0.7)


def allocated_mib(fn, dev) -> float:
    """Everything one call allocates, MiB (CPU and device memory together), from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with torch.no_grad(), profile(activities=acts, profile_memory=True) as p:
        fn()
    return round(sum(max(e.self_cpu_memory_usage, 0) + max(e.self_device_memory_usage, 0)
                     for e in p.key_averages()) / 2**20, 2)


def main(argv=None) -> int:
    args = parser(__doc__, SIZES).parse_args(argv)
    dev = course.pick_device(args.device)
    size = args.size or ("reference" if dev.type == "cuda" else "cpu")
    S = SIZES[size]
    sol = load_solution(solution_source(LESSON), Path(tempfile.mkdtemp()) / "l09.py", "l09")
    timing = dict(rounds=args.rounds, min_run_time=args.min_run_time, device=dev, progress=False)
    pinned = args.threads if dev.type == "cpu" else None
    seeds = iter(range(10**6))
    with threads(pinned), torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage")
        results = {"machine": machine(), "device": str(dev), "torch": torch.__version__, "size": size,
                   "sizes": S, "date": dt.date.today().isoformat(), "rounds": args.rounds,
                   "threads": torch.get_num_threads()}
        # 1. SDPA with a key-padding mask against the naive masked attention
        shape = dict(batch=S["batch"], heads=S["heads"], length=S["length"], dim=S["dim"], valid=S["valid"])
        candidates = {"naive": lambda q, k, v, pad: naive_masked_attention(q, k, v, pad),
                      "sdpa_attention": lambda q, k, v, pad: sol.sdpa_attention(q, k, v, key_padding_mask=pad)}

        def check(name, out, args_):
            if name != "naive":
                course.assert_close(out, candidates["naive"](*args_), rtol=1e-3, atol=1e-4, name=name)

        rep = compare(candidates, inputs=lambda: masked_attention_inputs(next(seeds), device=str(dev), **shape),
                      check=check, **timing)
        print(f"masked attention, {shape}")
        rep.show()
        q, k, v, pad = masked_attention_inputs(0, device=str(dev), **shape)
        results["sdpa"] = {"rows": rows(rep), "memory_mib": {
            "naive": allocated_mib(lambda: naive_masked_attention(q, k, v, pad), dev),
            "sdpa_attention": allocated_mib(lambda: sol.sdpa_attention(q, k, v, key_padding_mask=pad), dev),
            "score_matrix": round(S["batch"] * S["heads"] * S["length"] ** 2 * 4 / 2**20, 2)}}
        print("allocations (MiB):", results["sdpa"]["memory_mib"])
        # 2. the token MLP, jagged against padded
        mlp = token_mlp(7, dim=S["mlp_dim"], hidden=S["hidden"], device=str(dev))
        ragged = dict(batch=S["mlp_batch"], length=S["mlp_length"], dim=S["mlp_dim"], valid=S["mlp_valid"])

        def check_mlp(name, out, args_):
            if name != "padded":
                course.assert_close(out, padded_token_mlp(*args_, mlp), rtol=1e-4, atol=1e-5, name=name)

        rep = compare({"padded": lambda x, p: padded_token_mlp(x, p, mlp),
                       "jagged_token_mlp": lambda x, p: sol.jagged_token_mlp(x, p, mlp)},
                      inputs=lambda: ragged_batch(next(seeds), device=str(dev), **ragged), check=check_mlp, **timing)
        print(f"token MLP, {ragged}, hidden {S['hidden']}")
        rep.show()
        results["jagged_mlp"] = {"rows": rows(rep)}
        # 3. attention on a jagged tensor against padded SDPA (4 heads over the MLP's batch)
        x, pad = ragged_batch(1, device=str(dev), **ragged)
        jq, pq = split_heads(x, 4, pad), split_heads(x, 4)
        rep = compare({"padded SDPA": lambda: sol.sdpa_attention(pq, pq, pq, key_padding_mask=pad),
                       "jagged SDPA": lambda: F.scaled_dot_product_attention(jq, jq, jq)}, **timing)
        print("attention, jagged against padded")
        rep.show()
        from course.fastpath import ops_that_ran
        results["jagged_attention"] = {"rows": rows(rep), "kernels": sorted(
            op for op in ops_that_ran(lambda: F.scaled_dot_product_attention(jq, jq, jq)) if "attention" in op)}
        # 4. the encoder's fast path against the slow path, as padding grows
        enc = encoder(1, d_model=S["d_model"], nhead=S["nhead"], dim_feedforward=4 * S["d_model"], layers=2,
                      device=str(dev))
        results["encoder"] = {}
        for share in SHARES:
            x, pad = ragged_batch(6, device=str(dev), batch=S["enc_batch"], length=S["enc_length"], dim=S["d_model"],
                                  valid=1 - share)
            pad = pad if share > 0 else torch.zeros_like(pad)
            course.assert_close(valid_tokens(enc(x, src_key_padding_mask=pad), pad),
                                valid_tokens(slow_path(enc, x, pad), pad), rtol=1e-4, atol=1e-4, name="fast path")
            rep = compare({"slow path": lambda: slow_path(enc, x, pad),
                           "fast path": lambda: enc(x, src_key_padding_mask=pad)}, **timing)
            print(f"encoder, {share:.0%} padding")
            rep.show()
            results["encoder"][f"{share:.0%}"] = {"rows": rows(rep)}
    bars = TARGETS[dev.type if dev.type in TARGETS else "cpu"]
    got = {"sdpa": results["sdpa"]["rows"]["sdpa_attention"]["vs_baseline"],
           "jagged": results["jagged_mlp"]["rows"]["jagged_token_mlp"]["vs_baseline"]}
    results["targets"] = {k: {"bar": bars[k], "measured": got[k], "met": got[k] >= bars[k]} for k in bars}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"fastpath-{size}-{dev.type}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    m = results["sdpa"]["memory_mib"]
    lines = [f"# Lesson 9 benchmark ({size} sizes, {dev.type})", "",
             f"{results['machine']}; torch {results['torch']}; {results['threads']} thread(s); {results['date']}; "
             f"{args.rounds} rounds.", "",
             "| what | baseline | candidate |", "|---|---|---|",
             f"| masked attention ({S['batch']} x {S['heads']} heads x {S['length']}, {S['valid']:.0%} real) | naive "
             f"{cell(results['sdpa']['rows']['naive'])} | sdpa_attention {cell(results['sdpa']['rows']['sdpa_attention'])} |",
             f"| token MLP ({S['mlp_batch']} x {S['mlp_length']} x {S['mlp_dim']}, hidden {S['hidden']}, "
             f"{S['mlp_valid']:.0%} real) | padded {cell(results['jagged_mlp']['rows']['padded'])} | jagged_token_mlp "
             f"{cell(results['jagged_mlp']['rows']['jagged_token_mlp'])} |",
             f"| attention on the MLP's batch, 4 heads | padded SDPA "
             f"{cell(results['jagged_attention']['rows']['padded SDPA'])} | jagged SDPA "
             f"{cell(results['jagged_attention']['rows']['jagged SDPA'])} |"]
    for share, r in results["encoder"].items():
        lines.append(f"| encoder ({S['enc_batch']} x {S['enc_length']} x {S['d_model']}), {share} padding | slow path "
                     f"{cell(r['rows']['slow path'])} | fast path {cell(r['rows']['fast path'])} |")
    lines += ["", f"Allocations of one masked attention call (MiB; one (B, H, L, L) float32 score matrix is "
              f"{m['score_matrix']}): naive {m['naive']}, sdpa_attention {m['sdpa_attention']}.", "",
              f"Jagged attention ran: {', '.join(results['jagged_attention']['kernels'])}.", ""]
    for k, t in results["targets"].items():
        lines.append(f"Target ({k}): at least {t['bar']}x: measured {t['measured']}x, {'met' if t['met'] else 'NOT met'}.")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

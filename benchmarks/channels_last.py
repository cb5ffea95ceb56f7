"""Lesson 3: channels-last against NCHW (contiguous) inference, as ratios, at a few batch sizes.

    python benchmarks/channels_last.py                     # CPU, the lesson's CPU model
    python benchmarks/channels_last.py --size resnet18     # a ResNet-18-sized model, 224x224 (slow on a CPU)
    python benchmarks/channels_last.py --size reference    # the GPU size (default on CUDA)

The model is course.models.small_resnet; the conversion and the autocast call are the instructor
notebook's own solutions (``to_channels_last``, ``autocast_inference``). For every batch size four
candidates are timed side by side with course.timing.compare (interleaved rounds after warm-up,
fresh inputs per round, CUDA synchronised, every output checked against float32 NCHW): NCHW and
channels-last, each in float32 and in 16 bits (BF16 autocast on a CPU, FP16 AMP on CUDA). The
input is converted outside the timed call, as a data loader would. Results are printed and
written as JSON and Markdown under benchmarks/results/, with the machine named and whether the
CPU has native BF16.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import course  # noqa: E402
from course.doctor import machine_name as machine  # noqa: E402
from autograder.solution_code import load_solution, solution_source  # noqa: E402
from course.memory_format import cpu_has_native_bf16  # noqa: E402
from course.models import small_resnet  # noqa: E402
from course.timing import compare  # noqa: E402

SIZES = {
    "cpu": dict(width=64, blocks=(1, 1, 1), size=64, batches=(1, 8, 32)),        # the lesson's CPU model
    "resnet18": dict(width=64, blocks=(2, 2, 2, 2), size=224, batches=(1, 8)),   # ResNet-18's widths and depth
    "reference": dict(width=64, blocks=(2, 2, 2, 2), size=224, batches=(32, 64, 128)),
}
#: The issue's target: channels-last float32 inference at least this much faster than NCHW on 2 CPU cores.
CPU_TARGET = 1.2




def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help="default: cpu on CPU, reference on CUDA")
    ap.add_argument("--device", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="override the size's batch sizes")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--min-run-time", type=float, default=0.3)
    ap.add_argument("--fp32-only", action="store_true", help="skip the 16-bit (autocast) candidates")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)

    dev = course.pick_device(args.device)
    size = args.size or ("reference" if dev.type == "cuda" else "cpu")
    S = dict(SIZES[size])
    batches = tuple(args.batches or S["batches"])
    tmp = Path(tempfile.mkdtemp())
    sol = load_solution(solution_source("03_channels_last"), tmp / "l03.py", "l03")
    low = "bf16" if dev.type == "cpu" else "fp16"

    model = small_resnet(seed=0, width=S["width"], blocks=S["blocks"], device=dev)
    model_cl, _ = sol.to_channels_last(copy.deepcopy(model), torch.zeros(1, 3, S["size"], S["size"], device=dev))
    candidates = {
        "NCHW fp32": lambda x, x_cl: model(x),
        "channels-last fp32": lambda x, x_cl: model_cl(x_cl),
    }
    if not args.fp32_only:
        candidates[f"NCHW {low}"] = lambda x, x_cl: sol.autocast_inference(model, x)
        candidates[f"channels-last {low}"] = lambda x, x_cl: sol.autocast_inference(model_cl, x_cl)

    results = {"machine": machine(), "device": str(dev), "torch": torch.__version__, "size": size,
               "sizes": {**S, "batches": list(batches)}, "date": dt.date.today().isoformat(), "rounds": args.rounds,
               "native_bf16": cpu_has_native_bf16() if dev.type == "cpu" else None, "batches": {}}

    for batch in batches:
        def inputs():
            x = torch.randn(batch, 3, S["size"], S["size"], device=dev)
            return x, sol.to_channels_last(model_cl, x.clone())[1]

        def check(name, out, a):
            ref = model(a[0])
            err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
            if err > (1e-4 if "fp32" in name else 3e-2):
                raise AssertionError(f"{name} differs from float32 NCHW by {err:.2%} at batch {batch}")

        print(f"batch {batch}:")
        with torch.inference_mode():
            rep = compare(candidates, inputs=inputs, check=check, rounds=args.rounds,
                          min_run_time=args.min_run_time, device=dev, progress=False)
        rep.show()
        row = {n: {"median_ms": round(rep.median(n) * 1e3, 3), "vs_nchw_fp32": round(rep.speedup(n).median, 3),
                   "vs_nchw_fp32_iqr": [round(rep.speedup(n).low, 3), round(rep.speedup(n).high, 3)]}
               for n in rep.names}
        cl = rep.speedup("channels-last fp32", over="NCHW fp32")
        row["channels_last_over_nchw"] = {"fp32": round(cl.median, 3),
                                          "fp32_iqr": [round(cl.low, 3), round(cl.high, 3)]}
        if not args.fp32_only:
            cl_low = rep.speedup(f"channels-last {low}", over=f"NCHW {low}")
            row["channels_last_over_nchw"][low] = round(cl_low.median, 3)
            row["channels_last_over_nchw"][f"{low}_iqr"] = [round(cl_low.low, 3), round(cl_low.high, 3)]
        results["batches"][str(batch)] = row

    if dev.type == "cpu":
        worst = min(r["channels_last_over_nchw"]["fp32"] for r in results["batches"].values())
        results["cpu_target"] = {"channels_last_over_nchw_fp32": CPU_TARGET, "worst_measured": worst,
                                 "met": worst >= CPU_TARGET}

    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"channels-last-{size}-{dev.type}"
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"# Lesson 3 channels-last: {results['machine']}", "",
             f"torch {results['torch']}, {results['date']}, small_resnet width={S['width']} blocks={S['blocks']}, "
             f"{S['size']}x{S['size']} images, {args.rounds} interleaved rounds, inference"
             + (f"; native BF16 on this CPU: {'yes' if results['native_bf16'] else 'no'}" if dev.type == "cpu" else ""),
             ""]
    if "cpu_target" in results:
        t = results["cpu_target"]
        lines += [f"Target: channels-last fp32 at least {t['channels_last_over_nchw_fp32']}x NCHW; worst batch size "
                  f"measured {t['worst_measured']}x ({'met' if t['met'] else 'NOT met'}).", ""]
    for batch, row in results["batches"].items():
        lines += [f"## batch {batch}", "", "| candidate | median | vs NCHW fp32 (IQR) |", "|---|---|---|"]
        lines += [f"| {n} | {r['median_ms']} ms | {r['vs_nchw_fp32']}x ({r['vs_nchw_fp32_iqr'][0]}-"
                  f"{r['vs_nchw_fp32_iqr'][1]}) |" for n, r in row.items() if n != "channels_last_over_nchw"]
        over = row["channels_last_over_nchw"]
        lines += ["", "channels-last over NCHW in the same precision: "
                  + ", ".join(f"{k} {v}x" for k, v in over.items() if not k.endswith("_iqr")), ""]
    (args.out / f"{stem}.md").write_text("\n".join(lines))
    print(f"wrote {args.out / stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

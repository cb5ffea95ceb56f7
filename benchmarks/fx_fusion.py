"""Lesson 2's conv/BatchNorm fusion, measured side by side at a few batch sizes, as ratios.

    python benchmarks/fx_fusion.py                       # CPU: the lesson's small model, one thread
    python benchmarks/fx_fusion.py --threads 2           # CPU with two threads
    python benchmarks/fx_fusion.py --size resnet18       # ResNet-18-sized model at 224x224 (GPU)

Implementations are the instructor notebook's own solutions: the original model (eval mode), the
FX-fused model (``fuse``) and ``torch.compile`` with Inductor's freezing (``compile_frozen``),
each on the same seeded ``course.models.small_resnet`` without a tap (every pair is legal); and
Exercise 6's pair: the same model as an exporter hands it back (``course.models.exported_resnet``:
every BatchNorm written out as four elementwise ops on constants) and that model after
``fold_affine``, reported against the exported model as well.
Inference (no_grad) is timed with course.timing.compare: interleaved rounds after warm-up, fresh
inputs per round, every output checked against the original, CUDA synchronised. Results are
printed and written as JSON and Markdown under benchmarks/results/, with the machine named.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import course  # noqa: E402
from course.doctor import machine_name as machine  # noqa: E402
from autograder.solution_code import load_solution, solution_source  # noqa: E402
from course.devices import threads as pinned_threads  # noqa: E402
from course.models import exported_resnet, small_resnet  # noqa: E402
from course.numerics import assert_close  # noqa: E402
from course.timing import compare  # noqa: E402

SIZES = {
    # the lesson's CPU model; batch 1 at small images is where fusion pays, batch 8 at 224 where it does not
    "small": dict(width=16, blocks=(1, 1, 1), shapes=[(1, 32), (1, 64), (8, 64), (8, 224)]),
    # ResNet-18's widths and depths (3x3 stem), the lesson's CUDA size at batch 1 and larger batches
    "resnet18": dict(width=64, blocks=(2, 2, 2, 2), shapes=[(1, 224), (8, 224), (32, 224)]),
}




def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help="default: small on CPU, resnet18 on CUDA")
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads while timing (default: 1 on CPU)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--min-run-time", type=float, default=0.3)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (it compiles once per shape)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)

    dev = course.pick_device(args.device)
    size = args.size or ("resnet18" if dev.type == "cuda" else "small")
    S = SIZES[size]
    n_threads = None if dev.type == "cuda" else (args.threads or 1)
    sol = load_solution(solution_source("02_fx_transforms"), Path(tempfile.mkdtemp()) / "l02.py", "l02")

    model = small_resnet(seed=0, width=S["width"], blocks=S["blocks"], device=dev)
    fused = sol.fuse(model)
    exported = exported_resnet(seed=0, width=S["width"], blocks=S["blocks"], device=dev)
    folded = sol.fold_affine(exported)
    results = {"machine": machine(), "device": str(dev), "torch": torch.__version__, "size": size,
               "width": S["width"], "blocks": list(S["blocks"]), "threads": n_threads or torch.get_num_threads(),
               "date": dt.date.today().isoformat(), "rounds": args.rounds, "shapes": {}}
    for batch, image in S["shapes"]:
        def inputs():
            return (torch.randn(batch, 3, image, image, device=dev),)

        def check(name, out, a):
            ref = model(*a)
            assert_close(out, ref, atol=1e-5 * float(ref.abs().max()), rtol=0, name=f"{name} output")

        impls = {"original": model, "FX fused": fused, "exported": exported, "exported, folded": folded}
        row = {}
        with torch.no_grad(), pinned_threads(n_threads):
            if not args.no_compile:
                torch._dynamo.reset()
                t0 = time.perf_counter()
                impls["compile + freezing"] = sol.compile_frozen(model, *inputs())
                row["compile_s"] = round(time.perf_counter() - t0, 1)
            rep = compare(impls, inputs=inputs, check=check, rounds=args.rounds,
                          min_run_time=args.min_run_time, device=dev, progress=False)
        print(f"\nbatch {batch}, {image}x{image}")
        rep.show()
        row["impls"] = {n: {"median_ms": round(rep.median(n) * 1e3, 4), "vs_original": round(rep.speedup(n).median, 3),
                            "vs_original_iqr": [round(rep.speedup(n).low, 3), round(rep.speedup(n).high, 3)]}
                        for n in rep.names}
        vs = rep.speedup("exported, folded", over="exported")
        row["folded_vs_exported"] = {"median": round(vs.median, 3), "iqr": [round(vs.low, 3), round(vs.high, 3)]}
        results["shapes"][f"{batch}x{image}"] = row

    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"fx-fusion-{size}-{dev.type}"
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"# Lesson 2 conv/BatchNorm fusion: {results['machine']}", "",
             f"torch {results['torch']}, {results['date']}, small_resnet width {S['width']}, blocks "
             f"{tuple(S['blocks'])}, {results['threads']} thread(s), {args.rounds} interleaved rounds, inference.",
             "", "| batch x image | implementation | median | vs original (IQR) | compile |", "|---|---|---|---|---|"]
    for shape, row in results["shapes"].items():
        for n, r in row["impls"].items():
            comp = f"{row['compile_s']} s" if n.startswith("compile") and "compile_s" in row else ""
            lines.append(f"| {shape} | {n} | {r['median_ms']} ms | {r['vs_original']}x "
                         f"({r['vs_original_iqr'][0]}-{r['vs_original_iqr'][1]}) | {comp} |")
    lines += ["", "Exercise 6: the exported model after `fold_affine`, against the exported model (median of "
              "per-round ratios, IQR):", ""]
    lines += [f"- {shape}: {row['folded_vs_exported']['median']}x ({row['folded_vs_exported']['iqr'][0]}-"
              f"{row['folded_vs_exported']['iqr'][1]})" for shape, row in results["shapes"].items()]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

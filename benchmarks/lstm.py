"""Lesson 1's four (five) LSTM layers, measured side by side, as ratios.

    python benchmarks/lstm.py                     # CPU, the lesson's CPU size
    python benchmarks/lstm.py --size reference    # the PyTorch team's reference size (GPU)

Implementations are the instructor notebook's own solutions: eager, eager with the input
projection hoisted, TorchScript, torch.compile, and nn.LSTM (oneDNN on a CPU, cuDNN on a GPU).
Forward (inference, no_grad) and forward+backward are timed with course.timing.compare:
interleaved rounds after warm-up, fresh inputs per round, CUDA synchronised. Results are printed
and written as JSON and Markdown under benchmarks/results/, with the machine named.
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
from course.rnn import lstm_weights, make_lstm  # noqa: E402
from course.timing import compare  # noqa: E402

SIZES = {
    "cpu": dict(T=50, B=32, I=64, H=64),
    "reference": dict(T=100, B=64, I=512, H=512),  # the PyTorch team's custom-LSTM benchmark size
}




def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help="default: cpu on CPU, reference on CUDA")
    ap.add_argument("--device", default=None)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--min-run-time", type=float, default=0.3)
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)

    course.quiet_torchscript(explain=False)
    dev = course.pick_device(args.device)
    size = args.size or ("reference" if dev.type == "cuda" else "cpu")
    S = SIZES[size]
    tmp = Path(tempfile.mkdtemp())
    sol = load_solution(solution_source("01_custom_rnns").replace(
        "compiled_layer = torch.compile(fast_lstm_layer)", "compiled_layer = None"), tmp / "l01.py", "l01")

    lstm = make_lstm(S["I"], S["H"], seed=0, device=dev)
    w = tuple(lstm_weights(lstm))
    impls = {
        "eager": sol.lstm_layer,
        "eager, hoisted": sol.fast_lstm_layer,
        "TorchScript": torch.jit.script(sol.fast_lstm_layer),
        "torch.compile": torch.compile(sol.fast_lstm_layer),
        "nn.LSTM": lambda x, h, c, *_: lstm(x, (h[None], c[None])),
    }

    def inputs(grad=False):
        x = torch.randn(S["T"], S["B"], S["I"], device=dev, requires_grad=grad)
        h = torch.zeros(S["B"], S["H"], device=dev)
        return (x, h, torch.zeros_like(h)) + (w if grad else tuple(t.detach() for t in w))

    results = {"machine": machine(), "device": str(dev), "torch": torch.__version__, "size": size, "sizes": S,
               "date": dt.date.today().isoformat(), "rounds": args.rounds, "modes": {}}
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    cache = Path(cache_dir())
    results["inductor_cache"] = "warm" if cache.exists() and any(cache.iterdir()) else "cold"
    t0 = time.perf_counter()
    with torch.no_grad():
        impls["torch.compile"](*inputs())
    results["compile_forward_s"] = round(time.perf_counter() - t0, 1)
    with torch.no_grad():
        fwd = compare(impls, inputs=inputs, rounds=args.rounds, min_run_time=args.min_run_time, device=dev,
                          progress=False)
    fwd.show()
    modes = {"forward": fwd}
    if not args.no_backward:
        def train(fn):
            def step(*a):
                out = fn(*a)[0]
                out.sum().backward()
            return step
        t0 = time.perf_counter()
        train(impls["torch.compile"])(*inputs(True))
        results["compile_backward_s"] = round(time.perf_counter() - t0, 1)
        bwd = compare({k: train(f) for k, f in impls.items()}, inputs=lambda: inputs(True), rounds=args.rounds,
                      min_run_time=args.min_run_time, device=dev, progress=False)
        bwd.show()
        modes["forward+backward"] = bwd
    for mode, rep in modes.items():
        results["modes"][mode] = {
            n: {"median_ms": round(rep.median(n) * 1e3, 3), "vs_eager": round(rep.speedup(n).median, 3),
                "vs_eager_iqr": [round(rep.speedup(n).low, 3), round(rep.speedup(n).high, 3)],
                "vs_nn_lstm": round(rep.speedup(n, over="nn.LSTM").median, 3)}
            for n in rep.names}

    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"lstm-{size}-{dev.type}"
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"# Lesson 1 LSTM layers: {results['machine']}", "",
             f"torch {results['torch']}, {results['date']}, T={S['T']} B={S['B']} I={S['I']} H={S['H']}, "
             f"{args.rounds} interleaved rounds; first call with compile {results['compile_forward_s']} s (forward)"
             + (f", {results['compile_backward_s']} s (forward+backward)" if 'compile_backward_s' in results else "")
             + f", Inductor cache {results['inductor_cache']} (a cold compile takes about 20 s on 2 CPU cores)",
             ""]
    for mode, rows in results["modes"].items():
        lines += [f"## {mode}", "", "| implementation | median | vs eager (IQR) | vs nn.LSTM |", "|---|---|---|---|"]
        lines += [f"| {n} | {r['median_ms']} ms | {r['vs_eager']}x ({r['vs_eager_iqr'][0]}-{r['vs_eager_iqr'][1]}) "
                  f"| {r['vs_nn_lstm']}x |" for n, r in rows.items()]
        lines.append("")
    (args.out / f"{stem}.md").write_text("\n".join(lines))
    print(f"wrote {args.out / stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

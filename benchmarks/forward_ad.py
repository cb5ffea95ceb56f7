"""Lesson 4: full Jacobians by forward mode (k JVPs) and by reverse mode (m VJPs), and JVPs with
respect to a model's parameters, as ratios.

    python benchmarks/forward_ad.py                     # CPU, the lesson's CPU sizes (one thread)
    python benchmarks/forward_ad.py --size reference    # the GPU sizes (default on CUDA)
    python benchmarks/forward_ad.py --threads 2         # let torch use two threads on a CPU

Part 1, Jacobians: for f(x) = W2 @ tanh(W1 @ x + b1) + b2 from R^k to R^m (course.forward_ad.
WideFunction), at several m for a fixed k, four candidates: the instructor notebook's own
``jacobian_rev`` (m VJPs, vmapped; the baseline) and ``jacobian_fwd`` (k JVPs, vmapped), and
``torch.func.jacrev`` / ``torch.func.jacfwd``. Every output is checked against the closed-form
Jacobian in float64.

Part 2, parameter JVPs: the JVP of an MLP's output with respect to all its parameters, by the
notebook's ``param_jvp`` (torch.autograd.forward_ad), ``param_jvp_func`` (torch.func.jvp), and
``torch.autograd.functional.jvp`` (the older "double backward" trick: two reverse passes, no
forward mode; the baseline). Outputs are checked against ``param_jvp_func``.

Everything is timed with course.timing.compare: interleaved rounds after warm-up, fresh inputs
per round, CUDA synchronised. Results are printed and written as JSON and Markdown under
benchmarks/results/, with the machine named.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.func import functional_call, jacfwd, jacrev

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import course  # noqa: E402
from course.doctor import machine_name as machine  # noqa: E402
from autograder.solution_code import load_solution, solution_source  # noqa: E402
from course.forward_ad import WideFunction, mlp  # noqa: E402
from course.devices import threads as pinned_threads  # noqa: E402
from course.numerics import assert_close  # noqa: E402
from course.references.forward_ad import wide_jacobian  # noqa: E402
from course.timing import compare  # noqa: E402

SIZES = {
    # the lesson's CPU sizes: k = 8, m up to 4096, timed on one thread
    "cpu": dict(k=8, hidden=256, ms=(16, 64, 256, 1024, 2048, 4096), mlp=(64, 256, 256, 64), batch=32),
    # the lesson's GPU sizes
    "reference": dict(k=16, hidden=1024, ms=(64, 256, 1024, 4096, 8192, 16384), mlp=(256, 1024, 1024, 256),
                      batch=256),
}




def rows_of(report, baseline: str) -> dict:
    return {n: {"median_ms": round(report.median(n) * 1e3, 4),
                "speedup": round(report.speedup(n, over=baseline).median, 3),
                "speedup_iqr": [round(report.speedup(n, over=baseline).low, 3),
                                round(report.speedup(n, over=baseline).high, 3)]}
            for n in report.names}


def jacobians(sol, S, dev, args) -> dict:
    out = {}
    k = S["k"]
    for m in S["ms"]:
        f = WideFunction(k, m, S["hidden"], seed=0, dtype=torch.float32, device=dev)
        impls = {
            "jacobian_rev (m VJPs)": lambda x: sol.jacobian_rev(f, x),
            "jacobian_fwd (k JVPs)": lambda x: sol.jacobian_fwd(f, x),
            "torch.func.jacrev": lambda x: jacrev(f)(x),
            "torch.func.jacfwd": lambda x: jacfwd(f)(x),
        }

        def check(name, got, a):
            ref = wide_jacobian(f, a[0])
            assert_close(got.double(), ref, rtol=1e-3, atol=1e-4 * float(ref.abs().max()), name=f"{name} (m={m})")

        rep = compare(impls, inputs=lambda: (torch.randn(k, device=dev),), check=check, rounds=args.rounds,
                      min_run_time=args.min_run_time, device=dev, progress=False)
        print(f"\nJacobian of R^{k} -> R^{m} (hidden {S['hidden']})")
        rep.show()
        out[str(m)] = rows_of(rep, "jacobian_rev (m VJPs)")
    return out


def param_jvps(sol, S, dev, args) -> dict:
    model = mlp(S["mlp"], seed=0, dtype=torch.float32, device=dev)
    params = dict(model.named_parameters())
    names = list(params)

    def inputs():
        x = torch.randn(S["batch"], S["mlp"][0], device=dev)
        return x, {n: torch.randn_like(p) for n, p in params.items()}

    def double_backward(x, tangents):
        primals = tuple(params[n].detach() for n in names)
        f = lambda *ps: functional_call(model, dict(zip(names, ps)), (x,))  # noqa: E731
        return torch.autograd.functional.jvp(f, primals, tuple(tangents[n] for n in names))

    impls = {
        "autograd.functional.jvp (double backward)": double_backward,
        "param_jvp (forward_ad)": lambda x, t: sol.param_jvp(model, x, t),
        "param_jvp_func (torch.func.jvp)": lambda x, t: sol.param_jvp_func(model, x, t),
    }

    def check(name, got, a):
        ref = sol.param_jvp_func(model, *a)
        assert_close(got[1], ref[1], rtol=1e-4, atol=1e-5, name=f"{name}: tangent")

    rep = compare(impls, inputs=inputs, check=check, rounds=args.rounds, min_run_time=args.min_run_time,
                  device=dev, progress=False)
    print(f"\nJVP of an MLP {S['mlp']} w.r.t. all {sum(p.numel() for p in params.values())} parameters, "
          f"batch {S['batch']}")
    rep.show()
    return rows_of(rep, "autograd.functional.jvp (double backward)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help="default: cpu on CPU, reference on CUDA")
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads on a CPU (default 1, as the lesson)")
    ap.add_argument("--ms", type=int, nargs="+", default=None, help="override the size's output sizes m")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--min-run-time", type=float, default=0.2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)

    dev = course.pick_device(args.device)
    size = args.size or ("reference" if dev.type == "cuda" else "cpu")
    S = dict(SIZES[size])
    if args.ms:
        S["ms"] = tuple(args.ms)
    n_threads = args.threads if args.threads is not None else (1 if dev.type == "cpu" else None)
    tmp = Path(tempfile.mkdtemp())
    sol = load_solution(solution_source("04_forward_ad"), tmp / "l04.py", "l04")

    name = machine()
    with pinned_threads(n_threads):
        results = {"machine": name, "device": str(dev), "torch": torch.__version__, "size": size,
                   "sizes": S, "threads": torch.get_num_threads(), "date": dt.date.today().isoformat(),
                   "rounds": args.rounds}
        results["jacobians"] = jacobians(sol, S, dev, args)
        results["param_jvp"] = param_jvps(sol, S, dev, args)

    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"forward-ad-{size}-{dev.type}"
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"# Lesson 4 forward-mode AD: {results['machine']}", "",
             f"torch {results['torch']}, {results['date']}, {results['threads']} thread(s), {args.rounds} interleaved "
             "rounds; speedup = median of per-round ratios (quartiles).", "",
             f"## Full Jacobian of R^{S['k']} -> R^m (hidden {S['hidden']}), speedup over jacobian_rev", "",
             "| m | " + " | ".join(next(iter(results["jacobians"].values()))) + " |",
             "|---|" + "---|" * len(next(iter(results["jacobians"].values())))]
    for m, rows in results["jacobians"].items():
        lines.append(f"| {m} | " + " | ".join(f"{r['median_ms']} ms ({r['speedup']}x)" for r in rows.values()) + " |")
    lines += ["", f"## JVP w.r.t. all parameters of an MLP {S['mlp']}, batch {S['batch']}", "",
              "| implementation | median | speedup over double backward (IQR) |", "|---|---|---|"]
    lines += [f"| {n} | {r['median_ms']} ms | {r['speedup']}x ({r['speedup_iqr'][0]}-{r['speedup_iqr'][1]}) |"
              for n, r in results["param_jvp"].items()]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Lesson 5: Jacobians by row loop, vmap over vjp, jacrev and jacfwd; forward against reverse mode on a
tall and a wide function; Hessian-vector products. As ratios, against the issue's targets.

    python benchmarks/jacobians.py                  # CPU, the lesson's CPU sizes, torch's thread count
    python benchmarks/jacobians.py --threads 1      # CPU pinned to one thread (what the lesson's checks do)
    python benchmarks/jacobians.py --size cuda      # the lesson's GPU sizes (default on CUDA)

The functions are course.jacobians' ``tanh_layer`` (y = tanh(Wx + b)) and ``energy``; the Jacobians
and HVPs are the instructor notebook's own solutions (``jacobian_rows``, ``pick_jacobian``, ``hvp_fwd_rev``,
``hvp_rev_rev``) beside ``torch.func.jacrev``/``jacfwd``. Every
comparison runs with course.timing.compare: interleaved rounds after warm-up, fresh points every
round, CUDA synchronised, every output compared with the hand-written float64 derivative. Results
are printed and written as JSON and Markdown under benchmarks/results/, with the machine named.

Targets (from the lesson's issue): the vmapped Jacobian at least 3x the row loop on 2 CPU cores
(5x on an H100); the right mode (jacfwd for tall, jacrev for wide) at least 3x the wrong one in
both cases.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.func import grad, jacfwd, jacrev

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import course  # noqa: E402
from course.doctor import machine_name as machine  # noqa: E402
from autograder.solution_code import load_solution, solution_source  # noqa: E402
from course.devices import threads as pinned_threads  # noqa: E402
from course.jacobians import energy, tanh_layer  # noqa: E402
from course.references.jacobians import tanh_jacobian  # noqa: E402
from course.timing import compare  # noqa: E402

SIZES = {
    "cpu": dict(D=16, tall=(2048, 32), wide=(32, 2048), n_hvp=40_000),          # the lesson's CPU sizes
    "cuda": dict(D=64, tall=(16384, 64), wide=(64, 16384), n_hvp=4_000_000),    # the lesson's GPU sizes
}
TARGETS = {"vmap over vjp vs row loop": {"cpu": 3.0, "cuda": 5.0},
           "right mode vs wrong, tall": {"cpu": 3.0, "cuda": 3.0},
           "right mode vs wrong, wide": {"cpu": 3.0, "cuda": 3.0}}




def checker(reference):
    """``check(name, out, args)`` for compare: the output equals the float64 formula at args."""
    def check(name, out, args):
        exp = reference(*[a.double() for a in args])
        course.assert_close(out, exp.to(out.device), check_dtype=False, rtol=1e-4, atol=1e-4 * float(exp.abs().max()),
                            name=f"{name} while timing")
    return check


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help="default: cpu on CPU, cuda on CUDA")
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None, help="pin the CPU thread count (default: torch's)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--min-run-time", type=float, default=0.2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)

    dev = course.pick_device(args.device)
    size = args.size or ("cuda" if dev.type == "cuda" else "cpu")
    S = SIZES[size]
    n_threads = None if dev.type == "cuda" else args.threads
    sol = load_solution(solution_source("05_jacobians_hessians"), Path(tempfile.mkdtemp()) / "l05.py", "l05")
    timing = dict(rounds=args.rounds, min_run_time=args.min_run_time, device=dev, progress=False)
    reports = {}

    with pinned_threads(n_threads):
        threads_used, machine_name = torch.get_num_threads(), machine()
        D = S["D"]
        layer = tanh_layer(D, D, seed=0, device=dev)
        exact = layer.to(torch.float64)
        print(f"Jacobian of a {D}x{D} tanh layer")
        reports["jacobian"] = compare(
            {"row loop": lambda x: sol.jacobian_rows(layer, x), "jacrev (vmap over vjp)": lambda x: jacrev(layer)(x),
             "jacfwd": lambda x: jacfwd(layer)(x)},
            inputs=lambda: (torch.randn(D, device=dev),), check=checker(lambda x: tanh_jacobian(exact, x)),
            **timing).show()

        for label in ("tall", "wide"):
            m, n = S[label]
            layer_mn = tanh_layer(m, n, seed=0, device=dev)
            picked = sol.pick_jacobian(layer_mn, torch.randn(n, device=dev))
            print(f"{label}: {m} outputs x {n} inputs; pick_jacobian chose {picked.__name__}")
            reports[label] = compare(
                {"jacrev": jacrev(layer_mn), "jacfwd": jacfwd(layer_mn)}, inputs=lambda n=n: (torch.randn(n, device=dev),),
                check=checker(lambda x, exact=layer_mn.to(torch.float64): tanh_jacobian(exact, x)), **timing).show()
            reports[label].notes.append(f"pick_jacobian chose {picked.__name__}")

        n = S["n_hvp"]
        f = energy(n, seed=0, device=dev, dtype=torch.float64)
        v = torch.randn(n, device=dev, dtype=torch.float64)
        print(f"Hessian-vector product, energy of {n:,} variables (float64)")
        reports["hvp"] = compare(
            {"gradient alone": lambda x, v: grad(f)(x), "forward over reverse": lambda x, v: sol.hvp_fwd_rev(f, x, v),
             "reverse over reverse": lambda x, v: sol.hvp_rev_rev(f, x, v)},
            inputs=lambda: (torch.randn(n, device=dev, dtype=torch.float64), v), **timing).show()

    kind = dev.type
    headline = {
        "vmap over vjp vs row loop": reports["jacobian"].speedup("jacrev (vmap over vjp)", over="row loop"),
        "right mode vs wrong, tall": reports["tall"].speedup("jacfwd", over="jacrev"),
        "right mode vs wrong, wide": reports["wide"].speedup("jacrev", over="jacfwd"),
    }
    results = {"machine": machine_name, "device": str(dev), "torch": torch.__version__, "size": size,
               "sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in S.items()}, "threads": threads_used,
               "date": dt.date.today().isoformat(), "rounds": args.rounds,
               "headline": {k: {"speedup": round(r.median, 3), "iqr": [round(r.low, 3), round(r.high, 3)],
                                "target": TARGETS[k][kind], "met": r.median >= TARGETS[k][kind]}
                            for k, r in headline.items()},
               "tables": {name: {c: {"median_ms": round(rep.median(c) * 1e3, 4),
                                     "vs_first": round(rep.speedup(c).median, 3)} for c in rep.names}
                          for name, rep in reports.items()}}

    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"jacobians-{size}-{kind}"
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"# Lesson 5 Jacobians, Hessians, HVPs: {results['machine']}", "",
             f"torch {results['torch']}, {results['date']}, {threads_used} thread(s), {args.rounds} interleaved "
             f"rounds; D={S['D']}, tall {S['tall'][0]}x{S['tall'][1]}, wide {S['wide'][0]}x{S['wide'][1]} "
             f"(outputs x inputs), HVP at n={S['n_hvp']:,} float64.", "",
             "| headline | speedup (IQR) | target | met |", "|---|---|---|---|"]
    lines += [f"| {k} | {h['speedup']}x ({h['iqr'][0]}-{h['iqr'][1]}) | {h['target']}x | {'yes' if h['met'] else 'no'} |"
              for k, h in results["headline"].items()]
    for name, rows in results["tables"].items():
        first = next(iter(rows))
        lines += ["", f"## {name}", "", f"| candidate | median | vs {first} |", "|---|---|---|"]
        lines += [f"| {c} | {r['median_ms']} ms | {r['vs_first']}x |" for c, r in rows.items()]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

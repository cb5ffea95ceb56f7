"""What the lesson benchmarks share: their command line, and how a timing report becomes the rows
of their JSON and the cells of their Markdown tables."""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parser(doc: str, sizes: dict) -> argparse.ArgumentParser:
    """The options every lesson benchmark takes (``--size``, ``--device``, ``--threads``, ``--rounds``,
    ``--min-run-time``, ``--out``)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(sizes), default=None, help="default: cpu on CPU, reference on CUDA")
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None, help="pin torch's CPU thread count (default: torch's)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--min-run-time", type=float, default=0.3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    return ap


def rows(report) -> dict:
    """Each candidate's median (ms) and its speedup over the report's baseline, with quartiles."""
    return {n: {"median_ms": float(f"{report.median(n) * 1e3:.4g}"), "vs_baseline": round(report.speedup(n).median, 3),
                "vs_baseline_iqr": [round(report.speedup(n).low, 3), round(report.speedup(n).high, 3)]}
            for n in report.names}


def cell(r: dict) -> str:
    """One row as a Markdown table cell: ``12.3 ms (1.5x, 1.4-1.6)``."""
    return f"{r['median_ms']} ms ({r['vs_baseline']}x, {r['vs_baseline_iqr'][0]}-{r['vs_baseline_iqr'][1]})"

"""``python -m autograder report OUT``: the page an instructor reads after grading a class.

Read from ``OUT/grades.csv`` and ``OUT/cells.csv`` (what ``grade`` or ``collect`` wrote), written
to ``OUT/report/``: ``index.html`` (every lesson in one table), one page per lesson with PNG
charts, and ``data.json`` with every number the pages show. Per lesson: how many submissions and
in what state (graded, missing, invalid, timeout...), the score distribution, per exercise the
pass rate and *why* the rest failed (numerics, structure, speed, error, not written, timeout,
tampered...; ``autograder.verdict.REASONS``), the speed cells left undecided, time and memory per
submission, the flags to review and the device each was graded on.
"""

from __future__ import annotations

import csv
import html
import json
import statistics
from collections import Counter
from pathlib import Path

from . import UsageError
from .verdict import REASONS


def _read(path: Path) -> list[dict]:
    if not path.is_file():
        raise UsageError(f"expected {path.name} in {path.parent} (what `python -m autograder grade` or "
                         f"`collect` writes), but there is none: pass the folder given to grade --out")
    with path.open(newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarise(out: Path) -> dict:
    """Every number of the report, per lesson, from grades.csv and cells.csv."""
    rows, cells = _read(out / "grades.csv"), _read(out / "cells.csv")
    lessons: dict[str, dict] = {}
    for lesson_id in sorted({r["lesson_id"] for r in rows}):
        mine = [r for r in rows if r["lesson_id"] == lesson_id]
        graded = [r for r in mine if r["status"] not in ("missing", "invalid")]
        scores = [float(r["score"]) for r in graded]
        exercises: dict[str, dict] = {}
        for c in cells:
            if c["lesson_id"] != lesson_id:
                continue
            ex = exercises.setdefault(c["grade_id"], {"max_points": float(c["max_score"]), "submissions": 0,
                                                      "passed": 0, "undecided": 0,
                                                      "failed": {r: 0 for r in REASONS}})
            ex["submissions"] += 1
            verdict = c.get("verdict") or ("passed" if float(c["score"]) >= float(c["max_score"]) else "failed")
            if verdict == "passed":
                ex["passed"] += 1
            elif verdict == "undecided":
                ex["undecided"] += 1
            else:
                reason = c.get("reason") or "structure"
                ex["failed"][reason if reason in REASONS else "error"] += 1
        for ex in exercises.values():
            ex["pass_rate"] = ex["passed"] / ex["submissions"] if ex["submissions"] else 0.0
        seconds = [float(r["seconds"]) for r in graded]
        memory = [float(r["peak_rss_mb"]) for r in graded]
        lessons[lesson_id] = {
            "submissions": len(mine),
            "status": dict(sorted(Counter(r["status"] for r in mine).items())),
            "max_score": max((float(r["max_score"]) for r in mine), default=0.0),
            "scores": scores,
            "mean": statistics.fmean(scores) if scores else 0.0,
            "median": statistics.median(scores) if scores else 0.0,
            "full_marks": sum(1 for r in graded if float(r["score"]) == float(r["max_score"])),
            "exercises": exercises,
            "seconds": {"median": statistics.median(seconds) if seconds else 0.0,
                        "p90": _percentile(seconds, 0.9), "max": max(seconds, default=0.0)},
            "memory_mb": {"median": statistics.median(memory) if memory else 0.0, "max": max(memory, default=0.0)},
            "flagged": [{"student": r["student_id"], "flags": r["flags"], "detail": r["detail"]}
                        for r in mine if r["flags"]],
            "devices": dict(sorted(Counter(r.get("device") or "unknown" for r in graded).items())),
        }
    return {"students": len({r["student_id"] for r in rows}), "lessons": lessons}


def _charts(lesson_id: str, data: dict, folder: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {}
    fig, ax = plt.subplots(figsize=(5.5, 3))
    top = data["max_score"] or 1
    ax.hist(data["scores"], bins=[x - 0.5 for x in range(int(top) + 2)], color="#1f77b4", edgecolor="white")
    ax.set_xlabel(f"score (of {top:g})")
    ax.set_ylabel("submissions")
    ax.set_title(f"{lesson_id}: scores of the {len(data['scores'])} submission(s) that ran")
    names["scores"] = f"{lesson_id}-scores.png"
    fig.tight_layout()
    fig.savefig(folder / names["scores"], dpi=100)
    plt.close(fig)

    ids = list(data["exercises"])
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(ids) + 1.6))
    left = [0.0] * len(ids)
    colors = {"passed": "#1a7f37", "undecided": "#9a6700"}
    segments = [("passed", [data["exercises"][g]["passed"] for g in ids]),
                ("undecided", [data["exercises"][g]["undecided"] for g in ids])]
    segments += [(r, [data["exercises"][g]["failed"][r] for g in ids]) for r in REASONS
                 if any(data["exercises"][g]["failed"][r] for g in ids)]
    for label, counts in segments:
        ax.barh(ids, counts, left=left, label=label, color=colors.get(label) or REASON_COLORS[label])
        left = [a + b for a, b in zip(left, counts)]
    ax.invert_yaxis()
    ax.set_xlabel("submissions")
    ax.set_title("per exercise: passed, undecided, and why the rest failed")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    names["exercises"] = f"{lesson_id}-exercises.png"
    fig.tight_layout()
    fig.savefig(folder / names["exercises"], dpi=100)
    plt.close(fig)
    return names


#: One colour per kind of failure, the same on every page (no green: that is "passed").
REASON_COLORS = dict(zip(REASONS, ["#cf222e", "#fb8500", "#1f77b4", "#8e44ad", "#6e7781", "#e377c2", "#17becf",
                                   "#bcbd22", "#8c564b", "#000000", "#ff9896"]))

_STYLE = """body{font-family:system-ui,sans-serif;max-width:70rem;margin:2rem auto;padding:0 1rem;color:#222}
table{border-collapse:collapse;margin:.6rem 0}td,th{padding:.2rem .7rem;border-bottom:1px solid #ddd;text-align:left}
td.n{text-align:right;font-variant-numeric:tabular-nums}img{max-width:100%}.muted{color:#666}"""


def _page(title: str, body: list[str]) -> str:
    return (f"<!doctype html><html lang=en><meta charset=utf-8><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style><body><h1>{html.escape(title)}</h1>" + "\n".join(body) + "</body></html>\n")


def _fmt(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".") if x != int(x) else str(int(x))


def _lesson_page(lesson_id: str, d: dict, charts: dict[str, str]) -> str:
    e = html.escape
    status = ", ".join(f"{n} {e(s)}" for s, n in d["status"].items())
    body = [f"<p>{d['submissions']} submission(s): {status}. Graded on: "
            + ", ".join(f"{e(k)} ({n})" for k, n in d["devices"].items()) + ".</p>",
            f"<p>Mean score <b id=mean>{_fmt(d['mean'])}</b>, median <b id=median>{_fmt(d['median'])}</b> "
            f"of {_fmt(d['max_score'])}; full marks: <b id=full>{d['full_marks']}</b>.</p>",
            f"<img src='{charts['scores']}' alt='score distribution'>",
            "<h2>Exercises</h2><table><tr><th>exercise</th><th>points</th><th>submissions</th><th>pass rate</th>"
            "<th>undecided</th>" + "".join(f"<th>{e(r)}</th>" for r in REASONS) + "</tr>"]
    for g, ex in d["exercises"].items():
        body.append(f"<tr id='ex-{e(g)}'><td>{e(g)}</td><td class=n>{_fmt(ex['max_points'])}</td>"
                    f"<td class=n>{ex['submissions']}</td><td class=n>{100 * ex['pass_rate']:.0f}%</td>"
                    f"<td class=n>{ex['undecided']}</td>"
                    + "".join(f"<td class=n>{ex['failed'][r] or ''}</td>" for r in REASONS) + "</tr>")
    body.append("</table>")
    body.append(f"<img src='{charts['exercises']}' alt='passed and failed per exercise'>")
    body.append("<p class=muted>numerics: a wrong value on the grader's inputs; structure: the technique the "
                "exercise asks for was not used; speed: the bar was missed (undecided: the machine was too busy "
                "to tell; measured again by the next grade run); error: an exception in the learner's code; not "
                "written: the stub is still there; timeout, oom, crashed, not run: the run stopped before the cell; "
                "tampered, altered: the evidence was interfered with (see the flags).</p>")
    s, m = d["seconds"], d["memory_mb"]
    body.append(f"<h2>Time and memory per submission</h2><p>Grading time: median {_fmt(round(s['median'], 1))} s, "
                f"90th percentile {_fmt(round(s['p90'], 1))} s, longest {_fmt(round(s['max'], 1))} s. Peak memory: "
                f"median {_fmt(round(m['median']))} MB, largest {_fmt(round(m['max']))} MB.</p>")
    body.append(f"<h2>Flagged for review ({len(d['flagged'])})</h2>")
    if d["flagged"]:
        body.append("<table><tr><th>student</th><th>flags</th><th>detail</th></tr>" + "".join(
            f"<tr><td>{e(f['student'])}</td><td>{e(f['flags'])}</td><td>{e(f['detail'][:300])}</td></tr>"
            for f in d["flagged"]) + "</table><p class=muted>What each flag means: docs/grading.md. A flag is "
            "evidence for a human to look at, never a verdict by itself.</p>")
    else:
        body.append("<p>None.</p>")
    body.append("<p><a href='index.html'>All lessons</a></p>")
    return _page(f"{lesson_id}: class report", body)


def write_report(out: Path) -> Path:
    """Write ``OUT/report/`` and return the index page's path."""
    data = summarise(out)
    folder = out / "report"
    folder.mkdir(parents=True, exist_ok=True)
    e = html.escape
    index = [f"<p>{data['students']} student(s). Each lesson's page has the score distribution, every "
             "exercise's pass rate and reasons for failing, time and memory, and the flags to review.</p>",
             "<table><tr><th>lesson</th><th>submissions</th><th>graded</th><th>mean</th><th>median</th>"
             "<th>of</th><th>full marks</th><th>undecided cells</th><th>flagged</th></tr>"]
    for lesson_id, d in data["lessons"].items():
        charts = _charts(lesson_id, d, folder)
        (folder / f"{lesson_id}.html").write_text(_lesson_page(lesson_id, d, charts), encoding="utf-8")
        undecided = sum(ex["undecided"] for ex in d["exercises"].values())
        index.append(f"<tr><td><a href='{e(lesson_id)}.html'>{e(lesson_id)}</a></td><td class=n>{d['submissions']}</td>"
                     f"<td class=n>{len(d['scores'])}</td><td class=n>{_fmt(d['mean'])}</td>"
                     f"<td class=n>{_fmt(d['median'])}</td><td class=n>{_fmt(d['max_score'])}</td>"
                     f"<td class=n>{d['full_marks']}</td><td class=n>{undecided}</td>"
                     f"<td class=n>{len(d['flagged'])}</td></tr>")
    index.append("</table>")
    page = folder / "index.html"
    page.write_text(_page("Class report", index), encoding="utf-8")
    (folder / "data.json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {page} ({len(data['lessons'])} lesson page(s), data.json)", flush=True)
    return page

"""The learner's feedback page: their code, what each check said, and their score.

Written by the grader itself rather than ``nbgrader generate_feedback``, whose pages show the
graded notebook as run, hidden tests included. Here a test cell shows only its visible source
(the student version's), and the result of the hidden part is one line: passed, or why not.
"""

from __future__ import annotations

import html
from pathlib import Path

from .program import TEST, Program

_STYLE = """body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}
pre{background:#f6f8fa;padding:.6rem;overflow-x:auto;border-radius:4px;font-size:.85rem}
.pass{color:#1a7f37}.fail{color:#cf222e}.cell{border-left:4px solid #ddd;padding-left:.8rem;margin:1.2rem 0}
.cell.pass{border-color:#1a7f37}.cell.fail{border-color:#cf222e}table{border-collapse:collapse}
td,th{padding:.2rem .8rem;border-bottom:1px solid #ddd;text-align:left}"""


def write_feedback(path: Path, student: str, lesson: str, program: Program, outcome, verdicts,
                   status: str) -> Path:
    by_grade = {v.grade_id: v for v in verdicts}
    score = sum(v.points for v in verdicts)
    total = sum(v.max_points for v in verdicts)
    e = html.escape
    parts = [f"<!doctype html><meta charset=utf-8><title>{e(lesson)}: feedback for {e(student)}</title>",
             f"<style>{_STYLE}</style>", f"<h1>{e(lesson)}</h1>",
             f"<p>Student <b>{e(student)}</b>: <b>{score:g} / {total:g}</b> points ({e(status)}).</p>"]
    if outcome.detail:
        parts.append(f"<p class=fail>{e(outcome.detail)}</p>")
    if program.flags:
        items = "".join(f"<li><b>{e(k)}</b>: {e('; '.join(v)[:400])}</li>" for k, v in sorted(program.flags.items()))
        parts.append(f"<p>The grader noted:</p><ul>{items}</ul>")
    parts.append("<table><tr><th>exercise</th><th>points</th></tr>" + "".join(
        f"<tr><td>{e(v.grade_id)}</td><td class={'pass' if v.points else 'fail'}>{v.points:g} / {v.max_points:g}</td></tr>"
        for v in verdicts) + "</table>")
    for cell in program.cells:
        if cell.kind == TEST:
            v = by_grade[cell.grade_id]
            ok = v.points > 0
            parts.append(f"<div class='cell {'pass' if ok else 'fail'}'><h3>{e(cell.grade_id)}: "
                         f"{v.points:g} / {v.max_points:g}</h3><pre>{e(cell.visible)}</pre>"
                         + ("<p class=pass>passed, hidden tests included</p>" if ok else
                            f"<p class=fail>not passed:</p><pre>{e(v.message)}</pre>") + "</div>")
        elif cell.learner:
            rep = outcome.cells.get(cell.index)
            out = (rep.output if rep else "")[-3000:]
            err = rep.error if rep else ""
            parts.append(f"<div class=cell><h3>your code{f' ({e(cell.grade_id)})' if cell.grade_id else ''}</h3>"
                         f"<pre>{e(cell.source)}</pre>" + (f"<pre>{e(out)}</pre>" if out.strip() else "")
                         + (f"<pre class=fail>{e(err)}</pre>" if err else "") + "</div>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts) + "\n", encoding="utf-8")
    return path

"""The learner's feedback page: their code, what each check said, and their score.

Written by the grader itself rather than ``nbgrader generate_feedback``, whose pages show the
graded notebook as run, hidden tests included. Here a test cell shows only its visible source
(the student version's), and the result of the hidden part is one line: passed, or why not.

Nothing the learner's run printed appears (learners see their prints in their own notebook;
instructors find them in ``WORK/autograded/``), and every message shown has any line of a
hidden test removed, so a submission cannot use its feedback page to read the hidden tests back.
"""

from __future__ import annotations

import html
from pathlib import Path

from .program import TEST, Program

_STYLE = """body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}
pre{background:#f6f8fa;padding:.6rem;overflow-x:auto;border-radius:4px;font-size:.85rem}
.pass{color:#1a7f37}.fail{color:#cf222e}.cell{border-left:4px solid #ddd;padding-left:.8rem;margin:1.2rem 0}
.wait{color:#9a6700}.cell.pass{border-color:#1a7f37}.cell.fail{border-color:#cf222e}.cell.wait{border-color:#9a6700}table{border-collapse:collapse}
td,th{padding:.2rem .8rem;border-bottom:1px solid #ddd;text-align:left}"""


def hidden_lines(program: Program) -> list[str]:
    """The lines of the program's hidden tests (those not in the visible source), longest first."""
    lines = set()
    for cell in program.cells:
        if cell.kind == TEST:
            shown = {line.strip() for line in cell.visible.splitlines()}
            lines |= {line.strip() for line in cell.source.splitlines()
                      if len(line.strip()) >= 8 and line.strip() not in shown}
    return sorted(lines, key=len, reverse=True)


def scrub(text: str, hidden: list[str]) -> str:
    for line in hidden:
        if line in text:
            text = text.replace(line, "[a hidden test]")
    return text


def write_feedback(path: Path, student: str, lesson: str, program: Program, outcome, verdicts,
                   status: str) -> Path:
    hidden = hidden_lines(program)
    by_grade = {v.grade_id: v for v in verdicts}
    score = sum(v.points for v in verdicts)
    total = sum(v.max_points for v in verdicts)
    e = html.escape
    parts = [f"<!doctype html><meta charset=utf-8><title>{e(lesson)}: feedback for {e(student)}</title>",
             f"<style>{_STYLE}</style>", f"<h1>{e(lesson)}</h1>",
             f"<p>Student <b>{e(student)}</b>: <b>{score:g} / {total:g}</b> points ({e(status)}).</p>"]
    if outcome.detail:
        parts.append(f"<p class=fail>{e(scrub(outcome.detail, hidden))}</p>")
    if program.flags:
        items = "".join(f"<li><b>{e(k)}</b>: {e('; '.join(v)[:400])}</li>" for k, v in sorted(program.flags.items()))
        parts.append(f"<p>The grader noted:</p><ul>{items}</ul>")
    parts.append("<table><tr><th>exercise</th><th>points</th></tr>" + "".join(
        f"<tr><td>{e(v.grade_id)}</td><td class={_css(v)}>{v.points:g} / {v.max_points:g}"
        f"{' (undecided)' if v.undecided else ''}</td></tr>" for v in verdicts) + "</table>")
    for cell in program.cells:
        if cell.kind == TEST:
            v = by_grade[cell.grade_id]
            said = {"pass": "<p class=pass>passed, hidden tests included</p>",
                    "wait": "<p class=wait>not decided yet (no points yet; measured again when your "
                            "instructor regrades):</p>",
                    "fail": "<p class=fail>not passed:</p>"}[_css(v)]
            parts.append(f"<div class='cell {_css(v)}'><h3>{e(cell.grade_id)}: "
                         f"{v.points:g} / {v.max_points:g}</h3><pre>{e(cell.visible)}</pre>" + said
                         + ("" if v.points > 0 else f"<pre>{e(scrub(v.message, hidden))}</pre>") + "</div>")
        elif cell.learner:
            rep = outcome.cells.get(cell.index)
            err = scrub(rep.error, hidden)[-2000:] if rep else ""
            parts.append(f"<div class=cell><h3>your code{f' ({e(cell.grade_id)})' if cell.grade_id else ''}</h3>"
                         f"<pre>{e(scrub(cell.source, hidden))}</pre>" + (f"<pre class=fail>{e(err)}</pre>" if err else "")
                         + "</div>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts) + "\n", encoding="utf-8")
    return path


def _css(verdict) -> str:
    return "pass" if verdict.points > 0 else "wait" if verdict.undecided else "fail"

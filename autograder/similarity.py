"""``python -m autograder similarity``: pairs of learners whose solution cells are alike.

Evidence for a human to look at, never a verdict: short exercises have few good answers, and
two learners may well write the same ten lines. What is compared is what the grader graded (the
vetted copies in ``WORK/submitted/``), one lesson at a time, solution cell by solution cell:

1. each cell's code as a syntax tree, with names renamed in order of appearance (``v0``, ``v1``,
   ...), docstrings and comments gone, string constants blanked: renaming variables, reformatting
   or rewording comments changes nothing;
2. the code the lesson gives (the student version's cell: the signature, the docstring, the
   stub) taken out, statement by statement, so that it cannot make two learners look alike;
3. a pair's similarity: the share of k-token shingles the two have in common (Jaccard), over all
   the lesson's solution cells together, weighted by size; cells with too little code of the
   learner's own (``MIN_TOKENS``) do not count.

Pairs at or above the threshold are listed in ``OUT/similarity.csv`` and ``OUT/similarity.html``
(the two learners' cells side by side).
"""

from __future__ import annotations

import ast
import csv
import html
import itertools
from dataclasses import dataclass
from pathlib import Path

from course import cells as nbcells

from . import UsageError
from .intake import parse_notebook

#: Tokens in a shingle.
K = 4
#: A cell with fewer tokens of the learner's own is left out (a one-line answer is no evidence).
MIN_TOKENS = 12


class _Tokens(ast.NodeVisitor):
    """A syntax tree as a sequence of tokens: node types, names renamed by first appearance,
    attribute names and numbers kept (which API a learner calls is the substance), strings blanked."""

    def __init__(self) -> None:
        self.out: list[str] = []
        self.names: dict[str, str] = {}

    def _name(self, name: str) -> str:
        return self.names.setdefault(name, f"v{len(self.names)}")

    def generic_visit(self, node: ast.AST) -> None:
        self.out.append(type(node).__name__)
        if isinstance(node, ast.Name):
            self.out.append(self._name(node.id))
        elif isinstance(node, ast.arg):
            self.out.append(self._name(node.arg))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            self.out.append(self._name(node.name))
        elif isinstance(node, ast.Attribute):
            self.out.append("." + node.attr)
        elif isinstance(node, ast.Constant):
            self.out.append("str" if isinstance(node.value, (str, bytes)) else repr(node.value))
        elif isinstance(node, ast.keyword) and node.arg:
            self.out.append(node.arg + "=")
        super().generic_visit(node)


def _statements(source: str) -> list[ast.stmt] | None:
    tree = nbcells.parse(source)
    if tree is None:
        return None
    out = []
    for node in ast.walk(tree):  # every statement, nested ones too, without docstrings
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and node.body and \
                isinstance(node.body[0], ast.Expr) and isinstance(getattr(node.body[0], "value", None), ast.Constant) \
                and isinstance(node.body[0].value.value, str):
            node.body = node.body[1:] or [ast.Pass()]
    for stmt in tree.body:
        out.append(stmt)
    return out


def _dump(stmt: ast.AST) -> str:
    return ast.dump(stmt, annotate_fields=False, include_attributes=False)


def tokens(source: str, given: str = "") -> list[str]:
    """The learner's own tokens of a cell: ``source`` minus the statements of ``given`` (the code
    the lesson gave), as :class:`_Tokens` writes them. Code that is not Python, or nests deeper than
    a walk of its tree goes (a sum of 500 terms), is read as its words, whitespace-normalised: they
    still say something, and one learner's odd cell never stops the report."""
    try:
        stmts = _statements(source)
        if stmts is not None:
            return _tree_tokens(stmts, given)
    except RecursionError:
        pass
    return [w for w in " ".join(source.split()).split(" ") if w]


def _tree_tokens(stmts: list[ast.stmt], given: str) -> list[str]:
    given_stmts = _statements(given) or []
    given_dumps = {_dump(s) for s in given_stmts}
    # a def the lesson gave keeps its signature: only its body's new statements are the learner's
    given_defs = {s.name: s for s in given_stmts if isinstance(s, (ast.FunctionDef, ast.ClassDef))}
    visitor = _Tokens()
    for stmt in stmts:
        if _dump(stmt) in given_dumps:
            continue
        if isinstance(stmt, (ast.FunctionDef, ast.ClassDef)) and stmt.name in given_defs:
            known = {_dump(s) for s in given_defs[stmt.name].body}
            for inner in stmt.body:
                if _dump(inner) not in known:
                    visitor.visit(inner)
            continue
        visitor.visit(stmt)
    return visitor.out


def shingles(toks: list[str]) -> set[tuple[str, ...]]:
    return {tuple(toks[i:i + K]) for i in range(max(0, len(toks) - K + 1))}


@dataclass
class Pair:
    lesson: str
    a: str
    b: str
    score: float
    cells: list[tuple[str, float]]  # (grade id, similarity) of the cells both wrote


def _solution_cells(nb: dict) -> dict[str, str]:
    return {nbcells.grade_id(c): nbcells.source(c) for c in nb.get("cells", [])
            if nbcells.is_solution(c) and nbcells.grade_id(c)}


def lesson_pairs(lesson: str, learners: dict[str, dict[str, str]], given: dict[str, str],
                 threshold: float) -> list[Pair]:
    """Pairs of ``learners`` (student -> grade id -> cell source) at or above ``threshold``."""
    prints = {s: {g: shingles(tokens(src, given.get(g, ""))) for g, src in cells.items()}
              for s, cells in learners.items()}
    pairs = []
    for a, b in itertools.combinations(sorted(prints), 2):
        common, union, per_cell = 0, 0, []
        for g in sorted(set(prints[a]) & set(prints[b])):
            x, y = prints[a][g], prints[b][g]
            if len(x) + K - 1 < MIN_TOKENS or len(y) + K - 1 < MIN_TOKENS:
                continue
            both, either = len(x & y), len(x | y)
            common, union = common + both, union + either
            per_cell.append((g, both / either))
        if union and common / union >= threshold:
            pairs.append(Pair(lesson, a, b, common / union, per_cell))
    return sorted(pairs, key=lambda p: -p.score)


def similarity(work: Path, out: Path, *, threshold: float = 0.8, lesson: str | None = None) -> list[Pair]:
    submitted = work / "submitted"
    if not submitted.is_dir():
        raise UsageError(f"nothing graded in {work}: expected {submitted} (what `python -m autograder grade "
                         "--work WORK` keeps); pass the work folder of the grade run")
    if not 0 < threshold <= 1:
        raise UsageError(f"--threshold must be in (0, 1], got {threshold}")
    by_lesson: dict[str, dict[str, dict[str, str]]] = {}
    for nb_path in sorted(submitted.glob("*/*/*.ipynb")):
        student, lesson_id = nb_path.parent.parent.name, nb_path.parent.name
        if lesson and lesson_id != lesson:
            continue
        by_lesson.setdefault(lesson_id, {})[student] = _solution_cells(parse_notebook(nb_path.read_bytes()))
    pairs: list[Pair] = []
    for lesson_id, learners in sorted(by_lesson.items()):
        release = sorted((work / "lessons" / lesson_id).glob("*.ipynb"))
        given = _solution_cells(parse_notebook(release[0].read_bytes())) if release else {}
        pairs += lesson_pairs(lesson_id, learners, given, threshold)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "similarity.csv").open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["lesson_id", "student_a", "student_b", "similarity", "cells"])
        for p in pairs:
            w.writerow([p.lesson, p.a, p.b, f"{p.score:.3f}", " ".join(f"{g}:{s:.2f}" for g, s in p.cells)])
    _html(out / "similarity.html", pairs, by_lesson, threshold)
    print(f"{len(pairs)} pair(s) at or above {threshold:g} in {len(by_lesson)} lesson(s): wrote "
          f"{out / 'similarity.csv'} and {out / 'similarity.html'} (evidence for a human to look at, never a verdict)",
          flush=True)
    return pairs


def _html(path: Path, pairs: list[Pair], by_lesson: dict, threshold: float) -> None:
    e = html.escape
    parts = ["<!doctype html><html lang=en><meta charset=utf-8><title>Similar solutions</title><style>"
             "body{font-family:system-ui,sans-serif;max-width:90rem;margin:2rem auto;padding:0 1rem}"
             "pre{background:#f6f8fa;padding:.5rem;font-size:.8rem;overflow-x:auto;margin:0}"
             "td{vertical-align:top;width:50%}table{width:100%}</style>",
             f"<h1>Similar solutions ({len(pairs)} pair(s) at or above {threshold:g})</h1>"
             "<p>Names, formatting, comments and the code each lesson gives are left out of the comparison. "
             "Short exercises have few good answers: this is evidence to look at, never a verdict.</p>"]
    for p in pairs:
        parts.append(f"<h2>{e(p.lesson)}: {e(p.a)} and {e(p.b)}: {p.score:.2f}</h2>")
        for g, s in p.cells:
            parts.append(f"<h3>{e(g)}: {s:.2f}</h3><table><tr><td><pre>{e(by_lesson[p.lesson][p.a][g])}</pre></td>"
                         f"<td><pre>{e(by_lesson[p.lesson][p.b][g])}</pre></td></tr></table>")
    path.write_text("\n".join(parts) + "\n", encoding="utf-8")

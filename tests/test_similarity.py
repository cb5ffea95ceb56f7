"""The similarity report: renaming, reformatting and commenting do not hide a copy; the code a
lesson gives never makes two learners alike; different solutions are not paired."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

from autograder.similarity import tokens

REPO = Path(__file__).resolve().parents[1]

GIVEN = '''def lstm_cell(x, h, c, w_ih, w_hh, b):
    """One LSTM step: the new (h, c)."""
    raise NotImplementedError()
'''

ORIGINAL = '''def lstm_cell(x, h, c, w_ih, w_hh, b):
    """One LSTM step: the new (h, c)."""
    gates = x @ w_ih.t() + h @ w_hh.t() + b
    i, f, g, o = gates.chunk(4, dim=1)
    c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h_new = torch.sigmoid(o) * torch.tanh(c_new)
    return h_new, c_new
'''

DISGUISED = '''def lstm_cell(x, h, c, w_ih, w_hh, b):
    """One LSTM step: the new (h, c)."""
    # the four gates in one product each
    pre = x @ w_ih.t() + h @ w_hh.t() + b
    in_gate, forget, cand, out_gate = pre.chunk(4, dim=1)
    cell = (torch.sigmoid(forget) * c
            + torch.sigmoid(in_gate) * torch.tanh(cand))   # new memory
    hidden = torch.sigmoid(out_gate) * torch.tanh(cell)
    return hidden, cell
'''

OWN = '''def lstm_cell(x, h, c, w_ih, w_hh, b):
    """One LSTM step: the new (h, c)."""
    H = h.shape[1]
    z = torch.addmm(b, torch.cat([x, h], 1), torch.cat([w_ih, w_hh], 1).t())
    i = z[:, :H].sigmoid()
    f = z[:, H:2 * H].sigmoid()
    g = z[:, 2 * H:3 * H].tanh()
    o = z[:, 3 * H:].sigmoid()
    c2 = f * c + i * g
    return o * c2.tanh(), c2
'''


def _nb(source: str) -> dict:
    meta = {"nbgrader": {"solution": True, "grade": False, "locked": False, "grade_id": "cell", "schema_version": 3}}
    return {"nbformat": 4, "nbformat_minor": 5, "metadata": {},
            "cells": [{"cell_type": "code", "id": "c1", "metadata": meta, "source": source, "outputs": [],
                       "execution_count": None}]}


def test_names_formatting_comments_and_given_code_do_not_count():
    assert tokens(ORIGINAL, GIVEN) == tokens(DISGUISED, GIVEN)
    assert tokens(GIVEN, GIVEN) == []                      # the stub itself: nothing of the learner's
    assert tokens(ORIGINAL, GIVEN) != tokens(OWN, GIVEN)
    assert tokens("def f(:\n  oops", "") == ["def", "f(:", "oops"]  # not Python: its words


def test_a_cell_too_deep_to_walk_is_read_as_its_words_whatever_the_recursion_limit():
    """How deep the tree walk goes is this process's recursion limit, which others raise (Inductor
    does, so a suite that compiled anything before this test has a higher one)."""
    default = sys.getrecursionlimit()
    try:
        for limit in (1000, 3000):
            sys.setrecursionlimit(limit)
            assert tokens("x = 1" + " + 1" * (limit + 50), "")[:3] == ["x", "=", "1"], limit
    finally:
        sys.setrecursionlimit(default)


def test_the_report_pairs_the_disguised_copy_and_nothing_else(tmp_path):
    work = tmp_path / "work"
    # fay's cell nests deeper than a walk of its tree goes at the default recursion limit (600 terms
    # were enough), gus's deeper than the parser goes: before, either stopped the report for the
    # whole class (RecursionError)
    deep = {"fay": "total = 1" + " + 1" * 3000 + "\n" + ORIGINAL, "gus": "x = " + "-" * 6000 + "1\n" + OWN}
    for student, src in {"ann": ORIGINAL, "ben": DISGUISED, "cat": OWN, "dan": GIVEN, "eve": GIVEN, **deep}.items():
        folder = work / "submitted" / student / "01_rnn"
        folder.mkdir(parents=True)
        (folder / "01_rnn.ipynb").write_text(json.dumps(_nb(src)))
    (work / "lessons" / "01_rnn").mkdir(parents=True)
    (work / "lessons" / "01_rnn" / "01_rnn.ipynb").write_text(json.dumps(_nb(GIVEN)))
    proc = subprocess.run([sys.executable, "-m", "autograder", "similarity", "--work", work, "--out", tmp_path / "o"],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    with (tmp_path / "o" / "similarity.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["student_a"], r["student_b"]) for r in rows] == [("ann", "ben")]
    assert float(rows[0]["similarity"]) == 1.0
    page = (tmp_path / "o" / "similarity.html").read_text()
    assert "ann and ben" in page and "never a verdict" in page
    proc = subprocess.run([sys.executable, "-m", "autograder", "similarity", "--work", tmp_path / "none", "--out",
                           tmp_path / "o"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "nothing graded" in proc.stderr

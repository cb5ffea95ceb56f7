"""`python -m autograder bundle`: what learners get (lessons, the helper package, the files that
launch them: Makefile, Binder's start, the Jupyter settings), and never a solution."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from autograder.bundle import leaks

ROOT = Path(__file__).resolve().parents[1]


def test_bundle_has_what_learners_launch_with_and_no_instructor_material(tmp_path):
    out = tmp_path / "bundle"
    proc = subprocess.run([sys.executable, "-m", "autograder", "bundle", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for name in ("lessons", "course", "requirements", "environment.yml", "Makefile", "README.md",
                 "jupyter-config/labconfig/page_config.json", "course/exercises.json"):
        assert (out / name).exists(), name
    assert os.access(out / "start", os.X_OK), "Binder's start must stay executable"
    for name in ("solutions", "autograder", "tests", "benchmarks", "course/references"):
        assert not (out / name).exists(), name
    # what the visible checks use instead of the grader's references: every file they declare
    from course.references.__main__ import FILES

    missing = [name for name in FILES if not (out / "course/reference_data" / name).exists()]
    assert not missing and len(FILES) >= 3, missing
    assert leaks(out, ROOT / "solutions") == []
    # the bundled course runs lesson 1's visible checks without the grader's references
    # -S: no site hooks, so a development install's finder cannot bring back this checkout's course
    import sysconfig
    check = (f"import sys\nsys.path[:0] = [{str(out)!r}, {sysconfig.get_paths()['purelib']!r}]\n"
             "import torch, course, course.checks.rnn as C\n"
             f"assert course.__file__.startswith({str(out)!r}), course.__file__\n"
             "assert C.grader_references('rnn') is None\n"
             "def wrong(x, h, c, p):\n    return h, c\n"
             "try:\n    C.check_layer_norm_cell(wrong)\nexcept AssertionError as e:\n    print('caught', str(e)[:40])\n"
             # and lesson 9's mask checks, from stored answers: a misreading of the masks is still named
             "import course.checks.fastpath as C9\n"
             "assert C9.grader_references('fastpath') is None\n"
             "def flipped(q, k, v, attn_mask=None, key_padding_mask=None, is_causal=False):\n"
             "    s = (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5)\n"
             "    if key_padding_mask is not None:\n"
             "        s = s.masked_fill(~key_padding_mask[:, None, None, :], float('-inf'))\n"
             "    return torch.softmax(s, -1) @ v\n"
             "try:\n    C9.check_masked_attention(flipped)\nexcept AssertionError as e:\n"
             "    print('caught', 'read as SDPA' in str(e))\n")
    proc = subprocess.run([sys.executable, "-S", "-c", check], cwd=out, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "caught layer_norm_lstm_cell" in proc.stdout, proc.stderr[-2000:]
    assert "caught True" in proc.stdout, proc.stdout[-2000:]


def test_leak_check_finds_a_solution_pasted_into_a_lesson(tmp_path):
    lesson = tmp_path / "lessons" / "04_forward_ad" / "04_forward_ad.ipynb"
    lesson.parent.mkdir(parents=True)
    nb = json.loads((ROOT / "lessons" / "04_forward_ad" / "04_forward_ad.ipynb").read_text())
    solution = json.loads((ROOT / "solutions" / "04_forward_ad" / "04_forward_ad.ipynb").read_text())
    answer = next(c for c in solution["cells"] if "### BEGIN SOLUTION" in "".join(c["source"]))
    body = "".join(answer["source"]).split("### BEGIN SOLUTION")[1].split("### END SOLUTION")[0]
    lesson.write_text(json.dumps(nb))
    assert leaks(tmp_path, ROOT / "solutions") == []
    nb["cells"].append({"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
                        "source": body})
    lesson.write_text(json.dumps(nb))
    assert leaks(tmp_path, ROOT / "solutions"), "a pasted solution must be found"

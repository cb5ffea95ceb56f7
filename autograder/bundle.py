"""``python -m autograder bundle OUT``: the tree learners get, and nothing else.

What learners need: the student versions in ``lessons/``, the ``course`` helper package (the
visible checks run in it), the environment files, the Makefile (``make lab``), the learners'
Jupyter settings with Binder's ``start``, and the README. Left out: ``solutions/``
(solutions and hidden tests), ``autograder/``, ``tests/``, ``benchmarks/`` and any work folder.
``leaks`` then reads every file of the bundle for lines of solution code or hidden tests, and
the command fails if it finds one.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from course import cells

from . import REPO_ROOT, UsageError

INCLUDE = ["lessons", "course", "requirements", "pyproject.toml", "environment.yml", "README.md", "LICENSE",
           "Makefile", "start", "jupyter-config"]
SKIP = {"__pycache__", ".ipynb_checkpoints", ".DS_Store"}
#: The grader's references that reproduce exercises (``course/references``): never bundled.
GRADER_ONLY = [Path("course") / "references"]
_BLOCK = re.compile(r"### BEGIN (SOLUTION|HIDDEN TESTS)(.*?)### END \1", re.DOTALL)


def secret_blocks(solutions: Path) -> list[tuple[str, set[str]]]:
    """Each solution or hidden-test block as (where, its distinctive lines)."""
    found = []
    for nb_path in sorted(solutions.glob("*/*.ipynb")):
        nb = json.loads(nb_path.read_text(encoding="utf-8"))
        for cell in nb["cells"]:
            src = cells.source(cell)
            gid = cells.grade_id(cell, cell.get("id"))
            for kind, body in _BLOCK.findall(src):
                lines = {l.strip() for l in body.splitlines()}
                lines = {l for l in lines if len(l) >= 16 and not l.startswith("#")}
                if lines:
                    found.append((f"{nb_path.parent.name}/{gid} ({kind.lower()})", lines))
    return found


def leaks(tree: Path, solutions: Path, share: float = 0.5) -> list[str]:
    """Files that hold nbgrader's markers, any line of a hidden test, or at least ``share`` of
    the distinctive lines of a solution block (single common lines such as
    ``for i in range(n):`` are not a leak; a solution's body is)."""
    blocks = secret_blocks(solutions)
    problems = []
    for path in sorted(p for p in tree.rglob("*") if p.is_file()):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if "BEGIN SOLUTION" in text or "BEGIN HIDDEN TESTS" in text:
            problems.append(f"{path.relative_to(tree)}: nbgrader solution/hidden-test markers")
        lines = {l.strip() for l in text.replace("\\n", "\n").replace('\\"', '"').splitlines()}
        for where, secret in blocks:
            common = secret & lines
            hidden = where.endswith("(hidden tests)")
            if (hidden and common) or (not hidden and len(common) >= max(2, share * len(secret))):
                problems.append(f"{path.relative_to(tree)}: {len(common)}/{len(secret)} lines of {where}")
    return problems


def bundle(out: Path, solutions: Path | None = None) -> Path:
    if out.exists():
        raise UsageError(f"{out} already exists; bundle writes a new folder, pass a path that does not exist")
    out.mkdir(parents=True)
    for name in INCLUDE:
        src = REPO_ROOT / name
        if src.is_dir():
            shutil.copytree(src, out / name, ignore=lambda _d, names: [n for n in names if n in SKIP])
        elif src.exists():
            shutil.copy2(src, out / name)  # keeps Binder's `start` executable
    for path in GRADER_ONLY:
        shutil.rmtree(out / path, ignore_errors=True)
    problems = leaks(out, solutions or REPO_ROOT / "solutions")
    if problems:
        shutil.rmtree(out)
        raise UsageError("the bundle would leak instructor material, nothing written:\n  " + "\n  ".join(problems[:20]))
    print(f"wrote {out}: {', '.join(n for n in INCLUDE if (out / n).exists())}")
    return out

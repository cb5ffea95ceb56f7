"""Launch anywhere: the Colab set-up cell and the Binder/Colab links of every lesson.

One template, written into each lesson's source notebook by ``python -m autograder release``
(so the student versions, the instructor notebooks and the graded program all carry the same
cell), from the repository and release named in ``pyproject.toml`` (``[tool.course]``).
"""

from __future__ import annotations

import copy
import re
import tomllib
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETUP_TAG = "course-setup"
COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
BINDER_BADGE = "https://mybinder.org/badge_logo.svg"

CHECK_TAG, CHECK_MD_TAG = "course-self-check", "course-self-check-intro"
CHECK_MARKDOWN = """\
## Check your work

The cell below runs every test cell of this lesson again, against what your notebook holds now,
and lists which exercises pass. It records the result too: `python -m course progress`, in a
terminal, shows your progress across lessons. Nothing here is graded: the grader runs the same
checks again on inputs you have not seen (other seeds and sizes) and re-measures the speedups."""
CHECK_TEMPLATE = 'checked = course.self_check("{lesson_id}")'

SETUP_TEMPLATE = '''\
# Set-up for Colab (or any Python without the course): installs the course's helper package,
# pinned to release {release}, and keeps the PyTorch you have. With `make lab` or on Binder the
# package is there already, and this cell does nothing.
import importlib.util, os, re, subprocess, sys, tempfile
spec = importlib.util.find_spec("course")
if spec is None or spec.origin is None:  # not installed (a folder named `course`, e.g. a clone, is not it)
    if importlib.util.find_spec("torch") is None:
        raise RuntimeError("The course needs PyTorch: install it (pytorch.org), then run this cell again.")
    from importlib.metadata import requires, version
    if tuple(int(p) for p in re.findall(r"\\d+", version("torch"))[:2]) < ({torch_min_tuple}):
        raise RuntimeError(f"The course needs torch {torch_min} or newer; you have {{version('torch')}}. "
                           "Install a newer one (pytorch.org), restart, and run this cell again.")
    source = os.environ.get("COURSE_PIP_SOURCE", "{requirement}")
    with tempfile.TemporaryDirectory() as folder:  # removed, with what is in it, when the block ends
        keep = os.path.join(folder, "keep-torch.txt")
        with open(keep, "w") as f:
            f.write(f"torch=={{version('torch')}}\\n")  # pip may add packages, never replace torch
        pip = [sys.executable, "-m", "pip", "install", "-q", "-c", keep]
        # The package alone, then what it needs except torch: a torch newer than this release was
        # tested with ({torch_min} to below {torch_max}) is kept too; course.doctor() below says so.
        if subprocess.run(pip + ["--no-deps", source]).returncode:
            raise RuntimeError("pip could not install the course's helper package (its message is above).")
        importlib.invalidate_caches()
        needs = [r for r in requires("{name}") or [] if "extra ==" not in r and not re.match(r"torch\\b", r)]
        if subprocess.run(pip + needs).returncode:
            raise RuntimeError("pip could not install what the course needs besides torch (its message is above).")
    if getattr(sys.modules.get("course"), "__file__", "") is None:  # the folder, imported earlier
        del sys.modules["course"]
    importlib.invalidate_caches()
'''


@lru_cache(maxsize=1)
def settings(pyproject: Path = ROOT / "pyproject.toml") -> dict:
    data = tomllib.loads(pyproject.read_text())
    tool = data["tool"]["course"]
    torch_req = next(d for d in data["project"]["dependencies"] if d.replace(" ", "").startswith("torch>"))
    bounds = dict(re.findall(r"(>=|<=|==|<|>)([\w.]+)", torch_req))
    return {"repository": tool["repository"], "release": tool["release"],
            "name": data["project"]["name"], "version": data["project"]["version"],
            "torch_min": bounds[">="], "torch_max": bounds["<"]}


def requirement() -> str:
    s = settings()
    return f"{s['name']} @ git+https://github.com/{s['repository']}@{s['release']}"


def setup_source() -> str:
    s = settings()
    low = tuple(int(p) for p in re.findall(r"\d+", s["torch_min"])[:2])
    return SETUP_TEMPLATE.format(release=s["release"], requirement=requirement(), name=s["name"],
                                 torch_min=s["torch_min"], torch_max=s["torch_max"],
                                 torch_min_tuple=", ".join(map(str, low))).rstrip("\n")


def colab_url(lesson_id: str) -> str:
    s = settings()
    return (f"https://colab.research.google.com/github/{s['repository']}/blob/{s['release']}/"
            f"lessons/{lesson_id}/{lesson_id}.ipynb")


def binder_url(lesson_id: str | None = None) -> str:
    s = settings()
    path = f"lessons/{lesson_id}/{lesson_id}.ipynb" if lesson_id else "lessons"
    return f"https://mybinder.org/v2/gh/{s['repository']}/{s['release']}?urlpath=lab/tree/{path}"


def badges(lesson_id: str) -> str:
    return (f"[![Open In Colab]({COLAB_BADGE})]({colab_url(lesson_id)}) "
            f"[![Binder]({BINDER_BADGE})]({binder_url(lesson_id)})")


def _lines(source) -> list[str]:
    text = "".join(source) if isinstance(source, list) else source
    return text.split("\n")


def apply(nb: dict, lesson_id: str) -> dict:
    """The notebook with its launch links (in the first Markdown cell, under the title) and its
    set-up cell (the first code cell) up to date; idempotent."""
    nb = copy.deepcopy(nb)
    cells = nb["cells"]
    first_md = next((c for c in cells if c["cell_type"] == "markdown"), None)
    if first_md is not None:
        lines, skip = [], False
        for line in _lines(first_md["source"]):  # drop the old links and the blank line after
            if line.startswith("[![Open In Colab]"):
                skip = True
            elif not (skip and line == ""):
                lines.append(line)
                skip = False
            else:
                skip = False
        if lines and lines[0].startswith("#"):
            lines[1:1] = ["", badges(lesson_id)] + ([""] if len(lines) > 1 and lines[1] else [])
        else:
            lines[0:0] = [badges(lesson_id), ""]
        first_md["source"] = "\n".join(lines)
    setup = next((c for c in cells if SETUP_TAG in c.get("metadata", {}).get("tags", [])), None)
    if setup is None:
        at = next((i for i, c in enumerate(cells) if c["cell_type"] == "code"), len(cells))
        setup = {"id": SETUP_TAG, "cell_type": "code", "metadata": {"tags": [SETUP_TAG]},
                 "execution_count": None, "source": "", "outputs": []}
        cells.insert(at, setup)
    setup["source"] = setup_source()
    for tag, kind, text in ((CHECK_MD_TAG, "markdown", CHECK_MARKDOWN),
                            (CHECK_TAG, "code", CHECK_TEMPLATE.format(lesson_id=lesson_id))):
        # an untagged copy written by hand would run the self-check twice: the tagged cell is the one
        cells[:] = [c for c in cells if tag in c.get("metadata", {}).get("tags", [])
                    or not (c["cell_type"] == kind and "\n".join(_lines(c["source"])).strip() == text.strip())]
        cell = next((c for c in cells if tag in c.get("metadata", {}).get("tags", [])), None)
        if cell is None:
            cell = {"id": tag, "cell_type": kind, "metadata": {"tags": [tag]}}
            if kind == "code":
                cell["execution_count"] = None
            cell["source"] = ""
            if kind == "code":
                cell["outputs"] = []
            cells.append(cell)
        cell["source"] = text
    return nb


def apply_to_file(path: Path, lesson_id: str) -> bool:
    """Rewrite a source notebook in place when its launch cells are stale; True if it changed."""
    import json

    text = path.read_text(encoding="utf-8")
    nb = json.loads(text)  # the solutions keep their own layout: key order, one string a source
    updated = json.dumps(apply(nb, lesson_id), indent=1, ensure_ascii=False) + "\n"
    if updated == text:
        return False
    path.write_text(updated, encoding="utf-8")
    return True

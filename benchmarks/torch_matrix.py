"""The torch range as a tested matrix: every lesson run as a learner would, on each torch version.

    make torch-matrix                                    # lowest, pinned, newest accepted, GPU acceptance's
    python benchmarks/torch_matrix.py --versions 2.4.0 2.14.1 --lesson 04_forward_ad

For each version, a throwaway virtual environment (under ``.torch-matrix/``, never committed) gets
that torch from the package index, then the course's package and what it needs besides torch
(the way the lessons' Colab set-up cell installs it: the torch there is kept). Each lesson runs
there top to bottom as a learner who finished it would have it (the student version with the
instructor's answers), every cell in one namespace, with the warnings a learner would see in
Jupyter (``DeprecationWarning`` from the notebook's own code, every ``FutureWarning`` and
``UserWarning``), and must end with every visible check passing. The result is
``docs/compatibility.md``: version x lesson (passes, seconds, the warnings shown), the machine
and the date (the figures in ``docs/compatibility.json``; ``--render`` writes the page again). ``pyproject.toml`` declares the range this shows.

Downloads: one torch wheel per version (and, from PyPI, its CUDA libraries: a few GB for
versions whose Linux wheel is the CUDA build); everything else comes from the local pins.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Runs a notebook's code cells in one namespace as a kernel would (each cell from a file of its
# own: TorchScript reads functions' source from disk), showing warnings as Jupyter does, and
# prints one JSON line per cell: its index, seconds, error (or null), the warnings it showed.
# Guarded: a lesson that starts processes with torch.multiprocessing (lesson 10) re-imports this
# script in each child (spawn), which must not run the notebook again.
RUNNER = "if __name__ == '__main__':\n" + textwrap.indent(textwrap.dedent('''
    import json, os, sys, time, traceback, warnings
    nb = json.load(open(sys.argv[1]))
    cells_dir = sys.argv[2]
    os.makedirs(cells_dir, exist_ok=True)
    shown = []
    def record(message, category, filename, lineno, file=None, line=None):
        shown.append(f"{category.__name__}: {str(message).splitlines()[0][:200]}")
    warnings.showwarning = record
    warnings.resetwarnings()
    warnings.simplefilter("default")                      # FutureWarning, UserWarning...: once per place
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")  # IPython's rule
    warnings.filterwarnings("ignore", category=PendingDeprecationWarning)
    warnings.filterwarnings("ignore", category=ImportWarning)
    if os.environ.get("COURSE_LEARNERS_COPY") == "1":
        import importlib.abc
        class LearnersCopy(importlib.abc.MetaPathFinder):
            """A learner's copy of the course (the bundle) has no course/references: the visible
            checks compare with the stored data, and any other use of a reference fails here."""
            def find_spec(self, name, path=None, target=None):
                if name == "course.references" or name.startswith("course.references."):
                    raise ModuleNotFoundError(f"No module named {name!r} in a learner's copy", name=name)
        sys.meta_path.insert(0, LearnersCopy())
    ns = {"__name__": "__main__"}
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for n, cell in enumerate(code):
        src = "".join(cell["source"])
        path = os.path.join(cells_dir, f"cell_{n:03d}.py")
        with open(path, "w") as f:
            f.write(src)
        shown.clear()
        start, error, undecided = time.time(), None, False
        for attempt in range(3):  # a speed check the machine left undecided: run again, as its message says
            try:
                exec(compile(src, path, "exec"), ns)
                error, undecided = None, False
                break
            except BaseException as exc:
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
                undecided = type(exc).__name__ == "SpeedUndecided"
                if not undecided:
                    break
        print("CELL " + json.dumps({"cell": n, "seconds": round(time.time() - start, 2), "error": error,
                                    "undecided": undecided, "warnings": sorted(set(shown))}), flush=True)
        if error and not undecided:
            sys.exit(1)
'''), "    ")


def accepted_range() -> tuple[str, str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    req = next(d for d in deps if re.match(r"torch\b", d))
    bounds = dict(re.findall(r"(>=|<)([\w.]+)", req))
    return bounds[">="], bounds["<"]


def pinned() -> str:
    for line in (ROOT / "requirements" / "lock.txt").read_text().splitlines():
        if line.startswith("torch=="):
            return line.split("==")[1].strip()
    raise RuntimeError("requirements/lock.txt pins no torch")


def default_versions() -> list[str]:
    """The lowest release the package accepts, the one the pins name, the newest below the cap that
    the package index offers, and every release the GPU acceptance ran on (:func:`gpu_versions`)."""
    low, cap = accepted_range()
    newest = _newest_below(cap) or pinned()
    return sorted(dict.fromkeys([_full(low), pinned(), newest, *gpu_versions()]), key=_key)


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


def gpu_versions(record: Path = ROOT / "benchmarks" / "results" / "acceptance-cuda.json") -> list[str]:
    """The torch releases inside the declared range that ``record`` (the GPU acceptance) ran on, local
    tag dropped (``2.11.0+cu130`` is ``2.11.0``): a release between the lowest and the pinned can break
    a lesson on every device (torch 2.11's ``F.batch_norm`` refuses an epsilon of 0, which 2.4 and 2.13
    take), and a failure on a GPU must be told from one of its torch."""
    if not record.exists():
        return []
    lessons = json.loads(record.read_text()).get("lessons", {})
    low, cap = accepted_range()
    found = {str(e.get("environment", {}).get("torch", "")).split("+")[0] for e in lessons.values()}
    return sorted((v for v in found if re.fullmatch(r"\d+\.\d+\.\d+", v)
                   and _key(_full(low)) <= _key(v) < _key(cap)), key=_key)


def _full(version: str) -> str:
    return version if version.count(".") >= 2 else version + ".0"


def _newest_below(cap: str) -> str | None:
    proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "torch"], capture_output=True, text=True)
    found = re.search(r"Available versions: (.*)", proc.stdout)
    if not found:
        return None
    ok = [v.strip() for v in found.group(1).split(",")
          if re.fullmatch(r"\d+\.\d+\.\d+", v.strip()) and _key(v.strip())[:2] < _key(cap)[:2]]
    return max(ok, key=_key) if ok else None


def _pip(python: Path, args: list[str], log: Path) -> None:
    with log.open("a") as f:
        f.write(f"$ pip {' '.join(args)}\n")
        f.flush()
        proc = subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *args], stdout=f,
                              stderr=subprocess.STDOUT, env={**os.environ, "PIP_CONSTRAINT": os.devnull})  # no machine-wide cap
    if proc.returncode:
        raise RuntimeError(f"pip {' '.join(args)[:200]} failed; its log: {log}")


def python_version(python: str) -> str:
    """``X.Y`` of the interpreter ``python``."""
    out = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def column(version: str, python: str = sys.executable) -> str:
    """A run's key: the torch version, with the Python named when it is not the one running this."""
    py = python_version(python)
    return version if py == "%d.%d" % sys.version_info[:2] else f"{version} (Python {py})"


def environment(version: str, base: Path, interpreter: str = sys.executable) -> Path:
    """A virtual environment with torch ``version`` and the course (kept between runs), made by
    ``interpreter`` (Colab's Python may be newer than this machine's default)."""
    key = column(version, interpreter)
    venv = base / ("torch-" + key.replace(" (Python ", "-py").rstrip(")"))
    python = venv / "bin" / "python"
    stamp = venv / ".ready"
    if stamp.exists():
        return python
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([interpreter, "-m", "venv", str(venv)], check=True)
    log = base / f"{venv.name}.log"
    _pip(python, ["install", "--quiet", f"torch=={version}", "setuptools>=70.1"], log)  # setuptools: to install the course
    keep = venv / "keep-torch.txt"
    keep.write_text(f"torch=={version}\n")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    needs = [d for d in deps if not re.match(r"torch\b", d)]
    # the notebook's own tools come from the pins (matplotlib, tqdm...); the package as Colab gets it
    _pip(python, ["install", "--quiet", "-c", str(keep), "--no-deps", "--no-build-isolation", "-e", str(ROOT)], log)
    _pip(python, ["install", "--quiet", "-c", str(keep), *needs], log)
    stamp.write_text(version + "\n")
    return python


def lesson_print(lesson_id: str) -> str:
    """A short fingerprint of the lesson as it is now (its instructor notebook): a figure made on
    another version of the lesson is not a figure of this one."""
    import hashlib

    source = ROOT / "solutions" / lesson_id / f"{lesson_id}.ipynb"
    return hashlib.sha256(source.read_bytes()).hexdigest()[:12]


def run_lesson(python: Path, lesson_id: str, work: Path, learners_copy: bool = True) -> dict:
    """``lesson_id`` run top to bottom by ``python`` as a learner who finished it runs it: the student
    version with the instructor's answers, and (``learners_copy``) without ``course/references``, as
    the bundle a class receives has none, so every visible check runs on its stored data."""
    from autograder.solution_code import solved_notebook

    work.mkdir(parents=True, exist_ok=True)
    nb = work / f"{lesson_id}.ipynb"
    nb.write_text(json.dumps(solved_notebook(lesson_id), indent=1, ensure_ascii=False))
    (work / "runner.py").write_text(RUNNER)
    cache = work / f"inductor-{lesson_id}"  # a learner's first run compiles from scratch: no warm cache
    shutil.rmtree(cache, ignore_errors=True)
    start = time.monotonic()
    proc = subprocess.run([str(python), str(work / "runner.py"), str(nb), str(work / f"cells-{lesson_id}")],
                          cwd=work, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "MPLBACKEND": "Agg", "COURSE_PROGRESS_FILE": str(work / "progress.json"),
                               "TORCHINDUCTOR_CACHE_DIR": str(cache),
                               "COURSE_LEARNERS_COPY": "1" if learners_copy else "0"})
    seconds = time.monotonic() - start
    cells = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("CELL ")]
    # A speed bar still undecided after three runs of its cell (a busy machine) is no pass, and
    # no failure either: reported, and the exercise is missing from the self-check's count.
    undecided = [c["cell"] for c in cells if c.get("undecided")]
    errors = [c for c in cells if c["error"] and not c.get("undecided")]
    passed = re.search(r"(\d+) of (\d+) exercises pass", proc.stdout)
    ok = (proc.returncode == 0 and not errors and passed is not None
          and int(passed.group(1)) + len(undecided) == int(passed.group(2)))
    from course.doctor import machine_name

    return {"ok": ok, "seconds": round(seconds, 1), "undecided": undecided, "lesson": lesson_print(lesson_id),
            "date": dt.date.today().isoformat(), "machine": machine_name(),
            "exercises": passed.group(0) if passed else None,
            "error": (f"cell {errors[0]['cell']}: {errors[0]['error']}" if errors else
                      None if ok else (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]),
            "warnings": sorted({w for c in cells for w in c["warnings"]})}


def markdown(results: dict, lessons: list[str], machine: str, date: str, current: dict | None = None) -> str:
    """The page. ``current``: each lesson's fingerprint now (:func:`lesson_print`); a figure made on
    another version of a lesson says so (and counts for nothing in the range's test)."""
    from course.lessons import catalog

    low, cap = accepted_range()
    versions = list(results)
    current = current or {}
    budgets = {item["id"]: item["cpu_budget_s"] for item in catalog()}
    lines = ["# Compatibility: the torch range, tested", "",
             f"Written by `make torch-matrix` (`benchmarks/torch_matrix.py`), last on {machine}, "
             f"{date}; each column names where and when it ran, Python {'%d.%d' % sys.version_info[:2]} unless a column names another. "
             f"`pyproject.toml` accepts torch>={low},<{cap}; the pins "
             f"(`requirements/lock.txt`) name {pinned()}. Each lesson ran top to bottom as a learner who "
             "finished it (the student version with the instructor's answers, in a learner's copy of the "
             "course: no `course/references`, so the visible checks compare with the stored data), with the warnings Jupyter "
             "would show; \"passes\" means every cell ran and the closing self-check found every exercise "
             "passing.", "",
             "| lesson | " + " | ".join(f"torch {v}" for v in versions) + " |",
             "|---|" + "---|" * len(versions)]
    for lesson in lessons:
        row = []
        for v in versions:
            r = results[v].get(lesson)
            if r is None:
                row.append("-")
            else:
                warn = f", {len(r['warnings'])} warning(s)" if r["warnings"] else ""
                open_ = f", speed undecided in {len(r['undecided'])} cell(s)" if r.get("undecided") else ""
                old = ("" if lesson not in current or r.get("lesson") == current[lesson] else
                       ", on an earlier version of the lesson" if r.get("lesson") else ", lesson version not recorded")
                slow = (f", over the lesson's {budgets[lesson]} s budget"
                        if lesson in budgets and r["seconds"] > budgets[lesson] else "")
                row.append(f"{'passes' if r['ok'] else 'FAILS'} ({r['seconds']:.0f} s{slow}{warn}{open_}{old})")
        lines.append(f"| {lesson} | " + " | ".join(row) + " |")
    lines += ["", "## What a learner sees", ""]
    for v in versions:
        lines.append(f"**torch {v}**")
        lines.append("")
        where = sorted({f"{r.get('machine', 'an earlier machine')}, {r.get('date', 'an earlier date')}"
                        for r in results[v].values()})
        lines.append(f"Ran on {'; '.join(where)}.")
        lines.append("")
        any_line = False
        for lesson in lessons:
            r = results[v].get(lesson)
            if not r:
                continue
            if r.get("error"):
                lines.append(f"- {lesson}: fails at {r['error']}")
                any_line = True
            for w in r["warnings"]:
                lines.append(f"- {lesson}: {w}")
                any_line = True
        if not any_line:
            lines.append("- no warning, no error")
        lines.append("")
    return "\n".join(lines)


def load(path: Path) -> dict:
    """The committed figures; those from before each run named its own machine and date get the
    page's."""
    saved = json.loads(path.read_text())
    for runs in saved["runs"].values():
        for r in runs.values():
            r.setdefault("machine", saved["machine"])
            r.setdefault("date", f"on or before {saved['date']}")
    return saved


def main() -> int:
    from course.doctor import machine_name
    from course.lessons import catalog

    ids = [item["id"] for item in catalog()]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--versions", nargs="+", default=None, help="default: lowest, pinned and newest accepted")
    ap.add_argument("--lesson", action="append", choices=ids, help="only these lessons (repeatable)")
    ap.add_argument("--base", type=Path, default=ROOT / ".torch-matrix", help="where the environments live")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "compatibility.md")
    ap.add_argument("--render", action="store_true", help="only write the page again from its .json")
    ap.add_argument("--fresh", action="store_true", help="forget the figures of versions not run this time")
    ap.add_argument("--python", default=sys.executable,
                    help="the interpreter the environments are made with (default: this one)")
    args = ap.parse_args()
    if args.render:
        saved = load(args.out.with_suffix(".json"))
        lessons = [i for i in ids if any(i in r for r in saved["runs"].values())]
        args.out.write_text(markdown(saved["runs"], lessons, saved["machine"], saved["date"],
                                     {i: lesson_print(i) for i in lessons}))
        return 0
    versions = args.versions or default_versions()
    lessons = args.lesson or ids
    args.base.mkdir(parents=True, exist_ok=True)
    # Versions not run this time keep their earlier figures (one version can be run again alone).
    saved = args.out.with_suffix(".json")
    results: dict[str, dict] = load(saved)["runs"] if saved.exists() and not args.fresh else {}
    today = dt.date.today().isoformat()

    def write() -> str:
        order = sorted(results, key=lambda v: tuple(int(p) for p in re.findall(r"\d+", v)))
        ordered = {v: results[v] for v in order}
        shown = [i for i in ids if any(i in r for r in ordered.values())]
        text = markdown(ordered, shown, machine_name(), today, {i: lesson_print(i) for i in shown})
        args.out.write_text(text)
        saved.write_text(json.dumps({"machine": machine_name(), "date": today, "runs": ordered}, indent=1) + "\n")
        return text

    for version in versions:
        key = column(version, args.python)
        print(f"torch {key}: preparing its environment", flush=True)
        python = environment(version, args.base, args.python)
        # a run of some lessons keeps the figures of the others on this version
        results[key] = dict(results.get(key, {})) if args.lesson else {}
        for lesson in lessons:
            r = run_lesson(python, lesson, args.base / "runs" / key.replace(" (Python ", "-py").rstrip(")"))
            results[key][lesson] = r
            write()
            print(f"  {lesson}: {'passes' if r['ok'] else 'FAILS'} in {r['seconds']:.0f} s"
                  f"{'; ' + r['error'] if r['error'] else ''}; {len(r['warnings'])} warning(s)", flush=True)
    print(write())
    return 0 if all(r["ok"] for v in versions for r in results[column(v, args.python)].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

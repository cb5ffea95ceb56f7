"""The acceptance of a platform in one command: every lesson graded at the device's sizes, its
benchmark run, and one summary of what was measured.

    make gpu-check                                                  # on a machine with a GPU
    python -m autograder acceptance --device cuda --record          # the same, by hand
    python -m autograder acceptance --device cpu --lesson 04_forward_ad --quick   # what CI runs

For each lesson, three submissions are graded by ``grade --device D`` (the sandbox, the judge,
the device's speed bars):

- the instructor's solution, which must earn every point (so every instructor notebook has run
  top to bottom at the device's sizes with every check passing);
- the untouched student version, which must earn nothing on any graded cell;
- one planted mistake (``PLANTED``), which must lose exactly the cells it breaks.

Then the lesson's benchmark runs at the device's size (``BENCHMARKS``). The summary
(``OUT/acceptance-<device>.md`` and ``.json``) names the device, torch and CUDA, and gives per
lesson the instructor run's seconds and peak memory, the three scores, and each speed bar beside
the ratio (its lower bound) the instructor's solution measured on this machine: the figures the
CUDA bars are set from. ``--record`` writes the benchmarks' results and the summary into
``benchmarks/results/`` to be committed, merged with what earlier runs recorded there: a GPU lease
of 15 minutes does not hold a whole acceptance (about 20), so ``--missing-only`` (the lessons not yet
accepted on this device) and ``--budget SECONDS`` (only the lessons whose recorded or default cost
fits) let successive leases complete it lesson by lesson. Exit status 0 only when every expectation
of the lessons run held.

Nothing here needs the network: it grades with the torch that is installed (``--prepare`` installs
only what is missing besides torch, for a GPU machine that comes with its own).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# One planted mistake per lesson: (anchor in the solution, replacement, the graded cells it must break).
PLANTED = {
    "01_custom_rnns": ("h = torch.where(alive, h_new, h)", "h = alive * h_new + (~alive) * h",
                       {"test_masked_lstm_layer"}),
    "02_fx_transforms": ("if len(conv_node.users) > 1:", "if len(conv_node.users) > 2:",
                         {"test_conv_bn_pairs", "test_fuse"}),
    "03_channels_last": ("return watcher.losses[0] if watcher.losses else None",
                         "return watcher.losses[-1] if watcher.losses else None", {"test_format_finder"}),
    "04_forward_ad": ("    return vmap(column, out_dims=1)(basis)", "    return vmap(column)(basis)",
                      {"test_jacobians"}),
    "05_jacobians_hessians": ("return jacfwd if n_out > x.numel() else jacrev",
                              "return jacrev if n_out > x.numel() else jacfwd",
                              {"test_pick_jacobian", "test_picker_speed"}),
    "06_vmap_ensembles": ("return F.cross_entropy(logits, y_i.unsqueeze(0))",
                          "return F.cross_entropy(logits, y_i.unsqueeze(0)) / x.shape[0]",
                          {"test_psg_vmap"}),
    "07_broadcasting_indexing_higher_order": ("    return out.index_add_(0, index, values)",
                                              "    out[index] += values\n    return out",
                                              {"test_segment_sum", "test_segment_speed"}),
    "08_profiling_trace_diff": ("            merge(clock(ev[1]), recorded.get(ev[2], {}))",
                                "            pass  # (the wait is ignored)", {"test_find_races"}),
    "09_attention_fast_paths": ("        hidden = hidden | key_padding_mask[:, None, None, :]",
                                "        hidden = hidden | key_padding_mask[:, None, :, None]", {"test_masked_attention"}),
    "10_data_parallel": ("        chunks[(rank - step - 1) % n].add_(received)",
                         "        chunks[(rank - step - 1) % n].copy_(received)", {"test_ring_all_reduce"}),
}

#: The benchmark of each lesson (benchmarks/<script>), run at the device's size.
BENCHMARKS = {
    "01_custom_rnns": "lstm.py",
    "02_fx_transforms": "fx_fusion.py",
    "03_channels_last": "channels_last.py",
    "04_forward_ad": "forward_ad.py",
    "05_jacobians_hessians": "jacobians.py",
    "06_vmap_ensembles": "vmap.py",
    "07_broadcasting_indexing_higher_order": "broadcasting.py",
    "08_profiling_trace_diff": "profiling.py",
    "09_attention_fast_paths": "fastpath.py",
    "10_data_parallel": "data_parallel.py",
}

SUBMISSIONS = ("perfect", "untouched", "planted")


def planted_notebook(lesson_id: str, solutions: Path = ROOT / "solutions") -> str:
    """The instructor's notebook (as text) with the lesson's planted mistake."""
    src = solutions / lesson_id / f"{lesson_id}.ipynb"
    text = src.read_text()
    old, new, _ = PLANTED[lesson_id]
    anchor = json.dumps(old)[1:-1]
    if anchor not in text:
        raise RuntimeError(f"{lesson_id}: the planted mistake's anchor is no longer in the solution: {old!r}")
    return text.replace(anchor, json.dumps(new)[1:-1])


def write_submissions(subs: Path, lesson_id: str) -> None:
    from autograder.solution_code import solved_notebook

    name = f"{lesson_id}.ipynb"
    texts = {"perfect": json.dumps(solved_notebook(lesson_id), indent=1),
             "untouched": (ROOT / "lessons" / lesson_id / name).read_text(),
             "planted": planted_notebook(lesson_id)}
    for student, text in texts.items():
        (subs / student / lesson_id).mkdir(parents=True, exist_ok=True)
        (subs / student / lesson_id / name).write_text(text)


def _rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def speed_figures(work: Path, lesson_id: str) -> list[dict]:
    """Each speed check of the instructor's run on this machine: its name, the bar, the lower bound
    of the ratio the instructor's solution measured (from the grader's trusted transcript), and
    whether that run left the bar unproven (missed, on this machine)."""
    import torch

    out = []
    for cache in sorted((work / "trusted").glob(f"{lesson_id}-*.pt")):
        data = torch.load(cache, weights_only=True)
        for grade_id, records in data["records"].items():
            for r in records:
                if isinstance(r.get("tol"), dict) and r["tol"].get("kind") == "at_least":
                    out.append({"cell": grade_id, "name": r["name"], "bar": r["expected"], "measured": r["actual"],
                                "unproven": grade_id in (data.get("unproven") or {})})
    return out


def errored_cells(graded: Path) -> list[str]:
    """Each cell of a graded notebook (the grader's autograded copy, in ``graded``) that raised: its
    number, its grade id or first line, and the error's first line."""
    out = []
    for notebook in sorted(graded.glob("*.ipynb")) if graded.is_dir() else []:
        for i, cell in enumerate(json.loads(notebook.read_text()).get("cells", [])):
            error = next((o for o in cell.get("outputs", []) if o.get("output_type") == "error"), None)
            if error is not None:
                lines = "".join(cell.get("source", "")).strip().splitlines() or ["(empty)"]
                name = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") or lines[0][:60]
                # the grader's traceback starts with the error's whole first line; a kernel's, with colour codes
                first = (error.get("traceback") or [""])[0]
                if not first or "\x1b" in first:
                    first = f"{error.get('ename')}: {error.get('evalue')}".rstrip(": ")
                out.append(f"cell {i} ({name}): {first.splitlines()[0][:240]}")
    return out


def check_lesson(lesson_id: str, grades: Path, cells: Path,
                 graded: Path | None = None) -> tuple[dict, list[str], list[str]]:
    """The three rows of a lesson, what did not hold, and what was left undecided: a speed bar that
    this machine was too busy to decide (measure again; never counted as holding). The instructor's
    solution must also run every cell without an error (``graded``: its autograded copy, which
    names them): on a GPU, lesson 4's earned every point with two cells raising."""
    rows = {r["student_id"]: r for r in _rows(grades) if r["lesson_id"] == lesson_id}
    scores: dict[str, dict[str, float]] = {}
    most: dict[str, float] = {}
    open_: set[tuple[str, str]] = set()
    for r in _rows(cells):
        if r["lesson_id"] == lesson_id:
            scores.setdefault(r["student_id"], {})[r["grade_id"]] = float(r["score"])
            if r.get("max_score"):
                most[r["grade_id"]] = float(r["max_score"])
            if r.get("verdict") == "undecided":
                open_.add((r["student_id"], r["grade_id"]))
    problems: list[str] = []
    for student in SUBMISSIONS:
        if student not in rows:
            problems.append(f"{lesson_id}/{student}: no row")
    if problems:
        return rows, problems, []
    undecided = [f"{lesson_id}/{s}: {g}: its speed bar was left undecided (a busy machine?); measure again"
                 for s, g in sorted(open_) if s != "untouched"]
    perfect, untouched, planted = (rows[s] for s in SUBMISSIONS)
    full = {g: most.get(g, s) for g, s in scores.get("perfect", {}).items()}
    unsettled = sum(full[g] for s, g in open_ if s == "perfect" and g in full)
    if perfect["status"] != "graded" or float(perfect["score"]) + unsettled != float(perfect["max_score"]):
        problems.append(f"{lesson_id}: the instructor's solution scored {perfect['score']} of {perfect['max_score']} "
                        f"({perfect['status']}; {perfect['detail']})")
    errors = int(float(perfect.get("cell_errors") or 0))
    if errors:
        named = errored_cells(graded) if graded is not None else []
        problems.append(f"{lesson_id}: the instructor's solution raised an error in {errors} cell(s) on this "
                        "device" + (": " + "; ".join(named) if named else ""))
    if float(untouched["score"]) != 0:
        problems.append(f"{lesson_id}: the untouched student version scored {untouched['score']}")
    broken = PLANTED[lesson_id][2]
    got = scores.get("planted", {})
    # A cell the mistake leaves alone must score as in full, unless the machine left it undecided.
    wrong = sorted(g for g in full if got.get(g) != (0.0 if g in broken else full[g])
                   and not (g not in broken and (("planted", g) in open_ or ("perfect", g) in open_)))
    if set(got) != set(full) or wrong:
        problems.append(f"{lesson_id}: the planted mistake should cost exactly {sorted(broken)}; cells off: {wrong}")
    return rows, problems, undecided


def _environment(device: str) -> dict:
    import torch

    from course.doctor import machine_name

    try:  # the course's version the run graded (a lesson changed since is worth running again)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"device": device, "machine": machine_name(), "torch": torch.__version__,
            "cuda": torch.version.cuda if device == "cuda" else None, "python": sys.version.split()[0],
            "date": dt.date.today().isoformat(), "commit": commit}


#: A lesson's cost (grading and benchmark, seconds) where no earlier run recorded one.
DEFAULT_COST = {"cuda": 240.0, "cpu": 300.0}


def recorded(device: str, folder: Path = ROOT / "benchmarks" / "results") -> dict:
    """The committed acceptance of ``device`` (``acceptance-<device>.json``), or an empty one."""
    path = folder / f"acceptance-{device}.json"
    if not path.exists():
        return {"environment": {}, "lessons": {}, "problems": []}
    return json.loads(path.read_text())


def accepted(entry: dict) -> bool:
    """Whether a lesson's record shows every expectation held (nothing failed, nothing undecided)."""
    return bool(entry.get("rows")) and not entry.get("problems") and not entry.get("undecided") \
        and entry.get("benchmark", {}).get("exit") in (0, None)


def plan(lessons: list[str], device: str, *, budget: float | None, earlier: dict,
         missing_only: bool) -> tuple[list[str], list[str]]:
    """The lessons to run now and those left for another run: with ``missing_only``, those not
    yet accepted on this device; with a ``budget`` (seconds), as many as their costs measured
    by earlier runs (or :data:`DEFAULT_COST`) fit, in order, a lesson too long for what is left
    giving way to a shorter one after it. A GPU lease is short: an acceptance
    spread over several leases completes lesson by lesson."""
    todo = [l for l in lessons if not (missing_only and accepted(earlier.get("lessons", {}).get(l, {})))]
    if budget is None:
        return todo, []
    run_now, left, spent = [], [], 0.0
    for lesson_id in todo:
        e = earlier.get("lessons", {}).get(lesson_id, {})
        cost = (e.get("grading_s", 0) + e.get("benchmark", {}).get("seconds", 0)) or DEFAULT_COST[device]
        if spent + cost <= budget:
            run_now.append(lesson_id)
            spent += cost
        else:
            left.append(lesson_id)
    return run_now, left


def merged(summary: dict, earlier: dict) -> dict:
    """This run's summary with the lessons an earlier recorded run accepted or tried and this one
    did not run (each lesson keeps the environment it ran in)."""
    lessons = {k: v for k, v in earlier.get("lessons", {}).items() if k not in summary["lessons"]}
    lessons.update(summary["lessons"])
    problems = [p for e in lessons.values() for p in e.get("problems", [])]
    problems += [p for p in summary.get("problems", []) if p not in problems]
    undecided = [u for e in lessons.values() for u in e.get("undecided", [])]
    undecided += [u for u in summary.get("undecided", []) if u not in undecided]
    return {**summary, "lessons": dict(sorted(lessons.items())), "problems": problems, "undecided": undecided}


def run(device: str, lessons: list[str], out: Path, *, quick: bool = False, record: bool = False,
        jobs: int = 1, sandbox: str = "auto", benchmarks: bool = True, budget: float | None = None,
        missing_only: bool = False) -> int:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        print("acceptance --device cuda: this machine has no CUDA GPU that torch can use "
              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}). Run it where "
              "`nvidia-smi` lists a GPU, or use --device cpu.", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    work, subs = out / "work", out / "submissions"
    bench_out = ROOT / "benchmarks" / "results" if record else out / "benchmarks"
    bench_out.mkdir(parents=True, exist_ok=True)
    from autograder.sandbox import choose_sandbox

    earlier = recorded(device) if (record or missing_only or budget is not None) else {"lessons": {}}
    lessons, left = plan(lessons, device, budget=budget, earlier=earlier, missing_only=missing_only)
    if left:
        print(f"acceptance: {', '.join(left)} left for another run (--budget {budget:g} s)", flush=True)
    env = {**_environment(device), "sandbox": choose_sandbox(sandbox)}
    summary = {"environment": env, "lessons": {}, "problems": [], "undecided": [], "left": left}
    for lesson_id in lessons:
        print(f"== {lesson_id}: grading the instructor's solution, the untouched and a planted version "
              f"(--device {device})", flush=True)
        write_submissions(subs, lesson_id)
        start = time.monotonic()
        graded = out / "grading" / lesson_id
        code, tail = _streamed([sys.executable, "-m", "autograder", "grade", str(subs), "--out", str(graded),
                                "--work", str(work), "--device", device, "--lesson", lesson_id, "--jobs", str(jobs),
                                "--sandbox", sandbox], out / "grading" / f"{lesson_id}.log")
        entry: dict = {"environment": env, "grading_s": round(time.monotonic() - start, 1), "problems": [],
                       "undecided": []}
        summary["lessons"][lesson_id] = entry
        if code != 0:
            entry["problems"].append(f"{lesson_id}: grading could not run: {tail}")
        else:
            rows, entry["problems"], entry["undecided"] = check_lesson(lesson_id, graded / "grades.csv",
                                                                       graded / "cells.csv",
                                                                       work / "autograded" / "perfect" / lesson_id)
            entry["rows"] = {s: {k: rows[s][k] for k in ("score", "max_score", "status", "seconds", "peak_rss_mb")}
                             for s in SUBMISSIONS if s in rows}
            entry["speed"] = speed_figures(work, lesson_id)
        if not benchmarks:
            entry["benchmark"] = {"script": BENCHMARKS[lesson_id], "exit": None, "seconds": 0}
            _write(summary, out, record, earlier)
            continue
        print(f"== {lesson_id}: benchmark {BENCHMARKS[lesson_id]}", flush=True)
        args = [sys.executable, str(ROOT / "benchmarks" / BENCHMARKS[lesson_id]), "--device", device,
                "--out", str(bench_out)]
        if quick:
            args += ["--rounds", "3", "--min-run-time", "0.05"]
        start = time.monotonic()
        bench = subprocess.run(args, cwd=ROOT, text=True, capture_output=True)
        entry["benchmark"] = {"script": BENCHMARKS[lesson_id], "exit": bench.returncode,
                              "seconds": round(time.monotonic() - start, 1)}
        if bench.returncode != 0:
            entry["problems"].append(f"{lesson_id}: benchmarks/{BENCHMARKS[lesson_id]} failed: "
                                     f"{(bench.stderr or bench.stdout)[-800:]}")
        _write(summary, out, record, earlier)  # after every lesson: a run stopped midway keeps what it measured
    _write(summary, out, record, earlier)
    print(markdown(merged(summary, earlier) if record else _totals(summary)))
    return 0 if not _totals(summary)["problems"] else 1


def _totals(summary: dict) -> dict:
    return merged(summary, {"lessons": {}})


def _streamed(argv: list[str], log: Path) -> tuple[int, str]:
    """Run ``argv``, its output shown as it comes (indented) and kept in ``log``: a run cut short
    (a GPU lease that ends) still shows how far grading got. Returns the exit status and the
    output's last 3,000 characters."""
    log.parent.mkdir(parents=True, exist_ok=True)
    tail = ""
    with log.open("w", encoding="utf-8") as keep:
        proc = subprocess.Popen(argv, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for line in proc.stdout:
            keep.write(line)
            keep.flush()
            print("   " + line, end="", flush=True)
            tail = (tail + line)[-3000:]
        code = proc.wait()
    return code, tail


def _write(summary: dict, out: Path, record: bool, earlier: dict | None = None) -> None:
    """This run's summary into ``out``; with ``record``, merged with the earlier recorded one into
    ``benchmarks/results/`` (lessons accepted in earlier leases are kept)."""
    device = summary["environment"]["device"]
    targets = [(out, _totals(summary))]
    if record:
        targets.append((ROOT / "benchmarks" / "results", merged(summary, earlier or {"lessons": {}})))
    for folder, data in targets:
        (folder / f"acceptance-{device}.json").write_text(json.dumps(data, indent=1) + "\n")
        (folder / f"acceptance-{device}.md").write_text(markdown(data))


def _bench_cell(bench: dict) -> str:
    if bench["exit"] is None:
        return "not run (--no-benchmarks)"
    return f"{'ok' if bench['exit'] == 0 else 'failed'} ({bench['seconds']} s)"


def markdown(summary: dict) -> str:
    env = summary["environment"]
    lines = [f"# Acceptance on {env['device']}", "",
             f"Latest run: {env['machine']}, torch {env['torch']}" + (f", CUDA {env['cuda']}" if env.get("cuda") else "") +
             f", Python {env['python']}, {env['date']}, sandbox {env.get('sandbox', '?')}; each lesson's row says "
             "when and with which torch it ran. "
             "Written by `python -m autograder acceptance`.", "",
             "| lesson | accepted | run on | instructor run | peak memory | perfect | untouched | planted | benchmark |",
             "|---|---|---|---|---|---|---|---|---|"]
    for lesson_id, e in summary["lessons"].items():
        rows = e.get("rows", {})
        score = lambda s: f"{rows[s]['score']}/{rows[s]['max_score']}" if s in rows else "-"  # noqa: E731
        perfect = rows.get("perfect", {})
        bench = e.get("benchmark", {"exit": None})
        where = e.get("environment", env)
        lines.append(f"| {lesson_id} | {'yes' if accepted(e) else '**no**'} | {where.get('date', '?')}, "
                     f"torch {where.get('torch', '?')}, commit {where.get('commit') or '?'} | {perfect.get('seconds', '-')} s | "
                     f"{perfect.get('peak_rss_mb', '-')} MB | {score('perfect')} | {score('untouched')} | "
                     f"{score('planted')} | {_bench_cell(bench)} |")
    lines += ["", "## Speed bars against what the instructor's solution measured here", "",
              "| lesson | check | bar | measured (lower bound) | margin |", "|---|---|---|---|---|"]
    for lesson_id, e in summary["lessons"].items():
        for s in e.get("speed", []):
            measured = s["measured"]
            margin = f"{measured / s['bar']:.2f}x" if isinstance(measured, float) and s["bar"] else "-"
            shown = (f"{measured:.2f}x" if isinstance(measured, float) else "-") + (" (missed here)" if s.get("unproven") else "")
            lines.append(f"| {lesson_id} | {s['name']} | {s['bar']:.2f}x | {shown} | {margin} |")
    lines += ["", "## What did not hold", ""]
    lines += [f"- {p}" for p in summary["problems"]] or (
        ["Nothing failed; some speed bars were left undecided (below)."] if summary.get("undecided")
        else ["Nothing: every expectation held."])
    if summary.get("undecided"):
        lines += ["", "## Left undecided (not a pass: measure again, on a quieter machine)", ""]
        lines += [f"- {u}" for u in summary["undecided"]]
    from course.lessons import catalog

    missing = [item["id"] for item in catalog() if not accepted(summary["lessons"].get(item["id"], {}))]
    if missing:
        lines += ["", "## Not yet accepted on this device", "",
                  f"{', '.join(missing)}. Next: `python -m autograder acceptance --device {env['device']} --record "
                  "--missing-only --budget SECONDS` (a lease at a time)."]
    return "\n".join(lines) + "\n"


#: Not carried to a GPU machine as wheels: torch and what comes with it (the machine has its own),
#: the JupyterLab and Notebook front ends, their extensions' builder and translations and plotly
#: (grading imports none of them), the browser test's driver. What is left fits one lease's carry
#: (64 MiB with the repository: the third GPU run carried 41 MB of wheels).
NOT_CARRIED = re.compile(r"^(torch|triton|nvidia-.*|jupyterlab|notebook|widgetsnbextension|jupyter-builder|babel|"
                         r"plotly|playwright)$")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def carried_pins(lock: Path = ROOT / "requirements" / "lock.txt") -> list[str]:
    """The lock's exact pins that a GPU machine without network may lack: the wheels to carry."""
    pins = [line.strip() for line in lock.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return [p for p in pins if not NOT_CARRIED.match(_norm(p.split("==")[0]))]


def _names(listing: str) -> set[str]:
    """Distribution names from ``pip freeze`` or ``pip list`` output, or names separated by commas."""
    names = set()
    for line in listing.replace(",", "\n").splitlines():
        token = re.split(r"[=<>~!@ (]", line.strip(), maxsplit=1)[0]
        if token and not token.startswith(("#", "-")) and token.lower() != "package":
            names.add(_norm(token))
    return names


def download_wheels(folder: Path, python: str, have: Path | None = None) -> int:
    """On a machine with network: the carried pins as wheels for CPython ``python`` on x86-64
    Linux, into ``folder``, for ``--prepare --wheels`` on a GPU machine that has none. ``have``: the
    GPU machine's ``pip freeze`` (or ``pip list``); what it lists is left out (it keeps its own)."""
    folder.mkdir(parents=True, exist_ok=True)
    skip = _names(have.read_text()) if have else set()
    pins = [p for p in carried_pins() if _norm(p.split("==")[0]) not in skip]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as req:
        req.write("\n".join(pins) + "\n")
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", "-d", str(folder), "-r", req.name]
    cmd += [x for p in PLATFORMS for x in ("--platform", p)]
    code = subprocess.run(cmd).returncode
    if code == 0:
        size = sum(f.stat().st_size for f in folder.glob("*.whl")) / 2**20
        print(f"{len(list(folder.glob('*.whl')))} wheels ({size:.0f} MB) in {folder}: carry them to the GPU machine, "
              f"then: python -m autograder acceptance --prepare --wheels {folder}")
    return code


def wheels_to_install(folder: Path) -> list[Path]:
    """The wheels in ``folder`` whose distribution is not installed here (one per name)."""
    import importlib.metadata as md

    out, seen = [], set()
    for wheel in sorted(folder.glob("*.whl")):
        name = _norm(wheel.name.split("-")[0])
        if name in seen:
            continue
        seen.add(name)
        try:
            md.version(name)
        except md.PackageNotFoundError:
            out.append(wheel)
    return out


def prepare(wheels: Path | None = None) -> int:
    """Install what the course needs besides torch, keeping the torch this machine has (GPU
    machines come with their own): the package itself without dependencies, then each missing one,
    from the package index or, with ``wheels``, from that folder alone (a machine with no network)."""
    import importlib.metadata as md
    import tomllib

    try:
        torch_version = md.version("torch")
    except md.PackageNotFoundError:
        print("acceptance --prepare: no torch here; install the one for this machine first (pytorch.org).",
              file=sys.stderr)
        return 2
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wanted = data["project"]["dependencies"] + data["project"]["optional-dependencies"]["grading"]
    missing = []
    for req in wanted:
        name = re.match(r"[A-Za-z0-9_.-]+", req).group()
        if name == "torch":
            continue
        try:
            md.version(name)
        except md.PackageNotFoundError:
            missing.append(req)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as keep:
        keep.write(f"torch=={torch_version}\n")
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "-c", keep.name]
    if wheels is not None:
        if not wheels.is_dir():
            print(f"acceptance --prepare --wheels: no folder {wheels}; make it where there is network with "
                  "python -m autograder acceptance --download-wheels FOLDER --python-version X.Y", file=sys.stderr)
            return 2
        found = wheels_to_install(wheels)
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps"]
        steps = ([pip + [str(w) for w in found]] if found else []) + \
            [pip + ["--no-build-isolation", "-e", str(ROOT)]]
        missing = [w.name for w in found]
    else:
        steps = [pip + ["--no-deps", "--no-build-isolation", "-e", str(ROOT)]] + ([pip + missing] if missing else [])
    for step in steps:
        if subprocess.run(step).returncode:
            return 2
    print(f"ready: torch {torch_version} kept; installed {len(missing)} missing package(s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    from course.lessons import catalog

    ids = [item["id"] for item in catalog()]
    parser = argparse.ArgumentParser(prog="python -m autograder acceptance", description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--lesson", action="append", choices=ids, help="only these lessons (repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="folder for everything (default: a new one in /tmp)")
    parser.add_argument("--quick", action="store_true", help="benchmarks with few, short rounds (for tests)")
    parser.add_argument("--record", action="store_true", help="write results into benchmarks/results/")
    parser.add_argument("--jobs", type=int, default=1, help="submissions graded at once (default 1)")
    parser.add_argument("--sandbox", choices=("auto", "bwrap", "none"), default="auto",
                        help="passed to grade (default auto: bubblewrap where it works)")
    parser.add_argument("--no-benchmarks", action="store_true", help="grade only; run no benchmark")
    parser.add_argument("--missing-only", action="store_true",
                        help="only the lessons the recorded acceptance of this device has not accepted yet")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="start only the lessons that fit in SECONDS (costs from the recorded acceptance)")
    parser.add_argument("--prepare", action="store_true", help="install what is missing besides torch, then exit")
    parser.add_argument("--wheels", type=Path, default=None,
                        help="with --prepare: install from this folder of wheels only (a machine with no network)")
    parser.add_argument("--download-wheels", type=Path, default=None, metavar="FOLDER",
                        help="download the wheels a GPU machine without network needs into FOLDER, then exit")
    parser.add_argument("--python-version", default="3.12", help="with --download-wheels: the GPU machine's Python")
    parser.add_argument("--have", type=Path, default=None,
                        help="with --download-wheels: the GPU machine's `pip freeze`; what it has is not downloaded")
    args = parser.parse_args(argv)
    if args.download_wheels:
        return download_wheels(args.download_wheels, args.python_version, args.have)
    if args.prepare:
        return prepare(args.wheels)
    out = args.out or Path(tempfile.mkdtemp(prefix=f"acceptance-{args.device}-"))
    return run(args.device, args.lesson or ids, out, quick=args.quick, record=args.record, jobs=args.jobs,
               sandbox=args.sandbox, benchmarks=not args.no_benchmarks, budget=args.budget,
               missing_only=args.missing_only)


if __name__ == "__main__":
    sys.exit(main())

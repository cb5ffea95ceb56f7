"""The lessons end to end: the instructor notebooks run top to bottom with every test passing,
within their time and memory budgets; lessons/ is exactly what nbgrader generates from
solutions/; and grading gives full marks to the solutions, zero on every graded test to the
untouched student versions, and takes exactly the broken checks' points from a planted mistake."""

from __future__ import annotations

import csv
import functools
import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from autograder import acceptance, runtimes
from autograder.solution_code import solved_notebook
from course import cells
from course.lessons import catalog

ROOT = Path(__file__).resolve().parents[1]
LESSON_IDS = [item["id"] for item in catalog()]

# One `grade` run serves the whole module: ten instructor transcripts and 28 submissions. On CI's 2-core
# machine it ran past 40 minutes once (2026-11-29: 40 of 48 graded when the limit struck, and the whole
# suite past CI's 90): a guard against a hang, not a budget. Each submission costs a lesson's run, so
# faults that touch cells of their own share one, and the instructor's notebook is graded again as a
# submission only where the planted mistake hides a speed verdict's right answer (PERFECT_LESSONS);
# elsewhere the transcript is that run (see test_instructors_run_...).
pytestmark = pytest.mark.timeout(3600)

# One planted mistake per lesson (shared with the acceptance command): (anchor, replacement, cells it breaks).
PLANTED = acceptance.PLANTED


def notebook(lesson_id: str, folder: str) -> Path:
    return ROOT / folder / lesson_id / f"{lesson_id}.ipynb"


def graded_cells(path: Path) -> dict[str, float]:
    nb = json.loads(path.read_text())
    return {cells.grade_id(c): cells.points(c) for c in nb["cells"] if cells.is_test(c)}


def read_csv(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def expect_cells(got: dict[str, float], want: dict[str, float], undecided: set[str], speed: set[str],
                 why: Callable[[str], str] = lambda grade_id: "") -> None:
    """``got`` is ``want``, cell by cell, except where a busy machine left a speed bar undecided:
    such a cell must be a speed cell, and earns nothing (it is measured again by the next run).
    A positive test that needed a quiet machine would fail CI for the machine's sake. ``why(cell)``:
    what the feedback said about a cell, for the failure's message (CI keeps nothing else)."""
    assert undecided <= speed, f"undecided cells that have no speed bar: {sorted(undecided - speed)}"
    assert set(got) == set(want), (sorted(got), sorted(want))
    off = {g: (got[g], want[g]) for g in want if got[g] != (0.0 if g in undecided else want[g])}
    said = "".join(f"\n--- {g}: {why(g)}" for g in off)
    assert not off, f"cells off (got, want): {off}; undecided: {sorted(undecided)}{said}"


@pytest.mark.parametrize("lesson_id", LESSON_IDS)
def test_catalog_points_and_committed_notebooks_agree(lesson_id):
    item = next(x for x in catalog() if x["id"] == lesson_id)
    for folder in ("solutions", "lessons"):
        path = notebook(lesson_id, folder)
        assert path.exists(), f"{path} is missing"
        nb = json.loads(path.read_text())
        assert all(not c.get("outputs") and not c.get("execution_count") for c in nb["cells"]
                   if c["cell_type"] == "code"), f"{path} is committed with outputs"
    assert sum(graded_cells(notebook(lesson_id, "solutions")).values()) == item["points"]
    assert lesson_id in (ROOT / "README.md").read_text(), "the README's lessons table misses this lesson"


@pytest.mark.parametrize("lesson_id", LESSON_IDS)
def test_the_introduction_states_the_lessons_real_count_of_graded_cells_and_points(lesson_id):
    """"**Grading**: 9 exercises, 14 points" in a lesson's first cell is what its graded cells add up to."""
    import re

    nb = json.loads(notebook(lesson_id, "solutions").read_text())
    found = re.search(r"\*\*Grading\*\*: (\d+) (?:exercises|graded cells), (\d+) points", nb["cells"][0]["source"])
    assert found, "the introduction should say how many graded cells and points the lesson has"
    points = graded_cells(notebook(lesson_id, "solutions"))
    assert (int(found[1]), float(found[2])) == (len(points), sum(points.values())), found[0]


@pytest.mark.parametrize("lesson_id", LESSON_IDS)
def test_student_version_hides_solutions_and_hidden_tests(lesson_id):
    text = notebook(lesson_id, "lessons").read_text()
    for marker in ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS"):
        assert marker not in text
    assert "raise NotImplementedError()" in text


@pytest.mark.notebooks
def test_release_regenerates_exactly_the_committed_lessons(tmp_path):
    out = tmp_path / "lessons"
    subprocess.run([sys.executable, "-m", "autograder", "release", "--lessons", str(out), "--work",
                    str(tmp_path / "work")], check=True, cwd=ROOT)
    committed = sorted(p.relative_to(ROOT / "lessons") for p in (ROOT / "lessons").rglob("*") if p.is_file())
    regenerated = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert regenerated == committed, "lessons/ and solutions/ list different files: run `make release`"
    for rel in committed:
        assert (out / rel).read_bytes() == (ROOT / "lessons" / rel).read_bytes(), (
            f"lessons/{rel} differs from what solutions/ generates: run `make release` and commit")


ATTACK = """import sys, os, glob, time, torch
for name, module in list(sys.modules.items()):           # make every local comparison pass
    if name.startswith("course") and hasattr(module, "assert_close"):
        module.assert_close = lambda *args, **kwargs: None
torch.allclose = lambda *args, **kwargs: True
time.perf_counter = lambda: 0.0
GRADED = "NBGRADER_EXECUTION" in os.environ               # branch on being graded
for pattern in ("/*/solutions/*/*.ipynb", "/*/*/solutions/*/*.ipynb", "/*/.autograder/gradebook.db",
                "../../solutions/*/*.ipynb"):
    found = glob.glob(pattern)                              # look for instructor files
for path in ("/work/main/solutions/01_custom_rnns/01_custom_rnns.ipynb", "../gradebook.db"):
    try:
        open(path).read()
    except OSError:
        pass
try:
    get_ipython().set_custom_exc((Exception,), lambda *a, **k: None)
except NameError:
    pass
"""


def hostile(path: Path) -> dict:
    """The untouched student version, plus: every test cell emptied, a test cell duplicated,
    and a first cell that patches comparisons, torch and time, looks for the grader's files and
    hooks error reporting. It must score 0 and be named."""
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cells.is_test(cell):
            cell["source"] = "pass"
    first_test = next(c for c in nb["cells"] if cells.is_test(c))
    nb["cells"].append(json.loads(json.dumps(first_test)))
    nb["cells"].insert(0, {"cell_type": "code", "id": "attack", "metadata": {}, "outputs": [],
                           "execution_count": None, "source": ATTACK})
    return nb


#: The lesson whose planted mistake also hides behind patched checks (one is enough: each costs a run).
PATCHED_LESSON = "01_custom_rnns"

#: An answer by the naive formula: right numbers, but slow (its speed cell must fail and say why in the
#: feedback, issue 15) and not the fused kernel Exercise 3 asks for (that cell fails too, since version 47).
SLOW_LESSON = "08_profiling_trace_diff"
SLOW = ("    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)",
        "    return naive_attention(q, k, v, causal)")


def slow_notebook(text: str) -> str:
    old, new = (json.dumps(x)[1:-1] for x in SLOW)
    assert old in text, "the slow answer's anchor is gone from the solution"
    return text.replace(old, new)


#: Served checks of PATCHED_LESSON that rest partly on the learner's process's word (a course probe runs
#: there, and reports what it saw: the recurrent ops a cell or layer called): once the patching is
#: found, their cells are set aside too. (check_bucketed is not one: the layer it lends stays in the judge.
#: check_compiled_layer is one: the ops its compiled code ran are read there.)
PROBING = ("check_lstm_cell(", "check_lstm_layer(", "check_stacked_lstm(", "check_masked_lstm_layer(",
           "check_compiled_layer(")


def _judged_alone(text: str) -> bool:
    """A served cell whose verdict the judge reaches without the learner's process's word."""
    from autograder.program import is_served

    return is_served(text) and not any(p in text for p in PROBING)


def patched(src: Path) -> tuple[dict, float]:
    """The planted mistake, with the checks' comparisons patched away in the same cell. The seal
    marks everything from that cell on: a check that runs in the learner's process earns nothing
    from there, nor does a served one that uses a probe (the patched process reports to it); a
    served one judged in the judge alone (which the patching cannot reach) is judged as usual: the
    mistake's own check fails, the others pass."""
    old, new, broken = PLANTED[PATCHED_LESSON]
    nb = json.loads(src.read_text())
    earned, seen = 0.0, False
    for cell in nb["cells"]:
        text = cells.source(cell)
        if old in text:
            cell["source"] = text.replace(old, new) + "\n" + ATTACK
            seen = True
        elif cells.is_test(cell) and (not seen or (_judged_alone(text) and cells.grade_id(cell) not in broken)):
            earned += cells.points(cell)
    assert seen
    return nb, earned


def patched_points(nb: dict) -> dict[str, float]:
    """Per graded cell of ``patched``'s notebook, the points it earns (see there)."""
    old, new, broken = PLANTED[PATCHED_LESSON]
    out, seen = {}, False
    for cell in nb["cells"]:
        text = cells.source(cell)
        if new in text and ATTACK in text:
            seen = True
        if cells.is_test(cell):
            keeps = not seen or (_judged_alone(text) and cells.grade_id(cell) not in broken)
            out[cells.grade_id(cell)] = cells.points(cell) if keeps else 0.0
    return out


#: Exercises answered by calling the course's own references: (grade id of the solution cell, the
#: answer, the graded cell that must lose its points). Every other cell keeps the solution's points.
BORROWED = {
    # lesson 1's reference is the grader's alone: the learner's sandbox has no course/references
    "01_custom_rnns": ("layer_norm_lstm_cell",
                       "def layer_norm_lstm_cell(x, h, c, p):\n"
                       "    from course.references.rnn import layer_norm_lstm_cell_reference as ref\n"
                       "    return ref(x, (h, c), p)\n",
                       "test_layer_norm_cell"),
    # so are lessons 2-7's (lessons 6 and 7 tried here): the import itself fails in the sandbox
    "06_vmap_ensembles": ("dp_sgd",
                          "from course.references.vmap import dp_sgd_reference as dp_sgd_step\n",
                          "test_dp_sgd"),
    "07_broadcasting_indexing_higher_order": ("segment_max",
                                              "from course.references.broadcasting import segment_max_reference as "
                                              "segment_max\n", "test_segment_max"),
    # lesson 8's references serve its own cells as demonstrations, but never as an answer
    "08_profiling_trace_diff": ("find_races", "from course.streams import sanitizer_races as find_races\n",
                                "test_find_races"),
    # lesson 9's truth about the fast path is measured by a course helper, which is not an answer
    "09_attention_fast_paths": ("predict_fast_path", "from course.fastpath import fast_path_taken as predict_fast_path\n",
                                "test_fast_path_predictions"),
}


def borrowed(nb: dict, lesson_id: str) -> dict:
    grade_id, answer, _ = BORROWED[lesson_id]
    cells.find(nb["cells"], grade_id)["source"] = answer
    return nb


def borrowed_beside_the_mistake(lesson_id: str) -> bool:
    """Whether the borrowed answer rides in the planted mistake's submission: it does where the two
    touch different cells and break different checks (lesson 8's both touch find_races: apart)."""
    grade_id, _, lost = BORROWED[lesson_id]
    old, _, broken = PLANTED[lesson_id]
    return old not in cells.source(cells.find(solution_cells(lesson_id), grade_id)) and lost not in broken


@functools.cache
def solution_cells(lesson_id: str) -> tuple:
    """The cells of the lesson's solution notebook, read once (to look at, not to change)."""
    return tuple(json.loads(notebook(lesson_id, "solutions").read_text())["cells"])


def borrowed_student(lesson_id: str) -> str:
    return "mistake" if borrowed_beside_the_mistake(lesson_id) else "borrowed"


def mistake_losses(lesson_id: str) -> set[str]:
    """The graded cells the "mistake" submission loses: the planted mistake's, the borrowed answer's
    where it rides along, and the slow answer's speed cell in SLOW_LESSON (two faults in cells of
    their own, one run: each must cost its own cells exactly, and nothing of the other's). The slow
    answer is the naive formula, which Exercise 3's watch refuses as well as the speed cell."""
    lost = set(PLANTED[lesson_id][2])
    if lesson_id in BORROWED and borrowed_beside_the_mistake(lesson_id):
        lost.add(BORROWED[lesson_id][2])
    if lesson_id == SLOW_LESSON:
        lost |= {"test_attention", "test_attention_speed"}
    return lost


#: Lesson 10's answers run in worker processes: cheats that only a worker can try. A ring that sums
#: through the process group's own method around the byte counter and sends dummy chunks, a DDP answer
#: that reaches for the course's frames, and a comm hook that is right but patches the course in its
#: worker. Until grader version 45 the learner's workers ran them (the kernel's byte count, the workers'
#: audit hook and seal caught them); since version 46 the judge reads each program first and the
#: program host's workers run only what it let through: all three are refused by that reading, and no
#: worker of the learner's starts. The shift and the accumulation are right: they keep their points.
WORKER_LESSON = "10_data_parallel"
WORKER_CHEATS = {
    "ring_all_reduce": "def ring_all_reduce(tensor):\n"
                       "    rank, n = dist.get_rank(), dist.get_world_size()\n"
                       "    dist.group.WORLD.allreduce([tensor]).wait()\n"
                       "    chunk = torch.empty_like(tensor.chunk(n)[0])\n"
                       "    for _ in range(2 * (n - 1)):\n"
                       "        request = dist.isend(chunk.clone(), (rank + 1) % n)\n"
                       "        dist.recv(chunk, (rank - 1) % n)\n"
                       "        request.wait()\n",
    "train_ddp": "def train_ddp(model, inputs, targets, steps, lr):\n"
                 "    import sys\n"
                 "    sys._getframe(1).f_locals  # the course's worker: its seed, its counters\n",
    "fp16_hook": "def fp16_hook(state, bucket):\n"
                 "    import course.parallel\n"
                 "    course.parallel.train_full_batch = lambda *a, **k: None\n"
                 "    buffer = bucket.buffer()\n"
                 "    half = buffer.to(torch.float16).div_(dist.get_world_size())\n"
                 "    work = dist.all_reduce(half, async_op=True)\n"
                 "    return work.get_future().then(lambda f: f.value()[0].to(buffer.dtype))\n",
}
WORKER_CHEATS_LOSE = {"test_ring_all_reduce", "test_train_ddp", "test_fp16_hook"}


def worker_cheats(src: Path) -> dict:
    nb = json.loads(src.read_text())
    for cell in nb["cells"]:
        if cells.grade_id(cell) in WORKER_CHEATS:
            cell["source"] = WORKER_CHEATS[cells.grade_id(cell)]
    return nb


def said(row: dict) -> str:
    """A grades.csv row in full, as a failing assertion shows it (pytest cuts a dict short: CI once
    showed an "oom" row of lesson 5 without its detail)."""
    return "; ".join(f"{k}={v}" for k, v in row.items())


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """One `grade` run over, for each lesson with a planted mistake, the untouched student version
    and the mistake; the hostile, borrowed, workers, patched and perfect submissions where named."""
    tmp = tmp_path_factory.mktemp("grading")
    subs = tmp / "submissions"
    for lesson_id in LESSON_IDS:
        src = notebook(lesson_id, "solutions")
        if lesson_id in PLANTED:
            (subs / "untouched" / lesson_id).mkdir(parents=True)
            shutil.copy(notebook(lesson_id, "lessons"), subs / "untouched" / lesson_id / src.name)
            old, new, _ = PLANTED[lesson_id]
            text = src.read_text()
            assert json.dumps(old)[1:-1] in text, "the planted mistake's anchor is gone from the solution"
            text = text.replace(json.dumps(old)[1:-1], json.dumps(new)[1:-1])
            if lesson_id == SLOW_LESSON:
                text = slow_notebook(text)
            if lesson_id in BORROWED and borrowed_beside_the_mistake(lesson_id):
                text = json.dumps(borrowed(json.loads(text), lesson_id))
            (subs / "mistake" / lesson_id).mkdir(parents=True)
            (subs / "mistake" / lesson_id / src.name).write_text(text)
        if lesson_id in HOSTILE_LESSONS:
            (subs / "hostile" / lesson_id).mkdir(parents=True)
            (subs / "hostile" / lesson_id / src.name).write_text(json.dumps(hostile(notebook(lesson_id, "lessons"))))
        if lesson_id in BORROWED and borrowed_student(lesson_id) == "borrowed":
            (subs / "borrowed" / lesson_id).mkdir(parents=True)
            (subs / "borrowed" / lesson_id / src.name).write_text(json.dumps(borrowed(json.loads(src.read_text()), lesson_id)))
        if lesson_id == WORKER_LESSON:
            (subs / "workers" / lesson_id).mkdir(parents=True)
            (subs / "workers" / lesson_id / src.name).write_text(json.dumps(worker_cheats(src)))
        if lesson_id in PERFECT_LESSONS:  # as a learner who finished it has it: the student version, answered
            (subs / "perfect" / lesson_id).mkdir(parents=True)
            (subs / "perfect" / lesson_id / src.name).write_text(json.dumps(solved_notebook(lesson_id), indent=1))
        if lesson_id == PATCHED_LESSON:
            nb, _ = patched(src)
            (subs / "patched" / lesson_id).mkdir(parents=True)
            (subs / "patched" / lesson_id / src.name).write_text(json.dumps(nb))
    out = tmp / "out"
    proc = subprocess.run([sys.executable, "-m", "autograder", "grade", str(subs), "--out", str(out),
                           "--work", str(tmp / "work"), "--jobs", "2"], cwd=ROOT, capture_output=True, text=True)
    print(proc.stdout[-4000:], proc.stderr[-4000:])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return Graded(out, tmp / "work")


#: The instructor's answers graded as a submission (in the student version: the solutions notebook's hidden
#: tests would be flagged "edited-tests"), in the lessons whose planted mistake breaks a cell
#: whose verdict does more than compare records (speed judged against the instructor's run: lesson 5's
#: picker, lesson 7's segment sum): the right answer of every other cell earns its points beside the
#: mistake, these cells' right answers here (the picker was once called "implausible" on the
#: instructor's own notebook, and only this caught it).
PERFECT_LESSONS = ("05_jacobians_hessians", "07_broadcasting_indexing_higher_order")


#: The hostile submission (the untouched version, its tests emptied and duplicated, an attacking first cell)
#: in the lessons whose answers run in different places: lesson 1's probes in the learner's process,
#: lesson 6's checks all in the judge, lesson 10's workers. What it attacks (the seal, the audit hook,
#: the tests' sources, the grader's files) is the same in every lesson.
HOSTILE_LESSONS = ("01_custom_rnns", "06_vmap_ensembles", "10_data_parallel")


class Graded:
    """What the module's one `grade` run wrote: rows by (student, lesson), cell scores, the cells
    left undecided, and each lesson's speed cells (from the instructor's transcripts)."""

    def __init__(self, out: Path, work: Path):
        self.out, self.work = out, work
        self.rows = {(r["student_id"], r["lesson_id"]): r for r in read_csv(out / "grades.csv")}
        self.cells: dict[tuple[str, str], dict[str, float]] = {}
        self.undecided: dict[tuple[str, str], set[str]] = {}
        self.reasons: dict[tuple[str, str, str], str] = {}
        for r in read_csv(out / "cells.csv"):
            key = (r["student_id"], r["lesson_id"])
            self.cells.setdefault(key, {})[r["grade_id"]] = float(r["score"])
            self.reasons[(*key, r["grade_id"])] = r["reason"]
            if r["verdict"] == "undecided":
                self.undecided.setdefault(key, set()).add(r["grade_id"])
        self.speed = {lesson_id: {f["cell"] for f in acceptance.speed_figures(work, lesson_id)} for lesson_id in LESSON_IDS}

    def expect(self, student: str, lesson_id: str, want: dict[str, float]) -> None:
        """The submission's cells are ``want``, but for speed cells the machine left undecided."""
        expect_cells(self.cells[(student, lesson_id)], want, self.undecided.get((student, lesson_id), set()),
                     self.speed[lesson_id], lambda cell: self.why(student, lesson_id, cell))

    def why(self, student: str, lesson_id: str, cell: str) -> str:
        """The cell's reason (cells.csv) and what its feedback page says after the cell's name."""
        pages = sorted((self.out / "feedback" / student / lesson_id).glob("*.html"))
        text = html.unescape(re.sub(r"<[^>]+>", " ", pages[0].read_text())) if pages else ""
        found = list(re.finditer(rf"{re.escape(cell)}:\s*[\d.]+\s*/\s*[\d.]+", text))  # the cell's own block
        said = " ".join(text[found[-1].start():found[-1].start() + 1500].split()) if found else "(not in the feedback)"
        return f"{self.reasons.get((student, lesson_id, cell), '')}: {said}"


@pytest.mark.notebooks
@pytest.mark.parametrize("lesson_id", LESSON_IDS)
def test_instructors_run_passes_every_check_in_the_sandbox_within_budget(graded, lesson_id):
    """The grade run's transcript of the instructor's notebook: run top to bottom in the sandbox and
    the judge, every graded check passing (a check it fails stops the grade run: nothing can be graded
    against it), within the lesson's time and memory budgets. That every cell's right answer also
    earns its points through the grader's verdict, the planted mistake shows (every cell it does not
    break keeps its points), and the acceptance command (tests/test_acceptance.py) grades a perfect
    notebook as a submission."""
    import torch

    item = next(x for x in catalog() if x["id"] == lesson_id)
    caches = sorted((graded.work / "trusted").glob(f"{lesson_id}-*.pt"))
    assert len(caches) == 1, caches
    data = torch.load(caches[0], weights_only=True)
    points = graded_cells(notebook(lesson_id, "solutions"))
    assert sum(points.values()) == item["points"]
    assert set(data["records"]) == set(points), (sorted(data["records"]), sorted(points))
    # A lesson that "ran" in almost no time did not run: the floor catches a silent skip.
    assert 5 < data["seconds"] < item["cpu_budget_s"], data["seconds"]
    assert 0 < data["peak_rss_mb"] < item["memory_budget_mb"], data["peak_rss_mb"]


@pytest.mark.notebooks
@pytest.mark.parametrize("lesson_id", PERFECT_LESSONS)
def test_the_instructors_notebook_as_a_submission_earns_every_point_unflagged(graded, lesson_id):
    row = graded.rows[("perfect", lesson_id)]
    assert row["status"] == "graded" and not row["flags"], said(row)
    graded.expect("perfect", lesson_id, graded_cells(notebook(lesson_id, "solutions")))


@pytest.mark.notebooks
def test_the_grade_run_drew_the_seeds_its_test_cells_name(graded):
    """Under the grader a test cell's seeds are drawn from the class's key (``course.checks.draw_seeds``):
    the perfect lesson 7 submission's graded notebook says which seed each broadcasting check used, and
    none is the one its cell names (0 in the visible call, 7 in the hidden one)."""
    lesson_id = "07_broadcasting_indexing_higher_order"
    graded_nb = graded.work / "autograded" / "perfect" / lesson_id / f"{lesson_id}.ipynb"
    outputs = [o.get("text", "") for c in json.loads(graded_nb.read_text())["cells"] for o in c.get("outputs", [])]
    text = "".join("".join(t) if isinstance(t, list) else t for t in outputs)  # nbformat keeps lines as lists
    seeds = [int(x) for x in re.findall(r"agrees with torch.broadcast_shapes on \d+ pairs.*?\(seed (\d+)\)", text)]
    assert len(seeds) == 2 and all(s >= 2 ** 20 for s in seeds), (seeds, text[-2000:])


@pytest.mark.notebooks
@pytest.mark.parametrize("lesson_id", sorted(PLANTED))
def test_untouched_student_version_gets_zero_on_every_graded_test(graded, lesson_id):
    row = graded.rows[("untouched", lesson_id)]
    assert row["status"] == "graded" and float(row["score"]) == 0, said(row)
    expected = graded_cells(notebook(lesson_id, "solutions"))
    assert set(graded.cells[("untouched", lesson_id)]) == set(expected)
    assert all(score == 0 for score in graded.cells[("untouched", lesson_id)].values())
    assert not graded.undecided.get(("untouched", lesson_id)), "a stub's speed check is failed, not undecided"


@pytest.mark.notebooks
@pytest.mark.parametrize("lesson_id", sorted(PLANTED))
def test_planted_mistake_loses_exactly_the_points_of_the_checks_it_breaks(graded, lesson_id):
    broken = mistake_losses(lesson_id)
    points = graded_cells(notebook(lesson_id, "solutions"))
    graded.expect("mistake", lesson_id, {k: 0.0 if k in broken else v for k, v in points.items()})
    assert float(graded.rows[("mistake", lesson_id)]["score"]) == sum(graded.cells[("mistake", lesson_id)].values())


@pytest.mark.notebooks
@pytest.mark.parametrize("lesson_id", HOSTILE_LESSONS)
def test_hostile_submission_scores_zero_and_is_named(graded, lesson_id):
    row = graded.rows[("hostile", lesson_id)]
    assert row["status"] == "graded" and float(row["score"]) == 0, said(row)
    flags = set(row["flags"].split(","))
    assert {"tampered", "patching", "edited-tests", "duplicate-ids", "grader-aware", "introspection",
            "probing"} <= flags, said(row)
    assert float(row["seconds"]) < 300, row  # it fails fast: nothing waits on a missing answer


@pytest.mark.notebooks
def test_mistake_behind_patched_checks_earns_only_the_cells_before_it(graded):
    nb, _ = patched(notebook(PATCHED_LESSON, "solutions"))
    row = graded.rows[("patched", PATCHED_LESSON)]
    assert row["status"] == "graded", said(row)
    graded.expect("patched", PATCHED_LESSON, patched_points(nb))
    assert "tampered" in row["flags"].split(","), said(row)


@pytest.mark.notebooks
def test_cheats_inside_lesson_10s_workers_earn_nothing_and_are_named(graded):
    row = graded.rows[("workers", WORKER_LESSON)]
    expected = graded_cells(notebook(WORKER_LESSON, "solutions"))
    graded.expect("workers", WORKER_LESSON, {k: 0.0 if k in WORKER_CHEATS_LOSE else v for k, v in expected.items()})
    for cell in sorted(WORKER_CHEATS_LOSE):
        assert "read by the grader" in graded.why("workers", WORKER_LESSON, cell), (cell, row)


@pytest.mark.notebooks
def test_a_slow_answer_loses_its_speed_cell_and_the_feedback_says_what_the_profiler_saw(graded):
    expected = graded_cells(notebook(SLOW_LESSON, "solutions"))
    got = graded.cells[("mistake", SLOW_LESSON)]  # beside the planted mistake, in a cell of its own
    lost = mistake_losses(SLOW_LESSON)
    assert "test_attention_speed" in lost and got["test_attention_speed"] == 0.0, got
    assert got["test_attention"] == 0.0, got  # the naive formula is not the fused kernel Exercise 3 asks for
    assert all(got[g] == p for g, p in expected.items() if g not in lost), got
    page = next((graded.out / "feedback" / "mistake" / SLOW_LESSON).glob("*.html")).read_text()
    assert "What the profiler saw your code run" in page, page[-3000:]
    assert "no aten::_scaled_dot_product_flash_attention_for_cpu ran" in page, page[-3000:]


@pytest.mark.notebooks
@pytest.mark.parametrize("lesson_id", sorted(BORROWED))
def test_answers_that_call_the_course_references_earn_nothing_and_are_named(graded, lesson_id):
    student = borrowed_student(lesson_id)
    row = graded.rows[(student, lesson_id)]
    lost = mistake_losses(lesson_id) if student == "mistake" else {BORROWED[lesson_id][2]}
    expected = graded_cells(notebook(lesson_id, "solutions"))
    graded.expect(student, lesson_id, {g: 0.0 if g in lost else p for g, p in expected.items()})
    if lesson_id in ("08_profiling_trace_diff", "09_attention_fast_paths"):  # references the lessons' cells use
        assert "uses-reference" in row["flags"].split(","), said(row)
    else:  # the grader's alone: the learner's process has no reference to call, nothing to flag
        assert "uses-reference" not in row["flags"].split(","), said(row)


@pytest.mark.parametrize("lesson_id", LESSON_IDS)
def test_every_graded_cell_runs_in_the_judge(lesson_id):
    """No graded check runs in the learner's process: every check a graded cell calls is declared
    SERVED by its lesson's check module (a new check that is not would be checked where learner
    code can reach it)."""
    from autograder import program as prog

    program = prog.instructor_program(lesson_id, notebook(lesson_id, "solutions"))
    assert program.graded, lesson_id
    assert all(c.served for c in program.graded), [c.grade_id for c in program.graded if not c.served]


@pytest.mark.parametrize("lesson_id", LESSON_IDS)
def test_no_later_cell_reads_a_name_only_a_served_test_cell_binds(lesson_id):
    """A served test cell runs in the judge: what it binds never exists in the learner's process,
    so a later cell that reads it (a plot of the check's report) would fail there."""
    import ast

    from autograder import program as prog

    program = prog.instructor_program(lesson_id, notebook(lesson_id, "solutions"))
    judge_only: set[str] = set()
    for cell in program.cells:
        if cell.kind == prog.TEST and cell.served:
            judge_only |= set(prog.bound_names(cell.source))
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        assert not (read & judge_only), f"{cell.id} reads {sorted(read & judge_only)}, bound only in the judge"
        judge_only -= set(prog.bound_names(cell.source))


@pytest.mark.notebooks
@pytest.mark.timeout(900)
@pytest.mark.parametrize("lesson_id", LESSON_IDS)
def test_a_learners_run_passes_shows_no_warning_and_takes_what_the_readme_says(lesson_id, tmp_path):
    """Each lesson as a learner who finished it runs it (every cell in one namespace, the closing
    self-check included, torch.compile's cache empty), on the pinned torch: every exercise passes,
    no warning reaches the learner, and the time is the README's (autograder/runtimes.py) within
    the noise of a shared machine. The same runner as ``make torch-matrix``."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch_matrix

    result = torch_matrix.run_lesson(Path(sys.executable), lesson_id, tmp_path)
    assert result["ok"], result
    assert result["warnings"] == [], result["warnings"]
    artifact = ROOT / "test-artifacts" / "lesson-runtimes.json"
    artifact.parent.mkdir(parents=True, exist_ok=True)
    measured = json.loads(artifact.read_text()) if artifact.exists() else {}
    artifact.write_text(json.dumps({**measured, lesson_id: result["seconds"]}, indent=1))
    recorded = next(x for x in catalog() if x["id"] == lesson_id).get("measured_s")
    assert recorded and result["seconds"] <= 2 * recorded + 30, (
        f"{lesson_id} took {result['seconds']:.0f} s; the README says {runtimes.text(recorded or 0)!r} "
        f"({recorded} s recorded): measure again (make torch-matrix) and record it (python -m autograder.runtimes).")

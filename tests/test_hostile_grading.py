"""Hostile and malformed submissions against the staging wall and the sandbox's resource walls.

Each case is a class of attack, not one trick: links of every kind (to the instructor's
notebook, to a classmate's folder, dangling, to /dev/zero), special files, JSON built to break
parsers, text that is not Unicode, oversized files, floods of output and of the grading pipe,
rebinding the checks. One ``grade --jobs 2`` run covers them all, next to controls that must
keep full marks; no case may cost another submission its row.
"""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path

import nbformat
import time

import pytest

from test_autograder import LESSON, NOTEBOOK, autograder, read_csv, solution_version, student_version, with_answer

from test_autograder import course  # noqa: F401 - the module-scoped toy course fixture

COURSE_DIR = Path(__file__).resolve().parents[1] / "course"

HUGE_INT = "1" * 5000


def _json(nb) -> str:
    return nbformat.writes(nb)


@pytest.fixture(scope="module")
def hostile(course, tmp_path_factory):  # noqa: F811
    subs = tmp_path_factory.mktemp("hostile")

    def folder(student):
        path = subs / student / LESSON
        path.mkdir(parents=True)
        return path

    def put(student, text=None, name=NOTEBOOK, raw=None):
        path = folder(student)
        if raw is not None:
            (path / name).write_bytes(raw)
        else:
            (path / name).write_text(text, encoding="utf-8")
        return path

    perfect = _json(solution_version(course))
    put("control", perfect)
    # links
    (folder("link_to_instructor") / NOTEBOOK).symlink_to(course["solutions"] / LESSON / NOTEBOOK)
    (subs / "linked_student").symlink_to(subs / "control")
    (subs / "linked_lesson").mkdir()
    (subs / "linked_lesson" / LESSON).symlink_to(subs / "control" / LESSON)
    beside = put("dangling_beside", perfect)
    (beside / "notes.txt").symlink_to(subs / "does-not-exist")
    beside = put("devzero_beside", perfect)
    (beside / "data.bin").symlink_to("/dev/zero")
    os.mkfifo(folder("fifo") / NOTEBOOK)
    # JSON built to break parsers
    put("deep", '{"cells": ' + "[" * 100_000 + "]" * 100_000 + ', "nbformat": 4}')
    put("huge_int", perfect.replace('"nbformat": 4', f'"nbformat": 4, "big": {HUGE_INT}', 1))
    nb = json.loads(perfect)
    nb["cells"][1]["metadata"]["nbgrader"] = "solution"
    put("string_metadata", json.dumps(nb))
    nb = json.loads(perfect)
    nb["cells"][1]["source"] = 42
    put("number_source", json.dumps(nb))
    nb = json.loads(perfect)
    nb["cells"] = {"not": "a list"}
    put("cells_not_list", json.dumps(nb))
    put("surrogate_source", perfect.replace("return a + b", "return a + b  # \\ud800", 1))
    put("nan_constant", perfect.replace('"nbformat": 4', '"nbformat": 4, "x": NaN', 1))
    put("oversize", raw=b'{"cells": [], "nbformat": 4, "pad": "' + b"x" * (33 * 2**20) + b'"}')
    put("not_utf8", raw=b"\xff\xfe" + perfect.encode("utf-16-le"))
    put("odd_name", perfect, name=os.fsdecode(b"odd-\xff-name.ipynb"))
    # floods and run-time surprises
    put("surrogate_output", _json(with_answer(solution_version(course), "add_solution",
                                              "def add(a, b):\n    print(chr(0xD800) * 3)\n    return a + b")))
    put("stdout_flood", _json(with_answer(solution_version(course), "add_solution",
                                          "import os\nfor _ in range(400):\n    os.write(1, b'x' * 2**20)\n"
                                          "def add(a, b):\n    return a + b")))
    put("pipe_flood", _json(with_answer(solution_version(course), "add_solution",
                                        "import os, sys, struct\nos.write(int(sys.argv[2]), struct.pack('>Q', 2**40))\n"
                                        "def add(a, b):\n    return a + b")))
    hidden = "assert_close(add(-5, 5), 0)"  # however a submission came to know it
    echo = with_answer(solution_version(course), "add_solution",
                       f"print({hidden!r})\ndef add(a, b):\n    raise ValueError({hidden!r})")
    # at the end, after every test cell ran: print every cell file the sandbox holds
    echo.cells.append(nbformat.v4.new_code_cell("import glob\nfor f in sorted(glob.glob('*.py')):\n"
                                                "    print(f, open(f).read())"))
    put("echo_hidden", _json(echo))
    rebind = student_version(course)
    rebind.cells.insert(3, nbformat.v4.new_code_cell("assert_close = lambda *a, **k: None"))
    put("rebinds_check", _json(rebind))

    out = tmp_path_factory.mktemp("hostile-out")
    proc = autograder("grade", subs, "--out", out, "--solutions", course["solutions"], "--work", course["work"],
                      "--cell-timeout", 20, "--timeout", 120, "--memory-mb", 1500, "--jobs", 2, check=False)
    rows = {r["student_id"]: r for r in read_csv(out / "grades.csv")} if (out / "grades.csv").exists() else {}
    return {"proc": proc, "rows": rows, "out": out}


INVALID = {
    "link_to_instructor": "symbolic link",
    "linked_student": "symbolic link",
    "linked_lesson": "symbolic link",
    "fifo": "named pipe",
    "deep": "nests JSON",
    "huge_int": "integer of 5000 digits",
    "string_metadata": "nbgrader metadata should be a JSON object",
    "number_source": "source should be text",
    "cells_not_list": "'cells' should be a list",
    "surrogate_source": "not valid Unicode",
    "nan_constant": "NaN",
    "oversize": "more than the 32 MB",
    "not_utf8": "not UTF-8",
}


def test_no_submission_costs_another_its_row(hostile):
    assert hostile["proc"].returncode == 0, hostile["proc"].stderr[-3000:]
    expected = {"control", "dangling_beside", "devzero_beside", "odd_name", "surrogate_output", "stdout_flood",
                "pipe_flood", "rebinds_check", "echo_hidden", *INVALID}
    assert set(hostile["rows"]) == expected, hostile["proc"].stdout[-3000:]


@pytest.mark.parametrize("student", sorted(INVALID))
def test_malformed_and_linked_submissions_are_invalid_with_a_reason(hostile, student):
    row = hostile["rows"][student]
    assert (row["status"], float(row["score"])) == ("invalid", 0), row
    assert INVALID[student] in row["detail"], row["detail"]


def test_controls_keep_full_marks_and_nothing_beside_the_notebook_is_read(hostile):
    for student in ("control", "dangling_beside", "devzero_beside", "odd_name", "surrogate_output"):
        row = hostile["rows"][student]
        assert (row["status"], float(row["score"])) == ("graded", 3), row
    assert "extra-files" in hostile["rows"]["devzero_beside"]["flags"]
    assert "odd-\\xff-name.ipynb" in hostile["rows"]["odd_name"]["detail"]
    html = (hostile["out"] / "feedback" / "surrogate_output" / LESSON / f"{LESSON}.html").read_text(encoding="utf-8")
    assert "add" in html


def test_floods_cost_only_their_own_submission(hostile, course):  # noqa: F811
    # The kernel's file size limit stops the flood (EFBIG in the flooding cell): that cell fails,
    # the next one is graded, and the log it wrote stays under the limit.
    flood = hostile["rows"]["stdout_flood"]
    assert (flood["status"], float(flood["score"])) == ("graded", 1), flood
    log = course["work"] / "logs" / "runs" / "stdout_flood" / f"{LESSON}.log"
    assert log.stat().st_size <= 256 * 2**20
    pipe = hostile["rows"]["pipe_flood"]
    assert pipe["status"] == "crashed" and "over the 64 MB limit" in pipe["detail"], pipe
    assert "tampered" in pipe["flags"]


def test_rebinding_a_check_changes_nothing(hostile):
    row = hostile["rows"]["rebinds_check"]
    assert float(row["score"]) == 0, row


def test_rows_are_on_disk_as_they_are_decided(hostile):
    text = (hostile["out"] / "grades.csv").read_text(encoding="utf-8")
    assert text.count("\n") == 1 + len(hostile["rows"])
    assert not list(hostile["out"].glob("*.tmp"))


# -- the sandbox's clocks and user ------------------------------------------------------------

def _cell(source, index=0):
    return {"index": index, "id": f"c{index}", "kind": "instructor", "source": source, "grade_id": ""}


def _turns_taken(monkeypatch) -> list[float]:
    """When each timing turn of the runs that follow was taken (TURNS.take answering yes)."""
    from autograder.sandbox import parent

    taken, take = [], parent.TURNS.take

    def counted(clock):
        got = take(clock)
        if got:
            taken.append(time.monotonic())
        return got

    monkeypatch.setattr(parent.TURNS, "take", counted)
    return taken


def _turn_holder(source: str) -> tuple[list[dict], list[str]]:
    """A program whose served test cell runs ``source`` in the judge (which takes the timing turn)."""
    setup = "import time, course.timing as t\n"
    return [{"index": 0, "id": "a", "kind": "instructor", "source": setup, "grade_id": ""},
            {"index": 1, "id": "b", "kind": "test", "source": source, "grade_id": "t", "served": True}], [setup]


def test_a_paused_submission_is_not_timed_out_by_a_classmates_timing_turn(tmp_path, monkeypatch):
    """A's check holds the machine for one measurement in its judge (8 s: a sleeping block is starved
    of CPU, so each of its 8 rounds is measured twice); B, paused meanwhile, has a 4 s cell with a
    6 s limit. Before, B's own alarm kept running while it was stopped and B timed out."""
    from autograder.sandbox import bwrap_works, run_program

    sandbox = "bwrap" if bwrap_works() else "none"
    holder = "t.compare({'a': lambda: time.sleep(0.5)}, rounds=8, warmup=0, min_run_time=0.0, progress=False)\n"
    sleeper = "import time\ntime.sleep(1.5)\nfor _ in range(5):\n    time.sleep(0.5)\nprint('done')\n"
    results, turns = {}, _turns_taken(monkeypatch)

    def run(name, cells, setup, limit):
        results[name] = run_program(cells, judge_setup=setup, sandbox=sandbox, cell_timeout=limit, timeout=120,
                                    memory_mb=2000, log=tmp_path / f"{name}.log")

    a = threading.Thread(target=run, args=("a", *_turn_holder(holder), 60))
    b = threading.Thread(target=run, args=("b", [_cell(sleeper)], [], 6))
    a.start()
    b.start()
    a.join()
    b.join()
    assert results["a"].status == "ok" and not results["a"].cells[1].error, results["a"]
    assert turns, "the judge's measurement never took the timing turn: B was never paused, and this proves nothing"
    assert results["b"].status == "ok", results["b"]
    assert not results["b"].cells[0].error and "done" in results["b"].cells[0].output, results["b"].cells[0]


TAKES_TURNS = """
import time, course.grader_hooks as hooks
held = 0.0
time.sleep({lead})
for _ in range({turns}):
    with hooks.exclusive():
        began = time.monotonic()
        time.sleep({hold})
        held += time.monotonic() - began
    time.sleep({gap})
print("held", held)
"""


def test_a_run_waiting_for_the_timing_turn_counts_the_wait_once(tmp_path, monkeypatch):
    """B's judge asks for the timing turn again and again while A's holds it for 1.5 s at a time. B's
    run waits in the queue, paused by A meanwhile: its clocks stop for the pause, once. Before, the
    parent's loop blocked on a lock while it waited and then also added the whole wait to B's paused
    time: B's limits were loosened by every wait, its reported seconds short by as much."""
    from autograder.sandbox import bwrap_works, parent, run_program

    sandbox = "bwrap" if bwrap_works() else "none"
    results, walls, waits, take = {}, {}, [], parent.TURNS.take

    def counted(clock):
        got = take(clock)
        if not got:
            waits.append(threading.current_thread().name)  # the run that waited
        return got

    monkeypatch.setattr(parent.TURNS, "take", counted)

    def run(name, source):
        cells, setup = _turn_holder(source)
        begun = time.monotonic()
        results[name] = run_program(cells, judge_setup=setup, sandbox=sandbox, cell_timeout=90, timeout=150,
                                    memory_mb=2000, log=tmp_path / f"{name}.log")
        walls[name] = time.monotonic() - begun

    a = threading.Thread(target=run, args=("a", TAKES_TURNS.format(lead=4, turns=8, hold=1.5, gap=0.3)), name="a")
    b = threading.Thread(target=run, args=("b", TAKES_TURNS.format(lead=0, turns=60, hold=0.2, gap=0)), name="b")
    a.start()
    time.sleep(1)
    b.start()
    a.join()
    b.join()
    for name in "ab":
        assert results[name].status == "ok" and not results[name].cells[1].error, results[name]
    assert "b" in waits, "B never waited for the timing turn: this proves nothing"
    held = float(results["a"].cells[1].output.split()[-1])  # A's turns, as A's judge timed them
    paused = walls["b"] - results["b"].seconds  # B's time taken off its clocks
    # Each of A's turns pauses B a little longer than A's judge times it (the freeze, the answer's and
    # the end's crossings); the wait counted twice took about 2 x held off B's clocks.
    assert paused <= held * 1.3 + 0.5, f"B's clocks stopped for {paused:.1f} s; A held the machine for {held:.1f} s"


def test_a_demonstration_in_the_learners_process_takes_no_timing_turn(tmp_path, monkeypatch):
    """No grade rests on a lesson's own timing cells (every graded check is timed in the judge), so
    they run beside classmates instead of pausing them all: the learner's process asks for no turn,
    the judge's check does."""
    from autograder.sandbox import bwrap_works, run_program

    sandbox = "bwrap" if bwrap_works() else "none"
    timing = "t.compare({'a': lambda: sum(range(1000))}, rounds=3, warmup=0, min_run_time=0.0, progress=False)\n"
    cells, setup = _turn_holder(timing)
    cells.insert(1, {**_cell(timing, 1), "id": "demo"})
    cells[2]["index"] = 2
    turns = _turns_taken(monkeypatch)
    out = run_program(cells, judge_setup=setup, sandbox=sandbox, cell_timeout=60, timeout=120, memory_mb=2000,
                      log=tmp_path / "log")
    assert out.status == "ok" and not out.cells[1].error and not out.cells[2].error, out
    assert len(turns) == 1, f"{len(turns)} timing turns: the demonstration's and the check's?"


ASKS_AND_NEVER_READS = """
import os, course.grader_hooks as hooks
# The learner's process's own channel to the parent (reached through a closure the course package
# holds), asked for the timing turn and a hold again and again; the answers are never read.
channel = next(c.cell_contents for c in hooks.observer.__closure__ if type(c.cell_contents).__name__ == "Channel")
encode = type(channel).send.__globals__["encode"]
turn, hold = (b"".join(encode({"token": channel._token, "kind": kind, "cell": 0}) for kind in pair)
              for pair in (("speed_begin", "speed_end"), ("hold", "release")))
for _ in range(800):
    os.write(channel._fd, turn * 100 + hold)  # 80,000 turns: answers past what a pipe holds (64 KiB)
print("asked")
"""


def test_a_learner_asking_for_turns_and_never_reading_stops_no_one(tmp_path):
    """The parent answers a request for the timing turn (GO) or refuses it (NO) on the requester's
    pipe. A learner's process that asks without end and never reads its answers filled that pipe:
    the parent's loop stopped in its write, the turn held, for good: no limit of the submission
    was enforced again and a classmate graded beside it stayed paused with it. Now the parent never
    waits for its writes to be read, and the learner's process gets the turn in its own test cells
    only (as its harness asks), so both runs end, the classmate's with its cell done."""
    from autograder.sandbox import bwrap_works, run_program

    sandbox = "bwrap" if bwrap_works() else "none"
    results = {}
    sleeper = "import time\nfor _ in range(6):\n    time.sleep(0.5)\nprint('done')\n"

    def run(name, cells):
        results[name] = run_program(cells, sandbox=sandbox, cell_timeout=60, timeout=90, memory_mb=2000,
                                    log=tmp_path / f"{name}.log")

    asker = threading.Thread(target=run, args=("asker", [_cell(ASKS_AND_NEVER_READS), _cell("print('after')", 1)]),
                             daemon=True)
    asker.start()
    time.sleep(2)  # the classmate starts while the asker asks
    classmate = threading.Thread(target=run, args=("classmate", [_cell(sleeper)]), daemon=True)
    classmate.start()
    classmate.join(150)
    asker.join(max(1, 150 - 2))
    assert not asker.is_alive(), "the parent's loop never ended: it waited to write an answer nobody read"
    assert not classmate.is_alive(), "the classmate never ended: paused for a turn that was never given back"
    assert results["classmate"].status == "ok" and "done" in results["classmate"].cells[0].output, results
    assert "asked" in results["asker"].cells[0].output, results["asker"]


def test_a_turn_or_hold_the_parent_cannot_grant_is_refused_at_once(tmp_path):
    """A second hold of the learner's process, or a timing turn asked for while the submission holds
    one, is answered NO at once (the request raises); before, it was never answered, and the judge
    waited for it until its cell's time limit."""
    from autograder.sandbox import bwrap_works, run_program

    sandbox = "bwrap" if bwrap_works() else "none"
    nested = ("import course.grader_hooks as hooks\nsaid = []\n"
              "for outer, inner in ((hooks.hold, hooks.hold), (hooks.exclusive, hooks.exclusive)):\n"
              "    with outer():\n"
              "        try:\n"
              "            with inner():\n"
              "                said.append('granted twice')\n"
              "        except RuntimeError as exc:\n"
              "            said.append(str(exc))\n"
              "print(*said, sep='\\n')\n")
    cells, setup = _turn_holder(nested)
    begun = time.monotonic()
    out = run_program(cells, judge_setup=setup, sandbox=sandbox, cell_timeout=30, timeout=90, memory_mb=2000,
                      log=tmp_path / "log")
    assert out.status == "ok" and not out.cells[1].error, out
    assert out.cells[1].output.splitlines() == ["grading: the parent refused to stop the learner's process",
                                                "grading: the parent refused the timing turn"], out.cells[1]
    assert time.monotonic() - begun < 25, "the refusals were not answered at once"


FORGES_WHAT_THE_PARENT_READS = """
import course.grader_hooks as hooks, torch
channel = next(c.cell_contents for c in hooks.observer.__closure__ if type(c.cell_contents).__name__ == "Channel")
deep = "x"
for _ in range(48):
    deep = [deep, deep]  # a few hundred bytes on the wire, 2**48 strings read as a tree
{forge}
print("forged")
"""
FORGERIES = {
    # the parent read str() of it: a string of 2**48 parts, the grader's memory, and every row, gone
    "repeats": 'channel.send("flag", name="note", detail=deep, cell=0)',
    # the parent read bool() of it: the error escaped its loop, the processes and the turn left held
    "tensor": ('channel.send("cell_end", cell=0, error="", output="", seconds=0.1, records=0, '
               'tampered=torch.ones(2))'),
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_message_the_parent_cannot_read_as_its_fields_ends_only_its_own_run(tmp_path, forgery):
    """The parent reads each field of a message as one type (text, a number, a flag) and walks no
    message longer than its bytes: a list that holds itself twice at every depth (a few hundred
    bytes, 2**48 values read as a tree), or a tensor where a flag belongs, is a forgery that ends its
    own run (``crashed``, ``tampered``), at once."""
    from autograder.sandbox import bwrap_works, run_program

    sandbox = "bwrap" if bwrap_works() else "none"
    source = FORGES_WHAT_THE_PARENT_READS.replace("{forge}", FORGERIES[forgery])
    begun = time.monotonic()
    out = run_program([_cell(source), _cell("print('after')", 1)], sandbox=sandbox, cell_timeout=30, timeout=60,
                      memory_mb=2000, log=tmp_path / "log")
    assert out.status == "crashed" and any(name == "tampered" for name, _ in out.flags), out
    assert time.monotonic() - begun < 30, "the forgery was read for long"


def test_a_failure_of_the_grader_mid_run_leaves_nothing_held(tmp_path, monkeypatch):
    """Whatever fails in the parent's loop (here its reading of the learner's CPU, inside the judge's
    timing turn), the run's processes are ended and its turn given back before the failure is raised
    (the submission's row: the grader failed); before, the turn stayed held and every later
    measurement of the batch waited for it for good."""
    from autograder.sandbox import bwrap_works, parent, run_program

    def broken(pid):
        raise RuntimeError("a reading the grader could not make")

    monkeypatch.setattr(parent, "main_thread_counts", broken)
    sandbox = "bwrap" if bwrap_works() else "none"
    cells, setup = _turn_holder("import course.grader_hooks as hooks\nwith hooks.exclusive():\n"
                                "    hooks.learner_counts()\n")
    with pytest.raises(RuntimeError, match="the grader failed while running this submission"):
        run_program(cells, judge_setup=setup, sandbox=sandbox, cell_timeout=30, timeout=60, memory_mb=2000,
                    log=tmp_path / "log")
    assert parent.TURNS.holder is None and not parent.TURNS.children, "the timing turn was left held"
    assert not parent.TURNS.queue, "the run was left in the queue for the timing turn"


def test_a_turn_whose_begin_fails_is_not_left_held():
    """Pausing a classmate can fail (a process that vanished mid-freeze): the turn taken for it is given
    back before the failure goes on, so no later measurement of the batch waits for it."""
    from autograder.sandbox import parent

    class Classmate:
        pid = 2

        def pause(self):
            raise OSError("a classmate that could not be paused")

        def resume(self):
            pass

    class Holder(Classmate):
        pid, paused_total = 1, 0.0

    turns, holder = parent._Turns(), Holder()
    turns.children = {1: holder, 2: Classmate()}
    with pytest.raises(OSError):
        turns.take(holder)
    assert turns.holder is None and not turns.queue


def test_timing_turns_are_taken_first_come_first_served_and_never_waited_for():
    """TURNS.take answers at once, yes or no: the run's loop keeps watching its processes while it
    waits. Turns go in the order they were asked for (a run that asks again at once, as a judge's
    rounds do, does not overtake one that waits), and the first in the queue is woken when a turn
    ends; a run that ends leaves the queue."""
    from autograder.sandbox import parent

    class Run:
        def __init__(self, pid):
            self.pid, self.paused, self.woken = pid, False, 0

        def pause(self):
            self.paused = True

        def resume(self):
            self.paused = False

        def wake(self):
            self.woken += 1

    turns = parent._Turns()
    a, b, c = Run(1), Run(2), Run(3)
    for run in (a, b, c):
        turns.add(run)
    assert turns.take(a) and b.paused and c.paused and not a.paused
    assert not turns.take(b) and not turns.take(c) and not turns.take(b), "a turn given while A holds it"
    assert turns.queue == [2, 3], "B asked twice: it must still be queued once, before C"
    turns.end(a)
    assert (b.woken, c.woken) == (1, 0) and not b.paused and not c.paused
    assert not turns.take(a), "A asked again at once and overtook B, which was waiting"
    assert not turns.take(c), "C overtook B"
    assert turns.take(b) and a.paused and c.paused
    turns.remove(c)  # C's run ended while it waited
    turns.end(b)
    assert turns.queue == [1] and a.woken == 1 and turns.take(a)
    turns.add(c)  # C graded again
    assert not turns.take(b) and not turns.take(c)
    turns.end(a)
    turns.withdraw(b)  # B's request is left behind (its test cell ended): C, next, is woken
    assert turns.queue == [3] and c.woken == 1 and turns.take(c)
    turns.end(c)
    assert turns.holder is None and not turns.queue


def test_a_classmate_that_cannot_be_resumed_leaves_the_others_resumed():
    """Resuming one paused run can fail (a group the kernel will not thaw): every other run is still
    resumed, and the next in the queue woken, before the failure goes on; one left paused would have its
    clocks stopped for good."""
    from autograder.sandbox import parent

    class Run:
        def __init__(self, pid, broken=False):
            self.pid, self.broken, self.paused, self.woken = pid, broken, False, 0

        def pause(self):
            self.paused = True

        def resume(self):
            if self.broken:
                raise OSError("a group that would not thaw")
            self.paused = False

        def wake(self):
            self.woken += 1

    turns, holder, broken, other = parent._Turns(), Run(1), Run(2, broken=True), Run(3)
    for run in (holder, broken, other):
        turns.add(run)
    assert turns.take(holder) and not turns.take(other)
    with pytest.raises(OSError):
        turns.end(holder)
    assert not other.paused and other.woken == 1 and turns.holder is None and turns.take(other)


def _busiest_process() -> int:
    """The most threads any process on this machine has now."""
    most = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/status") as fh:
                    most = max(most, next(int(line.split()[1]) for line in fh if line.startswith("Threads:")))
            except (OSError, StopIteration, ValueError):
                pass
    return most


def test_a_learner_holding_every_thread_it_may_have_leaves_a_classmate_its_own(tmp_path):
    """The kernel counts a user's processes and threads (RLIMIT_NPROC, set in every sandbox) per
    uid. A starts idle threads until its sandbox may have no more and keeps them; B, graded
    meanwhile (--jobs), must still start threads of its own. Before, every sandbox of a grader
    running as root was the host's nobody: A's threads were B's too, and B could start none (its
    cell failed). A grader that is not root gives each sandbox a user namespace, counted apart."""
    from autograder.sandbox import bwrap_works, run_program

    if not bwrap_works():
        pytest.skip("bubblewrap is not available here (unconfined, both run as this user)")
    hog = ("import threading, time\n"
           "threading.stack_size(64 * 1024)\n"
           "hold, made = threading.Event(), 0\n"
           "try:\n"
           "    while made < 20000:\n"
           "        threading.Thread(target=hold.wait, daemon=True).start()\n"
           "        made += 1\n"
           "except RuntimeError:\n"
           "    pass\n"
           "print('made', made, flush=True)\n"
           "time.sleep(20)\n"
           "hold.set()\n")
    classmate = ("import threading, time\n"
                 "threads = [threading.Thread(target=time.sleep, args=(0.05,)) for _ in range(16)]\n"
                 "for t in threads:\n    t.start()\n"
                 "for t in threads:\n    t.join()\n"
                 "import torch\n"
                 "torch.set_num_threads(2)\n"
                 "print('started', len(threads), float(torch.ones(256, 256).mm(torch.ones(256, 256)).sum()))\n")
    results = {}

    def run(name, source):
        results[name] = run_program([_cell(source)], sandbox="bwrap", cell_timeout=60, timeout=120,
                                    memory_mb=2000, log=tmp_path / f"{name}.log", tasks=1024)

    a = threading.Thread(target=run, args=("a", hog))
    a.start()
    deadline = time.monotonic() + 60
    while _busiest_process() < 1000 and time.monotonic() < deadline:  # A holds its threads
        time.sleep(0.2)
    try:
        run("b", classmate)
    finally:
        a.join()
    assert results["a"].status == "ok", results["a"]
    made = int(results["a"].cells[0].output.split("made ")[1].split()[0])
    assert 900 <= made < 1024, results["a"].cells[0].output  # it held all it could have
    assert results["b"].status == "ok", results["b"]
    assert not results["b"].cells[0].error, results["b"].cells[0].error
    assert "started 16 16777216.0" in results["b"].cells[0].output, results["b"].cells[0]


def _writer(mb: int, folder: str, then: str = "") -> str:
    """A cell that writes ``mb`` MB of files into ``folder`` (16 MB each), says how far it got, then runs ``then``."""
    return ("import os, time\nchunk = b'x' * (16 * 2**20)\nn = 0\n"
            f"try:\n    for i in range({mb // 16}):\n        open(f'{folder}/f{{i}}', 'wb').write(chunk)\n        n += 1\n"
            "except OSError as e:\n    print('stopped:', e.strerror)\n"
            f"print('wrote MB', n * 16, flush=True)\n{then}")


@pytest.mark.parametrize("folder", ["/tmp", "/grading/cells"])
def test_files_written_in_the_sandbox_count_toward_the_memory_cap(tmp_path, folder):
    """The sandbox's writable folders are tmpfs: their files are kept in the machine's memory, in no
    process's resident count. Before, a learner wrote 1.5 GB there under a 1 GB cap and was graded
    ("ok", 402 MB resident): a way past the cap, and with --jobs, into a classmate's memory."""
    from autograder.sandbox import bwrap_works, run_program

    if not bwrap_works():
        pytest.skip("bubblewrap is not available here (unconfined, the files go to this machine's disk)")
    kept = run_program([_cell(_writer(1600, folder, "time.sleep(3)\nprint('still here')\n"))], sandbox="bwrap",
                       cell_timeout=60, timeout=120, memory_mb=1000, log=tmp_path / "kept.log")
    assert kept.status == "oom" and "the files it wrote" in kept.detail, kept
    small = run_program([_cell(_writer(320, folder, "time.sleep(1)\nprint('still here')\n"))], sandbox="bwrap",
                        cell_timeout=60, timeout=120, memory_mb=1000, log=tmp_path / "small.log")
    assert small.status == "ok" and "wrote MB 320\nstill here" in small.cells[0].output, small


_MEMFD = ("import os, time\nchunk = b'x' * (16 * 2**20)\nfds = []\n"
          "for k in range({files}):\n    fd = os.memfd_create(f'm{{k}}')\n    fds.append(fd)\n"
          "    for i in range(14):\n        os.write(fd, chunk)\n")
_PAIRS = ("import socket, time\nkept = []\n"
          "for k in range({pairs}):\n    a, b = socket.socketpair()\n"
          "    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)\n    a.setblocking(False)\n"
          "    try:\n        while True:\n            a.send({message})\n    except BlockingIOError:\n        pass\n"
          "    {after}\n")
_HOLD = "time.sleep(3)\nprint('still here')\n"


@pytest.mark.parametrize("case,says", [
    (_MEMFD.format(files=8) + _HOLD, "memory files (memfd) it holds open"),
    (_PAIRS.format(pairs=200, message="b'x' * 65536", after="kept.append((a, b))") + _HOLD, "data queued in its sockets"),
    # the sender closed: its 1-byte messages sit in the receiver's queue at a kilobyte each
    (_PAIRS.format(pairs=150, message="b'x'", after="a.close(); kept.append(b)") + _HOLD, "data queued in its sockets"),
    # empty files: no data, but an inode and a name each in the kernel's memory
    ("import os, time\nfor i in range(600000):\n    open(f'/tmp/e{i}', 'w').close()\n" + _HOLD,
     "the files it wrote"),
], ids=["memfd", "socket-pairs", "senders-closed", "empty-files"])
def test_memory_the_kernel_holds_outside_the_processes_counts_toward_the_cap(tmp_path, case, says):
    """Each kept between 1.2 and 1.8 GB of the machine's memory under a 1 GB cap and was graded "ok":
    memory files written and never mapped, and data sent into sockets nobody reads (a pair holds up
    to 8 MB). The parent counts them from outside (autograder/sandbox/held.py)."""
    from autograder.sandbox import bwrap_works, run_program

    if not bwrap_works():
        pytest.skip("bubblewrap is not available here")
    if "socket" in case and os.geteuid() != 0:
        pytest.skip("the sandbox's sockets are counted by a grader running as root (it enters their namespace)")
    out = run_program([_cell(case)], sandbox="bwrap", cell_timeout=60, timeout=120, memory_mb=1000,
                      log=tmp_path / "log")
    assert out.status == "oom" and says in out.detail, out


def test_a_sandbox_holding_more_files_than_the_parent_looks_through_is_ended(tmp_path):
    """Memory files are found by looking at every open descriptor of the tree; a process may have
    4,096, and every process it starts can be handed them all. A tree holding more than the parent
    looks through (65,536 in all) could hide a memory file behind them: it is ended as over the cap."""
    from autograder.sandbox import bwrap_works, run_program

    if not bwrap_works():
        pytest.skip("bubblewrap is not available here")
    case = ("import os, subprocess, time\n"
            "fds = [os.open('/dev/null', os.O_RDONLY) for _ in range(4000)]\n"
            "kids = [subprocess.Popen(['sleep', '30'], pass_fds=fds) for _ in range(17)]\n"
            "time.sleep(5)\nprint('still here')\n")
    out = run_program([_cell(case)], sandbox="bwrap", cell_timeout=60, timeout=120, memory_mb=2000,
                      log=tmp_path / "log")
    assert out.status == "oom" and "65,536 open files" in out.detail, out


def test_no_namespace_of_its_own_where_memory_could_hide(tmp_path):
    """In a user namespace of its own (``unshare -Urm``, util-linux is in the sandbox), a learner
    could mount a tmpfs or make a network namespace whose files and sockets the parent does not
    see. The seccomp filter refuses every new namespace; processes, threads and torch still run."""
    from autograder.sandbox import bwrap_works, run_program
    from autograder.sandbox.seccomp import program

    if not bwrap_works() or program() is None:
        pytest.skip("bubblewrap or a seccomp filter for this architecture is not available here")
    case = ("import os, subprocess, threading\n"
            "for cmd in (['unshare', '-Urm', 'true'], ['unshare', '-Un', 'true'], ['sh', '-c', 'echo child ok']):\n"
            "    r = subprocess.run(cmd, capture_output=True, text=True)\n"
            "    print(cmd[1], r.returncode, (r.stdout + r.stderr).strip())\n"
            "t = threading.Thread(target=print, args=('thread ok',))\nt.start()\nt.join()\n"
            "import torch\nprint('torch', torch.ones(3).sum().item())\n")
    out = run_program([_cell(case)], sandbox="bwrap", cell_timeout=60, timeout=120, memory_mb=2000,
                      log=tmp_path / "log")
    text = out.cells[0].output
    assert "-Urm 1 unshare: unshare failed: Operation not permitted" in text, out
    assert "-Un 1 unshare: unshare failed: Operation not permitted" in text, out
    assert "-c 0 child ok" in text and "thread ok" in text and "torch 3.0" in text, out


_SEGMENT = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
size = 1500 << 20
ident = libc.shmget(0, ctypes.c_size_t(size), 0o1600)
if ident < 0:
    print('shmget refused', ctypes.get_errno())
    sys.exit(0)
step = 100 << 20
for start in range(0, size, step):  # a little at a time: no more than 100 MB resident at once
    addr = libc.shmat(ident, None, 0)
    ctypes.memset(addr + start, 1, step)
    libc.shmdt(ctypes.c_void_p(addr))
print('left', size >> 20, 'MB in segment', ident)
"""


def test_no_kernel_held_ipc_where_memory_could_hide(tmp_path):
    """A System V segment outlives every process that filled it, in the sandbox's IPC namespace, in
    nobody's resident count: a Python without the audit hook, started as a subprocess, filled 1.5 GB
    100 MB at a time, detaching after each, under a 1 GB cap, and the cell was graded "ok". The seccomp filter refuses System V
    IPC and POSIX message queues (``ipcmk`` from util-linux made each before)."""
    from autograder.sandbox import bwrap_works, run_program
    from autograder.sandbox.seccomp import program

    if not bwrap_works() or program() is None:
        pytest.skip("bubblewrap or a seccomp filter for this architecture is not available here")
    case = ("import errno, subprocess, sys, time\n"
            f"r = subprocess.run([sys.executable, '-c', {_SEGMENT!r}], capture_output=True, text=True)\n"
            "print(r.stdout.strip(), r.stderr.strip()[-200:])\n"
            "for kind in ('-M', '-Q', '-S'):\n"
            "    r = subprocess.run(['ipcmk', kind, '1000'], capture_output=True, text=True)\n"
            "    print('ipcmk', kind, r.returncode, (r.stdout + r.stderr).strip())\n"
            "time.sleep(2)\nprint('still here')\n")
    out = run_program([_cell(case)], sandbox="bwrap", cell_timeout=60, timeout=120, memory_mb=1000,
                      log=tmp_path / "log")
    text = out.cells[0].output
    assert f"shmget refused {errno.EPERM}" in text and "left" not in text, out
    for kind in ("-M", "-Q", "-S"):
        assert f"ipcmk {kind} 1 " in text and "Operation not permitted" in text.split(f"ipcmk {kind}")[1].split("\n")[0], out
    assert out.status == "ok" and "still here" in text, out


def _memory_group_or_skip(bwrap: bool) -> None:
    from autograder.sandbox import memcg

    if not bwrap:
        pytest.skip("bubblewrap is not available here")
    if memcg.base() is None:
        if os.environ.get("COURSE_REQUIRE_MEMCG"):
            pytest.fail("COURSE_REQUIRE_MEMCG is set but no memory cgroup can be made and joined here")
        pytest.skip("no memory cgroup the grader can make here (not root, or cgroup v2 without the controller)")


_IN_FLIGHT = ("import os, socket, time\na, b = socket.socketpair()\nchunk = b'x' * (16 << 20)\n"
              "for k in range({files}):\n    fd = os.memfd_create(f'm{{k}}')\n"
              "    for i in range(6):\n        os.write(fd, chunk)\n"
              "    socket.send_fds(a, [b'x'], [fd])\n    os.close(fd)\n"
              "del chunk\nprint('in flight MB', {files} * 96, flush=True)\n")


def test_memory_only_the_kernel_refers_to_counts_toward_the_cap(tmp_path):
    """A memory file passed over a unix socket and closed is in no process's descriptor table while
    it waits in the queue: 1.4 GB written 96 MB at a time that way, under a 1 GB cap, was graded "ok".
    Where the grader can make a memory cgroup, the kernel's own count of the sandbox's shared memory
    is added (autograder/sandbox/memcg.py)."""
    from autograder.sandbox import bwrap_works, run_program

    _memory_group_or_skip(bwrap_works())
    out = run_program([_cell(_IN_FLIGHT.format(files=15) + _HOLD)], sandbox="bwrap", cell_timeout=60, timeout=120,
                      memory_mb=1000, log=tmp_path / "log")
    assert out.status == "oom" and "shared memory only the kernel refers to" in out.detail, out
    small = run_program([_cell(_IN_FLIGHT.format(files=3) + _HOLD)], sandbox="bwrap", cell_timeout=60, timeout=120,
                        memory_mb=1000, log=tmp_path / "small")
    assert small.status == "ok" and "still here" in small.cells[0].output, small


def test_the_kernel_holds_the_wall_between_two_looks(tmp_path, monkeypatch):
    """Between two looks of the parent, the memory group's limit (twice the cap) is the kernel's: a
    burst past it ends processes in the group, and the run is ``oom`` (here the parent looks only
    every 30 s, so that only the kernel can stop it)."""
    from autograder.sandbox import bwrap_works, parent, run_program

    _memory_group_or_skip(bwrap_works())
    monkeypatch.setattr(parent, "POLL", 30.0)
    burst = ("import subprocess, sys\n"
             f"r = subprocess.run([sys.executable, '-c', {_IN_FLIGHT.format(files=8) + 'time.sleep(20)'!r}])\n"
             "print('helper ended with', r.returncode)\n")
    out = run_program([_cell(burst)], sandbox="bwrap", cell_timeout=60, timeout=120, memory_mb=300,
                      log=tmp_path / "log")
    assert out.status == "oom" and "the kernel ended" in out.detail, out
    assert "in flight MB" not in (out.cells[0].output if 0 in out.cells else ""), out


# A right scripted LSTM layer that first allocates n floats in whatever process runs it, and
# writes them `rounds` times (each write of 1.6 GB takes a tenth of a second or more).
_HEAVY_SCRIPT = """import torch
@torch.jit.script
def scripted_layer(x, h0, c0, w_ih, w_hh, b_ih, b_hh):
    big = torch.ones([{n}])
    for _ in range({rounds}):
        big.add_(1.0)
    h, c = h0, c0
    outs = []
    for t in range(x.size(0)):
        gates = x[t] @ w_ih.t() + b_ih + h @ w_hh.t() + b_hh + big[0] * 0.0
        i, f, g, o = gates.chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outs.append(h)
    return torch.stack(outs), (h, c)
"""


def test_memory_a_scripted_answer_holds_counts_toward_the_cap(tmp_path):
    """A learner's TorchScript runs where it is loaded: in the judge, 8 GB allocated by a scripted
    ``scripted_layer`` under a 1 GB cap was graded "ok" (the judge had no cap and no data limit).
    It now runs in the script host, whose memory counts with the learner's process's against the
    submission's cap (``oom``), under the same data limit, twice the cap, which refuses the
    allocation; the judge holds only its own."""
    from autograder.sandbox import bwrap_works, run_program

    sandbox = "bwrap" if bwrap_works() else "none"

    def run(n, rounds):
        cells, setup = _served_program(_HEAVY_SCRIPT.format(n=n, rounds=rounds), "check_scripted_layer(scripted_layer)\n")
        cells[1]["answers"] = ["scripted_layer"]
        cells[3]["source"] = "print('after')"
        return run_program(cells, judge_setup=setup, sandbox=sandbox, cell_timeout=120, timeout=300,
                           memory_mb=1000, log=tmp_path / f"{n}.log")

    held = run(400_000_000, 20)  # 1.6 GB for a second or more: under the data limit, over the cap
    assert held.status == "oom" and "its TorchScript in the script host" in held.detail, held
    assert held.judge_peak_mb < 700, held  # the judge held none of it
    huge = run(2_000_000_000, 3)  # 8 GB: past the data limit
    assert huge.status == "ok" and "torch.ones" in huge.cells[2].error, huge.cells[2]
    assert "ok: scripted_layer" not in huge.cells[2].output
    control = run(1000, 3)
    assert control.status == "ok" and "ok: scripted_layer equals nn.LSTM" in control.cells[2].output, control
    assert 0 < control.judge_peak_mb < 1000 and control.cells[3].output.strip() == "after", control


def test_a_scripted_answer_leaves_no_global_state_to_a_later_cell(tmp_path):
    """TorchScript can switch grad mode off and seed the global generator in whatever process runs
    it. Run in the judge, that carried into every later check; it now runs in the script host, and
    every judge cell starts from torch's state as the set-up left it besides."""
    from autograder.sandbox import bwrap_works, run_program

    meddler = _HEAVY_SCRIPT.format(n=1, rounds=1).replace(
        "    h, c = h0, c0\n", "    torch.manual_seed(0)\n    torch.set_grad_enabled(False)\n    h, c = h0, c0\n")
    cells, setup = _served_program(meddler, "check_scripted_layer(scripted_layer)\n")
    cells[1]["answers"] = ["scripted_layer"]
    cells[3] = {"index": 3, "id": "d", "kind": "test", "grade_id": "t2", "served": True,
                "source": "print('grad', torch.is_grad_enabled(), 'draw', torch.rand(1).item())\n"}
    out = run_program(cells, judge_setup=setup, sandbox="bwrap" if bwrap_works() else "none", cell_timeout=120,
                      timeout=300, memory_mb=2000, log=tmp_path / "log")
    assert out.status == "ok" and "carry no gradient" in out.cells[2].error, out.cells[2]  # its own cell fails
    later = out.cells[3].output.split()
    assert later[:2] == ["grad", "True"], out.cells[3]
    import torch

    seeded = torch.rand(1, generator=torch.Generator().manual_seed(0)).item()  # the learner's seed's first draw
    assert abs(float(later[3]) - seeded) > 1e-6, out.cells[3]


# A scripted layer that reads a file by name (torch.from_file) and raises its first bytes as its
# error, which a failed check shows on the learner's feedback page.
_READER = """import torch
@torch.jit.script
def scripted_layer(x, h0, c0, w_ih, w_hh, b_ih, b_hh):
    b = torch.from_file("{path}", False, {size}, dtype=torch.uint8)
    s = ""
    for i in range({size}):
        s += chr(int(b[i]))
    raise RuntimeError("READ:" + s)
    return x, (h0, c0)
"""


def test_a_scripted_answer_reads_nothing_of_the_graders(tmp_path):
    """TorchScript reads files by name in whatever process runs it. Loaded in the judge, a
    ``scripted_layer`` read the course's references (every lesson's, hidden from the learner's
    process) and raised them into its own feedback. In the script host, confined as the learner's
    process is, there are none to read; the control reads a file that is there (the course's own
    ``__init__.py``), so the reader works."""
    from autograder.sandbox import bwrap_works, run_program

    if not bwrap_works():
        pytest.skip("bubblewrap is not available here: only the sandbox hides the references")
    reference = (COURSE_DIR / "references" / "rnn.py").read_text(encoding="utf-8")

    def run(path):
        cells, setup = _served_program(_READER.format(path=path, size=60), "check_scripted_layer(scripted_layer)\n")
        cells[1]["answers"] = ["scripted_layer"]
        cells[3]["source"] = "print('after')"
        return run_program(cells, judge_setup=setup, sandbox="bwrap", cell_timeout=120, timeout=300,
                           memory_mb=2000, log=tmp_path / f"{len(path)}.log")

    hidden = run("/grading/pkg/course/references/rnn.py")
    assert hidden.status == "ok" and "No such file" in hidden.cells[2].error, hidden.cells[2]
    assert reference[:40] not in hidden.cells[2].error and "READ:" not in hidden.cells[2].error
    there = run("/grading/pkg/course/__init__.py")
    first = (COURSE_DIR / "__init__.py").read_text(encoding="utf-8")[:60]
    assert "READ:" + first[:30] in there.cells[2].error, there.cells[2]


def test_a_scripted_answer_running_pytorchs_lstm_cell_is_read_in_the_script_host(tmp_path):
    """What a scripted answer runs is its graph, read by the script host's own code (no learner
    Python there): a layer whose loop calls torch.lstm_cell gives the right numbers and fails."""
    from autograder.sandbox import bwrap_works, run_program

    builtin = _HEAVY_SCRIPT.format(n=1, rounds=1).replace(
        "        gates = x[t] @ w_ih.t() + b_ih + h @ w_hh.t() + b_hh + big[0] * 0.0\n"
        "        i, f, g, o = gates.chunk(4, 1)\n"
        "        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)\n"
        "        h = torch.sigmoid(o) * torch.tanh(c)\n",
        "        h, c = torch.lstm_cell(x[t], (h, c), w_ih, w_hh, b_ih, b_hh)\n")
    assert "lstm_cell" in builtin
    cells, setup = _served_program(builtin, "check_scripted_layer(scripted_layer)\n")
    cells[1]["answers"] = ["scripted_layer"]
    cells[3]["source"] = "print('after')"
    out = run_program(cells, judge_setup=setup, sandbox="bwrap" if bwrap_works() else "none", cell_timeout=120,
                      timeout=300, memory_mb=2000, log=tmp_path / "log")
    assert out.status == "ok" and "graph calls aten::lstm_cell" in out.cells[2].error, out.cells[2]


def test_a_scripted_answer_that_never_returns_costs_only_its_own_cell(tmp_path):
    """TorchScript that loops forever never returns to Python, so no Python time limit lands in
    it. In the judge it held the judge: the run ended ``timeout`` and every later cell was lost. In
    the script host, the judge's wait for it is what the time limit ends: that cell fails with the
    timeout, the parent stops the host, a later cell that asks for TorchScript fails at once, and
    the others are graded."""
    from autograder.sandbox import bwrap_works, run_program

    forever = _HEAVY_SCRIPT.format(n=1, rounds=1).replace(
        "    h, c = h0, c0\n", "    k = 0\n    while k >= 0:\n        k = (k + 1) % 7\n    h, c = h0, c0\n")
    cells, setup = _served_program(forever, "check_scripted_layer(scripted_layer)\n")
    cells[1]["answers"] = ["scripted_layer"]
    again = dict(cells[2], index=3, id="d", grade_id="t2")
    later = {"index": 4, "id": "e", "kind": "test", "grade_id": "t3", "served": True, "source": "print('graded')\n"}
    cells = [*cells[:3], again, later]
    out = run_program(cells, judge_setup=setup, sandbox="bwrap" if bwrap_works() else "none", cell_timeout=15,
                      timeout=300, memory_mb=2000, log=tmp_path / "log")
    assert out.status == "ok", out
    assert "TimeoutError" in out.cells[2].error, out.cells[2]
    assert "was stopped" in out.cells[3].error and out.cells[3].seconds < 5, out.cells[3]
    assert out.cells[4].output.strip() == "graded" and not out.cells[4].error, out.cells[4]


def test_an_answer_that_keeps_the_course_watcher_from_seeing_fails_under_the_grader(tmp_path):
    """Lesson 1's "by hand" watcher is a TorchFunctionMode in the learner's process: one line of
    plain Python (torch function handling switched off, the mode popped, a thread) ran
    torch.lstm_cell unseen by it, and the cell earned full marks; so did a TorchScript function
    scripted in the cell and a thread started there, waiting for the work (2026-11-30). Under the
    real sandbox (its audit hook and seal in place), each fails with the watcher's or its witnesses'
    message, and a right cell by hand passes."""
    from autograder.sandbox import bwrap_works, run_program

    routes = {
        "switched off": "    with torch._C.DisableTorchFunction():\n"
                        "        return torch.lstm_cell(x, (h, c), w_ih, w_hh, b_ih, b_hh)\n",
        "popped": "    from torch.overrides import _pop_mode_temporarily\n"
                  "    if not torch._C._len_torch_function_stack():\n"
                  "        return torch.lstm_cell(x, (h, c), w_ih, w_hh, b_ih, b_hh)\n"
                  "    with _pop_mode_temporarily():\n"
                  "        return torch.lstm_cell(x, (h, c), w_ih, w_hh, b_ih, b_hh)\n",
        "thread": "    import threading\n    out = []\n"
                  "    t = threading.Thread(target=lambda: out.append(torch.lstm_cell(x, (h, c), w_ih, w_hh, b_ih, b_hh)))\n"
                  "    t.start(); t.join()\n    return out[0]\n",
        "scripted": "    return scripted_cell(x, h, c, w_ih, w_hh, b_ih, b_hh)\n",
        "waiting thread": "    inbox.put((x, h, c, w_ih, w_hh, b_ih, b_hh))\n    return outbox.get()\n",
        "by hand": "    i, f, g, o = (x @ w_ih.t() + b_ih + h @ w_hh.t() + b_hh).chunk(4, 1)\n"
                   "    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)\n"
                   "    return torch.sigmoid(o) * torch.tanh(c), c\n",
    }
    before = {  # made in the cell, before the call the watcher sees
        "scripted": "@torch.jit.script\n"
                    "def scripted_cell(x, h, c, w_ih, w_hh, b_ih, b_hh):\n"
                    "    return torch.lstm_cell(x, (h, c), w_ih, w_hh, b_ih, b_hh)\n\n",
        "waiting thread": "import queue, threading\ninbox, outbox = queue.Queue(), queue.Queue()\n"
                          "def serve():\n    while True:\n        x, h, c, *w = inbox.get()\n"
                          "        outbox.put(torch.lstm_cell(x, (h, c), *w))\n"
                          "threading.Thread(target=serve, daemon=True).start()\n\n",
    }
    cells, setup = _served_program("import torch\n")
    program = [cells[0]]
    for k, (route, body) in enumerate(routes.items()):
        name = f"cell_{k}"
        program.append(dict(cells[1], index=len(program), id=f"s{k}", grade_id=f"sol{k}", answers=[name],
                            source=f"{before.get(route, '')}def {name}(x, h, c, w_ih, w_hh, b_ih, b_hh):\n{body}"))
        program.append(dict(cells[2], index=len(program), id=f"t{k}", grade_id=f"t{k}",
                            source=f"check_lstm_cell({name})\n"))
    out = run_program(program, judge_setup=setup, sandbox="bwrap" if bwrap_works() else "none", cell_timeout=120,
                      timeout=300, memory_mb=2000, log=tmp_path / "log")
    assert out.status == "ok", out
    verdicts = {route: out.cells[2 + 2 * k] for k, route in enumerate(routes)}
    for route in ("switched off", "popped", "thread"):
        assert "the course watches which torch functions an answer calls" in verdicts[route].error, (route, verdicts[route])
    # the witnesses beside the watcher (course.checks.witnesses), in the sandbox: the dispatcher's
    # record of TorchScript's ops, and the kernel's count of another thread's CPU time
    assert "it calls aten::lstm_cell" in verdicts["scripted"].error, verdicts["scripted"]
    assert "another thread of your notebook's process worked" in verdicts["waiting thread"].error, verdicts["waiting thread"]
    assert not verdicts["by hand"].error, verdicts["by hand"]


def test_a_script_host_that_cannot_start_is_the_graders_failure_not_the_learners(tmp_path, monkeypatch):
    """Where the parent cannot start the script host (no uid left, no bwrap), the run raises (the
    submission's row is ``error``, to grade again), rather than failing the learner's cell."""
    from autograder.sandbox import bwrap_works, parent, run_program

    real = parent._Proc

    def no_host(script, *args, **kwargs):
        if script == "script_host.py":
            raise OSError("no uid left (planted)")
        return real(script, *args, **kwargs)

    monkeypatch.setattr(parent, "_Proc", no_host)
    cells, setup = _served_program(_HEAVY_SCRIPT.format(n=1, rounds=1), "check_scripted_layer(scripted_layer)\n")
    cells[1]["answers"] = ["scripted_layer"]
    with pytest.raises(RuntimeError, match="could not start a process that runs a learner's code for the judge .the script host.*planted"):
        run_program(cells, judge_setup=setup, sandbox="bwrap" if bwrap_works() else "none", cell_timeout=120,
                    timeout=300, memory_mb=2000, log=tmp_path / "log")


def test_a_few_sockets_and_memory_files_stay_within_the_cap(tmp_path):
    """The control: what honest code holds (a memory file of 16 MB, ten socket pairs with a little
    data waiting, a listening socket) is counted at its size and graded."""
    from autograder.sandbox import bwrap_works, run_program

    if not bwrap_works():
        pytest.skip("bubblewrap is not available here")
    case = (_MEMFD.format(files=1).replace("range(14)", "range(1)")
            + "import socket\nkept = [socket.socketpair() for _ in range(10)]\n"
              "for a, b in kept:\n    a.send(b'x' * 4096)\n"
            + "server = socket.socket(socket.AF_UNIX); server.bind('\\0course-test'); server.listen(8)\n" + _HOLD)
    out = run_program([_cell(case)], sandbox="bwrap", cell_timeout=60, timeout=120, memory_mb=1000,
                      log=tmp_path / "log")
    assert out.status == "ok" and "still here" in out.cells[0].output, out


def test_the_kernel_refuses_files_past_the_cap_in_the_sandbox(tmp_path):
    """Between two looks of the parent, the kernel holds the wall: each tmpfs is no larger than the
    memory cap (bwrap's --size, from bubblewrap 0.7), so a burst of writes ends in 'No space left'
    (without it, each could take half the machine's memory)."""
    from autograder.sandbox import bwrap_works, run_program
    from autograder.sandbox.parent import bwrap_sizes_tmpfs

    if not bwrap_works() or not bwrap_sizes_tmpfs():
        pytest.skip("this bubblewrap cannot size a tmpfs (older than 0.7): the parent's look alone holds the cap")
    probe = ("import os\nfor f in ('/tmp', '/grading', '/grading/cells'):\n"
             "    st = os.statvfs(f)\n    print(f, st.f_blocks * st.f_frsize // 2**20)\n")
    out = run_program([_cell(probe)], sandbox="bwrap", cell_timeout=60, timeout=120, memory_mb=700,
                      log=tmp_path / "log")
    sizes = dict(line.split() for line in out.cells[0].output.splitlines())
    assert sizes == {"/tmp": "700", "/grading": "700", "/grading/cells": "700"}, out


def test_a_cell_past_its_limit_is_interrupted_by_the_parent(tmp_path):
    from autograder.sandbox import bwrap_works, run_program

    sandbox = "bwrap" if bwrap_works() else "none"
    out = run_program([_cell("import time\ntime.sleep(30)\n"), _cell("print('next')", 1)], sandbox=sandbox,
                      cell_timeout=2, timeout=60, memory_mb=2000, log=tmp_path / "log")
    assert out.status == "ok" and "TimeoutError" in out.cells[0].error and out.cells[1].output.strip() == "next"


def test_the_sandbox_user_is_never_host_root(tmp_path):
    from autograder.sandbox import bwrap_works, run_program

    if not bwrap_works():
        pytest.skip("bubblewrap is not available here")
    probe = ("import os\nprint('uid', os.getuid(), os.geteuid())\n"
             "print('map', ' '.join(open('/proc/self/uid_map').read().split()))\n"
             "print('status', [l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1])\n")
    out = run_program([_cell(probe)], sandbox="bwrap", cell_timeout=30, timeout=60, memory_mb=2000,
                      log=tmp_path / "log")
    text = out.cells[0].output
    assert "status 0000000000000000" in text, text  # no capabilities at all
    if os.geteuid() == 0:  # no user namespace: a host uid of the sandboxes' own range, never root
        from autograder.sandbox import uids

        assert "map 0 0 4294967295" in text, text
        uid = int(text.split("uid ")[1].split()[0])
        assert uids.base() <= uid < uids.base() + uids.SPAN and f"uid {uid} {uid}" in text, text
    else:
        assert "uid 65534 65534" in text, text


def test_the_sandbox_imports_the_grading_checkouts_course(tmp_path):
    from autograder.sandbox import bwrap_works, run_program

    sandbox = "bwrap" if bwrap_works() else "none"
    out = run_program([_cell("import course\nprint(course.__file__)")], sandbox=sandbox, cell_timeout=30,
                      timeout=60, memory_mb=2000, log=tmp_path / "log")
    where = out.cells[0].output.strip()
    repo_course = str(Path(__file__).resolve().parents[1] / "course")
    assert where.startswith("/grading/pkg/course/" if sandbox == "bwrap" else repo_course), where


def test_a_lesson_that_compiles_has_dynamo_sealed_before_any_learner_code(tmp_path):
    """``torch._dynamo`` is imported before learner code only in lessons whose instructor's notebook
    compiles (it is about 2 s of every start-up): there, a learner's cell that patches it is flagged."""
    from autograder.program import instructor_program
    from autograder.sandbox import bwrap_works, run_program

    solutions = Path(__file__).resolve().parents[1] / "solutions"
    preload = {lesson: instructor_program(lesson, solutions / lesson / f"{lesson}.ipynb").preload
               for lesson in ("01_custom_rnns", "02_fx_transforms", "03_channels_last", "06_vmap_ensembles")}
    assert preload == {"01_custom_rnns": ["torch._dynamo"], "02_fx_transforms": ["torch._dynamo"],
                       "03_channels_last": [], "06_vmap_ensembles": []}, preload  # lesson 3 names it in prose only
    sandbox = "bwrap" if bwrap_works() else "none"
    patch = {"index": 0, "id": "a", "kind": "solution", "grade_id": "sol", "answers": [],
             "source": "import torch._dynamo\ntorch._dynamo.reset = lambda: None\n"}
    out = run_program([patch, _cell("print('next')", 1)], sandbox=sandbox, cell_timeout=30, timeout=90,
                      memory_mb=2000, log=tmp_path / "log", preload=["torch._dynamo"])
    assert out.status == "ok" and out.cells[1].output.strip() == "next", out
    assert any(name == "tampered" and "torch._dynamo.reset replaced" in detail
               for name, detail in out.flags), out.flags


def test_feedback_never_shows_hidden_tests_whatever_the_submission_prints(hostile, course):  # noqa: F811
    row = hostile["rows"]["echo_hidden"]
    assert (row["status"], float(row["score"])) == ("graded", 1), row
    page = (hostile["out"] / "feedback" / "echo_hidden" / LESSON / f"{LESSON}.html").read_text(encoding="utf-8")
    assert "add(-5, 5)" not in page and "mul(-1, 4)" not in page
    assert "[a hidden test]" in page  # the error is shown, the hidden line is not
    # the test cells' files in the sandbox were empty: the learner's cell printed nothing of them
    # (the instructor's copy in WORK/autograded holds the whole test cells, by design; look at outputs)
    graded_nb = nbformat.read(course["work"] / "autograded" / "echo_hidden" / LESSON / NOTEBOOK, as_version=4)
    printed = "".join(o.get("text", "") for c in graded_nb.cells if c.cell_type == "code"
                      and "glob.glob" in c.source for o in c.get("outputs", []))
    assert "cell_" in printed and "learner_" in printed  # the files were there, and read
    # the hidden tests live only in the test cells, whose files were empty
    assert "mul(-1, 4)" not in printed and "BEGIN HIDDEN" not in printed


def test_no_later_cell_is_in_the_sandbox_before_it_runs(tmp_path):
    """The parent sends each cell once the one before it has ended: a probe that searches every
    string object in the child finds no trace of the next cell (hidden tests included)."""
    from autograder.sandbox import bwrap_works, run_program

    sandbox = "bwrap" if bwrap_works() else "none"
    probe = ("import gc, warnings\nwarnings.simplefilter('ignore')\nmarker = 'SECRET' + '-MARKER-42'\n"
             "found = any(isinstance(o, str) and marker in o for o in gc.get_objects())\n"
             "found = found or any(isinstance(o, (bytes, bytearray)) and marker.encode() in o for o in gc.get_objects())\n"
             "print('found', found)\n")
    later = _cell("hidden = 'SECRET-MARKER-42'\nprint('ran')", 1)
    out = run_program([_cell(probe), later], sandbox=sandbox, cell_timeout=30, timeout=60, memory_mb=2000,
                      log=tmp_path / "log")
    assert out.status == "ok", out
    assert out.cells[0].output.strip().splitlines()[-1] == "found False", out.cells[0]
    assert out.cells[1].output.strip() == "ran"


def test_test_cells_see_the_instructors_names_and_the_learners_answers(tmp_path):
    """Before a test cell, names instructor cells bound are restored (an added cell rebinding a
    check changes nothing), except the names the lesson's solution cells define (the answers)."""
    from autograder.sandbox import bwrap_works, run_program

    sandbox = "bwrap" if bwrap_works() else "none"
    cells = [
        {"index": 0, "id": "a", "kind": "instructor", "source": "check = 'real check'\nanswer = 'placeholder'",
         "grade_id": ""},
        {"index": 1, "id": "b", "kind": "solution", "source": "answer = 'learner answer'", "grade_id": "sol",
         "answers": ["answer"]},
        {"index": 2, "id": "c", "kind": "added", "source": "check = lambda *a: None\nanswer = 'rebound'",
         "grade_id": ""},
        {"index": 3, "id": "d", "kind": "test", "source": "print(check, '|', answer)", "grade_id": "t"},
    ]
    out = run_program(cells, sandbox=sandbox, cell_timeout=30, timeout=60, memory_mb=2000, log=tmp_path / "log")
    assert out.status == "ok", out
    # the check is the instructor's again; the answer is whatever the learner's cells left
    assert out.cells[3].output.strip() == "real check | rebound", out.cells[3]


# -- served checks: the judge process ---------------------------------------------------------

FORGER = '''
import torch, threading, course.grader_hooks as hooks
# The harness's own objects, reached through a closure the course package holds: the channel to
# the parent, with its token. In a served cell none of it is heard.
cells = {c.cell_contents.__class__.__name__: c.cell_contents for c in hooks.observer.__closure__ or ()}
channel, state = cells.get("Channel"), cells.get("dict")
def forge(index):
    ok = torch.zeros(2)
    channel.send("record", cell=index, n=0, name="lstm_cell(...) -> (h', c')", actual=ok, expected=ok,
                 tol={"name": "forged"})
    channel.send("cell_end", cell=index, error="", output="", seconds=0.1, records=1, tampered=False)
def lstm_cell(x, h, c, w_ih, w_hh, b_ih, b_hh):
    forge(state["cell"]["index"])
    return torch.zeros_like(h), torch.zeros_like(c)   # wrong
print("channel reached:", channel is not None)
'''


def _served_program(learner: str, check: str = "check_lstm_cell(lstm_cell)\n"):
    setup = "import torch\nfrom course.checks.rnn import check_lstm_cell, check_scripted_layer\n"
    return [
        {"index": 0, "id": "a", "kind": "instructor", "source": setup, "grade_id": ""},
        {"index": 1, "id": "b", "kind": "solution", "source": learner, "grade_id": "sol", "answers": ["lstm_cell"]},
        {"index": 2, "id": "c", "kind": "test", "source": check, "grade_id": "t", "served": True},
        {"index": 3, "id": "d", "kind": "instructor", "source": "print('after', lstm_cell.__name__)", "grade_id": ""},
    ], [setup]


def test_a_served_check_runs_in_the_judge_and_forged_evidence_is_not_heard(tmp_path):
    from autograder.sandbox import bwrap_works, run_program

    sandbox = "bwrap" if bwrap_works() else "none"
    cells, setup = _served_program(FORGER)
    out = run_program(cells, judge_setup=setup, sandbox=sandbox, cell_timeout=60, timeout=120, memory_mb=2000,
                      log=tmp_path / "log")
    assert out.status == "ok", out
    assert "channel reached: True" in out.cells[1].output, out.cells[1]  # the attack did reach the harness...
    served = out.cells[2]
    assert "does not match the reference" in served.error, served  # ...and the judge's verdict stands
    assert all(r["tol"].get("name") != "forged" for r in served.records), served.records
    assert out.cells[3].output.strip() == "after lstm_cell"  # the learner's process went on after serving


def test_a_right_answer_passes_in_the_judge_and_a_hang_is_interrupted(tmp_path):
    from autograder.sandbox import bwrap_works, run_program

    sandbox = "bwrap" if bwrap_works() else "none"
    right = ("import torch\ndef lstm_cell(x, h, c, w_ih, w_hh, b_ih, b_hh):\n"
             "    i, f, g, o = (x @ w_ih.t() + b_ih + h @ w_hh.t() + b_hh).chunk(4, 1)\n"
             "    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)\n"
             "    return torch.sigmoid(o) * torch.tanh(c), c\n")
    cells, setup = _served_program(right)
    out = run_program(cells, judge_setup=setup, sandbox=sandbox, cell_timeout=60, timeout=120, memory_mb=2000,
                      log=tmp_path / "log")
    assert out.status == "ok" and not out.cells[2].error and out.cells[2].records, out.cells[2]
    assert "ok: lstm_cell equals nn.LSTM" in out.cells[2].output
    hang = "import time\ndef lstm_cell(*args):\n    time.sleep(600)\n"
    cells, setup = _served_program(hang, "check_lstm_cell(lstm_cell)\ncheck_lstm_cell(lstm_cell, seed=3)\n")
    cells.insert(3, {"index": 4, "id": "e", "kind": "test", "source": "check_lstm_cell(lstm_cell)\n",
                     "grade_id": "t2", "served": True})
    out = run_program(cells, judge_setup=setup, sandbox=sandbox, cell_timeout=4, timeout=120, memory_mb=2000,
                      log=tmp_path / "log2")
    assert out.status == "ok", out
    assert "TimeoutError" in out.cells[2].error and "TimeoutError" in out.cells[4].error, out.cells
    assert out.cells[3].output.strip() == "after lstm_cell"


def test_a_process_that_never_takes_the_next_cell_costs_its_run_a_grace_not_the_whole_limit(tmp_path):
    """A learner's call that swallows the interruption and sleeps on leaves its process inside the
    served call after the judge's cell has ended: it never starts the next cell. The parent
    interrupts it again (which frees a process whose interruption landed just before the call
    began: a race a busy machine produced in CI), then gives up after the grace, naming why,
    instead of waiting out the submission's whole time limit."""
    from autograder.sandbox import bwrap_works, run_program
    from autograder.sandbox.parent import GRACE

    sandbox = "bwrap" if bwrap_works() else "none"
    stubborn = ("import time\ndef lstm_cell(*args):\n    try:\n        time.sleep(600)\n"
                "    except BaseException:\n        time.sleep(600)\n")
    cells, setup = _served_program(stubborn)
    start = time.monotonic()
    out = run_program(cells, judge_setup=setup, sandbox=sandbox, cell_timeout=2, timeout=600, memory_mb=2000,
                      log=tmp_path / "log")
    took = time.monotonic() - start
    assert out.status == "timeout" and "did not start the next cell" in out.detail, out
    assert "TimeoutError" in out.cells[2].error
    assert took < 2 + GRACE + 60, took  # not the 600 s limit


def test_references_that_reproduce_exercises_are_the_judges_alone(tmp_path):
    """The learner's process sees no course/references (bubblewrap hides it), however it asks;
    the judge uses it for the served check."""
    from autograder.sandbox import bwrap_works, run_program

    if not bwrap_works():
        pytest.skip("bubblewrap is not available here")
    borrow = ("import os, importlib\nprint('listing', os.listdir('/grading/pkg/course/references'))\n"
              "try:\n    importlib.import_module('course.references.rnn')\n    print('imported')\n"
              "except ImportError:\n    print('no references')\n"
              "def layer_norm_lstm_cell(x, h, c, p):\n"
              "    from course.references.rnn import layer_norm_lstm_cell_reference as ref\n"
              "    return ref(x, (h, c), p)\n")
    setup = "import torch\nfrom course.checks.rnn import check_layer_norm_cell\n"
    cells = [
        {"index": 0, "id": "a", "kind": "instructor", "source": setup, "grade_id": ""},
        {"index": 1, "id": "b", "kind": "solution", "source": borrow, "grade_id": "sol",
         "answers": ["layer_norm_lstm_cell"]},
        {"index": 2, "id": "c", "kind": "test", "source": "check_layer_norm_cell(layer_norm_lstm_cell)\n",
         "grade_id": "t", "served": True},
    ]
    out = run_program(cells, judge_setup=[setup], sandbox="bwrap", cell_timeout=60, timeout=120, memory_mb=2000,
                      log=tmp_path / "log")
    assert out.status == "ok", out
    assert "listing []" in out.cells[1].output and "no references" in out.cells[1].output, out.cells[1]
    assert "ModuleNotFoundError" in out.cells[2].error and "course.references" in out.cells[2].error, out.cells[2]
    assert out.cells[2].records == []  # the judge never got as far as comparing: nothing borrowed


@pytest.mark.parametrize("sandbox", ["none", "bwrap"])
def test_a_warning_shown_through_the_harness_is_not_probing_and_its_other_files_still_are(tmp_path, sandbox):
    """A warning or traceback through a cell reads the lines of the harness's own frames (``child.py``,
    ``protocol.py``); outside bubblewrap those live in ``autograder/``, a path learners may not
    open. Reading them for a stack is not probing (lesson 3's instructor run once failed on it);
    opening the grader's other files still is."""
    from autograder.sandbox import bwrap_works, run_program

    if sandbox == "bwrap" and not bwrap_works():
        pytest.skip("bubblewrap is not available here")
    import autograder

    other = os.path.join(os.path.dirname(os.path.abspath(autograder.__file__)), "grade.py")
    # a warning shown at the cell's caller: the harness's frame in protocol.py, whose line it reads
    stack = "import warnings\nwarnings.simplefilter('always')\nwarnings.warn('look', stacklevel=2)\nprint('after')\n"
    peek = f"try:\n    open({other!r}).read()\nexcept OSError as exc:\n    print('refused', type(exc).__name__)\n"
    cells = [{**_cell(stack), "kind": "solution"}, {**_cell(peek, 1), "kind": "solution"}]
    out = run_program(cells, sandbox=sandbox, cell_timeout=30, timeout=60, memory_mb=2000, log=tmp_path / "log")
    assert out.status == "ok", out
    assert not out.cells[0].error and "after" in out.cells[0].output, out.cells[0]
    probing = [detail for name, detail in out.flags if name == "probing"]
    assert not any("protocol.py" in d or "child.py" in d for d in probing), probing
    if sandbox == "none":  # in bubblewrap the checkout is not there to open at all
        assert any("grade.py" in d for d in probing), out.flags


FORGED_PROBE = '''
import torch
def autocast_inference(model, x):
    # patched while the judge's probe runs here: the probe's report ("autocast was on") is forged
    torch.is_autocast_enabled = lambda *a: True
    torch.get_autocast_dtype = lambda *a: torch.bfloat16
    with torch.no_grad():
        return model(x).to(torch.bfloat16)
'''


def test_a_probe_report_forged_while_serving_sets_the_served_cell_aside(tmp_path):
    """A served check that asked the learner's process for a structure fact (a probe) rests partly on
    that process's word: patching found there right after the cell marks that cell, and the judge
    says the cell used a probe, so the verdict sets it aside (tests/test_verdict.py). Autocast is
    also confirmed from outside (a convolution whose result is 0 only under autocast)."""
    from autograder.sandbox import bwrap_works, run_program

    sandbox = "bwrap" if bwrap_works() else "none"
    setup = "import torch\nfrom course.checks.memory_format import check_autocast_inference\n"
    cells = [
        {"index": 0, "id": "a", "kind": "instructor", "source": setup, "grade_id": ""},
        {"index": 1, "id": "b", "kind": "solution", "source": FORGED_PROBE, "grade_id": "sol",
         "answers": ["autocast_inference"]},
        {"index": 2, "id": "c", "kind": "test", "source": "check_autocast_inference(autocast_inference, width=8, size=32)\n",
         "grade_id": "t", "served": True},
        {"index": 3, "id": "d", "kind": "instructor", "source": "print('after')", "grade_id": ""},
    ]
    out = run_program(cells, judge_setup=[setup], sandbox=sandbox, cell_timeout=60, timeout=120, memory_mb=2000,
                      log=tmp_path / "log")
    assert out.status == "ok", out
    served = out.cells[2]
    assert served.probed, served  # the check asked the learner's process (a probe)...
    assert served.tampered, served  # ...the patching was found, against this very cell...
    assert "did not run in bfloat16" in served.error, served  # ...and the witness saw through it anyway
    assert any(name == "tampered" and "is_autocast_enabled" in detail for name, detail in out.flags), out.flags


BUCKET_SERVERS = '''
import torch
import course.checks.rnn as R

def serve_bucketed(layer, x, lengths, *rest, bucket=16):
    T = x.shape[0]
    steps = -(-T // bucket) * bucket
    out, state = layer(torch.cat([x, x.new_zeros(steps - T, *x.shape[1:])]), lengths, *rest)
    return out[:T], state

def forged(layer, x, lengths, *rest, bucket=16):
    # no padding (a graph per length), and every report this process could make is forged
    R._padded = lambda T, b: T
    R.int = lambda v: -(-v // bucket) * bucket  # the steps a probe here would have reported: padded
    R._CountedLayer = lambda n: type("Forged", (), {"graphs": [], "calls": [[] for _ in range(n)],
                                                    "for_batch": lambda self, k: layer})()
    torch.compile = lambda fn, **k: fn
    return layer(x, lengths, *rest)

kept = []
def keeps(layer, x, lengths, *rest, bucket=16):
    kept.append(layer)
    if len(kept) > 1:
        return kept[0](x, lengths, *rest)  # the layer lent for an earlier call
    return serve_bucketed(layer, x, lengths, *rest, bucket=bucket)

print("lent:", type(serve_bucketed).__name__)
'''


def _served_cells(tmp_path, check: str, source: str, answers: list[str], args: str = "") -> list:
    """``source`` (a solution cell binding ``answers``) and one served test cell per answer,
    ``check(answer, args)``, run in real processes (the sandbox where there is one): the cells' results,
    the answers' in order."""
    from autograder.sandbox import bwrap_works, run_program

    module, _, name = check.rpartition(".")
    setup = f"import torch\nfrom {module} import {name}\n"
    cells = [
        {"index": 0, "id": "a", "kind": "instructor", "source": setup, "grade_id": ""},
        {"index": 1, "id": "b", "kind": "solution", "source": source, "grade_id": "sol", "answers": list(answers)},
        *({"index": i, "id": f"t{i}", "kind": "test", "source": f"{name}({answer}{', ' + args if args else ''})\n",
           "grade_id": f"t{i}",
           "served": True} for i, answer in enumerate(answers, start=2)),
    ]
    out = run_program(cells, judge_setup=[setup], sandbox="bwrap" if bwrap_works() else "none", cell_timeout=90,
                      timeout=240, memory_mb=2000, log=tmp_path / "log")
    assert out.status == "ok", out
    return [out.cells[i] for i in range(2, 2 + len(answers))]


def test_the_bucket_layer_is_lent_from_the_judge_so_its_count_is_the_judges(tmp_path):
    """Lesson 1's bucketing check hands the learner's function a layer that stays in the judge (each
    call crosses back): which steps it was called on and how many graphs it compiled are counted in
    the judge, with no probe in the learner's process. A server that forges everything its process
    could report (the course's helpers, torch.compile) still fails on the steps; a layer kept from one
    call and used in another refuses; the right server passes without resting on that process's word."""
    right, forged, keeps = _served_cells(tmp_path, "course.checks.rnn.check_bucketed", BUCKET_SERVERS,
                                         ["serve_bucketed", "forged", "keeps"], "bucket=8, lengths=(3, 5, 8, 12)")
    assert not right.error and "2 graph(s) compiled" in right.output and not right.probed, right
    assert "gave the layer the batch as it came" in forged.error and not forged.probed, forged
    assert "lent by the grader for one call" in keeps.error, keeps


PROFILERS = """
import time
from collections import defaultdict
from torch import fx


class ProfilingInterpreter(fx.Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.times = defaultdict(list)

    def profile(self, *args, runs=5):
        for _ in range(runs):
            out = self.run(*args)
        return out

    def run_node(self, n):
        start = time.perf_counter()
        result = super().run_node(n)
        self.times[n.name].append(time.perf_counter() - start)
        return result

    def rows(self):
        means = {k: sum(v) / len(v) for k, v in self.times.items()}
        total = sum(means.values())
        return sorted((("op", n.name, means[n.name], means[n.name] / total) for n in self.module.graph.nodes),
                      key=lambda r: r[2], reverse=True)


class Written(ProfilingInterpreter):  # a mean written down (15 ms: below any drawn mean, 18 ms or more)
    def rows(self):
        means = {n.name: (0.015 if n.name == "slow" else 1e-6) for n in self.module.graph.nodes}
        total = sum(means.values())
        return sorted((("op", k, m, m / total) for k, m in means.items()), key=lambda r: r[2], reverse=True)


class Peeking(Written):  # the node's own sleep times, read from the node
    def rows(self):
        cycle = self.module.slow.fn.fn.cycle_s
        rows = super().rows()
        return [(op, k, sum(cycle) / 2 if k == "slow" else m, s) for op, k, m, s in rows]
"""


def test_the_profilers_planted_node_is_the_judges_so_its_time_must_be_measured(tmp_path):
    """Lesson 2's profiler check lends the learner's graph a node whose work stays in the judge,
    sleeping times drawn for each check: a measured profile passes; a profile written down or read
    from the node fails, in real processes."""
    right, written, peeking = _served_cells(tmp_path, "course.checks.fx.check_profiler", PROFILERS,
                                            ["ProfilingInterpreter", "Written", "Peeking"])
    assert not right.error and "by the check's clock it slept" in right.output, right
    assert "by the grader's clock its mean over the 4 runs was" in written.error, written
    assert "has no attribute 'fn'" in peeking.error, peeking


JAGGED_ANSWERS = """
import torch


def _offsets(keep):
    return torch.cat([keep.new_zeros(1, dtype=torch.long), keep.sum(1).cumsum(0)])


def jagged_token_mlp(x, key_padding_mask, mlp):
    keep = ~key_padding_mask
    y = mlp(torch.nested.nested_tensor_from_jagged(x[keep], _offsets(keep)))
    out = torch.zeros_like(x)
    out[keep] = y.values()
    return out


def packed(x, key_padding_mask, mlp):  # the right numbers, no nested tensor
    out = torch.zeros_like(x)
    out[~key_padding_mask] = mlp(x[~key_padding_mask])
    return out


def weights_read(x, key_padding_mask, mlp):  # the MLP's weights, to compute without calling it
    return mlp[0].weight
"""

#: Loops over the sequences: ``observed`` gives a lent MLP (the structure check's) one jagged tensor and loops
#: whenever it is handed a real module (the speed cell's); ``looped`` always loops.
JAGGED_LOOPS = JAGGED_ANSWERS + """

def observed(x, key_padding_mask, mlp):
    if not isinstance(mlp, torch.nn.Module):
        return jagged_token_mlp(x, key_padding_mask, mlp)
    return looped(x, key_padding_mask, mlp)


def looped(x, key_padding_mask, mlp):
    out = torch.zeros_like(x)
    for i, n in enumerate((~key_padding_mask).sum(1).tolist()):
        out[i, :n] = mlp(x[i, :n])
    return out
"""


def test_lesson_9s_token_mlp_is_lent_so_what_it_was_given_is_the_judges_record(tmp_path):
    """The MLP stays in the judge, in real processes: a jagged tensor crosses as checked values and
    offsets, the right answer passes with no probe in the learner's process, the packed tokens fail on
    the judge's record, and the stand-in holds no weights."""
    right, packed, weights = _served_cells(tmp_path, "course.checks.fastpath.check_jagged_mlp", JAGGED_ANSWERS,
                                           ["jagged_token_mlp", "packed", "weights_read"])
    assert not right.error and "through one jagged nested tensor" in right.output and not right.probed, right
    assert "the MLP was given ['dense']" in packed.error and not packed.probed, packed
    assert "object is not subscriptable" in weights.error, weights


def test_lesson_9s_token_mlp_looped_over_the_sequences_fails_the_judges_clock_whatever_it_is_handed(tmp_path):
    """Red team, 2026-12-05: an answer that told the structure check's lent MLP from the real module the
    speed cell hands it (one ``isinstance``) earned both cells while looping over the sequences. The judge
    now times the answer, given a real module, against the course's loop over 2,048 short sequences, in
    both cells: the loop reads about 1 of it wherever it is, a jagged answer a fraction."""
    right, observed, looped = _served_cells(tmp_path, "course.checks.fastpath.check_jagged_mlp", JAGGED_LOOPS,
                                            ["jagged_token_mlp", "observed", "looped"])
    assert not right.error and "(the grader's clock)" in right.output, right
    assert "the work of a Python loop over the sequences" in observed.error, observed
    assert "the MLP was given ['dense', 'dense'" in looped.error, looped  # the lent MLP's record, first
    speed = _served_cells(tmp_path / "speed", "course.checks.fastpath.check_jagged_speed", JAGGED_LOOPS, ["looped"],
                          "bars={'cpu': 1.0, 'cuda': 1.0}, batch=8, length=256, dim=16, hidden=64, valid=0.6")[0]
    assert "the work of a Python loop over the sequences" in speed.error, speed


RESET_PEAK = '''
import os, tempfile
here = tempfile.mkdtemp()
tries = {
    "open": lambda: open("/proc/self/clear_refs", "w").write("5"),
    "dir_fd": lambda: os.write(os.open("clear_refs", os.O_WRONLY, dir_fd=os.open("/proc/self", os.O_RDONLY)), b"5"),
    "symlink": lambda: os.symlink("/proc/self/clear_refs", os.path.join(here, "peak")),
    "link_to_dir": lambda: (os.symlink("/proc/self", os.path.join(here, "me")),
                            open(os.path.join(here, "me", "clear_refs"), "w").write("5")),
}
for name, attempt in tries.items():
    try:
        attempt()
        print(name, "reset")
    except (OSError, RuntimeError) as exc:
        print(name, "refused", type(exc).__name__)
'''


@pytest.mark.parametrize("sandbox", ["none", "bwrap"])
def test_learner_code_cannot_reset_the_peak_memory_the_grader_reads(tmp_path, sandbox):
    """Lesson 5's HVP is checked by the kernel's count of the learner's peak memory, which writing 5
    to ``/proc/<pid>/clear_refs`` would set back mid-call: a Hessian built, freed, and the count reset.
    Every way learner code names that file (its path, a folder's descriptor, a link) is refused and
    flagged."""
    from autograder.sandbox import bwrap_works, run_program

    if sandbox == "bwrap" and not bwrap_works():
        pytest.skip("bubblewrap is not available here")
    out = run_program([{**_cell(RESET_PEAK), "kind": "solution"}], sandbox=sandbox, cell_timeout=30, timeout=60,
                      memory_mb=2000, log=tmp_path / "log")
    assert out.status == "ok", out
    lines = out.cells[0].output.split("\n")
    assert [line.split()[1] for line in lines if line.strip()] == ["refused"] * 4, out.cells[0]
    probing = [detail for name, detail in out.flags if name == "probing"]
    assert len(probing) >= 4 and all("clear_refs" in d or "/proc/self" in d for d in probing), probing


def test_a_folder_on_the_hosts_root_filesystem_is_never_counted_as_the_sandboxs_files(monkeypatch):
    """While bwrap sets a sandbox up, ``/proc/<p>/root/grading`` can reach the host's root filesystem
    before the sandbox's tmpfs is mounted there; its use was counted as the submission's files (CI: an
    untouched lesson 2, 0.04 s old, "wrote 56,571 MB" and was graded oom). A folder on a device of the
    host's is skipped, even where the host has no folder of that name."""
    import os

    from autograder.sandbox import held

    real = held._host_dev
    monkeypatch.setattr(held, "SCRATCH", ("/usr",))  # on the host's root filesystem, as /grading was
    monkeypatch.setattr(held, "_host_dev", lambda folder: None if folder == "/usr" else real(folder))
    if os.stat("/usr").st_dev != os.stat("/").st_dev:
        pytest.skip("/usr is not on the root filesystem here")
    assert held._scratch_bytes(os.getpid()) == 0


def test_a_tmpfs_of_the_hosts_is_never_counted_as_the_sandboxs_files(monkeypatch):
    """Skipping only the host's /, /tmp and a folder of the same name left every other device of the
    host's to chance while bwrap sets a sandbox up (CI graded the instructor's lesson 5 "oom" with 0
    of 16, early in its run, where no run here comes near the cap: a misread folder is one way that
    happens). A folder counts once, as the process inside sees its own
    mounts, a tmpfs is mounted there, on no device the grader's own mounts have: here a tmpfs of the
    host's, reached as if it were a scratch folder with no host folder of that name, counts nothing."""
    import os

    from autograder.sandbox import held

    shm = next((point for dev, point, fstype in held._mounts("self") if fstype == "tmpfs"
                and os.access(point, os.R_OK)), None)
    if shm is None:
        pytest.skip("no tmpfs is mounted here")
    monkeypatch.setattr(held, "SCRATCH", (shm,))
    monkeypatch.setattr(held, "_host_dev", lambda folder: None)  # the old rule alone would count it
    assert held._tmpfs_mounts(os.getpid())[shm] == os.stat(shm).st_dev
    assert held._scratch_bytes(os.getpid()) == 0
    monkeypatch.setattr(held, "_host_devs", set)  # the rule that skips it
    assert held._scratch_bytes(os.getpid()) > 0


def test_one_look_past_the_memory_cap_is_not_a_verdict_two_in_a_row_are(tmp_path, monkeypatch):
    """A run is ``oom`` when two looks in a row find it over the cap: one reading past it can be a
    misreading (a folder read while bwrap sets the sandbox up), and between two looks the kernel's wall
    holds. Here the parent's look is made to read 100 GB more, once, then at every look."""
    from autograder.sandbox import bwrap_works, parent, run_program

    sandbox = "bwrap" if bwrap_works() else "none"
    real, calls = parent._memory_look, []

    def misread(every):
        def look(proc, held, files_once=False):
            rss, outside = real(proc, held, files_once)
            calls.append(1)
            if not files_once and (every or len(calls) == 3):
                outside = {**outside, "files": outside.get("files", 0) + 100 * 2**30}
            return rss, outside
        return look

    cells = [_cell("import time\ntime.sleep(2)\nprint('still here')\n")]
    monkeypatch.setattr(parent, "_memory_look", misread(False))
    once = run_program(cells, sandbox=sandbox, cell_timeout=60, timeout=120, memory_mb=1000, log=tmp_path / "once")
    assert once.status == "ok" and "still here" in once.cells[0].output, once
    monkeypatch.setattr(parent, "_memory_look", misread(True))
    always = run_program(cells, sandbox=sandbox, cell_timeout=60, timeout=120, memory_mb=1000, log=tmp_path / "always")
    assert always.status == "oom" and "the files it wrote" in always.detail, always
    assert "(its processes " in always.detail, always


JACOBIAN_ANSWERS = """
import course.forward_ad as FA
from torch.func import jacfwd, jvp, vjp, vmap


def right_rev(f, x):
    out, pullback = vjp(f, x)
    return vmap(pullback)(torch.eye(out.numel(), dtype=out.dtype, device=out.device))[0]


def right_fwd(f, x):
    basis = torch.eye(x.numel(), dtype=x.dtype, device=x.device)
    return vmap(lambda v: jvp(f, (x,), (v,))[1])(basis).T


def right_tall(f, x):
    return jacfwd(f)(x)


def differences(f, x):
    h = 1e-6
    basis = torch.eye(x.numel(), dtype=x.dtype, device=x.device)
    ys = vmap(f)(torch.cat([x + h * basis, x - h * basis]))
    return ((ys[:x.numel()] - ys[x.numel():]) / (2 * h)).T


def token(f, x):
    jac, _ = jvp(lambda z: differences(f, z), (x,), (torch.zeros_like(x),))
    return jac


def closed(f, x):
    y = torch.tanh(f.W1 @ x + f.b1)
    return f.W2 @ ((1 - y * y)[:, None] * f.W1)


def forged(f, x):
    f(x)
    FA.RULES_RAN.append("forward")
    FA.TANGENTS_SEEN.append(("forward", torch.eye(f.hidden, dtype=torch.float64)))
    return closed(f, x)
"""


def test_lesson_4s_jacobians_are_forward_mode_in_the_judges_eyes_not_values_beside_a_token_call(tmp_path):
    """Red team, 2026-12-05: finite differences inside one ``jvp`` with zero tangents earned Exercise 5, and a
    closed form from the wide function's weights earned Exercise 6's speed cell. Through real processes: the
    right answers pass (``jacfwd`` read and run again by the program host under Exercise 6's vocabulary); the
    token call fails on the span of the tangents f's rule saw; the closed form fails for using no mode; one
    that forges what the learner's process reports passes there and is refused where it is run again."""
    right, token = _served_cells(tmp_path, "course.checks.forward_ad.check_jacobians", JACOBIAN_ANSWERS,
                                 ["right_fwd", "token"], "right_rev")
    assert not right.error and "ok: jacobian_fwd" in right.output, right
    assert "jacobian_fwd pushed tangents through f that span 0 directions" in token.error, token
    sizes = "bars={'cpu': 1.5, 'cuda': 1.5}, k=4, m=2048, hidden=128, threads=1, rounds=3, min_run_time=0.02"
    right, closed, forged = _served_cells(tmp_path / "speed", "course.checks.forward_ad.check_jacobian_speed",
                                          JACOBIAN_ANSWERS, ["right_tall", "closed", "forged"], sizes)
    assert not right.error and "your tall_jacobian" in right.output, right
    assert "tall_jacobian differentiated f by no mode" in closed.error, closed
    assert "tall_jacobian, read by the grader" in forged.error, forged  # the probe, first, believed its process

"""The grading parent's verdict on evidence: speed records, and no pass on 'no error' alone."""

from __future__ import annotations

import pytest

from autograder.program import TEST, Cell, Program
from autograder.sandbox import CellReport, Outcome
from autograder.verdict import IMPLAUSIBLE, Transcript, judge


def _program():
    return Program("l", "l.ipynb", [Cell(0, "s", "solution", "x = 1", "sol"),
                                    Cell(1, "t", TEST, "check(x)", "speed_test", 2.0)])


def _speed(value, bar=1.1):
    return {"name": "speed: fast over slow", "actual": value, "expected": bar,
            "tol": {"name": "speed: fast over slow", "kind": "at_least"}}


def _outcome(records, error=""):
    return Outcome("ok", {0: CellReport(0, finished=True), 1: CellReport(1, error=error, records=records,
                                                                          finished=True)}, [], 1.0, 10.0)


def test_a_graded_cell_with_no_comparison_cannot_be_graded():
    with pytest.raises(RuntimeError, match="speed_test: its check made no comparison"):
        Transcript.from_outcome(_program(), _outcome([]))


@pytest.fixture
def transcript():
    return Transcript.from_outcome(_program(), _outcome([_speed(1.6)]))


def test_speed_records_are_checked_again_against_the_bar(transcript):
    program = _program()
    assert judge(program, _outcome([_speed(1.3)]), transcript)[0].points == 2.0
    below = judge(program, _outcome([_speed(1.05)]), transcript)[0]
    assert below.points == 0 and "below the bar 1.10x" in below.message


def test_a_changed_bar_or_a_non_number_earns_nothing(transcript):
    program = _program()
    lowered = judge(program, _outcome([_speed(1.3, bar=0.0)]), transcript)[0]
    assert lowered.points == 0 and "altered-references" in program.flags
    for value in ("1.3", float("nan"), None):
        assert judge(_program(), _outcome([_speed(value)]), transcript)[0].points == 0


def test_an_implausibly_fast_candidate_is_flagged_not_credited(transcript):
    program = _program()
    verdict = judge(program, _outcome([_speed(IMPLAUSIBLE * 1.6 + 0.5)]), transcript)[0]
    assert verdict.points == 0 and "implausible-speed" in program.flags
    assert "not credited automatically" in verdict.message
    assert judge(_program(), _outcome([_speed(IMPLAUSIBLE * 1.6 - 0.5)]), transcript)[0].points == 2.0


def _served_program():
    return Program("l", "l.ipynb", [Cell(0, "s", "solution", "x = 1", "sol"),
                                    Cell(1, "t", TEST, "check(x)", "speed_test", 2.0, served=True)])


def _witnessed(value, witness, bar=3.0):
    record = _speed(value, bar)
    record["tol"] = dict(record["tol"], ceiling=value * 1.2, witness=witness)
    return record


@pytest.mark.parametrize("served", [True, False])
def test_a_ratio_moved_by_the_machines_load_is_judged_against_the_course_solution_timed_beside_it(served):
    """CI's case: the instructor's run measured 10.96x over a memory-bound baseline; the same
    solution, graded later under load, at least 37.23x (the baseline slowed, not the solution). Timed
    in the same rounds, it was about as fast as the course's solution: credited, not flagged. Only a
    served cell's witness counts (the judge timed it); a record from the learner's process could
    carry any witness, so there the instructor's ratio still decides."""
    program = _served_program() if served else _program()
    transcript = Transcript.from_outcome(program, _outcome([_witnessed(10.96, 1.02)]))
    verdict = judge(program, _outcome([_witnessed(37.23, 0.97)]), transcript)[0]
    if served:
        assert verdict.points == 2.0 and not program.flags, verdict
    else:
        assert verdict.points == 0 and "implausible-speed" in program.flags
    # at least three times as fast as the course's own solution, beside it: a cached answer looks so
    program = _served_program()
    verdict = judge(program, _outcome([_witnessed(12.0, IMPLAUSIBLE + 0.2)]), transcript)[0]
    assert verdict.points == 0 and "implausible-speed" in program.flags and verdict.reason == "speed"
    assert "as fast as the course's own solution timed in the same rounds" in verdict.message


@pytest.mark.parametrize("served", [True, False])
def test_a_ratio_of_the_courses_own_sides_is_never_implausible(served):
    """Lesson 5's picker speed times torch.func's jacfwd against jacrev in the judge (the learner's
    code only chose one): the instructor's own notebook was flagged at 14.5x against its transcript's
    3.65x (CI, 2026-11-29). A served record that says every side was trusted is judged on the bar
    alone; a record from the learner's process could say anything, so there the check stands."""
    program = _served_program() if served else _program()
    transcript = Transcript.from_outcome(program, _outcome([_speed(3.65, 3.0)]))
    record = _speed(14.5, 3.0)
    record["tol"] = dict(record["tol"], trusted=True)
    verdict = judge(program, _outcome([record]), transcript)[0]
    if served:
        assert verdict.points == 2.0 and not program.flags, verdict
    else:
        assert verdict.points == 0 and "implausible-speed" in program.flags
    below = _speed(2.0, 3.0)
    below["tol"] = dict(below["tol"], trusted=True)
    assert judge(_served_program(), _outcome([below]), transcript)[0].points == 0  # the bar still holds


def test_no_record_where_the_instructor_made_one_is_a_failure(transcript):
    verdict = judge(_program(), _outcome([]), transcript)[0]
    assert verdict.points == 0 and "made 0 comparison(s)" in verdict.message


@pytest.mark.parametrize("served, probed, earns", [(False, False, 0.0), (True, False, 2.0), (True, True, 0.0)])
def test_patching_costs_a_served_cell_only_where_a_probe_reported_from_the_learners_process(served, probed, earns):
    """Patching the learner's process cannot reach a served check's evidence, except what the
    course's probe reported from there (structure facts): such a cell is set aside like one
    checked in that process."""
    program = Program("l", "l.ipynb", [Cell(0, "s", "solution", "x = 1", "sol"),
                                       Cell(1, "t", TEST, "check(x)", "speed_test", 2.0, served=served)])
    transcript = Transcript.from_outcome(program, _outcome([_speed(1.6)]))
    outcome = Outcome("ok", {0: CellReport(0, finished=True, tampered=True),
                             1: CellReport(1, records=[_speed(1.6)], finished=True, probed=probed)}, [], 1.0, 10.0)
    verdict = judge(program, outcome, transcript)[0]
    assert verdict.points == earns
    if not earns:
        assert "flag 'tampered'" in verdict.message
        assert ("probe reported" in verdict.message) is served


def test_a_cell_whose_baseline_was_timed_beside_the_learners_processes_is_not_graded(transcript):
    """The parent found that something of the learner's ran while it held them paused for the
    judge's baseline (``Pause``): that cell's speed record, however good, earns nothing; the other
    cells are untouched."""
    program = _served_program()
    transcript = Transcript.from_outcome(program, _outcome([_speed(1.6)]))
    good = Outcome("ok", {0: CellReport(0, finished=True), 1: CellReport(1, records=[_speed(1.6)], finished=True)},
                   [], 1.0, 10.0)
    assert judge(program, good, transcript)[0].points == 2.0  # control
    escaped = Outcome("ok", {0: CellReport(0, finished=True),
                             1: CellReport(1, records=[_speed(9.0)], finished=True,
                                           escaped="its processes used 0.150 s of CPU while paused")},
                      [("escaped-pause", "cell 1: ...")], 1.0, 10.0)
    verdict = judge(program, escaped, transcript)[0]
    assert verdict.points == 0 and verdict.reason == "tampered", verdict
    assert "0.150 s of CPU while paused" in verdict.message and "escaped-pause" in verdict.message


def _missed(value, ceiling, bar=1.1):
    """A speed record that missed its bar, as ``expect_speedup`` sends it (then raises)."""
    rec = _speed(value, bar)
    rec["tol"] = {**rec["tol"], "ceiling": ceiling}
    return rec


def _number(actual, expected=1.0):
    return {"name": "value", "actual": actual, "expected": expected,
            "tol": {"name": "value", "rtol": 1e-6, "atol": 1e-6}}


UNDECIDED_ERROR = "course.grading.SpeedUndecided: Undecided: fast is 1.2x as fast as slow"


def test_a_bar_between_the_confidence_bounds_is_undecided_never_passed_nor_failed(transcript):
    verdict = judge(_program(), _outcome([_missed(1.05, 1.3)], error=UNDECIDED_ERROR), transcript)[0]
    assert verdict.status == "undecided" and verdict.undecided and verdict.points == 0
    assert "undecided" in verdict.message and "1.05x and 1.30x" in verdict.message
    # an upper bound below the bar decides: failed
    verdict = judge(_program(), _outcome([_missed(0.9, 1.05)], error="AssertionError: slow"), transcript)[0]
    assert verdict.status == "failed" and verdict.points == 0 and "below the bar" in verdict.message
    # a record with no upper bound (what an old or odd check sends) is a miss
    verdict = judge(_program(), _outcome([_speed(1.05)], error="AssertionError: slow"), transcript)[0]
    assert verdict.status == "failed"
    assert judge(_program(), _outcome([_speed(1.3)]), transcript)[0].status == "passed"


def test_undecided_needs_every_other_comparison_right_and_the_speed_miss_to_be_the_error():
    program = Program("l", "l.ipynb", [Cell(0, "s", "solution", "x = 1", "sol"),
                                       Cell(1, "t", TEST, "check(x)", "speed_test", 2.0)])
    transcript = Transcript.from_outcome(program, _outcome([_number(1.0), _speed(1.6)]))
    # a wrong value before the bar: failed, whatever the speed
    wrong = judge(program, _outcome([_number(2.0), _missed(1.05, 1.3)], error=UNDECIDED_ERROR), transcript)[0]
    assert wrong.status == "failed" and "checked again by the grader" in wrong.message
    # an error after a bar that was cleared: that error, failed
    later = judge(program, _outcome([_number(1.0), _speed(1.3)], error="RuntimeError: boom"), transcript)[0]
    assert later.status == "failed" and later.message == "RuntimeError: boom"
    # an error before any speed record (the check never measured): failed
    early = judge(program, _outcome([_number(1.0)], error=UNDECIDED_ERROR), transcript)[0]
    assert early.status == "failed"
    # all right, and the machine too busy to tell: undecided
    busy = judge(program, _outcome([_number(1.0), _missed(1.05, 1.3)], error=UNDECIDED_ERROR), transcript)[0]
    assert busy.status == "undecided"


def test_a_bar_the_instructors_solution_missed_here_leaves_the_lesson_gradable_and_misses_undecided():
    program = _program()
    transcript = Transcript.from_outcome(program, _outcome([_missed(0.8, 1.0)], error="AssertionError: slow"))
    assert set(transcript.unproven) == {"speed_test"}
    assert judge(program, _outcome([_speed(1.3)]), transcript)[0].status == "passed"  # a clear pass is a pass
    miss = judge(program, _outcome([_missed(0.8, 1.0)], error="AssertionError: slow"), transcript)[0]
    assert miss.status == "undecided" and "instructor's solution did not clear" in miss.message
    # but an instructor's run that failed on anything else cannot be graded against
    with pytest.raises(RuntimeError, match="does not pass its own checks"):
        Transcript.from_outcome(program, _outcome([_speed(1.6)], error="RuntimeError: boom"))


@pytest.mark.parametrize("message, status, outcome, reason", [
    ("", "passed", "ok", ""),
    ("checked again by the grader: speed: fast over slow at least 1.05x, below the bar 1.10x", "failed", "ok", "speed"),
    ("undecided: speed: fast over slow between 1.05x and 1.30x ...", "undecided", "ok", "speed"),
    ("speed: x: measured at least 9.00x, more than 3 times the instructor's solution", "failed", "ok", "speed"),
    ("speed: x: the bar used during grading (0x) is not the lesson's (1.1x)", "failed", "ok", "altered"),
    ("value: the reference computed during grading differs from the instructor's (inputs or references were "
     "altered); not graded", "failed", "ok", "altered"),
    ("checked again by the grader: out does not match the reference.\n  max abs error 1", "failed", "ok", "numerics"),
    ("AssertionError: lstm_cell -> (h, c) does not match the reference.\n  ...", "failed", "ok", "numerics"),
    ("AssertionError: lstm_cell is not written yet: replace `raise NotImplementedError()`", "failed", "ok",
     "not written"),
    ("AssertionError: compiled_layer should be what torch.compile returns, but it is a plain function.",
     "failed", "ok", "structure"),
    ("AssertionError: lstm_cell raised RuntimeError: mat1 and mat2 shapes cannot be multiplied", "failed", "ok",
     "error"),
    ("NameError: name 'lstm_cell' is not defined", "failed", "ok", "error"),
    ("the check made 0 comparison(s) here, but 2 on the instructor's solution", "failed", "ok", "structure"),
    ("not graded: the run stopped before this cell (timeout: 1800 s)", "failed", "timeout", "timeout"),
    ("not graded: guarded modules were patched before or during this cell (flag 'tampered')", "failed", "ok",
     "tampered"),
])
def test_each_failure_is_named_by_its_kind_for_the_instructors_report(message, status, outcome, reason):
    from autograder.verdict import REASONS, reason_of

    assert reason_of(message, status, outcome) == reason
    assert reason in REASONS + ("",)


CLOCK_UNDECIDED = ("course.grading.SpeedUndecided: Undecided: jacobian_vmap took 27.9 ms for 1024 outputs, where "
                   "the course's loop over them takes 36.8 ms (the grader's clock): 0.76 of the loop")


@pytest.mark.parametrize("served, status", [(True, "undecided"), (False, "failed")])
def test_a_structure_clock_that_cannot_tell_is_undecided_where_the_judge_raised_it(served, status):
    """A structure verdict by the grader's clock (no speed record) that the judge left undecided
    earns nothing yet and is measured again; the same text from a check run in the learner's
    process is not the judge's word, and stays an error."""
    program = Program("l", "l.ipynb", [Cell(0, "s", "solution", "x = 1", "sol"),
                                       Cell(1, "t", TEST, "check(x)", "structure_test", 2.0, served=served)])
    transcript = Transcript.from_outcome(program, _outcome([_number(1.0)]))
    verdict = judge(program, _outcome([_number(1.0)], error=CLOCK_UNDECIDED), transcript)[0]
    assert verdict.status == status and verdict.points == 0
    if served:
        assert verdict.message.startswith("undecided: ") and "0.76 of the loop" in verdict.message
        # an instructor's run left undecided this way still grades the lesson; a learner's clear pass passes
        slow = Transcript.from_outcome(program, _outcome([_number(1.0)], error=CLOCK_UNDECIDED))
        assert set(slow.unproven) == {"structure_test"}
        assert judge(program, _outcome([_number(1.0)]), slow)[0].status == "passed"

"""The grading parent's own verdict on each graded cell.

A graded cell earns its points only when all of this holds, checked here, in a process no
submission code ever ran in:

1. the sandboxed run reached the cell and the cell finished without an error;
2. the seal was intact up to the end of the cell (no guarded module patched, see sandbox/child.py);
3. the check made exactly the comparisons that it made when run on the instructor's solution,
   in the same order, and every value the learner's code produced matches the reference from
   the instructor's run, compared here with the check's own tolerance. The references the
   sandbox compared against must match the instructor's too; when they do not, inputs or
   references were altered in the sandbox (flag ``altered-references``).

4. a speed check's record (``course.numerics.report_at_least``: the measured ratio's lower
   confidence bound and the bar) must clear the bar, and must not be implausibly far above the
   instructor solution's own measurement on this machine (more than :data:`IMPLAUSIBLE` times):
   such a ratio is what a memoised or work-skipping candidate shows; it earns nothing and is
   flagged ``implausible-speed`` for a human to look at. Where the judge timed the course's own
   solution in the same rounds (``tol["witness"]``, a served cell's), the candidate's lower bound
   over that solution is judged instead: a ratio over a slow, memory-bound baseline can move
   threefold with the machine's load between the instructor's run and the learner's, a ratio
   between two right answers timed side by side does not.

A speed record whose bar lies between its lower and upper confidence bounds is *undecided*
(``course.grading.SpeedUndecided``): the cell earns nothing now and is measured again (``grade``
re-runs such submissions, and a later ``grade`` run too), never failed on a noisy machine's
word. So is a miss on a bar that the instructor's own solution did not clear on this machine
(:attr:`Transcript.unproven`): the machine cannot show it, which says nothing of the learner.

No graded cell is decided on "no error" alone: the instructor's run must make at least one
comparison in every graded cell, or the lesson cannot be graded (rule 3 then has nothing to
check). Structure checks that raise count through rule 1, under the seal of rule 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from course.numerics import assert_close

from .program import TEST, Program
from .sandbox import Outcome

#: A learner's speed ratio this many times the instructor's (on the same machine) is not credited.
IMPLAUSIBLE = 3.0


#: The verdict of a graded cell.
PASSED, FAILED, UNDECIDED = "passed", "failed", "undecided"


@dataclass
class CellVerdict:
    grade_id: str
    points: float
    max_points: float
    message: str       # why it failed, for the feedback ('' when it passed)
    status: str = FAILED
    reason: str = ""   # what kind of failure (see REASONS): '' when it passed

    @property
    def undecided(self) -> bool:
        return self.status == UNDECIDED


#: The kinds of failure, as the instructor's report counts them: a wrong value (checked again by
#: the parent, or by a check's assert_close), the technique not used (any other failed check), a
#: speed bar missed, an exception in the learner's code, an exercise never written, a run that
#: stopped before the cell (its status: timeout, oom, crashed; else "not run"), evidence that was
#: tampered with or altered.
REASONS = ("numerics", "structure", "speed", "error", "not written", "timeout", "oom", "crashed", "not run",
           "tampered", "altered")


def reason_of(message: str, status: str, outcome_status: str = "ok") -> str:
    """The kind of failure a verdict's message names ('' for a pass)."""
    if status == PASSED:
        return ""
    first = message.split("\n", 1)[0]
    if message.startswith("not graded: the run stopped"):
        return "not run" if outcome_status in ("ok", "") else outcome_status
    if message.startswith(("not graded: guarded modules were patched", "not graded: your notebook's processes kept")):
        return "tampered"
    if "were altered" in first or "is not the lesson's" in first:
        return "altered"
    if status == UNDECIDED or any(s in first for s in ("below the bar", "times the instructor's",
                                                          "as fast as the course's own",
                                                          "measured ratio is not a number")):
        return "speed"
    if "is not written yet" in first:
        return "not written"
    if first.startswith("checked again by the grader:") or "does not match the reference" in first:
        return "numerics"
    if " raised " in first or not first.startswith(("AssertionError", "the check")):
        return "error"
    return "structure"


class _Undecided(str):
    """A verdict message that leaves the cell undecided rather than failed."""


@dataclass
class Transcript:
    """The instructor's run: per graded cell, its comparisons (name, expected value, tolerance).
    ``unproven``: the speed cells whose bar the instructor's solution did not clear on this machine
    (why, per grade id); a lesson is graded all the same, and those bars decide only passes."""
    records: dict[str, list[dict]]
    seconds: float
    unproven: dict[str, str] = field(default_factory=dict)
    peak_rss_mb: float = 0.0  # the run's peak memory (the lesson's memory budget is checked against it)

    @classmethod
    def from_outcome(cls, program: Program, outcome: Outcome) -> "Transcript":
        problems = []
        if outcome.status != "ok":
            problems.append(f"the run ended with status {outcome.status} ({outcome.detail})"
                            + ("; a larger --memory-mb lets it run" if outcome.status == "oom" else ""))
        records, unproven = {}, {}
        for cell in program.graded:
            rep = outcome.cells.get(cell.index)
            if rep is not None and rep.finished and rep.error and (_missed_speed(rep.records)
                                                                     or _undecided_clock(cell, rep)):
                unproven[cell.grade_id] = rep.error  # the machine's doing, not the solution's (it ran to its bar)
            elif rep is None or not rep.finished or rep.error:
                problems.append(f"{cell.grade_id}: {rep.error if rep else 'not reached'}")
                continue
            records[cell.grade_id] = [{"name": r["name"], "expected": r["expected"], "tol": r["tol"],
                                       "actual": r["actual"] if _at_least(r["tol"]) else None}
                                      for r in rep.records]
            if not rep.records:
                problems.append(f"{cell.grade_id}: its check made no comparison the grader can check again "
                                "(a graded cell must compare through course.numerics.assert_close or "
                                "course.grading.expect_speedup; it never passes on 'no error' alone)")
        if outcome.flags:
            problems.append(f"flags on the instructor's own run: {outcome.flags[:3]}")
        if problems:
            raise RuntimeError("the instructor's solution does not pass its own checks on this machine, so "
                               "nothing can be graded against it: " + "; ".join(problems)[:1500])
        return cls(records, outcome.seconds, unproven, outcome.peak_rss_mb)


def _undecided_clock(cell, rep) -> bool:
    """A served check whose clock could not tell (``course.grading.SpeedUndecided`` raised in the
    judge without a speed record: a structure verdict by the grader's clock, between a batched answer
    and a loop). Only the judge's own exceptions read this way: a learner's are wrapped before they
    reach a check's caller."""
    return (bool(cell.served) and bool(rep.error) and not _missed_speed(rep.records)
            and rep.error.startswith("course.grading.SpeedUndecided:"))


def _missed_speed(records: list[dict]) -> bool:
    """The check's last comparison was a speed bar that was not cleared (``expect_speedup`` raises
    right after it records): the cell's error is that miss."""
    return bool(records) and _at_least(records[-1].get("tol")) and not records[-1]["actual"] >= records[-1]["expected"]


def judge(program: Program, outcome: Outcome, reference: Transcript) -> list[CellVerdict]:
    verdicts = []
    tampered_from = None
    for cell in program.cells:
        rep = outcome.cells.get(cell.index)
        if rep is not None and rep.tampered and tampered_from is None:
            tampered_from = cell.index
        if cell.kind != TEST:
            continue
        why = _why_not(cell, rep, reference.records.get(cell.grade_id, []), tampered_from, outcome, program,
                       reference.unproven.get(cell.grade_id))
        status = UNDECIDED if isinstance(why, _Undecided) else FAILED if why else PASSED
        verdicts.append(CellVerdict(cell.grade_id, cell.points if status == PASSED else 0.0, cell.points,
                                    str(why), status, reason_of(str(why), status, outcome.status)))
    return verdicts


def _why_not(cell, rep, expected, tampered_from, outcome, program, unproven=None) -> str:
    if rep is None or not rep.finished:
        return f"not graded: the run stopped before this cell ({outcome.status}: {outcome.detail})"
    # A served cell's check ran in the judge: patching the learner's process cannot reach its evidence,
    # except what a probe reported from there (structure facts), which patching can forge.
    if tampered_from is not None and tampered_from <= cell.index and (not cell.served or rep.probed):
        return ("not graded: guarded modules were patched before or during this cell (flag 'tampered')"
                + (", and its check relied on what the course's probe reported from your notebook's process"
                   if cell.served else ""))
    if getattr(rep, "escaped", ""):
        return ("not graded: your notebook's processes kept running while the grader held them paused to time "
                f"the course's baseline ({rep.escaped}), so no comparison with it can be trusted (flag "
                "'escaped-pause'). Leave no process of your own running, and start none that starts others.")
    if _undecided_clock(cell, rep):
        return _Undecided("undecided: " + rep.error.split(":", 1)[1].strip()[:600]
                          + "; measured again when your instructor regrades")
    # A check that failed on its speed bar ran every comparison up to it: those are judged below.
    if rep.error and not _missed_speed(rep.records):
        return rep.error
    got = rep.records
    if len(got) != len(expected):
        return (f"the check made {len(got)} comparison(s) here, but {len(expected)} on the instructor's "
                "solution: the code under test did not run the way the check expects")
    for mine, ref in zip(got, expected):
        tol = dict(ref["tol"])
        if mine["name"] != ref["name"]:
            return f"the check compared {mine['name']!r} where the instructor's run compared {ref['name']!r}"
        if _at_least(tol):
            why = _speed(cell, mine, ref, program, unproven)
            if why:
                return type(why)(why + _explanation(rep.error))
            continue
        kw = dict(rtol=tol.get("rtol"), atol=tol.get("atol"), check_dtype=bool(tol.get("check_dtype", True)),
                  equal_nan=bool(tol.get("equal_nan", False)), check_device=False)
        try:
            assert_close(mine["expected"], ref["expected"], name=f"reference of {ref['name']}", **kw)
        except AssertionError:
            program.flag("altered-references", f"{cell.grade_id}: the reference for {ref['name']!r} "
                         "differs from the instructor's run")
            return (f"{ref['name']}: the reference computed during grading differs from the instructor's "
                    "(inputs or references were altered); not graded")
        except Exception as exc:  # noqa: BLE001 - a strange value is a mismatch, never a crash
            return f"{ref['name']}: could not compare the reference ({type(exc).__name__})"
        try:
            assert_close(mine["actual"], ref["expected"], name=ref["name"], **kw)
        except AssertionError as exc:
            return f"checked again by the grader: {exc}"
        except Exception as exc:  # noqa: BLE001
            return f"{ref['name']}: the value could not be compared ({type(exc).__name__}: {exc})"[:500]
    return rep.error or ""


def _explanation(error: str | None) -> str:
    """The judge's account of a missed speed bar, from a profile of both sides (see
    ``course.checks.why_slow``), for the feedback page: feedback, not evidence."""
    for line in (error or "").splitlines():
        line = line.strip()
        if line.startswith("What the profiler saw"):
            return "\n" + line[:800]
    return ""


def _at_least(tol) -> bool:
    return isinstance(tol, dict) and tol.get("kind") == "at_least"


def _speed(cell, mine: dict, ref: dict, program: Program, unproven: str | None = None) -> str:
    """A speed record: the learner's bound must clear the instructor's bar, plausibly. A miss is
    undecided when the bar lies below the learner's upper bound, or when the instructor's own
    solution missed it on this machine."""
    name = ref["name"]
    value, bar, theirs = mine.get("actual"), ref["expected"], ref.get("actual")
    if type(value) is not float or type(mine.get("expected")) is not float or value != value:
        return f"{name}: the measured ratio is not a number; not graded"
    if mine["expected"] != bar:
        program.flag("altered-references", f"{cell.grade_id}: the speed bar of {name!r} was changed")
        return f"{name}: the bar used during grading ({mine['expected']:g}x) is not the lesson's ({bar:g}x)"
    if value < bar:
        ceiling = (mine.get("tol") or {}).get("ceiling") if isinstance(mine.get("tol"), dict) else None
        if unproven is not None:
            return _Undecided(f"undecided: {name} at least {value:.2f}x, below the bar {bar:.2f}x, but the "
                              "instructor's solution did not clear this bar on the grading machine either; "
                              "measured again when your instructor regrades on a quieter machine")
        if type(ceiling) is float and ceiling >= bar:
            return _Undecided(f"undecided: {name} between {value:.2f}x and {ceiling:.2f}x with 99% confidence, "
                              f"and the bar {bar:.2f}x lies between: the grading machine was too busy to tell; "
                              "measured again when your instructor regrades")
        return f"checked again by the grader: {name} at least {value:.2f}x, below the bar {bar:.2f}x"
    if cell.served and isinstance(mine.get("tol"), dict) and mine["tol"].get("trusted") is True:
        return ""  # every side timed was the course's or torch's own, in the judge: nothing to be implausible
    witness = (mine.get("tol") or {}).get("witness") if cell.served and isinstance(mine.get("tol"), dict) else None
    if type(witness) is float:
        # The course's solution was timed in the same rounds (by the judge, which the learner's code
        # cannot reach): the ratio over it is the same on a quiet machine and a loaded one.
        if witness > IMPLAUSIBLE:
            program.flag("implausible-speed", f"{cell.grade_id}: {name} measured at least {value:.2f}x, and at "
                         f"least {witness:.2f}x as fast as the course's solution timed beside it")
            return (f"{name}: measured at least {value:.2f}x, and at least {witness:.2f}x as fast as the course's "
                    f"own solution timed in the same rounds (more than {IMPLAUSIBLE:g} times); a cached or skipped "
                    "computation looks like this, so it is not credited automatically (flagged for your "
                    "instructor to review)")
        return ""
    if isinstance(theirs, float) and theirs > 0 and value > IMPLAUSIBLE * max(theirs, bar):
        program.flag("implausible-speed", f"{cell.grade_id}: {name} measured at least {value:.2f}x, the "
                     f"instructor's solution {theirs:.2f}x on this machine")
        return (f"{name}: measured at least {value:.2f}x, more than {IMPLAUSIBLE:g} times the instructor's "
                f"solution ({theirs:.2f}x) on the same machine; a cached or skipped computation looks like "
                "this, so it is not credited automatically (flagged for your instructor to review)")
    return ""

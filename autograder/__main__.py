"""``python -m autograder``: release the student versions, grade submissions, bundle, and run the
acceptance of a platform (``acceptance``, see :mod:`autograder.acceptance`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import DEFAULT_LESSONS, DEFAULT_SOLUTIONS, DEFAULT_WORK, UsageError
from .nbgrader_cli import skip_slow_imports


def positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m autograder",
        description="Generate the student notebooks of the course and autograde "
                    "submissions with nbgrader.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--lesson", metavar="ID",
                        help="only this lesson (e.g. 01_custom_rnns); default: all lessons")
    common.add_argument("--solutions", metavar="DIR", type=Path, default=DEFAULT_SOLUTIONS,
                        help="nbgrader source notebooks, DIR/<lesson_id>/*.ipynb "
                             "(default: %(default)s)")
    common.add_argument("--work", metavar="DIR", type=Path, default=DEFAULT_WORK,
                        help="work folder for nbgrader's course root, gradebook and logs "
                             "(default: %(default)s)")

    rel = sub.add_parser(
        "release", parents=[common],
        help="regenerate lessons/ (student versions) from solutions/",
        description="Regenerate LESSONS/<lesson_id>/ from SOLUTIONS/<lesson_id>/ with nbgrader "
                    "generate_assignment: solutions and hidden tests removed, no outputs, "
                    "same bytes for the same sources.")
    rel.add_argument("--lessons", metavar="DIR", type=Path, default=DEFAULT_LESSONS,
                     help="where the student versions go (default: %(default)s)")

    gra = sub.add_parser(
        "grade", parents=[common],
        help="autograde SUBMISSIONS/<student_id>/<lesson_id>/*.ipynb",
        description="Autograde SUBMISSIONS/<student_id>/<lesson_id>/*.ipynb, one nbgrader "
                    "process per submission, and write OUT/grades.csv, OUT/cells.csv and "
                    "OUT/feedback/<student_id>/<lesson_id>/*.html. Exits 0 when every "
                    "submission got its row, 2 when grading could not run. A speed bar that a busy "
                    "machine left undecided earns nothing yet (cells.csv says 'undecided'); the next "
                    "run of the same command measures only those again.")
    gra.add_argument("submissions", metavar="SUBMISSIONS", type=Path,
                     help="folder of student folders, each with <lesson_id>/ folders")
    gra.add_argument("--out", metavar="OUT", type=Path, required=True,
                     help="folder for grades.csv, cells.csv and feedback/")
    gra.add_argument("--db", metavar="URL", default=None,
                     help="gradebook database URL (default: sqlite:///WORK/gradebook.db)")
    gra.add_argument("--cell-timeout", metavar="S", type=positive(int), default=600,
                     help="seconds one cell may run before it is interrupted and counted "
                          "as an error (default: %(default)s)")
    gra.add_argument("--timeout", metavar="S", type=positive(float), default=1800,
                     help="seconds one submission may take in all before it is killed "
                          "and recorded as 'timeout' (default: %(default)s)")
    gra.add_argument("--jobs", metavar="N", type=positive(int), default=1,
                     help="grade N submissions at once (default: %(default)s)")
    gra.add_argument("--memory-mb", metavar="MB", type=positive(float), default=None,
                     help="memory cap of one submission's processes, and of the judge serving its checks "
                          "on its own count; above it the row is 'oom' (default: 4096, or 8192 with the "
                          "GPU's bars: each process holding CUDA keeps its libraries in host memory)")
    gra.add_argument("--sandbox", choices=("auto", "bwrap", "none"), default="auto",
                     help="confine submissions with bubblewrap (bwrap), or not (none); auto uses "
                          "bwrap when it works here (default: %(default)s)")
    gra.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                     help="cuda applies the GPU speed bars and refuses to run without CUDA; cpu "
                          "hides any GPU (default: %(default)s)")
    gra.add_argument("--force", action="store_true",
                     help="grade again what an earlier run already graded (default: resume)")
    gra.add_argument("--shard", metavar="K/N", default=None,
                     help="grade only share K of N (from 1 to N), balanced by each lesson's cost, so that N "
                          "machines finish together; when not given, read from Slurm job arrays, Kubernetes "
                          "Indexed Jobs, GitLab's parallel jobs or COURSE_SHARD (deploy/ has job files). "
                          "Give every shard the same --db, then run collect")
    gra.add_argument("--speed-retries", metavar="N", type=int, default=1, choices=range(0, 6),
                     help="how many more times a submission (or the instructor's run) is measured "
                          "when a speed bar was left undecided by a busy machine; what is still "
                          "undecided earns nothing yet and is measured again by the next grade run "
                          "(default: %(default)s)")

    col = sub.add_parser(
        "collect", help="write the class's grades.csv, cells.csv and feedback from the gradebook",
        description="Gather what every grade run (every shard) recorded in the gradebook into OUT: "
                    "grades.csv, cells.csv and feedback/, as one grade run over the whole class writes them.")
    col.add_argument("--out", metavar="OUT", type=Path, required=True, help="folder for the class's files")
    col.add_argument("--db", metavar="URL", default=None,
                     help="the gradebook the shards wrote (default: sqlite:///WORK/gradebook.db)")
    col.add_argument("--work", metavar="DIR", type=Path, default=DEFAULT_WORK,
                     help="work folder (default: %(default)s)")

    rep = sub.add_parser(
        "report", help="the instructor's report of a graded class: OUT/report/index.html",
        description="From OUT/grades.csv and OUT/cells.csv (what grade or collect wrote), write OUT/report/: "
                    "one HTML page per lesson (score distribution, pass rate and reasons for failing per "
                    "exercise, time and memory, flags to review, devices), an index, PNG charts, data.json.")
    rep.add_argument("out", metavar="OUT", type=Path, help="the folder grade --out (or collect --out) wrote")

    sim = sub.add_parser(
        "similarity", help="pairs of learners whose solution cells are alike (evidence, never a verdict)",
        description="Compare the solution cells of what grade graded (WORK/submitted/), lesson by lesson, as "
                    "syntax trees with names, formatting, comments and the code the lesson gives left out; list "
                    "the pairs at or above the threshold in OUT/similarity.csv and OUT/similarity.html.")
    sim.add_argument("--work", metavar="DIR", type=Path, default=DEFAULT_WORK,
                     help="the work folder of the grade run (default: %(default)s)")
    sim.add_argument("--out", metavar="OUT", type=Path, required=True, help="folder for the two files")
    sim.add_argument("--lesson", metavar="ID", default=None, help="only this lesson")
    sim.add_argument("--threshold", metavar="X", type=float, default=0.8,
                     help="least similarity listed, from 0 to 1 (default: %(default)s)")

    can = sub.add_parser(
        "canvas", help="the class's scores as a CSV Canvas's gradebook imports: OUT/canvas.csv",
        description="From OUT/grades.csv, write OUT/canvas.csv in the layout Canvas exports and imports. Best "
                    "with --roster (Canvas's own gradebook export): learners keep their Canvas identity, and "
                    "each lesson fills the assignment column whose title names it.")
    can.add_argument("out", metavar="OUT", type=Path, help="the folder grade --out (or collect --out) wrote")
    can.add_argument("--roster", metavar="CSV", type=Path, default=None,
                     help="Canvas's gradebook export (Grades > Export > CSV)")
    can.add_argument("--match", metavar="COLUMN", default="SIS Login ID",
                     help="the roster column holding the student ids of the submissions folder "
                          "(default: %(default)s)")
    can.add_argument("--title", metavar="LESSON=COLUMN", action="append", default=[],
                     help="the Canvas assignment column of a lesson, when its title does not name the lesson id")

    bun = sub.add_parser(
        "bundle", help="build the student-facing tree (no solutions, no hidden tests)",
        description="Copy what learners need into OUT: lessons/, the course package, the "
                    "environment files and README; nothing from solutions/, autograder/ or tests/.")
    bun.add_argument("out", metavar="OUT", type=Path, help="folder to create (must not exist)")
    sub.add_parser("acceptance", add_help=False,
                   help="grade every lesson at a device's sizes (perfect, untouched, planted), run the "
                        "benchmarks, write one summary: `python -m autograder acceptance --help`")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["acceptance"]:
        from .acceptance import main as acceptance

        return acceptance(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "bundle":
            from .bundle import bundle
            bundle(args.out.resolve())
        elif args.command == "canvas":
            from .canvas import export
            bad = [t for t in args.title if "=" not in t]
            if bad:
                raise UsageError(f"--title expects LESSON=COLUMN, got {bad[0]!r}")
            export(args.out.resolve(), roster=args.roster, match=args.match,
                   titles=dict(t.split("=", 1) for t in args.title))
        elif args.command == "similarity":
            from .similarity import similarity
            similarity(args.work.resolve(), args.out.resolve(), threshold=args.threshold, lesson=args.lesson)
        elif args.command == "report":
            from .class_report import write_report
            write_report(args.out.resolve())
        elif args.command == "collect":
            from .collect import collect
            collect(args.out.resolve(), args.work.resolve(), db_url=args.db)
        elif args.command == "release":
            from .release import release
            release(args.solutions.resolve(), args.lessons.resolve(), args.work.resolve(),
                    lesson=args.lesson)
        else:
            from .grade import grade
            from .shard import parse as parse_shard
            grade(args.submissions.resolve(), args.out.resolve(), args.solutions.resolve(),
                  args.work.resolve(), lesson=args.lesson, db_url=args.db,
                  cell_timeout=args.cell_timeout, timeout=args.timeout, jobs=args.jobs,
                  sandbox=args.sandbox, memory_mb=args.memory_mb, device=args.device, force=args.force,
                  speed_retries=args.speed_retries,
                  shard=parse_shard(args.shard) if args.shard else None)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    skip_slow_imports()  # this process imports nbformat and nbgrader's gradebook too
    sys.exit(main())

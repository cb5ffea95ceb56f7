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
    gra.add_argument("--memory-mb", metavar="MB", type=positive(float), default=4096,
                     help="memory cap of one submission's processes; above it the row is 'oom' "
                          "(default: %(default)s)")
    gra.add_argument("--sandbox", choices=("auto", "bwrap", "none"), default="auto",
                     help="confine submissions with bubblewrap (bwrap), or not (none); auto uses "
                          "bwrap when it works here (default: %(default)s)")
    gra.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                     help="cuda applies the GPU speed bars and refuses to run without CUDA; cpu "
                          "hides any GPU (default: %(default)s)")
    gra.add_argument("--force", action="store_true",
                     help="grade again what an earlier run already graded (default: resume)")
    gra.add_argument("--speed-retries", metavar="N", type=int, default=1, choices=range(0, 6),
                     help="how many more times a submission (or the instructor's run) is measured "
                          "when a speed bar was left undecided by a busy machine; what is still "
                          "undecided earns nothing yet and is measured again by the next grade run "
                          "(default: %(default)s)")

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
        elif args.command == "release":
            from .release import release
            release(args.solutions.resolve(), args.lessons.resolve(), args.work.resolve(),
                    lesson=args.lesson)
        else:
            from .grade import grade
            grade(args.submissions.resolve(), args.out.resolve(), args.solutions.resolve(),
                  args.work.resolve(), lesson=args.lesson, db_url=args.db,
                  cell_timeout=args.cell_timeout, timeout=args.timeout, jobs=args.jobs,
                  sandbox=args.sandbox, memory_mb=args.memory_mb, device=args.device, force=args.force,
                  speed_retries=args.speed_retries)
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

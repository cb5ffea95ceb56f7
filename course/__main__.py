"""``python -m course``: the learner's commands.

  doctor [--json] [--short]      what the course sees of this machine
  check NOTEBOOK...              run saved lesson notebooks, report which exercises pass
  progress [--dir D] [--run]     which exercises of which lessons pass (from the checks so far)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m course", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", help="report Python, torch, the device and known caveats")
    doc.add_argument("--json", action="store_true", help="print the report as JSON")
    doc.add_argument("--short", action="store_true", help="print only the first lines")
    doc.add_argument("--device", default=None, help="'cpu' or 'cuda' (default: CUDA if present)")

    check = sub.add_parser("check", help="run saved lesson notebooks in a fresh kernel and report "
                           "which exercises pass (the visible tests; nothing is graded)")
    check.add_argument("notebooks", nargs="+", type=Path, metavar="NOTEBOOK")
    check.add_argument("--lesson", default=None, help="the lesson id, when the file name does not say")
    check.add_argument("--cell-timeout", type=int, default=900, help="seconds per cell (900)")

    prog = sub.add_parser("progress", help="which exercises of which lessons pass")
    prog.add_argument("--dir", type=Path, default=None,
                      help="the folder of your lesson notebooks (default: ./lessons, or .)")
    prog.add_argument("--run", action="store_true",
                      help="first check every lesson whose notebook changed since its last check")
    prog.add_argument("--cell-timeout", type=int, default=900, help="seconds per cell (900)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "doctor":
            return _doctor(args)
        if args.command == "check":
            return _check(args)
        return _progress(args)
    except (RuntimeError, ValueError) as exc:
        print(f"course {args.command}: {exc}", file=sys.stderr)
        return 2


def _doctor(args: argparse.Namespace) -> int:
    from course.doctor import doctor

    rep = doctor(args.device, show=not args.json, short=args.short)
    if args.json:
        print(json.dumps(rep.as_dict(), indent=2))
    return 0


def _check(args: argparse.Namespace) -> int:
    from course.selfcheck import check_notebook

    missing = [str(p) for p in args.notebooks if not p.is_file()]
    if missing:
        raise ValueError(f"no such notebook: {', '.join(missing)}. Expected a lesson's .ipynb "
                         "file, as in lessons/01_custom_rnns/01_custom_rnns.ipynb.")
    all_pass = True
    for path in args.notebooks:
        print(f"checking {path}: runs the whole notebook in a fresh kernel (minutes on a CPU)",
              flush=True)
        report = check_notebook(path, lesson_id=args.lesson, cell_timeout=args.cell_timeout)
        print(report, flush=True)
        all_pass &= report.complete
    return 0 if all_pass else 1


def _progress(args: argparse.Namespace) -> int:
    from course.progress import summary

    folder = args.dir or (Path("lessons") if Path("lessons").is_dir() else Path("."))
    if not folder.is_dir():
        raise ValueError(f"no folder {folder}: pass --dir with the folder of your lesson notebooks.")
    print(summary(folder, run=args.run, cell_timeout=args.cell_timeout))
    return 0


if __name__ == "__main__":
    sys.exit(main())

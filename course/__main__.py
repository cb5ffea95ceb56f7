"""``python -m course doctor [--json] [--short]``: the environment report from a shell."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", help="report Python, torch, the device and known caveats")
    doc.add_argument("--json", action="store_true", help="print the report as JSON")
    doc.add_argument("--short", action="store_true", help="print only the first lines")
    doc.add_argument("--device", default=None, help="'cpu' or 'cuda' (default: CUDA if present)")
    args = parser.parse_args(argv)

    from course.doctor import doctor

    if args.command == "doctor":
        try:
            rep = doctor(args.device, show=not args.json, short=args.short)
        except (RuntimeError, ValueError) as exc:
            print(f"course doctor: {exc}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(rep.as_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

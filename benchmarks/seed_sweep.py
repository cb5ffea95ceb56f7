"""The hidden tests' checks on the instructor's solutions, on seeds drawn from fresh keys.

Under the grader a test cell's seeds are drawn from the class's secret key
(:func:`course.checks.draw_seeds`), so every grading run checks the instructor's solution and the
learners' on inputs no earlier run used. A check that passes the right answer on the seeds its
author tried and fails it on some other draw (a tolerance too tight, a case that happens to be
degenerate) would fail a whole class. This runs, for each lesson, every seeded check call of its
hidden tests (speed checks left out: their inputs come from the operating system already) on the
instructor's solution, served across a pipe as the grader serves it, under ``--keys`` fresh keys,
each key in a process of its own::

    python benchmarks/seed_sweep.py --keys 5 [--lesson 07_broadcasting_indexing_higher_order]

It prints one line per failure and a summary, and exits non-zero if any call failed. A structure
clock a busy machine left undecided (``SpeedUndecided``) is counted apart: it is no failure of the seed.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def hidden_calls(lesson: str) -> list[str]:
    """The seeded check calls of ``lesson``'s served test cells, hidden tests only, as source."""
    from autograder.program import HIDDEN, TEST, instructor_program

    source = ROOT / "solutions" / lesson / f"{lesson}.ipynb"
    program = instructor_program(lesson, source)
    found = []
    for cell in program.cells:
        if cell.kind != TEST or not cell.served:
            continue
        for block in HIDDEN.findall(cell.source):
            for node in ast.parse(block.replace("### BEGIN HIDDEN TESTS", "").replace("### END HIDDEN TESTS", "")).body:
                call = node.value if isinstance(node, ast.Expr) else None
                if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                        and call.func.id.startswith("check_") and not call.func.id.endswith("_speed")
                        and any(k.arg == "seed" for k in call.keywords)):
                    found.append(ast.unparse(call))
    return found


def run_one(lesson: str, key: bytes) -> list[dict]:
    """Every hidden seeded call of ``lesson`` under ``key``, in this process: what each did."""
    import builtins

    import course.checks
    from autograder.program import instructor_program
    from autograder.sandbox.judge import learner_names
    from autograder.solution_code import load_solution, solution_source
    from course.grading import SpeedUndecided
    from course.remote import Remote, serve_in_thread

    os.environ["COURSE_SELF_CHECK_SKIP"] = "1"
    course.checks.draw_seeds(key)
    program = instructor_program(lesson, ROOT / "solutions" / lesson / f"{lesson}.ipynb")
    folder = Path(tempfile.mkdtemp(prefix="sweep-"))
    solution = load_solution(solution_source(lesson), folder / f"sweep_{lesson[:2]}.py", f"sweep_{lesson[:2]}")
    trusted: dict = {"__name__": "__main__", "__builtins__": builtins}
    for source in program.judge_setup:
        exec(compile(source, "<instructor set-up>", "exec"), trusted)

    results = []
    with serve_in_thread(vars(solution)) as judge:  # a thread here, a process under the grader
        for call in hidden_calls(lesson):
            namespace = dict(trusted)
            for name in learner_names(call, trusted):
                namespace[name] = Remote(judge, name)
            start = time.monotonic()
            error = undecided = ""
            try:
                exec(compile(call, "<hidden test>", "exec"), namespace)
            except SpeedUndecided as exc:  # a structure clock a busy machine left undecided: not the seed's doing
                undecided = str(exc)[:300]
            except BaseException as exc:  # noqa: BLE001 - reported, the sweep goes on
                error = f"{type(exc).__name__}: {exc}"[:1500]
            results.append({"call": call, "error": error, "undecided": undecided,
                            "seconds": round(time.monotonic() - start, 2)})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=3, help="fresh keys per lesson (default 3)")
    parser.add_argument("--lesson", action="append", help="a lesson id (repeatable; default: every lesson)")
    parser.add_argument("--one", nargs=2, metavar=("LESSON", "KEY_HEX"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one[0], bytes.fromhex(args.one[1]))), flush=True)
        os._exit(0)  # no interpreter shutdown: the serving thread and torch's pools are not torn down
    from autograder.workspace import lesson_ids

    lessons = args.lesson or lesson_ids(ROOT / "solutions")
    failed = total = undecided = 0
    for lesson in lessons:
        for _ in range(args.keys):
            key = os.urandom(32).hex()
            out = subprocess.run([sys.executable, __file__, "--one", lesson, key], capture_output=True, text=True,
                                 cwd=ROOT, timeout=1800)
            if out.returncode != 0:
                print(f"{lesson} key {key}: the sweep itself failed (rc {out.returncode}):\n{out.stderr[-2000:]}",
                      flush=True)
                failed += 1
                continue
            results = json.loads(out.stdout.strip().splitlines()[-1])
            total += len(results)
            bad = [r for r in results if r["error"]]
            failed += len(bad)
            busy = [r for r in results if r["undecided"]]
            undecided += len(busy)
            print(f"{lesson} key {key[:8]}: {len(results) - len(bad) - len(busy)}/{len(results)} passed"
                  + (f", {len(busy)} undecided (a busy machine)" if busy else "")
                  + f" in {sum(r['seconds'] for r in results):.1f} s", flush=True)
            for r in bad:
                print(f"  FAILED {r['call']}\n    {r['error']}", flush=True)
    print(f"{total - failed - undecided} of {total} calls passed on drawn seeds, {failed} failed, {undecided} "
          f"undecided ({len(lessons)} lessons, {args.keys} keys each)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

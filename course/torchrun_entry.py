"""What each process that :func:`course.parallel.torchrun` starts runs first: confine itself as the
course's workers do (under the grader; nothing elsewhere), then run the script as ``__main__``.

``python -m course.torchrun_entry SCRIPT [ARGS...]``: torchrun's ``-m`` form starts this module in
every process with the environment torchrun set (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...)."""

from __future__ import annotations

import runpy
import sys

if __name__ == "__main__":
    from course.parallel import _confine

    report = _confine()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        for name, detail in report():
            print(f"[grading] {name}: {detail}", file=sys.stderr)

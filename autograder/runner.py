"""Run one command in its own process group, with a wall-clock limit and rusage.

Used for nbgrader's own commands (``generate_assignment`` when releasing and when preparing
a lesson for grading): each runs in a new session, is killed together with all its
descendants when it runs past its time, and its peak memory is read from the kernel's own
accounting (``os.wait4``). Submissions never run here: they run in the grading sandbox
(``autograder/sandbox/``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .proc import kill_tree


# ru_maxrss is in KiB on Linux and in bytes on macOS.
_RSS_UNITS_PER_MB = 1024.0 * 1024.0 if sys.platform == "darwin" else 1024.0


@dataclass
class RunResult:
    returncode: int | None  # None when the command was killed for running out of time
    seconds: float
    peak_rss_mb: float
    timed_out: bool
    log: Path


def run_limited(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float,
                log: Path) -> RunResult:
    """Run ``cmd`` with stdout and stderr into ``log``; kill its whole tree after ``timeout`` s."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    deadline = start + max(timeout, 0.0)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = False
        delay = 0.02
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() >= deadline:
                timed_out = True
                kill_tree(proc.pid)
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)
        # Popen must not try to reap the process a second time.
        proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.monotonic() - start
    if timed_out:
        with open(log, "a", encoding="utf-8") as out:
            out.write(f"\n[autograder] killed after {timeout:g} s (process tree of pid {proc.pid})\n")
    return RunResult(
        returncode=None if timed_out else proc.returncode,
        seconds=seconds,
        peak_rss_mb=usage.ru_maxrss / _RSS_UNITS_PER_MB,
        timed_out=timed_out,
        log=log,
    )

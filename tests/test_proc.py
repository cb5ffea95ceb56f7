"""Process trees (``autograder.proc``): which processes are Python interpreters, whatever their main
thread is called."""

from __future__ import annotations

import subprocess
import sys
import time

from autograder.proc import is_python, signal_tree

RENAMED = """
import signal, sys, time
signal.signal(signal.SIGALRM, lambda *_: (print("alarmed", flush=True), sys.exit(0)))
with open("/proc/self/comm", "w") as fh:
    fh.write(sys.argv[1])  # as torch 2.4 does as it loads ("pt_main_thread"), or as any code may
print("ready", flush=True)
time.sleep(30)
"""


def test_a_python_whose_main_thread_is_renamed_is_still_python_and_gets_the_alarm():
    for name in ("pt_main_thread", "sleep"):
        proc = subprocess.Popen([sys.executable, "-c", RENAMED, name], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            with open(f"/proc/{proc.pid}/comm") as fh:
                assert fh.read().strip() == name
            assert is_python(proc.pid)
            signal_tree(proc.pid, __import__("signal").SIGALRM, only=is_python)
            assert proc.stdout.readline().strip() == "alarmed"
            assert proc.wait(10) == 0
        finally:
            proc.kill()
            proc.wait()


def test_a_process_that_is_not_python_is_not_even_when_named_so():
    proc = subprocess.Popen(["bash", "-c", "printf python > /proc/$$/comm; sleep 30; true"])
    try:
        time.sleep(0.3)
        assert not is_python(proc.pid)
    finally:
        proc.kill()
        proc.wait()

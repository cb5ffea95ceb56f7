"""How the grading parent counts a host's memory (the program host, and the workers it starts for lesson
10): each process's private pages, and the file-backed pages (the libraries every one of them maps) once."""

from __future__ import annotations

import subprocess
import sys
import time

from autograder.sandbox.parent import _private_bytes_and_files_once, _resident_bytes

HOLDS = "import sys, time\nblock = bytearray(int(sys.argv[1]) * 2**20)\nblock[::4096] = b'x' * len(block[::4096])\n" \
        "print('ready', flush=True)\ntime.sleep(60)\n"


def _started(mb: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDS, str(mb)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_private_memory_counts_in_full_and_the_libraries_once():
    procs = [_started(mb) for mb in (64, 64, 128)]
    try:
        time.sleep(0.1)
        pids = [p.pid for p in procs]
        once, summed = _private_bytes_and_files_once(pids), _resident_bytes(pids)
        assert once >= 256 * 2**20  # every private page, in every process
        assert once <= summed  # never more than the plain sum
        one = _private_bytes_and_files_once(pids[:1])
        assert abs(one - _resident_bytes(pids[:1])) < 2 * 2**20  # one process: its resident memory
        assert summed - once > 2 * 2**20  # the interpreter's mapped files, counted once rather than three times
    finally:
        for p in procs:
            p.kill()
            p.wait()

"""Descriptors numbered past 1,024, which ``select.select`` refuses (ValueError): a process with
many files open (a grader with many submissions at once) gets such numbers for its pipes. The
judge/learner channel and the grading parent wait on their pipes with ``poll``."""

from __future__ import annotations

import os
import resource
import threading

import pytest

from autograder.sandbox import parent
from course.remote import Link


@pytest.fixture
def high_pipes():
    """Two pipes, ``(a_r, a_w, b_r, b_w)``, numbered 1100 to 1103."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if max(soft, hard) < 1200:
        pytest.skip(f"this machine allows {max(soft, hard)} open files")
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1200, hard))
    low = [*os.pipe(), *os.pipe()]
    high = [os.dup2(fd, 1100 + i) for i, fd in enumerate(low)]
    for fd in low:
        os.close(fd)
    yield high
    for fd in high:
        try:
            os.close(fd)
        except OSError:
            pass
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_channel_works_on_descriptors_numbered_past_select_s_limit(high_pipes):
    a_r, a_w, b_r, b_w = high_pipes
    judge, learner = Link(a_w, b_r), Link(b_w, a_r)
    big = "x" * 300_000  # more than a pipe holds: the send waits for room, the receive for bytes
    sender = threading.Thread(target=judge.send, args=({"ok": big},))
    sender.start()
    assert learner.receive() == {"ok": big}
    sender.join()
    learner.send("back")
    assert judge.receive() == "back"


def test_the_parent_hears_bytes_and_a_closed_pipe_on_high_descriptors(high_pipes):
    a_r, a_w, b_r, b_w = high_pipes
    assert parent._readable([a_r, b_r], 0.05) == set()
    os.write(a_w, b"report")
    assert parent._readable([a_r, b_r], 0.05) == {a_r}
    os.close(b_w)  # the process ended: its pipe reads b"", and the parent must see that
    assert parent._readable([a_r, b_r], 0.05) == {a_r, b_r}
    assert os.read(b_r, 10) == b""

"""The host uids of confined processes when the grader runs as root (``autograder/sandbox/uids.py``):
never one that an account, a running process or another grader's claim holds. The reason for them,
one learner's threads counted against a classmate's sandbox, is tested end to end in
``tests/test_hostile_grading.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest

from autograder.sandbox import uids

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def first_try(monkeypatch):
    """Every claim tries the range's first uid first (the random start pinned)."""
    monkeypatch.setattr(uids.secrets, "randbelow", lambda n: 0)


def test_claims_are_distinct_and_a_released_uid_is_free_again(first_try):
    held = [uids.claim() for _ in range(5)]
    got = [c.uid for c in held]
    assert len(set(got)) == 5 and all(uids.base() <= u < uids.base() + uids.SPAN for u in got), got
    held[0].release()
    again = uids.claim()
    assert again.uid == got[0]
    for c in [again, *held[1:]]:
        c.release()


def test_a_uid_another_grader_holds_is_passed_over(first_try):
    code = ("import sys, time; from autograder.sandbox import uids\n"
            "uids.secrets.randbelow = lambda n: 0\n"
            "c = uids.claim(); print(c.uid, flush=True); time.sleep(30)\n")
    other = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        theirs = int(other.stdout.readline())
        mine = uids.claim()
        assert mine.uid != theirs, (mine.uid, theirs)
        mine.release()
    finally:
        other.kill()
        other.wait()
    time.sleep(0.1)  # the kernel drops a dead process's lock
    back = uids.claim()
    assert back.uid == theirs
    back.release()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can start a process as another uid")
def test_a_uid_a_running_process_has_is_passed_over(first_try):
    first = uids.base()
    squatter = subprocess.Popen(["setpriv", f"--reuid={first}", f"--regid={first}", "--clear-groups", "sleep", "30"])
    try:
        deadline = time.monotonic() + 10
        while not uids._in_use(first) and time.monotonic() < deadline:
            time.sleep(0.05)
        mine = uids.claim()
        assert mine.uid != first
        mine.release()
    finally:
        squatter.kill()
        squatter.wait()


def test_a_uid_with_an_account_is_passed_over(first_try, monkeypatch):
    monkeypatch.setattr(uids, "_has_account", lambda uid: uid == uids.base())
    mine = uids.claim()
    assert mine.uid == uids.base() + 1
    mine.release()


def test_a_bad_range_is_refused_with_what_to_give(monkeypatch):
    for bad, says in (("lots", "whole number"), ("12", "from 1000"), (str(2**31), "from 1000")):
        monkeypatch.setenv(uids.BASE_ENV, bad)
        with pytest.raises(ValueError, match=says):
            uids.base()
    monkeypatch.setenv(uids.BASE_ENV, "3000000")
    assert uids.base() == 3000000


def test_a_lock_folder_laid_as_a_trap_is_refused(monkeypatch, tmp_path):
    real_access = os.access
    monkeypatch.setattr(uids.os, "access", lambda p, m: False if str(p) == "/run" else real_access(p, m))
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "course-grading-uids").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RuntimeError, match="writable by it alone"):
        uids.claim()
    (tmp_path / "course-grading-uids").unlink()
    (tmp_path / "course-grading-uids").mkdir(mode=0o777)
    os.chmod(tmp_path / "course-grading-uids", 0o777)  # anyone could plant a lock there
    with pytest.raises(RuntimeError, match="writable by it alone"):
        uids.claim()

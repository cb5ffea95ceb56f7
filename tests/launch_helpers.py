"""What the launch tests share: a solved lesson on disk, system packages, free ports, fresh venvs."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from autograder.solution_code import solved_notebook

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("COURSE_TEST_ARTIFACTS", ROOT / "test-artifacts"))


def write_solved(folder: Path, lesson_id: str) -> Path:
    """``folder/<id>/<id>.ipynb``: the lesson as a learner who finished it would have it."""
    path = folder / lesson_id / f"{lesson_id}.ipynb"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(solved_notebook(lesson_id), indent=1, ensure_ascii=False))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def system_package(command: str, package: str, require_env: str) -> str:
    """The path of ``command``, installing Debian's ``package`` when missing and this is root
    with apt-get (as on CI); otherwise skip, or fail where ``require_env`` says it must run."""
    found = shutil.which(command)
    if not found and shutil.which("apt-get") and os.geteuid() == 0:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-qq", package], env=env, capture_output=True,
                       timeout=900)
        found = shutil.which(command)
    if not found:
        why = (f"{command} is not installed (Debian package {package}; this test installs it "
               "itself when it runs as root with apt-get)")
        if os.environ.get(require_env):
            pytest.fail(f"{why}, and {require_env} says this test must run")
        pytest.skip(why)
    return found


def fresh_venv(path: Path, log: Path) -> Path:
    """A new virtual environment with pip only; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    python = path / "bin" / "python"
    pip(python, ["install", "--upgrade", "pip>=23.2"], log)
    return python


def pip(python: Path, args: list[str], log: Path, *, timeout: int = 900) -> None:
    with log.open("a") as f:
        f.write(f"$ pip {' '.join(args)}\n")
        f.flush()
        proc = subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *args],
                              stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    assert proc.returncode == 0, f"pip {' '.join(args)} failed; its log: {log}"

"""Environment report: ``course.doctor()`` in a notebook, ``python -m course doctor`` in a shell.

It says what a learner (or an instructor reading a bug report) needs first: Python, torch, the
device, where the notebook runs, and the known caveats, and returns the same as data.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

__all__ = ["Report", "doctor", "machine_name", "where_running"]

TESTED_TORCH = ("2.4", "2.15")  # the range of pyproject.toml (docs/compatibility.md), inclusive of minor releases


@dataclass
class Report:
    python: str
    torch: str
    device: str
    cuda: dict | None
    mps: bool
    cpu_threads: int
    cpu_count: int
    memory_limit_gb: float | None
    where: str
    cxx_compiler: str | None
    caveats: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)

    def lines(self, short: bool = False) -> list[str]:
        cuda = ("no" if not self.cuda else
                f"{self.cuda['name']} (capability {self.cuda['capability']}, "
                f"CUDA {self.cuda['version']}, {self.cuda['memory_gb']} GB)")
        rows = [
            ("Python", self.python),
            ("torch", self.torch),
            ("device used", self.device),
            ("CUDA GPU", cuda),
            ("Apple MPS", "yes" if self.mps else "no"),
            ("CPU threads", f"{self.cpu_threads} torch threads, {self.cpu_count} CPUs"),
            ("memory limit", "unknown" if self.memory_limit_gb is None else f"{self.memory_limit_gb} GB"),
            ("running in", self.where),
            ("C++ compiler", self.cxx_compiler or "none found"),
        ]
        if short:
            rows = rows[:3] + rows[7:8]
        out = [f"{k:>13}: {v}" for k, v in rows]
        out += [f"{'caveat':>13}: {c}" for c in self.caveats]
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def where_running(environ: dict | None = None, modules: dict | None = None) -> str:
    """Colab, Binder, JupyterLab (or another Jupyter front end), or plain Python."""
    env = os.environ if environ is None else environ
    mods = sys.modules if modules is None else modules
    if "google.colab" in mods or "COLAB_RELEASE_TAG" in env:
        return "Colab"
    if "BINDER_SERVICE_HOST" in env or "BINDER_REPO_URL" in env or "BINDER_LAUNCH_HOST" in env:
        return "Binder"
    if "ipykernel" in mods:
        return "JupyterLab" if "JPY_SESSION_NAME" in env or "JPY_PARENT_PID" in env else "Jupyter kernel"
    return "plain Python"


def _memory_limit_gb() -> float | None:
    limits = []
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            limits.append(int(text))
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                limits.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    return round(min(limits) / 2**30, 1) if limits else None


def _version_tuple(v: str) -> tuple[int, int]:
    parts = v.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def _caveats(rep: Report) -> list[str]:
    out = []
    tv = _version_tuple(rep.torch)
    if tv >= (2, 12):  # a DeprecationWarning in 2.12 and 2.13, a FutureWarning from 2.14
        out.append("torch.jit.script is deprecated in this torch: it still works; the course "
                   "explains the warning once and moves on to torch.compile.")
    if tv > _version_tuple(TESTED_TORCH[1]):
        out.append(f"torch {rep.torch} is newer than this release was tested with ({TESTED_TORCH[0]} to "
                   f"{TESTED_TORCH[1]}): lessons should run, but a message or a figure may differ; if a cell "
                   "fails, the README's set-up installs the tested version.")
    elif tv < _version_tuple(TESTED_TORCH[0]):
        out.append(f"torch {rep.torch} is older than this release was tested with ({TESTED_TORCH[0]} to "
                   f"{TESTED_TORCH[1]}): some lessons use features it lacks; install a newer one.")
    if rep.cuda is None and torch.version.cuda and rep.device == "cpu":
        out.append(f"this torch is built for CUDA {torch.version.cuda}, but no GPU is visible (a CPU runtime, "
                   "such as Colab's default): lessons use their CPU sizes.")
    if rep.device == "cpu" and rep.cxx_compiler is None:
        out.append("no C++ compiler found: torch.compile needs one on the CPU "
                   "(install gcc or clang, or run on a GPU).")
    if rep.device == "cpu":
        out.append("no GPU: lessons use their small CPU sizes, and the speed bars are the ones "
                   "a 2-core CPU can honestly show.")
    if rep.memory_limit_gb is not None and rep.memory_limit_gb < 2:
        out.append(f"only {rep.memory_limit_gb} GB of memory: lessons are sized for 2 GB.")
    return out


def collect(device: str | None = None) -> Report:
    from course.devices import pick_device

    dev = pick_device(device)
    cuda = None
    if torch.cuda.is_available():
        idx = dev.index or 0 if dev.type == "cuda" else 0
        props = torch.cuda.get_device_properties(idx)
        cuda = {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "version": torch.version.cuda,
            "memory_gb": round(props.total_memory / 2**30, 1),
            "count": torch.cuda.device_count(),
        }
    mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    rep = Report(
        python=platform.python_version(),
        torch=torch.__version__,
        device=str(dev),
        cuda=cuda,
        mps=mps,
        cpu_threads=torch.get_num_threads(),
        cpu_count=os.cpu_count() or 1,
        memory_limit_gb=_memory_limit_gb(),
        where=where_running(),
        cxx_compiler=shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++") or shutil.which("clang++"),
    )
    rep.caveats = _caveats(rep)
    return rep


def doctor(device: str | None = None, *, show: bool = True, short: bool = False) -> Report:
    """Print (unless ``show=False``) and return a report of the environment."""
    rep = collect(device)
    if show:
        print("\n".join(rep.lines(short=short)))
    return rep


def machine_name() -> str:
    """The machine as benchmark records name it: the GPU's name, or the CPU model and torch's threads."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    n = torch.get_num_threads()
    return f"{name}, {n} thread{'' if n == 1 else 's'}"

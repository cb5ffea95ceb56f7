"""What the first GPU acceptance run (an H100, 2026-11-25) found, kept true on a machine without one.

- Parts of checks that work on the CPU by design (float64 folding, the judge's clocks on tiny
  models, the profiler's planted graph) drew some tensors on the default device: on a GPU the
  model sat on the CPU and its input on CUDA. Here the default device is poisoned (``meta``) and
  those parts must still run, on the CPU.
- float32 on a GPU is float32: ``import course`` turns TF32 off.
- The sandbox binds the GPU's device files after ``--dev /dev``, which would hide them.
- A call whose arguments are only modules (a list of models) returns its result on their device.
- The third run (an H200, 2026-12-04): lesson 2's profiler ran its real model on the default device,
  but its profile came back on the CPU (a probe's results land on its arguments' device, and it
  had no tensor among them); and three processes holding CUDA passed the CPU's memory cap.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import course
from autograder.solution_code import load_solution, solution_source

META = torch.device("meta")


@pytest.fixture
def default_elsewhere(monkeypatch):
    """Every course module's ``pick_device()`` with no preference answers ``meta``: a stand-in for
    a GPU that makes any tensor drawn on the default device unusable beside a CPU one."""
    from course import devices

    original = devices.pick_device

    def poisoned(prefer=None):
        return META if prefer is None else original(prefer)

    for name, module in list(sys.modules.items()):
        if name.split(".")[0] == "course" and getattr(module, "pick_device", None) is original:
            monkeypatch.setattr(module, "pick_device", poisoned)
    yield poisoned
    # a course module first imported during the test bound the poisoned function by name: not
    # monkeypatch's to undo, so it is undone here (else later tests in the process draw on meta)
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] == "course" and getattr(module, "pick_device", None) is poisoned:
            setattr(module, "pick_device", original)


def _devices(value) -> set[str]:
    found: set[str] = set()

    def walk(v):
        if isinstance(v, torch.Tensor):
            found.add(v.device.type)
        elif isinstance(v, nn.Module):
            found.update(t.device.type for t in [*v.parameters(), *v.buffers()])
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
    walk(value)
    return found


def test_the_poisoned_default_reaches_the_course(default_elsewhere):
    from course.data import randn

    assert randn(2, seed=0).device == META          # the fixture bites where the checks draw
    assert randn(2, seed=0, device="cpu").device.type == "cpu"


def test_fold_check_works_on_the_cpu_whatever_the_default_device(default_elsewhere, tmp_path):
    from course.checks import fx as C

    fx = load_solution(solution_source("02_fx_transforms"), tmp_path / "fx_sol.py", "fx_sol_gpu")
    C.check_fold_conv_bn(fx.fold_conv_bn)
    C.check_fold_conv_bn(fx.fold_conv_bn, bias=False, groups=5, c_in=5, eps=1e-3)


def test_the_profiler_probe_graph_and_its_input_share_a_device(default_elsewhere):
    from course.checks.fx import _profiled_graph, _profiled_resnet

    root, gm, x = _profiled_graph(0)
    assert _devices([root, gm, x]) == {"cpu"}
    # the real model too: its profile came back to the judge on the CPU (the probe's arguments hold no
    # tensor) and was compared with the judge's model on the GPU (the third GPU run, an H200)
    model, gm, x = _profiled_resnet(0, 8, (1, 1))
    assert _devices([model, gm, x]) == {"cpu"}


def test_the_profiler_check_passes_whatever_the_default_device(default_elsewhere, tmp_path):
    from course.checks import fx as C

    fx = load_solution(solution_source("02_fx_transforms"), tmp_path / "fx_prof.py", "fx_sol_prof")
    C.check_profiler(fx.ProfilingInterpreter)


def test_the_picker_cases_live_on_the_cpu(default_elsewhere):
    from course.checks.jacobians import _picker_cases

    for f, x, _, _ in _picker_cases(0):
        assert _devices([f, x]) == {"cpu"}, f


def test_the_judges_clock_cases_live_on_the_cpu(default_elsewhere, monkeypatch):
    """The makers the judge's clocks use (lessons 5 and 6) build on the CPU: caught by calling each
    clock with a recorder in place of the clock itself."""
    from course.checks import jacobians as CJ
    from course.checks import vmap as CV

    made = []

    def record(fn, name, make, *args, **kwargs):
        for size in (2, 4):
            made.append(make(size, 0) if make.__code__.co_argcount > 1 else make(size))
        raise _Stop

    class _Stop(Exception):
        pass

    monkeypatch.setattr(CJ, "_growth", record)
    for call in (lambda: CJ._no_batch_loop(None, "f", CJ.tanh_layer(3, 4, seed=0, device="cpu"), 4, 0, None),
                 lambda: CJ._rows_growth(None, "f", 0),
                 lambda: CJ._hvp_growth(None, "f", 0)):
        with pytest.raises(_Stop):
            call()
    def clock(fn, label, setup, *args, **kwargs):  # the stateless base of an ensemble is on meta by design
        given = setup()
        args = (given["make"](1) if given["make"] is not None else  # a factory's, after the staged state
                (*given.get("constants", ()), *given["factory"](1, device="cpu", **given["sizes"])))
        made.append([v for v in args if not (isinstance(v, nn.Module) and _devices(v) == {"meta"})])
        return ""

    monkeypatch.setattr(CV, "_expect_no_loop_by_clock", clock)
    CV._per_sample_clock(None, "f")
    CV._ensemble_clock(None, "f", False)
    CV._ensemble_clock(None, "f", True)
    CV._sgd_clock(None, "f", 0.1)
    assert len(made) == 10
    for case in made:
        assert _devices(case) == {"cpu"}, case


def test_import_course_turns_tf32_off():
    code = ("import torch\n"
            "torch.backends.cudnn.allow_tf32 = True\n"
            "torch.backends.cuda.matmul.allow_tf32 = True\n"
            "import course\n"
            "print(torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)\n")
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
    assert "exact_float32" in course.__all__


def test_inductors_tf32_advice_is_not_shown():
    """The H200 run showed lesson 1's learners torch.compile's advice to turn TF32 on, which the
    course turns off on purpose. The filter matches torch's own words (read from its source, so a
    rewording shows up here), and silences nothing else."""
    import inspect

    import torch._inductor.compile_fx as compile_fx

    source = inspect.getsource(compile_fx)
    start = source.index("TensorFloat32 tensor cores")
    words = "".join(part.strip().strip('"') for part in source[start - 1:start + 200].split("\n")[:2])
    assert "available but not enabled" in words
    code = ("import warnings\n"
            "import course\n"
            f"warnings.warn({words!r}, UserWarning)\n"
            "warnings.warn('another warning', UserWarning)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "TensorFloat32" not in out.stderr and "another warning" in out.stderr


def test_the_sandbox_binds_gpu_devices_after_making_dev(monkeypatch):
    from autograder.sandbox import parent

    real_exists = Path.exists
    monkeypatch.setattr(Path, "exists", lambda self: str(self) == "/dev/nvidiactl" or real_exists(self))
    argv = parent._bwrap_argv("child.py", [], uid=2_100_000_000)
    dev = argv.index("--dev")
    binds = [i for i, a in enumerate(argv) if a == "/dev/nvidiactl"]
    assert binds and min(binds) > dev, "a device bound before --dev /dev is hidden by it"
    assert "/dev/nvidia0" in argv and "/dev/nvidia-uvm" in argv
    env = parent._env({})
    assert env["TORCHINDUCTOR_COMPILE_THREADS"] in ("1", "2")


def test_a_call_of_modules_alone_returns_on_their_device():
    from course.remote import _call_device

    class OnGpu(nn.Module):  # a module reporting a CUDA parameter, without needing a GPU
        def parameters(self, recurse=True):
            return iter([type("T", (), {"device": torch.device("cuda:0")})()])

    meta = nn.Linear(2, 2, device="meta")
    assert _call_device(([[meta, OnGpu()]], {})) == "cuda:0"
    assert _call_device(([meta], {})) == "cpu"
    assert _call_device(((torch.zeros(1), [OnGpu()]), {})) == "cpu"   # a tensor argument decides first
    assert _call_device(((), {"models": (OnGpu(),)})) == "cuda:0"


def test_the_memory_cap_left_unset_follows_the_device_whose_bars_apply():
    """Three processes holding CUDA passed the CPU's 4,096 MB in lesson 1's instructor run (H200): with
    no --memory-mb, grading with the GPU's bars caps at 8,192; a cap given is kept on every device."""
    from autograder.grade import MEMORY_MB, Settings

    def cap(device, memory_mb=None):
        return Settings(sandbox="none", cell_timeout=1, timeout=1, memory_mb=memory_mb, device=device, jobs=1,
                        force=False).memory_mb

    assert (cap("cpu"), cap("cuda")) == (MEMORY_MB["cpu"], MEMORY_MB["cuda"]) == (4096, 8192)
    assert cap("cuda", 1500) == cap("cpu", 1500) == 1500
    assert cap("auto") == MEMORY_MB["cuda" if torch.cuda.is_available() else "cpu"]
    help_text = subprocess.run([sys.executable, "-m", "autograder", "grade", "--help"], capture_output=True,
                               text=True, cwd=Path(__file__).resolve().parents[1]).stdout
    assert "8192 with the" in " ".join(help_text.split())

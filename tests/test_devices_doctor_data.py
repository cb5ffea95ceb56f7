import json
import subprocess
import sys
import warnings

import pytest
import torch

import course
from course.data import padded_batch, random_lengths
from course.doctor import where_running
from course.lessons import catalog, lesson

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_sizes_pick_cpu_values_and_keep_cpu_values_missing_on_cuda():
    s = course.sizes(cpu=dict(T=5, B=2), cuda=dict(T=100), device="cpu")
    assert (s.T, s.B, s.device.type) == (5, 2, "cpu") and dict(s) == {"T": 5, "B": 2}
    with pytest.raises(AttributeError, match="declares no size named 'H'"):
        s.H


def test_sizes_refuse_a_cuda_only_size():
    with pytest.raises(ValueError, match=r"CUDA sizes \['H'\] have no CPU value"):
        course.sizes(cpu=dict(T=5), cuda=dict(H=512))


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the message shown when CUDA is missing")
def test_asking_for_cuda_without_a_gpu_says_what_to_try(monkeypatch):
    with pytest.raises(RuntimeError, match="(?s)sees no CUDA GPU.*Try"):
        course.pick_device("cuda")
    monkeypatch.setenv("COURSE_DEVICE", "cpu")
    assert course.pick_device().type == "cpu"
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        course.pick_device("mps")


def test_doctor_returns_what_it_prints(capsys):
    rep = course.doctor()
    out = capsys.readouterr().out
    assert rep.torch == torch.__version__ and rep.torch in out and rep.device in out
    assert any("deprecated" in c for c in rep.caveats) == (tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 12))
    assert set(rep.as_dict()) >= {"python", "torch", "device", "cuda", "where", "caveats"}


def test_where_running_recognises_each_place():
    assert where_running({"COLAB_RELEASE_TAG": "x"}, {}) == "Colab"
    assert where_running({"BINDER_SERVICE_HOST": "x"}, {}) == "Binder"
    assert where_running({"JPY_PARENT_PID": "1"}, {"ipykernel": object()}) == "JupyterLab"
    assert where_running({}, {}) == "plain Python"


def test_doctor_command_line_prints_json():
    out = subprocess.run([sys.executable, "-m", "course", "doctor", "--json"], capture_output=True, text=True,
                         check=True).stdout
    assert json.loads(out)["torch"] == torch.__version__
    bad = subprocess.run([sys.executable, "-m", "course", "doctor", "--device", "tpu"], capture_output=True, text=True)
    assert bad.returncode == 2 and "'cpu' or 'cuda'" in bad.stderr


@pytest.mark.parametrize("seed", range(8))
def test_random_lengths_cover_both_ends_and_stay_in_range(seed):
    lengths = random_lengths(6, 9, seed=seed, min_len=2)
    assert lengths.max() == 9 and lengths.min() == 2 and len(lengths) == 6
    assert torch.equal(lengths, random_lengths(6, 9, seed=seed, min_len=2))  # seeded


def test_padded_batch_fills_exactly_the_padding():
    lengths = torch.tensor([3, 1, 2])
    x = padded_batch(lengths, 4, seed=0, pad_value=float("nan"))
    assert x.shape == (3, 3, 4)
    pad = torch.arange(3)[:, None] >= lengths[None, :]
    assert torch.isnan(x[pad]).all() and not torch.isnan(x[~pad]).any()


def test_quiet_torchscript_silences_only_the_deprecation_and_explains_once(capsys):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        course.quiet_torchscript()
        course.quiet_torchscript()
        warnings.warn("`torch.jit.script` is deprecated. Please switch", DeprecationWarning)
        warnings.warn("something else", DeprecationWarning)
    assert [str(w.message) for w in seen] == ["something else"]
    assert capsys.readouterr().out.count("deprecated") <= 1


def test_the_profilers_one_cycle_warning_of_torch_2_10_to_2_12_is_dropped_and_only_it():
    """Torch 2.10 to 2.12 warn of cleared cycles at every first profile (lessons 2, 8 and 9 showed it under
    torch 2.11); 2.13 and later warn, in words spaced otherwise, only when a second cycle begins."""
    from course.quiet import quiet_profiler_cycle_notice

    old = ("Warning: Profiler clears events at the end of each cycle.Only events from the current cycle will be "
           "reported.To keep events across cycles, set acc_events=True.")
    new = ("Warning: Profiler clears events at the end of each cycle. Only events from the current cycle will be "
           "reported. To keep events across cycles, set acc_events=True.")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_profiler_cycle_notice()
        warnings.warn(old, UserWarning)
        warnings.warn(new, UserWarning)
    assert [str(w.message) for w in seen] == [new]


def test_catalog_lists_lessons_with_budgets():
    assert lesson("01_custom_rnns")["cpu_budget_s"] <= 180
    assert all({"id", "title", "points", "cpu_budget_s", "memory_budget_mb"} <= set(x) for x in catalog())
    with pytest.raises(KeyError, match="the course has"):
        lesson("99_nope")


# -- what a learner on another torch or on Colab sees (issue: torch range, Colab findings) -------------

@pytest.mark.parametrize("version, says", [
    ("2.16.0+cu126", "newer than this release was tested with"),
    ("2.3.1", "older than this release was tested with"),
    ("2.13.0+cpu", None),
])
def test_doctor_names_a_torch_outside_the_tested_range_without_refusing_it(monkeypatch, version, says):
    D = sys.modules["course.doctor"]

    rep = D.collect("cpu")
    rep.torch = version
    caveats = " ".join(D._caveats(rep))
    if says is None:
        assert "tested with" not in caveats
    else:
        assert says in caveats and f"torch {version}" in caveats


def test_doctor_explains_a_cuda_build_without_a_gpu(monkeypatch):
    D = sys.modules["course.doctor"]

    monkeypatch.setattr(torch.version, "cuda", "12.6")
    rep = D.collect("cpu")
    assert any("built for CUDA 12.6, but no GPU is visible" in c for c in rep.caveats), rep.caveats


def _stderr_of(code: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, cwd=ROOT)


def test_the_cuda_home_notice_is_dropped_and_nothing_else():
    code = ("import course, logging\n"
            "log = logging.getLogger('torch.utils.cpp_extension')\n"
            "log.warning(\"No CUDA runtime is found, using CUDA_HOME='%s'\", '/usr/local/cuda')\n"
            "log.warning('another notice')\n")
    proc = _stderr_of(code)
    assert proc.returncode == 0 and "No CUDA runtime" not in proc.stderr and "another notice" in proc.stderr


FORWARD_MODE = ("import torch\nimport torch.autograd.forward_ad as fwAD\n"
                "with fwAD.dual_level():\n    fwAD.make_dual(torch.randn(2), torch.ones(2))\n"
                "torch.func.jvp(torch.sin, (torch.randn(2),), (torch.ones(2),))\n")
AS_ERRORS = ("-W", "error::DeprecationWarning", "-W", "error::FutureWarning")


def test_torchs_first_forward_mode_call_warns_that_torchscript_is_deprecated():
    """The claim behind course.quiet.load_forward_ad_quietly, on the installed torch: forward
    mode's first call loads decompositions written in TorchScript, which warns (2.13: hidden as a
    DeprecationWarning; 2.14 and 2.15: a FutureWarning a learner sees)."""
    proc = _stderr_of(FORWARD_MODE, *AS_ERRORS)
    assert proc.returncode != 0 and "torch.jit.script" in proc.stderr and "is deprecated" in proc.stderr


@pytest.mark.parametrize("module", ["course.forward_ad", "course.jacobians", "course.checks.forward_ad"])
def test_lessons_4_and_5_show_no_torchscript_warning_on_their_first_forward_mode_call(module):
    proc = _stderr_of(f"import {module}\n" + FORWARD_MODE, *AS_ERRORS)
    assert proc.returncode == 0, proc.stderr[-2000:]

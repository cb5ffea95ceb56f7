"""Lesson 3's checks judge how the answer worked, not only what it returned: red-team answers that
earned points with the right values and formats by another route fail, each with a message that
says what was expected, what came and what to try; the instructor's answers (and honest variants)
still pass.

- ``autocast_inference``: a token call ``model(x[:1])`` under autocast, then the real batch in
  float32 cast to bfloat16 at the end (the probe used to note only the first forward);
- ``coord_conv``: the planted NCHW ``torch.cat`` kept and the convolution replaced by one
  ``baddbmm`` reading it transposed (channels-last strides out, faster than the bar); or NCHW out on
  the timed (64-channel) inputs only. Checked before the clock, on inputs of the timed sizes."""

import pytest
import torch
import torch.nn.functional as F

from autograder.solution_code import load_solution, solution_source
from course import memory_format as MF
from course.checks import memory_format as C
from served_helpers import served

LESSON = "03_channels_last"
CL = torch.channels_last
#: The lesson's CPU sizes for the CoordConv clock (course.sizes' cpu entry in the notebook).
TIMED = dict(batch=8, channels=64, size=32)
LOW_BARS = {"cpu": 0.01, "cuda": 0.01}
SPEED = dict(rounds=3, min_run_time=0.02)


@pytest.fixture(scope="module")
def solution(tmp_path_factory):
    return load_solution(solution_source(LESSON), tmp_path_factory.mktemp("l3method") / "l3_method_sol.py",
                         "l3_method_sol")


# -- autocast_inference ------------------------------------------------------------------------

def autocast_token(model, x):
    """The red team's: a token forward on one image under autocast, the real batch in float32."""
    dtype = torch.bfloat16 if x.device.type == "cpu" else torch.float16
    with torch.inference_mode():
        with torch.autocast(device_type=x.device.type, dtype=dtype):
            token = model(x[:1])
        if not hasattr(model, "stem") or x.shape[0] == 1:
            return token
        return model(x).to(token.dtype)


def autocast_token_forward(model, x):
    """The same, the real batch through ``model.forward`` (no hook of the model itself fires)."""
    dtype = torch.bfloat16 if x.device.type == "cpu" else torch.float16
    with torch.inference_mode():
        with torch.autocast(device_type=x.device.type, dtype=dtype):
            token = model(x[:1])
        if not hasattr(model, "stem"):
            return token
        return model.forward(x).to(token.dtype)


def autocast_one_image(model, x):
    """Under autocast, but on one image only, its output repeated for the batch."""
    dtype = torch.bfloat16 if x.device.type == "cpu" else torch.float16
    with torch.inference_mode(), torch.autocast(device_type=x.device.type, dtype=dtype):
        out = model(x[:1])
    return out.expand(x.shape[0], *out.shape[1:]) if hasattr(model, "stem") else out


def autocast_in_chunks(model, x):
    """Honest: the batch in chunks of two, every forward under autocast."""
    dtype = torch.bfloat16 if x.device.type == "cpu" else torch.float16
    with torch.inference_mode(), torch.autocast(device_type=x.device.type, dtype=dtype):
        return torch.cat([model(part) for part in x.split(2)])


@pytest.mark.parametrize("attack, says", [
    (autocast_token, r"the model ran on 4 image\(s\) without autocast on cpu: expected every forward .*"
                     r"a forward on 1 image\(s\) did run under autocast.*Hint: run the whole batch"),
    (autocast_token_forward, r"its module 'stem' ran on 4 image\(s\) without autocast.*Hint:"),
    (autocast_one_image, r"under autocast the model ran on 1 image\(s\) in all, and the input holds 4.*Hint:"),
], ids=["token-call", "token-call-via-forward", "one-image"])
def test_autocast_attacks_fail_with_their_message(attack, says):
    with pytest.raises(AssertionError, match=f"(?s){says}"):
        C.check_autocast_inference(attack, width=8, size=32)


def test_autocast_instructor_answer_and_chunked_batch_pass(solution):
    C.check_autocast_inference(solution.autocast_inference, width=8, size=32)
    C.check_autocast_inference(solution.autocast_inference)  # the notebook's own call
    C.check_autocast_inference(autocast_in_chunks, width=8, size=32)


def test_autocast_probe_notes_every_forward_with_its_batch(solution):
    from course.models import small_resnet

    model = small_resnet(seed=0, width=8)
    x = torch.randn(4, 3, 16, 16).to(memory_format=CL)
    _, _, seen, _ = C.autocast_case(autocast_token, model, x)
    top = [(on, images) for on, _, name, images in seen if name == ""]
    assert top == [(True, 1), (False, 4)]
    _, _, seen, _ = C.autocast_case(solution.autocast_inference, small_resnet(seed=0, width=8), x)
    assert all(on for on, *_ in seen) and [images for _, _, name, images in seen if name == ""] == [4]


# -- coord_conv ----------------------------------------------------------------------------------

def coord_nchw_gemm(x, weight, bias):
    """The red team's: the planted cat (NCHW), then one baddbmm reading it transposed: channels-last out."""
    ys, xs = MF.coordinate_planes(x)
    z = torch.cat([x, torch.cat([ys, xs], dim=1)], dim=1)
    n, c2, h, w = z.shape
    c = weight.shape[0]
    zf = z.reshape(n, c2, h * w)
    wm = weight.reshape(c, c2)
    if x.is_contiguous(memory_format=CL):
        out = torch.baddbmm(bias.view(1, 1, c), zf.transpose(1, 2), wm.t().expand(n, c2, c))
        return out.view(n, h, w, c).permute(0, 3, 1, 2)
    return torch.baddbmm(bias.view(1, c, 1), wm.expand(n, c, c2), zf).view(n, c, h, w)


def coord_nchw_gemm_with_a_decoy_conv(x, weight, bias):
    """The same, beside a convolution of the output's shape whose result is thrown away."""
    F.conv2d(x, weight[:, : x.shape[1]], bias)
    return coord_nchw_gemm(x, weight, bias)


def coord_nchw_bmm_back(x, weight, bias):
    """The red team's: NCHW bmm, converted back to channels-last only below 32 channels (never timed)."""
    ys, xs = MF.coordinate_planes(x)
    z = torch.cat([x, torch.cat([ys, xs], dim=1)], dim=1)
    n, c2, h, w = z.shape
    c = weight.shape[0]
    out = torch.baddbmm(bias.view(1, c, 1), weight.reshape(c, c2).expand(n, c, c2), z.reshape(n, c2, h * w))
    out = out.view(n, c, h, w)
    if x.is_contiguous(memory_format=CL) and x.shape[1] < 32:
        return out.contiguous(memory_format=CL)
    return out


def coord_split(x, weight, bias):
    """Honest: no cat at all, the weight split between x's channels and the two planes."""
    n, c, h, w = x.shape
    ys = torch.linspace(-1, 1, h, device=x.device).view(1, 1, h, 1)
    xs = torch.linspace(-1, 1, w, device=x.device).view(1, 1, 1, w)
    return (F.conv2d(x, weight[:, :c], bias) + weight[:, c].view(1, -1, 1, 1) * ys
            + weight[:, c + 1].view(1, -1, 1, 1) * xs)


CONTEXT = r"\(Checked before the clock, and the bar on this device is 1\.25x: .*\)\n  Hint:"
COORD_ATTACKS = {
    "gemm": (coord_nchw_gemm, r"coord_conv ran no convolution returning the block's output \(shape \(8, 64, 32, 32\)\)"
                              r".*aten::baddbmm.*Expected the block's 1x1 convolution.*" + CONTEXT),
    "gemm-decoy-conv": (coord_nchw_gemm_with_a_decoy_conv,
                        r"coord_conv wrote an NCHW tensor of shape \(8, 66, 32, 32\) .*from aten::cat\) for the timed "
                        r"inputs.*expected every tensor of x's size on the way .* to stay channels-last.*" + CONTEXT),
    "bmm-back": (coord_nchw_bmm_back, r"coord_conv returned NCHW for the timed inputs \(x of shape \(8, 64, 32, 32\), "
                                      r"channels-last\), where the planted block returns channels-last.*" + CONTEXT),
}


@pytest.mark.parametrize("attack", sorted(COORD_ATTACKS))
def test_coord_conv_attacks_fail_before_the_clock(attack):
    """Each passes the value check (right values, x's format on its small inputs); the speed check
    fails it before timing anything (the bar is the lesson's; no clock runs)."""
    fn, says = COORD_ATTACKS[attack]
    C.check_coord_conv(fn)
    with pytest.raises(AssertionError, match=f"(?s){says}"):
        C.check_coord_conv_speed(fn, bars={"cpu": 1.25, "cuda": 1.25}, num_threads=1, **TIMED, **SPEED)


def test_the_planted_block_fails_before_the_clock_naming_the_cat():
    with pytest.raises(AssertionError, match=r"(?s)wrote an NCHW tensor of shape \(8, 66, 32, 32\).*aten::cat"):
        C._coord_before_the_clock(MF.coord_conv_planted, torch.device("cpu"), bar=1.25, **TIMED)


@pytest.mark.parametrize("honest", ["solution", "split"])
def test_honest_repairs_pass_before_the_clock_and_on_it(honest, solution):
    fn = solution.coord_conv if honest == "solution" else coord_split
    C._coord_before_the_clock(fn, torch.device("cpu"), bar=1.25, **TIMED)
    C.check_coord_conv(fn)
    C.check_coord_conv_speed(fn, bars=LOW_BARS, batch=2, channels=12, size=16, **SPEED)


def test_the_structure_probe_reports_ops_and_4d_strides(solution):
    x, w, b = MF.coord_conv_inputs(0, batch=2, channels=8, size=6)
    out, (count, *ops) = C.coord_conv_case(solution.coord_conv, x, w, b)
    assert MF.memory_format_of(out) == CL and count == len(ops)
    names = [name for name, _ in ops]
    assert "aten::convolution" in names and "aten::cat" in names
    cats = [outs for name, outs in ops if name == "aten::cat"]
    assert [shape for shape, _ in cats[-1]] == [(2, 10, 6, 6)]
    assert MF.memory_format_of(torch.empty_strided(*cats[-1][0], device="meta")) == CL


# -- across the boundary (the grader's route: probes run in the learner's process) ----------------

def test_attacks_fail_and_the_solution_passes_across_the_boundary(solution):
    namespace = {"autocast_token": autocast_token, "coord_nchw_gemm": coord_nchw_gemm,
                 "coord_nchw_bmm_back": coord_nchw_bmm_back, "autocast_inference": solution.autocast_inference,
                 "coord_conv": solution.coord_conv}
    for learner in served(namespace):
        with pytest.raises(AssertionError, match="without autocast"):
            C.check_autocast_inference(learner("autocast_token"), width=8, size=32)
        with pytest.raises(AssertionError, match="ran no convolution"):
            C.check_coord_conv_speed(learner("coord_nchw_gemm"), bars=LOW_BARS, **TIMED, **SPEED)
        with pytest.raises(AssertionError, match="returned NCHW for the timed inputs"):
            C.check_coord_conv_speed(learner("coord_nchw_bmm_back"), bars=LOW_BARS, **TIMED, **SPEED)
        C.check_autocast_inference(learner("autocast_inference"), width=8, size=32)
        C._coord_before_the_clock(learner("coord_conv"), torch.device("cpu"), bar=1.25, **TIMED)


# -- find_format_loss ------------------------------------------------------------------------------

#: The red team's: the planted modules' classes looked up in a table, no op ever watched.
_FIRST_LOSS = {"CoordChannels": "cat", "ChannelPermute": "__getitem__", "CircularConv": "pad",
               "ChannelGate": "softmax", "Tidy": "contiguous"}


def finder_table(model, x):
    for m in model.modules():
        name = _FIRST_LOSS.get(type(m).__name__)
        if name is not None:
            return name
    return None


def finder_table_in_table_order(model, x):
    """The same table, asked in its own order (the CoordConv of the default planted model first)."""
    kinds = {type(m).__name__ for m in model.modules()}
    return next((op for kind, op in _FIRST_LOSS.items() if kind in kinds), None)


@pytest.mark.parametrize("attack", [finder_table, finder_table_in_table_order], ids=["modules-order", "table-order"])
@pytest.mark.parametrize("seed", [0, 3])
def test_a_table_of_the_planted_classes_fails_on_the_decoy(attack, seed):
    with pytest.raises(AssertionError, match=r"(?s)find_format_loss named '\w+' in a second planted model, where the "
                                             r"first op that loses channels-last is 'torch\.[\w.]+': expected the "
                                             r"first op .*runs them in another order.*Hint: .*FormatWatcher"):
        C.check_format_finder(attack, seed=seed)


def test_the_decoy_runs_its_modules_out_of_the_listed_order():
    from course.references.memory_format import format_losses

    for seed in range(1, 9):
        model = C.format_decoy(seed=seed, width=8)
        calls = [m for m in model.modules() if isinstance(m, C._OutOfOrder)][0]._calls
        assert calls[0] in ("gate", "permute", "circular") and sorted(calls) == sorted(
            ["tidy", "gate", "permute", "circular", "coords"])
        first = format_losses(model, C.finder_input(seed=0, batch=2, size=16, device="cpu"))[0]
        decoy = [m for m in model.modules() if isinstance(m, C._OutOfOrder)][0]
        assert first.rsplit(".", 1)[-1] == _FIRST_LOSS[type(getattr(decoy, calls[0])).__name__], (first, calls)


@pytest.mark.parametrize("variant", ["coords", "permute", "circular", "gate"])
def test_the_instructors_finder_passes_with_the_decoy(variant, solution):
    C.check_format_finder(solution.find_format_loss, variant=variant)
    C.check_format_finder(solution.find_format_loss, variant=variant, seed=5)


def test_the_decoy_crosses_as_a_recipe(solution):
    for learner in served({"finder_table": finder_table, "find_format_loss": solution.find_format_loss}):
        with pytest.raises(AssertionError, match="in a second planted model"):
            C.check_format_finder(learner("finder_table"))
        C.check_format_finder(learner("find_format_loss"))

"""What the lessons say about PyTorch, checked against the installed torch: a release that changes
the behaviour fails here instead of the lesson teaching something wrong. The review of lessons 1-6
found the statements corrected here; each wrong one is also kept out of the lessons' text."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings

import mpmath
import pytest
import torch
import torch.nn.functional as F

from conftest import SOLUTIONS

ROOT = SOLUTIONS.parent

TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def prose(lesson_id: str) -> str:
    """A lesson's markdown, as one text with its line breaks turned into spaces."""
    nb = json.loads((SOLUTIONS / lesson_id / f"{lesson_id}.ipynb").read_text())
    return " ".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown").replace("\n", " ")


def declared_sizes(lesson_id: str, device: str = "cpu"):
    """The sizes a lesson's `S = course.sizes(...)` cell declares for ``device``, through the course's own
    ``course.sizes`` (no parsing of the call)."""
    import functools
    from types import SimpleNamespace

    import course

    nb = json.loads((SOLUTIONS / lesson_id / f"{lesson_id}.ipynb").read_text())
    cell = next("".join(c["source"]) for c in nb["cells"] if "S = course.sizes(" in "".join(c["source"]))
    scope = {"course": SimpleNamespace(sizes=functools.partial(course.sizes, device=device))}
    exec(cell, scope)  # noqa: S102 - the committed notebook's own cell
    return scope["S"]


def in_a_fresh_process(script: str):
    """What ``script`` prints last, as JSON, run in a fresh Python: a learner's kernel has no history of
    pytest's heap (a long-lived heap can hold a free stretch that takes a 64 MiB block)."""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("lesson_id, wrong", [
    ("01_custom_rnns", "Since PyTorch 2.13"),
    ("01_custom_rnns", "or `prim::CudaFusionGroup`), each one kernel"),
    ("02_fx_transforms", "each BatchNorm about 2%"),
    ("03_channels_last", "reductions such as BatchNorm statistics and softmax in float32"),
    ("04_forward_ad", "lose at most a few digits"),
    ("05_jacobians_hessians", "one batched pass per **output**"),
    ("06_vmap_ensembles", "the later lessons of the syllabus"),
])
def test_a_corrected_statement_stays_corrected(lesson_id, wrong):
    assert wrong not in prose(lesson_id)


def _script_warnings() -> list[warnings.WarningMessage]:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.jit.script(f)
    return [w for w in caught if "torch.jit.script" in str(w.message)]


def test_lesson_1_quotes_torchscripts_warning_and_names_its_category():
    text = prose("01_custom_rnns")
    caught = _script_warnings()
    if TORCH < (2, 12):
        pytest.skip("the lesson makes no claim about this torch's warning")
    assert caught, "torch.jit.script no longer warns: lesson 1's section 3 says it does"
    message, category = str(caught[0].message), caught[0].category
    assert message in text.replace("*\"", "").replace("\"*", "").replace("  ", " ") or \
        " ".join(message.split()) in text, message
    named = "`FutureWarning`" if TORCH >= (2, 14) else "`DeprecationWarning`"
    assert category.__name__ == named.strip("`") and named in text


def test_lesson_1_says_a_cpu_build_without_llvm_fuses_nothing():
    if torch._C._llvm_enabled():
        pytest.skip("this build has LLVM: NNC may fuse on the CPU")

    @torch.jit.script
    def gates(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x) * torch.tanh(h) + x

    x, h = torch.randn(4, 8), torch.randn(4, 8)
    for _ in range(3):  # the profiling executor optimises after a few calls
        gates(x, h)
    graph = str(torch.jit.last_executed_optimized_graph())
    assert "FusionGroup" not in graph and "TensorExprGroup" not in graph
    assert "`prim::TensorExprGroup`" in prose("01_custom_rnns")


def test_lesson_3_what_cpu_autocast_returns():
    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        conv = F.conv2d(x, w)
        assert conv.dtype == torch.bfloat16
        assert F.linear(torch.randn(2, 5), torch.randn(3, 5)).dtype == torch.bfloat16
        # after a BF16 convolution, these run in bfloat16 on a CPU (CUDA's lists cast some up)
        assert F.batch_norm(conv, torch.zeros(4), torch.ones(4), training=False).dtype == torch.bfloat16
        assert torch.softmax(conv, 1).dtype == torch.bfloat16
        assert F.layer_norm(conv, conv.shape[-1:]).dtype == torch.bfloat16
        # losses are on the CPU's float32 list
        assert F.cross_entropy(torch.randn(2, 3).bfloat16(), torch.tensor([0, 1])).dtype == torch.float32
        assert F.mse_loss(conv, conv.detach()).dtype == torch.float32
    text = prose("03_channels_last")
    assert "`batch_norm`, `softmax` and `layer_norm` in bfloat16" in text and "`cross_entropy` and `mse_loss`" in text


def _sinc_prime_error(x: float) -> float:
    mpmath.mp.dps = 50
    closed = (x * math.cos(x) - math.sin(x)) / (x * x)
    exact = mpmath.diff(lambda t: mpmath.sin(t) / t, mpmath.mpf(x))
    return float(abs((closed - exact) / exact))


def test_lesson_4_how_many_digits_the_closed_form_derivative_loses():
    """The lesson: about 4 of 16 digits at |x| = 1e-2 (relative error near 1e-12), 2 at 0.1, none
    by 1; the value sin(x)/x exact; three series terms exact below 1e-2."""
    assert 1e-13 < _sinc_prime_error(1e-2) < 1e-11
    assert 1e-15 < _sinc_prime_error(0.1) < 1e-13
    assert _sinc_prime_error(1.0) < 1e-15
    mpmath.mp.dps = 50
    for x in (1e-2, 0.3, 1.0):
        assert abs(math.sin(x) / x - float(mpmath.sin(mpmath.mpf(x)) / x)) <= 2 ** -52
    x = 1e-2
    series = -x / 3 + x ** 3 / 30 - x ** 5 / 840
    exact = mpmath.diff(lambda t: mpmath.sin(t) / t, mpmath.mpf(x))
    assert float(abs((series - exact) / exact)) < 2 ** -52
    assert "about 4 of float64's 16 at `|x| = 1e-2`" in prose("04_forward_ad")


def test_lesson_2_what_torch_export_makes_of_a_conv_and_batchnorm():
    from torch import nn
    from torch.fx import subgraph_rewriter

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(model, (torch.randn(1, 3, 8, 8),))
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    batch_norm = "aten.batch_norm.default" if TORCH >= (2, 5) else "aten._native_batch_norm_legit_no_training.default"
    assert {"aten.conv2d.default", batch_norm} <= ops, ops
    kinds = {s.kind.name for s in ep.graph_signature.input_specs}
    assert {"PARAMETER", "BUFFER", "USER_INPUT"} <= kinds   # parameters and buffers are graph inputs
    assert callable(subgraph_rewriter.replace_pattern)
    assert "`aten.batch_norm`" in prose("02_fx_transforms")


def test_lesson_1_a_traced_layer_silently_keeps_the_examples_length(rnn_solution):
    from course.rnn import lstm_weights, make_lstm

    weights = lstm_weights(make_lstm(8, 8, 1, seed=0))
    h0 = c0 = torch.zeros(3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(rnn_solution.lstm_layer, (torch.randn(4, 3, 8), h0, c0, *weights))
    out, _ = traced(torch.randn(6, 3, 8), h0, c0, *weights)
    assert out.shape[0] == 4                      # no error, and 2 of the 6 steps missing
    assert "called on one of 6, returns 4 steps without a\nword" in "".join(
        "".join(c["source"]) for c in json.loads((SOLUTIONS / "01_custom_rnns" / "01_custom_rnns.ipynb").read_text())["cells"])


@pytest.mark.parametrize("lesson_id, variable", [
    ("04_forward_ad", "speed_bars"), ("05_jacobians_hessians", "mode_bars"),
    ("06_vmap_ensembles", "kl_bars"), ("03_channels_last", "coord_bars"),
    ("02_fx_transforms", "speed_bars"),
    ("07_broadcasting_indexing_higher_order", "distance_bars"), ("07_broadcasting_indexing_higher_order", "segment_bars"),
    ("07_broadcasting_indexing_higher_order", "penalty_bars"), ("08_profiling_trace_diff", "attention_bars"),
])
def test_the_prose_states_the_bars_the_code_applies(lesson_id, variable):
    """A bar changed in a test cell and not in the text (or the reverse) fails here: every bar of
    the cell appears in bold in the lesson's prose."""
    import re

    nb = json.loads((SOLUTIONS / lesson_id / f"{lesson_id}.ipynb").read_text())
    code = next("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"
                and re.search(rf"^{variable} = \{{", "".join(c["source"]), re.M))
    bars = eval(re.search(rf"^{variable} = (\{{[^}}]*\}})", code, re.M).group(1))  # noqa: S307 - the course's own
    text = prose(lesson_id)
    for device, bar in bars.items():
        shown = f"**{bar:g}x**"
        assert shown in text, (lesson_id, variable, device, shown)


def test_lesson_6_what_vmap_does_with_a_random_op():
    from torch.func import vmap

    def dropped(row):
        return F.dropout(row, p=0.5, training=True)

    ones = torch.ones(6, 64)
    with pytest.raises(RuntimeError, match="randomness"):
        vmap(dropped)(ones)                                    # the default: 'error'
    torch.manual_seed(0)
    different = vmap(dropped, randomness="different")(ones) == 0
    same = vmap(dropped, randomness="same")(ones) == 0
    assert not all(torch.equal(different[0], row) for row in different[1:])
    assert all(torch.equal(same[0], row) for row in same[1:])
    assert "(`randomness='error'`)" in prose("06_vmap_ensembles")


def test_lesson_5_the_summation_trick_gives_the_batch_of_jacobians():
    """Summing independent samples' outputs, then one Jacobian with respect to the batch, gives
    (m, B, n): each sample's own Jacobian, as vmap(jacrev(f)) does."""
    from torch.func import jacrev, vmap

    from course.jacobians import tanh_layer

    layer = tanh_layer(5, 7, seed=0, dtype=torch.float64)
    xs = torch.randn(4, 7, dtype=torch.float64)
    by_sum = jacrev(lambda xs: layer(xs).sum(0))(xs)
    assert by_sum.shape == (5, 4, 7)
    assert torch.allclose(by_sum.movedim(1, 0), vmap(jacrev(layer))(xs))
    assert "Sum the outputs over the batch and take **one**" in prose("05_jacobians_hessians")


def test_lesson_5_batchnorm_refuses_one_sample_and_mixes_samples_only_with_batch_statistics():
    """Exercise 7's premise: nn.BatchNorm1d refuses a 1-D input, with the message the lesson quotes, so
    vmap(jacrev(f)) cannot run it; in eval mode the samples do not mix (the trick is exact); with the
    batch's own statistics they do (the full Jacobian has entries off its diagonal blocks)."""
    from torch.func import jacrev, vmap

    from course.jacobians import normed_layer

    text = prose("05_jacobians_hessians")
    assert '"expected 2D or 3D input (got 1D input)"' in text
    norm = normed_layer(5, 7, seed=0, dtype=torch.float64)
    xs = torch.randn(4, 7, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"expected 2D or 3D input \(got 1D input\)"):
        vmap(jacrev(norm))(xs)
    assert torch.allclose(jacrev(lambda b: norm(b).sum(0))(xs).movedim(1, 0),
                          torch.stack([jacrev(lambda x: norm(x[None])[0])(x) for x in xs]))
    torch.manual_seed(0)
    mixing = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.BatchNorm1d(5, track_running_stats=False),
                                 torch.nn.Tanh()).double()
    full = jacrev(mixing)(xs)
    own = torch.stack([full[b, :, b] for b in range(4)])
    assert full[0, :, 1:].abs().max() > 0.01
    assert (jacrev(lambda b: mixing(b).sum(0))(xs).movedim(1, 0) - own).abs().max() > 0.01
    assert "track_running_stats=False" in text and "updates nothing" in text


def test_lesson_5_chunk_size_bounds_the_identity_jacrev_maps_over():
    """Without chunk_size the largest tensor jacrev makes is the (m, m) identity; with chunk_size=c
    it is c rows of it, and the op count grows as the chunks shrink (chunk_size=1: a loop)."""
    from torch.func import jacrev

    from course.jacobians import TensorWatch, tanh_layer

    m, n = 512, 16
    layer, x = tanh_layer(m, n, seed=0), torch.randn(n)
    seen = {}
    for size in (None, 128, 1):
        with TensorWatch() as tw:
            jacrev(layer, chunk_size=size)(x)
        seen[size] = (tw.largest_bytes, tw.ops, tw.largest_shape, tw.largest_op)
    assert seen[None][0] >= m * m * 4 and seen[128][0] <= 128 * m * 4
    assert seen[None][1] < seen[128][1] < seen[1][1]
    assert "`jacrev(f, chunk_size=c)`" in prose("05_jacobians_hessians")
    # Exercise 3's floor: at small chunks the largest tensor is the Jacobian itself, (n, m), made by `t`
    assert seen[1][:1] + seen[1][2:] == (m * n * 4, (n, m), "t")
    text = prose("05_jacobians_hessians")
    assert "only down to the size of the Jacobian itself" in text and "the `(n, m)` result, made by `t`" in text
    assert "64 MiB for a Jacobian of 4 MiB" in text and 4096 * 4096 * 4 == 64 * 2**20 and 4096 * 256 * 4 == 4 * 2**20


def test_lesson_5_on_a_cpu_the_unchunked_jacrev_pays_for_fresh_pages_and_a_chunk_of_1024_does_not():
    """The chunk cell's CPU layer: unchunked, jacrev's (m, m) identity is over glibc's 32 MiB threshold
    and is mapped afresh on every call (page faults each call, held steady as the lesson's clock holds
    it); at chunk_size=1024 its blocks are under it and recycled. Run in a fresh process, as a learner's
    kernel is (see lesson 8's test)."""
    import re

    from course import allocator
    from course.allocator import MAP_FROM

    if not (allocator.available() and allocator.counts_faults()):
        pytest.skip("glibc's malloc is not this process's allocator, or this kernel does not count page faults")
    lesson = "05_jacobians_hessians"
    nb = json.loads((SOLUTIONS / lesson / f"{lesson}.ipynb").read_text())
    code = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    m, n = declared_sizes(lesson).chunk
    sweep = eval(re.search(r"tqdm\((\[None, [^]]*\]), desc=\"chunk sizes\"\)", code).group(1))  # noqa: S307
    assert 1024 in sweep and None in sweep
    identity, chunked = m * m * 4, 1024 * m * 4
    assert identity == 64 << 20 and identity >= MAP_FROM > chunked == 16 << 20
    script = f"""
import json, torch
from torch.func import jacrev
from course import allocator
from course.jacobians import tanh_layer
torch.set_num_threads(1)
layer, x = tanh_layer({m}, {n}, seed=0), torch.randn({n})
with allocator.steady():
    whole = allocator.faults_per_call(lambda: jacrev(layer)(x), calls=3, warmup=3)
    chunked = min(allocator.faults_per_call(lambda: jacrev(layer, chunk_size=1024)(x), calls=3, warmup=3)
                  for _ in range(3))
print(json.dumps([whole, chunked]))
"""
    whole, chunked_faults = in_a_fresh_process(script)
    # at least the identity's worth of 2 MiB pages (the kernel may back some with huge pages), every call
    assert whole > identity / (2 << 20) and whole > 100, whole
    assert chunked_faults < 100, chunked_faults
    text = " ".join(prose(lesson).split())
    for claim in ("its 64 MiB identity is over glibc's 32 MiB threshold, so that memory comes fresh from the "
                  "operating system, page by page, on every call, while the 16 MiB blocks of `chunk_size=1024` are "
                  "recycled",
                  "the unchunked call is not the fastest"):
        assert claim in text, claim
    assert "The time stays about flat" not in text


def test_lesson_1_a_compiled_rnn_makes_a_graph_per_length_and_one_for_all_batch_sizes():
    """Lesson 1, section 10: Dynamo unrolls the loop over time, so every new length compiles again;
    the batch size turns dynamic after its first change; dynamic=True does not help the length,
    mark_dynamic on it is refused, and after the recompile limit (8) nothing more is compiled."""
    import torch._dynamo

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def layer(x, h):
        outs = []
        for t in range(x.size(0)):
            h = torch.tanh(x[t] + h)
            outs.append(h)
        return torch.stack(outs)

    def made(fn, T, B, **kw):
        before = len(graphs)
        fn(torch.randn(T, B, 3), torch.zeros(B, 3), **kw)
        return len(graphs) - before

    torch._dynamo.reset()
    try:
        f = torch.compile(layer, backend=counting)
        assert [made(f, T, B) for T, B in [(4, 2), (4, 2), (5, 2), (6, 2), (4, 3), (4, 7), (4, 5), (5, 7)]] \
            == [1, 0, 1, 1, 1, 0, 0, 1]
        assert made(f, 4, 1) == 1  # a batch of one is always a shape of its own
        torch._dynamo.reset()
        g = torch.compile(layer, backend=counting, dynamic=True)
        assert [made(g, T, B) for T, B in [(4, 2), (5, 2), (4, 9)]] == [1, 1, 0]
        torch._dynamo.reset()
        x = torch.randn(4, 2, 3)
        torch._dynamo.mark_dynamic(x, 0)
        with pytest.raises(Exception, match="ConstraintViolation|specialized"):
            torch.compile(layer, backend=counting)(x, torch.zeros(2, 3))
        torch._dynamo.reset()
        limit = getattr(torch._dynamo.config, "recompile_limit", None) or torch._dynamo.config.cache_size_limit
        assert limit == 8
        h = torch.compile(layer, backend=counting)
        assert sum(made(h, T, 2) for T in range(1, 12)) == limit
    finally:
        torch._dynamo.reset()
    text = prose("01_custom_rnns")
    assert "after 8 graphs for one" in text and "`ConstraintViolationError`" in text and "a batch of 1" in text


def test_lesson_5_which_transforms_take_argnums():
    import inspect

    import torch.func as tf

    for name in ("jacrev", "jacfwd", "grad", "hessian"):
        assert "argnums" in inspect.signature(getattr(tf, name)).parameters, name
    for name in ("vjp", "jvp"):
        assert "argnums" not in inspect.signature(getattr(tf, name)).parameters, name
    assert "`vjp` and `jvp` differentiate with respect to every primal" in prose("05_jacobians_hessians")


L7 = "07_broadcasting_indexing_higher_order"


def test_lesson_7_what_broadcasting_and_indexing_do():
    text = prose(L7)
    # a repeated index in `x[idx] += 1` counts once; accumulate=True and bincount count all
    idx = torch.tensor([1, 1, 1, 3])
    naive = torch.zeros(5)
    naive[idx] += 1
    assert naive.tolist() == [0, 1, 0, 1, 0]
    assert torch.zeros(5).index_put_((idx,), torch.ones(4), accumulate=True).tolist() == [0, 3, 0, 1, 0]
    assert "**it is counted once**" in text
    # expand is a stride-0 view that cannot be written in place; repeat copies
    col = torch.arange(3.0).reshape(3, 1)
    e = col.expand(3, 4)
    assert e.stride() == (1, 0) and e.data_ptr() == col.data_ptr() and col.repeat(1, 4).stride() == (4, 1)
    with pytest.raises(RuntimeError, match="single memory location"):
        e.add_(1)
    assert "stride along the stretched dimension is **0**" in text
    # advanced indexing copies
    t = torch.arange(12.0).reshape(4, 3)
    assert t[torch.tensor([0, 1])].data_ptr() != t.data_ptr()
    # F.mse_loss warns about (N, 1) against (N,); the arithmetic broadcasts to N x N without a word
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        F.mse_loss(torch.zeros(4, 1), torch.zeros(4))
    assert any(issubclass(w.category, UserWarning) and "broadcasting" in str(w.message) for w in caught)
    assert (torch.zeros(4, 1) - torch.zeros(4)).shape == (4, 4)
    assert "`F.mse_loss` warns about it (a `UserWarning`" in text
    # scatter_reduce_ includes the output's own values unless include_self=False
    out = torch.zeros(2).scatter_reduce(0, torch.tensor([0, 0]), torch.tensor([-1.0, -2.0]), reduce="amax")
    assert out.tolist() == [0, 0]
    out = torch.zeros(2).scatter_reduce(0, torch.tensor([0, 0]), torch.tensor([-1.0, -2.0]), reduce="amax",
                                        include_self=False)
    assert out.tolist() == [-1, 0]
    assert "By default (`True`) the output's existing values take part" in text


def test_lesson_7_cdist_takes_the_matrix_product_above_25_points():
    # far from the origin the identity loses digits and the differences do not: cdist's error shows
    # which one it used
    g = torch.Generator().manual_seed(0)
    errors = {}
    for n in (25, 26):
        a, b = (torch.randn(n, 64, generator=g, dtype=torch.float64) + 1000 for _ in range(2))
        exact = ((a[:, None] - b[None]) ** 2).sum(-1)
        errors[n] = ((torch.cdist(a.float(), b.float()) ** 2).double() - exact).abs().max().item()
    assert errors[25] < 0.1 < 1.0 < errors[26], errors
    assert "as soon as either   set has more than 25 points" in prose(L7)


def test_lesson_7_what_second_derivatives_need():
    from torch.autograd.function import once_differentiable
    from torch.autograd.gradcheck import GradcheckError

    text = prose(L7)
    # log1p(exp(x)) overflows near 89 (float32) and 710 (float64)
    for dtype, fine, over in ((torch.float32, 88.0, 89.0), (torch.float64, 709.0, 710.0)):
        assert torch.isfinite(torch.log1p(torch.exp(torch.tensor(fine, dtype=dtype))))
        assert torch.isinf(torch.log1p(torch.exp(torch.tensor(over, dtype=dtype))))
    assert "`x = 89` in float32 and `710` in float64" in text

    class Once(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return F.softplus(x)

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        @staticmethod
        @once_differentiable
        def backward(ctx, g):
            x, = ctx.saved_tensors
            return g * torch.sigmoid(x)

    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(Once.apply, (x,))
    g, = torch.autograd.grad(Once.apply(x).sum(), x, create_graph=True)
    assert not g.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        torch.autograd.grad(g.sum(), x)
    with pytest.raises(GradcheckError, match="Jacobian mismatch"):
        torch.autograd.gradgradcheck(Once.apply, (x,))
    assert "passes the first and fails the second" in text and "carries no graph" in text
    # without create_graph the gradient is a constant: a penalty made from it has no graph
    w = torch.randn(3, requires_grad=True)
    xs = torch.randn(5, 3, requires_grad=True)
    g, = torch.autograd.grad(torch.tanh(xs @ w).sum(), xs)
    assert not ((g.norm(dim=1) - 1) ** 2).mean().requires_grad
    assert "Without `create_graph=True`, `g` is a constant" in text


L8 = "08_profiling_trace_diff"


def _scheduled_counts(steps: int, **extra) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    def step():
        with record_function("forward"):
            torch.randn(16, 16) @ torch.randn(16, 16)

    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3), **extra) as p:
        for _ in range(steps):
            step()
            p.step()
    return {e.key: e.count for e in p.key_averages() if e.key in ("forward", "aten::mm")}


def test_lesson_8_the_scheduled_profiles_table_holds_only_the_last_cycle():
    from course.profiling import accumulate

    text = prose(L8)
    five, six = _scheduled_counts(5), _scheduled_counts(6)
    assert five == {"forward": 3, "aten::mm": 3}
    if TORCH >= (2, 5):
        assert six == {}, six  # the last cycle (a wait step) recorded nothing
        assert _scheduled_counts(6, **accumulate()) == five
        assert accumulate() == {"acc_events": True}
        assert "Since torch 2.5, `key_averages()` after the block holds only the **last** cycle's events" in text
    else:
        assert six == five and accumulate() == {}  # torch 2.4 kept every cycle
        assert "Torch 2.4 kept every cycle, and has no `acc_events`" in text
    if TORCH >= (2, 13):  # torch warns once per process: a fresh one shows it
        import subprocess
        import sys

        code = ("import warnings, torch\nfrom torch.profiler import profile, schedule\n"
                "with warnings.catch_warnings(record=True) as caught:\n"
                "    warnings.simplefilter('always')\n"
                "    with profile(schedule=schedule(wait=1, warmup=1, active=3)) as p:\n"
                "        for _ in range(6):\n"
                "            torch.ones(2) + 1\n"
                "            p.step()\n"
                "print(any('clears events at the end of each cycle' in str(w.message) for w in caught))\n")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert done.stdout.strip().endswith("True"), done.stdout[-500:] + done.stderr[-1500:]
        assert "Recent versions warn about it, once per process" in text and "torch 2.13 does" in text


def test_lesson_8_on_trace_ready_runs_at_a_windows_end_and_at_the_blocks_end_inside_one():
    from torch.profiler import ProfilerActivity, profile, schedule

    for steps, windows in ((3, 1), (5, 1), (6, 1), (9, 2)):
        calls = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3),
                         on_trace_ready=lambda p: calls.append(1)) as p:
                for _ in range(steps):
                    torch.ones(2) + 1
                    p.step()
        assert len(calls) == windows, (steps, len(calls))
    assert "`on_trace_ready` runs at the end of every active window (and when the block ends inside one)" in prose(L8)


def test_lesson_8_what_sdpa_deletes_and_adds_and_what_it_allocates():
    from torch.profiler import ProfilerActivity, profile

    from course.profiling import attention_inputs, naive_attention
    from course.references.traces import ops_diff
    from course.traces import profile_steps

    text = prose(L8)
    q, k, v = attention_inputs(0, batch=2, heads=2, length=128, dim=32)
    with torch.no_grad():
        diff = ops_diff(profile_steps(lambda: naive_attention(q, k, v), steps=2),
                        profile_steps(lambda: F.scaled_dot_product_attention(q, k, v), steps=2))
    assert {"aten::bmm", "aten::matmul", "aten::div", "aten::_softmax"} <= set(diff["deleted"]), diff
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in diff["added"], diff
    for name in ("`aten::bmm`", "`aten::matmul`", "`aten::div`", "`aten::_softmax`",
                 "`aten::_scaled_dot_product_flash_attention_for_cpu`"):
        assert name in text, name
    scores = 2 * 2 * 128 * 128 * 4
    for fn, most in ((naive_attention, None), (F.scaled_dot_product_attention, scores // 4)):
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
            fn(q, k, v)
        per_op = {e.key: e.self_cpu_memory_usage for e in p.key_averages()}
        if most is None:  # the naive version: each of these allocates a whole (B, H, L, L) score matrix
            assert all(per_op[name] >= scores - 64 for name in ("aten::bmm", "aten::div", "aten::_softmax")), per_op
        else:
            assert sum(v for v in per_op.values() if v > 0) - q.numel() * 4 < most, per_op
    assert "each allocate a `(B, H, L, L)` float32 tensor; SDPA allocates little beyond its output" in text


def test_lesson_8_held_steady_the_score_matrix_is_recycled_under_32_mib_and_mapped_afresh_above():
    """The lesson's CPU score matrix is 16 MiB "below glibc's 32 MiB threshold"; held steady, naive
    attention then faults in no page per call, and at twice the length (64 MiB blocks) about
    three blocks' worth every call."""
    from course import allocator
    from course.profiling import attention_inputs, naive_attention

    if not (allocator.available() and allocator.counts_faults()):
        pytest.skip("glibc's malloc is not this process's allocator, or this kernel does not count page faults")
    sizes = {k: v for k, v in declared_sizes(L8).items() if k in ("batch", "heads", "length", "dim")}
    block = sizes["batch"] * sizes["heads"] * sizes["length"] ** 2 * 4
    assert block == 16 * 2**20  # "the score matrix alone is 16 MiB"
    # in a fresh process, as a learner's kernel is (course.allocator's residual: see in_a_fresh_process)
    script = f"""
import json, torch
from course import allocator
from course.profiling import attention_inputs, naive_attention
sizes = {sizes!r}
q, k, v = attention_inputs(0, **sizes)
longer = attention_inputs(1, **{{**sizes, "length": 2 * sizes["length"]}})
with torch.no_grad(), allocator.steady():
    kept = min(allocator.faults_per_call(lambda: naive_attention(q, k, v)) for _ in range(3))
    mapped = allocator.faults_per_call(lambda: naive_attention(*longer))
print(json.dumps([kept, mapped]))
"""
    kept, mapped = in_a_fresh_process(script)
    assert kept < 100, kept
    # mapped afresh every call: up to 3.5 blocks of 4 KiB pages; fewer faults where the kernel backs part
    # of them with 2 MiB pages (how much varies run to run), but never less than one block's huge pages
    assert 4 * block / (2 << 20) < mapped < 3.5 * 4 * block / 4096, mapped
    text = prose(L8)
    for claim in ("the score matrix alone is 16 MiB, a size chosen below glibc's 32 MiB threshold",
                  "a block under 32 MiB is recycled after the first call, and a larger one (the last column: score "
                  "matrices of 64 MiB) is mapped afresh on every call",
                  "every timing in this course, in your notebook and in the grader, holds the allocator steady"):
        assert claim in text, claim


def test_lesson_7_times_its_distances_where_the_broadcast_is_recycled_and_shows_them_where_it_is_not():
    """Section 2's broadcast (512 x 512 x 64, "64 MiB") is over glibc's 32 MiB threshold, mapped afresh
    on every call, as section 2 says; Exercise 4's check times at the declared ``timed_points`` (16 MiB,
    under it), and Exercise 4 says at which sizes and why."""
    import re

    from course.allocator import MAP_FROM
    lesson = "07_broadcasting_indexing_higher_order"
    nb = json.loads((SOLUTIONS / lesson / f"{lesson}.ipynb").read_text())
    code = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    cpu = declared_sizes(lesson)
    shown = cpu["n"] * cpu["m"] * cpu["d"] * 4
    assert shown == 64 << 20 and shown >= MAP_FROM
    assert "here 512 x 512 x 64 floats, 64 MiB" in prose(lesson)
    call = re.search(r"check_distance_speed\(pairwise_sq_dists,[^)]*\)", code).group(0)
    assert re.search(r"n=S\.timed_points,\s*m=S\.timed_points, d=S\.d", call), call
    timed = cpu["timed_points"]
    assert timed * timed * cpu["d"] * 4 == 16 << 20 < MAP_FROM
    text = " ".join(prose(lesson).split())
    assert "its memory comes fresh from the operating system, page by page, on every call" in text
    assert f"On a CPU it times at {timed} x {timed} points (`S.timed_points`)" in text
    assert "the broadcast's intermediate is 16 MiB" in text


def test_lesson_8_bfloat16_is_predicted_from_the_cpus_flags_not_torchs_vector_level(monkeypatch):
    import course.profiling as prof

    text = prose(L8)
    assert torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2", "AVX512", "VSX", "ZVECTOR", "NEON", "SVE256",
                                                       "SVE128", "SVE512")  # names a vector width, never BF16
    monkeypatch.setattr(prof, "cpu_flags", lambda: {"avx2", "fma"})
    assert prof.bf16_native()[0] is False
    monkeypatch.setattr(prof, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    assert prof.bf16_native()[0] is True
    monkeypatch.setattr(prof, "cpu_flags", lambda: {"avx512f", "avx512bw"})
    assert prof.bf16_native()[0] is False  # AVX512 without BF16
    assert "AVX512 machines exist with and without BF16" in text


def test_lesson_9_what_sdpa_does_with_masks_on_this_release():
    """course.fastpath's docstring: an attn_mask with is_causal=True is combined up to 2.13 and an
    error from 2.14; a query with no visible key gives NaN on 2.4 and zeros from 2.13; the masks'
    conventions are opposite (SDPA True = attend, MultiheadAttention's key_padding_mask True = ignore)."""
    from course.fastpath import causal_mask
    from course.references.fastpath import reference_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    attend = torch.rand(5, 5, generator=g) > 0.3
    attend[:, 0] = True
    if TORCH <= (2, 13):
        both = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, is_causal=True)
        assert torch.allclose(both, F.scaled_dot_product_attention(q, k, v, attn_mask=attend & causal_mask(5)))
    else:
        with pytest.raises(RuntimeError, match="Explicit attn_mask should not be set when is_causal=True"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=attend, is_causal=True)
    none = torch.ones(5, 5, dtype=torch.bool)
    none[0] = False
    row = F.scaled_dot_product_attention(q, k, v, attn_mask=none)[0, 0, 0]
    assert (row.isnan().all() if TORCH < (2, 13) else (row == 0).all()), row
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3:] = True
    mha = torch.nn.MultiheadAttention(8, 1, batch_first=True, dtype=torch.float64).eval()
    x = q[:, 0]
    with torch.no_grad():
        got = mha(x, x, x, key_padding_mask=pad, need_weights=False)[0]
        _, w = mha(x, x, x, key_padding_mask=pad, need_weights=True)
    assert (w[1, :, 3:] == 0).all() and (w[0] > 0).all()  # True in key_padding_mask: that key ignored
    assert torch.allclose(reference_attention(q, k, v, key_padding_mask=pad),
                          F.scaled_dot_product_attention(q, k, v, attn_mask=~pad[:, None, None, :]))
    assert got.shape == x.shape


def test_lesson_9_when_the_encoders_fast_path_runs_and_its_autocast_bug():
    """The fast path runs in eval mode without gradients and not in training, with gradients, an odd
    head count, batch_first=False or bias=False; under CPU autocast it ignores autocast: bfloat16 out
    without a padding mask (an error on 2.4), and with one and nested tensors "expected scalar type
    Float but found BFloat16" on every supported release (PyTorch issue 107663)."""
    from course.fastpath import encoder, encoder_config, fast_path_taken, ragged_batch

    assert fast_path_taken(encoder_config())
    for change in (dict(training=True), dict(grad=True), dict(nhead=3, d_model=18), dict(batch_first=False),
                   dict(bias=False)):
        assert not fast_path_taken(encoder_config(**change)), change
    for change in (dict(norm_first=True), dict(activation="gelu"), dict(dropout=0.1), dict(dtype="float64"),
                   dict(padding_mask=True)):
        assert fast_path_taken(encoder_config(**change)), change
    enc = encoder(0)
    x, pad = ragged_batch(1, batch=2, length=5, dim=16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if TORCH < (2, 13):
            with pytest.raises(RuntimeError, match="must have the same dtype"):
                enc(x)
        else:
            assert enc(x).dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="expected scalar type Float but found BFloat16"):
            enc(x, src_key_padding_mask=pad)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # gradients on: the slow path honours autocast
        assert enc(x, src_key_padding_mask=pad).dtype == torch.float32


L9 = "09_attention_fast_paths"


def test_lesson_9_which_sdpa_kernel_runs_on_a_cpu():
    """Lesson 9: on a CPU SDPA runs its flash kernel with no mask and with a boolean mask alike,
    MATH when restricted to it, and attention on a jagged nested tensor goes to MATH (every release
    from 2.4 to 2.15), while giving the same result as padded SDPA on the real tokens."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from course.fastpath import masked_attention_inputs, ops_that_ran, ragged_batch

    flash, math_ = "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math"
    q, k, v, pad = masked_attention_inputs(0, batch=2, heads=2, length=64, dim=16)
    keys = ~pad[:, None, None, :]
    assert flash in ops_that_ran(lambda: F.scaled_dot_product_attention(q, k, v))
    assert flash in ops_that_ran(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keys))
    with sdpa_kernel(SDPBackend.MATH):
        ran = ops_that_ran(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keys))
    assert math_ in ran and flash not in ran
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # the CPU's flash kernel is the FLASH_ATTENTION backend
        assert flash in ops_that_ran(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keys))
    assert ("OVERRIDEABLE" in SDPBackend.__members__) == (TORCH >= (2, 13)) or (2, 4) < TORCH < (2, 13)
    x, pad = ragged_batch(1, batch=3, length=12, dim=16, valid=0.5)
    real = ~pad
    offsets = torch.cat([real.new_zeros(1, dtype=torch.long), real.sum(1).cumsum(0)])
    jq = torch.nested.nested_tensor_from_jagged(x[real].reshape(-1, 2, 8), offsets).transpose(1, 2)
    pq = x.reshape(3, 12, 2, 8).transpose(1, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ran = ops_that_ran(lambda: F.scaled_dot_product_attention(jq, jq, jq))
        out = F.scaled_dot_product_attention(jq, jq, jq).transpose(1, 2).values()
    assert math_ in ran and flash not in ran
    want = F.scaled_dot_product_attention(pq, pq, pq, attn_mask=~pad[:, None, None, :]).transpose(1, 2)[real]
    assert torch.allclose(out, want, atol=1e-5)
    text = prose(L9)
    assert "every release from 2.4 to 2.15 sends it to the `MATH` backend" in text
    assert "`aten::_scaled_dot_product_flash_attention_for_cpu`, with a boolean mask too" in text
    assert "the CPU's flash-style kernel counts as `FLASH_ATTENTION`" in text
    assert "in recent releases (2.13 has it, 2.4 does not) `OVERRIDEABLE`" in text


def test_lesson_9_jagged_to_padded_and_the_fast_path_switch():
    """Lesson 9: the jagged layout's to_padded_tensor is missing on 2.4 and from 2.5 pads to the total length;
    torch.backends.mha.set_fastpath_enabled(False) keeps the encoder off its fast path; the fused
    attention allocates under a quarter of the naive one (3% at the lesson's CPU sizes)."""
    from course.fastpath import FAST_OP, encoder, masked_attention_inputs, ops_that_ran, ragged_batch
    from course.references.fastpath import naive_masked_attention

    nt = torch.nested.nested_tensor_from_jagged(torch.randn(5, 3), torch.tensor([0, 2, 5]))
    if TORCH < (2, 5):
        with pytest.raises(NotImplementedError):
            nt.to_padded_tensor(0.0)
    else:  # padded to the total of the lengths (5), not the longest (3), unless output_size is given
        assert nt.to_padded_tensor(0.0).shape == (2, 5, 3)
        assert nt.to_padded_tensor(0.0, output_size=(2, 3, 3)).shape == (2, 3, 3)
    text = prose(L9)
    assert "`nt.to_padded_tensor(0.0)` exists from torch 2.5 on, but not for the jagged layout on 2.4" in text
    assert "sequences of 2 and 3 tokens come back as `(2, 5, D)`" in text
    enc = encoder(0)
    x, pad = ragged_batch(1, batch=2, length=5, dim=16)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert FAST_OP in ops_that_ran(lambda: enc(x, src_key_padding_mask=pad))
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            assert FAST_OP not in ops_that_ran(lambda: enc(x, src_key_padding_mask=pad))
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
    from torch.profiler import ProfilerActivity, profile

    def allocated(fn):
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
            fn()
        return sum(max(e.self_cpu_memory_usage, 0) for e in p.key_averages())

    q, k, v, pad = masked_attention_inputs(2, batch=1, heads=4, length=1024, dim=64)
    naive = allocated(lambda: naive_masked_attention(q, k, v, pad))
    fused = allocated(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=~pad[:, None, None, :]))
    assert naive > 3 * 16 * 2**20 and fused < naive / 4, (naive, fused)


def test_lesson_9_keeps_torchs_fx_tracing_notice_out_of_a_jagged_lesson():
    """torch 2.13-2.15 log "is_fx_tracing will return true ..." at a jagged tensor's first op; the course
    drops that record (only it) from the logger, so lesson 9's outputs stay clean."""
    import logging
    import subprocess
    import sys

    import course  # noqa: F401  (installs the filter)

    logger = logging.getLogger("torch.fx._symbolic_trace")
    record = logging.LogRecord(logger.name, logging.WARNING, __file__, 1,
                               "is_fx_tracing will return true for both fx.symbolic_trace and torch.export.", None, None)
    other = logging.LogRecord(logger.name, logging.WARNING, __file__, 1, "something else", None, None)
    assert not all(f.filter(record) for f in logger.filters) and all(f.filter(other) for f in logger.filters)
    code = ("import course, torch\n"
            "nt = torch.nested.nested_tensor_from_jagged(torch.randn(10, 8), torch.tensor([0, 3, 10]))\n"
            "torch.nn.Linear(8, 4)(nt)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "is_fx_tracing" not in proc.stderr, proc.stderr[-2000:]


def test_lesson_3_channels_last_3d_and_inductors_own_layout_choice():
    """Lesson 3: 5-D tensors have channels_last_3d (NDHWC; Conv3d keeps it; channels_last refuses a
    5-D tensor); Inductor's layout optimisation is on by default and, on a CPU with oneDNN, always
    picks channels-last for a graph with convolutions (its rule, read from the installed torch)."""
    import inspect

    import torch._inductor.config as inductor_config
    from torch._inductor.graph import GraphLowering

    clip = torch.randn(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d)
    assert clip.stride() == (360, 1, 90, 18, 3)
    conv = torch.nn.Conv3d(3, 8, 3, padding=1).to(memory_format=torch.channels_last_3d)
    assert conv(clip).is_contiguous(memory_format=torch.channels_last_3d)
    with pytest.raises(RuntimeError):
        torch.randn(2, 3, 4, 5, 6).to(memory_format=torch.channels_last)
    assert inductor_config.layout_optimization is True
    rule = inspect.getsource(GraphLowering.decide_layout_opt)
    assert "mkldnn" in rule and "always use channels_last" in rule
    text = prose("03_channels_last")
    assert "on a CPU with oneDNN it always does" in text and "`torch.channels_last_3d`: NDHWC" in text


def test_lesson_2_profiler_names_each_node_type_by_one_top_level_op():
    """Lesson 2's comparison with torch.profiler: every module type and function of the lesson's model
    runs one top-level ATen op that course.fx.ATEN_OP_TYPES names as op_type names the node (lower
    case), so the two columns line up; nodes that run no op (Identity, the input, the output) get no
    profiler time. Shares add to 1."""
    from torch import fx

    from course.fx import ATEN_OP_TYPES, profiler_shares
    from course.models import small_resnet

    model = small_resnet(seed=0, width=4, blocks=(1, 1, 1), tap=True).eval()
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        shares, per_call = profiler_shares(fx.symbolic_trace(model), x, runs=2)
    assert "other" not in shares, shares
    assert abs(sum(shares.values()) - 1) < 1e-9 and per_call > 0
    gm = fx.symbolic_trace(model)
    names = set()
    for n in gm.graph.nodes:
        if n.op == "call_module":
            names.add(type(gm.get_submodule(n.target)).__name__.lower())
        elif n.op in ("call_function", "call_method"):
            names.add(getattr(n.target, "__name__", str(n.target)).lower())
    assert set(shares) <= names and names - set(shares) <= {"identity"}, (names, shares)
    assert set(ATEN_OP_TYPES.values()) >= set(shares)
    assert "it even gives time to nodes that run no op at all" in prose("02_fx_transforms")


def test_lesson_9_the_fast_path_asks_about_autocast_without_a_device():
    """Lesson 9's explanation of issue 107663: the encoder and its layer ask torch.is_autocast_enabled()
    with no device, which answers for CUDA: inside torch.autocast("cpu") it says False, so the fast path
    runs under CPU autocast."""
    import inspect
    import re

    for cls in (torch.nn.TransformerEncoderLayer, torch.nn.TransformerEncoder):
        assert re.findall(r"torch\.is_autocast_enabled\([^)]*\)", inspect.getsource(cls.forward)) == [
            "torch.is_autocast_enabled()"], cls
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled()
    assert "it asks whether autocast is on *for CUDA* (`torch.is_autocast_enabled()` without a device)" in prose(L9)


LESSON_10_CLAIMS = '''
import torch
import torch.distributed as dist


def claims(rank, world_size):
    out = {}
    try:
        dist.reduce_scatter(torch.empty(1), list(torch.arange(2.0).chunk(2)))
        out["reduce_scatter"] = True
    except RuntimeError as e:
        out["reduce_scatter"] = "does not support reduce_scatter" in str(e) and str(e)
    out["threads"] = torch.get_num_threads()
    return out
'''


def test_lesson_10_what_gloo_supports_and_what_a_worker_sees(tmp_path):
    """Lesson 10 says: gloo on torch 2.4 has no reduce_scatter ("does not support"), 2.13 and later
    have it; nccl is absent from a CPU build; a course worker starts with every core's threads (torchrun
    sets one: tests/test_parallel.py); gloo's send blocks until the receive (the deadlock demo:
    tests/test_parallel.py, shift_naive)."""
    import torch.distributed as dist

    from course.parallel import launch, write_worker

    write_worker("course_claims_10", LESSON_10_CLAIMS, folder=tmp_path)
    got = launch("course_claims_10:claims", 2, path=tmp_path)[0]
    if TORCH < (2, 5):
        assert got["reduce_scatter"] and got["reduce_scatter"] is not True, got
    elif TORCH >= (2, 13):
        assert got["reduce_scatter"] is True, got
    import subprocess
    import sys

    fresh = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], capture_output=True,
                           text=True, check=True)
    assert got["threads"] == int(fresh.stdout), (got, fresh.stdout)  # a fresh interpreter's default: every core
    if not torch.cuda.is_available() and "+cpu" in torch.__version__:
        assert not dist.is_nccl_available()
    text = (SOLUTIONS / "10_data_parallel" / "10_data_parallel.ipynb").read_text()
    assert "gloo on torch 2.4 has no `reduce_scatter`" in text and "2.13 and later have it" in text


def test_lesson_6_batchnorm_running_statistics_under_vmap():
    """Lesson 6 says: with stacked buffers, each member's running statistics update in place under
    vmap exactly as the loop's; shared (unbatched) buffers are refused with torch's "Batch norm got a
    batched tensor" error; replace_all_batch_norm_modules_ leaves no buffers and runs."""
    import copy

    from torch import nn
    from torch.func import functional_call, replace_all_batch_norm_modules_, stack_module_state, vmap

    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)) for _ in range(4)]
    params, buffers = stack_module_state(members)
    base = copy.deepcopy(members[0]).to("meta")
    xs = torch.randn(4, 32, 8)
    call = lambda p, b, x: functional_call(base, (p, b), (x,))  # noqa: E731
    vmap(call)(params, buffers, xs)
    for member, x in zip(members, xs):
        member(x)
    assert torch.allclose(buffers["1.running_mean"], torch.stack([m[1].running_mean for m in members]), atol=1e-6)
    assert buffers["1.running_mean"].abs().sum() > 0
    shared = {name: t[0].clone() for name, t in buffers.items()}
    with pytest.raises(RuntimeError, match="Batch norm got a batched tensor as input while the running_mean"):
        vmap(call, in_dims=(0, None, 0))(params, shared, xs)
    replace_all_batch_norm_modules_(base)
    assert dict(base.named_buffers()) == {}
    assert vmap(lambda p, x: functional_call(base, p, (x,)))(params, xs).shape == (4, 32, 3)
    text = (SOLUTIONS / "06_vmap_ensembles" / "06_vmap_ensembles.ipynb").read_text()
    assert "shared buffers:" in text and "replace_all_batch_norm_modules_" in text


def test_lesson_6_kl_div_has_no_batching_rule_and_the_warning_can_be_made_an_error():
    """What lesson 6's last ensemble exercise rests on, on the installed torch: ``F.kl_div`` under
    ``vmap`` falls back to a loop over the slices, with PyTorch's warning naming ``aten::kl_div``
    (a torch that gains a batching rule for it fails here, and the exercise needs another op); the
    result is still right; an "error" filter turns the warning into an exception whose traceback
    reaches the caller's line; and 0 * log 0 is NaN where ``torch.xlogy`` gives 0."""
    import traceback

    from torch.func import vmap

    from course.vmap import vmap_fallbacks

    log_q = torch.randn(4, 3, 5, dtype=torch.float64).log_softmax(-1)
    target = torch.softmax(torch.randn(3, 5, dtype=torch.float64), -1)

    def one(lq):
        return F.kl_div(lq, target, reduction="batchmean")

    assert vmap_fallbacks(vmap(one), log_q) == ["aten::kl_div"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = vmap(one)(log_q)
    assert torch.allclose(got, torch.stack([one(lq) for lq in log_q]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with pytest.raises(UserWarning, match="batching rule for aten::kl_div") as caught:
            vmap(one)(log_q)
    assert "one" in [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)]
    zero = torch.zeros(1)
    assert torch.isnan(zero * zero.log()).all() and torch.equal(torch.xlogy(zero, zero), zero)
    text = " ".join(prose("06_vmap_ensembles").split())
    assert "implemented the batching rule for aten::..." in text and "`torch.xlogy(a, b)`" in text


def test_lesson_4_the_legacy_jacobian_defaults_to_reverse_mode_in_a_loop():
    """Exercise 6's planted block: torch.autograd.functional.jacobian defaults to reverse mode,
    unvectorised; forward mode without vectorize=True raises; the planted call is that default."""
    import inspect

    from torch.autograd.functional import jacobian

    from course.forward_ad import WideFunction, tall_jacobian_planted

    defaults = {k: p.default for k, p in inspect.signature(jacobian).parameters.items()}
    assert defaults["strategy"] == "reverse-mode" and defaults["vectorize"] is False
    f, x = WideFunction(3, 40, 8, seed=0, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="vectorize=True"):
        jacobian(f, x, strategy="forward-mode")
    assert torch.allclose(jacobian(f, x, strategy="forward-mode", vectorize=True), torch.func.jacrev(f)(x))
    assert torch.allclose(tall_jacobian_planted(f, x), torch.func.jacrev(f)(x))
    text = prose("04_forward_ad")
    assert 'Its defaults are `strategy="reverse-mode"` and `vectorize=False`' in text
    assert '`strategy="forward-mode"` needs `vectorize=True` too (without it, PyTorch raises)' in text


class _NotATensor:
    pass


def test_lesson_10_torch_load_loads_tensors_only_by_default_from_2_6(tmp_path):
    """Lesson 10's comment: ``weights_only=True`` is the default from torch 2.6 (2.4 warns without it)."""
    obj, tensor = tmp_path / "obj.pt", tmp_path / "t.pt"
    torch.save({"t": torch.ones(1), "o": _NotATensor()}, obj)
    torch.save(torch.ones(2), tensor)
    if TORCH >= (2, 6):
        with pytest.raises(Exception, match="[Ww]eights.only"):
            torch.load(obj)  # the default refuses a pickled object that is not a tensor
    else:
        with pytest.warns(FutureWarning, match="weights_only"):
            torch.load(obj)
    assert torch.load(tensor, weights_only=True).sum().item() == 2.0  # what the lesson loads, on every release
    source = (SOLUTIONS / "10_data_parallel" / "10_data_parallel.ipynb").read_text()
    assert 'weights_only=True).item()' in source

"""Lesson 5's checks across the judge/learner boundary: functions to differentiate cross as
recipes (built again by the course's code on the learner's side), the transforms a picker returns
cross by name, and the structure questions (a loop or not, a Hessian built or not) are answered by
the judge's own clock, never by op counts the learner's process could report."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

from autograder import program as prog
from course import remote, wire
from course.checks.jacobians import (SERVED, check_batched_hessian, check_batched_jacobian, check_hvp,
                                     check_parameter_jacobians, check_pick_jacobian, check_picker_speed, check_row_jacobian,
                                     check_batched_jacobian_sum, check_largest_chunk, flat_layer)
from course.grading import SpeedUndecided
from course.jacobians import TensorWatch, energy, tanh_layer
from served_helpers import UNDECIDED, memoised, never_failed, served

ROOT = Path(__file__).resolve().parents[1]


# -- recipes and names on the wire ----------------------------------------------------------------

def test_recipes_cross_as_data_and_are_built_by_the_course_on_the_other_side():
    layer = flat_layer(tanh_layer(14, 12, seed=3), (2, 7))
    e = energy(6, seed=2, dtype=torch.float64)
    sent = wire.decode(wire.encode([layer, e.gradient, jacfwd, jacrev]))
    assert isinstance(sent[0], wire.Recipe) and isinstance(sent[1], wire.Recipe) and sent[1].attr == "gradient"
    assert sent[2] is jacfwd and sent[3] is jacrev  # the very objects: a check can ask `is jacfwd`
    built = remote.build(sent)
    x = torch.randn(3, 4)
    assert torch.equal(built[0](x), layer(x))
    y = torch.randn(6, dtype=torch.float64)
    assert torch.equal(built[1](y), e.gradient(y))


@pytest.mark.parametrize("forged, message", [
    (wire.Recipe("os.system", {"command": "true"}), "no recipe named"),
    (wire.Recipe("course.jacobians.tanh_layer", {"n_out": 2, "n_in": 2}, "__class__"), "attribute"),
    (wire.Recipe("course.nowhere.thing", {}), "No module named"),
])
def test_a_recipe_names_only_what_the_course_registered(forged, message):
    """The learner's side builds recipes, the judge never does; still, only registered builders
    and public attributes are reachable, and a private one does not even decode."""
    if forged.attr == "__class__":
        with pytest.raises(wire.WireError):
            wire.decode(wire.encode(forged).replace(b'"__class__"', b'"__class__"'))
        head = wire.encode(wire.Recipe("course.jacobians.tanh_layer", {"n_out": 2, "n_in": 2}, "weight"))
        with pytest.raises(wire.WireError):
            wire.decode(head.replace(b'"weight"', b'"_weigh"'))
        return
    with pytest.raises(Exception, match=message):
        remote.build(forged)


# -- lesson 5's answers, served from a thread -------------------------------------------------------

def rows(f, x):
    x = x.detach().requires_grad_(True)
    y = f(x)
    return torch.stack([torch.autograd.grad(y[i], x, retain_graph=True)[0] for i in range(y.shape[0])])


def by_vmap(f, x):
    y, pullback = vjp(f, x)
    return vmap(pullback)(torch.eye(y.numel(), dtype=y.dtype, device=y.device))[0]


def lean_rows(f, x):
    x = x.detach().requires_grad_(True)
    y = f(x)
    return torch.stack([torch.autograd.grad(y, x, e, retain_graph=True)[0] for e in torch.eye(y.numel(), dtype=y.dtype)])


def lean_hessian(f, x):
    x = x.detach().requires_grad_(True)
    g = torch.autograd.grad(f(x), x, create_graph=True)[0]
    return torch.stack([torch.autograd.grad(g, x, e, retain_graph=True)[0] for e in torch.eye(g.numel(), dtype=g.dtype)])


def batched_rows(f, x):
    x = x.detach().requires_grad_(True)
    y = f(x)
    return torch.autograd.grad(y, x, torch.eye(y.numel(), dtype=y.dtype), is_grads_batched=True)[0]


def chunk_by_search(f, x, budget):
    def peak(c):
        with TensorWatch() as w:
            jacrev(f, chunk_size=c)(x)
        return w.largest_bytes
    if peak(1) > budget:
        raise ValueError("nothing fits")
    lo, hi = 1, f(x).numel()
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if peak(mid) <= budget else (lo, mid - 1)
    return lo


def by_sum(f, xs):
    return jacrev(lambda batch: f(batch).sum(0))(xs).movedim(1, 0)


def sample_loop(f, xs):
    return torch.stack([jacrev(lambda x: f(x[None])[0])(x) for x in xs])


def pick(f, x):
    with torch.no_grad():
        return jacfwd if f(x).numel() > x.numel() else jacrev


def closed_form_hvp(f, x, v):
    """The Hessian of the lesson's Energy written out by hand and multiplied by v: right, and
    quicker than the clock's Hessian, but n x n all the same."""
    s = torch.sigmoid(f.A @ x + f.c)
    h = (f.A.T * (s * (1 - s))) @ f.A + torch.diag(-f.d * torch.cos(x))
    i = torch.arange(len(x) - 1)
    h[i, i + 1] += 1
    h[i + 1, i] += 1
    return h @ v


def hvp_fwd_rev(f, x, v):
    return jvp(grad(f), (x,), (v,))[1]


def hvp_rev_rev(f, x, v):
    return grad(lambda y: torch.dot(grad(f)(y), v))(x)


def hvp_full(f, x, v):
    """The whole Hessian, by forward over reverse mode (so the watch of the modes is satisfied),
    times v: right, and n times the work of an HVP."""
    basis = torch.eye(len(x), dtype=x.dtype, device=x.device)
    return vmap(lambda e: jvp(grad(f), (x,), (e,))[1])(basis) @ v


def hvp_switch(f, x, v):
    """An HVP at the size of the one-call memory reading (``HVP_MEMORY_N`` elements), the whole
    Hessian everywhere else."""
    return jvp(grad(f), (x,), (v,))[1] if x.numel() == 4096 else hvp_full(f, x, v)


LEARNER = {
    "jacobian_rows": rows, "batched_jacobian_sum": by_sum, "pick_jacobian": pick,
    "batched_jacobian": lambda f, xs: vmap(jacrev(f))(xs),
    "batched_hessian": lambda f, xs: vmap(hessian(f))(xs),
    "hvp_fwd_rev": hvp_fwd_rev, "hvp_rev_rev": hvp_rev_rev,  # defined with def: the judge reads their programs
    "largest_chunk": chunk_by_search,
    # a chunk from a formula for 4-byte numbers, and the error for every budget
    "chunk_4_bytes": lambda f, x, budget: max(1, min(f(x).numel(), budget // (4 * f(x).numel()))),
    "chunk_refuses": lambda f, x, budget: (_ for _ in ()).throw(ValueError("no")),
    # plausible wrong answers: right numbers, wrong structure
    "rows_by_vmap": by_vmap,
    "sum_by_loop": sample_loop,
    "sum_by_vmap": lambda f, xs: vmap(jacrev(f))(xs),
    "batched_loop": lambda f, xs: torch.stack([jacrev(f)(x) for x in xs]),
    "hvp_full": hvp_full,
    "hvp_closed_form": closed_form_hvp,
    # loops as lean as loops get: a backward pass per row, per sample
    "hessian_lean_loop": lambda f, xs: torch.stack([lean_hessian(f, x) for x in xs]),
    "jacobian_lean_loop": lambda f, xs: torch.stack([lean_rows(f, x) for x in xs]),
    # a loop over the samples whose every step is batched: the rows of one sample in one backward pass
    "rows_batched_loop": lambda f, xs: torch.stack([batched_rows(f, x) for x in xs]),
    # red team, round 18: per sample, the gradient with its graph, then every row of the Hessian in one
    # batched backward pass (0.33 of the former yardstick, which took a backward pass per row)
    "hessian_batched_loop": lambda f, xs: torch.stack([batched_rows(lambda z: torch.autograd.grad(
        f(z), z, create_graph=True)[0], x) for x in xs]),
    # a loop that sleeps at small sizes, to look as flat as one Jacobian of the batch
    "flat_loop": lambda f, xs: (time.sleep(max(0.0, 0.05 - 0.0004 * len(xs))), sample_loop(f, xs))[1],
    # a loop that remembers its answers (the same inputs timed again and again would be free)
    "memo_loop": lambda f, xs: memoised(sample_loop)(f, xs),
    # right at the numerics check's sizes, anything at the clock's
    "fast_garbage": lambda f, xs: by_sum(f, xs) if len(xs) < 100 else torch.zeros(len(xs), f(xs).shape[1], xs.shape[1]),
    # red team, round 18: the Hessian built except at the one-call memory reading's size
    "hvp_switch": hvp_switch,
    # ...and jacrev, then a sleep as long as a loop over the rows
    "rows_asleep": lambda f, x: (lambda J: (time.sleep(60e-6 * J.shape[0]), J)[1])(jacrev(f)(x.detach())),
    # and wrong choices
    "pick_first_dim": lambda f, x: jacfwd if f(x).shape[0] > x.shape[0] else jacrev,
    "pick_by_name": lambda f, x: "jacfwd" if f(x).numel() > x.numel() else "jacrev",
    "zeros": lambda f, x: torch.zeros(f(x).numel(), x.numel()),
    # right numbers, but the caller's x now requires grad (the lesson forbids it)
    "rows_on_callers_x": lambda f, x: rows(f, x.requires_grad_(True)),
    # Jacobians with respect to the weight and the bias: right, swapped, and changing the weight
    "parameter_jacobians": lambda w, b, x: jacrev(lambda w, b: torch.tanh(F.linear(x, w, b)), argnums=(0, 1))(w, b),
    "parameter_jacobians_swapped": lambda w, b, x: jacrev(lambda w, b: torch.tanh(F.linear(x, w, b)),
                                                          argnums=(1, 0))(w, b),
    "parameter_jacobians_zeroes_w": lambda w, b, x: (jacrev(lambda w, b: torch.tanh(F.linear(x, w, b)),
                                                            argnums=(0, 1))(w, b), w.zero_())[0],
}


@pytest.fixture
def learner():
    yield from served(LEARNER)


def test_right_answers_pass_every_served_check(learner, capsys):
    """Every check passes, or (those read by the judge's clock) a busy machine leaves it undecided:
    never a decided miss."""
    results = [never_failed(check) for check in (
        lambda: check_row_jacobian(learner("jacobian_rows")),
        lambda: check_batched_jacobian_sum(learner("batched_jacobian_sum")),
        lambda: check_pick_jacobian(learner("pick_jacobian")),
        lambda: check_batched_jacobian(learner("batched_jacobian")),
        lambda: check_batched_hessian(learner("batched_hessian")),
        lambda: check_hvp(learner("hvp_fwd_rev"), learner("hvp_rev_rev")),
        lambda: check_parameter_jacobians(learner("parameter_jacobians")),
        # the grader's hidden call: its references answer
        lambda: check_largest_chunk(learner("largest_chunk"), seed=7),
    )]
    out = capsys.readouterr().out
    assert out.count("ok:") == 8 - sum(r is UNDECIDED for r in results), out
    assert "ops for" not in out, out  # structure from the judge's clock
    assert "the grader's clock" in out or UNDECIDED in results, out


@pytest.mark.parametrize("check, name, message", [
    (check_parameter_jacobians, "parameter_jacobians_swapped", "returned \\(bias, weight\\)"),
    (check_parameter_jacobians, "parameter_jacobians_zeroes_w", "changed its input weight"),
    (check_row_jacobian, "rows_by_vmap", "the same work whatever the number of rows"),
    (check_row_jacobian, "rows_on_callers_x", "switched on requires_grad of the caller's x"),
    (check_batched_jacobian_sum, "sum_by_loop", "a Python loop over the samples"),
    (check_batched_jacobian_sum, "sum_by_vmap", "refuses a single sample"),
    (check_batched_jacobian_sum, "flat_loop", "a Python loop over the samples"),
    (check_batched_jacobian_sum, "memo_loop", "a Python loop over the samples"),
    (check_batched_jacobian_sum, "fast_garbage", "while timed beside the course's loop"),
    (check_batched_jacobian, "batched_loop", "a Python loop over the samples"),
    (check_pick_jacobian, "pick_first_dim", "compare numbers of elements"),
    (check_pick_jacobian, "pick_by_name", "returned the string"),
    (check_largest_chunk, "chunk_4_bytes", "over the budget|no chunk fits"),
    (check_largest_chunk, "chunk_refuses", "raised ValueError"),
])
def test_wrong_structure_or_choice_across_the_boundary_fails_with_its_cause(learner, check, name, message):
    with pytest.raises(AssertionError, match=message):
        check(learner(name))


@pytest.mark.parametrize("check, name", [
    (check_batched_jacobian, "jacobian_lean_loop"),
    (check_batched_hessian, "hessian_lean_loop"),
    (check_batched_jacobian, "rows_batched_loop"),
    (check_batched_hessian, "hessian_batched_loop"),
])
def test_a_loop_over_the_samples_however_lean_never_passes_and_is_named(learner, check, name):
    """Loops as lean as loops get read about 1.0 of the course's loop on a quiet machine (the yardstick
    runs nothing else per sample) and are decided; a busy machine can pull them below the loop's bar
    (0.76 against the old, heavier yardstick, in CI), and a loop whose every step is one batched
    backward pass reads about 0.6 whatever the load. Neither is ever "no loop": either failed, or
    undecided (no points) with a message that names the loop as a cause."""
    with pytest.raises(AssertionError) as caught:
        check(learner(name))
    if isinstance(caught.value, SpeedUndecided):
        assert "still loops over the samples in Python" in str(caught.value)
    else:
        assert "a Python loop over the samples" in str(caught.value)


@pytest.mark.parametrize("hessian", [False, True])
def test_the_course_loop_does_no_more_per_sample_than_a_learners_lean_loop(hessian):
    """The yardstick runs no more ATen ops (forward and backward, as the dispatcher sees them) than
    the leanest loop a learner writes: on a quiet machine such a loop reads about 1.0 of it (0.94 to
    1.04 measured here), not 0.88 as against the former yardstick, whose clone and reshape added a
    node to every backward pass. Counted, not timed: the clock's margin is load's to move."""
    from course.checks.jacobians import _course_loop
    from course.jacobians import TensorWatch

    f = energy(8, seed=0, device="cpu") if hessian else tanh_layer(5, 7, seed=0, device="cpu")
    xs = torch.randn(16, 8 if hessian else 7)
    lean = lean_hessian if hessian else lean_rows
    with TensorWatch() as theirs:
        ours = _course_loop(hessian=hessian)(f, xs)
    with TensorWatch() as mine:
        got = torch.stack([lean(f, x) for x in xs])
    torch.testing.assert_close(ours, got)
    assert theirs.ops <= mine.ops, (theirs.ops, mine.ops)


def test_an_hvp_that_builds_the_hessian_is_caught_by_the_judges_clock(learner):
    with pytest.raises(AssertionError, match="the work of building the Hessian"):
        check_hvp(learner("hvp_full"), learner("hvp_rev_rev"))


@pytest.mark.parametrize("share, verdict", [(289 / 391, "fail"), (0.4, "fail"), (0.2, "undecided"),
                                            (0.1, "pass"), (0.008, "pass")])
def test_the_hvps_clock_has_bars_of_its_own(learner, monkeypatch, share, verdict):
    """CI, 2026-12-04: a Hessian built by vmap over jvp of grad, the very work of the course's
    ``hessian(f)(x) @ v``, read 0.74 of it on a busy machine, undecided between the lessons' general
    bars (a third, 0.8). An HVP reads 0.005-0.008 of it and a built Hessian about 1: the HVP's clock
    decides at a tenth and at 0.4. The clock's reading is planted here; what is tested is the verdict."""
    from course.checks import jacobians

    monkeypatch.setattr(jacobians, "clock_against_loop", lambda *args, **kw: (share * 0.391, 0.391))
    fn = learner("hvp_full")
    if verdict == "pass":
        jacobians._hvp_growth(fn, "hvp_fwd_rev", 0)
        return
    with pytest.raises(SpeedUndecided if verdict == "undecided" else AssertionError) as caught:
        jacobians._hvp_growth(fn, "hvp_fwd_rev", 0)
    assert (type(caught.value) is SpeedUndecided) == (verdict == "undecided")
    if verdict == "fail":
        assert "the work of building the Hessian" in str(caught.value)


@pytest.fixture
def kernel_count(monkeypatch):
    """The grading parent's reading of the learner's peak memory (here the learner is a thread of
    this process, so the kernel's count of this process is its count)."""
    import os

    from autograder.sandbox.parent import tree_peak_bytes
    from course import grader_hooks

    monkeypatch.setattr(grader_hooks, "learner_peak", lambda reset=False: tree_peak_bytes(os.getpid(), reset))


def test_the_kernel_counts_a_processes_peak_memory_from_a_reset():
    import os

    from autograder.sandbox.parent import tree_peak_bytes

    before = tree_peak_bytes(os.getpid(), reset=True)
    block = torch.ones(64 * 2**20 // 8, dtype=torch.float64)  # 64 MiB, every page touched
    assert tree_peak_bytes(os.getpid()) - before >= 60 * 2**20
    del block
    now = tree_peak_bytes(os.getpid(), reset=True)  # the count starts again from what is resident now
    with open(f"/proc/{os.getpid()}/status") as fh:
        rss = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))
    assert abs(now - rss) < 16 * 2**20 and tree_peak_bytes(os.getpid()) - now < 16 * 2**20


HELPER = ("import time\nblock = b'\\x01' * (128 * 2**20)\ntime.sleep(0.2)\ndel block\n"
          "open('/proc/self/clear_refs', 'w').write('5')\n")


def test_the_parents_watch_sees_a_peak_set_back_from_inside_and_a_helper_that_ended():
    """What ``VmHWM`` alone misses, the parent's sampling of resident memory sees: a process that sets
    its own peak back (``clear_refs``, as native code can, where no audit hook looks) after freeing
    128 MiB, and a helper process that built 128 MiB and ended before the reading."""
    import os
    import subprocess
    import sys

    from autograder.sandbox.parent import PeakWatch, tree_peak_bytes

    watch = PeakWatch(os.getpid())
    before = watch.start()
    subprocess.run([sys.executable, "-c", HELPER], check=True)  # a helper: 128 MiB, then gone
    assert tree_peak_bytes(os.getpid()) - before < 64 * 2**20  # the kernel's peak left with it...
    assert watch.stop() - before >= 100 * 2**20  # ...the watch saw it while it lived

    # a live process that sets its own peak back (this one could not: pytest's own process keeps
    # freed memory resident, so a new block need not raise its peak at all)
    before = watch.start()
    helper = subprocess.Popen([sys.executable, "-c", HELPER + "print('reset', flush=True)\ntime.sleep(30)\n"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert helper.stdout.readline().strip() == "reset"
        assert tree_peak_bytes(os.getpid()) - before < 64 * 2**20  # alive, its peak set back...
        assert watch.stop() - before >= 100 * 2**20  # ...the watch had seen it
    finally:
        helper.kill()
        helper.wait()


PEAK_PROGRAM = [
    {"index": 0, "id": "a", "kind": "instructor", "source": "import course.grader_hooks as hooks\n", "grade_id": ""},
    {"index": 1, "id": "b", "kind": "solution", "grade_id": "sol", "answers": ["grow"],
     "source": "def grow(mib):\n    import torch\n    return float(torch.ones(mib * 2**17, dtype=torch.float64).sum())\n"},
    {"index": 2, "id": "c", "kind": "test", "grade_id": "t", "served": True,
     "source": "p0 = hooks.learner_peak(True)\ngrow(96)\np1 = hooks.learner_peak()\np2 = hooks.learner_peak(True)\n"
               "grow(0)\nprint(f'grew {(p1 - p0) / 2**20:.0f} {(hooks.learner_peak() - p2) / 2**20:.0f}')\n"},
]


def test_the_judge_reads_the_learners_peak_memory_through_the_parent(tmp_path):
    """The whole path: the judge asks, the grading parent resets and reads the learner's
    processes' peak in /proc (in bubblewrap where it works), and answers."""
    from autograder.sandbox import bwrap_works, run_program

    out = run_program(PEAK_PROGRAM, judge_setup=[PEAK_PROGRAM[0]["source"]],
                      sandbox="bwrap" if bwrap_works() else "none", cell_timeout=60, timeout=120, memory_mb=2000,
                      log=tmp_path / "log")
    assert out.status == "ok", out
    text = out.cells[2].output.strip()
    assert text.startswith("grew "), out.cells[2]
    grew, then = (float(x) for x in text.split()[1:])
    assert grew >= 90 and then < 16, text


NATIVE_RESET = r'''
from torch._inductor.codecache import CppPythonBindingsCodeCache
# C++ compiled by PyTorch's own machinery in the sandbox: its fopen passes no audit hook
reset_peak = CppPythonBindingsCodeCache.load_pybinding(["long"], """
#include <cstdio>
extern "C" void kernel(long unused) {
    FILE* f = std::fopen("/proc/self/clear_refs", "w");
    if (f) { std::fputs("5", f); std::fclose(f); }
}
""")
seen = []

def peak_kib():
    return int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1])

def grow(mib):
    import time, torch
    block = torch.ones(mib * 2**17, dtype=torch.float64)
    time.sleep(0.05)
    total = float(block.sum())
    del block
    high = peak_kib()
    reset_peak(0)
    seen.append(high - peak_kib())
    return total
'''


def test_a_peak_set_back_from_native_code_in_the_sandbox_is_still_seen(tmp_path):
    """A learner's answer that builds 96 MiB, frees it, and sets the kernel's peak back from C++ it
    compiled in the sandbox (the audit hook never sees C's fopen): the peak did drop, and the parent's
    sampled count still shows the growth."""
    from autograder.sandbox import bwrap_works, run_program

    program = [dict(cell) for cell in PEAK_PROGRAM]
    program[1]["source"] = NATIVE_RESET
    program[2]["source"] = ("p0 = hooks.learner_peak(True)\ngrow(96)\n"
                            "print(f'grew {(hooks.learner_peak() - p0) / 2**20:.0f}')\n")
    program.append({"index": 3, "id": "d", "kind": "instructor", "grade_id": "",
                    "source": "print('dropped', seen[0] // 1024)\n"})
    out = run_program(program, judge_setup=[program[0]["source"]], sandbox="bwrap" if bwrap_works() else "none",
                      cell_timeout=120, timeout=240, memory_mb=2000, log=tmp_path / "log")
    assert out.status == "ok", out
    assert not out.cells[1].error, out.cells[1]
    dropped = out.cells[3].output.split()
    assert dropped[0] == "dropped" and int(dropped[1]) >= 80, out.cells[3]  # the reset worked...
    text = out.cells[2].output.strip()
    assert text.startswith("grew ") and float(text.split()[1]) >= 80, out.cells[2]  # ...and was seen through


def test_an_hvp_that_writes_the_hessian_out_beats_the_clock_but_not_the_kernels_count(learner, kernel_count,
                                                                                      monkeypatch):
    from course.checks import jacobians
    from course.checks.jacobians import _hvp_growth
    from course.grading import SpeedUndecided

    # fast enough for the clock at times (0.06-0.41 of the course's Hessian, against a bar of 0.1), but the kernel
    # counts the learner's memory during every timed call as well
    with pytest.raises(AssertionError, match="built the Hessian .*during a call the grader timed"):
        _hvp_growth(learner("hvp_closed_form"), "hvp_fwd_rev", 0)
    closed = learner("hvp_closed_form")
    for seed in (0, 1):  # read once, judged at every call (the hidden tests ask again); the kernel's count
        # comes before the clock, so the verdict is "built the Hessian" at once, never "run it again"
        with pytest.raises(AssertionError, match="built the Hessian .*as the operating system counts it"):
            check_hvp(closed, learner("hvp_rev_rev"), seed=seed)

    def undecided(*args):  # the busiest machine: the clock never tells; the verdict must not wait on it
        raise SpeedUndecided("the clock could not tell")

    with monkeypatch.context() as patch, \
            pytest.raises(AssertionError, match="built the Hessian .*as the operating system counts it"):
        patch.setattr(jacobians, "_hvp_growth", undecided)
        check_hvp(learner("hvp_closed_form"), learner("hvp_rev_rev"))
    right = learner("hvp_fwd_rev"), learner("hvp_rev_rev")
    check_hvp(*right)
    assert all(fn.__dict__["memory_reading"] < 8 * 2**20 for fn in right), [fn.__dict__["memory_reading"] for fn in right]


def test_an_hvp_that_builds_the_hessian_only_where_memory_is_not_read_once_is_caught_while_timed(learner,
                                                                                                  kernel_count):
    """Red team, round 18: an HVP that behaves at the size of the one-call memory reading
    (``HVP_MEMORY_N``) and writes the Hessian out everywhere else passed (3/3 under the grader): the clock
    alone cannot tell a fast built Hessian. The kernel's count is now read around every call the clock
    times as well."""
    from course.checks.jacobians import HVP_MEMORY_N

    switch = learner("hvp_switch")
    with pytest.raises(AssertionError, match="built the Hessian .*during a call the grader timed"):
        check_hvp(switch, learner("hvp_rev_rev"))
    assert switch.__dict__["memory_reading"] < 8 * 2**20  # the one-call reading alone was fooled
    assert HVP_MEMORY_N == 4096


def test_a_row_loop_that_sleeps_instead_of_working_fails(learner, monkeypatch):
    """Red team, round 18: jacrev, then a sleep as long as a loop over the rows would take, grew with the
    rows as a loop does (2/2). The kernel's count of the learner's CPU time says it waited; a loop works."""
    from course import grader_hooks

    monkeypatch.setattr(grader_hooks, "learner_cpu", time.process_time)  # the learner is a thread here
    with pytest.raises(AssertionError, match="spent only .* of that time on a CPU"):
        check_row_jacobian(learner("rows_asleep"))
    never_failed(lambda: check_row_jacobian(learner("jacobian_rows")))  # a loop works for its time


def test_a_row_loop_a_busy_machine_kept_from_the_cpu_is_undecided_not_failed(learner, monkeypatch):
    """A right loop that a busy machine kept off the CPU for most of its time reads like the sleeper above
    by its CPU share alone, and was failed outright (an audit, 2026-12-04). The scheduler also counts the
    time a thread waited, ready to run: a loop kept from the CPU wanted it, a sleep did not. Here the
    learner's CPU count is shown a fifth of what it used, and the wall time as waited: undecided, never a
    fail; the sleeper, shown the same fifth and no wait, still fails."""
    from course import grader_hooks

    monkeypatch.setattr(grader_hooks, "learner_cpu", lambda: time.process_time() / 5)
    monkeypatch.setattr(grader_hooks, "learner_waited", lambda main=False: time.perf_counter())
    with pytest.raises(SpeedUndecided, match="ready for one, waiting, .* the machine was busy"):
        check_row_jacobian(learner("jacobian_rows"))
    monkeypatch.setattr(grader_hooks, "learner_waited", lambda main=False: 0.0)
    with pytest.raises(AssertionError, match="spent only .* of that time on a CPU") as caught:
        check_row_jacobian(learner("rows_asleep"))
    assert not isinstance(caught.value, SpeedUndecided)
    monkeypatch.setattr(grader_hooks, "learner_waited", lambda main=False: -1.0)  # the kernel keeps no count: as before
    with pytest.raises(AssertionError, match="spent only .* of that time on a CPU") as caught:
        check_row_jacobian(learner("jacobian_rows"))
    assert not isinstance(caught.value, SpeedUndecided)


def test_the_share_a_loop_worked_and_wanted_is_read_from_every_reading():
    """``_recorded``: per reading, the CPU share of the large calls' wall time, and that share with the
    time waited for a CPU; the most of each over the readings. A reading without a count of waiting
    leaves the second unknown (the CPU share decides alone)."""
    from course.checks.jacobians import _Growth, _recorded

    record = {"used": [[[(1.0, 0.1)], [(2.0, 0.2), (2.0, 0.4)]], [[(1.0, 0.1)], [(1.0, 0.25)]]],
              "waited": [[[0.0], [1.5, 1.5]], [[0.0], [0.5]]], "grown": []}
    g = _recorded(_Growth(1.0, 2.0, (8, 1024), "time"), record, 1)
    assert g.worked == pytest.approx(0.25) and g.wanted == pytest.approx(0.9)
    record["waited"][1][1] = [-1.0]
    assert _recorded(_Growth(1.0, 2.0, (8, 1024), "time"), record, 1).wanted is None
    del record["waited"]
    assert _recorded(_Growth(1.0, 2.0, (8, 1024), "time"), record, 1).wanted is None


def test_the_picker_speed_check_times_the_judges_own_transforms(learner, capsys):
    """Only the choice crosses; what is timed is torch.func in the judge, on the judge's layer."""
    check_picker_speed(learner("pick_jacobian"), bars={"cpu": 2.0, "cuda": 2.0}, tall=(2048, 32), wide=(32, 2048),
                       num_threads=1, rounds=7, min_run_time=0.05)
    with pytest.raises(AssertionError, match="returned the string 'jacfwd'"):
        check_picker_speed(learner("pick_by_name"), bars={"cpu": 1.5}, tall=(256, 16), wide=(16, 256))


def test_lesson_5_routes_every_graded_cell_to_the_judge():
    program = prog.instructor_program("05_jacobians_hessians",
                                      ROOT / "solutions/05_jacobians_hessians/05_jacobians_hessians.ipynb")
    assert program.graded and all(c.served for c in program.graded), [c.grade_id for c in program.graded if not c.served]
    assert "check_largest_chunk" in SERVED
    setup = "\n".join(program.judge_setup)
    assert "from course.checks.jacobians import" in setup and "S = course.sizes(" in setup


def test_a_row_loop_whose_small_calls_were_mostly_waiting_is_undecided_not_flat():
    """Lesson 5's row loop must take ten times as long for 128 times the rows, and fails at five or less: a
    busy machine adds the crossing's waiting to both sizes, most to the small one in share, and could make
    a loop read flat. Net of that waiting (the scheduler's count), it is undecided, never passed."""
    from course.checks.common import Clocked
    from course.checks.jacobians import _expect_loop, _Growth

    def growth(small_net, large_net):
        return _Growth(Clocked(0.010, small_net), Clocked(0.045, large_net), (8, 1024), "time")

    with pytest.raises(SpeedUndecided, match="net of the time your process and the grader waited"):
        _expect_loop(growth(0.001, 0.040), "jacobian_rows took", ": no loop")  # 4.5x by the clock, 40x net
    for nets in ((None, None), (0.009, 0.040)):  # not counted, or flat net of it too: a fail as before
        with pytest.raises(AssertionError, match=": no loop") as caught:
            _expect_loop(growth(*nets), "jacobian_rows took", ": no loop")
        assert not isinstance(caught.value, SpeedUndecided)

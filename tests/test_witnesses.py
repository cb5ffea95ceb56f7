"""The witnesses beside the course's "by hand" watchers (course.checks.witnesses): what the
watchers could not see, one plain-Python route each, and the checks of lessons 1, 3 and 7 failing
every one of them; the controls (honest answers, an honest thread that wakes once) keep passing.

Found 2026-11-30: a TorchScript function scripted before the call ran torch.lstm_cell and
torch.empty(...).stride() unheard by the TorchFunctionMode and by lesson 7's profile function; a
thread started before the call (waiting on a queue, or torch's inter-op pool spinning in
TorchScript) did the work for the answer unseen by both; and a table of strides made with torch
before the call answered lesson 3 by lookup, since every shape of the small sizes it drew was
a few thousand."""

import itertools
import queue
import threading
import time
import warnings

import pytest
import torch

from course.checks import broadcasting as B
from course.checks import memory_format as M
from course.checks import rnn as R
from course.checks.common import TorchCalls
from course.checks.witnesses import DispatcherOps, OtherThreads, alone
from served_helpers import broadcast_rule

with warnings.catch_warnings():  # torch 2.15 calls TorchScript deprecated; it still runs, which is the point
    warnings.simplefilter("ignore")

    @torch.jit.script
    def _scripted_cell(x, h, c, w_ih, w_hh, b_ih, b_hh):
        return torch.lstm_cell(x, (h, c), w_ih, w_hh, b_ih, b_hh)

    @torch.jit.script
    def _scripted_strides(n: int, c: int, h: int, w: int) -> list[int]:
        return torch.empty([n, c, h, w], device="meta").stride()

    @torch.jit.script
    def _scripted_broadcast(a: list[int], b: list[int]) -> list[int]:
        return (torch.empty(a) + torch.empty(b)).size()  # (on the meta device, torch's Python meta kernels run)


def _cell_args(seed=0):
    g = torch.Generator().manual_seed(seed)
    x, h, c = (torch.randn(3, n, generator=g) for n in (4, 5, 5))
    w = [torch.randn(20, 4, generator=g), torch.randn(20, 5, generator=g), torch.randn(20, generator=g),
         torch.randn(20, generator=g)]
    return [x, h, c, *w]


class Helper:
    """A thread started before the call, waiting on a queue for work the answer hands it."""

    def __init__(self, work):
        self.inbox, self.outbox = queue.Queue(), queue.Queue()
        self.thread = threading.Thread(target=self._serve, args=(work,), daemon=True)
        self.thread.start()

    def _serve(self, work):
        while True:
            args = self.inbox.get()
            if args is None:
                return
            try:
                self.outbox.put((True, work(*args)))
            except Exception as exc:  # handed back, as the answer's own
                self.outbox.put((False, exc))

    def __call__(self, *args):
        self.inbox.put(args)
        ok, out = self.outbox.get(timeout=60)
        if not ok:
            raise out
        return out

    def stop(self):
        self.inbox.put(None)
        self.thread.join(5)


@pytest.fixture(scope="module")
def cl_solution(tmp_path_factory):
    from autograder.solution_code import load_solution, solution_source

    return load_solution(solution_source("03_channels_last"), tmp_path_factory.mktemp("sol3") / "cl_witness.py",
                         "cl_witness")


@pytest.fixture
def helper():
    made = []

    def make(work):
        made.append(Helper(work))
        return made[-1]

    yield make
    for h in made:
        h.stop()


# -- the witnesses themselves ----------------------------------------------------------------------

def test_dispatcher_ops_hear_torchscript_and_its_forks_which_the_mode_does_not():
    args = _cell_args()
    with TorchCalls("mode") as seen:  # (the mode alone, as it was: TorchScript's op unheard)
        _scripted_cell(*args)
    assert not [n for n in seen.names if not n.startswith("aten::")], seen.names
    with DispatcherOps() as ops:
        _scripted_cell(*args)
    assert "aten::lstm_cell" in ops.names and not ops.blocked
    with DispatcherOps() as ops:
        torch.jit.wait(torch.jit.fork(_scripted_cell, *args))
    assert "aten::lstm_cell" in ops.names
    with DispatcherOps() as ops:
        sum(range(100))
    assert ops.names == [] and not ops.blocked


def test_dispatcher_ops_say_when_a_profiler_of_the_notebooks_keeps_them_out():
    with torch.autograd.profiler.profile(use_kineto=False):
        with DispatcherOps() as ops:
            torch.ones(2) + 1
    assert "a profiler of the notebook's was running" in ops.blocked
    with DispatcherOps() as ops:  # stopped from inside
        torch.autograd._disable_profiler_legacy()
    assert "stopped" in ops.blocked


def test_a_waiting_thread_is_not_seen_and_one_that_works_is(helper):
    h = helper(lambda n: sum(range(n)))
    others = OtherThreads()
    assert others.settle()
    with others:
        sum(range(10_000))
    assert others.worked == []
    with others:
        h(20_000)
    assert len(others.worked) == 1 and "ms of CPU" in others.worked[0]


def test_alone_forgives_one_wake_up_and_not_a_thread_that_works_every_time(helper):
    h = helper(lambda n: sum(range(n)))
    calls = []

    def once():  # an honest thread's rare wake-up: during the first try only
        calls.append(1)
        return h(20_000) if len(calls) == 1 else 7

    assert alone(once, label="once") == 7 and len(calls) == 2
    with pytest.raises(AssertionError, match="every|another thread of your notebook's process worked"):
        alone(lambda: h(20_000), label="helper")
    assert torch.get_num_threads() >= 1


def test_alone_keeps_torch_s_thread_count():
    before = torch.get_num_threads()
    seen = alone(torch.get_num_threads, label="count")
    assert seen == 1 and torch.get_num_threads() == before


# -- lesson 1: lstm_cell by hand -------------------------------------------------------------------

def _by_script(x, h, c, w_ih, w_hh, b_ih, b_hh):
    return _scripted_cell(x, h, c, w_ih, w_hh, b_ih, b_hh)


def _by_fork(x, h, c, w_ih, w_hh, b_ih, b_hh):
    return torch.jit.wait(torch.jit.fork(_scripted_cell, x, h, c, w_ih, w_hh, b_ih, b_hh))


@pytest.mark.parametrize("cell", [_by_script, _by_fork], ids=["scripted", "forked"])
def test_lesson_1_a_cell_hiding_pytorchs_op_in_torchscript_fails(cell):
    with pytest.raises(AssertionError, match=r"lstm_cell gives the right numbers, but it calls aten::lstm_cell"):
        R.check_lstm_cell(cell)


def test_lesson_1_a_cell_handing_its_work_to_a_waiting_thread_fails(helper):
    h = helper(lambda *a: torch.lstm_cell(a[0], (a[1], a[2]), *a[3:]))
    with pytest.raises(AssertionError, match="lstm_cell: while the answer ran, another thread"):
        R.check_lstm_cell(lambda *a: h(*a))


def test_lesson_1_an_honest_cell_passes_beside_an_idle_thread(helper, rnn_solution):
    helper(lambda *a: None)  # started, waiting, never handed anything
    R.check_lstm_cell(rnn_solution.lstm_cell)
    R.check_lstm_layer(rnn_solution.lstm_layer)


# -- lesson 3: strides and the contiguity rule by hand --------------------------------------------

def _strides_by_script(shape):
    return tuple(_scripted_strides(*shape))


def test_lesson_3_strides_by_torchscript_fail():
    with pytest.raises(AssertionError, match=r"nchw_strides called torch \(aten::"):
        M.check_strides(_strides_by_script, _strides_by_script)


def test_lesson_3_strides_from_a_waiting_thread_fail(helper):
    h = helper(lambda shape: tuple(torch.empty(shape, device="meta").stride()))
    with pytest.raises(AssertionError, match="nchw_strides: while the answer ran, another thread"):
        M.check_strides(h, h)


SPINNER = """
import os, torch, warnings
warnings.simplefilter("ignore")
from course.checks import memory_format as M

@torch.jit.script
def spin(box: torch.Tensor) -> int:
    while True:
        if int(box[0]) == 1:
            box[5] = torch.empty([int(box[1]), int(box[2]), int(box[3]), int(box[4])], device="meta").stride()[0]
            box[0] = 2
    return 0

@torch.jit.script
def launch(box: torch.Tensor) -> torch.jit.Future[int]:
    return torch.jit.fork(spin, box)

box = torch.zeros(8, dtype=torch.long)
future = launch(box)  # torch's inter-op pool, spinning on the box from now on

def nchw(shape):
    box[1:5] = torch.tensor(shape)
    box[0] = 1
    while int(box[0]) != 2:
        pass
    box[0] = 0
    n, c, h, w = shape
    return int(box[5]), h * w, w, 1

assert nchw((2, 3, 4, 5)) == (60, 20, 5, 1)
try:
    M.check_strides(nchw, nchw)
    print("PASSED")
except AssertionError as exc:
    print("FAILED:", exc)
os._exit(0)  # (the pool's thread never stops)
"""


def test_lesson_3_strides_from_torchs_pool_spinning_in_torchscript_fail(tmp_path):
    """The pool's thread is not Python's: no mode, profile function or threading list reaches it; the
    kernel's count of its CPU time does. (In a process of its own: that thread never stops.)"""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "spinner.py"  # (TorchScript reads the source of what it compiles)
    script.write_text(SPINNER)
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=root,
                         env={**os.environ, "PYTHONPATH": root})
    assert "FAILED: nchw_strides: while the answer ran, another thread" in out.stdout, (out.stdout, out.stderr[-2000:])
    assert "PTThreadPool" in out.stdout or "ms of CPU" in out.stdout


def test_lesson_3_a_table_of_strides_made_with_torch_beforehand_fails():
    sizes = [1, 2, 3, 4, 5, 7, 16]
    table = {s: tuple(torch.empty(s, device="meta").stride()) for s in itertools.product(sizes, repeat=4)}
    table.update({s: tuple(torch.empty(s, device="meta").stride()) for s in M.FIXED_SHAPES})
    cl = {s: tuple(torch.empty(s, device="meta", memory_format=torch.channels_last).stride()) for s in table}

    with pytest.raises(AssertionError, match=r"nchw_strides\(\(\d+, \d+, \d+, \d+\)\) should return a tuple"):
        M.check_strides(lambda shape: table.get(tuple(shape)), lambda shape: cl.get(tuple(shape)), seed=2024, cases=60)


def test_lesson_3_the_contiguity_rule_from_a_table_fails():
    from course.references.memory_format import stride_cases

    small = stride_cases(5, 200)[:206]  # the fixed cases and those of small sizes, told by torch beforehand
    table = {(tuple(s), tuple(t)): torch.empty_strided(s, t, device="meta").is_contiguous(memory_format=torch.channels_last)
             for s, t in small}
    with pytest.raises(AssertionError, match="should return True or False"):
        M.check_is_channels_last_contiguous(lambda shape, strides: table.get((tuple(shape), tuple(strides))),
                                            seed=5, cases=200)


def test_lesson_3_honest_answers_pass_beside_an_idle_thread(helper, cl_solution):
    helper(lambda *a: None)
    M.check_strides(cl_solution.nchw_strides, cl_solution.nhwc_strides, seed=3, cases=30)
    M.check_is_channels_last_contiguous(cl_solution.is_channels_last_contiguous, seed=3, cases=100)


# -- lesson 7: broadcast_shape by hand -------------------------------------------------------------

def _broadcast_by_script(a, b):
    return tuple(_scripted_broadcast(list(a), list(b)))


def test_lesson_7_broadcasting_by_torchscript_fails():
    with pytest.raises(AssertionError, match=r"broadcast_shape called [^:]*(aten::empty|aten::add)"):
        B.check_broadcast_shape(_broadcast_by_script)


def test_lesson_7_broadcasting_from_a_waiting_thread_fails(helper):
    h = helper(lambda a, b: tuple(torch.broadcast_shapes(a, b)))
    with pytest.raises(AssertionError, match="broadcast_shape: while the answer ran, another thread"):
        B.check_broadcast_shape(h)


def test_lesson_7_an_honest_rule_passes_beside_an_idle_thread(helper):
    helper(lambda *a: None)
    B.check_broadcast_shape(broadcast_rule(), seed=3, n=40)


def test_the_witnesses_cost_little():
    """A probe's price: a few milliseconds (torch's pool settling, the profiler's start)."""
    start = time.perf_counter()
    for _ in range(5):
        alone(lambda: sum(range(1000)), label="cost")
    assert (time.perf_counter() - start) / 5 < 0.5

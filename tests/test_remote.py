"""The judge/learner boundary: values cross as data (course.wire), checks run unchanged on remote
answers (course.remote), and nothing the learner's side sends can do more than be a wrong answer."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path
from typing import List, Tuple

import pytest
import torch
from torch import Tensor

from autograder import program as prog
from course import wire
from course.cells import names
from course.checks.rnn import (SERVED, check_layer_norm_cell, check_lstm_cell, check_lstm_layer,
                               check_masked_lstm_layer, check_scripted_layer, check_stacked_lstm)
from course.remote import Link, Remote, serve

ROOT = Path(__file__).resolve().parents[1]

# -- course.wire ------------------------------------------------------------------------------


def _random_value(rng: random.Random, depth: int = 0):
    kinds = ["none", "bool", "int", "float", "str", "tensor", "dtype", "lent", "kept"] + (
        ["list", "tuple", "dict"] if depth < 4 else [])
    kind = rng.choice(kinds)
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.randint(-2**62, 2**62)
    if kind == "float":
        return rng.choice([rng.uniform(-1e9, 1e9), float("nan"), float("inf"), -0.0])
    if kind == "str":
        return "".join(rng.choice("aé∂\n\"{}[]\\x") for _ in range(rng.randint(0, 12)))
    if kind == "dtype":
        return rng.choice([torch.float32, torch.int64, torch.bool])
    if kind == "lent":
        return wire.Lent(rng.randint(0, 2**31 - 1), rng.choice(["layer", "f", "lent"]))
    if kind == "kept":
        return wire.Kept(rng.randint(0, 2**31 - 1), rng.randint(0, 2**31 - 1))
    if kind == "tensor":
        dtype = rng.choice([torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8,
                            torch.bool, torch.complex64])
        shape = [rng.randint(0, 3) for _ in range(rng.randint(0, 3))]
        t = (torch.randn(shape, generator=torch.Generator().manual_seed(rng.randint(0, 99)), dtype=torch.float64) * 9)
        t = t.to(dtype)
        if dtype.is_floating_point and rng.random() < 0.3:
            t.requires_grad_(True)
        return t
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == "tuple":
        return tuple(_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4)))
    return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randint(0, 4))}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.requires_grad == b.requires_grad and torch.equal(a.detach(), b))
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("seed", range(60))
def test_wire_round_trips_every_value_it_carries(seed):
    value = _random_value(random.Random(seed))
    assert _same(value, wire.decode(wire.encode(value)))


def test_wire_describes_what_it_does_not_carry():
    import collections
    Point = collections.namedtuple("Point", "x y")
    out = wire.decode(wire.encode([len, torch.nn.Linear(2, 2), Point(1, 2), {1: 2}, 2**70, object()]))
    assert out[0] == wire.Opaque("builtins.builtin_function_or_method")
    # a module (not built by a recipe) crosses as what it is: its type's name and its state, as data
    assert isinstance(out[1], wire.ModuleState) and out[1].type_name == "torch.nn.modules.linear.Linear"
    assert sorted(out[1].state) == ["bias", "weight"] and all(type(t) is torch.Tensor for t in out[1].state.values())
    assert out[2] == (1, 2)  # named tuples travel as tuples
    assert isinstance(out[3], wire.Opaque) and isinstance(out[4], wire.Opaque) and isinstance(out[5], wire.Opaque)
    assert out[1] != torch.zeros(1).sum().item()


@pytest.mark.parametrize("seed", range(30))
def test_wire_keeps_the_exact_strides_of_dense_tensors(seed):
    """A dense tensor in any order of its dimensions (channels-last, a transpose, a permutation,
    size-1 dimensions with any stride) arrives with the same strides; any other is made contiguous."""
    rng = random.Random(seed)
    shape = [rng.choice([1, 1, 2, 3, 5]) for _ in range(rng.randint(1, 5))]
    order = rng.sample(range(len(shape)), len(shape))
    t = torch.randn([shape[d] for d in order], dtype=torch.float64).permute([order.index(d) for d in range(len(shape))])
    if t.dim() == 4 and rng.random() < 0.5:
        t = t.contiguous().to(memory_format=torch.channels_last)
    back = wire.decode(wire.encode(t))
    assert back.stride() == t.stride() and torch.equal(back, t)
    strided = t.unsqueeze(0).expand(2, *t.shape) if rng.random() < 0.5 else torch.randn(2 * t.numel())[::2]
    back = wire.decode(wire.encode(strided))
    assert back.is_contiguous() and torch.equal(back, strided)


@pytest.mark.parametrize("seed", range(40))
def test_wire_refuses_damaged_bytes_with_its_own_error(seed):
    """Whatever bytes the learner's side sends: a value or WireError, never another exception."""
    rng = random.Random(seed)
    data = bytearray(wire.encode(_random_value(rng)))
    for _ in range(rng.randint(1, 8)):
        op = rng.choice(["flip", "cut", "grow"])
        if op == "flip" and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif op == "cut" and data:
            del data[rng.randrange(len(data)):]
        else:
            data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))
    try:
        wire.decode(bytes(data))
    except wire.WireError:
        pass


@pytest.mark.parametrize("header", [
    b'{"t":["float32",[1000000000000,1000000],0,false]}',      # a shape far beyond its bytes
    b'{"t":["object",[1],8,false]}',                          # no such dtype
    b'{"m":[[1,2]]}',                                         # a non-string key
    b'[' * 5000 + b']' * 5000,                                # nesting
    b'{"s":' + b'1' * 400 + b'}',                             # an integer of 400 digits
    b'NaN', b'{"x":1}', b'{"f":"1e999"}', b'"\\ud800"',
    b'{"t":["float32",[2,2],16,false,[0,1]]}',                # strides that overlap (a broadcast)
    b'{"t":["float32",[2,2],16,false,[1,1]]}',                # two elements in one place
    b'{"t":["float32",[2,2],16,false,[4,1]]}',                # gaps: more memory than its bytes
    b'{"t":["float32",[2,2],16,false,[2]]}',                  # strides of another rank
    b'{"t":["float32",[2,2],16,false,[-1,2]]}',               # a negative stride
    b'{"c":3}', b'{"c":[3,"a b"]}', b'{"c":[-3,"f"]}',           # lent handles: bare, a name no function has, < 0
    b'{"c":[3,"' + b'f' * 61 + b'"]}',                        # a name over 60 characters
])
def test_wire_refuses_values_built_to_hurt(header):
    data = len(header).to_bytes(4, "big") + header
    with pytest.raises(wire.WireError):
        wire.decode(data)


def _jagged_bytes(values, offsets) -> bytes:
    """The bytes of a jagged tensor as the other side could write them: any values, any offsets."""
    data = wire.encode([values, offsets])
    n = int.from_bytes(data[:4], "big")
    head = b'{"j":' + data[4:4 + n] + b"}"
    return len(head).to_bytes(4, "big") + head + data[4 + n:]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_wire_carries_a_jagged_tensor_as_its_values_and_offsets():
    values, offsets = torch.randn(9, 4), torch.tensor([0, 2, 2, 9])
    nt = torch.nested.nested_tensor_from_jagged(values, offsets)
    back = wire.decode(wire.encode([nt]))[0]
    assert back.is_nested and back.layout == torch.jagged
    assert torch.equal(back.values(), values) and torch.equal(back.offsets(), offsets)
    assert wire.decode(_jagged_bytes(values, offsets)).layout == torch.jagged
    # what it does not carry: a jagged tensor with holes (its values hold what the lengths skip), a strided one
    holes = torch.nested.nested_tensor_from_jagged(values, offsets, lengths=torch.tensor([1, 0, 3]))
    strided = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)])
    assert [type(v) for v in wire.decode(wire.encode([holes, strided]))] == [wire.Opaque, wire.Opaque]


@pytest.mark.parametrize("values, offsets", [
    (torch.randn(9, 4), torch.tensor([0, 2, 20])),          # offsets past the values' end: read past them
    (torch.randn(9, 4), torch.tensor([0, 5, 3, 9])),        # decreasing
    (torch.randn(9, 4), torch.tensor([1, 9])),              # not from 0
    (torch.randn(9, 4), torch.tensor([0, 2, 8])),           # short of the end
    (torch.randn(9, 4), torch.tensor([0.0, 9.0])),          # not int64
    (torch.randn(9, 4), torch.tensor([[0, 9]])),            # not one dimension
    (torch.randn(9, 4), torch.tensor([0])),                 # no sequence
    (torch.randn(36), torch.tensor([0, 9])),                # values not (tokens, width)
    (torch.ones(9, 4, dtype=torch.int64), torch.tensor([0, 9])),
])
def test_wire_refuses_a_jagged_tensor_whose_offsets_do_not_cut_its_values(values, offsets):
    with pytest.raises(wire.WireError):
        wire.decode(_jagged_bytes(values, offsets))


def test_wire_refuses_jagged_values_built_to_cost_the_judge():
    values, offsets = torch.randn(9, 4), torch.tensor([0, 9])
    meta = _jagged_bytes(values, torch.empty(2, dtype=torch.long, device="meta"))  # offsets of no memory
    with pytest.raises(wire.WireError):
        wire.decode(meta)
    many = [torch.nested.nested_tensor_from_jagged(values, offsets)] * (wire.MAX_JAGGED + 1)
    with pytest.raises(wire.WireError, match="jagged tensors in one value"):
        wire.decode(wire.encode(many))  # each is rebuilt by torch's Python code: slow by the thousand
    assert len(wire.decode(wire.encode(many[:wire.MAX_JAGGED]))) == wire.MAX_JAGGED
    for shape in ([2**30, 2**30], [0, 2**39, 2**39]):  # storage sizes that overflow: no RuntimeError
        header = ('{"t":["float32",%s,0,false,"meta"]}' % shape).replace(" ", "").encode()
        with pytest.raises(wire.WireError):
            wire.decode(len(header).to_bytes(4, "big") + header)


# -- course.remote: checks on answers served by another process ---------------------------


def lstm_cell(x, h, c, w_ih, w_hh, b_ih, b_hh):
    return _step(x, h, c, w_ih, w_hh, b_ih, b_hh)


def _step(x_t: Tensor, h: Tensor, c: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor,
          b_hh: Tensor) -> Tuple[Tensor, Tensor]:
    i, f, g, o = (x_t @ w_ih.t() + b_ih + h @ w_hh.t() + b_hh).chunk(4, 1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def lstm_layer(x: Tensor, h: Tensor, c: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor,
               b_hh: Tensor) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
    outs: List[Tensor] = []
    for t in range(x.size(0)):
        h, c = _step(x[t], h, c, w_ih, w_hh, b_ih, b_hh)
        outs.append(h)
    return torch.stack(outs), (h, c)


def masked(x: Tensor, lengths: Tensor, h: Tensor, c: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor,
           b_hh: Tensor) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
    outs: List[Tensor] = []
    for t in range(x.size(0)):
        h2, c2 = _step(x[t], h, c, w_ih, w_hh, b_ih, b_hh)
        alive = (lengths > t).unsqueeze(1)
        h = torch.where(alive, h2, h)
        c = torch.where(alive, c2, c)
        outs.append(torch.where(alive, h2, torch.zeros_like(h2)))
    return torch.stack(outs), (h, c)


def _same_value_other_gradient(*args):
    h, c = lstm_cell(*args)
    return h + (0.01 * h - (0.01 * h).detach()), c


def _raise(exc):
    def fn(*args, **kwargs):
        raise exc
    return fn


class _Weird(Exception):
    def __str__(self):
        raise RuntimeError("no message for you")


def builtin_cell(x, h, c, w_ih, w_hh, b_ih, b_hh):
    return torch.lstm_cell(x, (h, c), w_ih, w_hh, b_ih, b_hh)


@torch.jit.script
def _builtin_layer(x: torch.Tensor, h: torch.Tensor, c: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor,
                   b_ih: torch.Tensor, b_hh: torch.Tensor):
    outs = []
    for t in range(x.size(0)):
        h, c = torch.lstm_cell(x[t], (h, c), w_ih, w_hh, b_ih, b_hh)
        outs.append(h)
    return torch.stack(outs), (h, c)


def blind_cell(x, h, c, w_ih, w_hh, b_ih, b_hh):
    with torch._C.DisableTorchFunction():  # kept from the course's watcher (a TorchFunctionMode)
        return torch.lstm_cell(x, (h, c), w_ih, w_hh, b_ih, b_hh)


LEARNER = {
    "lstm_cell": lstm_cell, "lstm_layer": lstm_layer, "scripted_layer": torch.jit.script(lstm_layer),
    "plain_layer": lstm_layer, "masked_lstm_layer": masked,
    "detached": lambda *a: tuple(t.detach() for t in lstm_cell(*a)),
    "other_gradient": _same_value_other_gradient,
    "stub": _raise(NotImplementedError()),
    "exits": _raise(SystemExit(3)), "weird": _raise(_Weird()),
    "not_a_tensor": lambda *a: (lambda: 0, "h"),
    "lying_shape": lambda *a: (torch.zeros(7, 7, dtype=torch.float64), torch.zeros(7, 7, dtype=torch.float64)),
    "data_not_code": 3.0,
    "builtin_cell": builtin_cell, "builtin_scripted": _builtin_layer, "blind_cell": blind_cell,
}


@pytest.fixture
def remote():
    """A learner's process in a thread: the judge's end of the link, and the answers served."""
    a_r, a_w = os.pipe()
    b_r, b_w = os.pipe()
    judge, learner = Link(a_w, b_r), Link(b_w, a_r)
    thread = threading.Thread(target=serve, args=(learner, dict(LEARNER)), daemon=True)
    thread.start()
    yield lambda name: Remote(judge, name)
    judge.send({"op": "end"})
    thread.join(10)
    for fd in (a_r, a_w, b_r, b_w):
        os.close(fd)


def test_served_checks_pass_right_answers_across_the_boundary(remote, capsys):
    check_lstm_cell(remote("lstm_cell"))
    check_lstm_layer(remote("lstm_layer"), seed=5, seq_len=3)
    check_scripted_layer(remote("scripted_layer"))
    check_masked_lstm_layer(remote("masked_lstm_layer"))
    assert capsys.readouterr().out.count("ok:") == 4


@pytest.mark.parametrize("name, message", [
    ("detached", "the outputs carry no gradient at all"),
    ("other_gradient", "gradient w.r.t. x does not match"),
    ("stub", "is not written yet"),
    ("exits", "raised SystemExit"),
    ("weird", "raised _Weird"),
    ("not_a_tensor", "expected a tensor"),
    ("lying_shape", "expected shape (4, 5), got (7, 7)"),
    ("data_not_code", "raised TypeError"),
    ("nowhere", "is not defined in your notebook"),
])
def test_wrong_answers_across_the_boundary_fail_with_the_cause(remote, name, message):
    with pytest.raises(AssertionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_lstm_cell(remote(name))


def test_torchscript_is_tested_as_compiled_in_the_judge(remote):
    with pytest.raises(AssertionError, match="should be what torch.jit.script returns, but it is a function"):
        check_scripted_layer(remote("plain_layer"))


def test_pytorchs_own_lstm_cell_is_seen_across_the_boundary(remote):
    """The course's watcher runs where the answer lives (a probe); a scripted answer's graph is read
    where its archive is loaded."""
    with pytest.raises(AssertionError, match="lstm_cell gives the right numbers, but it calls torch.lstm_cell"):
        check_lstm_cell(remote("builtin_cell"))
    with pytest.raises(AssertionError, match="scripted_layer's graph calls aten::lstm_cell"):
        check_scripted_layer(remote("builtin_scripted"))
    # the watcher kept from seeing: the learner's side says so, and the judge fails the cell with it
    with pytest.raises(AssertionError, match="lstm_cell: the course watches which torch functions .*switched off"):
        check_lstm_cell(remote("blind_cell"))


def test_a_desynchronised_learner_stream_is_a_failed_check_not_a_crash():
    a_r, a_w = os.pipe()
    b_r, b_w = os.pipe()
    judge = Link(a_w, b_r)
    os.write(b_w, (40).to_bytes(8, "big") + b"\x00\x00\x00\x05{\"s\":" + b"x" * 31)  # a forged, broken reply
    with pytest.raises(AssertionError, match="raised WireError"):
        check_lstm_cell(Remote(judge, "lstm_cell"))
    for fd in (a_r, a_w, b_r, b_w):
        os.close(fd)


# -- which cells the judge runs -------------------------------------------------------------


def test_lesson_1_routes_its_served_checks_and_the_trusted_set_up_to_the_judge():
    program = prog.instructor_program("01_custom_rnns", ROOT / "solutions/01_custom_rnns/01_custom_rnns.ipynb")
    assert all(c.served for c in program.graded)  # every graded cell of lesson 1 is judged outside
    assert set(SERVED) >= {"check_lstm_cell", "check_masked_lstm_layer", "check_bucketed"}
    setup = "\n".join(program.judge_setup)
    assert "from course.checks.rnn import" in setup and "S = course.sizes(" in setup
    # nothing that reads a learner's name (demos on the answers, benchmarks) runs in the judge
    for name in ("lstm_cell", "scripted_layer", "compiled_layer", "fast_lstm_layer"):
        assert not any(name in names(src)[0] for src in program.judge_setup), name


def test_a_set_up_cell_that_reads_a_learners_name_taints_what_it_binds():
    cells = [prog.Cell(0, "a", prog.INSTRUCTOR, "import torch\nN = 3\n"),
             prog.Cell(1, "b", prog.SOLUTION, "def f(x):\n    return x\n", answers=("f",)),
             prog.Cell(2, "c", prog.INSTRUCTOR, "y = f(torch.ones(N))\nM = 4\n"),
             prog.Cell(3, "d", prog.INSTRUCTOR, "unused = 1\n"),
             prog.Cell(4, "t", prog.TEST, "check_lstm_cell(f, batch=N, hidden_size=M)\n", served=True)]
    assert prog.judge_setup(cells) == ["import torch\nN = 3\n"]  # M comes from a tainted cell: the learner's


# -- speed across the boundary: course.timing.compare_served --------------------------------

from course.references.rnn import eager_lstm_layer, layer_norm_lstm_cell_reference  # noqa: E402
from course.rnn import lstm_weights, make_lstm, timing_inputs  # noqa: E402
from course.timing import compare_served  # noqa: E402
import contextlib  # noqa: E402
import time  # noqa: E402

import course.grader_hooks as grader_hooks  # noqa: E402

SIZES = dict(seq_len=4, batch=3, input_size=5, hidden_size=6)
_last = {}


def _replaying(*args):
    """Skips work: answers every call after the first with the first call's output."""
    if "out" not in _last:
        _last["out"] = eager_lstm_layer(*args)
    return _last["out"]


def _half_wrong(*args):
    out, (h, c) = eager_lstm_layer(*args)
    return out, (h, c * 1.01)


SPEED_LEARNER = {"right": lambda *a: eager_lstm_layer(*a), "replaying": _replaying, "half_wrong": _half_wrong,
                 "compiled": torch.compile(lambda *a: eager_lstm_layer(*a), backend="eager"),
                 "plain": lambda *a: eager_lstm_layer(*a)}


@pytest.fixture
def served_speed(monkeypatch):
    """A learner's process in a thread that logs when it works; the judge's hold logs too."""
    a_r, a_w = os.pipe()
    b_r, b_w = os.pipe()
    judge, learner = Link(a_w, b_r), Link(b_w, a_r)
    log = []

    def logged(fn):
        def run(*args):
            log.append(("learner", time.perf_counter()))
            return fn(*args)
        return run

    names = {k: logged(v) for k, v in SPEED_LEARNER.items()}
    names["compiled"] = SPEED_LEARNER["compiled"]
    thread = threading.Thread(target=serve, args=(learner, names), daemon=True)
    thread.start()

    @contextlib.contextmanager
    def hold():
        log.append(("hold", time.perf_counter()))
        yield
        log.append(("release", time.perf_counter()))

    monkeypatch.setattr(grader_hooks, "hold", hold)
    weights = tuple(p.detach() for p in lstm_weights(make_lstm(5, 6, seed=0)))

    def measure(name, **kw):
        return compare_served(("eager", eager_lstm_layer), ("candidate", Remote(judge, name)), factory=timing_inputs,
                              sizes=SIZES, constants=weights, rounds=kw.pop("rounds", 7), warmup=1,
                              min_run_time=0.002, **kw)
    yield measure, log, lambda name: Remote(judge, name)
    judge.send({"op": "end"})
    thread.join(10)


def test_served_timing_checks_every_call_and_never_overlaps_the_baseline(served_speed):
    measure, log, _ = served_speed
    report = measure("right")
    assert len(report.times["candidate"]) == 7 and report.speedup("candidate").median > 0
    holds = [(t0, t1) for (a, t0), (b, t1) in zip(log, log[1:]) if a == "hold" and b == "release"]
    assert len(holds) >= 8  # warm-up and every round's baseline block ran under hold()
    calls = [t for kind, t in log if kind == "learner"]
    assert calls and not any(t0 <= t <= t1 for t in calls for t0, t1 in holds)


def test_a_witness_is_timed_in_every_round_like_the_baseline_and_reported(served_speed, monkeypatch):
    """The course's own solution, timed beside the learner's (``witness``): in every round, on the
    same seeds, with the learner's process held like the baseline's, each side leading in turn;
    ``expect_speedup`` reports the candidate's bound over it with the speed record."""
    from course.grading import expect_speedup

    measure, log, _ = served_speed
    report = measure("right", witness=("course's solution", eager_lstm_layer))
    assert report.witness == "course's solution" and set(report.times) == {"eager", "candidate", report.witness}
    assert all(len(ts) == 7 for ts in report.times.values())
    holds = [(t0, t1) for (a, t0), (b, t1) in zip(log, log[1:]) if a == "hold" and b == "release"]
    assert len(holds) >= 2 * 8  # the baseline's and the witness's blocks, warm-up and rounds, all held
    calls = [t for kind, t in log if kind == "learner"]
    assert calls and not any(t0 <= t <= t1 for t in calls for t0, t1 in holds)
    seen = []
    monkeypatch.setattr(grader_hooks, "observer", lambda actual, expected, tol: seen.append(tol))
    expect_speedup(report, "candidate", over="eager", bars={"cpu": 0.01, "cuda": 0.01})
    assert seen and seen[-1]["witness"] == report.speedup("candidate", report.witness).bound
    with pytest.raises(ValueError, match="a name of its own"):
        measure("right", witness=("eager", eager_lstm_layer))


@pytest.mark.parametrize("name", ["replaying", "half_wrong"])
def test_served_timing_fails_a_candidate_that_skips_or_changes_work(served_speed, name):
    measure, _, _ = served_speed
    _last.clear()
    with pytest.raises(AssertionError, match="the output of a timed call differs from eager's"):
        measure(name, rounds=3)


def test_timed_outputs_off_by_one_shared_offset_are_seen_where_the_random_weights_are_blind():
    """The checksum's random weights for 8,192 elements add up to almost nothing (0.00008 of
    their typical size): an offset shared by every element barely moves the weighted sum. The
    plain sum sees it; honest outputs (the baseline itself) still pass."""
    from course.checks.broadcasting import distance_inputs, naive_sq_dists
    from course.remote import checksum

    w = torch.randn(8192, generator=torch.Generator().manual_seed(8192), dtype=torch.float64)
    assert abs(float(w.sum())) < 0.01 * 8192 ** 0.5  # the blind direction this test is about
    a, b = distance_inputs(0, device="cpu", n=64, m=128, d=8)
    out = naive_sq_dists(a, b)
    shifted = out + 0.01 * out.abs().mean()  # 100 times the tolerance's rtol, on every element
    before, after = checksum(out), checksum(shifted)
    assert abs(float(after[0] - before[0])) < 4e-4 * float(before[1])  # the weighted sum alone would pass it
    assert abs(float(after[2] - before[2])) > 4e-4 * float(before[3])

    sizes = dict(n=64, m=128, d=8)
    compare_served(("broadcast", naive_sq_dists), ("same", naive_sq_dists), factory=distance_inputs, sizes=sizes,
                   device="cpu", rounds=2, warmup=1, min_run_time=0.002)
    with pytest.raises(AssertionError, match="the output of a timed call differs from broadcast's"):
        compare_served(("broadcast", naive_sq_dists),
                       ("offset", lambda a, b: (lambda o: o + 0.01 * o.abs().mean())(naive_sq_dists(a, b))),
                       factory=distance_inputs, sizes=sizes, device="cpu", rounds=2, warmup=1, min_run_time=0.002)


def _outputs(seed: int) -> list:
    """Outputs of every kind a timed call returns: sizes from one element to thousands, float32 and
    float64, a channels-last batch, a transpose, a tuple of two, a complex one, offsets on both sides
    of zero."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 5000, (1,), generator=g))
    return [torch.randn(n, generator=g, dtype=torch.float64),
            torch.randn(n, generator=g) + 3.0,
            torch.randn(2, 8, 5, 3, generator=g).to(memory_format=torch.channels_last),
            torch.randn(7, n % 50 + 1, generator=g, dtype=torch.float64).t(),
            (torch.randn(3, generator=g), torch.rand(n % 97 + 1, 4, generator=g) - 0.2),
            torch.randn(n % 300 + 1, generator=g, dtype=torch.complex64)]


def _each(value, fn):
    if isinstance(value, tuple):
        return tuple(fn(v) for v in value)
    return fn(value)


def _sums_alone_differ(have, want, rtol: float) -> bool:
    """What version 51 compared: the weighted and the plain sum only (columns 0 and 2)."""
    return bool(((have - want)[:, [0, 2]].abs() > 4 * rtol * want[:, [1, 3]] + 1e-9).any())


@pytest.mark.parametrize("rtol", [1e-3, 1e-4])
def test_timed_outputs_within_rtol_always_pass_and_scaled_ones_never_do(rtol):
    """``checksums_differ`` on every kind of output, 40 fresh sets each: outputs within ``rtol`` of
    every element pass (the norm and the absolute sum move by at most ``rtol`` of themselves, the two
    sums by a few thousandths of their tolerance); outputs scaled by ``1 +- 5 * rtol`` fail in every
    call (the norm moves by 5 rtol, beyond its 4), where the weighted and plain sums alone, the check
    before grader version 52, let a share of them through (x1.01 at rtol 1e-3: half the calls)."""
    from course.remote import checksum
    from course.timing import checksums_differ

    honest, scaled, linear_missed = [], [], 0
    for seed in range(40):
        g = torch.Generator().manual_seed(1000 + seed)
        for out in _outputs(seed):
            want = checksum(out)[None]

            def jitter(t):
                u = torch.rand(t.shape, generator=g, dtype=torch.float64) * 2 - 1
                return (t * (1 + rtol * u).to(t.real.dtype if t.is_complex() else t.dtype)).to(t.dtype)
            honest.append(checksums_differ(checksum(_each(out, jitter))[None], want, rtol))
            for factor in (1 + 5 * rtol, 1 - 5 * rtol):
                have = checksum(_each(out, lambda t: t * factor))[None]
                scaled.append(checksums_differ(have, want, rtol))
                linear_missed += not _sums_alone_differ(have, want, rtol)
    assert not bool(torch.cat(honest).any())
    assert bool(torch.cat(scaled).all()), f"{int((~torch.cat(scaled)).sum())} scaled outputs passed"
    assert linear_missed > len(scaled) // 4  # what this test is about: the sums alone missed most of them


def test_a_timed_output_forged_to_the_public_weights_fails():
    """The checksum's weights are public (seeded by the output's size), and the weighted and plain
    sums are linear: for a linear function of a staged constant, both could be had from the input
    (through the constant's adjoint, computed once) and an output made to match them in two cheap
    strokes, ``a * weights + b``, without the work. The norm and the absolute sum cannot be had so:
    the forgery passes the two sums and fails the check, for every kind of output."""
    from course.remote import _check_weights, _in_memory_order, checksum
    from course.timing import checksums_differ

    for seed in range(20):
        for out in _outputs(seed)[:4]:
            flat, order = _in_memory_order(out)
            w = _check_weights(out, order).to(torch.float64)
            one = torch.ones_like(w)
            want = checksum(out)[None]
            gram = torch.tensor([[w @ w, w @ one], [one @ w, one @ one]], dtype=torch.float64)
            a, b = torch.linalg.solve(gram, want[0, [0, 2]])
            forged_flat = (a * w + b * one).to(out.dtype)
            forged = torch.empty_like(out)  # the same layout as the output
            _in_memory_order(forged)[0].copy_(forged_flat)
            have = checksum(forged)[None]
            assert not _sums_alone_differ(have, want, 1e-4)  # the sums are matched
            assert bool(checksums_differ(have, want, 1e-4).all())


@pytest.mark.parametrize("column", range(4))
def test_a_timed_output_whose_checksum_is_not_finite_fails(column):
    from course.remote import checksum
    from course.timing import checksums_differ

    want = checksum(torch.randn(100))[None]
    for bad in (float("nan"), float("inf")):
        have = want.clone()
        have[0, column] = bad
        assert bool(checksums_differ(have, want, 1e-3).all())
    assert not bool(checksums_differ(want.clone(), want, 1e-3).any())


def test_compiled_is_asked_of_the_learners_process(served_speed):
    from course.grading import expect_compiled

    _, _, remote = served_speed
    expect_compiled(remote("compiled"))
    with pytest.raises(AssertionError, match="should be what torch.compile returns, but it is a function"):
        expect_compiled(remote("plain"))


# -- references that reproduce exercises are the grader's -----------------------------------

def test_reference_data_is_what_the_grader_reference_gives():
    from course.references.__main__ import FILES, DATA

    def same(a, b):
        if isinstance(a, torch.Tensor):
            # float64 to its rounding, not bit for bit: the sums of a matrix product add in an order that
            # depends on the thread count and on the CPU's vector width (one thread and two differ in the
            # last bits; so do two CPUs), and an element near zero after cancellation differs by the
            # rounding of the terms it summed, not of itself: the tolerance scales with the tensor's own
            if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
                return False
            if not torch.equal(a.isnan(), b.isnan()):  # a query with no keys left: NaN
                return False
            if not a.is_floating_point():
                return torch.equal(a, b)
            a, b = a.nan_to_num(), b.nan_to_num()
            eps = 64 * torch.finfo(a.dtype).eps
            return torch.allclose(a, b, rtol=eps, atol=eps * float(b.abs().max()) if b.numel() else 0.0)
        if isinstance(a, dict):
            return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
        return a == b

    for name, make in FILES.items():
        stored, now = torch.load(DATA / name, weights_only=True), make()
        assert same(stored, now), f"{name} is stale: run python -m course.references"


def _right_layer_norm_cell(x, h, c, p):
    return layer_norm_lstm_cell_reference(x, (h, c), p)


def test_without_the_grader_references_the_visible_check_uses_data(learners_copy, capsys):
    import course.checks.rnn as C

    C.check_layer_norm_cell(_right_layer_norm_cell)
    assert "ok: layer_norm_lstm_cell equals the reference" in capsys.readouterr().out

    def no_cell_norm(x, h, c, p):
        p = dict(p, ln_c_weight=torch.ones_like(p["ln_c_weight"]))
        return _right_layer_norm_cell(x, h, c, p)

    with pytest.raises(AssertionError, match="does not match the reference"):
        C.check_layer_norm_cell(no_cell_norm)
    with pytest.raises(AssertionError, match="reference data for .* only"):
        C.check_layer_norm_cell(_right_layer_norm_cell, seed=3)


def _serve(layer, x, lengths, *rest, bucket=16, pad=True):
    T = x.shape[0]
    steps = -(-T // bucket) * bucket if pad else T
    out, state = layer(torch.cat([x, x.new_zeros(steps - T, *x.shape[1:])]), lengths, *rest)
    return out[:T], state


def test_the_bucket_check_across_the_boundary(capsys):
    """The compiled, counted layer stays in the judge and is lent to the learner's function (each call
    crosses back); the answers come back and are checked against the judge's own layer on the unpadded
    batches, and the judge counts the layer's calls and graphs itself."""
    from served_helpers import served

    import course.checks.rnn as C

    for learner in served({"serve_bucketed": _serve, "unpadded": lambda *a, **k: _serve(*a, **k, pad=False),
                           "shifted": lambda *a, **k: tuple(t + 1e-3 for t in _serve(*a, **k))}):
        C.check_bucketed(learner("serve_bucketed"), bucket=8, lengths=(3, 5, 8, 12))
        assert "2 graph(s) compiled" in capsys.readouterr().out
        with pytest.raises(AssertionError, match="gave the layer the batch as it came"):
            C.check_bucketed(learner("unpadded"), bucket=8, lengths=(3, 5, 8, 12))
        with pytest.raises(AssertionError, match="vs the layer on the unpadded batch"):
            C.check_bucketed(learner("shifted"), bucket=8, lengths=(3, 5, 8, 12))
        with pytest.raises(AssertionError, match="is not defined in your notebook .name 'nope'"):
            C.check_bucketed(learner("nope"))


def test_a_lent_function_runs_in_the_judge_for_the_length_of_one_call():
    """What the learner's code calls is a stand-in: the lent function runs where it was lent, on the
    tensors the learner sent, and its value or its error comes back; kept and called in a later call,
    the stand-in refuses, and a forged handle reaches nothing. The channel stays in step throughout."""
    from served_helpers import served

    from course.remote import lend

    kept = []

    def twice(f, x):
        return f(x) + f(x, scale=2.0)

    def keep(f, x):
        kept.append(f)
        return kept[0](x) if len(kept) > 1 else f(x)

    def forge(f, x):
        return type(f)(f._link, wire.Lent(f._handle + 1000, "layer"), f._seq, "cpu")(x)

    def unhashable(f, x):  # a call message written by hand, its handle a list
        f._link.send({"back": [f._handle], "seq": f._seq, "args": [x], "kwargs": {}})
        raise RuntimeError(f._link.receive().get("message"))

    seen = []

    def scaled(x, scale=1.0):
        seen.append(x.clone())
        if x.numel() > 3:
            raise ValueError("too long")
        return x * scale

    for learner in served({"twice": twice, "keep": keep, "forge": forge, "unhashable": unhashable,
                           "named": lambda f: f.__name__}):
        x = torch.arange(3.0)
        assert learner("named")(lend(scaled)) == "scaled"  # the stand-in goes by the lent function's name
        assert learner("named")(lend(lambda x: x)) == "lent"  # "<lambda>" names no function: a plain word instead
        assert torch.equal(learner("twice")(lend(scaled), x), 3 * x)
        assert len(seen) == 2 and all(torch.equal(s, x) for s in seen)  # the judge saw each call itself
        with pytest.raises(ValueError, match="too long"):  # the lent function's error, through the learner's code
            learner("twice")(lend(scaled), torch.ones(5))
        assert torch.equal(learner("keep")(lend(scaled), x), x)
        with pytest.raises(RuntimeError, match="lent by the grader for one call of yours, which has returned"):
            learner("keep")(lend(scaled), x)
        with pytest.raises(RuntimeError, match="did not lend it for this call"):
            learner("forge")(lend(scaled), x)
        with pytest.raises(RuntimeError, match="did not lend it for this call"):
            learner("unhashable")(lend(scaled), x)
        assert torch.equal(learner("twice")(lend(scaled), x), 3 * x)  # still in step
    assert torch.equal(lend(scaled)(x, scale=3.0), 3 * x)  # here, it is the function


_KEPT_BY_PROBE: list = []


def _lending_probe(answer, f, x, keep=False):
    """A probe (the course's code in the learner's process) that calls a lent function: once through
    the learner's answer, once itself; ``keep`` keeps the stand-in, to be called by a later probe."""
    if keep:
        _KEPT_BY_PROBE.append(f)
    if _KEPT_BY_PROBE and not keep:
        return _KEPT_BY_PROBE[0](x)
    return answer(f, x) + f(x)


def test_a_probe_may_lend_a_function_as_a_call_does():
    """A lent function in a probe's arguments stays in the judge too (lesson 2's planted node): its
    calls from the probe and from the learner's code inside it run there, and the stand-in refuses
    once that probe has returned."""
    from served_helpers import served

    from course.remote import lend, probe, prober

    prober(_lending_probe)
    seen = []

    def doubled(x):
        seen.append(x.clone())
        return 2 * x

    _KEPT_BY_PROBE.clear()
    for learner in served({"apply": lambda f, x: f(x)}):
        x = torch.arange(3.0)
        assert torch.equal(probe(learner("apply"), _lending_probe, lend(doubled), x), 4 * x)
        assert len(seen) == 2  # both calls ran here
        assert torch.equal(probe(learner("apply"), _lending_probe, lend(doubled), x, keep=True), 4 * x)
        with pytest.raises(RuntimeError, match="lent by the grader for one call of yours, which has returned"):
            probe(learner("apply"), _lending_probe, lend(doubled), x)
        _KEPT_BY_PROBE.clear()
        assert torch.equal(probe(learner("apply"), _lending_probe, lend(doubled), x), 4 * x)  # still in step
    assert torch.equal(probe(lambda f, x: f(x), _lending_probe, lend(doubled), x), 4 * x)  # here, the function


def test_a_staged_value_is_sent_once_and_kept_by_the_learners_side_for_its_calls():
    """What the judge stages (a model's state for a clock) crosses once; a call names it by two numbers
    and the learner's side puts its own copy, the same object every call, in their place. A handle or
    an index nothing was staged under is the call's error, a kept value outside a call's arguments is
    refused, and the channel stays in step. A forged Kept in a reply is a plain value to the judge."""
    from served_helpers import served

    from course.remote import probe, prober

    prober(_lending_probe)
    seen = []

    def total(state, x):
        seen.append(state)
        return state["w"].sum() + x

    for learner in served({"total": total, "forged": lambda: wire.Kept(0, 0)}):
        state = {"w": torch.arange(4.0)}
        handle = learner("total").stage([state])
        for x in (1.0, 2.0):
            assert learner("total")(wire.Kept(handle, 0), torch.tensor(x)).item() == 6.0 + x
        assert len(seen) == 2 and seen[0] is seen[1] and torch.equal(seen[0]["w"], state["w"])
        for wrong in (wire.Kept(handle, 1), wire.Kept(handle + 5, 0)):
            with pytest.raises(ValueError, match="nothing staged as item"):
                learner("total")(wrong, torch.tensor(1.0))
        with pytest.raises(ValueError, match="a kept value outside the arguments of a call"):
            probe(learner("total"), _lending_probe, wire.Kept(handle, 0), torch.tensor(1.0))
        assert learner("forged")() == wire.Kept(0, 0)  # data: it resolves nothing on the judge's side
        assert learner("total")(wire.Kept(handle, 0), torch.tensor(3.0)).item() == 9.0  # still in step


def test_a_clock_sends_the_state_once_and_refuses_state_that_changes(monkeypatch):
    """clock_against_loop's ``kept``: the learner's function sees the state staged once (the same
    object on every timed call, only the fresh inputs crossing each time); a ``make`` whose kept
    arguments are new objects on every call is a mistake of the check's, said as such."""
    from served_helpers import served

    from course.checks.common import clock_against_loop

    seen = []

    def scaled(state, x):
        seen.append(state)
        return state["w"] * x

    state = {"w": torch.arange(3.0)}
    loop = lambda state, x: state["w"] * x  # noqa: E731
    for learner in served({"scaled": scaled}):
        clock_against_loop(learner("scaled"), "scaled", lambda s: (state, torch.tensor(float(s % 7))), loop,
                           kept=1, attempts=2)
        assert len(seen) >= 6 and all(s is seen[0] for s in seen)
        with pytest.raises(ValueError, match="change from call to call"):
            clock_against_loop(learner("scaled"), "scaled", lambda s: (dict(state), torch.tensor(1.0)), loop,
                               kept=1, attempts=2)


def test_a_result_too_large_to_cross_is_the_learners_error_and_the_channel_goes_on(monkeypatch):
    from served_helpers import served

    monkeypatch.setattr(wire, "MAX_BYTES", 2**20)
    for learner in served({"big": lambda: torch.zeros(2**19), "small": lambda: torch.ones(3)}):
        with pytest.raises(RuntimeError, match="could not be sent: a value of 2 MB, over the 1 MB"):
            learner("big")()
        assert torch.equal(learner("small")(), torch.ones(3))  # still in step


def test_a_frame_over_the_limit_breaks_the_channel_for_good_not_the_judge():
    from course.remote import RemoteError
    import struct

    a_r, a_w = os.pipe()
    b_r, b_w = os.pipe()
    judge = Link(a_w, b_r)
    os.write(b_w, struct.pack(">Q", 2**60))  # a forged header: 1 EiB to follow
    try:
        with pytest.raises(RemoteError, match="over the 256 MB limit; nothing it sends is heard any more"):
            judge.request({"op": "call", "name": "f", "args": [], "kwargs": {}})
        with pytest.raises(RemoteError, match="nothing it sends is heard"):  # at once, without reading
            judge.request({"op": "call", "name": "f", "args": [], "kwargs": {}})
    finally:
        for fd in (a_r, a_w, b_r, b_w):
            os.close(fd)


def test_a_call_under_pinned_calls_runs_with_the_threads_the_judge_asks():
    """The judge's clocks charge a learner's CPU time over one thread (``clock_against_loop``): within
    ``pinned_calls(1)`` every call across the boundary runs the learner's function with one intra-op
    thread (a block request already carries the count), and outside it the learner keeps its own."""
    from course.remote import pinned_calls, serve_in_thread

    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with serve_in_thread({"count": lambda: torch.get_num_threads()}) as judge:
            count = Remote(judge, "count")
            assert count() == 3
            with pinned_calls(1):
                assert count() == 1
                with pinned_calls(2):  # nested: the inner setting, then the outer one back
                    assert count() == 2
                assert count() == 1
                other: list = []  # another thread of the judge's is not pinned by this block
                worker = threading.Thread(target=lambda: other.append(count()))
                worker.start()
                worker.join()
                assert other == [3]
            assert count() == 3 and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


# -- where a probe runs ---------------------------------------------------------------------------

from course.remote import probe, prober, serve_in_thread, serving_host  # noqa: E402


@prober
def where_served(answer) -> bool:
    """A probe that says whether it runs inside the program host's serving loop."""
    return serving_host()


def test_only_the_program_hosts_serving_loop_says_it_is_the_program_host():
    """``serving_host()`` is True where :func:`serve` answers as the program host, and only there: not in
    the judge, not in a learner's process served from a thread of the same test process, and not after
    the host's loop ended (lesson 10's workers trust a program's ``course_program`` only there)."""
    assert serving_host() is False
    with serve_in_thread({"f": len}) as learner:
        assert probe(Remote(learner, "f"), where_served) is False
    with serve_in_thread({"f": len}, host=True) as host:
        assert probe(Remote(host, "f"), where_served) is True
        with serve_in_thread({"f": len}) as learner:  # a learner's side beside a live host
            assert probe(Remote(learner, "f"), where_served) is False
        assert serving_host() is False

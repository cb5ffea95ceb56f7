"""course.traces, the course's own trace diff, against Holistic Trace Analysis (HTA, PyPI
``traceinsight``): on real torch.profiler traces of pairs of functions and on small hand-made traces
that pin down what HTA counts (which events are CPU, which iteration an event is in, its rounding
of nanosecond timestamps). Planted bugs in course.traces (patched in) must make these checks fail."""

from __future__ import annotations

import gzip
import json
import logging
import math
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from hta.trace_diff import DeviceType, TraceDiff

from course import traces
from course.references import traces as reading  # HTA's reading: the grader's alone

# HTA's pandas calls (inplace=True, ...) warn of pandas deprecations: HTA's concern, not the course's.
pytestmark = pytest.mark.filterwarnings("ignore::Warning:hta")


@pytest.fixture(autouse=True, scope="module")
def _quiet_hta():
    """HTA logs several warnings per trace it reads (no rank in the file, rounding, timings)."""
    logger = logging.getLogger("hta")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


# ------------------------------------------------------------------------------------------ HTA side

def _hta_dir(root, trace: dict, *, gz: bool = False) -> str:
    """A folder holding ``trace`` as HTA's TraceDiff wants it: one trace file per rank, ``.json`` or
    ``.gz``. A CPU trace has no ``distributedInfo``: HTA then takes the file as rank 0."""
    folder = tempfile.mkdtemp(dir=root)
    name = "rank0.pt.trace.json.gz" if gz else "rank0.pt.trace.json"
    with (gzip.open if gz else open)(os.path.join(folder, name), "wt") as f:
        json.dump(trace, f)
    return folder


def _hta_rows(root, control: dict, test: dict, *, gz: bool = False, **iterations) -> dict[str, tuple]:
    df = TraceDiff.compare_traces(_hta_dir(root, control, gz=gz), _hta_dir(root, test, gz=gz),
                                  device_type=DeviceType.CPU, **iterations)
    return {name: (int(r["Control_counts"]), int(r["Test_counts"]), int(r["diff_counts"]),
                   r["counts_change_categories"], float(r["Control_total_duration"]),
                   float(r["Test_total_duration"]), float(r["diff_duration"]))
            for name, r in df.iterrows()}


def _hta_ops_diff(root, control: dict, test: dict, **iterations) -> dict[str, set]:
    diff = TraceDiff.ops_diff(_hta_dir(root, control), _hta_dir(root, test), device_type=DeviceType.CPU, **iterations)
    return {k: set(v) for k, v in diff.items()}


def _our_rows(control, test, **iterations) -> dict[str, tuple]:
    rows = reading.compare_traces(control, test, **iterations)
    assert [r["name"] for r in rows] == sorted(r["name"] for r in rows)
    return {r["name"]: (r["control_counts"], r["test_counts"], r["diff_counts"], r["change"],
                        r["control_duration"], r["test_duration"], r["diff_duration"]) for r in rows}


def _mismatches(ours: dict, theirs: dict) -> list[str]:
    """What differs: names, counts and change exactly, durations to 1e-6 relative."""
    out = [f"only ours: {sorted(set(ours) - set(theirs))}"] if set(ours) - set(theirs) else []
    out += [f"only HTA's: {sorted(set(theirs) - set(ours))}"] if set(theirs) - set(ours) else []
    for name in sorted(set(ours) & set(theirs)):
        a, b = ours[name], theirs[name]
        if a[:4] != b[:4] or not all(math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9) for x, y in zip(a[4:], b[4:])):
            out.append(f"{name}: ours {a}, HTA's {b}")
    return out


def _agrees_with_hta(root, control: dict, test: dict, **iterations) -> list[str]:
    problems = _mismatches(_our_rows(control, test, **iterations), _hta_rows(root, control, test, **iterations))
    ours = {k: set(v) for k, v in reading.ops_diff(control, test, **iterations).items()}
    theirs = _hta_ops_diff(root, control, test, **iterations)
    if ours != theirs:
        problems.append(f"ops_diff: ours {ours}, HTA's {theirs}")
    return problems


# ---------------------------------------------------------------------------------------- real traces

def _naive_attention(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """Traces of small functions, made once: ``{name: trace}``."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 32) for _ in range(3))
    x, w = torch.randn(128, 128), torch.randn(128, 128)

    def add3():
        y = x
        for _ in range(3):
            y = y + 1
        return y

    def twice_clone():  # two calls of the timed function per profiler step
        for _ in range(2):
            (x * 2).clone()

    def twice_plain():
        for _ in range(2):
            x * 2

    functions = {
        "naive": lambda: _naive_attention(q, k, v),
        "naive_again": lambda: _naive_attention(q, k, v),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
        "plain": lambda: x * 2,
        "clone": lambda: (x * 2).clone(),
        "transposed": lambda: x.t() @ w,
        "contiguous": lambda: x.t().contiguous() @ w,
        "f32": lambda: x @ w,
        "bf16": lambda: x.bfloat16() @ w.bfloat16(),
        "add3": add3,
        "add1": lambda: x + 1,
        "twice_plain": twice_plain,
        "twice_clone": twice_clone,
    }
    made = {name: traces.profile_steps(fn) for name, fn in functions.items()}
    made["shapes"] = traces.profile_steps(functions["naive"], record_shapes=True)
    made["gz"] = traces.profile_steps(functions["clone"], path=tmp_path_factory.mktemp("gz") / "clone.json.gz")
    return made


PAIRS = [("naive", "sdpa"), ("sdpa", "naive"), ("plain", "clone"), ("transposed", "contiguous"), ("f32", "bf16"),
         ("add3", "add1"), ("add1", "add3"), ("naive", "naive_again"), ("naive", "shapes"), ("plain", "gz")]


@pytest.mark.parametrize("control,test", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_compare_and_ops_diff_agree_with_hta(real, tmp_path, control, test):
    assert _agrees_with_hta(tmp_path, real[control], real[test]) == []


@pytest.mark.parametrize("iterations", [dict(control_iteration=2, test_iteration=3),
                                        dict(control_iteration=3, test_iteration=1),
                                        dict(control_iteration=[1, 2], test_iteration=[3])],
                         ids=["2-3", "3-1", "12-3"])
def test_chosen_iterations_agree_with_hta(real, tmp_path, iterations):
    assert _agrees_with_hta(tmp_path, real["naive"], real["clone"], **iterations) == []


def test_same_trace_different_iterations_agree_with_hta(real, tmp_path):
    problems = _agrees_with_hta(tmp_path, real["naive"], real["naive"], control_iteration=1, test_iteration=3)
    assert problems == []
    diff = reading.ops_diff(real["naive"], real["naive"], control_iteration=1, test_iteration=3)
    assert diff["added"] == ["ProfilerStep#3"] and diff["deleted"] == ["ProfilerStep#1"]
    assert "aten::bmm" in diff["unchanged"]


def test_gz_trace_file_agrees_with_hta(real, tmp_path):
    theirs = _hta_rows(tmp_path, real["plain"], real["gz"], gz=True)
    assert _mismatches(_our_rows(real["plain"], real["gz"]), theirs) == []


def test_iterations_are_one_per_recorded_step(real):
    trace = real["naive"]
    assert traces.iterations(trace) == [1, 2, 3]
    tables = [reading.op_table(trace, i) for i in (1, 2, 3)]
    assert reading.op_table(trace) == tables[0]
    assert [sorted(n for n in t if n.startswith("ProfilerStep")) for t in tables] == \
        [["ProfilerStep#1"], ["ProfilerStep#2"], ["ProfilerStep#3"]]
    assert all(t["aten::bmm"][0] == 2 and t["aten::softmax"][0] == 1 for t in tables)
    both = reading.op_table(trace, [1, 2])
    assert both["aten::bmm"] == (4, pytest.approx(tables[0]["aten::bmm"][1] + tables[1]["aten::bmm"][1]))


def test_profile_steps_writes_the_trace_it_returns(tmp_path):
    x = torch.randn(32, 32)
    before = {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("course_trace_")}
    trace = traces.profile_steps(lambda: x @ x, steps=2, warmup=2)
    assert traces.iterations(trace) == [2, 3]
    assert reading.op_table(trace)["aten::mm"][0] == 1
    assert {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("course_trace_")} == before
    path = tmp_path / "mm.json"
    assert traces.profile_steps(lambda: x @ x, path=path) == json.loads(path.read_text())


# ------------------------------------------------------------------------------- hand-made traces

def _ev(name, ts, dur, cat="cpu_op", **args):
    """A complete event. Every one has ``args``, as torch's do: HTA fails on a trace with none."""
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur, "args": args}


def _steps_trace():
    """Two steps (#7, #8), float timestamps (rounded inwards by HTA), events of every kind."""
    return {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "ts": 0.5, "args": {"name": "python"}},
        _ev("PyTorch Profiler (0)", 0.0, 1000.0, cat="Trace"),        # the profiler's span: dropped
        _ev("aten::before", 5.25, 3.0),                               # before every step: no iteration
        _ev("ProfilerStep#7", 10.4, 100.2, cat="user_annotation"),    # [11, 110)
        _ev("aten::mm", 12.3, 20.5),                                  # 13 .. 32: 19 us
        _ev("aten::tiny", 30.2, 0.5),                                 # 31 .. 30: -1 us
        _ev("my_region", 40.0, 10.0, cat="user_annotation"),
        _ev("PyTorch Profiler (1)", 40.5, 2.0, cat="Trace"),          # a profiler span in a step: dropped
        _ev("torch/nn/x.py(1): f", 41.0, 3.0, cat="python_function"),
        _ev("void gemm_kernel<float>", 45.0, 5.0, cat="kernel", stream=7),   # GPU
        _ev("triton_op", 46.0, 2.0, stream=0),                        # stream 0: not CPU either
        _ev("aten::string_stream", 47.0, 2.0, stream="7"),            # a stream, as text
        _ev("aten::odd_stream", 47.0, 2.0, stream="abc"),             # not a number: CPU
        _ev("aten::null_stream", 47.0, 2.0, stream=None),             # null: CPU
        _ev("aten::negative_stream", 47.0, 2.0, stream=-3),           # CPU is stream -1 exactly
        {"ph": "i", "name": "[memory]", "pid": 1, "tid": 1, "ts": 50.0, "s": "t", "args": {}},
        {"ph": "X", "name": "no_category", "pid": 1, "tid": 1, "ts": 50.0, "dur": 1.0},
        {"ph": "X", "cat": "cpu_op", "name": "no_duration", "pid": 1, "tid": 1, "ts": 50.0},
        {"ph": "X", "cat": "cpu_op", "name": "no_timestamp", "pid": 1, "tid": 1, "dur": 3.0, "args": {}},
        _ev("aten::straddle", 105.0, 20.0),                           # starts in #7, ends in #8
        _ev("aten::at_end", 110.0, 1.0),                              # at #7's end, before #8's start
        _ev("ProfilerStep#8", 110.6, 50.0, cat="user_annotation"),    # [111, 160)
        _ev("aten::mm", 120.0, 4.0),
        _ev("aten::after", 500.0, 4.0),                               # after every step
    ]}


STEP7 = {"ProfilerStep#7": (1, 99.0), "aten::mm": (1, 19.0), "aten::tiny": (1, -1.0), "my_region": (1, 10.0),
         "torch/nn/x.py(1): f": (1, 3.0), "aten::odd_stream": (1, 2.0), "aten::null_stream": (1, 2.0),
         "aten::straddle": (1, 20.0)}
STEP8 = {"ProfilerStep#8": (1, 49.0), "aten::mm": (1, 4.0)}


def test_hand_made_trace_counts_what_hta_counts(tmp_path):
    trace = _steps_trace()
    assert traces.iterations(trace) == [7, 8]
    assert reading.op_table(trace) == STEP7 == reading.op_table(trace, 7)
    assert reading.op_table(trace, 8) == STEP8
    other = _steps_trace()
    for iterations in (dict(), dict(control_iteration=7, test_iteration=8), dict(control_iteration=[7, 8])):
        assert _agrees_with_hta(tmp_path, trace, other, **iterations) == []


def test_integer_timestamps_are_not_rounded(tmp_path):
    """Integer ``ts`` (older traces, other tools): HTA keeps durations as they are, fractions too;
    a step that ends where the next starts hands its boundary event to the next one."""
    trace = {"traceEvents": [
        _ev("ProfilerStep#1", 10, 100, cat="user_annotation"), _ev("a", 20, 1.5), _ev("a", 30, 0.25),
        _ev("b", 109, 3), _ev("c", 110, 1), _ev("ProfilerStep#2", 110, 50, cat="user_annotation")]}
    assert reading.op_table(trace) == {"ProfilerStep#1": (1, 100.0), "a": (2, 1.75), "b": (1, 3.0)}
    assert reading.op_table(trace, 2) == {"ProfilerStep#2": (1, 50.0), "c": (1, 1.0)}
    assert _agrees_with_hta(tmp_path, trace, trace, control_iteration=1, test_iteration=2) == []
    # One event without a timestamp makes pandas read them all as floats: HTA rounds again.
    trace["traceEvents"].append({"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "x"}})
    assert reading.op_table(trace) == {"ProfilerStep#1": (1, 100.0), "a": (2, 1.0), "b": (1, 3.0)}
    assert _agrees_with_hta(tmp_path, trace, trace) == []


def test_overlapping_steps_last_in_file_order_wins(tmp_path):
    trace = {"traceEvents": [
        _ev("ProfilerStep#2", 100.5, 100.0, cat="user_annotation"),
        _ev("ProfilerStep#1", 0.5, 150.0, cat="user_annotation"),
        _ev("x", 120.2, 1.0), _ev("y", 50.2, 1.0)]}
    # #1 is [1, 150), #2 is [101, 200): #2's own start, and x's, are in both, and #1 comes later.
    assert reading.op_table(trace, 1) == {"ProfilerStep#1": (1, 149.0), "ProfilerStep#2": (1, 99.0), "x": (1, 0.0),
                                         "y": (1, 0.0)}
    assert reading.op_table(trace, 2) == {}
    assert _agrees_with_hta(tmp_path, trace, trace, control_iteration=1, test_iteration=1) == []


def test_gz_file_is_read_like_json(tmp_path):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_steps_trace(), f)
    assert traces.load_trace(path) == _steps_trace()
    assert reading.op_table(str(path)) == STEP7
    theirs = _hta_rows(tmp_path, _steps_trace(), _steps_trace(), gz=True)
    assert _mismatches(_our_rows(path, _steps_trace()), theirs) == []


def _every_iteration(present, iteration, what="this trace"):
    return set(present)


def _with_gpu(event):
    return -1


def _only_cpu_ops(original):
    return lambda trace, *a: [e for e in original(trace, *a) if e[1] == "cpu_op" or e[0].startswith("ProfilerStep")]


def _keep_trace_spans(original):
    def events(trace, *a):
        spans = [(e["name"], e["cat"], math.ceil(e["ts"]), math.floor(e["ts"] + e["dur"]) - math.ceil(e["ts"]), -1)
                 for e in trace["traceEvents"] if e.get("cat") == "Trace"]
        return spans + original(trace, *a)
    return events


def _by_end_too(ts, steps):
    found = -1
    for start, dur, n in steps:
        if start <= ts <= start + dur:
            found = n
    return found


PLANTED = {
    "counts every iteration": ("_chosen", lambda original: _every_iteration),
    "counts GPU and stream-0 events": ("_stream", lambda original: _with_gpu),
    "counts only cpu_op events (and the steps)": ("_events", _only_cpu_ops),
    "keeps the profiler's Trace span": ("_events", _keep_trace_spans),
    "does not round ns timestamps": ("_ts_are_floats", lambda original: lambda events: False),
    "a step's end is in the step": ("_iteration_of", lambda original: _by_end_too),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_planted_bugs_are_caught(monkeypatch, tmp_path, bug):
    name, make = PLANTED[bug]
    monkeypatch.setattr(reading, name, make(getattr(reading, name)))
    trace = _steps_trace()
    assert reading.op_table(trace) != STEP7 or reading.op_table(trace, 8) != STEP8
    assert _agrees_with_hta(tmp_path, trace, trace, control_iteration=7, test_iteration=8) != []


# -------------------------------------------------------------------------------------- explaining

def _counted(sentences):
    """The sentences that rest on counts (time-based ones may come and go with timing noise)."""
    return [s for s in sentences if " extra " in s or s.startswith("no ")]


def test_explain_naive_attention_against_sdpa(real):
    said = traces.explain_diff(real["naive"], real["sdpa"], top=10)
    assert any(s.startswith("1 extra aten::_scaled_dot_product_flash_attention_for_cpu per call") for s in said), said
    assert "no aten::bmm ran (the reference runs it twice per call)" in said, said
    said = traces.explain_diff(real["sdpa"], real["naive"], top=10)
    assert ("no aten::_scaled_dot_product_flash_attention_for_cpu ran (the reference runs it once per call)"
            in said), said
    assert any(s.startswith("2 extra aten::bmm per call (") for s in said), said


def test_explain_extra_clone_per_call(real):
    said = _counted(traces.explain_diff(real["plain"], real["clone"]))
    assert any(s.startswith("1 extra aten::clone per call (") for s in said), said
    assert any(s.startswith("1 extra aten::copy_ per call (") for s in said), said
    assert not any("empty" in s or "ProfilerStep" in s for s in said), said
    said = _counted(traces.explain_diff(real["twice_plain"], real["twice_clone"], calls=2))
    assert any(s.startswith("1 extra aten::clone per call (") for s in said), said
    assert any(s.startswith("1 extra aten::copy_ per call (") for s in said), said
    said = traces.explain_diff(real["twice_clone"], real["twice_plain"], calls=2)
    assert "no aten::clone ran (the reference runs it once per call)" in said, said
    assert len(traces.explain_diff(real["plain"], real["clone"], top=1)) == 1


def test_explain_extra_adds(real):
    said = _counted(traces.explain_diff(real["add1"], real["add3"]))
    assert any(s.startswith("2 extra aten::add per call (3 instead of 1") for s in said), said
    assert _counted(traces.explain_diff(real["add3"], real["add1"])) == []  # fewer ops is not a reason


def test_explain_nothing_notable_for_the_same_function(real):
    assert _counted(traces.explain_diff(real["naive"], real["naive_again"])) == []
    assert _counted(traces.explain_diff(real["plain"], real["plain"])) == []
    assert traces.explain_diff(real["plain"], real["plain"]) == []


def _timed(mm_us, copies=1, step="ProfilerStep#1"):
    events = [_ev(step, 0, 1000, cat="user_annotation"), _ev("aten::mm", 10, mm_us), _ev("aten::relu", 900, 50)]
    events += [_ev("aten::copy_", 800 + i, 1) for i in range(copies)]
    return {"traceEvents": events}


def test_explain_slower_op_only_when_much_slower_and_worth_it():
    assert traces.explain_diff(_timed(100), _timed(400)) == ["aten::mm took 4.0x as long (100 us -> 400 us per call)"]
    assert traces.explain_diff(_timed(200), _timed(280)) == []      # 8% of the step, but under 1.5x
    assert traces.explain_diff(_timed(10), _timed(40)) == []        # 4x, but 3% of the step
    assert traces.explain_diff(_timed(100, step="ProfilerStep#1"), _timed(100, step="ProfilerStep#9")) == []
    assert traces.explain_diff(_timed(100), _timed(100, copies=4), calls=3) == \
        ["1 extra aten::copy_ per call (1.33 instead of 0.333, +1 us)"]
    assert traces.explain_diff(_timed(100), _timed(400, copies=3), top=1) == \
        ["aten::mm took 4.0x as long (100 us -> 400 us per call)"]
    with pytest.raises(ValueError, match="calls"):
        traces.explain_diff(_timed(100), _timed(100), calls=0)


def test_explain_always_names_the_heaviest_op_the_test_never_ran():
    """A fused kernel the reference runs, quick on this CPU, outweighed by the five small ops that
    replace it: its absence still gets a line (it is the explanation), in place of the lightest."""
    control = {"ProfilerStep#1": [1, 1000.0, ["cpu_op"]], "aten::fused": [1, 5.0, ["cpu_op"]]}
    test = {"ProfilerStep#1": [1, 1000.0, ["cpu_op"]],
            **{f"aten::small{i}": [1, 100.0 - i, ["cpu_op"]] for i in range(6)}}
    lines = traces.explain_rows(control, test, top=5)
    assert len(lines) == 5 and lines[-1].startswith("no aten::fused ran"), lines
    assert [line.split()[2] for line in lines[:4]] == [f"aten::small{i}" for i in range(4)], lines
    assert traces.explain_rows(control, test, top=0) == []
    # a composite op and the kernel it dispatches to, both missing: both named
    control["aten::fused_kernel"] = [1, 4.0, ["cpu_op"]]
    lines = traces.explain_rows(control, test, top=5)
    assert [line.split()[1] for line in lines[-2:]] == ["aten::fused", "aten::fused_kernel"], lines
    assert [line.split()[2] for line in lines[:3]] == [f"aten::small{i}" for i in range(3)], lines


# ------------------------------------------------------------------------------------------ errors

def test_load_trace_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"expected a trace file at .*nowhere\.json.*export_chrome_trace"):
        traces.load_trace(tmp_path / "nowhere.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [')
    with pytest.raises(ValueError, match="not valid JSON"):
        traces.load_trace(bad)
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(gzip.compress(b'{"traceEvents": []}')[:12])
    with pytest.raises(ValueError, match="cut short"):
        traces.load_trace(cut)
    snapshot = tmp_path / "snapshot.json"
    snapshot.write_text('{"segments": [], "device_traces": []}')
    with pytest.raises(ValueError, match=r"'traceEvents' list.*got keys \['device_traces', 'segments'\]"):
        traces.load_trace(snapshot)
    with pytest.raises(ValueError, match="traceEvents"):
        traces.load_trace({"events": []})
    with pytest.raises(TypeError, match="got int"):
        traces.load_trace(3)
    trace = {"traceEvents": []}
    assert traces.load_trace(trace) is trace
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "host_1.pt.trace.json").write_text(json.dumps(trace))
    assert traces.load_trace(folder) == trace  # what tensorboard_trace_handler leaves
    (folder / "host_2.pt.trace.json").write_text(json.dumps(trace))
    with pytest.raises(ValueError, match=r"exactly one .*holds 2: host_1.pt.trace.json, host_2.pt.trace.json"):
        traces.load_trace(folder)


def test_op_table_errors(real):
    no_steps = {"traceEvents": [_ev("aten::mm", 1.5, 2.0)]}
    with pytest.raises(ValueError, match=r"no ProfilerStep#N events.*schedule.*prof\.step\(\)"):
        reading.op_table(no_steps)
    with pytest.raises(ValueError, match=r"the control trace has no ProfilerStep"):
        reading.compare_traces(no_steps, real["plain"])
    with pytest.raises(ValueError, match=r"iteration 5 is not in this trace: it has iterations \[1, 2, 3\]"):
        reading.op_table(real["plain"], 5)
    with pytest.raises(ValueError, match=r"iteration 0 is not in the test trace"):
        reading.compare_traces(real["plain"], real["plain"], test_iteration=0)
    assert traces.iterations(no_steps) == []


def test_the_profilers_own_log_lines_stay_out_of_a_lessons_output():
    """Kineto prints "USDT: ... profiler_start" on stderr for every profile; importing the course
    keeps that out (and a level the learner set is theirs)."""
    import subprocess
    import sys
    from pathlib import Path

    probe = ("import torch, course\nfrom torch.profiler import profile\n"
             "with profile() as p:\n    torch.ones(3) + 1\nprint(len(p.key_averages()) > 0)\n")
    root = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"} | {"PYTHONPATH": root}
    quiet = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert quiet.stdout.strip() == "True", quiet
    assert "profiler_start" not in quiet.stderr and "USDT" not in quiet.stderr, quiet.stderr
    loud = subprocess.run([sys.executable, "-c", probe.replace("course\n", "course, os\nos.environ['KINETO_LOG_LEVEL'] = '5'\n")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert "profiler_start" in loud.stderr, loud.stderr  # the test's premise: without it, they are printed

import pytest
import torch

from course.grading import (expect_compiled, expect_ops_absent, expect_scripted, expect_speedup, graph_ops,
                            is_compiled, is_scripted, speed_bar)
from course.timing import SpeedReport, compare


def work(n):
    a = torch.randn(n, n)
    return lambda: a @ a


def test_compare_ranks_more_work_as_slower_and_reports_ratios():
    rep = compare({"big": work(256), "small": work(32)}, rounds=5, warmup=2, min_run_time=0.05, progress=False)
    assert rep.speedup("small").median > 2.0  # 512x fewer flops: a ratio, never an absolute time
    assert rep.speedup("big").median == 1.0
    table = rep.table()
    assert "big" in table and "small" in table and "speedup over big" in table
    assert "small" in repr(rep)


def test_compare_calls_the_check_on_every_candidate_every_round_with_fresh_inputs():
    seen, made = [], []

    def inputs():
        made.append(torch.randn(4))
        return (made[-1],)

    compare({"a": lambda x: x * 2, "b": lambda x: x + x}, inputs=inputs,
            check=lambda name, out, args: seen.append((name, torch.equal(out, args[0] * 2))),
            rounds=3, warmup=1, min_run_time=0.001, progress=False)
    assert len(made) == 4 and len(seen) == 2 * 4 and all(ok for _, ok in seen)


def test_compare_refuses_bad_input_with_a_clear_message():
    with pytest.raises(TypeError, match="not something to call"):
        compare({"a": 3})
    with pytest.raises(KeyError, match="baseline"):
        compare({"a": lambda: 0}, baseline="z")
    with pytest.raises(ValueError, match="at least one candidate"):
        compare({})


def test_check_failure_stops_the_measurement():
    def check(name, out, args):
        assert name != "cheat", "cheat returned a wrong result"

    with pytest.raises(AssertionError, match="cheat returned"):
        compare({"ok": lambda: 1, "cheat": lambda: 2}, check=check, rounds=1, warmup=1, min_run_time=0.001,
                progress=False)


def test_plot_draws_one_bar_per_candidate():
    rep = SpeedReport({"a": [2.0, 2.0], "b": [1.0, 1.0]}, baseline="a", device="cpu", threads=1)
    ax = rep.plot()
    assert len(ax.patches) == 2


def report(base, fast):
    return SpeedReport({"eager": base, "fast": fast}, baseline="eager", device="cpu", threads=2)


def test_expect_speedup_passes_above_the_bar_and_fails_below_it():
    assert expect_speedup(report([2.0, 2.1, 1.9], [1.0, 1.0, 1.0]), "fast", bars={"cpu": 1.5, "cuda": 3}) >= 1.9
    with pytest.raises(AssertionError, match=r"1.05x as fast as eager on cpu .* bar on this device is 1.50x"):
        expect_speedup(report([1.05, 1.05, 1.05], [1.0, 1.0, 1.0]), "fast", bars={"cpu": 1.5, "cuda": 3})


def test_a_device_without_a_bar_is_an_error_not_a_pass():
    with pytest.raises(KeyError, match="No speed bar"):
        speed_bar({"cuda": 2.0}, "cpu")


def test_structure_checks_tell_scripted_compiled_and_plain_apart():
    def f(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    s, c = torch.jit.script(f), torch.compile(f, backend="eager")
    assert is_scripted(s) and not is_scripted(f) and not is_scripted(c)
    assert is_compiled(c) and not is_compiled(f) and not is_compiled(s)
    assert is_compiled(torch.compile(torch.nn.Linear(2, 2), backend="eager"))
    expect_scripted(s)
    expect_compiled(c)
    with pytest.raises(AssertionError, match="(?s)a plain function.*torch.jit.script"):
        expect_scripted(f, "scripted_layer")
    with pytest.raises(AssertionError, match="(?s)TorchScript function.*torch.compile"):
        expect_compiled(s, "compiled_layer")


def test_ops_absent_reads_torchscript_and_fx_graphs():
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) + 1

    g = torch.jit.script(f).graph
    assert "aten::relu" in graph_ops(g)
    with pytest.raises(AssertionError, match="aten::relu"):
        expect_ops_absent(g, ["aten::relu"])
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Conv2d(1, 1, 1), torch.nn.BatchNorm2d(1)))
    with pytest.raises(AssertionError, match="BatchNorm2d"):
        expect_ops_absent(gm, ["BatchNorm2d"])
    expect_ops_absent(gm, ["aten::relu"])


def test_best_of_retries_below_the_bar_and_keeps_the_best(capsys):
    from course.grading import best_of

    reports = iter([report([1.0] * 3, [1.0] * 3), report([2.0] * 3, [1.0] * 3), report([9.0] * 3, [1.0] * 3)])
    best = best_of(lambda: next(reports), "fast", bar=1.5, attempts=3)
    assert best.speedup("fast").median == 2.0  # stopped at the first report over the bar
    assert "attempt 1" in capsys.readouterr().out
    slow = iter([report([1.0] * 3, [2.0] * 3)] * 3)
    assert best_of(lambda: next(slow), "fast", bar=1.5, attempts=3).speedup("fast").median == 0.5
    with pytest.raises(ValueError, match="attempts"):
        best_of(lambda: None, "fast", bar=1.0, attempts=0)

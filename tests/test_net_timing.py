"""Times net of the harness's own work (compare_served(net=True), lesson 3's CoordConv check).

Every timed call makes its fresh inputs and checksums its output; where that costs more than the
answer's own work, the gross ratio of two answers is pulled towards 1 (lesson 3: a repair 1.45x
as fast as the planted block reads 1.2x). Netting takes one amount off every reading, measured
beside them: a ratio moves away from 1, never across it, so a slower answer stays slower."""

from __future__ import annotations

import random

import torch

from course.devices import threads
from course.timing import NET_SHARE, SpeedReport, _netted, compare_served


def test_netting_never_turns_a_slower_side_into_a_faster_one():
    rng = random.Random(12)
    for _ in range(2000):
        rounds = rng.randint(1, 9)
        times = {s: [rng.uniform(1e-4, 1e-2) for _ in range(rounds)] for s in ("base", "cand", "witness")}
        harness = [rng.uniform(1e-5, 2e-2) for _ in range(rounds)]
        net = _netted(times, harness)
        off = times["base"][0] - net["base"][0]
        assert 0 <= off <= NET_SHARE * min(harness) + 1e-15
        for r in range(rounds):
            b, c, nb, nc = times["base"][r], times["cand"][r], net["base"][r], net["cand"][r]
            assert nb > 0 and nc > 0
            assert (b / c > 1) == (nb / nc > 1) or b == c      # the same side of 1...
            assert abs(nb / nc - 1) >= abs(b / c - 1) - 1e-12  # ...and no nearer to it
    assert _netted({"a": [1.0]}, []) == {"a": [1.0]}


def _cheap_work_dear_inputs():
    """An answer whose work is small beside making its inputs (randn of a million numbers)."""
    from course.memory_format import coord_conv_inputs

    def double(x, weight, bias):
        return x * 2

    def double_twice(x, weight, bias):
        y = x * 2
        return (y + x) - x

    return coord_conv_inputs, double, double_twice


def test_a_net_reading_shows_the_work_and_still_ranks_the_sides():
    """Gross and net are read off the same rounds: two runs side by side would each carry their own
    load (CI once read the net run's median ratio 0.69x and the gross run's 0.66x)."""
    factory, fast, slow = _cheap_work_dear_inputs()
    sizes = dict(batch=16, channels=64, size=32)
    with threads(1):
        net = compare_served(("once", fast), ("three times", slow), factory=factory, sizes=sizes, device="cpu",
                             rounds=5, warmup=1, min_run_time=0.05, net=True)
        plain = compare_served(("once", fast), ("three times", slow), factory=factory, sizes=sizes, device="cpu",
                               rounds=3, warmup=1, min_run_time=0.05)
    assert plain.gross is None and net.gross is not None and set(net.gross) == set(net.times)
    gross = SpeedReport(net.gross, baseline=net.baseline, device=net.device, threads=net.threads)
    assert net.speedup("three times").median < 1.0, net.table()
    assert net.speedup("three times").median <= gross.speedup("three times").median, (gross.table(), net.table())
    for side in net.times:  # one amount off every reading, and a reading of its own
        offs = [g - n for g, n in zip(net.gross[side], net.times[side])]
        assert min(offs) > 0 and max(offs) - min(offs) < 1e-12, (side, net.gross[side], net.times[side])
    assert any("net of" in note for note in net.notes) and not any("net of" in note for note in plain.notes)

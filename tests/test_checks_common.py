"""The shared comparison behind every "it looks as if ..." message: ``same_values`` and
``name_mistake`` (course.checks.common), on generated inputs."""
import pytest
import torch

from course.checks.common import name_mistake, same_values


def _params(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(3, 4, generator=g, dtype=torch.float64) for k in ("w", "b", "g")}


@pytest.mark.parametrize("seed", range(5))
def test_dicts_compare_by_key_whatever_their_order(seed):
    a = _params(seed)
    shuffled = dict(reversed(list(a.items())))
    assert same_values(shuffled, a)
    assert not same_values({**a, "w": a["b"]}, a)  # values swapped between keys
    assert not same_values({k: a[k] for k in ("w", "b")}, a)  # a key missing
    assert not same_values({**a, "extra": a["w"]}, a)  # a key too many
    assert same_values({"x": (a["w"], [a["b"]])}, {"x": (a["w"], [a["b"]])})  # nested


@pytest.mark.parametrize("seed", range(5))
def test_name_mistake_names_the_matching_variant_and_nothing_else(seed):
    want = _params(seed)
    halved = {k: v / 2 for k, v in want.items()}
    variants = {"the step was halved": halved, "nothing changed": dict(want)}  # the second is right here
    with pytest.raises(AssertionError, match="looks as if the step was halved"):
        name_mistake("step", dict(reversed(list(halved.items()))), want, variants)
    name_mistake("step", want, want, variants)  # right: no message
    name_mistake("step", {k: v + 1 for k, v in want.items()}, want, variants)  # unknown: left to the comparison
    name_mistake("step", {"w": want["w"]}, want, variants)  # wrong structure: no crash, no claim


def test_name_mistake_compares_other_data_with_the_callers_own_equality():
    """Profiler op tables ({name: (count, total)}) are not tensors: the caller says what 'the same' means."""
    want = {"aten::mm": (2, 10.0)}
    twice = {"aten::mm": (4, 20.0)}
    same = lambda a, b: a == b  # noqa: E731
    with pytest.raises(AssertionError, match="looks as if it counted twice"):
        name_mistake("table", twice, want, {"it counted twice": twice}, same=same)
    name_mistake("table", {"aten::add": (1, 1.0)}, want, {"it counted twice": twice}, same=same)


@pytest.mark.parametrize("readings, want, taken", [
    # a loop whose course-side loop was slowed in the first readings: in the gap (0.77), refined
    # until both sides' best show the loop (1.0); before, three readings ended undecided
    ([(1.0, 1.3)] * 3 + [(1.0, 1.0)], (1.0, 1.0), 4),
    # a batched answer stops as soon as the second reading shows it
    ([(0.1, 1.0)] * 6, (0.1, 1.0), 2),
    # a clear loop stops after the usual readings
    ([(1.0, 1.0)] * 6, (1.0, 1.0), 3),
    # still in the gap after twice the readings: undecided is then the honest answer
    ([(0.6, 1.0)] * 8, (0.6, 1.0), 6),
    # a loop of module calls, many times the loop's in the first reading: decided by it (LOOP_FAST)
    ([(3.5, 1.0)] * 6, (3.5, 1.0), 1),
    # ...but not one just under it, nor one whose loop side was slowed in the first reading (2.7)
    ([(2.9, 1.0)] * 6, (2.9, 1.0), 3),
    ([(3.5, 1.3)] + [(1.0, 1.0)] * 5, (1.0, 1.0), 3),
])
def test_a_clock_reading_in_the_gap_is_refined_before_it_is_left_undecided(monkeypatch, readings, want, taken):
    from course import timing
    from course.checks.common import clock_against_loop

    calls = iter(readings)
    seen = []

    def fake_best_times(pairs, held, check, warm=(), record=None):
        seen.append(1)
        return list(next(calls))

    monkeypatch.setattr(timing, "best_times", fake_best_times)
    assert clock_against_loop(lambda: None, "fn", lambda seed: (), lambda: None, attempts=3) == want
    assert len(seen) == taken


def test_a_clock_reads_both_sides_in_one_thread_and_charges_the_learner_over_one(monkeypatch):
    """The yardstick is a loop in one thread: a loop of the learner's spread over the machine's cores
    (a pool of processes) must not read a fraction of it because the judge runs many threads. Every
    reading is taken with one intra-op thread on the judge's side (best_times charges the learner's CPU
    time over the judge's count), and with calls pinned to one thread on the learner's."""
    from course import remote, timing
    from course.checks.common import clock_against_loop

    seen = []

    def fake_best_times(pairs, held, check, warm=(), record=None):
        seen.append((torch.get_num_threads(), remote._PINNED.get()))
        return [0.1, 1.0]

    monkeypatch.setattr(timing, "best_times", fake_best_times)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        clock_against_loop(lambda: None, "fn", lambda seed: (), lambda: None)
        assert seen and set(seen) == {(1, 1)}
        assert torch.get_num_threads() == 3 and remote._PINNED.get() is None
    finally:
        torch.set_num_threads(before)

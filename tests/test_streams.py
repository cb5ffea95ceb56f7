"""Lesson 8's stream-race helpers (course.streams): the reference checker agrees with PyTorch's
CUDA Stream Sanitizer (its pure-Python event handler, driven directly, never enabled) on random
and hand-written programs; planted wrong checkers disagree with it on some random program, so a
grading check built on the agreement catches them; malformed events are explained; and the
process stays usable afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from course import streams as S
from course.references.streams import find_races
from course.streams import RAW, WAR, WAW, random_events, sanitizer_races

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [dict(), dict(n=12, streams=2, tensors=2, events=1), dict(n=45, streams=4, tensors=5, events=3),
          dict(n=20, streams=3, tensors=1, events=2), dict(n=30, streams=1), dict(n=60, streams=5, tensors=3, events=4)]
PROGRAMS = [random_events(seed, **SHAPES[seed % len(SHAPES)]) for seed in range(480)]


# -- 1. agreement ------------------------------------------------------------------------------

def test_reference_agrees_with_the_sanitizer_on_random_programs():
    seen = {"race-free": 0, "racy": 0, RAW: 0, WAR: 0, WAW: 0, "repeated report": 0}
    for seed, program in enumerate(PROGRAMS):
        ours, theirs = find_races(program), sanitizer_races(program)
        assert ours == theirs, f"seed {seed}: {program}\nfind_races: {ours}\nsanitizer:  {theirs}"
        seen["racy" if ours else "race-free"] += 1
        for race in ours:
            seen[race[1]] += 1
        seen["repeated report"] += len(ours) != len(set(ours))
    # The random programs exercise every outcome, or agreement on them would prove little.
    assert all(count >= 10 for count in seen.values()), seen
    default = [not find_races(random_events(seed)) for seed in range(200)]
    assert 0.15 < sum(default) / len(default) < 0.85, "the default programs should be a mix of race-free and racy"


def test_random_events_is_reproducible_and_mixes_every_kind():
    assert random_events(7) == random_events(7)
    assert random_events(7) != random_events(8)
    assert all(len(random_events(seed, n=n)) == n for seed, n in [(1, 0), (2, 5), (3, 30)])
    kinds = {event[0] for program in PROGRAMS for event in program}
    assert kinds == set(S.KINDS)
    # waits on events nobody recorded yet, and events recorded twice, both come up
    unrecorded = twice = 0
    for program in PROGRAMS:
        recorded: list = []
        for event in program:
            if event[0] == "wait" and event[2] not in recorded:
                unrecorded += 1
            if event[0] == "record":
                twice += event[1] in recorded
                recorded.append(event[1])
    assert unrecorded > 20 and twice > 20


def launch(stream, reads=(), writes=()):
    return ("launch", stream, tuple(reads), tuple(writes))


EDGE_CASES = {
    "read-read on two streams is no race": (
        [launch(1, writes="x"), ("sync_device",), launch(1, reads="x"), launch(2, reads="x")], []),
    "write then read on one stream is ordered": (
        [launch(1, writes="x"), launch(1, reads="x"), launch(1, writes="x")], []),
    "a record/wait chain across three streams orders the ends": (
        [launch(1, writes="x"), ("record", "a", 1), ("wait", 2, "a"), launch(2, writes="y"),
         ("record", "b", 2), ("wait", 0, "b"), launch(0, reads="xy")], []),
    "a wait on an event recorded before the write does not cover it": (
        [("record", "e", 1), launch(1, writes="x"), ("wait", 0, "e"), launch(0, reads="x")],
        [(3, RAW, "x", 1)]),
    "sync_device orders everything before it, on every stream": (
        [launch(1, writes="x"), launch(2, writes="y"), launch(0, reads="z"), ("sync_device",),
         launch(0, reads="x", writes="y"), launch(1, writes="z"), launch(7, reads="x")], []),
    "the same without sync_device races": (
        [launch(1, writes="x"), launch(2, writes="y"), launch(0, reads="z"),
         launch(0, reads="x", writes="y"), launch(1, writes="z")],
        [(3, RAW, "x", 1), (3, WAW, "y", 2), (4, WAR, "z", 0)]),
    "sync_stream orders that stream's work only": (
        [launch(1, writes="x"), launch(2, writes="y"), ("sync_stream", 1), launch(0, reads="xy")],
        [(3, RAW, "y", 2)]),
    "sync_stream covers what that stream waited for": (
        [launch(1, writes="x"), ("record", "e", 1), ("wait", 2, "e"), ("sync_stream", 2), launch(0, reads="x")],
        []),
    "sync_event orders what was recorded, not what came after": (
        [launch(1, writes="x"), ("record", "e", 1), launch(1, writes="z"), ("sync_event", "e"),
         launch(0, reads="xz")], [(4, RAW, "z", 1)]),
    "an event recorded twice: the later record counts (covering)": (
        [("record", "e", 1), launch(1, writes="x"), ("record", "e", 1), ("wait", 0, "e"), launch(0, reads="x")],
        []),
    "an event recorded twice: the later record counts (replacing)": (
        [launch(1, writes="x"), ("record", "e", 1), ("record", "e", 2), ("wait", 0, "e"), launch(0, reads="x")],
        [(4, RAW, "x", 1)]),
    "a wait recorded before a re-record keeps what it saw": (
        [launch(1, writes="x"), ("record", "e", 1), ("wait", 0, "e"), ("record", "e", 2), launch(0, reads="x")],
        []),
    "waiting on a never-recorded event orders nothing": (
        [launch(1, writes="x"), ("wait", 0, "never"), ("sync_event", "never"), launch(0, reads="x")],
        [(3, RAW, "x", 1)]),
    "every unordered earlier read is reported, one report each": (
        [launch(0, reads="x"), launch(0, reads="x"), launch(2, reads="x"), launch(1, writes="x")],
        [(3, WAR, "x", 0), (3, WAR, "x", 0), (3, WAR, "x", 2)]),
    "the frontier rule: a write checks the reads since the last write, not the write": (
        [launch(1, writes="x"), launch(0, reads="x"), launch(0, writes="x")], [(1, RAW, "x", 1)]),
    "a tensor read and written in one launch counts as written": (
        [launch(1, writes="x"), launch(0, reads="x", writes="x")], [(1, WAW, "x", 1)]),
    "free ends a tensor's history": (
        [launch(1, writes="x"), ("free", "x"), launch(0, reads="x"), ("free", "never used")], []),
    "reports within a launch: reads as listed, then writes as listed": (
        [launch(1, writes=["a", "b", "c", 3]), launch(1, reads="d"),
         launch(0, reads=["c", "a"], writes=["d", 3, "b"])],
        [(2, RAW, "c", 1), (2, RAW, "a", 1), (2, WAR, "d", 1), (2, WAW, 3, 1), (2, WAW, "b", 1)]),
    "the lesson's planted race": (S.planted_race(), [(1, RAW, "x", 1)]),
    "the lesson's fix": (S.planted_race_fixed(), []),
}


@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_edge_cases(name):
    program, expected = EDGE_CASES[name]
    assert sanitizer_races(program) == expected, "the sanitizer itself"
    assert find_races(program) == expected


# -- 2. planted wrong checkers -----------------------------------------------------------------

def checker(events, *, ignore_waits=False, record_is_barrier=False, report_read_read=False,
            every_access=False, blank_new_streams=False, first_record_counts=False, ignore_host_syncs=False):
    """An independent checker (sets of launch indices, not vector clocks), right with no flag
    set, and with one flag set, a mistake a learner could make."""
    known: dict[int, set] = {0: set()}   # stream -> launches its next work is ordered after
    host: set = set()
    recorded: dict = {}
    accesses: dict = {}                  # tensor -> [(launch index, stream, is_write), ...] since free
    races = []

    def stream(s):
        return known.setdefault(s, set() if blank_new_streams else set(host))

    def host_waits_for(done):
        if not ignore_host_syncs:
            done = set(done)
            host.update(done)
            for k in known.values():
                k.update(done)

    for i, (kind, *args) in enumerate(events):
        if kind == "launch":
            s, reads, writes = args
            mine = stream(s)
            mine.add(i)
            for t, is_write in [(t, False) for t in reads if t not in writes] + [(t, True) for t in writes]:
                history = accesses.setdefault(t, [])
                last_write = max((j for j, (_, _, w) in enumerate(history) if w), default=-1)
                if every_access:
                    earlier = [a for a in history if is_write or a[2] or report_read_read]
                elif not is_write:
                    earlier = [history[last_write]] if last_write >= 0 else []
                    if report_read_read:
                        earlier += [a for a in history[last_write + 1:]]
                else:
                    earlier = history[last_write + 1:] or ([history[last_write]] if last_write >= 0 else [])
                for j, q, w in earlier:
                    if j not in mine:
                        races.append((i, NAMES[is_write, w], t, q))
                history.append((i, s, is_write))
        elif kind == "record":
            e, s = args
            if not (first_record_counts and e in recorded):
                recorded[e] = set(stream(s))
            if record_is_barrier:
                host_waits_for(set().union(*known.values()))
        elif kind == "wait":
            if not ignore_waits:
                stream(args[0]).update(recorded.get(args[1], set()))
        elif kind == "sync_stream":
            host_waits_for(stream(args[0]))
        elif kind == "sync_event":
            host_waits_for(recorded.get(args[0], set()))
        elif kind == "sync_device":
            host_waits_for(set().union(*known.values()))
        elif kind == "free":
            accesses.pop(args[0], None)
    return races


NAMES = {(False, True): RAW, (True, False): WAR, (True, True): WAW, (False, False): "read-after-read"}
MISTAKES = ["ignore_waits", "record_is_barrier", "report_read_read", "every_access", "blank_new_streams",
            "first_record_counts", "ignore_host_syncs"]


def test_the_independent_checker_agrees_when_right():
    for seed, program in enumerate(PROGRAMS):
        assert checker(program) == sanitizer_races(program), f"seed {seed}: {program}"


@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_planted_wrong_checker_disagrees_with_the_sanitizer(mistake):
    caught = [seed for seed, program in enumerate(PROGRAMS)
              if checker(program, **{mistake: True}) != sanitizer_races(program)]
    assert caught, f"no random program tells a checker with {mistake} from the sanitizer"
    # and on default-sized programs alone, as a grading check would draw them
    assert any(checker(p, **{mistake: True}) != sanitizer_races(p) for p in map(random_events, range(300)))


# -- 3. malformed events -----------------------------------------------------------------------

BAD = [
    (("launch", 0, (), ("x",)), TypeError, "looks like one event"),
    (5, TypeError, "expects a list of event tuples"),
    ("launch", TypeError, "expects a list of event tuples"),
    ([()], TypeError, "event 0: expected an event tuple, got () (tuple). Try (\"launch\", 1,"),
    ([launch(0, writes="x"), "sync_device"], TypeError,
     "event 1: expected an event tuple, got 'sync_device' (str). Try ('sync_device',)"),
    ([{"launch": 0}], TypeError, "event 0: expected an event tuple, got {'launch': 0} (dict)"),
    ([(["launch"], 0, (), ())], ValueError, "unknown kind ['launch']"),
    ([("lauch", 0, (), ())], ValueError, "unknown kind 'lauch'; expected one of 'launch'"),
    ([("record", "e")], ValueError, "a 'record' event is ('record', event, stream), 3 item(s)"),
    ([("sync_device", 0)], ValueError, "a 'sync_device' event is ('sync_device',)"),
    ([("launch", 0, (), ("x",), 1)], ValueError, "('launch', stream, reads, writes)"),
    ([("launch", -1, (), ("x",))], ValueError, "stream must be an int >= 0 (0 is the default stream), got -1"),
    ([("wait", "s1", "e")], ValueError, "got 's1' (str)"),
    ([("sync_stream", True)], ValueError, "got True (bool)"),
    ([("launch", 0, "x", ())], TypeError, "reads must be a tuple of tensor names, got 'x' (str). Did you mean ('x',)?"),
    ([("launch", 0, (), 3)], TypeError, "writes must be a tuple of tensor names, got 3 (int). Did you mean (3,)?"),
    ([("launch", 0, (), {"x"})], TypeError, "Try () for none"),
    ([("launch", 0, ("x", 1.5), ())], ValueError, "reads holds 1.5 (float); a tensor is named by a str or an int"),
    ([("launch", 0, ("x", "x"), ())], ValueError, "lists tensor 'x' more than once"),
    ([("record", None, 0)], ValueError, "the event must be named by a str or an int, got None"),
    ([("free", ("x",))], ValueError, "the tensor must be named by a str or an int"),
]


@pytest.mark.parametrize("events, error, message", BAD, ids=[f"bad{k}" for k in range(len(BAD))])
def test_malformed_events_are_explained(events, error, message):
    for check in (find_races, sanitizer_races):
        with pytest.raises(error) as info:
            check(events)
        assert message in str(info.value)
        assert "Try" in str(info.value) or "Did you mean" in str(info.value) or "list each" in str(info.value) \
            or "Wrap it" in str(info.value)


def test_events_as_lists_are_accepted():
    as_lists = [list(map(lambda f: list(f) if isinstance(f, tuple) else f, e)) for e in PROGRAMS[5]]
    assert find_races(as_lists) == sanitizer_races(as_lists) == find_races(PROGRAMS[5])


@pytest.mark.parametrize("kwargs", [dict(n=-1), dict(streams=0), dict(tensors=1.0), dict(events=True)])
def test_random_events_rejects_bad_sizes(kwargs):
    with pytest.raises(ValueError, match="random_events: .* must be an int"):
        random_events(0, **kwargs)


def test_find_races_leaves_the_sanitizer_unimported():
    """find_races is pure Python: importing torch's sanitizer switches the GPU trace on for the
    whole process (see sanitizer_races), which a learner's checking cell should not do."""
    code = ("import sys, course.streams as s; from course.references.streams import find_races; "
            "find_races(s.planted_race()); s.random_events(0); "
            "assert 'torch.cuda._sanitizer' not in sys.modules, 'imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


# -- 4. the process stays usable (keep last) ---------------------------------------------------

def test_the_process_stays_usable_after_driving_the_sanitizer():
    from torch.cuda import _sanitizer as csan
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    sanitizer_races(S.planted_race())
    assert not csan.cuda_sanitizer.enabled, "the sanitizer was switched on"
    assert not _get_current_dispatch_mode_stack(), "a dispatch mode is left active"
    assert torch.equal(torch.ones(2) + 1, torch.full((2,), 2.0))
    assert torch.ones(3, 3).sum().item() == 9.0


def test_on_a_cuda_machine_the_replay_runs_in_a_fresh_process_and_agrees():
    """Importing the sanitizer switches PyTorch's GPU trace on for the whole process (every later
    allocation calls Python on a GPU): where CUDA is present, the replay runs in a process of its
    own. Forced here on a CPU, in a clean interpreter: same reports, and the module never imported."""
    import subprocess
    import sys

    script = ("import sys\n"
              "import course.streams as st\n"
              "import course.references.streams as rs\n"
              "rs._cuda = lambda: True\n"
              "programs = [st.random_events(i, n=25) for i in range(30)]\n"
              "away = rs.sanitizer_races_many(programs)\n"
              "assert 'torch.cuda._sanitizer' not in sys.modules\n"
              "from course.references.streams import find_races\n"
              "assert away == [find_races(p) for p in programs]\n"
              "assert st.sanitizer_races(st.planted_race()) == [(1, 'read-after-write', 'x', 1)]\n"
              "print(sum(map(len, away)))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.strip()) > 0

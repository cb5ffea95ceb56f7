"""The whole contract between the course package and the autograder, in one place.

In a learner's notebook every hook here is ``None`` and the course behaves as plain Python.
The grading sandbox (``autograder/sandbox/child.py``) calls :func:`install` once, before any
learner code runs, and nothing else in the course is set from outside. Each hook is read by one
module:

- ``observer(actual, expected, tol)``: told every comparison a check makes
  (:func:`course.numerics.assert_close`) and every speed verdict
  (:func:`course.numerics.report_at_least`), so that the grading parent can decide again;
- ``exclusive()``: a context manager that holds the machine for one measurement
  (:func:`course.timing.compare`), so that submissions graded in parallel never time against
  each other;
- ``learner_prefix`` and ``refused(name, where)``: where the learner's cells are written, and
  whom to tell when one of them calls a course reference (:mod:`course.guard`);
- ``hold()``: in the judge process only, a context manager during which the learner's process is
  held still (frozen with its cgroup, else stopped with SIGSTOP; the parent checks afterwards that
  nothing of it ran), so that a trusted baseline is never timed beside learner code
  (:func:`course.timing.compare_served`);
- ``learner_cpu()``: in the judge process only, the CPU seconds the learner's process and every
  process it started have used so far (threads and helper processes counted), read by the
  grading parent from its cgroup (else ``/proc``): a candidate's timed block is charged its CPU time divided by the
  threads it was allowed when that exceeds its wall time; the timing functions read it through
  ``learner_counts`` where the grader offers that (this hook on its own: tests, and any grader without it);
- ``learner_main_cpu()``: in the judge process only, the CPU seconds the main thread of the
  learner's interpreter has used so far (-1 where not known), read by the parent from ``/proc``:
  the thread that runs the course's own function when it is timed there, apart from any thread of
  the learner's (a thread that holds the interpreter's lock makes that one wait, not work)
  (:func:`course.timing.compare_served` with ``calibrate``, through ``learner_counts`` where offered);
- ``learner_peak(reset)``: in the judge process only, the peak resident memory (bytes) of the
  learner's process and the processes it runs, as the kernel counts it, since the last call with
  ``reset=True`` (which starts the count again from what is resident, and has the grading parent
  sample the resident memory until the next call: a peak the learner's code sets back, or a
  helper process that ends, is still seen): what an answer that builds something large cannot
  hide, however fast it is (lesson 5's HVP);
- ``learner_waited(main=False)``: in the judge process only, the seconds the learner's live threads
  (``main``: its interpreter's main thread alone, the one that answers the judge) have spent ready to
  run but waiting for a CPU (-1 where the kernel keeps no count), read by the parent from ``/proc``:
  beside ``learner_cpu``, whether a process that used little CPU in a timed call was kept from it (a
  busy machine) or did not ask for it (it slept); read on its own by :func:`course.timing.waited_for_cpu`
  (lesson 2's profiler), and through ``learner_counts`` around timed calls;
- ``learner_counts()``: in the judge process only, ``learner_cpu()``, ``learner_waited()``,
  ``learner_waited(main=True)`` and ``learner_main_cpu()`` read together, in one request to the parent:
  what a timed call or block is bracketed with (:func:`course.timing.best_times`,
  :func:`course.timing.compare_served`; one round trip before it, one after; without this hook they
  ask the three above one by one);
- ``uninterrupted()``: a context manager during which the grader's time limit waits (raised as
  it ends): the few lines that write or keep one piece of a message on the judge/learner channel
  (:class:`course.remote.Link`), so that a time limit never cuts a message in two (the harness's own
  channel to the grading parent holds it the same way, ``autograder/sandbox/protocol.py``);
- ``alarm``: the handler of SIGALRM the harness installed (its time limit): any other Python
  handler of a signal is code that could run between the course's bytecodes while the course's
  function is timed in the learner's process (:func:`course.remote.disturbances`);
- ``script_host()``: in the judge process only, the channel (a :class:`course.remote.Link`) to the
  script host, a third confined process started at the first call, which loads and runs a learner's
  TorchScript archive (:func:`course.remote.local_script`): TorchScript runs with the reach of the
  process it is in, so it never runs in the judge;
- ``bare_host()``: in the judge process only, the channel (a :class:`course.remote.Link` speaking
  JSON) to the bare host, a confined Python with its standard library and no installed package,
  where a learner's answer by hand runs again on the judge's inputs (:func:`course.bare.run_bare`):
  there, not calling torch is the kernel's fact, not a probe's report;
- ``program_host()``: in the judge process only, the channel to the program host, a process like the
  script host but of its own, where the programs the judge read run again (:func:`course.hand.hosted`):
  nothing of the learner's but those programs runs there, not even its TorchScript;
- the environment variable :data:`SELF_CHECK_SKIP`: the lessons' closing self-check does
  nothing (the grader reads the test cells itself).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager

observer: Callable[[Any, Any, dict], None] | None = None
exclusive: Callable[[], ContextManager] | None = None
learner_prefix: str | None = None
refused: Callable[[str, str], None] | None = None
hold: Callable[[], ContextManager] | None = None
learner_cpu: Callable[[], float] | None = None
learner_main_cpu: Callable[[], float] | None = None
learner_peak: Callable[[bool], float] | None = None
learner_waited: Callable[..., float] | None = None
learner_counts: Callable[[], tuple[float, float, float, float]] | None = None
uninterrupted: Callable[[], ContextManager] | None = None
alarm: Callable | None = None
script_host: Callable[[], Any] | None = None
bare_host: Callable[[], Any] | None = None
program_host: Callable[[], Any] | None = None

SELF_CHECK_SKIP = "COURSE_SELF_CHECK_SKIP"


def machine_turn() -> ContextManager:
    """The timing turn (``exclusive``) under the grader; elsewhere a context that does nothing."""
    return exclusive() if exclusive is not None else nullcontext()


def learner_stopped() -> ContextManager:
    """The learner's process stopped (``hold``) in the judge; elsewhere a context that does nothing."""
    return hold() if hold is not None else nullcontext()


def install(*, observer: Callable, exclusive: Callable, learner_prefix: str, refused: Callable,
            hold: Callable | None = None, learner_cpu: Callable | None = None,
            learner_main_cpu: Callable | None = None, learner_peak: Callable | None = None,
            uninterrupted: Callable | None = None, alarm: Callable | None = None,
            script_host: Callable | None = None, bare_host: Callable | None = None,
            program_host: Callable | None = None, learner_waited: Callable | None = None,
            learner_counts: Callable | None = None) -> None:
    """Called by the grading sandbox only."""
    globals().update(observer=observer, exclusive=exclusive, learner_prefix=learner_prefix, refused=refused,
                     hold=hold, learner_cpu=learner_cpu, learner_main_cpu=learner_main_cpu,
                     learner_peak=learner_peak, uninterrupted=uninterrupted, alarm=alarm, script_host=script_host,
                     bare_host=bare_host, program_host=program_host, learner_waited=learner_waited,
                     learner_counts=learner_counts)


def installed() -> tuple:
    """What is installed now (the sandbox compares it after every cell)."""
    return (observer, exclusive, learner_prefix, refused, hold, learner_cpu, learner_main_cpu, learner_peak,
            uninterrupted, alarm, script_host, bare_host, program_host, learner_waited, learner_counts)

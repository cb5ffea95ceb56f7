"""The trusted side of a served check: runs the instructor's test cells outside the learner's process.

Started by ``parent.py`` as
``python -I judge.py IN_FD OUT_FD CALL_FD REPLY_FD PKG_ROOT LIMITS HOST_CALL_FD HOST_REPLY_FD BARE_CALL_FD
BARE_REPLY_FD``,
confined like the learner's process (bubblewrap, no network, ``nobody``) but sharing nothing with
it: no memory, no module, no file. It runs only code from the grading checkout: the instructor's
set-up cells that depend on no learner name (imports, sizes; chosen by ``program.py``), then each
*served* test cell as the parent sends it. In a test cell, every name those set-up cells did not
bind is a :class:`course.remote.Remote`: the learner's value, reached over ``CALL_FD``/``REPLY_FD``
(``course.wire``: data both ways, never pickles), while the learner's process serves requests
(``child.py``). So the check, its references, its comparisons and the evidence it reports to
the parent (the same messages as ``child.py``: records, cell start and end) are out of the
learner's reach; what the learner's code contributes is outputs, as data, on inputs this process
chose (from seeds drawn from the class's secret key: ``course.checks.draw_seeds``). No
learner code runs here, TorchScript included: a learner's archive is loaded and run by the
script host (``script_host.py``, over ``HOST_CALL_FD``/``HOST_REPLY_FD``), which the parent starts
when this process first asks for it; an answer the lesson asks for by hand is run again by the bare
host (``bare_host.py``, over ``BARE_CALL_FD``/``BARE_REPLY_FD``), a Python without torch.
"""

from __future__ import annotations

import builtins
import importlib.util
import io
import os
import pickle
import sys
import time
import traceback


def _load_protocol():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "protocol.py")
    spec = importlib.util.spec_from_file_location("_grading_protocol", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


protocol = _load_protocol()


def learner_names(source: str, known: dict) -> list[str]:
    """The names a test cell reads that neither it nor the trusted set-up binds: the learner's."""
    from course.cells import names

    loaded, stored = names(source)
    return sorted(n for n in loaded - stored if n not in known and not hasattr(builtins, n))


def main() -> int:
    in_fd, out_fd, call_fd, reply_fd, pkg_root, limits = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                                          int(sys.argv[4]), sys.argv[5], sys.argv[6])
    host_fds = {which: (int(sys.argv[7 + 2 * i]), int(sys.argv[8 + 2 * i])) for i, which in enumerate(protocol.HOSTS)}
    protocol.set_limits(limits)

    def receive():
        (size,) = protocol.HEADER.unpack(protocol.read_exact(in_fd, protocol.HEADER.size))
        return pickle.loads(protocol.read_exact(in_fd, size))  # from the grading parent: trusted

    setup = receive()
    alarm = protocol.Alarm()  # the parent's time limit (its handler is installed below), held by the channel
    channel = protocol.Channel(out_fd, setup["token"], in_fd=in_fd, alarm=alarm)
    os.environ.setdefault("MPLBACKEND", "Agg")
    os.environ["COURSE_SELF_CHECK_SKIP"] = "1"
    sys.path.insert(0, pkg_root)
    import torch

    import course
    if not os.path.realpath(course.__file__).startswith(os.path.realpath(pkg_root) + os.sep):
        raise SystemExit(f"grading: imported course from {course.__file__}, not from {pkg_root}")
    import course.checks
    if setup.get("seed_key"):  # before the set-up cells import the checks: the seeds they name are drawn
        course.checks.draw_seeds(bytes.fromhex(setup["seed_key"]))
    from course.allocator import hold_process
    hold_process()  # C memory steady in this process, as in the other: fair timings
    import course.grader_hooks as hooks
    from course.remote import Link, Remote

    state = {"cell": None, "records": 0}

    def observer(actual, expected, tol):
        if state["cell"] is None:
            return
        channel.send("record", cell=state["cell"], n=state["records"], name=str(tol.get("name")),
                     actual=protocol.plain(actual), expected=protocol.plain(expected), tol=protocol.plain(tol))
        state["records"] += 1

    def exclusive():
        """The machine to this submission alone for one measurement (other submissions paused)."""
        return channel.granted("speed_begin", "speed_end", "the timing turn", cell=state["cell"])

    def hold():
        """The learner's process stopped (by the parent) for a block: a trusted baseline is
        never timed beside learner code."""
        return channel.granted("hold", "release", "to stop the learner's process")

    def answered(kind: str, shape, **data) -> tuple:
        """The parent's answer (``shape``, a struct) to a request (``Channel.request``: the cell's time
        limit waits while they cross)."""
        return shape.unpack(channel.request(kind, shape.size, **data))

    def ask(kind: str, **data) -> float:
        """A number the parent reads from /proc about the learner's processes."""
        return answered(kind, protocol.NUMBER_ANSWER, **data)[0]

    def learner_cpu() -> float:
        """The CPU seconds the learner's process tree has used so far."""
        return ask(protocol.CPU)

    def learner_main_cpu() -> float:
        """The CPU seconds the main thread of the learner's interpreter has used so far (-1: not known)."""
        return ask(protocol.CPU, main=True)

    def learner_waited(main: bool = False) -> float:
        """The seconds the learner's live threads (``main``: its interpreter's main thread alone) have
        waited, ready to run, for a CPU (-1: not known)."""
        return ask(protocol.CPU, waited=True, main=bool(main))

    def learner_counts() -> tuple[float, float, float, float]:
        """``learner_cpu()``, ``learner_waited()``, ``learner_waited(main=True)`` and ``learner_main_cpu()``
        in one round trip: what a timed call is bracketed with (``course.timing``)."""
        return answered(protocol.CPU, protocol.COUNTS_ANSWER, counts=True)

    def learner_peak(reset: bool = False) -> float:
        """The learner's processes' peak resident bytes, as the kernel counts it; ``reset``: start
        the count again from what is resident now (and the parent's sampling, until the next call)."""
        return ask(protocol.PEAK, reset=bool(reset))

    links: dict = {}  # the hosts' channels, once started

    def host_link(which: str):
        """The channel to the host ``which``, which the parent starts at the first call."""
        if which not in links:
            if ask(protocol.HOST, which=which) < 1:
                raise RuntimeError(f"grading: the parent could not start the {which} host")
            links[which] = Link(*host_fds[which], codec=(protocol.json_payload, protocol.json_value)
                                if which == "bare" else None)
        if links[which].broken:
            raise RuntimeError(links[which].broken)
        return links[which]

    def script_host():
        """A learner's TorchScript is loaded and run there, never here (``script_host.py``)."""
        return host_link("script")

    def bare_host():
        """A learner's answer by hand runs there again, in a Python without torch (``bare_host.py``)."""
        return host_link("bare")

    def program_host():
        """The programs the judge read (``course.hand``) run there again, beside no TorchScript of the
        learner's (``script_host.py``, a process of its own)."""
        return host_link("program")

    # No learner frame is ever on this process's stack: the references serve the checks freely.
    hooks.install(observer=observer, exclusive=exclusive, learner_prefix=os.path.join(os.sep, "no-learner-code", ""),
                  refused=lambda name, where: None, hold=hold, learner_cpu=learner_cpu, learner_main_cpu=learner_main_cpu,
                  learner_peak=learner_peak, learner_waited=learner_waited, learner_counts=learner_counts,
                  uninterrupted=alarm.uninterrupted, alarm=alarm.on_alarm, script_host=script_host,
                  bare_host=bare_host, program_host=program_host)

    alarm.install()  # the parent's time limit, felt inside a cell's code only
    link = Link(call_fd, reply_fd)
    namespace: dict = {"__name__": "__main__", "__builtins__": builtins}
    real_out, real_err = sys.stdout, sys.stderr
    for source in setup["setup_cells"]:
        sys.stdout = sys.stderr = io.StringIO()
        try:
            exec(compile(source, "<instructor set-up>", "exec"), namespace)
        except BaseException:  # noqa: BLE001 - reported with the first test cell
            setup.setdefault("setup_errors", []).append(traceback.format_exc(limit=3)[-1500:])
        finally:
            sys.stdout, sys.stderr = real_out, real_err
    trusted = dict(namespace)
    # torch's global state as the set-up left it, set back at the start of every cell as the
    # namespace is: a check that switches grad mode off or seeds the global generator (as a
    # learner's TorchScript did when it ran here) leaves nothing to a later cell.
    trusted_torch = (torch.is_grad_enabled(), torch.get_rng_state())
    channel.send("ready", seal_entries=0)

    for _ in range(setup["count"]):
        cell = receive()
        index, source = cell["index"], cell["source"]
        namespace.clear()
        namespace.update(trusted)
        torch.set_grad_enabled(trusted_torch[0])
        torch.set_rng_state(trusted_torch[1])
        for name in learner_names(source, trusted):
            namespace[name] = Remote(link, name)
        state["cell"], state["records"] = index, 0
        probes_before = link.probes
        channel.send("cell_start", cell=index)
        buf = io.StringIO()
        sys.stdout = sys.stderr = buf
        start = time.monotonic()
        if setup.get("setup_errors"):
            outcome = RuntimeError("grading: the lesson's set-up failed in the judge:\n" + setup["setup_errors"][0])
        else:
            outcome = alarm.run(lambda: exec(compile(source, f"<test cell {index}>", "exec"), namespace))
            channel.give_back()  # a turn or a hold an alarm left held (``Channel.give_back``)
        sys.stdout, sys.stderr = real_out, real_err
        state["cell"] = None
        if isinstance(outcome, protocol.CellTimeout):
            error = f"TimeoutError: the cell ran longer than {setup['cell_timeout']:g} s and was interrupted"
            for which, host in links.items():
                if host.busy:  # interrupted waiting for it: stopped, it runs nothing more
                    ask(protocol.HOST, stop=True, which=which)
                    host.broken = (f"the process that runs your {protocol.HOST_RUNS.get(which, which)} was stopped: "
                                   "a call to it ran past an earlier cell's time limit")
        elif outcome is not None:
            error = "".join(traceback.format_exception_only(type(outcome), outcome)).strip()
        else:
            error = ""
        outcome = None
        try:
            link.send({"op": "end"})
        except OSError:
            pass
        if link.broken and link.send_fd >= 0:
            # The learner's process broke the channel (a frame over the limit): close it, so that a
            # write it is blocked in fails and it goes on with its notebook; every later served cell
            # fails at once with the reason.
            for fd in (link.send_fd, link.recv_fd):
                os.close(fd)
            link.send_fd = link.recv_fd = -1
        channel.send("cell_end", cell=index, error=error[-protocol.MAX_ERROR_CHARS:],
                     output=buf.getvalue()[-protocol.MAX_OUTPUT_CHARS:], seconds=round(time.monotonic() - start, 3),
                     records=state["records"], tampered=False, probed=link.probes > probes_before)
    channel.send("done")
    return 0


if __name__ == "__main__":
    protocol.end(main())

"""The sandboxed side of grading: runs one graded program and reports what happened.

Started by ``parent.py`` as ``python -I child.py IN_FD OUT_FD CELLS_DIR PKG_ROOT LIMITS [CALL_FD REPLY_FD]``, usually
inside bubblewrap, where it sees the Python environment, the grading checkout's ``course``
package (under ``PKG_ROOT``, imported from there whatever else is installed) and an empty
folder, nothing else. Before any learner code runs it lowers its own rlimits (``LIMITS``:
file size, processes, core dumps, data size on a CPU), soft and hard, so the kernel enforces
them; it never sets a clock of its own: the parent interrupts a cell that runs too long with
SIGALRM, counting only the time this process was not paused. It never decides a grade. It tells the grading parent, over a pipe:

- when each cell starts and ends, and the error a cell raised (with its output, for feedback);
- every comparison a graded check makes (``course.numerics.assert_close`` reports the value the
  learner's code produced and the reference it was compared with); the parent redoes each
  comparison itself, against references from the instructor's run, so patching comparisons,
  references or inputs in here earns nothing;
- flags: what the seal and the audit hook saw learner code try (patching guarded modules,
  reaching for frames, the garbage collector, ctypes, other processes, the grader's files).

Every message carries a token that only this harness holds, so learner code that writes to the
pipe cannot forge one. The parent treats all of it as evidence, never as a verdict.

A *served* test cell never comes here: the parent sends a ``serve`` stub instead, and this
process answers the judge's requests on ``CALL_FD``/``REPLY_FD`` (``course.remote.serve``: calls,
backward passes, TorchScript archives, timed blocks) until the judge ends the cell. Nothing this
process sends during a served cell counts as that cell's evidence.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import sys
import time
import traceback

# The standard library itself (os.py's folder), not site-packages: in a venv sysconfig's
# "platstdlib" points into the venv, where torch lives.
STDLIB = (os.path.dirname(os.path.realpath(os.__file__)) + os.sep,
          os.path.dirname(os.path.abspath(os.__file__)) + os.sep)
GUARDED_PREFIXES = ("course", "torch", "builtins", "time", "math", "functools", "operator", "timeit",
                    "unittest", "numpy")
FORBIDDEN_PATH = re.compile(r"solutions|gradebook|autograd(?:er|ed)|submitted|/proc/\d+/mem|"
                            r"/proc/self/(?:fd|mem|environ)|/dev/fd/|clear_refs", re.IGNORECASE)
#: Events whose first argument is a path that learner code reaches: opening one, or making a link to
#: one (a link under another name would open it unseen). ``clear_refs`` is the kernel's reset of a
#: process's peak memory, which the grader reads as a witness (lesson 5's HVP): never the learner's.
PATH_EVENTS = ("open", "os.symlink", "os.link")
LEARNER_EVENTS = {
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function", "ctypes.string_at",
    "ctypes.addressof", "ctypes.wstring_at", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
    "object.__getattr__", "sys._getframe", "sys._current_frames", "sys.settrace", "sys.setprofile",
    "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "os.kill", "os.killpg", "function.__new__", "code.__new__", "object.__setattr__", "object.__delattr__",
    "socket.__new__", "socket.connect", "socket.bind", "signal.pthread_kill", "sys.addaudithook",
}


#: A process's memory by any of its names in /proc (``thread-self``, a task's own ``mem``), once the
#: path is normalised (``/proc/self//mem``, ``/proc/./self/mem``); and a bare ``mem`` or ``pagemap``,
#: which is how a file opened relative to a folder's descriptor (``dir_fd``) reaches the hook.
PROCESS_MEMORY = re.compile(r"/proc/(?:self|thread-self|\d+)(?:/task/\d+)?/(?:mem|pagemap)\b|^(?:mem|pagemap)$")


def _forbidden(path: str) -> bool:
    return bool(FORBIDDEN_PATH.search(path) or PROCESS_MEMORY.search(path)
                or PROCESS_MEMORY.search(os.path.normpath(path).replace("//", "/")))


def _reached(event: str) -> str:
    """How a path event reached its path, for a flag."""
    return "opened" if event == "open" else "made a link to"


def _own_file(path: str) -> bool:
    try:
        return os.path.realpath(path) in OWN_FILES
    except (OSError, ValueError):
        return False


def _load(name: str):
    """``NAME.py`` beside this file, by path (no folder is added to ``sys.path``)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_grading_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


protocol = _load("protocol")
#: The harness's own files: a traceback through its frames reads their lines (public code, not probing;
#: outside bubblewrap they sit in the checkout's ``autograder/``, a path learners may not open).
OWN_FILES = frozenset(os.path.realpath(p) for p in (__file__, protocol.__file__))


Channel, read_exact, set_limits, plain = protocol.Channel, protocol.read_exact, protocol.set_limits, protocol.plain


#: Classes of guarded libraries whose methods the course's probes and watchers rely on: their own
#: attributes are sealed too (a probe's report could be forged by patching them).
SEALED_CLASSES = {"torch.overrides": ("TorchFunctionMode",), "torch.nn.modules.module": ("Module",),
                  "torch.autograd.function": ("Function",), "torch.amp.autocast_mode": ("autocast",)}


class Seal:
    """Which callables and modules the guarded modules held before learner code ran, and the
    attributes of the course's own classes (and of ``SEALED_CLASSES``)."""

    def __init__(self):
        self.snapshot: dict[str, tuple[object, dict]] = {}
        self.classes: dict[str, list[tuple[type, dict]]] = {}
        self.codes: dict[str, dict[str, tuple]] = {}
        self.take()

    @staticmethod
    def _guarded(name: str) -> bool:
        root = name.split(".")[0]
        return root in GUARDED_PREFIXES and ".config" not in name and not name.endswith("config")

    def take(self) -> None:
        # Reading a module's attributes can trip torch's deprecation shims (torch.distributed's
        # reduce_op warns on isinstance); the learner should not see the grader's bookkeeping.
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._take()

    def _take(self) -> None:
        import types

        for name, mod in list(sys.modules.items()):
            if mod is None or not self._guarded(name) or name in self.snapshot:
                continue
            try:
                entries = {k: v for k, v in vars(mod).items()
                           if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, type,
                                             types.ModuleType)) or callable(v)}
            except TypeError:
                continue
            self.snapshot[name] = (mod, entries)
            if name.split(".")[0] == "course":  # the course's functions keep their code, too
                self.codes[name] = {k: _fingerprint(v) for k, v in entries.items() if isinstance(v, types.FunctionType)}
            if name.split(".")[0] == "course":
                classes = [v for v in entries.values() if isinstance(v, type) and v.__module__ == name]
            else:
                classes = [entries[c] for c in SEALED_CLASSES.get(name, ()) if isinstance(entries.get(c), type)]
            self.classes[name] = [(cls, {k: v for k, v in vars(cls).items() if _behaviour(v)}) for cls in classes]

    def type_ids(self) -> set[int]:
        """The ids of the guarded modules' classes: patching one of them is the audit hook's to refuse."""
        return {id(v) for _, (_, entries) in self.snapshot.items() for v in entries.values() if isinstance(v, type)}

    def broken(self) -> list[str]:
        changed = []
        for name, (mod, entries) in self.snapshot.items():
            now = sys.modules.get(name, _MISSING)
            if now is not mod and now is not _MISSING:
                if name.split(".")[0] == "course" or not _from_guarded(now):
                    changed.append(f"sys.modules[{name!r}] replaced")
                continue
            d = vars(mod)
            ours = name.split(".")[0] == "course"
            for key, obj in entries.items():
                now = d.get(key, _MISSING)
                if now is not obj and (ours or not _from_guarded(now)):
                    changed.append(f"{name}.{key} replaced")
                    if len(changed) > 5:
                        return changed
            for key, print_ in self.codes.get(name, {}).items():
                if any(a is not b for a, b in zip(_fingerprint(d.get(key)), print_)):
                    changed.append(f"{name}.{key}'s code replaced")
            for cls, attrs in self.classes.get(name, ()):
                now_attrs = {k: v for k, v in vars(cls).items() if _behaviour(v)}
                for key in set(attrs) | set(now_attrs):
                    if key == "__dict__" or key == "__weakref__":
                        continue
                    if now_attrs.get(key, _MISSING) is not attrs.get(key, _MISSING) and (
                            ours or not _from_guarded(now_attrs.get(key, _MISSING))):
                        changed.append(f"{name}.{cls.__qualname__}.{key} replaced")
                        if len(changed) > 5:
                            return changed
        return changed


def _fingerprint(fn) -> tuple:
    """What a function runs: its code and default values (``__code__`` can be swapped in place)."""
    return (getattr(fn, "__code__", None), getattr(fn, "__defaults__", None), getattr(fn, "__kwdefaults__", None))


def _behaviour(value) -> bool:
    """A class attribute that is behaviour (a method, a property, a descriptor), not data: what a
    patch changes. Data a library keeps on its own classes (dynamo marks ``nn.Module`` with a flag)
    is left alone."""
    return callable(value) or hasattr(type(value), "__get__")


_MISSING = object()
LEARNER_FILES = [""]  # set in main(): where the learner's cells are written


def _from_guarded(value) -> bool:
    """Whether ``value`` comes from a guarded library itself (torch re-binds some of its own
    names lazily); what learner code defines or deletes does not."""
    if value is _MISSING:
        return False
    code = getattr(value, "__code__", None)
    if code is not None and LEARNER_FILES[0] and code.co_filename.startswith(LEARNER_FILES[0]):
        return False
    module = getattr(value, "__module__", None) or getattr(value, "__name__", "")
    return isinstance(module, str) and module.split(".")[0] in GUARDED_PREFIXES


def audit_hook(state: dict, *, judging, caller, flag, guarded_type_ids: set):
    """The sandbox's audit hook, one for the learner's process and for the workers it launches.

    It refuses (and ``flag(name, detail)``s) a path in ``FORBIDDEN_PATH`` opened or linked to, and,
    when learner code raised it, an event in ``LEARNER_EVENTS``: frames, the garbage collector,
    ctypes, other processes, and a swapped ``__code__`` or attribute of a guarded function or type
    (``guarded_type_ids``; the learner's own are left alone). ``caller(frame)`` names the learner's
    ``file:line`` nearest the event, or None when the event is not the learner's. It does nothing
    while ``state["busy"]`` (the harness's own work; set by the hook too, whose frame walk raises
    events of its own) or while ``judging()`` is false (no learner code has run yet)."""

    def hook(event, args):
        if state["busy"] or not judging():
            return
        if event in PATH_EVENTS:
            path = args[0]
            if isinstance(path, bytes):
                path = path.decode(errors="replace")
            if isinstance(path, str) and _forbidden(path) and not _own_file(path):
                state["busy"] = True
                try:
                    who = caller(sys._getframe(1)) or "code called by the submission"
                finally:
                    state["busy"] = False
                flag("probing", f"{who} {_reached(event)} {path}")
                raise PermissionError(f"grading: {path} is out of bounds")
            return
        if event not in LEARNER_EVENTS:
            return
        state["busy"] = True
        try:
            if event == "object.__getattr__" and args[1] not in ("tb_frame", "gi_frame", "cr_frame",
                                                                 "ag_frame", "f_back"):
                return
            if event == "object.__setattr__" or event == "object.__delattr__":
                target = args[0]
                owner = getattr(target, "__module__", "") or ""
                if not (id(target) in guarded_type_ids or
                        (callable(target) and str(owner).split(".")[0] in GUARDED_PREFIXES and
                         getattr(target, "__module__", None) is not None and not isinstance(target, type))):
                    return
            who = caller(sys._getframe(1))
        finally:
            state["busy"] = False
        if who is None:
            return
        name = "patching" if event.startswith("object.__set") or event.startswith("object.__del") else "introspection"
        flag(name, f"{who}: {event} {str(args[:2])[:120]}")
        raise RuntimeError(f"grading: {event} is not allowed in submitted code")

    return hook


def confine_worker():
    """Confine a worker process that ``course.parallel.launch`` started from the learner's process
    (lesson 10): the same seal over the guarded modules and the same audit hook as that process,
    installed before the worker imports any learner code. Learner code here is any frame whose
    file is outside the standard library, the Python environment, the course package and this
    folder (the worker modules are written by the learner's cells). Returns ``report()``: the
    ``(flag, detail)`` pairs seen, the seal checked once more, for the launcher to send back."""
    import course.parallel  # noqa: F401 - what the worker runs is guarded from here on
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    seccomp = _load("seccomp")  # no memory shared with another rank, no write the kernel does not count
    if seccomp.worker_program() is not None:
        seccomp.install(seccomp.worker_program())

    import course
    roots = {os.path.dirname(os.path.dirname(os.path.realpath(course.__file__))),
             os.path.dirname(os.path.dirname(os.path.abspath(course.__file__))),
             os.path.dirname(os.path.realpath(__file__)), os.path.dirname(os.path.abspath(__file__)),
             os.path.realpath(sys.prefix), sys.prefix, os.path.realpath(sys.base_prefix), sys.base_prefix}
    trusted = tuple(r.rstrip(os.sep) + os.sep for r in roots if r and r != os.sep)
    seen: list = []
    seal = Seal()
    state = {"busy": False}

    def learner(frame) -> str | None:
        while frame is not None:
            path = frame.f_code.co_filename
            if path.startswith(STDLIB) or path.startswith("<"):
                frame = frame.f_back
                continue
            return None if path.startswith(trusted) else f"{os.path.basename(path)}:{frame.f_lineno}"
        return None

    sys.addaudithook(audit_hook(state, judging=lambda: True, caller=learner,
                                flag=lambda name, detail: seen.append((name, f"a worker, {detail}"[:300])),
                                guarded_type_ids=seal.type_ids()))

    def report() -> list:
        state["busy"] = True
        try:
            broken = seal.broken()
        finally:
            state["busy"] = False
        return seen + ([("tampered", "a worker: " + "; ".join(broken))] if broken else [])
    return report


def main() -> int:
    in_fd, out_fd, cells_dir, pkg_root, limits = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                                   sys.argv[4], sys.argv[5])
    serve_fds = (int(sys.argv[6]), int(sys.argv[7])) if len(sys.argv) > 7 else None  # from the judge, to it
    set_limits(limits)
    def receive():
        (size,) = protocol.HEADER.unpack(read_exact(in_fd, protocol.HEADER.size))
        return pickle.loads(read_exact(in_fd, size))

    setup = receive()
    alarm = protocol.Alarm()  # the parent's time limit (its handler is installed below, before "ready")
    channel = Channel(out_fd, setup["token"], in_fd=in_fd, alarm=alarm)
    del setup["token"]

    # Everything the checks use is imported before any learner code runs.
    os.environ.setdefault("MPLBACKEND", "Agg")
    os.environ["COURSE_SELF_CHECK_SKIP"] = "1"  # grader_hooks.SELF_CHECK_SKIP: the grader reads the tests
    import torch  # noqa: F401
    sys.path.insert(0, pkg_root)  # the grading checkout's course, not whichever one is installed
    import course
    import course.checks  # noqa: F401
    if not os.path.realpath(course.__file__).startswith(os.path.realpath(pkg_root) + os.sep):
        raise SystemExit(f"grading: imported course from {course.__file__}, not from {pkg_root}")
    from course.allocator import hold_process
    hold_process()  # C memory steady in this process, as in the judge's: fair timings
    import importlib
    import pkgutil

    for info in pkgutil.iter_modules(course.checks.__path__, "course.checks."):
        importlib.import_module(info.name)
    for info in pkgutil.iter_modules(course.__path__, "course."):
        if info.name not in ("course.__main__",):
            importlib.import_module(info.name)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401
    for name in setup.get("preload", ()):  # torch._dynamo where the instructor's notebook compiles
        importlib.import_module(name)
    import torch.fx  # noqa: F401
    import torch.func  # noqa: F401
    import torch.utils.benchmark  # noqa: F401

    import course.parallel
    os.environ[course.parallel.GUARD_ENV] = os.path.abspath(__file__)  # workers confine themselves
    worker_flags = course.parallel.WORKER_FLAGS

    state = {"cell": None, "learner": False, "records": 0, "busy": False}
    cell_prefix = os.path.realpath(cells_dir) + os.sep
    learner_prefix = cell_prefix + "learner_"
    LEARNER_FILES[0] = learner_prefix

    def flag(name: str, detail: str) -> None:
        channel.send("flag", name=name, detail=detail[:300], cell=(state["cell"] or {}).get("index"))

    def workers_saw() -> list[str]:
        """Flag what this cell's workers (lesson 10) saw; return their broken seals."""
        broken = []
        for item in list(worker_flags)[:20]:
            name, detail = (item if isinstance(item, (tuple, list)) and len(item) == 2 else ("tampered", repr(item)))
            if name == "tampered":
                broken.append(str(detail))
            else:
                flag(str(name), str(detail))
        worker_flags.clear()
        return broken

    def observer(actual, expected, tol):
        cell = state["cell"]
        if cell is None or cell["kind"] != "test":
            return
        channel.send("record", cell=cell["index"], n=state["records"], name=str(tol.get("name")),
                     actual=plain(actual), expected=plain(expected), tol=plain(tol))
        state["records"] += 1


    import contextlib

    def exclusive():
        """Ask the parent for the machine to ourselves, wait for its go, give it back after; in a
        test cell only. Every graded check is served (timed in the judge, which takes the turn
        itself), so what times here is a lesson's demonstration: no grade rests on it, and holding
        the machine for it paused every classmate graded beside it (lesson 8's demonstrations took
        the turn for a minute at a time). It runs beside them instead."""
        if (state["cell"] or {}).get("kind") != "test":
            return contextlib.nullcontext()
        # Not wrapped in a generator: one left suspended by an alarm would give the turn back whenever
        # it was collected, perhaps inside another frame's write (``protocol.Granted``).
        return channel.granted("speed_begin", "speed_end", "the timing turn", cell=state["cell"].get("index"))

    import course.grader_hooks as hooks
    import course.guard as guard

    hooks.install(observer=observer, exclusive=exclusive, learner_prefix=learner_prefix,
                  refused=lambda name, where: flag("uses-reference", f"{where} called the course's {name}"),
                  uninterrupted=alarm.uninterrupted, alarm=alarm.on_alarm)
    contract = hooks.installed()
    seal = Seal()

    def learner_caller(frame) -> str | None:
        """The learner file that triggered the event, if the nearest non-stdlib frame is one."""
        while frame is not None:
            path = frame.f_code.co_filename
            if path.startswith(STDLIB) or path.startswith("<frozen"):
                frame = frame.f_back
                continue
            return f"{os.path.basename(path)}:{frame.f_lineno}" if path.startswith(learner_prefix) else None
        return None

    sys.addaudithook(audit_hook(state, judging=lambda: state["learner"], caller=learner_caller, flag=flag,
                                guarded_type_ids=seal.type_ids()))

    alarm.install()  # the parent's time limit, felt inside a cell's code only
    channel.send("ready", seal_entries=sum(len(e) for _, e in seal.snapshot.values()))

    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    trusted: dict = {}  # names bound by instructor cells, restored before every test cell
    real_out, real_err = sys.stdout, sys.stderr
    tampered = False
    link = None
    if serve_fds is not None:
        from course.remote import Link, serve
        link = Link(serve_fds[1], serve_fds[0])
    for _ in range(setup["count"]):
        cell = receive()  # the parent sends a cell only once the one before it has ended
        if cell["kind"] == "serve":
            # A served test cell runs in the judge; this process answers its calls on the learner's
            # names (and sends nothing of its own for the cell).
            state["cell"], state["records"] = {"index": cell["index"], "kind": "served"}, 0
            state["learner"] = True
            sys.stdout = sys.stderr = io.StringIO()
            # An alarm while learner code runs is the reply to that call; one elsewhere in
            # serving leaves this process serving on.
            while link is not None and isinstance(alarm.run(serve, link, namespace), protocol.CellTimeout):
                continue
            channel.give_back()
            sys.stdout, sys.stderr = real_out, real_err
            # What a probe reported in this cell is this process's word: patching found now (done
            # while serving) is flagged against this cell, so that the parent can set it aside.
            state["busy"] = True
            try:
                broken = (seal.broken() if not tampered else []) + workers_saw()
            finally:
                state["busy"] = False
            if broken:
                tampered = True
                flag("tampered", "; ".join(broken))
            seal.take()
            continue
        learner = cell["kind"] in ("solution", "added")
        path = os.path.join(cells_dir, f"{'learner_' if learner else 'cell_'}{cell['index']:03d}.py")
        source = cell.pop("source")  # held by this loop alone: nothing the harness keeps reaches it
        with open(path, "w", encoding="utf-8") as fh:
            # A test cell's file stays empty: its source holds the hidden tests (the other cells are
            # in the student version anyway, and TorchScript reads functions' source from these files).
            fh.write("" if cell["kind"] == "test" else source)
        state["cell"], state["records"] = {"index": cell["index"], "kind": cell["kind"]}, 0
        if cell["kind"] == "test":
            # The names test cells use (checks, sizes) are the instructor cells' own, whatever a
            # learner's cell rebound them to since.
            namespace.update(trusted)
        before = dict(namespace) if not learner else None
        channel.send("cell_start", cell=cell["index"])
        buf = io.StringIO()
        sys.stdout = sys.stderr = buf
        error = ""
        start = time.monotonic()
        try:
            code, outcome = compile(source, path, "exec"), None
        except BaseException as exc:  # noqa: BLE001 - a syntax error is the cell's error
            code, outcome = None, exc
        del source
        state["learner"] = learner or cell["kind"] == "test" or state["learner"]
        if code is not None:
            outcome = alarm.run(exec, code, namespace)
            channel.give_back()  # a turn an alarm left held (``Channel.give_back``)
        sys.stdout, sys.stderr = real_out, real_err
        if isinstance(outcome, protocol.CellTimeout):
            error = f"TimeoutError: the cell ran longer than {setup['cell_timeout']:g} s and was interrupted"
        elif outcome is not None:  # a learner's SystemExit is a cell error too
            error = "".join(traceback.format_exception_only(type(outcome), outcome)).strip()
            tb = traceback.extract_tb(outcome.__traceback__)
            where = [f"{os.path.basename(f.filename)}:{f.lineno}" for f in tb if f.filename.startswith(cell_prefix)]
            if where:
                error += f"\n  (at {', '.join(where[-3:])})"
            del outcome, tb
        if before is not None and cell["kind"] != "test":
            trusted.update({k: v for k, v in namespace.items() if before.get(k, _MISSING) is not v})
        elif cell["kind"] == "solution":
            for name in cell.get("answers", ()):  # an answer's names are the learner's from here on
                trusted.pop(name, None)
        state["busy"] = True
        try:
            broken = (seal.broken() if not tampered else []) + workers_saw()
        finally:
            state["busy"] = False
        if hooks.installed() != contract or guard.reference.__module__ != "course.guard":
            broken = broken + ["the course/grader contract (course.grader_hooks, course.guard) was changed"]
        if broken:
            tampered = True
            flag("tampered", "; ".join(broken))
        seal.take()  # modules imported by this cell are guarded from now on
        out = buf.getvalue()
        channel.send("cell_end", cell=cell["index"], error=error[-protocol.MAX_ERROR_CHARS:],
                     output=out[-protocol.MAX_OUTPUT_CHARS:],
                     seconds=round(time.monotonic() - start, 3), records=state["records"],
                     tampered=tampered)
    state["cell"] = None
    channel.send("done")
    return 0


if __name__ == "__main__":
    protocol.end(main())

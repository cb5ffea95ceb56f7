"""Where a "by hand" answer is run again for the judge: a Python with its standard library alone.

Started by ``parent.py``, at the judge's first request, as
``python -I -S bare_host.py IN_FD OUT_FD CALL_FD REPLY_FD LIMITS``, confined as the learner's process
is (bubblewrap, a uid and memory group of its own, the submission's rlimits) with one difference
that is the point of it: its filesystem holds the interpreter and its standard library, and no
installed package. Every ``site-packages`` and ``dist-packages`` folder is hidden under an empty
one and the virtual environment is not mounted at all, so neither torch nor NumPy is there to
import, to load as a shared library, or to read (``parent._bwrap_argv``).

Some exercises ask for a rule worked out by hand: lesson 7's broadcasting rule, lesson 3's
strides. In the learner's process, "called no torch function" is what the course's watcher
reports, and a learner who forges from C can make it report anything. Here it is a fact of the
kernel's: the learner's answer (its ``def`` and what it needs, read from the notebook by the
course's probe, ``course.bare``) is executed in a fresh namespace and called on the judge's
inputs, and whatever computed the answers could not have been torch.

The judge sends requests on ``CALL_FD`` and reads replies on ``REPLY_FD``, JSON both ways
(``protocol.json_payload``), framed like every message of the grader. ``OUT_FD`` is never written.
This file imports nothing but the standard library and ``protocol.py`` (loaded by path).
"""

from __future__ import annotations

import __future__
import builtins
import importlib.util
import os
import signal
import sys

#: Longest text kept of an error or a description; most items in one returned value.
TEXT, ITEMS, DEPTH = 300, 20_000, 8


def _load_protocol():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "protocol.py")
    spec = importlib.util.spec_from_file_location("_grading_protocol", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plain(value, depth: int = 0, count: list | None = None):
    """``(value as JSON can carry it, True)`` (tuples become lists; dicts with string keys), or None
    when it is anything else."""
    count = count if count is not None else [0]
    count[0] += 1
    if depth > DEPTH or count[0] > ITEMS:
        return None
    if value is None or type(value) is bool:
        return value, True
    if type(value) is int:
        return (value, True) if abs(value) < 2**62 else None
    if type(value) is float:
        return (value, True) if value == value and abs(value) != float("inf") else None
    if type(value) is str:
        return (value, True) if len(value) <= 1000 else None
    if type(value) in (list, tuple):
        out = []
        for item in value:
            got = _plain(item, depth + 1, count)
            if got is None:
                return None
            out.append(got[0])
        return out, True
    if type(value) is dict:  # string keys only, as JSON has them (lesson 8's tables)
        table = {}
        for key, item in value.items():
            got = _plain(item, depth + 1, count)
            if type(key) is not str or len(key) > 1000 or got is None:
                return None
            table[key] = got[0]
        return table, True
    return None


def _describe(value) -> str:
    try:
        text = repr(value)
    except BaseException:  # noqa: BLE001 - a repr of the learner's own that fails
        text = "?"
    return f"{type(value).__name__}: {text[:TEXT]}"


def _outcome(fn, args: list) -> dict:
    try:
        got = fn(*args)
    except BaseException as exc:  # noqa: BLE001 - the answer's own exception is its outcome
        return {"raised": type(exc).__name__, "message": str(exc)[:TEXT]}
    plain = _plain(got)
    return {"value": plain[0]} if plain is not None else {"other": _describe(got)}


def run(request: dict) -> dict:
    """Execute the answer's program in a fresh namespace and call ``name`` on every case."""
    source, name, cases = request.get("source"), request.get("name"), request.get("cases")
    if not (isinstance(source, str) and isinstance(name, str) and isinstance(cases, list)
            and all(isinstance(c, list) for c in cases)):
        return {"error": "a malformed request"}
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        # Annotations stay text (``Tuple[int, ...]`` needs no import to define the function).
        code = compile(source, "<your notebook>", "exec", flags=__future__.annotations.compiler_flag,
                       dont_inherit=True)
        exec(code, namespace)
    except BaseException as exc:  # noqa: BLE001 - the program's own failure is the answer's
        return {"error": f"{type(exc).__name__}: {str(exc)[:TEXT]}"}
    fn = namespace.get(name)
    if not callable(fn):
        return {"error": f"the program defines no function {name}"}
    return {"outcomes": [_outcome(fn, [_tuples(arg) for arg in case]) for case in cases]}


def _tuples(value):
    """JSON's lists as the tuples they were (the inputs are shapes and strides)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def main() -> int:
    call_fd, reply_fd, limits = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    signal.signal(signal.SIGALRM, signal.SIG_IGN)  # the cell's time limit is the judge's to feel
    protocol = _load_protocol()
    protocol.set_limits(limits)
    sys.stdout = sys.stderr = open(os.devnull, "w")  # what the answer prints is heard nowhere
    while True:
        try:
            head = protocol.read_exact(call_fd, protocol.HEADER.size)
        except EOFError:
            return 0
        (size,) = protocol.HEADER.unpack(head)
        if size > protocol.MAX_MESSAGE:
            return 1
        request = protocol.json_value(protocol.read_exact(call_fd, size))
        seq = request.get("seq") if isinstance(request, dict) else None
        reply = {"seq": seq, "ok": run(request) if isinstance(request, dict) and request.get("op") == "run"
                 else {"error": "a request of no known kind"}}
        payload = protocol.json_payload(reply)
        protocol.write_all(reply_fd, protocol.HEADER.pack(len(payload)) + payload)


if __name__ == "__main__":
    protocol_end = main()
    os._exit(protocol_end)

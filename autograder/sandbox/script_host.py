"""Where a learner's TorchScript runs for the judge: a process that holds nothing to read.

Started by ``parent.py``, at the judge's first request, as
``python -I script_host.py IN_FD OUT_FD CALL_FD REPLY_FD PKG_ROOT LIMITS``, confined exactly as the
learner's process is (bubblewrap, the course without its references, a uid of its own, the
submission's rlimits, its own memory group). A TorchScript archive is code the learner wrote, and
it can do in whatever process runs it what any TorchScript can: read a file by name
(``torch.from_file``) and raise its bytes as an error message, switch grad mode off, seed the
global generator, loop forever without ever returning to Python (so no Python time limit lands).
Run in the judge, it read the course's references and the grader's code into its own feedback
page. Here it runs beside nothing of the grader's: no reference, no instructor cell, no token,
no pipe to the parent (``OUT_FD`` is never written), and the judge's own time limit ends the
judge's wait for it, not the judge.

The judge sends each archive (``course.remote.local_script``) on ``CALL_FD`` and calls what it
loaded as it calls the learner's process (:func:`course.remote.serve`, data both ways, never
pickles); what comes back is outputs the judge compares, and what this process's trusted code
read off the loaded object (its TorchScript type and graph's ops).

It also defines the programs of answers by hand that need torch (lessons 1 and 9; ``course.hand``),
after the judge has read them: only the program's own code runs there, with the imports the judge
read and a short list of builtins, and the judge calls and watches it as it calls the learner's.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys


def _load_protocol():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "protocol.py")
    spec = importlib.util.spec_from_file_location("_grading_protocol", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    call_fd, reply_fd, pkg_root, limits = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
    signal.signal(signal.SIGALRM, signal.SIG_IGN)  # the cell's time limit is the judge's to feel
    _load_protocol().set_limits(limits)
    os.environ["COURSE_SELF_CHECK_SKIP"] = "1"
    sys.path.insert(0, pkg_root)
    import torch  # noqa: F401

    import course
    if not os.path.realpath(course.__file__).startswith(os.path.realpath(pkg_root) + os.sep):
        raise SystemExit(f"grading: imported course from {course.__file__}, not from {pkg_root}")
    from course.hand import guard_script_host
    from course.remote import Link, serve

    guard_script_host()

    serve(Link(reply_fd, call_fd), {}, host=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The grading sandbox: run a graded program in a fresh, confined process; collect evidence.

- ``parent.py``: starts the child (bubblewrap), owns its clocks and limits, reads its messages;
- ``child.py``: the script that runs the learner's program inside (never imports the grader);
  at a served test cell it answers the judge's calls instead (``course.remote.serve``);
- ``judge.py``: the trusted side of served checks, a second confined process that runs the
  instructor's set-up and served test cells, calling the learner's code across the boundary;
- ``script_host.py``: where a learner's TorchScript is loaded and run for the judge, confined as
  the learner's process is;
- ``bare_host.py``: where a learner's answer by hand runs again for the judge, in a Python with its
  standard library and no installed package (no torch to call); it speaks JSON with the judge;
- ``cgroup.py``, ``uids.py``: a cgroup and, as root, a host uid of its own for every process;
- ``seccomp.py``: the system calls every confined process is refused (new namespaces, kernel-held IPC);
- ``held.py``, ``memcg.py``: the memory the kernel holds for a sandbox outside its processes'
  resident count, read from outside, and the kernel's own count of it (a memory cgroup);
- ``protocol.py``: the one definition of the messages between them and their size limits (the
  judge/learner channel itself carries ``course.wire`` values, see ``course/remote.py``).
"""

from .parent import TURNS, CellReport, Outcome, bwrap_works, choose_sandbox, run_program, task_limit

__all__ = ["TURNS", "CellReport", "Outcome", "bwrap_works", "choose_sandbox", "run_program", "task_limit"]

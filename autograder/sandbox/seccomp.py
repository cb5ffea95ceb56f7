"""A seccomp filter for every confined process: no namespaces of its own, no kernel-held IPC.

Inside bubblewrap a learner's process can still start ``unshare -Urm`` (util-linux is among the
system folders the sandbox sees) and, in a user namespace of its own, mount a tmpfs or make a
network namespace. What it keeps there is out of the parent's sight: the files of a tmpfs mounted
over ``/tmp`` in a mount namespace of its own are not those the parent measures through
``/proc/<p>/root/tmp``, and the sockets of a network namespace of its own are not listed by the
``sock_diag`` socket the parent opened in the sandbox's (``held.py``). Nothing a lesson does needs a
namespace, so none may be made: ``unshare`` and ``clone`` with any ``CLONE_NEW*`` flag and
``setns`` fail with EPERM, ``clone3`` (whose flags a filter cannot read) with ENOSYS, on which the C
library falls back to ``clone``.

System V shared memory, message queues and semaphores, and POSIX message queues, are memory the
kernel keeps outside every process, in the sandbox's IPC namespace, until the sandbox ends: a
process that filled a 1.5 GB segment and detached from it (``ipcmk`` makes one; a Python without the
audit hook, started as a subprocess, fills it with ``ctypes``) held that much under a 1 GB cap, in
nobody's resident count, and was graded "ok". Nothing a lesson does uses them (PyTorch shares memory
through files and ``memfd``), so none may be made: ``shmget``, ``msgget``, ``semget`` and ``mq_open``
fail with EPERM. A system call of another ABI (i386's ``int 0x80`` on x86-64, whose ``ipc`` call
multiplexes all of System V's; x32) fails with ENOSYS.

bwrap loads the filter (``--seccomp FD``) just before it starts the process; every process started
from it inherits the filter. The program is classic BPF, assembled below for x86-64 and AArch64
(elsewhere there is no filter, and :func:`program` returns None).
"""

from __future__ import annotations

import errno
import platform
import struct

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
SYSCALLS = {"x86_64": {"clone": 56, "unshare": 272, "setns": 308, "clone3": 435,
                       "shmget": 29, "semget": 64, "msgget": 68, "mq_open": 240},
            "aarch64": {"clone": 220, "unshare": 97, "setns": 268, "clone3": 435,
                        "shmget": 194, "semget": 190, "msgget": 186, "mq_open": 180}}
#: Refused outright (EPERM): entering a namespace, and making kernel-held IPC objects.
REFUSED = ("setns", "shmget", "semget", "msgget", "mq_open")
#: CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID,
#: CLONE_NEWNET and CLONE_NEWTIME.
NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80
X32 = 0x40000000  # x32 system calls have this bit in their number

LD_ABS_W, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
ALLOW = 0x7FFF0000
ERRNO = 0x00050000


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def program(machine: str | None = None) -> bytes | None:
    """The filter for this machine's architecture (``sock_filter`` instructions), or None."""
    machine = machine or platform.machine()
    if machine not in AUDIT_ARCH:
        return None
    nr = SYSCALLS[machine]
    # (code, k, where to go if true, where to go if false): a label, or None for the next instruction
    ops: list[tuple] = [
        (LD_ABS_W, 4, None, None),                     # the ABI of the call
        (JEQ, AUDIT_ARCH[machine], None, "enosys"),    # another ABI: nothing
        (LD_ABS_W, 0, None, None),                     # the call's number
        (JGE, X32, "enosys", None),                    # x32
        (JEQ, nr["clone3"], "enosys", None),           # the C library falls back to clone
        *((JEQ, nr[name], "eperm", None) for name in REFUSED),
        (JEQ, nr["unshare"], "flags", None),
        (JEQ, nr["clone"], "flags", "allow"),
    ]
    labels = {"flags": len(ops)}
    ops += [(LD_ABS_W, 16, None, None),                # the flags (first argument, low half)
            (JSET, NAMESPACES, "eperm", "allow")]      # any new namespace
    labels.update(allow=len(ops), eperm=len(ops) + 1, enosys=len(ops) + 2)
    ops += [(RET, ALLOW, None, None), (RET, ERRNO | errno.EPERM, None, None), (RET, ERRNO | errno.ENOSYS, None, None)]

    def offset(at: int, label: str | None) -> int:  # a jump counts from the instruction after it
        return 0 if label is None else labels[label] - at - 1

    return b"".join(_op(code, k, offset(i, t), offset(i, f)) for i, (code, k, t, f) in enumerate(ops))

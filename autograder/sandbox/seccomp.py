"""A seccomp filter for every confined process: no namespaces of its own.

Inside bubblewrap a learner's process can still start ``unshare -Urm`` (util-linux is among the
system folders the sandbox sees) and, in a user namespace of its own, mount a tmpfs or make a
network namespace. What it keeps there is out of the parent's sight: the files of a tmpfs mounted
over ``/tmp`` in a mount namespace of its own are not those the parent measures through
``/proc/<p>/root/tmp``, and the sockets of a network namespace of its own are not listed by the
``sock_diag`` socket the parent opened in the sandbox's (``held.py``). Nothing a lesson does needs a
namespace, so none may be made: ``unshare`` and ``clone`` with any ``CLONE_NEW*`` flag and
``setns`` fail with EPERM, ``clone3`` (whose flags a filter cannot read) with ENOSYS, on which the C
library falls back to ``clone``; a system call of another ABI (i386's ``int 0x80`` on x86-64, x32)
fails with ENOSYS. bwrap loads the filter (``--seccomp FD``) just before it starts the process;
every process started from it inherits the filter.

The program is classic BPF, written out below for x86-64 and AArch64 (elsewhere there is no
filter, and :func:`program` returns None).
"""

from __future__ import annotations

import errno
import platform
import struct

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
SYSCALLS = {"x86_64": {"clone": 56, "unshare": 272, "setns": 308, "clone3": 435},
            "aarch64": {"clone": 220, "unshare": 97, "setns": 268, "clone3": 435}}
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
    ops = [
        _op(LD_ABS_W, 4),                              # 0: the ABI of the call
        _op(JEQ, AUDIT_ARCH[machine], jt=1),           # 1: ours: to 3
        _op(RET, ERRNO | errno.ENOSYS),                # 2: another ABI: nothing
        _op(LD_ABS_W, 0),                              # 3: the call's number
        _op(JGE, X32, jt=8),                           # 4: x32: to 13
        _op(JEQ, nr["clone3"], jt=7),                  # 5: to 13 (ENOSYS: the C library falls back to clone)
        _op(JEQ, nr["setns"], jt=5),                   # 6: to 12
        _op(JEQ, nr["unshare"], jt=1),                 # 7: to 9
        _op(JEQ, nr["clone"], jt=0, jf=2),             # 8: to 9, else to 11
        _op(LD_ABS_W, 16),                             # 9: the flags (first argument, low half)
        _op(JSET, NAMESPACES, jt=1),                   # 10: any new namespace: to 12
        _op(RET, ALLOW),                               # 11
        _op(RET, ERRNO | errno.EPERM),                 # 12
        _op(RET, ERRNO | errno.ENOSYS),                # 13
    ]
    return b"".join(ops)

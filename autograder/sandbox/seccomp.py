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
import os
import platform
import struct

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
SYSCALLS = {"x86_64": {"clone": 56, "unshare": 272, "setns": 308, "clone3": 435,
                       "shmget": 29, "semget": 64, "msgget": 68, "mq_open": 240,
                       "mmap": 9, "process_vm_readv": 310, "process_vm_writev": 311, "ptrace": 101,
                       "vmsplice": 278, "io_uring_setup": 425, "io_setup": 206, "symlink": 88, "symlinkat": 266,
                       "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190},
            "aarch64": {"clone": 220, "unshare": 97, "setns": 268, "clone3": 435,
                        "shmget": 194, "semget": 190, "msgget": 186, "mq_open": 180,
                        "mmap": 222, "process_vm_readv": 270, "process_vm_writev": 271, "ptrace": 117,
                        "vmsplice": 75, "io_uring_setup": 425, "io_setup": 0, "symlinkat": 36,
                        "setxattr": 5, "lsetxattr": 6, "fsetxattr": 7}}
#: Refused outright (EPERM): entering a namespace, and making kernel-held IPC objects.
REFUSED = ("setns", "shmget", "semget", "msgget", "mq_open")
#: Refused besides to lesson 10's workers (see :func:`worker_program`): reaching another process's
#: memory, and writing by routes the kernel's count of bytes written (``wchar``) does not see.
WORKER_REFUSED = ("process_vm_readv", "process_vm_writev", "ptrace", "vmsplice", "io_uring_setup", "io_setup",
                  "symlink", "symlinkat", "setxattr", "lsetxattr", "fsetxattr")
MAP_SHARED, MAP_ANONYMOUS = 0x01, 0x20  # the same on both architectures
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
    return _assemble(ops, labels)


def _assemble(ops: list[tuple], labels: dict[str, int]) -> bytes:
    """``ops`` followed by the three verdicts (labels ``allow``, ``eperm``, ``enosys``), as
    ``sock_filter`` instructions: each jump counted from the instruction after it."""
    labels = {**labels, "allow": len(ops), "eperm": len(ops) + 1, "enosys": len(ops) + 2}
    ops = [*ops, (RET, ALLOW, None, None), (RET, ERRNO | errno.EPERM, None, None),
           (RET, ERRNO | errno.ENOSYS, None, None)]

    def offset(at: int, label: str | None) -> int:
        return 0 if label is None else labels[label] - at - 1

    return b"".join(_op(code, k, offset(i, t), offset(i, f)) for i, (code, k, t, f) in enumerate(ops))


def worker_program(machine: str | None = None) -> bytes | None:
    """The filter lesson 10's workers add to the sandbox's (:func:`install`, before any learner code
    runs in them), or None where there is none. The ring all-reduce check counts what each rank
    wrote (the kernel's ``wchar``: files, pipes, gloo's sockets) and gives each rank inputs that only
    it holds, so that no rank can compute the sum without being sent the others' values. Memory
    shared through a file (``mmap`` with ``MAP_SHARED`` of a file or ``memfd``: ``torch.from_file(...,
    shared=True)``, ``numpy.memmap``, ``share_memory_()``) carries values between processes without a
    byte written, and so would another process's memory read or written directly, a pipe filled by
    ``vmsplice``, or asynchronous writes (``io_uring``, ``io_submit``): all fail with EPERM here; so do
    symbolic links and extended attributes, whose targets and values carry data no write counts (a
    rank passed its whole tensor in symlink targets; red team, 2026-12-01).
    Anonymous shared memory stays (a process and its own children), as do private file mappings
    (every shared library)."""
    machine = machine or platform.machine()
    if machine not in AUDIT_ARCH:
        return None
    nr = SYSCALLS[machine]
    ops: list[tuple] = [
        (LD_ABS_W, 4, None, None),
        (JEQ, AUDIT_ARCH[machine], None, "enosys"),
        (LD_ABS_W, 0, None, None),
        *((JEQ, nr[name], "eperm", None) for name in WORKER_REFUSED if name in nr),
        (JEQ, nr["mmap"], None, "allow"),
        (LD_ABS_W, 16 + 3 * 8, None, None),             # the flags (fourth argument, low half)
        (JSET, MAP_ANONYMOUS, "allow", None),
        (JSET, MAP_SHARED, "eperm", "allow"),            # MAP_SHARED and MAP_SHARED_VALIDATE
    ]
    return _assemble(ops, {})


def install(filter_program: bytes) -> None:
    """Load ``filter_program`` on this process (and what it starts from now on); it stacks on the
    sandbox's own, the stricter verdict winning. Raises ``OSError`` if the kernel refuses it."""
    import ctypes

    class _Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    buffer = ctypes.create_string_buffer(filter_program, len(filter_program))
    prog = _Prog(len(filter_program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    for args in ((pr_set_no_new_privs, 1, 0, 0, 0), (pr_set_seccomp, seccomp_mode_filter, ctypes.addressof(prog), 0, 0)):
        if libc.prctl(*(ctypes.c_ulong(a) for a in args)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"the seccomp filter could not be loaded: {os.strerror(err)}")

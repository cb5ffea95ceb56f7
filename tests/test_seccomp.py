"""The seccomp filter's decisions, read by a small classic-BPF interpreter for each architecture it
is assembled for (AArch64's cannot be loaded on this machine; the kernel's own verdicts on x86-64
are tested in tests/test_hostile_grading.py)."""

from __future__ import annotations

import errno
import struct

import pytest

from autograder.sandbox import seccomp as S

ALLOW, EPERM, ENOSYS = "allow", "EPERM", "ENOSYS"


def _run(program: bytes, nr: int, arch: int, arg0: int = 0, arg3: int = 0) -> str:
    """What the filter returns for one call (``struct seccomp_data``: nr, arch, ip, args)."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, arg0, 0, 0, arg3, 0, 0)
    ops = [struct.unpack_from("=HBBI", program, i) for i in range(0, len(program), 8)]
    acc, pc = 0, 0
    for _ in range(len(ops) + 1):  # classic BPF only jumps forward
        code, jt, jf, k = ops[pc]
        if code == S.LD_ABS_W:
            acc = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif code in (S.JEQ, S.JGE, S.JSET):
            hit = {S.JEQ: acc == k, S.JGE: acc >= k, S.JSET: bool(acc & k)}[code]
            pc += 1 + (jt if hit else jf)
        elif code == S.RET:
            if k == S.ALLOW:
                return ALLOW
            assert k & 0xFFFF0000 == S.ERRNO, hex(k)
            return {errno.EPERM: EPERM, errno.ENOSYS: ENOSYS}[k & 0xFFFF]
        else:
            raise AssertionError(f"unknown instruction {code:#x}")
    raise AssertionError("the program did not return")


THREAD = 0x3D0F00  # CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND | CLONE_THREAD | ... (pthread_create)
READ = {"x86_64": 0, "aarch64": 63}
MMAP = {"x86_64": 9, "aarch64": 222}


@pytest.mark.parametrize("machine", sorted(S.AUDIT_ARCH))
def test_the_filter_refuses_namespaces_and_kernel_held_ipc_and_allows_the_rest(machine):
    program, arch, nr = S.program(machine), S.AUDIT_ARCH[machine], S.SYSCALLS[machine]
    assert len(program) % 8 == 0 and len(program) // 8 < 64
    for call in (READ[machine], MMAP[machine]):
        assert _run(program, call, arch) == ALLOW
    assert _run(program, nr["clone"], arch, THREAD) == ALLOW          # threads and fork run
    assert _run(program, nr["clone"], arch, 0x11) == ALLOW            # fork: SIGCHLD
    assert _run(program, nr["unshare"], arch, 0x200) == ALLOW         # CLONE_FS only: no namespace
    for flag in (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x80):
        assert _run(program, nr["clone"], arch, THREAD | flag) == EPERM, hex(flag)
        assert _run(program, nr["unshare"], arch, flag) == EPERM, hex(flag)
    for name in ("setns", "shmget", "semget", "msgget", "mq_open"):
        assert _run(program, nr[name], arch) == EPERM, name
    assert _run(program, nr["clone3"], arch) == ENOSYS
    other = next(a for m, a in S.AUDIT_ARCH.items() if m != machine)
    assert _run(program, READ[machine], 0x40000003) == ENOSYS          # i386
    assert _run(program, READ[machine], other) == ENOSYS
    if machine == "x86_64":
        assert _run(program, S.X32 | READ[machine], arch) == ENOSYS


def test_no_filter_where_none_is_written():
    assert S.program("riscv64") is None


@pytest.mark.parametrize("machine", sorted(S.AUDIT_ARCH))
def test_lesson_10s_workers_share_no_memory_by_file_and_reach_no_other_process(machine):
    """The filter a worker adds (``worker_program``): memory shared through a file, another process's
    memory, vmsplice, asynchronous writes, symbolic links and extended attributes refused (each
    carries data the kernel's count of bytes written does not see); anonymous and private mappings,
    and every other call, allowed."""
    program, arch, nr = S.worker_program(machine), S.AUDIT_ARCH[machine], S.SYSCALLS[machine]
    assert len(program) % 8 == 0 and len(program) // 8 < 64
    shared, private, anonymous = S.MAP_SHARED, 0x02, S.MAP_ANONYMOUS
    assert _run(program, nr["mmap"], arch, arg3=shared) == EPERM                  # a file, shared
    assert _run(program, nr["mmap"], arch, arg3=0x03) == EPERM                    # MAP_SHARED_VALIDATE
    assert _run(program, nr["mmap"], arch, arg3=shared | anonymous) == ALLOW      # a process and its children
    assert _run(program, nr["mmap"], arch, arg3=private) == ALLOW                 # every shared library
    assert _run(program, nr["mmap"], arch, arg3=private | anonymous) == ALLOW     # malloc
    for name in S.WORKER_REFUSED:
        if name in nr:
            assert _run(program, nr[name], arch) == EPERM, name
    assert _run(program, READ[machine], arch) == ALLOW
    assert _run(program, nr["clone"], arch, THREAD) == ALLOW
    other = next(a for m, a in S.AUDIT_ARCH.items() if m != machine)
    assert _run(program, READ[machine], other) == ENOSYS

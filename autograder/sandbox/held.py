"""Memory the kernel holds for a sandbox outside its processes' resident count.

The memory cap is a poll of the learner's process tree (``parent.py``): each process's resident
memory (``statm``). A sandbox can make the kernel hold memory that is in no process's count, and
each of these, tried under a 1 GB cap, was graded "ok":

- files in its writable folders, ``/tmp`` and ``/grading``, which are tmpfs, kept in memory
  (1.5 GB written, 402 MB resident);
- anonymous memory files (``os.memfd_create``), written and never mapped (1.8 GB);
- data sent into sockets that nobody reads: a pair of unix sockets queues up to 8 MB
  (``SO_SNDBUF``), so 200 pairs held 1.6 GB of the machine's memory; with the thousands of
  descriptors a process may open, enough to take the machine's memory from everyone on it.

:class:`Held` reads each from outside, every time the parent looks at the memory:

- the tmpfs folders' use, through the root of a process inside (``/proc/<p>/root``, ``statvfs``;
  files deleted while still open included), each file's inode too (a million empty files hold a
  gigabyte of the kernel's memory and no block);
- the memory files any process of the tree has open (``/proc/<p>/fd``, each file once); a tree
  holding more than :data:`MAX_FDS` descriptors in all (each process may have 4,096, and a fork
  copies them) is too many to look through, and is ended like one over the cap;
- the bytes queued in the sandbox's sockets, unix and TCP/UDP, as the kernel's ``sock_diag``
  reports them, asked from inside the sandbox's network namespace (a thread of the parent enters
  it to open the netlink socket: this needs root; elsewhere sockets are not counted, and the
  descriptor limit, :data:`FDS`, bounds them). A unix sender's buffers count at their true size
  (its write queue). What a sender that has closed left in a receiver shows there only as payload
  bytes (a 1-byte message takes a kilobyte), so such a receiver counts as the most one sender can
  queue; a listening socket, that much for each connection waiting; a datagram receiver with data
  from no listed sender, as much as its queue holds.

Whatever it counts is added to the resident memory before comparing with the cap.
What only the kernel refers to (a memory file passed over a unix socket and closed, pipe buffers)
is not found here; a memory cgroup counts it where one can be made (``memcg.py``).
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading

from ..proc import descendants

#: Descriptors a learner's process may have open (RLIMIT_NOFILE; lower if the grader's own is).
FDS = 4096
#: The most descriptors a sandbox's processes may hold in all (each look examines every one).
MAX_FDS = 65536

CLONE_NEWNET = 0x40000000
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
UDIAG_SHOW_PEER, UDIAG_SHOW_RQLEN = 0x04, 0x10
UNIX_DIAG_PEER, UNIX_DIAG_RQLEN = 2, 4
DGRAM_QUEUE = 11  # datagrams a unix receiver queues: net.unix.max_dgram_qlen (10 by default), and one more
LISTEN = 10  # TCP_LISTEN: a listening socket's queue lengths count connections, not bytes
SCRATCH = ("/tmp", "/grading")
#: What the kernel keeps for each file of a tmpfs beside its data: its inode and name (1.0 KB of slab
#: measured for an empty file; a long name adds up to 256 bytes).
INODE_BYTES = 1536


class TooManyFiles(Exception):
    """The sandbox holds more descriptors than the parent will look through."""


def _mnt_ns(pid: int | str) -> int:
    return os.stat(f"/proc/{pid}/ns/mnt").st_ino


class Held:
    """What the kernel holds for the sandbox of the process tree under ``root`` (a bwrap process)."""

    def __init__(self, root: int):
        self.root = root
        self._ours = _mnt_ns("self")
        self._inside: int | None = None
        self._diag: socket.socket | None = None
        self._diag_tried = False
        self._seq = 0

    def close(self) -> None:
        if self._diag is not None:
            self._diag.close()
            self._diag = None

    def _find_inside(self, tree: list[int]) -> int | None:
        """A process of the sandbox (another mount namespace than the parent's): not found by its
        name, which a learner can change (``/proc/self/comm``)."""
        if self._inside is not None and self._inside in tree:
            return self._inside
        self._inside = None
        for p in tree:
            try:
                if _mnt_ns(p) != self._ours:
                    self._inside = p
                    break
            except OSError:
                continue
        return self._inside

    def bytes(self, tree: list[int] | None = None) -> dict[str, int]:
        """Bytes held now: ``files`` (tmpfs folders), ``memory files`` (memfd), ``sockets``. ``tree``:
        the processes under the root as the caller just listed them (the root first), or None to
        list them here."""
        tree = tree if tree is not None else [self.root, *descendants(self.root)]
        inside = self._find_inside(tree)
        out = {"files": 0, "memory files": 0, "sockets": 0}
        if inside is None:
            return out
        out["files"] = _scratch_bytes(inside)
        memfd = _memfd_bytes(tree)
        if memfd < 0:
            raise TooManyFiles(f"held more than {MAX_FDS:,} open files in all across its processes: too many "
                               "to count what they hold")
        out["memory files"] = memfd
        if not self._diag_tried:
            self._diag_tried = True
            self._diag = _diag_socket(inside)
        if self._diag is not None:
            try:
                out["sockets"] = self._socket_bytes()
            except OSError:
                self.close()
        return out

    def _ask(self, family: int, payload: bytes) -> list[bytes]:
        """The replies (their payloads after the netlink header) to one sock_diag dump request."""
        self._seq += 1
        header = struct.pack("=IHHII", 16 + len(payload), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP,
                             self._seq, 0)
        sock = self._diag
        sock.send(header + payload)
        messages: list[bytes] = []
        sock.settimeout(0.5)
        while True:
            data = sock.recv(1 << 16)
            offset = 0
            while offset + 16 <= len(data):
                length, kind, _, seq, _ = struct.unpack_from("=IHHII", data, offset)
                if length < 16:
                    return messages
                if seq == self._seq:
                    if kind == NLMSG_DONE:
                        return messages
                    if kind == NLMSG_ERROR:
                        return messages
                    messages.append(data[offset + 16:offset + length])
                offset += (length + 3) & ~3

    def _socket_bytes(self) -> int:
        total = 0
        worst = _worst_queue()
        # Unix sockets. A sender's queued buffers are charged to it at their true size (its write
        # queue). What a sender that has closed left in a receiver's queue shows only as payload
        # bytes there (1 byte can take a kilobyte), so such a receiver is charged the most one sender
        # can queue; a listening socket, the most for each connection waiting to be accepted; a
        # datagram receiver with data from no listed peer, the most its queue can hold.
        req = struct.pack("=BBHIIIII", socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, UDIAG_SHOW_PEER | UDIAG_SHOW_RQLEN,
                          0xFFFFFFFF, 0xFFFFFFFF)
        found = []
        for msg in self._ask(socket.AF_UNIX, req):
            if len(msg) < 16:
                continue
            kind, state, ino = msg[1], msg[2], struct.unpack_from("=I", msg, 4)[0]
            rqueue = wqueue = peer = 0
            offset = 16
            while offset + 4 <= len(msg):
                length, attr = struct.unpack_from("=HH", msg, offset)
                if length < 4:
                    break
                if attr == UNIX_DIAG_RQLEN and length >= 12:
                    rqueue, wqueue = struct.unpack_from("=II", msg, offset + 4)
                elif attr == UNIX_DIAG_PEER and length >= 8:
                    peer = struct.unpack_from("=I", msg, offset + 4)[0]
                offset += (length + 3) & ~3
            found.append((ino, kind, state, rqueue, wqueue, peer))
        live = {f[0] for f in found}
        for ino, kind, state, rqueue, wqueue, peer in found:
            if state == LISTEN:
                total += rqueue * worst
                continue
            total += wqueue
            if rqueue and peer not in live:
                total += worst * (DGRAM_QUEUE if kind == socket.SOCK_DGRAM else 1)
        # TCP and UDP over the sandbox's loopback: bytes waiting in receive and send queues (a
        # connection waiting to be accepted is listed with its own).
        for family in (socket.AF_INET, socket.AF_INET6):
            for proto in (socket.IPPROTO_TCP, socket.IPPROTO_UDP):
                req = struct.pack("=BBBBI", family, proto, 0, 0, 0xFFFFFFFF) + bytes(48)
                for msg in self._ask(family, req):
                    if len(msg) >= 64 and msg[1] != LISTEN:
                        rqueue, wqueue = struct.unpack_from("=II", msg, 56)
                        total += rqueue + wqueue
        return total


def _worst_queue() -> int:
    """The most one socket can have queued as a sender: twice ``net.core.wmem_max`` (the kernel
    doubles what SO_SNDBUF asks, up to that)."""
    try:
        with open("/proc/sys/net/core/wmem_max") as fh:
            return 2 * int(fh.read())
    except (OSError, ValueError):
        return 2 * 4 * 2**20


def _scratch_bytes(inside: int) -> int:
    """What the files in the sandbox's tmpfs folders hold (open files already deleted included)."""
    seen, total = set(), 0
    own = _tmpfs_mounts(inside)
    host = _host_devs()
    for folder in SCRATCH:
        try:
            where = f"/proc/{inside}/root{folder}"
            dev = os.stat(where).st_dev
            # Counted only once it is the sandbox's: a tmpfs mounted at that folder as the process
            # inside sees its own root, on no device the host has mounted. While bwrap sets up, the
            # folder can be the host's (/tmp), or reach the host's filesystems another way (CI met
            # /grading there: 56 GB "written" by a submission 0.04 s old, graded oom).
            if (dev in seen or own.get(folder) != dev or dev in host
                    or dev in {_host_dev(folder), _host_dev("/"), _host_dev("/tmp")}):
                continue
            seen.add(dev)
            st = os.statvfs(where)
        except OSError:
            continue
        # every file, folder or link, empty or not, also takes an inode and a name in the kernel's
        # own memory: about a kilobyte (measured), which no block count shows
        total += (st.f_blocks - st.f_bfree) * st.f_frsize + (st.f_files - st.f_ffree) * INODE_BYTES
    return total


def _mounts(pid: int | str) -> list[tuple[int, str, str]]:
    """``pid``'s mounts as it sees them: (device, mount point relative to its root, file system type),
    in mount order (a later mount at the same point covers an earlier one)."""
    out = []
    try:
        with open(f"/proc/{pid}/mountinfo") as fh:
            for line in fh:
                fields = line.split()
                try:
                    major, minor = fields[2].split(":")
                    fstype = fields[fields.index("-") + 1]
                    out.append((os.makedev(int(major), int(minor)), fields[4], fstype))
                except (ValueError, IndexError):
                    continue
    except OSError:
        pass
    return out


def _tmpfs_mounts(pid: int) -> dict[str, int]:
    """The device of the mount at each of ``pid``'s mount points where it is a tmpfs (the topmost)."""
    top: dict[str, tuple[int, str]] = {}
    for dev, point, fstype in _mounts(pid):
        top[point] = (dev, fstype)
    return {point: dev for point, (dev, fstype) in top.items() if fstype == "tmpfs"}


def _host_devs() -> set[int]:
    """Every device mounted where the grader runs: none of them is a sandbox's own tmpfs."""
    return {dev for dev, _, _ in _mounts("self")}


def _host_dev(folder: str) -> int | None:
    try:
        return os.stat(folder).st_dev
    except OSError:
        return None


def _descriptor_slots(tree: list[int]) -> int:
    """The descriptor table sizes of ``tree``'s processes, summed (``FDSize``: at least the open ones)."""
    total = 0
    for p in tree:
        try:
            with open(f"/proc/{p}/status") as fh:
                total += next((int(line.split()[1]) for line in fh if line.startswith("FDSize:")), 0)
        except (OSError, ValueError, IndexError):
            continue
    return total


def _memfd_bytes(tree: list[int]) -> int:
    """What the memory files open in ``tree``'s processes hold, each file counted once; -1 when the
    tree holds more than :data:`MAX_FDS` descriptors in all, too many to look through (a learner
    could hide a memory file behind them)."""
    if _descriptor_slots(tree) > MAX_FDS:
        return -1
    seen, total = set(), 0
    for p in tree:
        try:
            names = os.listdir(f"/proc/{p}/fd")
        except OSError:
            continue
        for name in names:
            path = f"/proc/{p}/fd/{name}"
            try:
                if not os.readlink(path).startswith("/memfd:"):
                    continue
                st = os.stat(path)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def _diag_socket(inside: int) -> socket.socket | None:
    """A sock_diag netlink socket in the network namespace of process ``inside``, opened by a thread
    that enters that namespace (``setns`` moves the calling thread only) and then ends; None where
    this grader may not enter it (not root)."""
    if os.geteuid() != 0:
        return None
    found: list = []

    def enter_and_open() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/proc/{inside}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    return
            finally:
                os.close(fd)
            found.append(socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                                       NETLINK_SOCK_DIAG))
        except OSError:
            pass

    thread = threading.Thread(target=enter_and_open, name="sock-diag-netns")
    thread.start()
    thread.join()
    return found[0] if found else None

"""Does FUSE over io_uring pay for this daemon? A standalone probe (issue 23).

`python -m benchmarks.fuse_uring_probe [--rounds 3]` (root; Linux 6.14+ with
CONFIG_FUSE_IO_URING): mounts a trivial in-memory filesystem twice per round and serves it
with the same Python request handler, once through the classic /dev/fuse transport (one
blocking read(2) per request, one writev(2) per reply) and once through FUSE over io_uring
(per-CPU queues of ring entries, each reply committed with FUSE_IO_URING_CMD_COMMIT_AND_FETCH,
which also fetches the next request: one io_uring_enter per batch). Each mount runs three
workloads from this process:

- `stat`: os.stat of existing files with entry and attribute timeouts of 0, so each stat is
  three requests, LOOKUP and GETATTRs (the metadata shape: lookups and getattrs);
- `create`: open(O_CREAT|O_EXCL) + close of new files (CREATE, FLUSH, RELEASE);
- `read`: sequential 1 MiB read() of files served from memory, page cache dropped by each
  open, the mount's read-ahead at 1 MiB: 1 MiB READs, the cold-read shape without S3.

Per workload it reports the requests the daemon served, the daemon's CPU time per request
(all its threads, /proc/PID/task/*/schedstat: user + kernel, so the kernel's copies of
requests and replies count where they run) and the wall time per request, and the ratios
io_uring / /dev/fuse within each round, with their medians, as a Markdown table.

Daemon shapes: `--loop plain` (default) is a synchronous loop with a minimal handler, where
the transport's share of the work, and so any gain from changing it, is the largest it can
be; `--loop trio` serves each request in a trio task as the native session does (eventfd
registered with the ring; commits batched per loop turn, or with `--taskrun direct` entered
by each task itself). `--clients N` runs stat and create in N processes at once (requests
in flight at the same time, so that io_uring can batch); `--read-in-place` has READ copy
its data once into the reply buffer both ways (the cache-file shape) instead of answering
from memory (the S3 shape, where io_uring adds a copy into the ring entry).

`/sys/module/fuse/parameters/enable_uring` is set to Y for the io_uring mounts and put back
to what it was at the end. Throwaway quality: the ring code here is the probe's own; only
uring/ would own it in the daemon.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import mmap
import multiprocessing
import os
import select
import shutil
import signal
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import trio

from lakefs_mount.fuse.native import device, wire
from lakefs_mount.ops.mountpoint import set_kernel_readahead
from lakefs_mount.uring import _sys

ENABLE_URING = Path("/sys/module/fuse/parameters/enable_uring")
OVER_IO_URING = 1 << 41  # FUSE_OVER_IO_URING, bit 9 of flags2
CMD_REGISTER = 1
CMD_COMMIT_AND_FETCH = 2
SETUP_SQE128 = 1 << 10
OP_POLL_ADD = 6
OP_URING_CMD = 46
URING_HEADER = 128 + 128 + 32  # in_out, op_in, fuse_uring_ent_in_out
CMD_REQ = struct.Struct("<QQH6x")  # flags commit_id qid
SQE128_HEAD = struct.Struct("<BBHiIIQIIQHHI")  # opcode flags ioprio fd cmd_op pad addr len
#                                               op_flags user_data buf_index personality fi
COMMIT_ID_SIZE = struct.Struct("<QI")  # commit_id payload_sz, at 264 in the header block
COMMIT_SQE = struct.Struct("<II")  # cmd_op pad, at 8 in the SQE
U32, U64 = struct.Struct("<I"), struct.Struct("<Q")
POLL_TAG = 1 << 62
# io_uring set-up flags tried for the daemon's own ring (--taskrun)
TASKRUN = {"plain": 0, "coop": (1 << 8) | (1 << 9),  # COOP_TASKRUN | TASKRUN_FLAG
           "defer": (1 << 12) | (1 << 13)}  # SINGLE_ISSUER | DEFER_TASKRUN
MiB = 1 << 20
PAGE = mmap.PAGESIZE
MAX_PAGES = 256

# the size of each opcode's fixed header (in_args[0]): io_uring hands it in `op_in`, the
# rest (names, data) in the payload; /dev/fuse sends both back to back after the header
OP_HEADER: dict[int, int] = {
             wire.Op.GETATTR: 16, wire.Op.OPEN: 8, wire.Op.READ: 40, wire.Op.RELEASE: 24,
             wire.Op.FLUSH: 24, wire.Op.CREATE: 16, wire.Op.GETXATTR: 8,
             wire.Op.OPENDIR: 8, wire.Op.RELEASEDIR: 24, wire.Op.SETATTR: 88,
             wire.Op.ACCESS: 8, wire.Op.FORGET: 8, wire.Op.INTERRUPT: 8}


class MemFS:
    """Root directory with `files` files of `size` bytes each; new files are empty. The
    same handler serves both transports: (opcode, nodeid, fixed header, rest) -> reply."""

    def __init__(self, files: int, size: int, in_place: bool) -> None:
        self.size = size
        self.in_place = in_place
        self.block = memoryview(bytes(range(256)) * (MiB // 256))
        self.names = {f"f{i}".encode(): 2 + i for i in range(files)}
        self.sizes = {2 + i: size for i in range(files)}
        self.next_ino = 2 + files

    def attr(self, ino: int) -> bytes:
        if ino == 1:
            return wire.pack_attr(1, 0, 0, 0, 0, 0o40755, 2, 0, 0, 0, 4096)
        size = self.sizes[ino]
        return wire.pack_attr(ino, size, (size + 511) // 512, 0, 0, 0o100644, 1, 0, 0, 0,
                              4096)

    def entry(self, ino: int) -> bytes:
        return wire.ENTRY_OUT_HEAD.pack(ino, 0, 0, 0, 0, 0) + self.attr(ino)

    def handle(self, op: int, nodeid: int, head: memoryview, rest: memoryview,
               out: memoryview) -> tuple[int, list[bytes | memoryview]]:
        """`out`: where a READ may produce its data (the ring entry's payload, or a reply
        buffer for /dev/fuse), as a read from a cache file would; with `in_place` off,
        READ answers with the memory it holds, as the reply of an S3 GET would."""
        if op == wire.Op.LOOKUP:
            ino = self.names.get(bytes(rest).split(b"\0", 1)[0])
            return (errno.ENOENT, []) if ino is None else (0, [self.entry(ino)])
        if op == wire.Op.GETATTR:
            return 0, [wire.ATTR_OUT_HEAD.pack(0, 0, 0), self.attr(nodeid)]
        if op == wire.Op.OPEN:
            return 0, [wire.OPEN_OUT.pack(nodeid, 0, 0)]
        if op == wire.Op.READ:
            _, offset, size, _ = wire.READ_IN.unpack_from(head)
            n = max(0, min(size, self.sizes[nodeid] - offset, MiB))
            if self.in_place:
                out[:n] = self.block[:n]
                return 0, [out[:n]]
            return 0, [self.block[:n]]
        if op == wire.Op.CREATE:
            name = bytes(rest).split(b"\0", 1)[0]
            if name in self.names:
                return errno.EEXIST, []
            ino = self.next_ino
            self.next_ino += 1
            self.names[name] = ino
            self.sizes[ino] = 0
            return 0, [self.entry(ino), wire.OPEN_OUT.pack(ino, 0, 0)]
        if op in (wire.Op.FLUSH, wire.Op.RELEASE, wire.Op.RELEASEDIR, wire.Op.ACCESS):
            return 0, []
        if op == wire.Op.OPENDIR:
            return 0, [wire.OPEN_OUT.pack(0, 0, 0)]
        return errno.ENOSYS, []


class Counters:
    """Requests served, by transport path, shared with the parent across fork."""

    def __init__(self) -> None:
        self.array = multiprocessing.RawArray(ctypes.c_uint64, 64)

    def total(self) -> int:
        return sum(self.array)


def _init_reply(fd: int, buf: bytes | bytearray, uring: bool) -> None:
    length, opcode, unique, *_ = wire.IN_HEADER.unpack_from(buf)
    assert opcode == wire.Op.INIT, opcode
    major, minor, readahead, flags, flags2 = wire.INIT_IN.unpack_from(buf, wire.IN_HEADER.size)
    offered = flags | flags2 << 32
    if uring and not offered & OVER_IO_URING:
        raise SystemExit("the kernel does not offer FUSE_OVER_IO_URING (enable_uring is N?)")
    wanted = (wire.ASYNC_READ | wire.BIG_WRITES | wire.PARALLEL_DIROPS | wire.MAX_PAGES
              | wire.INIT_EXT | (OVER_IO_URING if uring else 0))
    granted = wanted & offered
    out = wire.INIT_OUT.pack(7, wire.KERNEL_MINOR, readahead, granted & 0xFFFFFFFF, 0, 0,
                             MAX_PAGES * PAGE, 1, MAX_PAGES, 0, granted >> 32, 0, 0)
    os.writev(fd, [wire.OUT_HEADER.pack(16 + len(out), 0, unique), out])


def _send(fd: int, unique: int, err: int, parts: list[bytes | memoryview]) -> None:
    size = 16 + sum(len(p) for p in parts)
    try:
        os.writev(fd, [wire.OUT_HEADER.pack(size, -err, unique), *parts])
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENODEV):
            raise


def _dev_header(fd: int, view: memoryview, counts: Counters) -> tuple[int, int, int] | None:
    """(opcode, unique, nodeid) of the request read into `view`, counted; None for one
    answered here (INTERRUPT: not seen) or not at all (FORGET)."""
    _, op, unique, nodeid, *_ = wire.IN_HEADER.unpack_from(view)
    counts.array[op] += 1
    if op in (wire.Op.FORGET, wire.Op.BATCH_FORGET):
        return None
    if op == wire.Op.INTERRUPT:
        _send(fd, unique, errno.EAGAIN, [])
        return None
    return op, unique, nodeid


def _serve_dev_request(fs: MemFS, fd: int, view: memoryview, n: int, counts: Counters,
                       out: memoryview) -> None:
    head = _dev_header(fd, view, counts)
    if head is None:
        return
    op, unique, nodeid = head
    cut = wire.IN_HEADER.size + OP_HEADER.get(op, 0)
    err, parts = fs.handle(op, nodeid, view[wire.IN_HEADER.size:cut], view[cut:n], out)
    _send(fd, unique, err, parts)


def serve_dev(fs: MemFS, fd: int, counts: Counters) -> None:
    """Classic transport: one blocking read per request, one writev per reply."""
    os.set_blocking(fd, True)
    buf = bytearray(MAX_PAGES * PAGE + 64 * 1024)
    view = memoryview(buf)
    out = memoryview(bytearray(MAX_PAGES * PAGE))
    n = os.readv(fd, [buf])
    _init_reply(fd, buf[:n], uring=False)
    while True:
        try:
            n = os.readv(fd, [buf])
        except OSError as exc:
            if exc.errno in (errno.EINTR, errno.ENOENT):
                continue
            if exc.errno == errno.ENODEV:
                return
            raise
        _serve_dev_request(fs, fd, view, n, counts, out)


class Sqe128Ring:
    """An io_uring with 128-byte SQEs (IORING_SETUP_SQE128), as URING_CMD needs."""

    def __init__(self, entries: int, flags: int = 0) -> None:
        params = ctypes.create_string_buffer(_sys._PARAMS.size)
        struct.pack_into("<3I", params, 0, 0, 0,
                         SETUP_SQE128 | _sys.IORING_SETUP_CLAMP | flags)
        self.fd = _sys._check(_sys._syscall(ctypes.c_long(_sys.SYS_IO_URING_SETUP),
                                            ctypes.c_long(entries), params))
        p = _sys._PARAMS.unpack(params.raw)
        self.entries = p[0]
        cq_entries = p[1]
        sq_head, sq_tail, sq_mask, _, _, _, self.sq_array = p[10:17]
        cq_head, cq_tail, cq_mask, _, _, self.cqes = p[19:25]
        prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | mmap.MAP_POPULATE
        self.sq = mmap.mmap(self.fd, self.sq_array + self.entries * 4, flags, prot,
                            offset=_sys.IORING_OFF_SQ_RING)
        self.cq = mmap.mmap(self.fd, self.cqes + cq_entries * 16, flags, prot,
                            offset=_sys.IORING_OFF_CQ_RING)
        self.sqes = mmap.mmap(self.fd, self.entries * 128, flags, prot,
                              offset=_sys.IORING_OFF_SQES)
        self.sq_head, self.sq_tail_off, self.sq_mask = sq_head, sq_tail, \
            struct.unpack_from("<I", self.sq, sq_mask)[0]
        self.cq_head_off, self.cq_tail_off = cq_head, cq_tail
        self.cq_mask = struct.unpack_from("<I", self.cq, cq_mask)[0]
        self.tail = struct.unpack_from("<I", self.sq, sq_tail)[0]
        self.pending = 0
        self._fd_arg = ctypes.c_long(self.fd)
        enter = ctypes.CFUNCTYPE(ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_uint,
                                 ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_size_t,
                                 use_errno=True)(("syscall", _sys._libc))
        self._enter = lambda fd, n, wait, flags: enter(_sys.SYS_IO_URING_ENTER, fd, n, wait,
                                                       flags, None, 0)

    def put(self, opcode: int, fd: int, cmd_op: int, addr: int, length: int, op_flags: int,
            user_data: int, cmd: bytes = b"", slot: int | None = None) -> int:
        """Fill SQE `slot` (default: the next ring index's own) and queue it; returns
        the slot, which a caller may queue again later with `requeue`."""
        idx = self.tail & self.sq_mask if slot is None else slot
        base = idx * 128
        self.sqes[base:base + 128] = bytes(128)
        SQE128_HEAD.pack_into(self.sqes, base, opcode, 0, 0, fd, cmd_op, 0, addr, length,
                              op_flags, user_data, 0, 0, 0)
        self.sqes[base + 48:base + 48 + len(cmd)] = cmd
        self.requeue(idx)
        return idx

    def requeue(self, slot: int) -> None:
        """Queue the SQE already in `slot` (the SQ array maps ring positions to slots)."""
        U32.pack_into(self.sq, self.sq_array + (self.tail & self.sq_mask) * 4, slot)
        self.tail = (self.tail + 1) & 0xFFFFFFFF
        self.pending += 1

    def enter(self, wait: int) -> None:
        struct.pack_into("<I", self.sq, self.sq_tail_off, self.tail)
        while True:
            ret = self._enter(self._fd_arg, self.pending, wait,
                              _sys.IORING_ENTER_GETEVENTS if wait else 0)
            if ret >= 0:
                self.pending -= ret
                return
            err = ctypes.get_errno()
            if err != errno.EINTR:
                raise OSError(err, os.strerror(err))

    def completions(self) -> list[tuple[int, int]]:
        head = struct.unpack_from("<I", self.cq, self.cq_head_off)[0]
        tail = struct.unpack_from("<I", self.cq, self.cq_tail_off)[0]
        out = []
        while head != tail:
            user_data, res, _ = struct.unpack_from(
                "<QiI", self.cq, self.cqes + (head & self.cq_mask) * 16)
            out.append((user_data, res))
            head = (head + 1) & 0xFFFFFFFF
        struct.pack_into("<I", self.cq, self.cq_head_off, head)
        return out


class Entry:
    """One ring entry: its header block and its payload buffer, registered with the kernel."""

    def __init__(self, qid: int, payload_size: int) -> None:
        self.qid = qid
        self.header = mmap.mmap(-1, URING_HEADER)
        self.payload = mmap.mmap(-1, payload_size)
        self.header_view = memoryview(self.header)
        self.payload_view = memoryview(self.payload)
        self._pins = [ctypes.c_char.from_buffer(self.header),
                      ctypes.c_char.from_buffer(self.payload)]
        iov = (ctypes.c_uint64 * 4)(ctypes.addressof(self._pins[0]), URING_HEADER,
                                    ctypes.addressof(self._pins[1]), payload_size)
        self.iov = iov
        self.iov_address = ctypes.addressof(iov)


def _uring_setup(fd: int, depth: int, flags: int) -> tuple[Sqe128Ring, list[Entry], int]:
    """INIT on /dev/fuse (offering io_uring), then REGISTER `depth` entries on each
    possible CPU's queue (the kernel routes a request to the queue of the CPU its caller
    runs on, and uses the ring once every queue has an entry) and a POLL_ADD on /dev/fuse,
    which still carries FORGET and INTERRUPT. Returns the ring, its entries (entry i owns
    SQE slot i) and the poll's slot."""
    os.set_blocking(fd, True)
    buf = bytearray(MAX_PAGES * PAGE + 64 * 1024)
    n = os.readv(fd, [buf])
    _init_reply(fd, buf[:n], uring=True)
    os.set_blocking(fd, False)
    with open("/sys/devices/system/cpu/possible") as f:
        queues = int(f.read().strip().split("-")[-1].split(",")[-1]) + 1
    entries = [Entry(q, MAX_PAGES * PAGE) for q in range(queues) for _ in range(depth)]
    ring = Sqe128Ring(len(entries) + 2, flags)
    for i, ent in enumerate(entries):
        ring.put(OP_URING_CMD, fd, CMD_REGISTER, ent.iov_address, 2, 0, i,
                 CMD_REQ.pack(0, 0, ent.qid), slot=i)
    poll_slot = len(entries)
    ring.put(OP_POLL_ADD, fd, 0, 0, 0, select.POLLIN, POLL_TAG, slot=poll_slot)
    return ring, entries, poll_slot


def _check_res(user_data: int, res: int) -> bool:
    """False when a CQE says the connection is gone; raises on any other error."""
    if res in (-errno.ENOTCONN, -errno.ECANCELED, -errno.ENODEV):
        return False
    if res < 0:
        raise OSError(-res, f"FUSE ring entry {user_data}: {os.strerror(-res)}")
    return True


def _uring_request(ent: Entry) -> tuple[int, int, int, int, memoryview, memoryview]:
    """(opcode, unique, nodeid, commit_id, fixed header, rest) of the entry's request."""
    _, op, unique, nodeid, *_ = wire.IN_HEADER.unpack_from(ent.header)
    commit_id, payload_sz = COMMIT_ID_SIZE.unpack_from(ent.header, 264)
    return (op, unique, nodeid, commit_id, ent.header_view[128:128 + OP_HEADER.get(op, 0)],
            ent.payload_view[:payload_sz])


def _uring_commit(ring: Sqe128Ring, slot: int, ent: Entry, unique: int, commit_id: int,
                  err: int, parts: list[bytes | memoryview]) -> None:
    """Put the reply into the entry and queue its COMMIT_AND_FETCH."""
    size = 0
    for part in parts:
        if not (isinstance(part, memoryview) and part.obj is ent.payload):
            ent.payload_view[size:size + len(part)] = part
        size += len(part)
    wire.OUT_HEADER.pack_into(ent.header, 0, 16 + size, -err, unique)
    U32.pack_into(ent.header, 272, size)  # fuse_uring_ent_in_out.payload_sz
    # the slot holds this entry's REGISTER, or its last commit: commit commit_id
    COMMIT_SQE.pack_into(ring.sqes, slot * 128 + 8, CMD_COMMIT_AND_FETCH, 0)
    U64.pack_into(ring.sqes, slot * 128 + 56, commit_id)
    ring.requeue(slot)


def serve_uring(fs: MemFS, fd: int, counts: Counters, depth: int, taskrun: str) -> None:
    """FUSE over io_uring in a plain loop: one io_uring_enter submits the commits of the
    last batch and waits for the next requests."""
    ring, entries, poll_slot = _uring_setup(fd, depth, TASKRUN[taskrun])
    view = memoryview(bytearray(MAX_PAGES * PAGE + 64 * 1024))
    while True:
        ring.enter(1)
        for user_data, res in ring.completions():
            if user_data == POLL_TAG:
                if _drain_dev(fs, fd, view, counts):
                    return
                ring.requeue(poll_slot)
                continue
            if not _check_res(user_data, res):
                return
            ent = entries[user_data]
            op, unique, nodeid, commit_id, head, rest = _uring_request(ent)
            counts.array[op] += 1
            err, parts = fs.handle(op, nodeid, head, rest, ent.payload_view)
            _uring_commit(ring, user_data, ent, unique, commit_id, err, parts)


async def serve_dev_trio(fs: MemFS, fd: int, counts: Counters) -> None:
    """/dev/fuse as the native session reads it: non-blocking reads in the trio loop,
    the request's arguments copied out, a task per request, writev of the reply."""
    buf = bytearray(MAX_PAGES * PAGE + 64 * 1024)
    view = memoryview(buf)
    out = memoryview(bytearray(MAX_PAGES * PAGE))
    os.set_blocking(fd, True)
    n = os.readv(fd, [buf])
    _init_reply(fd, buf[:n], uring=False)
    os.set_blocking(fd, False)

    async def one(op: int, unique: int, nodeid: int, arg: bytes) -> None:
        await trio.lowlevel.checkpoint()  # the real handler awaits the file system
        cut = OP_HEADER.get(op, 0)
        err, parts = fs.handle(op, nodeid, memoryview(arg)[:cut], memoryview(arg)[cut:], out)
        _send(fd, unique, err, parts)

    async with trio.open_nursery() as nursery:
        while True:
            try:
                n = os.readv(fd, [buf])
            except BlockingIOError:
                await trio.lowlevel.wait_readable(fd)
                continue
            except OSError as exc:
                if exc.errno in (errno.EINTR, errno.ENOENT):
                    continue
                if exc.errno == errno.ENODEV:
                    nursery.cancel_scope.cancel()
                    return
                raise
            head = _dev_header(fd, view, counts)
            if head is not None:
                nursery.start_soon(one, *head, bytes(view[wire.IN_HEADER.size:n]))
            await trio.lowlevel.checkpoint()


async def serve_uring_trio(fs: MemFS, fd: int, counts: Counters, depth: int,
                           direct: bool) -> None:
    """FUSE over io_uring in the trio loop: an eventfd (registered with the ring) wakes
    the loop, a task per request fills its entry, and the commits queued during a loop
    turn go to the kernel in one io_uring_enter."""
    ring, entries, poll_slot = _uring_setup(fd, depth, 0)
    ring.enter(0)
    efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    arg = ctypes.c_int32(efd)
    _sys._check(_sys._syscall(ctypes.c_long(_sys.SYS_IO_URING_REGISTER), ctypes.c_long(ring.fd),
                              ctypes.c_long(_sys.IORING_REGISTER_EVENTFD), ctypes.byref(arg),
                              ctypes.c_long(1)))
    view = memoryview(bytearray(MAX_PAGES * PAGE + 64 * 1024))

    wake = [trio.Event()]

    async def one(user_data: int) -> None:
        ent = entries[user_data]
        op, unique, nodeid, commit_id, head, rest = _uring_request(ent)
        counts.array[op] += 1
        await trio.lowlevel.checkpoint()  # the real handler awaits the file system
        err, parts = fs.handle(op, nodeid, head, rest, ent.payload_view)
        _uring_commit(ring, user_data, ent, unique, commit_id, err, parts)
        if direct:  # its own io_uring_enter: no hop through the submitter task
            ring.enter(0)
        else:
            wake[0].set()

    async def submitter() -> None:
        """One io_uring_enter for all the commits queued during a loop turn."""
        while True:
            await wake[0].wait()
            wake[0] = trio.Event()
            ring.enter(0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(submitter)
        while True:
            done = ring.completions()
            if not done:
                await trio.lowlevel.wait_readable(efd)
                try:
                    os.eventfd_read(efd)
                except BlockingIOError:
                    pass
                continue
            for user_data, res in done:
                if user_data == POLL_TAG:
                    if _drain_dev(fs, fd, view, counts):
                        nursery.cancel_scope.cancel()
                        return
                    ring.requeue(poll_slot)
                    wake[0].set()
                    continue
                if not _check_res(user_data, res):
                    nursery.cancel_scope.cancel()
                    return
                nursery.start_soon(one, user_data)
            await trio.lowlevel.checkpoint()


def _drain_dev(fs: MemFS, fd: int, view: memoryview, counts: Counters) -> bool:
    """Serve what /dev/fuse holds (FORGET, INTERRUPT); True once the connection is gone."""
    while True:
        try:
            n = os.readv(fd, [view])
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno in (errno.EINTR, errno.ENOENT):
                continue
            if exc.errno == errno.ENODEV:
                return True
            raise
        counts.array[63] += 1  # requests that came through /dev/fuse after the ring was up
        _serve_dev_request(fs, fd, view, n, counts, view)


def _daemon(mode: str, mnt: str, counts: Counters, files: int, size: int, depth: int,
            taskrun: str, in_place: bool, loop: str) -> None:
    fs = MemFS(files, size, in_place)
    fd = device.open_device()
    device.mount(fd, Path(mnt), fsname="uringprobe", subtype="uringprobe", allow_other=False,
                 read_only=False)
    if mode == "uring" and loop == "trio":
        trio.run(serve_uring_trio, fs, fd, counts, depth, taskrun == "direct")
    elif mode == "uring":
        serve_uring(fs, fd, counts, depth, taskrun)
    elif loop == "trio":
        trio.run(serve_dev_trio, fs, fd, counts)
    else:
        serve_dev(fs, fd, counts)


def _cpu_ns(pid: int) -> int:
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError):
            pass
    return total


def _user_sys(pid: int) -> tuple[float, float]:
    """User and kernel CPU seconds of all of `pid`'s threads (clock ticks)."""
    user = kernel = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        user += int(fields[11])
        kernel += int(fields[12])
    tick = os.sysconf("SC_CLK_TCK")
    return user / tick, kernel / tick


def _in_clients(clients: int, work: Callable[[int], object]) -> None:
    """Run work(k) in `clients` processes at once (one: in this process)."""
    if clients == 1:
        work(0)
        return
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=work, args=(k,)) for k in range(clients)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            raise SystemExit(f"a client failed with exit status {proc.exitcode}")


def _wl_stat(mnt: str, files: int, reps: int, clients: int) -> None:
    def work(_: int) -> None:
        for _ in range(reps // clients):
            for i in range(files):
                os.stat(f"{mnt}/f{i}")
    _in_clients(clients, work)


def _wl_create(mnt: str, count: int, tag: str, clients: int) -> None:
    def work(k: int) -> None:
        for i in range(count // clients):
            os.close(os.open(f"{mnt}/n{tag}-{k}-{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY,
                             0o644))
    _in_clients(clients, work)


def _wl_read(mnt: str, files: int) -> int:
    total = 0
    buf = bytearray(MiB)
    for i in range(files):
        with open(f"{mnt}/f{i}", "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


def _measure(mode: str, args: argparse.Namespace, base: Path, rnd: int) -> dict[str, dict]:
    mnt = base / f"mnt-{mode}"
    mnt.mkdir(exist_ok=True)
    counts = Counters()
    proc = multiprocessing.get_context("fork").Process(
        target=_daemon, args=(mode, str(mnt), counts, args.files, args.mib * MiB, args.depth,
                                  args.taskrun, args.read_in_place, args.loop))
    proc.start()
    pid = proc.pid
    assert pid is not None
    out: dict[str, dict] = {}
    try:
        deadline = time.monotonic() + 10
        while not os.path.ismount(mnt):
            if time.monotonic() > deadline or not proc.is_alive():
                raise SystemExit(f"{mode}: mount did not come up")
            time.sleep(0.01)
        os.stat(mnt)  # INIT answered (and, with io_uring, the ring registered)
        set_kernel_readahead(mnt, 1024)
        workloads = [
            ("stat", lambda: _wl_stat(str(mnt), args.files, args.stat_reps, args.clients)),
            ("create", lambda: _wl_create(str(mnt), args.creates, str(rnd), args.clients)),
            ("read", lambda: _wl_read(str(mnt), args.files)),
        ]
        for name, work in workloads:
            req0, cpu0, us0 = counts.total(), _cpu_ns(pid), _user_sys(pid)
            t0 = time.perf_counter()
            work()
            wall = time.perf_counter() - t0
            time.sleep(0.05)  # RELEASEs are sent asynchronously
            requests = counts.total() - req0
            us1 = _user_sys(pid)
            out[name] = {"requests": requests, "wall": wall,
                         "daemon_cpu": (_cpu_ns(pid) - cpu0) / 1e9,
                         "user": us1[0] - us0[0], "sys": us1[1] - us0[1],
                         "via_dev": counts.array[63]}
    finally:
        device.unmount(mnt)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--files", type=int, default=8, help="files for stat and read")
    parser.add_argument("--mib", type=int, default=64, help="size of each file read")
    parser.add_argument("--stat-reps", type=int, default=1500)
    parser.add_argument("--creates", type=int, default=4000)
    parser.add_argument("--clients", type=int, default=1,
                        help="processes running stat and create at once")
    parser.add_argument("--taskrun", choices=sorted(TASKRUN) + ["direct"], default="plain",
                        help="how the daemon's ring runs the kernel's completion work (plain "
                             "loop); with --loop trio, `direct` has each request task enter "
                             "the ring itself instead of batching commits per loop turn")
    parser.add_argument("--read-in-place", action="store_true",
                        help="READ data copied once into the reply buffer both ways (the "
                             "cache-file shape) instead of answered from memory")
    parser.add_argument("--loop", choices=["plain", "trio"], default="plain",
                        help="the daemon's loop: synchronous, or trio with a task per "
                             "request as the native session")
    parser.add_argument("--depth", type=int, default=8, help="ring entries per queue")
    args = parser.parse_args()
    if (args.taskrun == "direct") != (args.loop == "trio") and args.taskrun != "plain":
        parser.error("--taskrun direct goes with --loop trio; coop and defer with --loop plain")
    if os.geteuid() != 0:
        raise SystemExit("fuse_uring_probe: needs root (mount(2), sysfs); run it as root")
    if not ENABLE_URING.exists():
        raise SystemExit(f"fuse_uring_probe: {ENABLE_URING} missing: this kernel has no "
                         "FUSE over io_uring (6.14+, CONFIG_FUSE_IO_URING)")
    before = ENABLE_URING.read_text().strip()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("fuse_uring_probe: terminated"))
    base = Path(tempfile.mkdtemp(prefix="uringprobe-"))
    ratios: dict[str, dict[str, list[float]]] = {}
    per_req: dict[tuple[str, str], dict[str, list[float]]] = {}
    try:
        ENABLE_URING.write_text("Y\n")
        for rnd in range(args.rounds):
            order = ["dev", "uring"] if rnd % 2 == 0 else ["uring", "dev"]
            got = {mode: _measure(mode, args, base, rnd) for mode in order}
            for wl in got["dev"]:
                line = [f"round {rnd} {wl:6}"]
                for mode in ("dev", "uring"):
                    r = got[mode][wl]
                    n = r["requests"]
                    line.append(f"{mode}: {n} req, {r['daemon_cpu'] / n * 1e6:6.1f} us cpu/req "
                                f"(user/sys {r['user']:.2f}/{r['sys']:.2f} s), "
                                f"{r['wall'] / n * 1e6:6.1f} us wall/req")
                    per = per_req.setdefault((wl, mode), {"cpu": [], "wall": []})
                    per["cpu"].append(r["daemon_cpu"] / n * 1e6)
                    per["wall"].append(r["wall"] / n * 1e6)
                print("  ".join(line), flush=True)
                d, u = got["dev"][wl], got["uring"][wl]
                rs = ratios.setdefault(wl, {"cpu": [], "wall": []})
                rs["cpu"].append((u["daemon_cpu"] / u["requests"])
                                 / (d["daemon_cpu"] / d["requests"]))
                rs["wall"].append(u["wall"] / d["wall"])
                if u["requests"] != d["requests"]:
                    print(f"  note: {wl} made {d['requests']} requests through /dev/fuse, "
                          f"{u['requests']} through io_uring")
            print(f"  (requests through /dev/fuse with the ring up: "
                  f"{got['uring']['read']['via_dev']})")
    finally:
        ENABLE_URING.write_text(f"{before}\n")
        shutil.rmtree(base, ignore_errors=True)
    print(f"\n{vars(args)}\n")
    print("| shape | daemon CPU us/request, /dev/fuse | io_uring | ratio (per round) "
          "| wall ratio (per round) |")
    print("|---|---:|---:|---|---|")
    med = statistics.median
    for wl, rs in ratios.items():
        dev, uring = per_req[(wl, "dev")], per_req[(wl, "uring")]
        print(f"| {wl} | {med(dev['cpu']):.1f} | {med(uring['cpu']):.1f} "
              f"| **{med(rs['cpu']):.2f}** ({', '.join(f'{x:.2f}' for x in rs['cpu'])}) "
              f"| {med(rs['wall']):.2f} ({', '.join(f'{x:.2f}' for x in rs['wall'])}) |")


if __name__ == "__main__":
    main()

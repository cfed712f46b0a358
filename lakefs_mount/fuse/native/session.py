"""The native FUSE session: reads kernel requests from /dev/fuse in the trio loop, hands
each to `KernelOps` in a task of its own, and writes the replies.

Why not libfuse: Debian's libfuse 3.14 (and pyfuse3 over it) can negotiate neither
passthrough nor requests over 128 KiB pages of its own buffer; the kernel (6.9+) can do
both, and the protocol is a few structs (`wire.py`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import trio

from lakefs_mount.config import FSTYPE_NAME
from lakefs_mount.filespan import FileSpan
from lakefs_mount.fuse.native import device, wire
from lakefs_mount.fuse.native.ops import SENT, KernelOps, Reply, Sent
from lakefs_mount.fuse.native.splicereply import SplicedReplies
from lakefs_mount.fuse.native.wire import Request
from lakefs_mount.metrics import Latencies

log = logging.getLogger(__name__)

# 1 MiB requests (capped by fs.fuse.max_pages_limit, read at start; it sizes the request
# buffers). Larger ones, where root raised the limit, do not make a cold restore faster.
MAX_PAGES = 256
# A user's mount keeps the kernel's 128 KiB read-ahead (raising it is root's, in sysfs);
# under it, reads run faster as 128 KiB READs, several in flight, than as 1 MiB ones.
# Writes stay at MAX_PAGES.
USER_MAX_READ = 128 * 1024
HEADROOM = 64 * 1024  # the read buffer must exceed the largest WRITE by its headers
KEEP_BUFFERS = 16  # request buffers kept between requests (more are made while needed)
# Requests a kernel sends that this filesystem does not implement get ENOSYS, which the
# kernel turns into EOPNOTSUPP for the caller or a fallback of its own (lseek, copy).
NO_REPLY = (wire.Op.FORGET, wire.Op.BATCH_FORGET)
# What --allow-root still serves to other users, as libfuse's allow_root: requests on what
# they already hold open (a descriptor passed to them), and the kernel's own.
OPEN_TO_OTHERS = frozenset({wire.Op.INIT, wire.Op.READ, wire.Op.WRITE, wire.Op.FSYNC,
                            wire.Op.RELEASE, wire.Op.READDIR, wire.Op.FSYNCDIR,
                            wire.Op.RELEASEDIR, wire.Op.NOTIFY_REPLY, wire.Op.READDIRPLUS,
                            wire.Op.FORGET, wire.Op.BATCH_FORGET, wire.Op.INTERRUPT,
                            wire.Op.DESTROY})
# opcode -> the `operation` label of its latency (an opcode this kernel made up: "other")
OP_NAMES = {op.value: op.name.lower() for op in wire.Op}


class _Buffers:
    """Request buffers: an 80-byte head and a page-aligned body, so that the bytes of a
    WRITE land aligned for O_DIRECT. Only a WRITE keeps its buffer while it is served."""

    def __init__(self, body_size: int) -> None:
        self.body_size = body_size
        self._free: list[tuple[bytearray, mmap.mmap]] = []

    def take(self) -> tuple[bytearray, mmap.mmap]:
        if self._free:
            return self._free.pop()
        return bytearray(wire.WRITE_DATA_OFFSET), mmap.mmap(-1, self.body_size)

    def give_back(self, buf: tuple[bytearray, mmap.mmap]) -> None:
        if len(self._free) < KEEP_BUFFERS:
            self._free.append(buf)


class NativeSession:
    """One FUSE connection mounted at `mountpoint` and served by `ops`."""

    name = "native"

    def __init__(self, ops: KernelOps, mountpoint: Path, *, allow_other: bool,
                 read_only: bool, probe_dir: Path, source: str = FSTYPE_NAME,
                 allow_root: bool = False) -> None:
        self.ops = ops
        self.mountpoint = mountpoint
        self.source = source  # what mount(8) shows as the source
        # allow_root: the kernel lets everyone in (allow_other) and requests of users other
        # than root and the mounter are refused here, as libfuse does
        self.allow_other = allow_other or allow_root
        self.deny_others = allow_root and not allow_other
        self.read_only = read_only
        self.probe_dir = probe_dir
        self.fd = -1
        self._fd_lock = threading.Lock()
        self.max_pages = min(MAX_PAGES, device.max_pages_limit())
        self.max_write = self.max_pages * mmap.PAGESIZE
        self.passthrough = False
        self.passthrough_reason = "not negotiated yet"
        self.proto_minor = 0
        self.max_read = self.max_write  # (a user's mount: USER_MAX_READ, see `mount`)
        self.spliced_replies: SplicedReplies | None = None  # (made at `mount`)
        self.spliced_reads_reason = "not mounted yet"  # why read replies are copied
        self._buffers = _Buffers(self.max_write + HEADROOM)
        self._cancel = trio.CancelScope()
        # requests being served, by unique: the cancel scope of each interruptible one
        self._in_flight: dict[int, trio.CancelScope | None] = {}
        self.latencies = Latencies()  # from a request's task start to its reply sent

    async def mount(self) -> None:
        """Open a connection and mount it (as root by mount(2), else through fusermount3);
        the kernel's INIT is answered by `serve`. DeviceError says why the native session
        cannot run here."""
        self.fd = await trio.to_thread.run_sync(lambda: device.connect(
            self.mountpoint, fsname=self.source, subtype=FSTYPE_NAME,
            allow_other=self.allow_other, read_only=self.read_only,
            user_max_read=USER_MAX_READ))
        self.ops.attach(self)
        if not device.privileged():
            self.max_read = min(self.max_write, USER_MAX_READ)
            log.info("FUSE session: native for uid %d without CAP_SYS_ADMIN (mounted through "
                     "fusermount3, no passthrough); `auto` keeps it for a user's mount: it "
                     "serves writes through the daemon as pyfuse3 does, and it answers "
                     "interrupts", os.getuid())
        self.spliced_replies, self.spliced_reads_reason = SplicedReplies.open(self.max_read)
        if self.spliced_replies is None:
            log.info("read replies are copied, not spliced: %s", self.spliced_reads_reason)

    async def serve(self) -> None:
        """Serve requests until the mount goes away (or `terminate`)."""
        with self._cancel:
            async with trio.open_nursery() as nursery:
                try:
                    await self._read_loop(nursery)
                finally:
                    nursery.cancel_scope.cancel()

    @property
    def spliced_reads(self) -> bool:
        return self.spliced_replies is not None

    def terminate(self) -> None:
        self._cancel.cancel()

    def close(self, unmount: bool) -> None:
        if self.fd < 0:
            return
        if unmount:
            try:
                device.unmount(self.mountpoint)
            except OSError as exc:
                log.warning("%s", exc)
        self.ops.detach()
        if self.spliced_replies is not None:
            self.spliced_replies.close()
            self.spliced_replies = None
        with self._fd_lock:
            os.close(self.fd)
            self.fd = -1

    async def _read_loop(self, nursery: trio.Nursery) -> None:
        while True:
            buf = self._buffers.take()
            head, body = buf
            try:
                n = os.readv(self.fd, [head, body])
            except BlockingIOError:
                self._buffers.give_back(buf)
                await trio.lowlevel.wait_readable(self.fd)
                continue
            except OSError as exc:
                self._buffers.give_back(buf)
                if exc.errno in (errno.EINTR, errno.ENOENT):  # ENOENT: interrupted meanwhile
                    continue
                if exc.errno == errno.ENODEV:  # unmounted: the clean end
                    return
                raise
            req = _parse(head, body, n)
            if req.opcode == wire.Op.INTERRUPT:
                self._buffers.give_back(buf)
                self._interrupt(req)
            else:
                # registered before its task runs: an INTERRUPT read next finds it
                scope = trio.CancelScope() if self.ops.interruptible(req) else None
                self._in_flight[req.unique] = scope
                if req.data is None:
                    self._buffers.give_back(buf)
                    nursery.start_soon(self._serve_one, req, None, scope)
                else:
                    nursery.start_soon(self._serve_one, req, buf, scope)
            await trio.lowlevel.checkpoint()

    async def _serve_one(self, req: Request, buf: tuple[bytearray, mmap.mmap] | None,
                         scope: trio.CancelScope | None) -> None:
        started = time.perf_counter()
        try:
            if req.opcode == wire.Op.INIT:
                self._init(req)
                return
            reply: Reply = errno.EACCES
            if not self._refused(req):
                with scope or contextlib.nullcontext():
                    reply = await self.ops.dispatch(req)
            if scope is not None and scope.cancelled_caught:
                reply = errno.EINTR  # the one reply of an interrupted request
        finally:
            del self._in_flight[req.unique]
            req.data = None
            if buf is not None:
                self._buffers.give_back(buf)
        if req.opcode not in NO_REPLY and reply is not SENT:
            self.reply(req.unique, reply)
        self.latencies.observe(OP_NAMES.get(req.opcode, "other"),
                               time.perf_counter() - started)

    def _refused(self, req: Request) -> bool:
        """--allow-root: a request of a user other than root and the mounter."""
        return (self.deny_others and req.uid not in (0, os.getuid())
                and req.opcode not in OPEN_TO_OTHERS)

    def _interrupt(self, req: Request) -> None:
        """FUSE_INTERRUPT: the process waiting for request `unique` got a signal (or was
        killed, and waits for the reply in D state). An interruptible request is
        cancelled and answers EINTR, unless it finishes first; one that may not stop
        halfway (`KernelOps.interruptible`) runs to its end and the interrupt is
        dropped. A request not seen (already answered, or not yet read: the kernel's
        rules allow an INTERRUPT to overtake it) gets EAGAIN, which has the kernel send
        the INTERRUPT again if the request is still waiting, and is ignored otherwise."""
        (unique,) = wire.INTERRUPT_IN.unpack_from(req.arg)
        if unique not in self._in_flight:
            self.reply(req.unique, errno.EAGAIN)
            return
        scope = self._in_flight[unique]
        log.debug("interrupt of request %d: %s", unique,
                  "cancelled" if scope is not None else "runs to its end")
        if scope is not None:
            scope.cancel()

    def reply(self, unique: int, reply: Reply) -> None:
        """Send a reply: an int is an errno (0: success with no data), else the payload."""
        assert not isinstance(reply, Sent)
        if isinstance(reply, int):
            self._write([wire.OUT_HEADER.pack(wire.OUT_HEADER.size, -reply, unique)])
            return
        parts: Sequence[bytes | memoryview] = (reply,) if not isinstance(reply, list) \
            else reply
        size = wire.OUT_HEADER.size + sum(len(p) for p in parts)
        self._write([wire.OUT_HEADER.pack(size, 0, unique), *parts])

    def send_span(self, unique: int, span: FileSpan) -> bool:
        """Reply with the bytes of `span`, spliced (see `SplicedReplies.send`)."""
        assert self.spliced_replies is not None
        return self.spliced_replies.send(self.fd, unique, span)

    async def notify_from_thread(self, code: wire.Notify,
                                 parts: list[bytes | memoryview]) -> bool:
        """Send a notification from a worker thread; True once the kernel took it.

        Never from the loop: the kernel holds the write until it can lock what the
        notification touches (the pages of a STORE or INVAL_INODE, the directory of an
        INVAL_ENTRY), and the request that holds that lock (a READ of those pages, a
        LOOKUP in that directory) is answered by this loop. Written from the loop, that
        wait never ends (a STORE of a file's pages at its open, for one). Cancelled,
        the caller stops waiting and the thread finishes on its own."""
        return await trio.to_thread.run_sync(self._notify_blocking, code, parts,
                                             abandon_on_cancel=True)

    def _notify_blocking(self, code: wire.Notify, parts: list[bytes | memoryview]) -> bool:
        with self._fd_lock:  # a duplicate: `close` may run while this thread waits
            if self.fd < 0:
                return False
            fd = os.dup(self.fd)
        size = wire.OUT_HEADER.size + sum(len(p) for p in parts)
        try:
            os.writev(fd, [wire.OUT_HEADER.pack(size, code, 0), *parts])
            return True
        except OSError as exc:  # ENOENT: the inode or name is not cached; ENODEV: gone
            if exc.errno not in (errno.ENOENT, errno.ENODEV):
                log.warning("FUSE notification %s not sent: %s", code.name, exc)
            return False
        finally:
            os.close(fd)

    def invalidate_inode(self, ino: int) -> None:
        """Blocking (`KernelCaches`): the kernel drops the attributes and cached pages
        of `ino`."""
        self._notify_blocking(wire.Notify.INVAL_INODE,
                              [wire.NOTIFY_INVAL_INODE.pack(ino, 0, 0)])

    def invalidate_entry(self, parent: int, name: bytes) -> None:
        """Blocking (`KernelCaches`): the kernel forgets the name `name` in `parent`."""
        self._notify_blocking(wire.Notify.INVAL_ENTRY, [
            wire.NOTIFY_INVAL_ENTRY.pack(parent, len(name), 0), name + b"\0"])

    def _write(self, parts: list[bytes | memoryview]) -> None:
        try:
            os.writev(self.fd, parts)
        except OSError as exc:
            # ENOENT: the request was interrupted and is gone; ENODEV: unmounted meanwhile
            if exc.errno not in (errno.ENOENT, errno.ENODEV):
                raise

    def _init(self, req: Request) -> None:
        major, minor, max_readahead, flags, flags2 = wire.INIT_IN.unpack_from(req.arg)
        offered = flags | (flags2 << 32 if flags & wire.INIT_EXT else 0)
        if major != wire.KERNEL_MAJOR or minor < 31:
            log.error("kernel speaks FUSE %d.%d; the native session needs 7.31+", major, minor)
            self.reply(req.unique, errno.EPROTO)
            return
        self.proto_minor = min(minor, wire.KERNEL_MINOR)
        wanted = (wire.ASYNC_READ | wire.ATOMIC_O_TRUNC | wire.EXPORT_SUPPORT
                  | wire.BIG_WRITES | wire.AUTO_INVAL_DATA | wire.DO_READDIRPLUS
                  | wire.ASYNC_DIO | wire.PARALLEL_DIROPS | wire.MAX_PAGES | wire.INIT_EXT
                  | wire.PASSTHROUGH)
        granted = wanted & offered
        if not granted & wire.PASSTHROUGH:
            self.passthrough_reason = "the kernel does not offer FUSE passthrough"
        stack_depth = 1 if granted & wire.PASSTHROUGH else 0
        self.reply(req.unique, [wire.INIT_OUT.pack(
            wire.KERNEL_MAJOR, self.proto_minor, max_readahead, granted & 0xFFFFFFFF, 0, 0,
            self.max_write, 1, self.max_pages, 0, granted >> 32, stack_depth, 0)])
        if granted & wire.PASSTHROUGH:
            self._probe_passthrough()
        log.info("native FUSE session: protocol 7.%d, %s, passthrough %s",
                 self.proto_minor, f"{self.max_write // 1024} KiB requests"
                 if self.max_read == self.max_write else
                 f"{self.max_write // 1024} KiB writes, {self.max_read // 1024} KiB reads",
                 "on" if self.passthrough else f"off ({self.passthrough_reason})")

    def _probe_passthrough(self) -> None:
        """The kernel may accept the INIT and still refuse every backing file (EPERM
        without CAP_SYS_ADMIN, or a cache filesystem it cannot stack on): try one."""
        try:
            fd = os.open(self.probe_dir, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            self.passthrough_reason = f"no probe file in {self.probe_dir}: {exc.strerror}"
            return
        try:
            backing_id = device.backing_open(self.fd, fd)
            device.backing_close(self.fd, backing_id)
            self.passthrough = True
        except OSError as exc:
            self.passthrough_reason = f"the kernel refused a backing file: {exc.strerror}"
            if exc.errno == errno.EPERM and not device.privileged():
                self.passthrough_reason = (
                    f"the kernel lends backing files only to a daemon with CAP_SYS_ADMIN, and "
                    f"this one runs as uid {os.getuid()} without it; mount as root for "
                    f"passthrough")
        finally:
            os.close(fd)


def _parse(head: bytearray, body: mmap.mmap, n: int) -> Request:
    length, opcode, unique, nodeid, uid, gid, pid, _, _ = wire.IN_HEADER.unpack_from(head)
    if opcode == wire.Op.WRITE and n >= wire.WRITE_DATA_OFFSET:
        return Request(opcode, unique, nodeid, uid, gid, pid,
                       bytes(head[wire.IN_HEADER.size:]),
                       memoryview(body)[:n - wire.WRITE_DATA_OFFSET])
    arg = bytes(head[wire.IN_HEADER.size:min(n, wire.WRITE_DATA_OFFSET)])
    if n > wire.WRITE_DATA_OFFSET:
        arg += body[:n - wire.WRITE_DATA_OFFSET]
    return Request(opcode, unique, nodeid, uid, gid, pid, arg)

"""Kernel requests -> `FileSystem` calls -> reply payloads: the native session's adapter,
with the same errno table as the pyfuse3 adapter (docs/semantics.md)."""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from lakefs_mount.filespan import FileSpan
from lakefs_mount.fs.errors import errno_of
from lakefs_mount.fs.filesystem import ATTR_TIMEOUT, BLKSIZE, Attr, FileSystem
from lakefs_mount.fuse.native import device, wire
from lakefs_mount.fuse.native.splicereply import SplicedReplies
from lakefs_mount.fuse.native.wire import Request


class Sent:
    """A reply that went already, as the handler served the request (a spliced read)."""


SENT = Sent()
# A reply: an errno (0 = success without data), a payload, payload pieces, or SENT.
Reply = int | bytes | memoryview | list[bytes | memoryview] | Sent
Handler = Callable[[Request], Awaitable[Reply]]


class Connection(Protocol):
    """What the adapter needs of the session that serves it: the device, whether the
    kernel agreed to passthrough, and the replies and notifications it sends itself."""

    fd: int
    passthrough: bool
    spliced_replies: SplicedReplies | None

    def send_span(self, unique: int, span: FileSpan) -> bool: ...

    async def notify_from_thread(self, code: wire.Notify,
                                 parts: list[bytes | memoryview]) -> bool: ...

log = logging.getLogger(__name__)
# What a FUSE_INTERRUPT may cancel: requests that change nothing before their last wait
# (on S3, a fetch or the disk), so that a cancelled one leaves no trace and answers EINTR.
# Every other request runs to its end once started (see `interruptible`).
INTERRUPTIBLE = frozenset({
    wire.Op.LOOKUP, wire.Op.GETATTR, wire.Op.READLINK, wire.Op.READ, wire.Op.OPENDIR,
    wire.Op.READDIR, wire.Op.READDIRPLUS, wire.Op.STATFS})
_VALID_S, _VALID_NS = wire.split_valid(ATTR_TIMEOUT)


def pack_attr(a: Attr) -> bytes:
    return wire.pack_attr(a.ino, a.size, a.blocks, a.atime_ns, a.mtime_ns, a.ctime_ns, a.mode,
                          a.nlink, a.uid, a.gid, a.rdev, BLKSIZE)


def entry_out(a: Attr) -> bytes:
    return wire.ENTRY_OUT_HEAD.pack(a.ino, 0, _VALID_S, _VALID_S, _VALID_NS,
                                    _VALID_NS) + pack_attr(a)


def _name(raw: bytes) -> str:
    return os.fsdecode(raw)


class KernelOps:
    """Serves each opcode from the `FileSystem` core; the session owns the wire."""

    def __init__(self, fs: FileSystem) -> None:
        self.fs = fs
        self.session: Connection | None = None
        # FUSE passthrough: the kernel takes one backing file per inode at a time, so
        # every open of an inode shares its id: {ino: [backing id, opens]}, {fh: ino}
        self._backing: dict[int, list[int]] = {}
        self._backed_fh: dict[int, int] = {}
        self._handlers: dict[int, Handler] = {
            wire.Op.LOOKUP: self.lookup, wire.Op.FORGET: self.forget,
            wire.Op.BATCH_FORGET: self.batch_forget, wire.Op.GETATTR: self.getattr,
            wire.Op.SETATTR: self.setattr, wire.Op.READLINK: self.readlink,
            wire.Op.SYMLINK: self.symlink, wire.Op.MKNOD: self.mknod,
            wire.Op.MKDIR: self.mkdir, wire.Op.UNLINK: self.unlink, wire.Op.RMDIR: self.rmdir,
            wire.Op.RENAME: self.rename, wire.Op.RENAME2: self.rename,
            wire.Op.LINK: self.link, wire.Op.OPEN: self.open, wire.Op.CREATE: self.create,
            wire.Op.READ: self.read, wire.Op.WRITE: self.write, wire.Op.FLUSH: self.flush,
            wire.Op.RELEASE: self.release, wire.Op.FSYNC: self.fsync,
            wire.Op.OPENDIR: self.opendir, wire.Op.READDIR: self.readdir,
            wire.Op.READDIRPLUS: self.readdir, wire.Op.RELEASEDIR: self.releasedir,
            wire.Op.FSYNCDIR: self.nothing, wire.Op.STATFS: self.statfs,
            wire.Op.DESTROY: self.nothing,
        }

    def attach(self, session: Connection) -> None:
        self.session = session

    def detach(self) -> None:
        self.session = None
        self._backing.clear()
        self._backed_fh.clear()

    async def _open_reply(self, ino: int, fh: int) -> bytes | None:
        """The OPEN reply of a passthrough open, or None if this open goes through us."""
        session = self.session
        if session is None or not session.passthrough:
            return None
        try:
            fd = await self.fs.passthrough(fh)
        except OSError as exc:  # e.g. a full disk refused the journal's record of it
            log.warning("passthrough not entered for inode %d: %s", ino, exc)
            return None  # the open itself stands: it goes through the daemon
        if fd is None:
            return None
        try:
            backing = self._backing.get(ino)
            if backing is None:
                # registered before the reply, closed only at the last release: closing
                # it while the kernel still consumes the reply fails the open
                backing = self._backing[ino] = [device.backing_open(session.fd, fd), 0]
        except OSError as exc:  # served by the daemon then, as any other open
            log.warning("passthrough refused for inode %d: %s", ino, exc)
            await self.fs.end_passthrough(fh)
            return None
        finally:
            os.close(fd)
        backing[1] += 1
        self._backed_fh[fh] = ino
        return wire.OPEN_OUT.pack(fh, wire.FOPEN_PASSTHROUGH, backing[0])

    async def _drop_handle(self, fh: int) -> None:
        """An open or create that fails once its handle exists: the kernel never learns of
        the handle, so it is released here (shielded: also when interrupted)."""
        with trio.CancelScope(shield=True):
            self._unback(fh)
            await self.fs.release(fh)

    def _unback(self, fh: int) -> None:
        ino = self._backed_fh.pop(fh, None)
        if ino is None:
            return
        backing = self._backing[ino]
        backing[1] -= 1
        if backing[1] == 0:
            del self._backing[ino]
            if self.session is not None:
                device.backing_close(self.session.fd, backing[0])

    def interruptible(self, req: Request) -> bool:
        """True if `req` may be cancelled midway (FUSE_INTERRUPT). Not so: a change of
        names, attributes or bytes (cancelled halfway it could leave the journal, the
        cache and S3 disagreeing about what the caller was told), a release, a local
        fsync, an open that may write or truncate; a read-only open is, up to the moment
        it exists (`open`). An fsync with `--fsync remote` is: its local part runs to its
        end, and then it only waits for a commit that the flusher carries on without it,
        so EINTR (which POSIX allows fsync) tells the truth, "not known to be in S3", and
        a killed process need not wait in the kernel for an S3 that does not answer."""
        if req.opcode == wire.Op.FSYNC:
            return self.fs.fsync_remote
        if req.opcode == wire.Op.OPEN:
            flags, _ = wire.OPEN_IN.unpack_from(req.arg)
            return flags & os.O_ACCMODE == os.O_RDONLY and not flags & os.O_TRUNC
        return req.opcode in INTERRUPTIBLE

    async def dispatch(self, req: Request) -> Reply:
        handler = self._handlers.get(req.opcode)
        if handler is None:
            return errno.ENOSYS
        try:
            return await handler(req)
        except Exception as exc:
            return errno_of(exc, _op_name(req.opcode))

    # -- names and attributes ---------------------------------------------------------

    async def lookup(self, req: Request) -> Reply:
        (name,) = wire.names(req.arg, 1)
        return entry_out(await self.fs.lookup(req.nodeid, _name(name)))

    async def forget(self, req: Request) -> Reply:
        (count,) = wire.U64.unpack_from(req.arg)
        self.fs.forget(req.nodeid, count)
        return 0

    async def batch_forget(self, req: Request) -> Reply:
        (count,) = wire.U32.unpack_from(req.arg)
        for i in range(count):
            ino, n = wire.FORGET_ONE.unpack_from(req.arg, 8 + i * wire.FORGET_ONE.size)
            self.fs.forget(ino, n)
        return 0

    async def getattr(self, req: Request) -> Reply:
        return self._attr_out(await self.fs.getattr(req.nodeid))

    def _attr_out(self, a: Attr) -> bytes:
        return wire.ATTR_OUT_HEAD.pack(_VALID_S, _VALID_NS, 0) + pack_attr(a)

    async def setattr(self, req: Request) -> Reply:
        (valid, _, _fh, size, _, atime, mtime, _, atime_ns, mtime_ns, _, mode, _, uid, gid,
         _) = wire.SETATTR_IN.unpack_from(req.arg)
        new_mtime = new_atime = None
        if valid & wire.FATTR_MTIME_NOW:
            new_mtime = time.time_ns()
        elif valid & wire.FATTR_MTIME:
            new_mtime = mtime * 1_000_000_000 + mtime_ns
        if valid & wire.FATTR_ATIME_NOW:
            new_atime = time.time_ns()
        elif valid & wire.FATTR_ATIME:
            new_atime = atime * 1_000_000_000 + atime_ns
        attr = await self.fs.setattr(
            req.nodeid,
            size=size if valid & wire.FATTR_SIZE else None,
            mode=mode if valid & wire.FATTR_MODE else None,
            uid=uid if valid & wire.FATTR_UID else None,
            gid=gid if valid & wire.FATTR_GID else None,
            mtime_ns=new_mtime, atime_ns=new_atime)
        return self._attr_out(attr)

    async def readlink(self, req: Request) -> Reply:
        return os.fsencode(await self.fs.readlink(req.nodeid))

    async def symlink(self, req: Request) -> Reply:
        name, target = wire.names(req.arg, 2)
        return entry_out(await self.fs.symlink(req.nodeid, _name(name), os.fsdecode(target),
                                               req.uid, req.gid))

    async def mknod(self, req: Request) -> Reply:
        mode, rdev, _umask, _ = wire.MKNOD_IN.unpack_from(req.arg)
        (name,) = wire.names(req.arg[wire.MKNOD_IN.size:], 1)
        return entry_out(await self.fs.mknod(req.nodeid, _name(name), mode, rdev, req.uid,
                                             req.gid))

    async def mkdir(self, req: Request) -> Reply:
        mode, _umask = wire.MKDIR_IN.unpack_from(req.arg)
        (name,) = wire.names(req.arg[wire.MKDIR_IN.size:], 1)
        return entry_out(await self.fs.mkdir(req.nodeid, _name(name), mode, req.uid, req.gid))

    async def unlink(self, req: Request) -> Reply:
        (name,) = wire.names(req.arg, 1)
        await self.fs.unlink(req.nodeid, _name(name))
        return 0

    async def rmdir(self, req: Request) -> Reply:
        (name,) = wire.names(req.arg, 1)
        await self.fs.rmdir(req.nodeid, _name(name))
        return 0

    async def rename(self, req: Request) -> Reply:
        if req.opcode == wire.Op.RENAME2:
            newdir, flags, _ = wire.RENAME2_IN.unpack_from(req.arg)
            rest = req.arg[wire.RENAME2_IN.size:]
        else:
            (newdir,), flags = wire.U64.unpack_from(req.arg), 0
            rest = req.arg[wire.U64.size:]
        old, new = wire.names(rest, 2)
        await self.fs.rename(req.nodeid, _name(old), newdir, _name(new), flags)
        return 0

    async def link(self, req: Request) -> Reply:
        (ino,) = wire.U64.unpack_from(req.arg)
        (name,) = wire.names(req.arg[wire.U64.size:], 1)
        return entry_out(await self.fs.link(ino, req.nodeid, _name(name)))

    # -- files ------------------------------------------------------------------------

    async def open(self, req: Request) -> Reply:
        flags, _ = wire.OPEN_IN.unpack_from(req.arg)
        fh = await self.fs.open(req.nodeid, flags)
        try:
            reply = await self._open_reply(req.nodeid, fh)
            if reply is None:
                await self._fill_page_cache(req.nodeid, fh)
                keep = wire.FOPEN_KEEP_CACHE if self.fs.keep_cache(fh) else 0
                reply = wire.OPEN_OUT.pack(fh, keep, 0)
        except BaseException:  # interrupted (a read-only open may be) or failed
            await self._drop_handle(fh)
            raise
        return reply

    async def _fill_page_cache(self, ino: int, fh: int) -> None:
        """A small file whose bytes are all cached goes into the kernel's page cache
        before the open is answered (the reply then says keep_cache): its first read
        costs no request. The STORE is written from a thread (`notify_from_thread`)."""
        data = await self.fs.page_cache_fill(fh)
        if data is not None and self.session is not None and \
                await self.session.notify_from_thread(wire.Notify.STORE, [
                    wire.NOTIFY_STORE.pack(ino, 0, len(data), 0), data]):
            self.fs.page_cache_filled(fh)

    async def create(self, req: Request) -> Reply:
        flags, mode, _umask, _ = wire.CREATE_IN.unpack_from(req.arg)
        (name,) = wire.names(req.arg[wire.CREATE_IN.size:], 1)
        session = self.session
        fh, attr = await self.fs.create(req.nodeid, _name(name), mode, flags, req.uid, req.gid,
                                        session is not None and session.passthrough)
        try:
            reply = await self._open_reply(attr.ino, fh)
        except BaseException:
            await self._drop_handle(fh)
            raise
        return [entry_out(attr), reply or wire.OPEN_OUT.pack(fh, 0, 0)]

    async def read(self, req: Request) -> Reply:
        """The bytes, or SENT: the cache spliced them to the kernel itself (`SplicedReplies`)."""
        fh, offset, size, _ = wire.READ_IN.unpack_from(req.arg)
        session = self.session
        if session is None or session.spliced_replies is None:
            return await self.fs.read(fh, offset, size)
        sent = False

        def send(span: FileSpan) -> bool:
            nonlocal sent
            sent = session.send_span(req.unique, span)
            return sent

        data = await self.fs.read(fh, offset, size, send)
        return SENT if sent else data

    async def write(self, req: Request) -> Reply:
        fh, offset, size, *_ = wire.WRITE_IN.unpack_from(req.arg)
        assert req.data is not None
        written = await self.fs.write(fh, offset, req.data[:size])
        return wire.WRITE_OUT.pack(written, 0)

    async def flush(self, req: Request) -> Reply:
        """Nothing to do at close (the commit follows RELEASE): ENOSYS tells the kernel to
        stop sending FLUSH, which saves every close() a round trip to the daemon."""
        return errno.ENOSYS

    async def release(self, req: Request) -> Reply:
        fh, _, _ = wire.RELEASE_IN.unpack_from(req.arg)
        self._unback(fh)
        await self.fs.release(fh)
        return 0

    async def fsync(self, req: Request) -> Reply:
        fh, flags, _ = wire.FSYNC_IN.unpack_from(req.arg)
        await self.fs.fsync(fh, bool(flags & wire.FSYNC_FDATASYNC))
        return 0

    # -- directories ------------------------------------------------------------------

    async def opendir(self, req: Request) -> Reply:
        return wire.OPEN_OUT.pack(await self.fs.opendir(req.nodeid), 0, 0)

    async def readdir(self, req: Request) -> Reply:
        fh, offset, size, _ = wire.READ_IN.unpack_from(req.arg)
        plus = req.opcode == wire.Op.READDIRPLUS
        out: list[bytes] = []
        used = 0
        for name, attr, next_id in self.fs.readdir(fh, offset):
            raw = os.fsencode(name)
            need = wire.dirent_size(raw, plus)
            if used + need > size:
                break
            dirent = wire.DIRENT_HEAD.pack(attr.ino, next_id, len(raw),
                                           stat.S_IFMT(attr.mode) >> 12) + raw
            pad = b"\0" * (-len(dirent) % 8)
            out.append((entry_out(attr) if plus else b"") + dirent + pad)
            used += need
            if plus:
                self.fs.note_lookup(attr.ino)
        return b"".join(out)

    async def releasedir(self, req: Request) -> Reply:
        fh, _, _ = wire.RELEASE_IN.unpack_from(req.arg)
        self.fs.releasedir(fh)
        return 0

    async def statfs(self, req: Request) -> Reply:
        info = self.fs.statfs()
        return wire.STATFS_OUT.pack(info["blocks"], info["bfree"], info["bfree"],
                                    info["files"], info["ffree"], info["bsize"],
                                    info["namemax"], info["bsize"], 0)

    async def nothing(self, req: Request) -> Reply:
        return 0


def _op_name(opcode: int) -> str:
    try:
        return wire.Op(opcode).name.lower()
    except ValueError:
        return f"opcode {opcode}"

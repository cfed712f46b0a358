"""pyfuse3 adapter: translates kernel requests into `FileSystem` calls, nothing more."""

from __future__ import annotations

import errno
import functools
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import pyfuse3
import trio

from lakefs_mount.config import FSTYPE_NAME
from lakefs_mount.fs.errors import errno_of
from lakefs_mount.fs.filesystem import ATTR_TIMEOUT, BLKSIZE, Attr, FileSystem
from lakefs_mount.metrics import Latencies

log = logging.getLogger(__name__)
T = TypeVar("T")
P = ParamSpec("P")

# pyfuse3 keeps at least this many request tasks parked between requests. With its
# default, 1, concurrent requests make it end and start a trio task over and over (about
# one of each per request); 16 leave one parked for each of a few concurrent writers.
FUSE_IDLE_TASKS = 16
CLOSE_WAIT_SECONDS = 5.0  # how long close waits for an invalidation the kernel holds


def entry(attr: Attr) -> pyfuse3.EntryAttributes:
    e = pyfuse3.EntryAttributes()
    e.st_ino = attr.ino
    e.generation = 0
    e.entry_timeout = ATTR_TIMEOUT
    e.attr_timeout = ATTR_TIMEOUT
    e.st_mode = attr.mode
    e.st_nlink = attr.nlink
    e.st_uid = attr.uid
    e.st_gid = attr.gid
    e.st_rdev = attr.rdev
    e.st_size = attr.size
    e.st_blksize = BLKSIZE
    e.st_blocks = attr.blocks
    e.st_atime_ns = attr.atime_ns
    e.st_mtime_ns = attr.mtime_ns
    e.st_ctime_ns = attr.ctime_ns
    return e


async def _call(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    try:
        return await fn(*args)
    except pyfuse3.FUSEError:
        raise
    except Exception as exc:
        raise pyfuse3.FUSEError(errno_of(exc, getattr(fn, "__name__", str(fn)))) from None


def _name(raw: bytes) -> str:
    return os.fsdecode(raw)


def _timed(handler: Callable[Concatenate[FuseOperations, P], Coroutine[Any, Any, T]]
           ) -> Callable[Concatenate[FuseOperations, P], Coroutine[Any, Any, T]]:
    """A handler whose time (to its return; libfuse sends the reply) goes into the
    session's latencies under the handler's name, the kernel's opcode in lower case."""
    op = handler.__name__

    @functools.wraps(handler)
    async def timed(self: FuseOperations, *args: P.args, **kwargs: P.kwargs) -> T:
        started = time.perf_counter()
        try:
            return await handler(self, *args, **kwargs)
        finally:
            self.latencies.observe(op, time.perf_counter() - started)

    return timed


class FuseOperations(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, fs: FileSystem, latencies: Latencies | None = None) -> None:
        super().__init__()
        self.fs = fs
        self.latencies = latencies or Latencies()

    @_timed
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> Any:
        return entry(await _call(self.fs.lookup, parent_inode, _name(name)))

    @_timed
    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, count in inode_list:
            self.fs.forget(ino, count)

    @_timed
    async def getattr(self, inode: int, ctx: Any = None) -> Any:
        return entry(await _call(self.fs.getattr, inode))

    @_timed
    async def setattr(self, inode: int, attr: Any, fields: Any, fh: Any, ctx: Any) -> Any:
        async def apply() -> Attr:
            return await self.fs.setattr(
                inode,
                size=attr.st_size if fields.update_size else None,
                mode=attr.st_mode if fields.update_mode else None,
                uid=attr.st_uid if fields.update_uid else None,
                gid=attr.st_gid if fields.update_gid else None,
                mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
                atime_ns=attr.st_atime_ns if fields.update_atime else None)

        return entry(await _call(apply))

    @_timed
    async def readlink(self, inode: int, ctx: Any) -> bytes:
        return os.fsencode(await _call(self.fs.readlink, inode))

    @_timed
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any) -> Any:
        return entry(await _call(self.fs.mknod, parent_inode, _name(name), mode, rdev, ctx.uid,
                                 ctx.gid))

    @_timed
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> Any:
        return entry(await _call(self.fs.mkdir, parent_inode, _name(name), mode, ctx.uid,
                                 ctx.gid))

    @_timed
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        await _call(self.fs.unlink, parent_inode, _name(name))

    @_timed
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        await _call(self.fs.rmdir, parent_inode, _name(name))

    @_timed
    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Any) -> Any:
        return entry(await _call(self.fs.symlink, parent_inode, _name(name),
                                 os.fsdecode(target), ctx.uid, ctx.gid))

    @_timed
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: Any) -> None:
        await _call(self.fs.rename, parent_inode_old, _name(name_old), parent_inode_new,
                    _name(name_new), flags)

    @_timed
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any) -> Any:
        return entry(await _call(self.fs.link, inode, new_parent_inode, _name(new_name)))

    @_timed
    async def open(self, inode: int, flags: int, ctx: Any) -> Any:
        fh = await _call(self.fs.open, inode, flags)
        data = await _call(self.fs.page_cache_fill, fh)
        if data is not None:
            # the kernel keeps these pages (the open below says keep_cache); from a thread,
            # as the kernel may hold the STORE until a READ of those pages is answered by
            # this loop (a deadlock; see lakefs_mount/namespace/invalidations.py)
            try:
                await trio.to_thread.run_sync(
                    pyfuse3.notify_store, inode, 0, data)  # type: ignore[arg-type]  # any buffer
                self.fs.page_cache_filled(fh)
            except OSError as exc:
                log.debug("page cache of inode %d not filled: %s", inode, exc)
        return pyfuse3.FileInfo(fh=fh, keep_cache=self.fs.keep_cache(fh))

    @_timed
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: Any) -> Any:
        fh, attr = await _call(self.fs.create, parent_inode, _name(name), mode, flags, ctx.uid,
                               ctx.gid)
        return pyfuse3.FileInfo(fh=fh), entry(attr)

    @_timed
    async def read(  # type: ignore[override]  # pyfuse3 replies with any buffer
            self, fh: int, off: int, size: int) -> bytes | memoryview:
        return await _call(self.fs.read, fh, off, size)

    @_timed
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return await _call(self.fs.write, fh, off, buf)

    @_timed
    async def flush(self, fh: int) -> None:
        """Nothing to do at close (the commit follows `release`): ENOSYS tells the kernel
        to stop sending FLUSH, which saves every close() a round trip to the daemon."""
        raise pyfuse3.FUSEError(errno.ENOSYS)

    @_timed
    async def fsync(self, fh: int, datasync: bool) -> None:
        await _call(self.fs.fsync, fh, datasync)

    @_timed
    async def release(self, fh: int) -> None:
        await _call(self.fs.release, fh)

    @_timed
    async def opendir(self, inode: int, ctx: Any) -> int:
        return await _call(self.fs.opendir, inode)

    @_timed
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        for name, attr, next_id in self.fs.readdir(fh, start_id):
            if not pyfuse3.readdir_reply(token, os.fsencode(name), entry(attr), next_id):
                return
            self.fs.note_lookup(attr.ino)

    @_timed
    async def releasedir(self, fh: int) -> None:
        self.fs.releasedir(fh)

    @_timed
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        pass

    @_timed
    async def statfs(self, ctx: Any) -> Any:
        info = self.fs.statfs()
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = info["bsize"]
        s.f_blocks = info["blocks"]
        s.f_bfree = s.f_bavail = info["bfree"]
        s.f_files = info["files"]
        s.f_ffree = s.f_favail = info["ffree"]
        s.f_namemax = info["namemax"]
        return s


class Pyfuse3Session:
    """The portable FUSE session: libfuse through pyfuse3, for kernels and setups where
    the native session cannot start (no passthrough, requests of at most 128 KiB pages)."""

    name = "pyfuse3"
    passthrough = False
    passthrough_reason = "pyfuse3 over libfuse 3.14 cannot negotiate it"
    spliced_reads = False
    spliced_reads_reason = "pyfuse3 copies every read reply"

    def __init__(self, fs: FileSystem, mountpoint: str, *, allow_other: bool,
                 read_only: bool, source: str = FSTYPE_NAME, allow_root: bool = False) -> None:
        self.options = set(pyfuse3.default_options)
        # nodev, as the native session: a device node is a few bytes of metadata anyone who
        # writes the bucket can set; it must never open a device of this machine.
        self.options |= {f"fsname={source}", f"subtype={FSTYPE_NAME}", "nodev"}
        if allow_other:
            self.options.add("allow_other")
        if allow_root:  # libfuse: allow_other for the kernel, and it refuses other users
            self.options.add("allow_root")
        if read_only:
            self.options.add("ro")
        self.fs = fs
        self.mountpoint = mountpoint
        self.latencies = Latencies()  # each handler's time (FuseOperations)
        self._in_use = threading.Lock()  # held while an invalidation uses the session
        self._closed = False

    async def mount(self) -> None:
        pyfuse3.init(FuseOperations(self.fs, self.latencies), self.mountpoint,
                     self.options)

    async def serve(self) -> None:
        await pyfuse3.main(min_tasks=FUSE_IDLE_TASKS)

    def terminate(self) -> None:
        pyfuse3.terminate()

    def close(self, unmount: bool) -> None:
        # an invalidation being sent uses the libfuse session that close frees
        held = self._in_use.acquire(timeout=CLOSE_WAIT_SECONDS)
        if not held:
            log.warning("closing the FUSE session while the kernel holds an invalidation")
        self._closed = True
        if held:
            self._in_use.release()
        pyfuse3.close(unmount=unmount)

    def invalidate_inode(self, ino: int) -> None:
        """Blocking (`KernelCaches`): the kernel drops the attributes and pages of `ino`."""
        with self._in_use:
            if not self._closed:
                pyfuse3.invalidate_inode(ino)

    def invalidate_entry(self, parent: int, name: bytes) -> None:
        """Blocking (`KernelCaches`): the kernel forgets the name `name` in `parent`."""
        with self._in_use:
            if not self._closed:
                pyfuse3.invalidate_entry(parent, name)

"""The filesystem core: POSIX operations on inodes, without the kernel.

Both FUSE sessions (`fuse/native/`, the native one, and `fuse/pyfuse3_ops.py` over
pyfuse3) are thin adapters over this class, and tests may drive it directly. Errors are
`FSError(errno)` (fs/errors.py). Content goes through the cache. Namespace changes
(mkdir, rmdir, unlink, renames, a directory's attributes) are journaled and written back
to S3 in the background (namelog, renames).

Parts, held by composition: `Inodes` (inodes.py: inodes by number, attributes, handles,
checks of new names), `Names` (names.py: directories and names of files); this module
holds the open files, flush and status, and hands the rest to its parts.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable, Iterator

import trio

from lakefs_mount import metrics as m
from lakefs_mount.cache.cachefile import CachedFile
from lakefs_mount.cache.flusher import Flusher
from lakefs_mount.cache.manager import CacheManager
from lakefs_mount.filespan import FileSpan, SendSpan
from lakefs_mount.fs.errors import FSError, s3_errors
from lakefs_mount.fs.inodes import _TOO_BIG, ATTR_TIMEOUT, BLKSIZE, BLOCK_SIZE, Attr, Handle, Inodes
from lakefs_mount.fs.names import Names
from lakefs_mount.namespace.inode import ROOT_INO, Inode, Kind
from lakefs_mount.namespace.namelog import NameLog
from lakefs_mount.namespace.namespace import SMALL_OBJECT_MAX, Namespace
from lakefs_mount.s3.layout import MAX_OBJECT_SIZE

__all__ = ["ATTR_TIMEOUT", "BLKSIZE", "Attr", "FileSystem"]  # (what the sessions use)

log = logging.getLogger(__name__)


class FileSystem:
    """The POSIX core the FUSE sessions call: open files here; inodes and attributes in
    `Inodes`, directories and names in `Names`, both of which it holds."""

    def __init__(self, ns: Namespace, cache: CacheManager, flusher: Flusher, names: NameLog,
                 *, read_only: bool = False, fsync_remote: bool = False,
                 hold_temporaries: float = 0.0) -> None:
        self.inodes = Inodes(ns, cache, flusher, names, read_only=read_only)
        self.dirs = Names(self.inodes)
        self.ns, self.cache, self.flusher, self.names = ns, cache, flusher, names
        self.fsync_remote = fsync_remote
        self.hold_temporaries = hold_temporaries  # seconds (UploadDemand.hold)

    # -- inodes and attributes (Inodes) ------------------------------------------------

    async def lookup(self, parent_ino: int, name: str) -> Attr:
        return await self.inodes.lookup(parent_ino, name)

    def forget(self, ino: int, count: int) -> None:
        self.inodes.forget(ino, count)

    async def getattr(self, ino: int) -> Attr:
        return await self.inodes.getattr(ino)

    async def setattr(self, ino: int, *, size: int | None = None, mode: int | None = None,
                      uid: int | None = None, gid: int | None = None,
                      mtime_ns: int | None = None, atime_ns: int | None = None) -> Attr:
        return await self.inodes.setattr(ino, size=size, mode=mode, uid=uid, gid=gid,
                                         mtime_ns=mtime_ns, atime_ns=atime_ns)

    # -- directories and names (Names) ------------------------------------------------

    def _group_in(self, parent_ino: int, gid: int) -> tuple[int, int]:
        """The group of a new entry of directory `parent_ino` and the mode bits it adds:
        a set-group-ID directory gives its group, and to a new directory its S_ISGID too
        (as ext4 and POSIX's BSD semantics: shared directories of a team rely on it)."""
        parent = self.inodes.inode(parent_ino)
        if parent.is_dir and parent.dir_mode & stat.S_ISGID:
            return parent.dir_gid, stat.S_ISGID
        return gid, 0

    async def mkdir(self, parent_ino: int, name: str, mode: int, uid: int, gid: int) -> Attr:
        gid, setgid = self._group_in(parent_ino, gid)
        return await self.dirs.mkdir(parent_ino, name, mode | setgid, uid, gid)

    async def rmdir(self, parent_ino: int, name: str) -> None:
        await self.dirs.rmdir(parent_ino, name)

    async def opendir(self, ino: int) -> int:
        return await self.dirs.opendir(ino)

    def readdir(self, fh: int, start: int) -> Iterator[tuple[str, Attr, int]]:
        return self.dirs.readdir(fh, start)

    def note_lookup(self, ino: int) -> None:
        self.dirs.note_lookup(ino)

    def releasedir(self, fh: int) -> None:
        self.dirs.releasedir(fh)

    async def unlink(self, parent_ino: int, name: str) -> None:
        await self.dirs.unlink(parent_ino, name)

    async def symlink(self, parent_ino: int, name: str, target: str, uid: int, gid: int) -> Attr:
        gid = self._group_in(parent_ino, gid)[0]
        return await self.dirs.symlink(parent_ino, name, target, uid, gid)

    async def mknod(self, parent_ino: int, name: str, mode: int, rdev: int, uid: int,
                    gid: int) -> Attr:
        gid = self._group_in(parent_ino, gid)[0]
        return await self.dirs.mknod(parent_ino, name, mode, rdev, uid, gid)

    async def readlink(self, ino: int) -> str:
        return await self.dirs.readlink(ino)

    async def rename(self, parent_old: int, name_old: str, parent_new: int, name_new: str,
                     flags: int) -> None:
        await self.dirs.rename(parent_old, name_old, parent_new, name_new, flags)

    async def link(self, ino: int, parent_ino: int, name: str) -> Attr:
        return await self.dirs.link(ino, parent_ino, name)

    # -- open files -------------------------------------------------------------------

    async def open(self, ino: int, flags: int) -> int:
        inode = self.inodes.inode(ino)
        await self.inodes.getattr(ino)
        if inode.is_dir:
            raise FSError(errno.EISDIR)
        cf = inode.file
        assert cf is not None
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        if writable:
            self.inodes.writable_fs()
        await self.inodes.revalidate(inode)
        keep = cf.page_cache_etag is not None and cf.page_cache_etag == cf.base.etag
        cf.page_cache_etag = cf.base.etag
        cf.openers += 1
        if writable:
            cf.writers += 1
        fh = self.inodes.new_fh()
        self.inodes.handles[fh] = Handle(inode, writable, bool(flags & os.O_APPEND), keep)
        if writable and flags & os.O_TRUNC and cf.size:
            if cf.pt.writers:
                await self.cache.passthrough.sync(cf)
            await self.cache.truncate(cf, 0)
        return fh

    async def passthrough(self, fh: int) -> int | None:
        """A new descriptor of the open file's cache file if the kernel may serve this open
        from it (FUSE passthrough), else None; the caller registers it with the kernel and
        closes it. Only a session that can do passthrough asks."""
        handle = self.inodes.handle(fh)
        cf = handle.inode.file
        if cf is None or handle.inode.kind is not Kind.FILE:
            return None
        fd = await self.cache.passthrough.enter(cf, handle.writable,
                                                cf.openers - 1 - cf.pt.opens)
        handle.passthrough = fd is not None
        if fd is not None:
            self.cache.metrics[m.PASSTHROUGH_OPENS] += 1
        return fd

    async def end_passthrough(self, fh: int) -> None:
        """The kernel would not take the cache file: this open goes through the daemon."""
        handle = self.inodes.handle(fh)
        if handle.passthrough and handle.inode.file is not None:
            handle.passthrough = False
            await self.cache.passthrough.leave(handle.inode.file, handle.writable)

    def keep_cache(self, fh: int) -> bool:
        return self.inodes.handle(fh).keep_cache

    async def page_cache_fill(self, fh: int) -> bytes | memoryview | None:
        """The bytes of a small file opened for reading whose every byte is cached here,
        for the FUSE layer to put in the kernel's page cache with the open: the first read
        then needs no request. None when the kernel must ask."""
        handle = self.inodes.handle(fh)
        cf = handle.inode.file
        if (handle.writable or handle.keep_cache or cf is None or cf.pending or cf.writers
                or not 0 < cf.size <= SMALL_OBJECT_MAX or not self.cache.holds(cf, 0, cf.size)):
            return None
        try:
            return await self.cache.read_lent(cf, 0, cf.size)
        except OSError:  # the kernel's read will ask, and report it
            return None

    def page_cache_filled(self, fh: int) -> None:
        self.inodes.handle(fh).keep_cache = True
        self.cache.metrics[m.PAGE_CACHE_FILLS] += 1

    async def create(self, parent_ino: int, name: str, mode: int, flags: int, uid: int,
                     gid: int, passthrough: bool = False) -> tuple[int, Attr]:
        """`passthrough`: the session asks right after for the new open to be served in
        passthrough (`FileSystem.passthrough`)."""
        gid = self._group_in(parent_ino, gid)[0]
        parent = await self.inodes.new_name(parent_ino, name)
        cf = CachedFile(key=self.ns.key_of(parent) + name, size=0,
                        mode=stat.S_IFREG | (mode & 0o7777), uid=uid, gid=gid,
                        mtime_ns=time.time_ns())
        await self.cache.new_file(cf, passthrough)
        if self.hold_temporaries and flags & os.O_EXCL and mode & 0o777 == 0o600:
            self.cache.demand.hold(cf, self.hold_temporaries)  # (mkstemp's way)
            self.cache.metrics[m.TEMPORARIES_HELD] += 1
        inode = self.ns.add(parent, name, Kind.FILE, file=cf)
        inode.lookups += 1
        parent.entries_changed(cf.mtime_ns)
        cf.openers += 1
        cf.writers += 1
        fh = self.inodes.new_fh()
        self.inodes.handles[fh] = Handle(inode, True, bool(flags & os.O_APPEND))
        return fh, self.inodes.attr(inode)

    async def read(self, fh: int, offset: int, size: int,
                   send: SendSpan | None = None) -> bytes | memoryview:
        """The bytes to reply with; or, through `send` (see `Reader.read_lent`), none."""
        cf = self.inodes.handle(fh).inode.file
        assert cf is not None
        metrics = self.cache.metrics
        metrics[m.READ_REQUESTS] += 1
        counted: SendSpan | None = None
        if send is not None:
            def counted(span: FileSpan) -> bool:
                if not send(span):
                    return False
                metrics[m.SPLICED_READS] += 1
                return True
        async with s3_errors(f"reading {cf.key}"):
            return await self.cache.read_lent(cf, offset, size, counted)

    async def write(self, fh: int, offset: int, data: bytes | memoryview) -> int:
        handle = self.inodes.handle(fh)
        if not handle.writable:
            raise FSError(errno.EBADF)
        cf = handle.inode.file
        assert cf is not None
        self.cache.metrics[m.WRITE_REQUESTS] += 1
        if handle.append:
            offset = cf.size
        if offset + len(data) > MAX_OBJECT_SIZE:  # a short write up to the limit, then EFBIG
            if offset >= MAX_OBJECT_SIZE:
                raise FSError(errno.EFBIG, _TOO_BIG)
            data = memoryview(data)[:MAX_OBJECT_SIZE - offset]
        async with s3_errors(f"writing {cf.key}"):
            return await self.cache.write(cf, offset, data)

    async def fsync(self, fh: int, datasync: bool) -> None:
        cf = self.inodes.handle(fh).inode.file
        assert cf is not None
        with trio.CancelScope(shield=True):  # an interrupt stops only the wait for S3
            await self.cache.fsync(cf, datasync)
        if self.fsync_remote:  # (its name's changes first: the commit waits for them)
            await self.flush_files([cf], path=self.ns.path_of(self.inodes.handle(fh).inode))

    async def release(self, fh: int) -> None:
        handle = self.inodes.handles.pop(fh, None)
        if handle is None:
            return
        cf = handle.inode.file
        assert cf is not None
        cf.openers -= 1
        if handle.passthrough:
            await self.cache.passthrough.leave(cf, handle.writable)
        if handle.writable:
            cf.writers -= 1
            if cf.writers == 0:
                self.cache.demand.release(cf)
                self.flusher.request_commit(cf, settle=True)
        if cf.openers == 0 and cf.unlinked:
            if cf.in_journal:  # written after the unlink: nothing of it may be recovered
                await self.cache.discard(cf)
            self.cache.close_file(cf)

    # -- flush and status ---------------------------------------------------------------

    def pending_files(self, path: str | None) -> list[CachedFile]:
        """Files with uncommitted data at or under `path` (relative to the mount root)."""
        key = self.ns.prefix + path.strip("/") if path else None
        out = []
        for cf in list(self.cache.files.values()):
            if not cf.pending or cf.unlinked:
                continue
            if key is None or cf.key == key or cf.key.startswith(key.rstrip("/") + "/"):
                out.append(cf)
        return out

    async def node_at(self, path: str | None) -> Inode:
        """The inode at `path` (relative to the mount root; the root for None), looked up
        as the kernel would; FSError(ENOENT) if it is not there."""
        node = self.ns.get(ROOT_INO)
        for name in (path or "").strip("/").split("/"):
            if name in ("", "."):
                continue
            child = await self.inodes.child(node, name)
            if child is None:
                raise FSError(errno.ENOENT, f"{path}: no such file or directory")
            node = child
        return node

    def changed_at(self, path: str) -> bool:
        """A namespace change touches `path` that is not yet in S3, or a removal of it
        landed lately (a directory just removed: its removal is what a flush of it waits
        for)."""
        key = self.ns.prefix + path.strip("/")
        return self.names.busy(key) or self.names.removed_lately(key)

    async def remote_files_at(self, path: str | None) -> tuple[list[CachedFile], int]:
        """The files at or under `path` (relative to the mount root) whose bytes are in S3
        and not changed here, for a warm-up, and how many files were left out for having
        local changes. Directories are listed from S3 where not yet known, each file is
        checked as at an open (close-to-open); a file removed from S3 meanwhile is left
        out. FSError(ENOENT/ENOTDIR) for a path that is not there."""
        node = await self.node_at(path)
        out: list[CachedFile] = []
        local = 0
        stack = [node]
        while stack:
            inode = stack.pop()
            if inode.is_dir:
                async with s3_errors(f"listing {self.ns.key_of(inode)}"):
                    await self.ns.ensure_listed(inode)
                stack.extend(child for name in list(inode.children)
                             if (child := self.ns.child(inode, name)) is not None)
                continue
            cf = inode.file
            if inode.kind is not Kind.FILE or cf is None or cf.unlinked:
                continue
            if cf.pending or cf.writers or cf.base.key is None:
                local += 1
                continue
            try:
                await self.inodes.revalidate(inode)
            except FSError as exc:
                if exc.errno != errno.ENOENT:
                    raise
                continue
            out.append(cf)
        return out, local

    async def flush_files(self, files: list[CachedFile],
                          on_progress: Callable[[object], Awaitable[None]] | None = None,
                          path: str | None = None) -> None:
        """Commit `files`, after the namespace changes at or under `path` (all of them
        for None): a commit of data waits for those before it anyway. A file whose
        upload a rename kept commits first: the move of its object waits for it."""
        for cf in files:
            if cf.upload.moves is not None:
                self.flusher.request_commit(cf)
        await self.names.drain(self.ns.prefix + path.strip("/") if path else None)
        await self.flusher.flush(files, on_progress=on_progress)

    def statfs(self) -> dict[str, int]:
        total = 1 << 50
        return {"bsize": BLOCK_SIZE, "blocks": total // BLOCK_SIZE,
                "bfree": total // BLOCK_SIZE, "files": 1 << 32, "ffree": 1 << 32,
                "namemax": 255}

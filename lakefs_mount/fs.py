"""The filesystem core: POSIX operations on inodes, without the kernel.

Both FUSE sessions (`kernel/`, the native one, and `fuse_ops.py` over pyfuse3) are thin
adapters over this class, and tests may drive it directly. Errors are `FSError(errno)`
(fserrors). Content goes through the cache. Namespace changes (mkdir, rmdir, unlink,
renames, a directory's attributes) are journaled and written back to S3 in the background
(namelog, renames).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import trio

from lakefs_mount import metrics as m
from lakefs_mount.cache.cachefile import CachedFile
from lakefs_mount.cache.flusher import Flusher
from lakefs_mount.cache.manager import CacheManager
from lakefs_mount.dirindex import RESERVED_NAME
from lakefs_mount.fserrors import FSError, check_dir_key, check_key, s3_errors
from lakefs_mount.namelog import DELETE, DIR, RMDIR, NameLog, dir_arg
from lakefs_mount.namespace import (
    ROOT_INO,
    SMALL_OBJECT_MAX,
    Inode,
    Kind,
    Namespace,
    kind_of,
    valid_name,
)
from lakefs_mount.renames import Renames, dir_stat
from lakefs_mount.s3.layout import MAX_OBJECT_SIZE, SPECIAL_TYPES
from lakefs_mount.s3.objectstore import ObjectStoreError

log = logging.getLogger(__name__)

RENAME_NOREPLACE = 1
BLOCK_SIZE = 4096
ATTR_TIMEOUT = 1.0  # seconds the kernel may cache names and attributes
BLKSIZE = 128 * 1024  # st_blksize: the I/O size programs should prefer
_TOO_BIG = "larger than S3's largest object (5 TiB)"


@dataclass(frozen=True)
class Attr:
    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    size: int
    mtime_ns: int
    ctime_ns: int
    blocks: int
    rdev: int = 0


@dataclass
class Handle:
    inode: Inode
    writable: bool
    append: bool
    keep_cache: bool = False  # the kernel's page cache of this file is still valid
    passthrough: bool = False  # the kernel serves it from the cache file (see passthrough)


class FileSystem:
    def __init__(self, ns: Namespace, cache: CacheManager, flusher: Flusher, names: NameLog,
                 *, read_only: bool = False, fsync_remote: bool = False) -> None:
        self.ns = ns
        self.names = names
        self.cache = cache
        self.flusher = flusher
        self.store = cache.store
        self.read_only = read_only
        self.fsync_remote = fsync_remote
        self._handles: dict[int, Handle] = {}
        self._dir_handles: dict[int, list[tuple[str, int]]] = {}
        self._next_fh = 1
        self.renames = Renames(ns, cache, flusher, names)

    # -- attributes -------------------------------------------------------------------

    def attr(self, inode: Inode) -> Attr:
        if inode.file is not None and inode.file.pt_writers:
            self.cache.passthrough.refresh(inode.file)
        size = inode.size
        mtime = inode.mtime_ns
        return Attr(ino=inode.ino, mode=inode.mode, nlink=_nlink(inode),
                    uid=inode.uid, gid=inode.gid, size=size, mtime_ns=mtime,
                    ctime_ns=max(inode.ctime_ns, mtime), blocks=(size + 511) // 512,
                    rdev=inode.file.rdev if inode.file is not None else 0)

    def _inode(self, ino: int) -> Inode:
        try:
            return self.ns.get(ino)
        except KeyError:
            raise FSError(errno.ENOENT) from None

    def _writable_fs(self) -> None:
        if self.read_only:
            raise FSError(errno.EROFS)

    async def _child(self, parent: Inode, name: str, with_body: bool = False) -> Inode | None:
        if not parent.is_dir:
            raise FSError(errno.ENOTDIR)
        if len(os.fsencode(name)) > 255:
            raise FSError(errno.ENAMETOOLONG)
        existing = self.ns.child(parent, name)
        if existing is not None and existing.headed and (
                existing.file is None or existing.file.pending):
            return existing
        async with s3_errors(f"listing {self.ns.key_of(parent)}"):
            await self.ns.ensure_listed(parent, lenient=True)
            child = self.ns.child(parent, name)
            if child is not None:
                await self.ns.ensure_headed(child, with_body)
        return child

    async def lookup(self, parent_ino: int, name: str) -> Attr:
        parent = self._inode(parent_ino)
        if name == ".":
            child: Inode | None = parent
        elif name == "..":
            child = self.ns.get(parent.parent)
        else:
            child = await self._child(parent, name, with_body=True)  # usually opened next
        if child is None:
            raise FSError(errno.ENOENT)
        child.lookups += 1
        return self.attr(child)

    def forget(self, ino: int, count: int) -> None:
        self.ns.forget(ino, count)

    async def getattr(self, ino: int) -> Attr:
        inode = self._inode(ino)
        if not inode.headed:
            async with s3_errors(f"HEAD {self.ns.key_of(inode)}"):
                await self.ns.ensure_headed(inode)
        return self.attr(inode)

    async def setattr(self, ino: int, *, size: int | None = None, mode: int | None = None,
                      uid: int | None = None, gid: int | None = None,
                      mtime_ns: int | None = None) -> Attr:
        self._writable_fs()
        inode = self._inode(ino)
        await self.getattr(ino)
        if mode is not None:
            mode = (inode.mode & ~0o7777) | (mode & 0o7777)
        if inode.file is None:  # a directory: its marker (or sidecar key) keeps them
            inode.set_attrs(mode, uid, gid, mtime_ns)
            if inode.ino != ROOT_INO:
                await self._save_dir_attrs(inode, replace=True)
            return self.attr(inode)
        cf = inode.file
        if size is not None and inode.kind is not Kind.FILE:
            raise FSError(errno.EINVAL)
        if size is not None and size > MAX_OBJECT_SIZE:
            raise FSError(errno.EFBIG, _TOO_BIG)
        if cf.pt_writers:  # the chunk map first learns what the kernel wrote
            await self.cache.passthrough.sync(cf)
        if size is not None:
            async with s3_errors(f"truncating {cf.key}"):
                await self.cache.truncate(cf, size)
            if mtime_ns is None:
                mtime_ns = time.time_ns()
        inode.set_attrs(mode, uid, gid, mtime_ns)
        await self.cache.save_attrs(cf)
        if cf.writers == 0:
            self.flusher.request_commit(cf, settle=True)
        return self.attr(inode)

    # -- directories ------------------------------------------------------------------

    async def _save_dir_attrs(self, inode: Inode, *, replace: bool) -> None:
        """The directory's marker with its attributes, written back (namelog): where the
        store drops a marker's metadata, the sidecar key (dirattrs) goes first, so a
        directory never shows up in S3 before its attributes do, and no mount ever serves
        it looser than it was made; objects below it commit after both."""
        await self.names.record(DIR, self.ns.key_of(inode),
                                arg=dir_arg(dir_stat(inode), replace=replace))

    async def _new_name(self, parent_ino: int, name: str, is_dir: bool = False) -> Inode:
        """The parent of a name about to be created; EEXIST if it is taken."""
        self._writable_fs()
        parent = self._inode(parent_ino)
        self._check_new_name(parent, name, is_dir)
        if await self._child(parent, name) is not None:
            raise FSError(errno.EEXIST)
        return parent

    def _check_new_name(self, parent: Inode, name: str, is_dir: bool,
                        invalid: int | None = None) -> None:
        """A name about to appear in `parent`: not lakefs-mount's own, a name POSIX can
        show (else `invalid`, by default ENAMETOOLONG or EINVAL), and one S3 can store."""
        if name == RESERVED_NAME:
            raise FSError(errno.EPERM, f"the name {name} is lakefs-mount's own")
        if not valid_name(name):
            raise FSError(invalid or (errno.ENAMETOOLONG if len(name) > 255 else errno.EINVAL))
        if is_dir:
            check_dir_key(self.ns.key_of(parent) + name + "/", self.ns.dir_attrs)
        else:
            check_key(self.ns.key_of(parent) + name)

    async def mkdir(self, parent_ino: int, name: str, mode: int, uid: int, gid: int) -> Attr:
        parent = await self._new_name(parent_ino, name, is_dir=True)
        now = time.time_ns()
        inode = self.ns.add(parent, name, Kind.DIR, dir_mode=stat.S_IFDIR | (mode & 0o7777),
                            dir_uid=uid, dir_gid=gid, dir_mtime_ns=now)
        inode.listed_at = time.monotonic()  # a new directory is known to be empty
        try:
            await self._save_dir_attrs(inode, replace=False)
        except FSError:
            self.ns.detach(inode)
            raise
        parent.dir_mtime_ns = now
        inode.lookups += 1
        return self.attr(inode)

    async def rmdir(self, parent_ino: int, name: str) -> None:
        self._writable_fs()
        parent = self._inode(parent_ino)
        inode = await self._child(parent, name)
        if inode is None:
            raise FSError(errno.ENOENT)
        if not inode.is_dir:
            raise FSError(errno.ENOTDIR)
        key = self.ns.key_of(inode)
        await self._remove_empty_dir(inode)
        self.ns.index_changed(key)  # its index goes too
        parent.dir_mtime_ns = time.time_ns()

    async def _remove_empty_dir(self, inode: Inode) -> None:
        """ENOTEMPTY unless S3 and the cache hold nothing below it; then its marker goes
        (written back). S3 is asked unless the mount made the directory and its marker is
        not even in S3 yet: another writer may have filled it since the last listing."""
        key = self.ns.key_of(inode)
        if not self.names.creating(key):
            async with s3_errors(f"listing {key}"):
                await self.ns.ensure_listed(inode, force=True)
        if inode.children:
            raise FSError(errno.ENOTEMPTY)
        await self.names.record(RMDIR, key)
        self.ns.detach(inode)

    async def opendir(self, ino: int) -> int:
        inode = self._inode(ino)
        if not inode.is_dir:
            raise FSError(errno.ENOTDIR)
        async with s3_errors(f"listing {self.ns.key_of(inode)}"):
            await self.ns.ensure_listed(inode)
            await self.ns.ensure_children_headed(inode)
        fh = self._new_fh()
        self._dir_handles[fh] = list(inode.children.items())  # a snapshot, listing order
        return fh

    def readdir(self, fh: int, start: int) -> Iterator[tuple[str, Attr, int]]:
        """Entries from index `start` on, each with the index to resume after it; lazily,
        as the kernel's buffer takes a few dozen of them per request (attributes of all
        the rest on every request made `ls -l` quadratic in the directory's size)."""
        entries = self._dir_handles.get(fh, [])
        for i in range(start, len(entries)):
            name, ino = entries[i]
            inode = self.ns.inodes.get(ino)
            if inode is not None:
                yield name, self.attr(inode), i + 1

    def note_lookup(self, ino: int) -> None:
        """The kernel took a reference to an inode (readdirplus)."""
        inode = self.ns.inodes.get(ino)
        if inode is not None:
            inode.lookups += 1

    def releasedir(self, fh: int) -> None:
        self._dir_handles.pop(fh, None)

    # -- names of files ---------------------------------------------------------------

    async def unlink(self, parent_ino: int, name: str) -> None:
        self._writable_fs()
        parent = self._inode(parent_ino)
        inode = await self._child(parent, name)
        if inode is None:
            raise FSError(errno.ENOENT)
        if inode.is_dir:
            raise FSError(errno.EISDIR)
        cf = inode.file
        assert cf is not None
        if cf.commit_lock.locked() and not cf.openers:
            await self._unlink_behind_commit(cf)
        else:
            async with cf.commit_lock:
                obj = self.names.object_key(cf.key, cf.base_key)
                if obj is not None:
                    kept = None
                    if cf.openers and cf.size and not self.cache.holds(cf, 0, cf.size):
                        kept = trio.Event()
                        self.ns.start_soon(self._keep_bytes, cf, kept)
                    # the DELETE and the end of the file's pending state, in one transaction
                    await self.names.record(DELETE, obj, after=kept,
                                            drop_fid=cf.fid if cf.in_journal else None)
                    cf.in_journal = False
                await self.cache.discard(cf)
        self.ns.detach(inode)
        self.ns.index_changed(self.ns.key_of(parent))
        parent.dir_mtime_ns = time.time_ns()
        if cf.openers == 0:
            self.cache.close_file(cf)

    async def _unlink_behind_commit(self, cf: CachedFile) -> None:
        """A commit of the file is under way, and S3 may keep it for long: the unlink
        does not wait for it. The DELETEs of its name and of its committed object are
        applied once that commit has ended (they hold its lock first), so whatever it
        lands is deleted, and a new file of the name commits after them."""
        keys = dict.fromkeys(k for k in (cf.key, self.names.object_key(cf.key, cf.base_key))
                             if k is not None)
        for i, key in enumerate(keys):
            await self.names.record(DELETE, key, after=cf.commit_lock,
                                    drop_fid=cf.fid if cf.in_journal and i == 0 else None)
        cf.in_journal = False
        await self.cache.discard(cf)

    async def _keep_bytes(self, cf: CachedFile, kept: trio.Event) -> None:
        """An open file lost its name: its bytes come to the cache in the background
        (reading them first made the unlink wait for S3, for ever in a black hole), and
        its object's DELETE waits for them (`kept`), so the open descriptors read every
        byte. Once the last one is closed, what is left is not fetched. If S3 never
        gives them (the object deleted elsewhere), the DELETE goes on and a read of a
        byte not cached fails with EIO."""
        parts = self.cache.parts
        try:
            for idx in range(parts.chunk_count(cf.size)):
                if cf.openers == 0:
                    break
                await self.cache.read(cf, parts.chunk_range(idx)[0], 1)
        except Exception as exc:  # (a background task: the daemon must not end with it)
            log.warning("%s: unlinked while open, not all of it read before its DELETE: %s",
                        cf.key, exc)
        finally:
            kept.set()

    async def symlink(self, parent_ino: int, name: str, target: str, uid: int, gid: int) -> Attr:
        parent = await self._new_name(parent_ino, name)
        key = self.ns.key_of(parent) + name
        cf = CachedFile(key=key, size=0, mode=stat.S_IFLNK | 0o777, uid=uid, gid=gid,
                        mtime_ns=time.time_ns(), symlink=target)
        await self.cache.new_file(cf)
        inode = self.ns.add(parent, name, Kind.SYMLINK, file=cf)
        inode.lookups += 1
        parent.dir_mtime_ns = cf.mtime_ns
        self.flusher.request_commit(cf, settle=True)
        return self.attr(inode)

    async def mknod(self, parent_ino: int, name: str, mode: int, rdev: int, uid: int,
                    gid: int) -> Attr:
        """A FIFO, device, UNIX socket (or empty regular file): a zero-byte object whose
        mode carries the type (and metadata the device number). The kernel serves FIFOs,
        sockets and devices itself; their content never reaches the daemon."""
        file_type = stat.S_IFMT(mode) or stat.S_IFREG
        if file_type not in SPECIAL_TYPES | {stat.S_IFREG}:
            raise FSError(errno.EPERM, f"mknod of file type {file_type:o}")
        parent = await self._new_name(parent_ino, name)
        device = file_type in (stat.S_IFCHR, stat.S_IFBLK)
        cf = CachedFile(key=self.ns.key_of(parent) + name, size=0,
                        mode=file_type | (mode & 0o7777), uid=uid, gid=gid,
                        mtime_ns=time.time_ns(), rdev=rdev if device else 0)
        await self.cache.new_file(cf)
        inode = self.ns.add(parent, name, kind_of(cf), file=cf)
        inode.lookups += 1
        parent.dir_mtime_ns = cf.mtime_ns
        self.flusher.request_commit(cf, settle=True)
        return self.attr(inode)

    async def readlink(self, ino: int) -> str:
        inode = self._inode(ino)
        await self.getattr(ino)
        cf = inode.file
        if inode.kind is not Kind.SYMLINK or cf is None:
            raise FSError(errno.EINVAL)
        if cf.symlink is None:
            assert cf.base_key is not None
            async with s3_errors(f"GET {cf.base_key}"):
                body = await self.store.get_range(cf.base_key, 0, max(cf.base_size, 1))
            cf.symlink = body.decode(errors="surrogateescape")
        return cf.symlink

    async def rename(self, parent_old: int, name_old: str, parent_new: int, name_new: str,
                     flags: int) -> None:
        self._writable_fs()
        if flags & ~RENAME_NOREPLACE:  # RENAME_EXCHANGE, RENAME_WHITEOUT: no atomic way in S3
            raise FSError(errno.EINVAL, "only RENAME_NOREPLACE is supported")
        src_parent, dst_parent = self._inode(parent_old), self._inode(parent_new)
        inode = await self._child(src_parent, name_old)
        if inode is None:
            raise FSError(errno.ENOENT)
        self._check_new_name(dst_parent, name_new, inode.is_dir, invalid=errno.EINVAL)
        if inode.is_dir and self._is_within(dst_parent, inode):
            raise FSError(errno.EINVAL)  # a directory cannot move into itself
        target = await self._child(dst_parent, name_new)
        if target is inode:
            return
        if target is not None:
            if flags & RENAME_NOREPLACE:
                raise FSError(errno.EEXIST)
            await self._drop_rename_target(inode, target)
        moved_dirs = [d for d in [inode, *self.ns.descendants(inode)] if d.is_dir]
        old_keys = [self.ns.key_of(d) for d in (src_parent, *moved_dirs)]
        if inode.is_dir:
            await self.renames.move_dir(inode, dst_parent, name_new)
        else:
            await self.renames.move_file(inode, dst_parent, name_new)
        for key in old_keys + [self.ns.key_of(d) for d in (dst_parent, *moved_dirs)]:
            self.ns.index_changed(key)
        now = time.time_ns()
        src_parent.dir_mtime_ns = dst_parent.dir_mtime_ns = now

    def _is_within(self, node: Inode, ancestor: Inode) -> bool:
        while True:
            if node.ino == ancestor.ino:
                return True
            if node.ino == ROOT_INO:
                return False
            node = self.ns.get(node.parent)

    async def _drop_rename_target(self, inode: Inode, target: Inode) -> None:
        """Rename onto an existing name: the source's commit overwrites the target object."""
        if target.is_dir:
            if not inode.is_dir:
                raise FSError(errno.EISDIR)
            await self._remove_empty_dir(target)
            return
        if inode.is_dir:
            raise FSError(errno.ENOTDIR)
        cf = target.file
        assert cf is not None
        async with cf.commit_lock:
            await self.cache.discard(cf)
        if cf.openers == 0:
            self.cache.close_file(cf)
        self.ns.detach(target)

    async def link(self, ino: int, parent_ino: int, name: str) -> Attr:
        raise FSError(errno.EPERM, "hard links are not supported")

    # -- open files -------------------------------------------------------------------

    def _new_fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    def _handle(self, fh: int) -> Handle:
        try:
            return self._handles[fh]
        except KeyError:
            raise FSError(errno.EBADF) from None

    async def open(self, ino: int, flags: int) -> int:
        inode = self._inode(ino)
        await self.getattr(ino)
        if inode.is_dir:
            raise FSError(errno.EISDIR)
        cf = inode.file
        assert cf is not None
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        if writable:
            self._writable_fs()
        await self._revalidate(inode)
        keep = cf.page_cache_etag is not None and cf.page_cache_etag == cf.base_etag
        cf.page_cache_etag = cf.base_etag
        cf.openers += 1
        if writable:
            cf.writers += 1
        fh = self._new_fh()
        self._handles[fh] = Handle(inode, writable, bool(flags & os.O_APPEND), keep)
        if writable and flags & os.O_TRUNC and cf.size:
            if cf.pt_writers:
                await self.cache.passthrough.sync(cf)
            await self.cache.truncate(cf, 0)
            cf.mtime_ns = time.time_ns()
        return fh

    async def _revalidate(self, inode: Inode) -> None:
        """Close-to-open: a first open after the TTL checks the ETag; a changed object
        drops the cached chunks of the old version. While S3 is unreachable or slow (no
        answer within a lookup's patience) the open goes on with the version last seen
        (what is cached of it reads at local speed)."""
        cf = inode.file
        assert cf is not None
        if (cf.pending or cf.openers or cf.base_key is None
                or time.monotonic() - cf.validated_at < self.ns.ttl or self.ns.s3_slow()):
            return
        patience = self.ns.patience(True)
        try:
            with trio.move_on_after(patience) as waited:
                info = await self.store.head(cf.base_key)
        except ObjectStoreError as exc:  # S3 cannot say now: the version last seen serves
            log.warning("%s not revalidated (%s): the version last seen is served",
                        cf.base_key, exc)
            return
        if waited.cancelled_caught:
            self.ns.s3_was_slow()
            log.warning("%s not revalidated (S3 did not answer in %.2f s): the version last "
                        "seen is served", cf.base_key, patience)
            return
        if info is None:
            raise FSError(errno.ENOENT, f"{cf.base_key} was deleted in S3")
        cf.validated_at = time.monotonic()
        if info.etag != cf.base_etag:
            self.ns.apply_metadata(inode, info)  # drops the chunks of the old version

    async def passthrough(self, fh: int) -> int | None:
        """A new descriptor of the open file's cache file if the kernel may serve this open
        from it (FUSE passthrough), else None; the caller registers it with the kernel and
        closes it. Only a session that can do passthrough asks."""
        handle = self._handle(fh)
        cf = handle.inode.file
        if cf is None or handle.inode.kind is not Kind.FILE:
            return None
        fd = await self.cache.passthrough.enter(cf, handle.writable,
                                                cf.openers - 1 - cf.pt_opens)
        handle.passthrough = fd is not None
        if fd is not None:
            self.cache.metrics[m.PASSTHROUGH_OPENS] += 1
        return fd

    async def end_passthrough(self, fh: int) -> None:
        """The kernel would not take the cache file: this open goes through the daemon."""
        handle = self._handle(fh)
        if handle.passthrough and handle.inode.file is not None:
            handle.passthrough = False
            await self.cache.passthrough.leave(handle.inode.file, handle.writable)

    def keep_cache(self, fh: int) -> bool:
        return self._handle(fh).keep_cache

    async def page_cache_fill(self, fh: int) -> bytes | memoryview | None:
        """The bytes of a small file opened for reading whose every byte is cached here,
        for the FUSE layer to put in the kernel's page cache with the open: the first read
        then needs no request. None when the kernel must ask."""
        handle = self._handle(fh)
        cf = handle.inode.file
        if (handle.writable or handle.keep_cache or cf is None or cf.pending or cf.writers
                or not 0 < cf.size <= SMALL_OBJECT_MAX or not self.cache.holds(cf, 0, cf.size)):
            return None
        try:
            return await self.cache.read_lent(cf, 0, cf.size)
        except OSError:  # the kernel's read will ask, and report it
            return None

    def page_cache_filled(self, fh: int) -> None:
        self._handle(fh).keep_cache = True
        self.cache.metrics[m.PAGE_CACHE_FILLS] += 1

    async def create(self, parent_ino: int, name: str, mode: int, flags: int, uid: int,
                     gid: int) -> tuple[int, Attr]:
        parent = await self._new_name(parent_ino, name)
        cf = CachedFile(key=self.ns.key_of(parent) + name, size=0,
                        mode=stat.S_IFREG | (mode & 0o7777), uid=uid, gid=gid,
                        mtime_ns=time.time_ns())
        await self.cache.new_file(cf)
        inode = self.ns.add(parent, name, Kind.FILE, file=cf)
        inode.lookups += 1
        parent.dir_mtime_ns = cf.mtime_ns
        cf.openers += 1
        cf.writers += 1
        fh = self._new_fh()
        self._handles[fh] = Handle(inode, True, bool(flags & os.O_APPEND))
        return fh, self.attr(inode)

    async def read(self, fh: int, offset: int, size: int) -> bytes | memoryview:
        cf = self._handle(fh).inode.file
        assert cf is not None
        self.cache.metrics[m.READ_REQUESTS] += 1
        async with s3_errors(f"reading {cf.key}"):
            return await self.cache.read_lent(cf, offset, size)

    async def write(self, fh: int, offset: int, data: bytes | memoryview) -> int:
        handle = self._handle(fh)
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
            written = await self.cache.write(cf, offset, data)
        cf.mtime_ns = time.time_ns()
        return written

    async def fsync(self, fh: int, datasync: bool) -> None:
        cf = self._handle(fh).inode.file
        assert cf is not None
        await self.cache.fsync(cf, datasync)
        if self.fsync_remote:  # (its name's changes first: the commit waits for them)
            await self.flush_files([cf], path=self.ns.path_of(self._handle(fh).inode))

    async def release(self, fh: int) -> None:
        handle = self._handles.pop(fh, None)
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

    async def remote_files_at(self, path: str | None) -> tuple[list[CachedFile], int]:
        """The files at or under `path` (relative to the mount root) whose bytes are in S3
        and not changed here, for a warm-up, and how many files were left out for having
        local changes. Directories are listed from S3 where not yet known, each file is
        checked as at an open (close-to-open); a file removed from S3 meanwhile is left
        out. FSError(ENOENT/ENOTDIR) for a path that is not there."""
        node = self.ns.get(ROOT_INO)
        for name in (path or "").strip("/").split("/"):
            if name in ("", "."):
                continue
            child = await self._child(node, name)
            if child is None:
                raise FSError(errno.ENOENT, f"{path}: no such file or directory")
            node = child
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
            if cf.pending or cf.writers or cf.base_key is None:
                local += 1
                continue
            try:
                await self._revalidate(inode)
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
        for None): a commit of data waits for those before it anyway."""
        await self.names.drain(self.ns.prefix + path.strip("/") if path else None)
        await self.flusher.flush(files, on_progress=on_progress)

    def statfs(self) -> dict[str, int]:
        total = 1 << 50
        return {"bsize": BLOCK_SIZE, "blocks": total // BLOCK_SIZE,
                "bfree": total // BLOCK_SIZE, "files": 1 << 32, "ffree": 1 << 32,
                "namemax": 255}


def _nlink(inode: Inode) -> int:
    """A directory: itself, its entry, and each subdirectory's ".." (those this mount knows
    of); a file: its one name, none once unlinked (still open)."""
    if inode.is_dir:
        return 2 + inode.subdirs
    return 0 if inode.file is not None and inode.file.unlinked else 1

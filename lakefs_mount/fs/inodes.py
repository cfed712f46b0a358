"""The filesystem core's shared part: inodes by number, their attributes, file handles,
and the checks a new name passes. `Names` (names.py) and `FileSystem` (filesystem.py, the
open files) hold it."""

from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import dataclass

import trio

from lakefs_mount.cache.flusher import Flusher
from lakefs_mount.cache.manager import CacheManager
from lakefs_mount.fs.errors import FSError, check_key, s3_errors
from lakefs_mount.fs.renames import Renames, dir_stat
from lakefs_mount.namespace.dirindex import RESERVED_NAME
from lakefs_mount.namespace.inode import ROOT_INO, Inode, Kind, valid_name
from lakefs_mount.namespace.namelog import DIR, NameLog, dir_arg
from lakefs_mount.namespace.namespace import Namespace
from lakefs_mount.s3.layout import MAX_OBJECT_SIZE
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
    atime_ns: int = 0


@dataclass
class Handle:
    inode: Inode
    writable: bool
    append: bool
    keep_cache: bool = False  # the kernel's page cache of this file is still valid
    passthrough: bool = False  # the kernel serves it from the cache file (see passthrough)


class Inodes:
    """Inodes by number, their attributes, open handles, and the checks a new name passes:
    what the name and open-file operations share."""

    def __init__(self, ns: Namespace, cache: CacheManager, flusher: Flusher, names: NameLog,
                 *, read_only: bool = False) -> None:
        self.ns = ns
        self.names = names
        self.cache = cache
        self.flusher = flusher
        self.store = cache.store
        self.read_only = read_only
        self.handles: dict[int, Handle] = {}
        self._next_fh = 1
        self.renames = Renames(ns, cache, flusher, names)

    # -- attributes -------------------------------------------------------------------

    def attr(self, inode: Inode) -> Attr:
        if inode.file is not None and self.cache.passthrough.kernel_writes(inode.file):
            self.cache.passthrough.refresh(inode.file)
        size = inode.size
        return Attr(ino=inode.ino, mode=inode.mode, nlink=_nlink(inode),
                    uid=inode.uid, gid=inode.gid, size=size, mtime_ns=inode.mtime_ns,
                    ctime_ns=inode.changed_ns, blocks=(size + 511) // 512,
                    rdev=inode.file.rdev if inode.file is not None else 0,
                    atime_ns=inode.atime_ns)

    def inode(self, ino: int) -> Inode:
        try:
            return self.ns.get(ino)
        except KeyError:
            raise FSError(errno.ENOENT) from None

    def writable_fs(self) -> None:
        if self.read_only:
            raise FSError(errno.EROFS)

    async def child(self, parent: Inode, name: str, with_body: bool = False) -> Inode | None:
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
        parent = self.inode(parent_ino)
        if name == ".":
            child: Inode | None = parent
        elif name == "..":
            child = self.ns.get(parent.parent)
        else:
            child = await self.child(parent, name, with_body=True)  # usually opened next
        if child is None:
            raise FSError(errno.ENOENT)
        child.lookups += 1
        return self.attr(child)

    def forget(self, ino: int, count: int) -> None:
        self.ns.forget(ino, count)

    async def getattr(self, ino: int) -> Attr:
        inode = self.inode(ino)
        if not inode.headed:
            async with s3_errors(f"HEAD {self.ns.key_of(inode)}"):
                await self.ns.ensure_headed(inode)
        return self.attr(inode)

    async def setattr(self, ino: int, *, size: int | None = None, mode: int | None = None,
                      uid: int | None = None, gid: int | None = None,
                      mtime_ns: int | None = None, atime_ns: int | None = None) -> Attr:
        self.writable_fs()
        inode = self.inode(ino)
        await self.getattr(ino)
        if mode is not None:
            mode = (inode.mode & ~0o7777) | (mode & 0o7777)
        if inode.file is None:  # a directory: its marker (or sidecar key) keeps them
            inode.set_attrs(mode, uid, gid, mtime_ns, atime_ns)
            if inode.ino != ROOT_INO:
                await self.save_dir_attrs(inode, replace=True)
            return self.attr(inode)
        cf = inode.file
        if size is not None and inode.kind is not Kind.FILE:
            raise FSError(errno.EINVAL)
        if size is not None and size > MAX_OBJECT_SIZE:
            raise FSError(errno.EFBIG, _TOO_BIG)
        await self.cache.passthrough.left(cf)
        if cf.pt.writers:  # the chunk map first learns what the kernel wrote
            await self.cache.passthrough.sync(cf)
        if size is not None:
            async with s3_errors(f"truncating {cf.key}"):
                await self.cache.truncate(cf, size)
            if mtime_ns is None:
                mtime_ns = time.time_ns()
        inode.set_attrs(mode, uid, gid, mtime_ns, atime_ns)
        await self.cache.save_attrs(cf)
        if cf.writers == 0:
            self.flusher.request_commit(cf, settle=True)
        return self.attr(inode)

    # -- new names and handles --------------------------------------------------------

    async def save_dir_attrs(self, inode: Inode, *, replace: bool) -> None:
        """The directory's marker with its attributes, written back (namelog): where the
        store drops a marker's metadata, the sidecar key (dirattrs) goes first, so a
        directory never shows up in S3 before its attributes do, and no mount ever serves
        it looser than it was made; objects below it commit after both."""
        await self.names.record(DIR, self.ns.key_of(inode),
                                arg=dir_arg(dir_stat(inode), replace=replace))

    async def new_name(self, parent_ino: int, name: str, is_dir: bool = False) -> Inode:
        """The parent of a name about to be created; EEXIST if it is taken."""
        self.writable_fs()
        parent = self.inode(parent_ino)
        self.check_new_name(parent, name, is_dir)
        if await self.child(parent, name) is not None:
            raise FSError(errno.EEXIST)
        return parent

    def check_new_name(self, parent: Inode, name: str, is_dir: bool,
                        invalid: int | None = None) -> None:
        """A name about to appear in `parent`: not lakefs-mount's own, a name POSIX can
        show (else `invalid`, by default ENAMETOOLONG or EINVAL), and one S3 can store."""
        if name == RESERVED_NAME:
            raise FSError(errno.EPERM, f"the name {name} is lakefs-mount's own")
        if not valid_name(name):
            raise FSError(invalid or (errno.ENAMETOOLONG if len(name) > 255 else errno.EINVAL))
        check_key(self.ns.key_of(parent) + name, self.ns.dir_attrs)

    def new_fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    def handle(self, fh: int) -> Handle:
        try:
            return self.handles[fh]
        except KeyError:
            raise FSError(errno.EBADF) from None

    async def revalidate(self, inode: Inode) -> None:
        """Close-to-open: a first open after the TTL checks the ETag; a changed object
        drops the cached chunks of the old version. While S3 is unreachable or slow (no
        answer within a lookup's patience) the open goes on with the version last seen
        (what is cached of it reads at local speed)."""
        cf = inode.file
        assert cf is not None
        if (cf.pending or cf.openers or cf.base.key is None
                or time.monotonic() - cf.base.validated_at < self.ns.ttl or self.ns.s3_slow()):
            return
        patience = self.ns.patience(True)
        started = trio.current_time()
        try:
            with trio.move_on_after(patience) as waited:
                info = await self.store.head(cf.base.key)
        except ObjectStoreError as exc:  # S3 cannot say now: the version last seen serves
            log.warning("%s not revalidated (%s): the version last seen is served",
                        cf.base.key, exc)
            return
        if waited.cancelled_caught:
            self.ns.kept_waiting(started)
            log.warning("%s not revalidated (S3 did not answer in %.2f s): the version last "
                        "seen is served", cf.base.key, patience)
            return
        if info is None:
            raise FSError(errno.ENOENT, f"{cf.base.key} was deleted in S3")
        cf.validated(time.monotonic())
        if info.etag != cf.base.etag:
            self.ns.apply_metadata(inode, info)  # drops the chunks of the old version


def _nlink(inode: Inode) -> int:
    """A directory: itself, its entry, and each subdirectory's ".." (those this mount knows
    of); a file: its one name, none once unlinked (still open)."""
    if inode.is_dir:
        return 2 + inode.subdirs
    return 0 if inode.file is not None and inode.file.unlinked else 1

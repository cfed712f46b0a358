"""Inodes and their names: the tree the kernel sees, merged from S3 listings and the cache,
with the attributes of what S3 listed (HEADs, attribute indexes, directory sidecars).

Layers: inode.py (an inode), tree.py (numbers, names, keys), listings.py (S3 listings
and how long a lookup waits for them), this module (attributes, moves in S3).
"""

from __future__ import annotations

import logging
import stat
import time
from collections.abc import Awaitable, Callable

import trio

from lakefs_mount.cache.cachefile import CachedFile
from lakefs_mount.cache.manager import CacheManager
from lakefs_mount.concurrency import each_bounded
from lakefs_mount.namespace.dirattrs import DirAttrs
from lakefs_mount.namespace.dirindex import DirIndex, IndexEntry
from lakefs_mount.namespace.inode import (
    DEFAULT_DIR_MODE,
    DEFAULT_FILE_MODE,
    ROOT_INO,
    Inode,
    Kind,
    kind_of,
    valid_name,
)
from lakefs_mount.namespace.invalidations import Invalidations
from lakefs_mount.namespace.listings import Listed, UnderWay
from lakefs_mount.namespace.namelog import NameLog
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.layout import carries_posix_attrs, decode_attrs
from lakefs_mount.s3.objectstore import ObjectInfo, ObjectStoreError

__all__ = ["ROOT_INO", "SMALL_OBJECT_MAX", "Inode", "Kind", "Namespace", "kind_of",
           "valid_name"]

log = logging.getLogger(__name__)

HEAD_CONCURRENCY = 32
# A listing proves an object larger than PATH_MAX a regular file: a symlink keeps its
# target as its body, FIFOs and devices are empty.
TYPE_PROVEN_ABOVE = 4096
# In one readdir, more files than this of that size that no index describes are sampled
# (SAMPLE_HEADS of them, spread over the listing) before each is HEADed.
LISTING_TRUSTED_AFTER = 64
SAMPLE_HEADS = 16
# Looked up by name, an object up to this size is fetched whole instead of HEADed: the GET
# brings the same metadata, and the read that usually follows a lookup needs no request.
SMALL_OBJECT_MAX = 256 * 1024


class Namespace(Listed):
    def __init__(self, store: AsyncStore, cache: CacheManager, prefix: str, ttl: float,
                 owner: tuple[int, int], *, index_writer: str,
                 dir_attrs: DirAttrs | None, names: NameLog | None = None,
                 kernel: Invalidations | None = None,
                 modes: tuple[int, int] = (DEFAULT_FILE_MODE, DEFAULT_DIR_MODE)) -> None:
        super().__init__(store, cache, prefix, ttl, owner, names, kernel, modes)
        # Directories' attribute indexes, written by this cache as `index_writer`.
        self.index = DirIndex(store, prefix, index_writer, self.index_entries)
        # Where directories' own attributes are kept (None: listed directories show defaults).
        self.dir_attrs = dir_attrs
        self._attr_loads: dict[int, UnderWay] = {}  # subdirectories' attributes, by parent
        self._attrs_unread: set[int] = set()  # parents whose load failed (logged once)
        self._head_loads: dict[int, UnderWay] = {}  # files' metadata being read, by inode
        self._files_unread: set[int] = set()  # parents of files answered from the listing

    async def ensure_headed(self, inode: Inode, with_body: bool = False) -> None:
        """Attributes from the object's metadata (mode, owner, mtime, symlink); with_body
        (a lookup by name), a small object comes whole, its bytes go to the cache."""
        cf = inode.file
        if inode.headed:
            return
        if cf is None:
            parent = self.inodes.get(inode.parent)
            if parent is None:
                inode.headed = True
            elif self.dir_attrs is not None and self.dir_attrs.lists_siblings:
                await self._head_dirs(parent, self._unheaded_dirs(parent))
            else:
                await self._head_dirs(parent, [inode])
            return
        load = self._head_loads.get(inode.ino)
        if load is None:
            if self.s3_slow():  # (asked when S3 is not known slow: at a later getattr)
                self._from_listing(inode, "S3 is not answering")
                return
            load = self._start_head(inode, with_body)
        answered = load.done.is_set() if self.s3_slow() else (
            await self.answered_while_alive(load))
        if answered and load.error is None:
            return
        if load.error is not None:  # S3 said no (403), or the cache failed: that is the answer
            if not (isinstance(load.error, ObjectStoreError) and load.error.transient):
                raise load.error
            self.s3_was_slow()  # (refused, timed out, 503s: S3 is in trouble)
        self._from_listing(inode, load.error or f"no answer in "
                           f"{trio.current_time() - load.started:.2f} s")

    def _start_head(self, inode: Inode, with_body: bool) -> UnderWay:
        """Read a file's metadata in a task of its own (a lookup stops waiting for a quiet
        S3; it lands when S3 answers)."""
        cf = inode.file
        assert cf is not None

        async def head_it() -> None:
            try:
                if (with_body and not cf.pending
                        and not cf.chunks  # a warm cache already holds it: HEAD is enough
                        and cf.base.key == cf.key and 0 < cf.size <= SMALL_OBJECT_MAX):
                    info = await self.cache.fetch_small_object(cf)
                else:
                    info = await self._head_object(cf)
            finally:
                del self._head_loads[inode.ino]
            if inode.headed:
                return
            was = inode.kind
            inode.headed = True
            if info is not None:
                self.apply_metadata(inode, info)
            self._files_unread.discard(inode.parent)
            if inode.kind is not was and inode.lookups > 0:
                self._retype(inode, was)

        load = self._head_loads[inode.ino] = self.in_background(head_it)
        return load

    async def _head_object(self, cf: CachedFile) -> ObjectInfo | None:
        """HEAD where the file's object is: at its base while a pending move of it or of
        its directory has not brought it to its new key (asked again at the new key if
        that move landed meanwhile and took the object away)."""
        while True:
            key = cf.base.key or cf.key
            info = await self.store.head(key)
            if info is not None or (cf.base.key or cf.key) == key:
                return info

    def _from_listing(self, inode: Inode, why: object) -> None:
        """A file S3 listed answers with what the listing gave (size, time, ETag; the
        default mode and the mount's owner) until its metadata is read; said once per
        directory until a file's metadata is read there."""
        if inode.parent not in self._files_unread:
            self._files_unread.add(inode.parent)
            parent = self.inodes.get(inode.parent)
            log.warning("metadata of files in %s not read (%s): answered from the listing "
                        "until S3 answers", self.key_of(parent) if parent else "?", why)

    def _retype(self, inode: Inode, was: Kind) -> None:
        """Metadata read late made a file served as `was` something else (a symlink, a
        FIFO): the kernel refuses a number whose type changes, so the name gets a new
        inode (the kernel forgets the old entry); the old number keeps its type."""
        kind, inode.kind = inode.kind, was
        parent = self.inodes.get(inode.parent)
        if parent is None or parent.children.get(inode.name) != inode.ino:
            return
        name = inode.name
        self.detach(inode)
        self.add(parent, name, kind, file=inode.file)
        self.kernel.entry(parent.ino, name)

    async def ensure_children_headed(self, dir_inode: Inode) -> None:
        """Attributes of the listed files before readdir hands them out: from the
        directory's attribute indexes (dirindex), else a HEAD each.

        readdirplus gives the kernel each entry's type and attributes; a listing knows
        neither a symlink from a file nor the stored mode, and the kernel refuses an inode
        whose type changes later (EIO). The HEADs run concurrently, bounded.
        """
        dirs = self._unheaded_dirs(dir_inode)
        if dirs:
            await self._head_dirs(dir_inode, dirs)
        todo = await self._apply_index(dir_inode, patient=True)

        async def head(inode: Inode) -> None:
            if self.s3_slow():  # (read at their next lookup, not thrown at a quiet S3)
                self._from_listing(inode, "S3 is not answering")
            else:
                await self.ensure_headed(inode)

        heads = trio.CapacityLimiter(HEAD_CONCURRENCY)
        await self._trust_foreign_listing(dir_inode, todo,
                                          lambda inodes: each_bounded(head, inodes, heads))
        await each_bounded(head, [i for i in todo if not i.headed], heads)

    async def _trust_foreign_listing(
            self, dir_inode: Inode, todo: list[Inode],
            head_all: Callable[[list[Inode]], Awaitable[None]]) -> None:
        """A directory of many files that no index describes and that are too large to be
        anything but regular files, such as a dataset another tool uploaded: HEAD a sample
        of them first. If none carries POSIX metadata, the others take what the listing
        says, which is all their HEADs would have added (size, time, ETag; the default
        mode and the mount's owner), and `ls -l` costs no HEAD per file. If one does, or
        a HEAD did not answer, each is HEADed."""
        large = [i for i in todo if i.file is not None and i.file.base.size > TYPE_PROVEN_ABOVE
                 and i.file.base.key == i.file.key and not i.file.pending]
        if len(large) <= LISTING_TRUSTED_AFTER:
            return
        step = len(large) / SAMPLE_HEADS
        sample = [large[int(k * step)] for k in range(SAMPLE_HEADS)]
        await head_all(sample)
        if any(not i.headed or i.file is None or i.file.base.meta is None
               or carries_posix_attrs(i.file.base.meta) for i in sample):
            return
        trusted = [i for i in large if not i.headed]
        for inode in trusted:
            inode.headed = True
        log.info("%s: no POSIX metadata in a sample of %d HEADs; %d of its %d files are "
                 "answered from the listing", self.key_of(dir_inode) or "/", SAMPLE_HEADS,
                 len(trusted), len(large))

    async def _head_dirs(self, parent: Inode, dirs: list[Inode]) -> None:
        """Stored attributes of subdirectories (see dirattrs). S3 gets the same moment as
        for a listing (patience): one that S3 cannot tell about by then is served 0700
        and the mount's owner, never looser than it was given, and its attributes land
        when S3 answers (or are asked again at its next lookup)."""
        if self.dir_attrs is None:
            for inode in dirs:
                inode.headed = True
            return
        load = self._attr_loads.get(parent.ino)
        if load is None:
            load = self._start_attr_load(parent, dirs)
        if (await self.within_patience(load) and load.error is None
                and all(d.headed for d in dirs)):
            return  # (a load started for other siblings may leave some: asked again later)
        if parent.ino not in self._attrs_unread:  # (said once until they are read)
            self._attrs_unread.add(parent.ino)
            log.warning("attributes of directories in %s not read (%s): served 0700 until "
                        "they are", self.key_of(parent),
                        load.error or f"no answer in {trio.current_time() - load.started:.2f} s")
        for inode in dirs:
            if not inode.headed:
                inode.dir_mode = stat.S_IFDIR | 0o700
                inode.dir_uid, inode.dir_gid = self.owner

    def _start_attr_load(self, parent: Inode, dirs: list[Inode]) -> UnderWay:
        """Load the attributes of `dirs` in a task of its own (a lookup stops waiting for a
        quiet S3; they land when it answers)."""
        dir_attrs = self.dir_attrs
        assert dir_attrs is not None

        async def load_them() -> None:
            try:
                found = await dir_attrs.load(self.key_of(parent), [d.name for d in dirs])
            finally:
                del self._attr_loads[parent.ino]
            for inode in dirs:
                attrs = found.get(inode.name)
                if attrs is None:  # never given any: the defaults (also after a failed read)
                    inode.dir_mode, (inode.dir_uid, inode.dir_gid) = self.dir_mode, self.owner
                else:
                    inode.dir_mode, inode.dir_uid, inode.dir_gid = (attrs.mode, attrs.uid,
                                                                    attrs.gid)
                    inode.dir_mtime_ns = attrs.mtime_ns
                inode.headed = True
            self._attrs_unread.discard(parent.ino)

        load = self._attr_loads[parent.ino] = self.in_background(load_them)
        return load

    def _unheaded_dirs(self, parent: Inode) -> list[Inode]:
        children = (self.inodes.get(ino) for ino in parent.children.values())
        return [c for c in children if c is not None and c.is_dir and not c.headed]

    async def _apply_index(self, dir_inode: Inode, patient: bool = False) -> list[Inode]:
        """Attributes of listed files from the directory's indexes, where an entry matches
        the listed ETag and size (and writers agree); returns the files still unheaded.
        `patient` (readdir): S3 gets a lookup's patience to give the indexes, or they
        are read again next time (an index rewrite must wait for them: it keeps what
        they say of files this mount does not know)."""
        todo = [self.inodes[ino] for ino in dir_inode.children.values()
                if ino in self.inodes and not self.inodes[ino].headed
                and self.inodes[ino].file is not None]
        if (not todo or dir_inode.indexed_at == dir_inode.listed_at  # (read since then)
                or patient and self.s3_slow()):
            return todo
        dir_inode.indexed_at, before = dir_inode.listed_at, dir_inode.indexed_at
        load = self.in_background(lambda: self.index.load(self.key_of(dir_inode)))
        if not patient:
            await load.done.wait()
        elif not await self.answered_while_alive(load):
            dir_inode.indexed_at = before
            return todo
        if load.error is not None:
            raise load.error
        found: dict[str, list[IndexEntry]] = load.result
        left = []
        for inode in todo:
            cf = inode.file
            assert cf is not None
            if inode.headed:  # a HEAD or a lookup got there while the index loaded
                continue
            metas = [e.meta for e in found.get(inode.name, ())
                     if e.etag == cf.base.etag and e.size == cf.base.size]
            if not metas or any(meta != metas[0] for meta in metas) or cf.base.key != cf.key:
                left.append(inode)
                continue
            inode.headed = True
            self.apply_metadata(inode, ObjectInfo(cf.key, cf.base.size, cf.base.etag or "",
                                                  cf.mtime_ns / 1e9, metas[0]))
        return left

    async def index_entries(self, dir_key: str) -> dict[str, IndexEntry] | None:
        """What this mount knows of the objects in a directory, for its index (None: the
        directory is gone). Files listed but not yet known take what the indexes say first,
        so a rewrite after a remount keeps the entries of the mount before."""
        dir_inode = self.dir_by_key(dir_key)
        if dir_inode is None:
            return None
        await self._apply_index(dir_inode)
        out: dict[str, IndexEntry] = {}
        for name, ino in dir_inode.children.items():
            inode = self.inodes.get(ino)
            cf = inode.file if inode is not None else None
            if (cf is not None and inode is not None and inode.headed and cf.base.meta is not None
                    and cf.base.etag and cf.base.key == cf.key and not cf.unlinked):
                out[name] = IndexEntry(cf.base.etag, cf.base.size, cf.base.meta)
        return out

    def index_changed(self, dir_key: str) -> None:
        """This mount changed what the directory holds in S3: its index is due a rewrite."""
        self.index.changed(dir_key)

    def apply_metadata(self, inode: Inode, info: ObjectInfo) -> None:
        cf = inode.file
        assert cf is not None
        if cf.pending:
            return  # local changes not yet committed win over what S3 still holds
        cf.base.meta = dict(info.metadata)
        attrs = decode_attrs(info.metadata)
        cf.set_attrs(attrs.mode, attrs.uid, attrs.gid, attrs.mtime_ns if attrs.mtime_ns
                     is not None else int(info.mtime * 1e9))
        cf.atime_ns, cf.ctime_ns = attrs.atime_ns, attrs.ctime_ns or 0
        cf.rdev = attrs.rdev
        if cf.base.etag != info.etag:
            self.cache.invalidate(cf)
            self.kernel.inode(inode.ino)
        cf.object_seen(cf.base.key, info.size, info.etag, time.monotonic())
        if attrs.is_symlink:
            cf.set_attrs(mode=stat.S_IFLNK | 0o777)
        inode.kind = kind_of(cf)

    def rebase(self, src: str, dst: str, etags: dict[str, str]) -> None:
        """An object moved in S3 (a written-back rename; every object below `src` for a
        directory's "prefix/"): files that read their unchanged bytes from `src` find them
        at `dst`, with the ETag the copy gave them (`etags`, by new key), so that the next
        listing does not take the copy for a change made elsewhere."""
        for inode in self.inodes.values():
            cf = inode.file
            if cf is None or cf.base.key is None:
                continue
            if cf.base.key == src:
                moved = dst
            elif src.endswith("/") and cf.base.key.startswith(src):
                moved = dst + cf.base.key[len(src):]
            else:
                continue
            cf.rebased(moved, etags.get(moved))

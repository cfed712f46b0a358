"""Directories and names of files: mkdir, rmdir, readdir, unlink, symlink, mknod, rename.

Each change is journaled at once and written back to S3 in the background (namelog,
renames); none waits for S3 where the mount knows the answer.
"""

from __future__ import annotations

import errno
import logging
import stat
import time
from collections.abc import Iterator

import trio

from lakefs_mount.cache.cachefile import CachedFile
from lakefs_mount.fs.errors import FSError, s3_errors
from lakefs_mount.fs.inodes import RENAME_NOREPLACE, Attr, Inodes
from lakefs_mount.namespace.inode import ROOT_INO, Inode, Kind, kind_of
from lakefs_mount.namespace.namelog import DELETE, RMDIR
from lakefs_mount.s3.layout import META_PARTS, SPECIAL_TYPES

log = logging.getLogger(__name__)


class Names:
    """Directories and names of files, over the inodes they share with open files."""

    def __init__(self, inodes: Inodes) -> None:
        self.inodes = inodes
        self.ns, self.cache, self.flusher = inodes.ns, inodes.cache, inodes.flusher
        self.names, self.store, self.renames = inodes.names, inodes.store, inodes.renames
        self._dir_handles: dict[int, list[tuple[str, int]]] = {}

    # -- directories ------------------------------------------------------------------

    async def mkdir(self, parent_ino: int, name: str, mode: int, uid: int, gid: int) -> Attr:
        parent = await self.inodes.new_name(parent_ino, name, is_dir=True)
        now = time.time_ns()
        inode = self.ns.add(parent, name, Kind.DIR, dir_mode=stat.S_IFDIR | (mode & 0o7777),
                            dir_uid=uid, dir_gid=gid, dir_mtime_ns=now)
        inode.listed_at = time.monotonic()  # a new directory is known to be empty
        try:
            await self.inodes.save_dir_attrs(inode, replace=False)
        except FSError:
            self.ns.detach(inode)
            raise
        parent.entries_changed(now)
        inode.lookups += 1
        return self.inodes.attr(inode)

    async def rmdir(self, parent_ino: int, name: str) -> None:
        self.inodes.writable_fs()
        parent = self.inodes.inode(parent_ino)
        inode = await self.inodes.child(parent, name)
        if inode is None:
            raise FSError(errno.ENOENT)
        if not inode.is_dir:
            raise FSError(errno.ENOTDIR)
        key = self.ns.key_of(inode)
        await self._remove_empty_dir(inode)
        self.ns.index_changed(key)  # its index goes too
        parent.entries_changed(time.time_ns())

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
        inode = self.inodes.inode(ino)
        if not inode.is_dir:
            raise FSError(errno.ENOTDIR)
        async with s3_errors(f"listing {self.ns.key_of(inode)}"):
            await self.ns.ensure_listed(inode)
            await self.ns.ensure_children_headed(inode)
        fh = self.inodes.new_fh()
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
                yield name, self.inodes.attr(inode), i + 1

    def note_lookup(self, ino: int) -> None:
        """The kernel took a reference to an inode (readdirplus)."""
        inode = self.ns.inodes.get(ino)
        if inode is not None:
            inode.lookups += 1

    def releasedir(self, fh: int) -> None:
        self._dir_handles.pop(fh, None)

    # -- names of files ---------------------------------------------------------------

    async def unlink(self, parent_ino: int, name: str) -> None:
        self.inodes.writable_fs()
        parent = self.inodes.inode(parent_ino)
        inode = await self.inodes.child(parent, name)
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
                keys = self._objects_of(cf)
                kept = None
                if keys and cf.openers and cf.size and not self.cache.holds(cf, 0, cf.size):
                    kept = trio.Event()
                    self.ns.start_soon(self._keep_bytes, cf, kept)
                await self._record_deletes(cf, keys, kept)
                await self.cache.discard(cf, row_dropped=bool(keys))
        self.ns.detach(inode)
        self.ns.index_changed(self.ns.key_of(parent))
        parent.entries_changed(time.time_ns())
        if cf.openers == 0:
            self.cache.close_file(cf)

    def _objects_of(self, cf: CachedFile, under_way: bool = False) -> dict[str, str | None]:
        """The keys where S3 may hold an object of the file, each with the arg of its
        DELETE: its committed object, and, where the outcome of a commit of it is not
        known (under way, unanswered, or a killed daemon's), its own key, which that
        commit may fill without the journal knowing (`CachedFile.late_commit_tag`)."""
        keys: dict[str, str | None] = {}
        tag = cf.late_commit_tag(under_way)
        if tag is not None:
            keys[cf.key] = tag
        obj = self.names.object_key(cf.key, cf.base.key)
        if obj is not None:
            keys.setdefault(obj, None)
        if cf.replaces is not None:  # (what its commit was to replace there)
            keys.setdefault(cf.replaces, None)
        return keys

    async def _record_deletes(self, cf: CachedFile, keys: dict[str, str | None],
                              after: trio.Lock | trio.Event | None) -> None:
        """Journal the DELETEs; the last one's transaction also drops the file's row and
        records the removal of the tables of part CRCs the deleted objects name, so a
        crash between them leaves the file (the unlink had not returned), never a key
        that no DELETE names."""
        tables = self._tables_of(cf, keys)
        for i, (key, arg) in enumerate(keys.items()):
            last = i == len(keys) - 1
            await self.names.record(DELETE, key, arg=arg, after=after,
                                    drop_fid=cf.fid if cf.in_journal and last else None,
                                    tables=tables if last else ())

    def _tables_of(self, cf: CachedFile, keys: dict[str, str | None]) -> list[tuple[str, str]]:
        """(table, key): the tables of part CRCs that the objects of `cf` at these keys
        name, as far as the mount knows: its committed object's (whose metadata a lookup
        or its commit told), and that of a commit whose outcome is not known (its
        upload's). Where it does not know, `sweep-tables` finds them."""
        tables: list[tuple[str, str]] = []
        obj = self.names.object_key(cf.key, cf.base.key)
        table = None if cf.base.meta is None else cf.base.meta.get(META_PARTS)
        if obj in keys and table is not None:
            tables.append((table, obj))
        if keys.get(cf.key) is not None and cf.upload.table not in (None, table):
            assert cf.upload.table is not None
            tables.append((cf.upload.table, cf.key))
        if cf.replaces in keys and cf.replaced_table is not None:
            tables.append((cf.replaced_table, cf.replaces))
        return tables

    async def _unlink_behind_commit(self, cf: CachedFile) -> None:
        """A commit of the file is under way, and S3 may keep it for long: the unlink
        does not wait for it. The DELETEs of its name and of its committed object are
        applied once that commit has ended (they hold its lock first), so whatever it
        lands is deleted, and a new file of the name commits after them. Nothing orders
        that commit's request after them if the daemon dies or gives up on it: the
        DELETE of its key names the file, and the mount watches (latewrites)."""
        await self._record_deletes(cf, self._objects_of(cf, under_way=True), cf.commit_lock)
        await self.cache.discard(cf, row_dropped=True)

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
        parent = await self.inodes.new_name(parent_ino, name)
        key = self.ns.key_of(parent) + name
        cf = CachedFile(key=key, size=0, mode=stat.S_IFLNK | 0o777, uid=uid, gid=gid,
                        mtime_ns=time.time_ns(), symlink=target)
        await self.cache.new_file(cf)
        inode = self.ns.add(parent, name, Kind.SYMLINK, file=cf)
        inode.lookups += 1
        parent.entries_changed(cf.mtime_ns)
        self.flusher.request_commit(cf, settle=True)
        return self.inodes.attr(inode)

    async def mknod(self, parent_ino: int, name: str, mode: int, rdev: int, uid: int,
                    gid: int) -> Attr:
        """A FIFO, device, UNIX socket (or empty regular file): a zero-byte object whose
        mode carries the type (and metadata the device number). The kernel serves FIFOs,
        sockets and devices itself; their content never reaches the daemon."""
        file_type = stat.S_IFMT(mode) or stat.S_IFREG
        if file_type not in SPECIAL_TYPES | {stat.S_IFREG}:
            raise FSError(errno.EPERM, f"mknod of file type {file_type:o}")
        parent = await self.inodes.new_name(parent_ino, name)
        device = file_type in (stat.S_IFCHR, stat.S_IFBLK)
        cf = CachedFile(key=self.ns.key_of(parent) + name, size=0,
                        mode=file_type | (mode & 0o7777), uid=uid, gid=gid,
                        mtime_ns=time.time_ns(), rdev=rdev if device else 0)
        await self.cache.new_file(cf)
        inode = self.ns.add(parent, name, kind_of(cf), file=cf)
        inode.lookups += 1
        parent.entries_changed(cf.mtime_ns)
        self.flusher.request_commit(cf, settle=True)
        return self.inodes.attr(inode)

    async def readlink(self, ino: int) -> str:
        inode = self.inodes.inode(ino)
        await self.inodes.getattr(ino)
        cf = inode.file
        if inode.kind is not Kind.SYMLINK or cf is None:
            raise FSError(errno.EINVAL)
        if cf.symlink is None:
            assert cf.base.key is not None
            body = bytearray(cf.base.size)

            def write(offset: int, piece: bytes) -> None:  # (a retry writes it again)
                body[offset:offset + len(piece)] = piece

            async with s3_errors(f"GET {cf.base.key}"):  # checked as any read (whole)
                got = await self.store.get_range_into(cf.base.key, 0, cf.base.size, write,
                                                      whole=True)
            cf.symlink = bytes(body[:got]).decode(errors="surrogateescape")
        return cf.symlink

    async def rename(self, parent_old: int, name_old: str, parent_new: int, name_new: str,
                     flags: int) -> None:
        self.inodes.writable_fs()
        if flags & ~RENAME_NOREPLACE:  # RENAME_EXCHANGE, RENAME_WHITEOUT: no atomic way in S3
            raise FSError(errno.EINVAL, "only RENAME_NOREPLACE is supported")
        src_parent, dst_parent = self.inodes.inode(parent_old), self.inodes.inode(parent_new)
        inode = await self.inodes.child(src_parent, name_old)
        if inode is None:
            raise FSError(errno.ENOENT)
        self.inodes.check_new_name(dst_parent, name_new, inode.is_dir, invalid=errno.EINVAL)
        if inode.is_dir and self._is_within(dst_parent, inode):
            raise FSError(errno.EINVAL)  # a directory cannot move into itself
        target = await self.inodes.child(dst_parent, name_new)
        if target is inode:
            return
        replaced: tuple[str, str | None] | None = None
        if target is not None:
            if flags & RENAME_NOREPLACE:
                raise FSError(errno.EEXIST)
            replaced = await self._drop_rename_target(inode, target)
        moved_dirs = [d for d in [inode, *self.ns.descendants(inode)] if d.is_dir]
        old_keys = [self.ns.key_of(d) for d in (src_parent, *moved_dirs)]
        if inode.is_dir:
            await self.renames.move_dir(inode, dst_parent, name_new)
        else:
            await self.renames.move_file(inode, dst_parent, name_new, replaced)
        for key in old_keys + [self.ns.key_of(d) for d in (dst_parent, *moved_dirs)]:
            self.ns.index_changed(key)
        now = time.time_ns()
        src_parent.entries_changed(now)
        dst_parent.entries_changed(now)

    def _is_within(self, node: Inode, ancestor: Inode) -> bool:
        while True:
            if node.ino == ancestor.ino:
                return True
            if node.ino == ROOT_INO:
                return False
            node = self.ns.get(node.parent)

    async def _drop_rename_target(self, inode: Inode,
                                  target: Inode) -> tuple[str, str | None] | None:
        """Rename onto an existing name: the source's move or commit overwrites the
        target's object. Returns, where S3 may hold one there, its key and the table of
        part CRCs it names if the mount knows it (both go once the source's object
        replaced it, or when the source leaves the name first)."""
        if target.is_dir:
            if not inode.is_dir:
                raise FSError(errno.EISDIR)
            await self._remove_empty_dir(target)
            return None
        if inode.is_dir:
            raise FSError(errno.ENOTDIR)
        cf = target.file
        assert cf is not None
        table = None if cf.base.meta is None else cf.base.meta.get(META_PARTS)
        key = self.ns.key_of(target)
        holds_object = bool(self._objects_of(cf))
        async with cf.commit_lock:
            await self.cache.discard(cf)
        if cf.openers == 0:
            self.cache.close_file(cf)
        self.ns.detach(target)
        return (key, table) if holds_object else None

    async def link(self, ino: int, parent_ino: int, name: str) -> Attr:
        raise FSError(errno.EPERM, "hard links are not supported")

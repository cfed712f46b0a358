"""Renames: a file's is written back (namelog); a directory's is too where nothing of it
is in S3 yet, and is otherwise done in S3 before it returns.

The rename of a directory with objects in S3 lists them and copies each: journal first,
then copy, then delete, so that a crash at any step loses nothing (docs/durability.md, D7
and D8); a failed delete leaves a duplicate, never a loss.
"""

from __future__ import annotations

import errno
import logging

import trio

from lakefs_mount.cache.cachefile import CachedFile
from lakefs_mount.cache.flusher import Flusher
from lakefs_mount.cache.manager import CacheManager
from lakefs_mount.dirattrs import DirStat
from lakefs_mount.fserrors import FSError, check_dir_key, check_key, s3_errors
from lakefs_mount.namelog import DIR, MOVE, RMDIR, NameLog, dir_arg
from lakefs_mount.namespace import Inode, Namespace
from lakefs_mount.s3.objectstore import ObjectStoreError

log = logging.getLogger(__name__)

# How long the rename of a directory with objects in S3 waits for the namespace changes
# under it to reach S3 before it gives up with EIO (S3 is down: nothing was changed).
PENDING_WAIT = 10.0


def dir_stat(inode: Inode) -> DirStat:
    return DirStat(inode.dir_mode, inode.dir_uid, inode.dir_gid, inode.dir_mtime_ns)


class S3Names:
    def __init__(self, ns: Namespace, cache: CacheManager, flusher: Flusher,
                 names: NameLog) -> None:
        self.ns = ns
        self.cache = cache
        self.flusher = flusher
        self.names = names
        self.store = cache.store
        self._copy_limiter = trio.CapacityLimiter(16)

    async def _mark_new_dir(self, inode: Inode) -> None:
        await self.names.record(DIR, self.ns.key_of(inode),
                                arg=dir_arg(dir_stat(inode), replace=False))

    async def _copy_object(self, src: str, dst: str) -> None:
        async with self._copy_limiter, s3_errors(f"rename {src} -> {dst}"):
            if src.endswith("/"):
                # A directory marker: some stores (SeaweedFS) cannot CopyObject a key
                # ending in "/", and it has no content worth copying anyway.
                info = await self.store.head(src)
                await self.store.call(self.store.sync.put, dst, b"",
                                      info.metadata if info is not None else {})
            else:
                await self.store.copy(src, dst, None)

    async def _delete_objects(self, keys: list[str]) -> None:
        """The old names of a rename, once nothing needs them (a failure leaves a duplicate)."""
        async def delete(key: str) -> None:
            async with self._copy_limiter:
                try:
                    await self.store.delete(key)
                except ObjectStoreError as exc:
                    log.warning("rename left %s behind: %s", key, exc)

        async with trio.open_nursery() as nursery:
            for key in keys:
                nursery.start_soon(delete, key)

    async def _abandon_upload(self, cf: CachedFile) -> None:
        """An upload open at the old key: aborted, so its parts go again, to the new key,
        from the cache. Where S3 cannot take the abort now, the upload stays, and its
        commit completes it at the old key and moves the object (Flusher._commit)."""
        try:
            async with s3_errors(f"aborting the upload of {cf.key}"):
                await self.flusher.abandon_upload(cf)
        except FSError as exc:
            log.info("%s (its commit moves the object instead)", exc)

    async def move_file(self, inode: Inode, dst_parent: Inode, name: str) -> None:
        """The new name in the journal, with the move of the committed object if there is
        one (CopyObject, then DELETE of the old key: written back, namelog); what is not
        yet in S3 commits to the new name."""
        cf = inode.file
        assert cf is not None
        new_key = self.ns.key_of(dst_parent) + name
        async with cf.commit_lock:
            if cf.upload_id is not None:
                await self._abandon_upload(cf)
            obj = self.names.object_key(cf.key, cf.base_key)
            if obj is not None:
                rekey = (cf.fid, new_key, cf.base_key) if cf.in_journal and cf.fid else None
                await self.names.record(MOVE, obj, new_key, rekey=rekey)
            await self.cache.rekey(cf, new_key, cf.base_key)
        self.ns.move(inode, dst_parent, name)

    def _only_here(self, inode: Inode) -> bool:
        """Nothing of the directory is in S3 yet: the mount made it and everything in it,
        and no marker or object of it has been written."""
        for node in [inode, *self.ns.descendants(inode)]:
            if node.is_dir and not self.names.creating(self.ns.key_of(node)):
                return False
            cf = node.file
            if cf is not None and self.names.object_key(cf.key, cf.base_key) is not None:
                return False
        return True

    async def _move_dir_here(self, inode: Inode, dst_parent: Inode, name: str) -> None:
        """A directory with nothing in S3 moves in the journal: markers at the new names,
        files rekeyed, the old markers removed after they are written."""
        nodes = [inode, *self.ns.descendants(inode)]  # each directory before its entries
        old_dirs = [self.ns.key_of(d) for d in nodes if d.is_dir]
        self.ns.move(inode, dst_parent, name)
        for node in nodes:
            if node.is_dir:
                await self._mark_new_dir(node)
        for node in nodes:
            if (cf := node.file) is not None:
                async with cf.commit_lock:
                    if cf.upload_id is not None:
                        await self._abandon_upload(cf)
                    await self.cache.rekey(cf, self.ns.key_of(node), None)
        for key in reversed(old_dirs):
            await self.names.record(RMDIR, key)

    async def move_dir(self, inode: Inode, dst_parent: Inode, name: str) -> None:
        if self._only_here(inode):
            await self._move_dir_here(inode, dst_parent, name)
            return
        old_prefix = self.ns.key_of(inode)
        new_prefix = self.ns.key_of(dst_parent) + name + "/"
        with trio.move_on_after(PENDING_WAIT) as waited:
            for prefix in (old_prefix, new_prefix):
                await self.names.wait_clear(prefix)
        if waited.cancelled_caught:
            raise FSError(errno.EIO, f"renaming {old_prefix}: namespace changes under it "
                          "are not yet in S3 (is S3 reachable?)")

        def moved(key: str) -> str:
            return new_prefix + key[len(old_prefix):] if key.startswith(old_prefix) else key

        files = [d.file for d in self.ns.descendants(inode) if d.file is not None]
        locks = [cf.commit_lock for cf in files]
        for lock in locks:
            await lock.acquire()
        try:
            # listed only once no commit is in flight: one landing after the listing would
            # be rekeyed without being copied and stay behind under the old prefix
            async with s3_errors(f"listing {old_prefix}"):
                objects = await self.store.list_recursive(old_prefix)
            dirs = [self.ns.key_of(d) for d in self.ns.descendants(inode) if d.is_dir]
            for key in [*(o.key for o in objects), *(cf.key for cf in files), *dirs]:
                # before anything moves
                if key.endswith("/"):
                    check_dir_key(moved(key), self.ns.dir_attrs)
                else:
                    check_key(moved(key))
            old_attrs, new_attrs = await self._copy_dir_attrs(inode, old_prefix, new_prefix)
            for cf in files:  # pending data follows the new names; bases stay until copied
                await self._abandon_upload(cf)
                await self.cache.rekey(cf, moved(cf.key), cf.base_key)
            try:
                async with trio.open_nursery() as nursery:
                    for obj in objects:
                        nursery.start_soon(self._copy_object, obj.key, moved(obj.key))
            except ExceptionGroup as group:
                await self._delete_objects([moved(o.key) for o in objects] + new_attrs)
                for cf in files:
                    await self.cache.rekey(cf, old_prefix + cf.key[len(new_prefix):],
                                           cf.base_key)
                first = group.exceptions[0]
                raise FSError(first.errno if isinstance(first, FSError) else errno.EIO) from group
            self.ns.move(inode, dst_parent, name)
            for cf in files:
                if cf.base_key is not None:
                    await self.cache.rekey(cf, cf.key, moved(cf.base_key))
        finally:
            for lock in locks:
                lock.release()
        await self._delete_objects([o.key for o in objects if not o.key.endswith("/")]
                                   + old_attrs)
        await self._delete_folders(old_prefix, [o.key for o in objects])
        if not any(o.key == old_prefix for o in objects):
            await self._mark_new_dir(inode)

    async def _delete_folders(self, prefix: str, keys: list[str]) -> None:
        """The markers of a moved tree, and the folders that stores such as SeaweedFS keep
        for its keys even where no marker was written, deepest first: such a store keeps a
        folder that still holds anything, and lists it on as a directory."""
        folders = {prefix}
        for key in keys:
            parts = key[len(prefix):].split("/")[:-1]
            folders.update(prefix + "/".join(parts[:i]) + "/" for i in range(1, len(parts) + 1))
        for depth in sorted({f.count("/") for f in folders}, reverse=True):
            await self._delete_objects([f for f in folders if f.count("/") == depth])

    async def _copy_dir_attrs(self, inode: Inode, old_prefix: str, new_prefix: str
                              ) -> tuple[list[str], list[str]]:
        """The attributes of a directory being renamed, and of those below it, at their
        new place before any object moves (dirattrs.copy_tree)."""
        if self.ns.dir_attrs is None:
            return [], []
        async with s3_errors(f"copying the directory attributes under {old_prefix}"):
            return await self.ns.dir_attrs.copy_tree(old_prefix, new_prefix, dir_stat(inode))

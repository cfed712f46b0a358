"""Renames, written back: the journal takes the new names at once, S3 follows (namelog).

A file's committed object moves with CopyObject and a DELETE of the old key; a
directory's every object below it (`move` of "old/" to "new/"). What is not yet in S3
simply commits under the new names. Within this mount the rename is atomic; other S3
readers see the objects move one by one.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import trio

from lakefs_mount.cache.cachefile import CachedFile, ChunkState
from lakefs_mount.cache.flusher import Flusher
from lakefs_mount.cache.manager import CacheManager
from lakefs_mount.fs.errors import check_key, s3_errors
from lakefs_mount.namespace.dirattrs import DirStat
from lakefs_mount.namespace.inode import Inode
from lakefs_mount.namespace.namelog import DELETE, KEPT_UPLOAD, MOVE, NameLog, dir_arg
from lakefs_mount.namespace.namespace import Namespace

log = logging.getLogger(__name__)


def dir_stat(inode: Inode) -> DirStat:
    return DirStat(inode.dir_mode, inode.dir_uid, inode.dir_gid, inode.dir_mtime_ns)


class Renames:
    def __init__(self, ns: Namespace, cache: CacheManager, flusher: Flusher,
                 names: NameLog) -> None:
        self.ns = ns
        self.cache = cache
        self.flusher = flusher
        self.names = names

    async def move_file(self, inode: Inode, dst_parent: Inode, name: str,
                        replaced: tuple[str, str | None] | None = None) -> None:
        """The new name in the journal, with the move of the committed object if there is
        one; what is not yet in S3 commits to the new name. `replaced`: the key of an
        object S3 may hold at the new name, which this one replaces, and the table of
        part CRCs it names (removed once the move, or the commit, has replaced it)."""
        cf = inode.file
        assert cf is not None
        new_key = self.ns.key_of(dst_parent) + name
        replaced_table = None if replaced is None else replaced[1]
        tables = [] if replaced_table is None else [(replaced_table, new_key)]
        async with cf.commit_lock:
            await self._leave_replaced(cf)
            rekey = (cf.fid, new_key, cf.base.key) if cf.in_journal and cf.fid else None
            if self._mostly_streamed(cf):
                # Most of its parts are in S3 already: the upload stays and completes at
                # the old key, and then the object moves (D25). Nothing is sent twice;
                # after a crash, what the journal holds goes again to the new key
                # (recovery aborts the upload).
                moves = trio.Event()
                await self.names.record(MOVE, cf.key, new_key, KEPT_UPLOAD, rekey=rekey,
                                        after=moves, tables=tables)
                cf.upload.moves = moves
            else:
                await self.flusher.uploads.abandon(cf)
                obj = self.names.object_key(cf.key, cf.base.key)
                if obj is not None:
                    await self.names.record(MOVE, obj, new_key, rekey=rekey, tables=tables)
                elif replaced is not None:  # its commit replaces the object there
                    cf.replaces, cf.replaced_table = new_key, replaced_table
                tag = cf.late_commit_tag()  # a commit to the old name may land there
                if tag is not None and obj != cf.key:
                    await self.names.record(DELETE, cf.key, arg=tag)
            await self.cache.rekey(cf, new_key, cf.base.key)
        self.ns.move(inode, dst_parent, name)
        self.cache.demand.release(cf)  # a temporary has its final name

    async def _leave_replaced(self, cf: CachedFile) -> None:
        """A file that was to replace an object at its name with its commit leaves the
        name first: that object goes (else it showed again there, the file it replaced
        back), with its table of part CRCs. A kept upload completes there and its move
        deletes what it put there."""
        if cf.replaces is None:
            return
        key, table = cf.replaces, cf.replaced_table
        cf.replaces = cf.replaced_table = None
        if self._mostly_streamed(cf):
            return
        await self.names.record(DELETE, key, tables=[] if table is None else [(table, key)])

    def _mostly_streamed(self, cf: CachedFile) -> bool:
        """A new file (no object in S3 before) whose upload at its own key holds, or is
        receiving, at least half of its bytes: moving the object in S3 afterwards (a
        server-side copy, a few times faster than sending) costs less than sending those
        parts again. A file renamed right after its writes (safetensors renames before
        it even closes) has few parts up yet: they go again, and no copy follows."""
        if (cf.upload.id is None or cf.upload.key != cf.key or cf.base.key is not None
                or cf.upload.moves is not None or cf.unlinked or cf.size == 0):
            return False
        sent = sum(ch.state in (ChunkState.UPLOADED, ChunkState.UPLOADING)
                   for ch in cf.chunks.values())
        return 2 * sent * self.cache.parts.part_size >= cf.size

    async def move_dir(self, inode: Inode, dst_parent: Inode, name: str) -> None:
        """The whole tree moves in the journal (the move of its objects, and every pending
        file's key, in one transaction); S3 follows, listing the old prefix anew when it
        applies the move. Its directories are listed first where the mount has not, so
        that no name known in it is too long for S3 at the new place; where S3 cannot
        answer within a lookup's patience (an outage), the rename goes on without: a
        directory listed later is listed at the old place while the move is pending
        (Namespace._list), and a key found too long then fails that move's step (logged,
        retried; documented in docs/semantics.md)."""
        old_prefix = self.ns.key_of(inode)
        new_prefix = self.ns.key_of(dst_parent) + name + "/"
        await self._list_tree(inode)
        nodes = [inode, *self.ns.descendants(inode)]
        for node in nodes:
            moved = new_prefix + self.ns.key_of(node)[len(old_prefix):]
            check_key(moved, self.ns.dir_attrs)
        files = [node.file for node in nodes if node.file is not None]
        async with self._commit_locks(files):  # no commit lands at an old key after this
            for cf in files:
                await self.flusher.uploads.abandon(cf)
            await self.names.record(MOVE, old_prefix, new_prefix,
                                    arg=dir_arg(dir_stat(inode), replace=False),
                                    rekey_prefix=(old_prefix, new_prefix))
            self.ns.move(inode, dst_parent, name)
            for node in nodes:  # (their journal rows moved with the record)
                if node.file is not None:
                    await self.cache.rekey(node.file, self.ns.key_of(node),
                                           node.file.base.key)

    async def _list_tree(self, top: Inode) -> None:
        stack = [top]
        while stack:
            node = stack.pop()
            started = trio.current_time()
            with trio.move_on_after(self.ns.patience(True)) as waited:
                async with s3_errors(f"listing {self.ns.key_of(node)}"):
                    await self.ns.ensure_listed(node, lenient=True)
            if waited.cancelled_caught:  # (its listing goes on, and lands when S3 answers)
                self.ns.kept_waiting(started)
                log.warning("renaming %s without the names S3 has below it: S3 did not list "
                            "it in time (the move lists them when S3 answers)",
                            self.ns.key_of(node))
            stack.extend(child for name in list(node.children)
                         if (child := self.ns.child(node, name)) is not None and child.is_dir)

    @asynccontextmanager
    async def _commit_locks(self, files: list[CachedFile]) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            for cf in files:
                await stack.enter_async_context(cf.commit_lock)
            yield

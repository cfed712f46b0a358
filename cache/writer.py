"""Writes into the cache, and the journal records that make them safe to acknowledge.

Intent before write: a chunk is journalled dirty (`mark_dirty`) before bytes in it are
acknowledged, and a partial write into a chunk of a committed object first fills the chunk
from S3. A chunk left behind by a sequential writer goes to the flusher at once.
"""

from __future__ import annotations

import errno
import os

import trio

from lakefs_mount import metrics as m
from lakefs_mount.cache.asyncjournal import AsyncJournal
from lakefs_mount.cache.cachefile import DIRTY_STATES, CachedFile, ChunkState
from lakefs_mount.cache.cachefiles import CacheFiles
from lakefs_mount.cache.chunkbook import ChunkBook
from lakefs_mount.cache.demand import UploadDemand
from lakefs_mount.cache.direct import BUFFER_SIZE, DIRECT_WRITE_MIN, AlignedBuffers, split_aligned
from lakefs_mount.cache.diskroom import DiskRoom
from lakefs_mount.cache.fetcher import Fetcher
from lakefs_mount.cache.journalschema import PendingFile
from lakefs_mount.uring import IoEngine

HOLES_AT_ONCE = 64  # chunks a growth past a cut marks dirty at a time (1 GiB of 16 MiB ones)


class Writer:
    def __init__(self, book: ChunkBook, files: CacheFiles, fetcher: Fetcher, room: DiskRoom,
                 journal: AsyncJournal, demand: UploadDemand, engine: IoEngine,
                 buffers: AlignedBuffers) -> None:
        self.book = book
        self.parts = book.parts
        self.files = files
        self.fetcher = fetcher
        self.room = room
        self.journal = journal
        self.demand = demand
        self.engine = engine
        self._buffers = buffers

    # -- the file's journal row ---------------------------------------------------------

    def pending_record(self, cf: CachedFile, passthrough: bool = False) -> PendingFile:
        """The journal row of `cf`, as a new intent (its generation bumped); flagged
        `passthrough` while the kernel may write the cache file, or when about to."""
        assert cf.fid is not None
        cf.intent_gen += 1
        return PendingFile(intent_gen=cf.intent_gen,
            fid=cf.fid, key=cf.key, size=cf.size, mode=cf.mode, uid=cf.uid, gid=cf.gid,
            mtime_ns=cf.mtime_ns, base_key=cf.base.key, base_size=cf.base.size,
            upload_id=cf.upload.id, upload_key=cf.upload.key, symlink=cf.symlink, rdev=cf.rdev,
            passthrough=1 if cf.pt.writers or passthrough else 0,
            upload_checksum=int(cf.upload.checksum), upload_table=cf.upload.table,
            atime_ns=cf.atime_ns, ctime_ns=cf.ctime_ns)

    async def _put_row(self, cf: CachedFile, dirty: list[int] | None = None,
                       passthrough: bool = False) -> None:
        """Write the file's row, with the chunks `dirty` journalled dirty in the same
        transaction; `cf.pt.flagged` follows the row's flag (see `row_covers`)."""
        rec = self.pending_record(cf, passthrough)
        if not rec.passthrough:
            cf.pt.flagged = False  # the row may lose its flag any moment now
        cf.row_written()
        self.book.metrics[m.INTENTS_JOURNALLED] += 1
        if dirty is None:
            await self.journal(self.journal.sync.put_file, rec)
        else:
            await self.journal(self.journal.sync.mark_dirty, rec, dirty)
        if cf.intent_gen == rec.intent_gen:  # no row write of it came after this one
            cf.pt.flagged = bool(rec.passthrough)

    def row_covers(self, cf: CachedFile, size: int) -> bool:
        """Whether the journal row says all a passthrough writer's take-over would write
        down: flagged (recovery takes every byte of the cache file for dirty, with its
        size and mtime), and every chunk up to `size` journalled dirty, as a new file's
        are from its create, so that the row stays right when it loses the flag. The
        take-over then needs no transaction, and the commit drops the row, flag and all
        (`Journal.finish_commit`): one transaction per small file created through
        passthrough, not three (the flag, the take-over)."""
        return (cf.pt.flagged and cf.in_journal and cf.upload.id is None
                and all(cf.state(i) is ChunkState.DIRTY
                        for i in range(self.parts.chunk_count(size))))

    async def _ensure_journalled(self, cf: CachedFile) -> None:
        """Give the file its row in the journal before any chunk of it is dirty."""
        if cf.in_journal or cf.unlinked:  # an unlinked file's bytes never go to S3
            return
        await self.files.ensure_fd(cf)
        await self._put_row(cf)

    async def new_file(self, cf: CachedFile, passthrough: bool = False) -> None:
        """A file created through the mount: pending until its first commit.

        A regular file's first chunk is journalled dirty with its row, in one transaction:
        its bytes can only come from the cache file anyway, and its first write then needs
        no journal round trip of its own (small files: one per file less). `passthrough`:
        the create will be answered in passthrough if it may, and the row carries the flag
        from the start (a new file's every byte is dirty anyway): its open then needs no
        transaction of its own either.
        """
        if cf.symlink is not None:
            await self._ensure_journalled(cf)
            return
        await self.files.ensure_fd(cf)
        cf.row_written()  # (the intent writes it)
        try:
            await self.mark_dirty(cf, [0], None, passthrough)
        except BaseException:
            # Refused (a full cache disk, the journal): the create fails, so nothing of
            # this file may reach S3: the flusher took it for pending and committed an
            # empty object the application was told it never made.
            cf.discarded()
            self.files.remove(cf)
            raise

    async def save_attrs(self, cf: CachedFile) -> None:
        """Attributes or size changed: the next commit writes them."""
        cf.changed()
        if cf.unlinked:
            return
        await self.files.ensure_fd(cf)
        await self._put_row(cf)

    # -- writing ------------------------------------------------------------------------

    async def write(self, cf: CachedFile, offset: int, data: bytes | memoryview) -> int:
        end = offset + len(data)
        if end <= offset:
            return 0
        touched = self.parts.chunks_between(offset, end)
        with self.book.pinned(cf, touched):
            return await self._write_pinned(cf, offset, end, data, touched)

    async def _write_pinned(self, cf: CachedFile, offset: int, end: int,
                            data: bytes | memoryview, touched: range) -> int:
        if end > cf.size:
            await self.zeros_past_cut(cf, cf.size, end)
        for idx in touched:
            while idx in cf.fetches.under_way:  # a fetch or an eviction of this chunk is under way
                await cf.fetches.under_way[idx].wait()
            if idx not in cf.chunks:
                bstart, bend = self.fetcher.base_span(cf, idx)
                if bend > bstart and not (offset <= bstart and end >= bend):
                    await self.fetcher.ensure_chunk(cf, idx)  # keep the bytes the write leaves
        grows_from = cf.size if end > cf.size else None
        await self.mark_dirty(cf, list(touched), grows_from)
        cf.writes.in_flight += 1
        try:
            await self._write_room_permitting(cf, data, offset)
        except OSError:
            if cf.writes.in_flight == 1 and not cf.pt.writers:
                await self._drop_unacknowledged_tail(cf)
            raise
        finally:
            cf.writes.in_flight -= 1
        for idx in touched:
            cf.chunks[idx].gen += 1
        # An upload of a touched chunk that ended while these bytes went into the cache
        # file took (some of) the old ones, and marked the chunk uploaded or committed: it
        # is dirty again, journalled before this write is acknowledged.
        stale = [idx for idx in touched if cf.state(idx) not in DIRTY_STATES]
        if stale:
            await self.mark_dirty(cf, stale, None)
        if end > cf.size:
            cf.resized(end)
            self.book.grow_held(cf, touched)
        cf.changed()
        cf.touched()
        first = touched[0]
        if first > 0:
            prev = cf.chunks.get(first - 1)
            if prev is not None and prev.state is ChunkState.DIRTY:
                self.demand.written_past(cf, first - 1)
        return len(data)

    async def _drop_unacknowledged_tail(self, cf: CachedFile) -> None:
        """A failed write that got part of its bytes past the end into the cache file
        (ENOSPC half-way): the cache file goes back to the acknowledged size, since
        recovery trusts its length (the journal's size may lag behind acknowledged
        writes). Only with no other write of the file under way, whose bytes past
        the end may be acknowledged any moment, and no passthrough writer (the kernel
        writes past cf.size without telling)."""
        fd = await self.files.ensure_fd(cf)
        if os.fstat(fd).st_size > cf.size:
            os.ftruncate(fd, cf.size)  # metadata-only; never blocks on data

    async def _write_room_permitting(self, cf: CachedFile, data: bytes | memoryview,
                                     offset: int) -> None:
        """A full cache disk: evict clean data, then wait for uploads; ENOSPC only after that.

        The chunk is journalled dirty already; a failed write leaves its old bytes (fetched
        before) or zeros in the cache file, which is what a short write promises anyway.
        """
        async def attempt() -> int:
            try:
                await self._write_cache_file(cf, data, offset)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                return 2 * len(data) + self.parts.part_size
            return 0

        await self.room.patiently(attempt, f"writing {cf.key}")

    async def _write_cache_file(self, cf: CachedFile, data: bytes | memoryview,
                                offset: int) -> None:
        """Write into the cache file: the whole pages of a write of DIRECT_WRITE_MIN up to
        BUFFER_SIZE with O_DIRECT (copied into an aligned buffer), which also marks its
        chunks for O_DIRECT reads; the rest, and smaller or larger writes, buffered."""
        view = memoryview(data).cast("B")
        head, body = split_aligned(offset, len(view))
        direct = DIRECT_WRITE_MIN <= body and len(view) <= BUFFER_SIZE
        async with self.files.io(cf, direct) as fd:
            dfd = self.files.dfd(cf) if direct else None
            if dfd is None:
                await self.engine.write(fd, view, offset)
                for idx in self.parts.chunks_between(offset, offset + len(view)):
                    cf.chunks[idx].direct = False
                return
            if head:
                await self.engine.write(fd, view[:head], offset)
            buf = self._buffers.take()
            with memoryview(buf) as aligned_view:  # kept from the pool if the write fails
                aligned_view[:body] = view[head:head + body]
                try:
                    await self.engine.write(dfd, aligned_view[:body], offset + head)
                except OSError as exc:
                    self.files.give_up_direct(exc)
                    await self.engine.write(fd, view[head:head + body], offset + head)
            self._buffers.give_back(buf)
            if head + body < len(view):
                await self.engine.write(fd, view[head + body:], offset + head + body)
            for idx in self.parts.chunks_between(offset, offset + len(view)):
                cf.chunks[idx].direct = True

    async def truncate(self, cf: CachedFile, size: int) -> None:
        old = cf.size
        if size == old:
            return
        if size < old:
            if size > 0:
                last = self.parts.chunk_of(size - 1)
                with self.book.pinned(cf, [last]):
                    await self.fetcher.ensure_chunk(cf, last)
                    await self.mark_dirty(cf, [last], None)
            first_gone = self.parts.chunk_count(size)
            # A fetch of a chunk past the cut (a readahead) that ended after it would put
            # the old object's bytes back behind the new end, in the chunk map and in the
            # cache file: it ends first, and no new one starts (the size is cut now).
            while (filling := next((e for i, e in cf.fetches.under_way.items()
                                    if i >= first_gone), None)) is not None:
                await filling.wait()
            cf.resized(size)
            for idx in [i for i in cf.chunks if i >= first_gone]:
                self.book.remove_chunk(cf, idx)
            for idx in [i for i in cf.spills if i >= first_gone]:
                cf.stale_spills.append((idx, cf.spills.pop(idx)))
            if cf.in_journal:
                assert cf.fid is not None
                await self.journal(self.journal.sync.drop_chunks_from, cf.fid, first_gone)
            fd = await self.files.ensure_fd(cf)
            os.ftruncate(fd, size)  # metadata-only; never blocks on data
            cf.low_water = min(cf.low_water, size)
        else:
            await self.zeros_past_cut(cf, old, size)
            await self.mark_dirty(cf, [], old)
            fd = await self.files.ensure_fd(cf)
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # the cache file's length is what recovery trusts
        cf.resized(size)
        cf.touched()
        if size > old:
            self.book.grow_held(cf, self.parts.chunks_between(max(old - 1, 0), size))
        await self.save_attrs(cf)

    async def zeros_past_cut(self, cf: CachedFile, cut: int, end: int) -> None:
        """The file's bytes from `cut` to `end` are not its committed object's (a truncate
        cut them: the file grows from `cut` while the object is longer, or a commit begun
        before the cut has just made a longer object its base). So every chunk wholly past
        `cut` that the object covers becomes dirty before anything could fetch it from the
        object or a commit copy it from it: one not cached as a hole of the cache file
        (which the truncate shortened), one cached as it is. (The chunk holding `cut` was
        made dirty by the cut.) In batches, so that a long hole waits for dirty room like
        a long write."""
        if cf.base.key is None or cut >= cf.base.size:
            return
        todo = [i for i in range(self.parts.chunk_count(cut),
                                  self.parts.chunk_count(min(end, cf.base.size)))
                if cf.state(i) not in DIRTY_STATES]
        for at in range(0, len(todo), HOLES_AT_ONCE):
            await self.mark_dirty(cf, todo[at:at + HOLES_AT_ONCE], None)

    # -- what passthrough writers wrote -------------------------------------------------

    async def take_over_written(self, cf: CachedFile, size: int,
                                keep: frozenset[int] = frozenset()) -> None:
        """The kernel wrote the cache file directly (FUSE passthrough) and it is now `size`
        bytes long: every chunk but those in `keep` (uploaded parts that still hold what the
        file holds) is dirty, journalled in one transaction, which also records whether
        passthrough writers remain."""
        count = self.parts.chunk_count(size)
        for idx in [i for i in cf.chunks if i >= count]:
            self.book.remove_chunk(cf, idx)
        cf.resized(size)
        indices = [i for i in range(count) if i not in keep]
        await self.files.ensure_fd(cf)
        if not self.row_covers(cf, size):
            await self._put_row(cf, indices)
        for idx in indices:
            ch = self.book.new_chunk(cf, idx)
            # An upload of it in flight no longer counts: when it ends, the chunk is dirty
            # again. (Made dirty here, another upload could take it meanwhile, and the
            # first one's end would mark it dirty under that one: sent a third time.)
            ch.gen += 1
            ch.direct = False  # in the page cache: read it back buffered
            if ch.state not in DIRTY_STATES:
                self.book.set_state(cf, ch, idx, ChunkState.DIRTY)
        self.book.grow_held(cf, range(count))
        cf.changed()
        cf.page_cache_stale()

    async def stream_written(self, cf: CachedFile, indices: list[int]) -> None:
        """Chunks a passthrough writer has left behind: dirty (journalled first), and to
        the flusher now, while the writer goes on. The bytes are on the disk already:
        neither the dirty budget nor disk room is waited for (a passthrough writer is held
        back at open), and the last close, which waits for this, is not held up by S3.
        Pinned while the journal is waited for."""
        with self.book.pinned(cf, indices):
            need = await self._not_dirty_yet(cf, indices)
            if need:
                await self._journal_dirty(cf, need)
            # (a chunk made dirty while the file was shorter, as the first at its create,
            # counts its bytes now: --max-dirty holds passthrough writers to them)
            self.book.grow_held(cf, range(min(indices), max(indices) + 1))
            for idx in indices:
                ch = cf.chunks[idx]
                ch.direct = False  # in the page cache: read it back buffered
                self.demand.chunk_full(cf, idx)

    # -- intent before write ------------------------------------------------------------

    async def mark_dirty(self, cf: CachedFile, indices: list[int], grows_from: int | None,
                         passthrough: bool = False) -> None:
        """Journal the chunks as dirty before the write that touches them is acknowledged
        (`passthrough`: see `new_file`)."""
        if grows_from is not None and grows_from > 0:
            # Bytes past the old end were a hole; the old last chunk's part must grow too.
            tail = self.parts.chunk_of(grows_from - 1)
            if self.parts.chunk_range(tail)[1] > grows_from and tail not in indices:
                with self.book.pinned(cf, [tail]):
                    await self.fetcher.ensure_chunk(cf, tail)
                    await self.mark_dirty(cf, [tail], None)
        need = await self._not_dirty_yet(cf, indices)
        if not need:
            return
        needed = sum(self.book.chunk_bytes(i) for i in need)
        await self.book.wait_for_dirty_room(needed)
        await self.room.ensure(needed)
        await self._journal_dirty(cf, need, passthrough)

    async def _not_dirty_yet(self, cf: CachedFile, indices: list[int]) -> list[int]:
        for idx in indices:
            pending = cf.writes.intents.get(idx)
            if pending is not None:
                await pending.wait()
        return [i for i in indices if cf.state(i) not in DIRTY_STATES]

    async def _journal_dirty(self, cf: CachedFile, need: list[int],
                             passthrough: bool = False) -> None:
        await self._ensure_journalled(cf)
        done = trio.Event()
        for idx in need:
            cf.writes.intents[idx] = done
        try:
            assert cf.fid is not None
            if not cf.unlinked:
                await self._put_row(cf, need, passthrough)
            for idx in need:
                ch = self.book.new_chunk(cf, idx)
                if ch.state not in DIRTY_STATES:
                    self.book.set_state(cf, ch, idx, ChunkState.DIRTY)
        finally:
            for idx in need:
                cf.writes.intents.pop(idx, None)
            done.set()

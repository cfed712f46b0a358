"""Bytes of committed objects into the cache: fetches, shared fetches, readahead.

A chunk a reader waits for is fetched into the page cache and stays "fresh" there until a
read reaches its end (or FRESH_FOR seconds pass); then it is written back to disk, dropped
from the page cache, and only then noted in the journal for the next mount (`_settle`).
Reading each chunk back from the cache disk while the disk writes the next ones would slow
a cold restore.

A chunk read to its end is written back once the reads and GETs pause for QUIET_FOR
seconds, not while the restore goes on: the write-back's CPU and disk then do not compete
with the fetch and the reader. That pays only for a restore the page cache can hold until
it pauses: once the files read since the last pause are larger together than
READ_THROUGH_MAX, their chunks go to disk as they are read, since holding back the first
READ_THROUGH_MAX bytes would only move their write-back into a burst in the middle of the
restore. Every fresh chunk goes after FRESH_FOR seconds all the same.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

import outcome
import trio

from lakefs_mount.cache.asyncjournal import AsyncJournal
from lakefs_mount.cache.cachefile import CachedFile, Chunk, ChunkState, SpilledPart
from lakefs_mount.cache.cachefiles import CacheFiles
from lakefs_mount.cache.chunkbook import ChunkBook
from lakefs_mount.cache.direct import BUFFER_SIZE, write_back
from lakefs_mount.cache.diskroom import DiskRoom
from lakefs_mount.cache.parttables import PartTables
from lakefs_mount.cache.spills import Spills
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.objectstore import CorruptRead, NoSuchKey, ObjectInfo
from lakefs_mount.uring import write_on_this_thread

log = logging.getLogger(__name__)
T = TypeVar("T")

FRESH_FOR = 5.0  # seconds a fetched chunk may stay in the page cache with no reader past it
SETTLE_THREADS = 4  # fetched chunks being written back to disk at once
READ_THROUGH_MAX = 1 << 30  # bytes of files a restore reads whose chunks wait for its pause
QUIET_FOR = 0.5  # seconds without a fetch or a chunk read to its end: the restore paused


class FetchStopped(Exception):
    """A cancelled fetch's GET thread gives up at its next piece."""


class _Filling:
    """The mark of a chunk being filled, set at once (before the task that fills it runs,
    so that a reader arriving meanwhile shares it) and cleared when the fill ends."""

    def __init__(self, cf: CachedFile, idx: int) -> None:
        self.cf = cf
        self.idx = idx
        self.done = cf.fetches.under_way[idx] = trio.Event()

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        del self.cf.fetches.under_way[self.idx]
        self.done.set()


class Fetcher:
    def __init__(self, book: ChunkBook, files: CacheFiles, room: DiskRoom,
                 journal: AsyncJournal, store: AsyncStore, read_ahead: int,
                 spills: Spills) -> None:
        self.book = book
        self.spills = spills
        self.tables = PartTables(store, book.parts)
        self.parts = book.parts
        self.files = files
        self.room = room
        self.journal = journal
        self.store = store
        self.read_ahead = read_ahead
        self._fetch_slots = trio.Semaphore(2 * read_ahead + 8)  # GETs in flight (1 MiB each)
        self._settle_slots = trio.CapacityLimiter(SETTLE_THREADS)
        self._settling = 0
        self._busy_at = 0.0  # when a fetch started or a chunk was last read to its end
        # chunks read to their end, oldest first, with their bytes: written back once the
        # reads pause (see the module)
        self._read_through: dict[tuple[CachedFile, int], int] = {}
        self._read_through_bytes = 0
        self._reading: set[CachedFile] = set()  # files read through since the last pause
        self._reading_bytes = 0  # ... their sizes
        self._nursery: trio.Nursery | None = None

    async def run(self, every: float,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Owns readahead and write-back of fetched chunks; every `every` seconds the fresh
        chunks nobody read to their end within FRESH_FOR seconds are written back."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                while True:
                    await trio.sleep(every)
                    stale = trio.current_time() - FRESH_FOR
                    for ref in [r for r, (_, _, at) in self.book.fresh.items() if at < stale]:
                        self.settle_soon(*ref)
                    if trio.current_time() - self._busy_at > QUIET_FOR:
                        for ref in list(self._read_through):
                            self.settle_soon(*ref)
                        self._reading.clear()
                        self._reading_bytes = 0
        finally:
            self._nursery = None

    async def settle_all(self) -> None:
        """Before unmounting: every fetched chunk still only in the page cache goes to disk
        and into the journal, so that the next mount reuses it."""
        for ref in list(self.book.fresh):
            self.settle_soon(*ref)
        while self._settling:
            await trio.sleep(0.01)

    def base_span(self, cf: CachedFile, idx: int) -> tuple[int, int]:
        """The part of chunk `idx` that the committed object (or the chunk's spilled part)
        holds and the file still has (empty if none: past the file's end, bytes of the
        object are not the file's)."""
        start, end = self.parts.chunk_range(idx)
        spilled = cf.spills.get(idx)
        if spilled is not None:
            return start, max(start, min(start + spilled.length, cf.size))
        if cf.base.key is None:
            return start, start
        return start, max(start, min(end, cf.base.size, cf.size))

    def fetching(self, cf: CachedFile, idx: int) -> _Filling:
        """Chunk `idx` is being filled: readers share the fill, writers wait for it."""
        return _Filling(cf, idx)

    async def _for_waiter(self, fill: Callable[[], Awaitable[T]]) -> T:
        """Run `fill` in the fetcher's own task and wait for its outcome. A waiter that is
        cancelled (its request interrupted, FUSE_INTERRUPT) stops waiting at once and
        the fill goes on, for the readers sharing it and the next one: its GET thread
        writes into the cache file and cannot be abandoned, and stopping it would make
        every reader of the chunk start again."""
        if self._nursery is None:
            return await fill()
        done = trio.Event()
        result: list[outcome.Outcome[T]] = []

        async def run() -> None:
            try:
                result.append(outcome.Value(await fill()))
            except Exception as exc:
                result.append(outcome.Error(exc))
            finally:
                done.set()

        self._nursery.start_soon(run)
        await done.wait()
        if not result:
            raise FetchStopped("the fetch was stopped (unmounting)")
        return result[0].unwrap()

    async def ensure_chunk(self, cf: CachedFile, idx: int, written_back: bool = False) -> None:
        """Make chunk `idx` readable from the cache file, fetching it from S3 if needed.

        A chunk of BUFFER_SIZE or more stays fresh in the page cache (see the module);
        with `written_back` (a warm-up: nobody waits) it is written back at once, before
        it counts as cached. On a cache disk too full for the chunk, clean chunks are
        evicted for it first (or uploads waited for), as for a write (`DiskRoom`): the GET
        failed with ENOSPC on a disk full of clean chunks (CI of b4109d5)."""
        while True:
            if idx in cf.chunks:
                return
            waiting = cf.fetches.under_way.get(idx)
            if waiting is not None:
                await waiting.wait()  # a concurrent reader fetches it; share its GET
                continue
            start, end = self.base_span(cf, idx)
            if end <= start:
                self.book.new_chunk(cf, idx)  # a hole: zeros in the sparse file
                return
            if self.room.free_above_reserve() >= end - start:
                break
            await self.room.ensure(end - start)  # (then all of the above again)
        filling = self.fetching(cf, idx)  # at once: a reader arriving meanwhile shares it
        if written_back:  # a warm-up: stopped with it
            await self._fill(cf, idx, start, end, filling, written_back)
        else:
            await self._for_waiter(
                lambda: self._fill(cf, idx, start, end, filling, written_back))

    async def _fill(self, cf: CachedFile, idx: int, start: int, end: int, filling: _Filling,
                    written_back: bool) -> None:
        with filling:
            async with self._fetch_slots, self.files.io(cf) as fd:
                self._busy_at = trio.current_time()
                spilled = cf.spills.get(idx)
                if spilled is not None:
                    await self._get_spilled_into(fd, cf, idx, start, end, spilled)
                    self.book.new_chunk(cf, idx)  # (its bytes are no base's: never noted)
                    return
                await self._get_base_into(fd, cf, idx, start, end)
                if written_back:  # (fetched: kept even if the warm-up is being stopped)
                    with trio.CancelScope(shield=True):
                        await trio.to_thread.run_sync(write_back, fd, start, end)
            ch = self.book.new_chunk(cf, idx)
            if end - start >= BUFFER_SIZE and not written_back:
                self.book.fresh[(cf, idx)] = (ch, cf.base.etag, trio.current_time())
                return
            self._note_fetched(cf, idx)
            ch.direct = written_back and self.files.fds.can_direct  # (O_DIRECT reads see it)

    async def _get_base_into(self, fd: int, cf: CachedFile, idx: int, start: int,
                             end: int) -> None:
        """`_get_into` from the file's committed object, checked against what its bytes
        must be (`PartTables`). A written-back rename may move that object while the GET
        is under way (its copy lands, the file is rebased, the old key is deleted): the
        GET then goes to where the object is now."""
        expect = await self.tables.expected_crc(cf, idx, start, end)
        whole = start == 0 and end == cf.base.size
        while True:
            key = cf.base.key
            assert key is not None
            try:
                return await self._get_into(fd, key, start, end, expect, whole)
            except NoSuchKey:
                if cf.base.key in (key, None):
                    raise

    async def _get_spilled_into(self, fd: int, cf: CachedFile, idx: int, start: int,
                                end: int, spilled: SpilledPart) -> None:
        """`_get_into` from the chunk's spilled part (its offset 0 is the chunk's start),
        checked against the CRC it was sent with where all of it is read."""
        assert cf.fid is not None
        expect = spilled.crc if end - start == spilled.length else None
        await self._get_into(fd, self.spills.part_key(cf, idx, spilled), 0, end - start,
                             expect, False, at=start)

    async def _get_into(self, fd: int, key: str, start: int, end: int, expect: int | None,
                        whole: bool, at: int = 0) -> None:
        """GET bytes [start, end) of `key` into the cache file at their offsets (plus
        `at`), from the GET's own thread, checked against `expect` or, for the `whole`
        object, S3's CRC of it (a mismatch is fetched again, then fails the read). Cancelled (an
        interrupted warm-up), the GET stops at its next piece instead of running to its
        end: the thread cannot be abandoned."""
        stop = threading.Event()

        def write_piece(offset: int, piece: bytes) -> None:  # in the GET's thread
            if stop.is_set():
                raise FetchStopped
            write_on_this_thread(fd, piece, offset + at)

        async def stop_when_cancelled() -> None:
            try:
                await trio.sleep_forever()
            finally:
                stop.set()

        failed: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop_when_cancelled)
            try:
                await self.store.get_range_into(key, start, end, write_piece, expect, whole)
            except FetchStopped:
                await trio.lowlevel.checkpoint()  # cancelled: raises Cancelled here
                raise
            except Exception as exc:  # S3's error as itself, not in the nursery's group
                failed = exc
            nursery.cancel_scope.cancel()
        if failed is not None:
            raise failed

    def read_ahead_of(self, cf: CachedFile, last: int) -> None:
        """A sequential reader: fetch the next chunks in parallel before it asks."""
        if self._nursery is None or cf.base.key is None:
            return
        stop = min(last + 1 + self.read_ahead,  # (none past the file's end: truncated, the
                   self.parts.chunk_count(min(cf.base.size, cf.size)))  # rest is not its)
        for idx in range(last + 1, stop):
            if idx not in cf.chunks and idx not in cf.fetches.under_way:
                self._nursery.start_soon(self._prefetch, cf, idx)

    async def _prefetch(self, cf: CachedFile, idx: int) -> None:
        try:
            await self.ensure_chunk(cf, idx)
        except Exception as exc:  # the reader itself will fetch (and report) it
            log.debug("readahead of %s chunk %d failed: %s", cf.key, idx, exc)

    def _note_fetched(self, cf: CachedFile, idx: int) -> None:
        """Chunk `idx` holds the committed object's bytes: the next mount may reuse it."""
        if cf.base.key is not None and cf.base.etag is not None and cf.fid is not None:
            self.journal.note_clean_later(cf.fid, cf.base.key, cf.base.etag, cf.base.size,
                                          [idx])

    def read_through(self, cf: CachedFile, idx: int) -> None:
        """A reader read fresh chunk `idx` to its end: it has served its reader. Written
        back once the reads pause (`run`), or at once when the files read since the last
        pause, or the chunks waiting so, are larger than READ_THROUGH_MAX (the oldest
        go first)."""
        if (cf, idx) not in self.book.fresh or (cf, idx) in self._read_through:
            return
        self._busy_at = trio.current_time()
        start, end = self.base_span(cf, idx)  # (a file's last chunk: its bytes, not a part)
        size = end - start
        self._read_through[(cf, idx)] = size
        self._read_through_bytes += size
        if cf not in self._reading:
            self._reading.add(cf)
            self._reading_bytes += cf.base.size
        limit = READ_THROUGH_MAX if self._reading_bytes <= READ_THROUGH_MAX else 0
        while self._read_through_bytes > limit:
            self.settle_soon(*next(iter(self._read_through)))

    def settle_soon(self, cf: CachedFile, idx: int) -> None:
        waited = self._read_through.pop((cf, idx), None)
        if waited is not None:
            self._read_through_bytes -= waited
        entry = self.book.fresh.pop((cf, idx), None)
        if entry is not None and self._nursery is not None:
            self._settling += 1
            self._nursery.start_soon(self._settle, cf, idx, entry[0], entry[1])

    async def _settle(self, cf: CachedFile, idx: int, ch: Chunk, etag: str | None) -> None:
        """A fresh chunk goes to disk and out of the page cache, then into the journal and
        to O_DIRECT reads, unless it changed meanwhile (written, evicted, or a new version
        in S3): then the journal does not note it."""
        try:
            if cf.chunks.get(idx) is not ch:  # evicted, or its file removed, meanwhile
                return
            with trio.CancelScope(shield=True):  # (an unmount waits for it)
                start, end = self.base_span(cf, idx)
                async with self.files.io(cf) as fd:
                    await trio.to_thread.run_sync(write_back, fd, start, end,
                                                  limiter=self._settle_slots)
        except OSError as exc:  # stays readable from the page cache, not reused after this mount
            log.warning("writing chunk %d of %s back to the cache disk: %s", idx, cf.key, exc)
            return
        finally:
            self._settling -= 1
        if cf.chunks.get(idx) is ch and ch.state is ChunkState.CLEAN and etag == cf.base.etag:
            self._note_fetched(cf, idx)
            ch.direct = self.files.fds.can_direct

    async def fetch_chunk(self, cf: CachedFile, idx: int) -> int:
        """Cache chunk `idx` of `cf` ahead of any reader (a warm-up); returns the bytes
        fetched from S3 for it (0 if it was cached). Nobody waits for a page of it, so
        it is written back as a whole (faster here than in O_DIRECT pieces)."""
        fetched = 0
        if idx not in cf.chunks:
            waited = idx in cf.fetches.under_way  # a reader's GET: that one counts it
            start, end = self.base_span(cf, idx)
            await self.room.ensure(end - start)  # evicts clean data of others
            await self.ensure_chunk(cf, idx, written_back=True)
            fetched = 0 if waited else end - start
        self.book.budget.touch((cf, idx))
        return fetched

    async def fetch_small_object(self, cf: CachedFile) -> ObjectInfo | None:
        """GET a small object whole at lookup (its open usually follows), for its metadata
        and its bytes: they go into the cache file as chunk 0 from the GET's own thread,
        so the read that follows sends no GET and the loop never handles the bytes."""
        expected = cf.base.size
        if (cf.pending or cf.chunks or cf.fetches.under_way or cf.base.key is None
                or not 0 < expected <= self.parts.chunk_range(0)[1]):
            return await self.store.head(cf.base.key or cf.key)
        filling = self.fetching(cf, 0)  # writers of chunk 0 wait, as for any fetch
        return await self._for_waiter(lambda: self._fetch_small(cf, filling))

    async def _fetch_small(self, cf: CachedFile, filling: _Filling) -> ObjectInfo | None:
        expected = cf.base.size
        assert cf.base.key is not None
        with filling:
            async with self._fetch_slots, self.files.io(cf) as fd:
                def keep(body: bytes) -> bool:  # in the GET's thread
                    if len(body) != expected:
                        return False  # changed in S3: the read fetches what it needs
                    try:
                        write_on_this_thread(fd, body, 0)
                    except OSError as exc:  # e.g. a full cache disk: the read fetches it
                        log.debug("not caching %s at lookup: %s", cf.key, exc)
                        return False
                    return True

                try:
                    got = await self.store.get_whole(cf.key, keep)
                except CorruptRead:  # (counted and logged): the read fetches and checks it
                    return await self.store.head(cf.key)
            if got is None:
                return None
            info, kept = got
            if kept and info.etag == cf.base.etag and not cf.pending and cf.fid is not None:
                self.journal.note_clean_later(cf.fid, cf.base.key, info.etag, expected, [0])
                self.book.new_chunk(cf, 0)
            return info

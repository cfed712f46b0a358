"""The write-back chunk cache: file content on local disk, the journal, and the flusher's inputs.

The filesystem layer calls `CacheManager` with `CachedFile`s; it never sees S3 keys of
chunks, parts or the journal. Rules kept here (docs/durability.md):
- intent before write: a chunk is journalled dirty before bytes in it are acknowledged;
- a partial write into a chunk of a committed object first fills the chunk from S3;
- a dirty chunk is never dropped; it leaves the cache only as a part or object in S3.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import TypeVar

import trio

from lakefs_mount import metrics as m
from lakefs_mount.cache.budget import CacheBudget
from lakefs_mount.cache.cachefile import (
    DIRTY_STATES,
    CachedFile,
    Chunk,
    ChunkState,
)
from lakefs_mount.cache.direct import (
    BUFFER_SIZE,
    DIRECT_WRITE_MIN,
    AlignedBuffers,
    aligned,
    round_up,
    split_aligned,
    write_back,
)
from lakefs_mount.cache.fdtable import FdTable
from lakefs_mount.cache.journal import AsyncJournal, CleanNote, PendingFile
from lakefs_mount.cache.partbody import UploadSource, crc_of
from lakefs_mount.cache.passthrough import Passthrough
from lakefs_mount.cache.warm import WarmCache
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.layout import PartMap
from lakefs_mount.s3.objectstore import ObjectInfo
from lakefs_mount.uring import FALLOC_PUNCH_HOLE, IoEngine, write_on_this_thread

log = logging.getLogger(__name__)
T = TypeVar("T", bound=bytes | memoryview)

ENOSPC_PATIENCE = 60.0  # seconds a writer waits for uploads to free a full cache disk
FID_BLOCK = 1024
JOURNAL_RESERVE = 32 * 1024 * 1024  # free space kept for the journal (10 % on tiny disks)
NOTES_EVERY = 1.0  # seconds a note of a fetched chunk may wait for the next journal call
FRESH_FOR = 5.0  # seconds a fetched chunk may stay in the page cache with no reader past it
SETTLE_THREADS = 4  # fetched chunks being written back to disk at once


class CacheManager:
    def __init__(self, cache_dir: Path, engine: IoEngine, journal: AsyncJournal,
                 store: AsyncStore, parts: PartMap, metrics: m.Metrics, *,
                 max_dirty: int, cache_size: int = 1 << 62, read_ahead: int = 4,
                 open_files: int = 1024, direct_io: bool = True) -> None:
        self.data_dir = cache_dir / "data"
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.fds = FdTable(open_files, direct_io)  # cache files kept open between I/Os
        self._buffers = AlignedBuffers()
        self.engine = engine
        self.journal = journal
        self.store = store
        self.parts = parts
        self.metrics = metrics
        self.max_dirty = max_dirty
        self.dirty_bytes = 0
        self._dirty_changed = trio.Condition()
        self.files: dict[int, CachedFile] = {}  # by fid: every file with a cache file
        self.budget = CacheBudget(cache_size)
        self.read_ahead = read_ahead
        self._fetch_slots = trio.Semaphore(2 * read_ahead + 8)  # GETs in flight (1 MiB each)
        self._punch_slots = trio.CapacityLimiter(32)  # holes being punched by an eviction
        self._nursery: trio.Nursery | None = None
        self._evicting = False
        self._free_fids: Iterator[int] | None = None
        # Fetched chunks a reader waits for: in the page cache, not yet on disk or in the
        # journal (see `_ensure_chunk`); with S3's ETag they were fetched at and when.
        self._fresh: dict[tuple[CachedFile, int], tuple[Chunk, str | None, float]] = {}
        self._settle_slots = trio.CapacityLimiter(SETTLE_THREADS)
        self._settling = 0
        self.warm = WarmCache(journal, self.budget, parts, self.cache_path)
        self.passthrough = Passthrough(self)
        # Set by the flusher: called when a full chunk can go up while writing continues.
        self.on_chunk_full: Callable[[CachedFile, int], None] = lambda cf, idx: None
        self.on_pressure: Callable[[], None] = lambda: None
        self.uploads_busy: Callable[[], bool] = lambda: False

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Owns the background work of the cache: readahead, eviction, writing back fetched
        chunks nobody read to their end within FRESH_FOR seconds, writing the journal's
        notes of fetched chunks at least every NOTES_EVERY seconds, and streaming what
        passthrough writers wrote."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self.passthrough.run)
            await self.keep_journal_reserve()
            task_status.started()
            while True:
                await trio.sleep(NOTES_EVERY)
                await self.keep_journal_reserve()
                stale = trio.current_time() - FRESH_FOR
                for ref in [r for r, (_, _, at) in self._fresh.items() if at < stale]:
                    self._settle_soon(*ref)
                await self.journal.write_notes()

    async def settle_all(self) -> None:
        """Before unmounting: every fetched chunk still only in the page cache goes to disk
        and into the journal, so that the next mount reuses it."""
        for ref in list(self._fresh):
            self._settle_soon(*ref)
        while self._settling:
            await trio.sleep(0.01)

    # -- the warm cache a previous mount left ----------------------------------------

    async def load_warm(self) -> None:
        await self.warm.load(self.data_dir)

    def adopt_warm(self, cf: CachedFile) -> None:
        """A file seen in S3: if a previous mount cached this very version, reuse it."""
        entry, stale = self.warm.take(cf)
        if stale is not None and self._nursery is not None:
            self._nursery.start_soon(self.warm.drop, stale)
        if entry is None:
            return
        cf.fid = entry.fid
        self.files[entry.fid] = cf
        for idx in entry.chunks:
            held = self.parts.held_bytes(idx, entry.size)  # as the warm cache counted it
            if idx < self.parts.chunk_count(cf.size):
                cf.chunks[idx] = Chunk(ChunkState.CLEAN, held=held, direct=True)
                self.budget.clean((cf, idx), held)
            else:
                self.budget.removed(held)

    def _forget_cached_later(self, cf: CachedFile) -> None:
        if cf.fid is not None and self._nursery is not None:
            self._nursery.start_soon(self.journal, self.journal.sync.forget_cached, cf.fid)

    def clean_note(self, cf: CachedFile) -> CleanNote | None:
        """The committed object is the new base: every clean cached chunk belongs to it
        (what the journal notes for the warm cache, with the commit)."""
        if cf.fid is None or cf.base_key is None or cf.base_etag is None:
            return None
        clean = [i for i, c in cf.chunks.items() if c.state is ChunkState.CLEAN]
        return cf.fid, cf.base_key, cf.base_etag, cf.base_size, clean

    # -- cache files ------------------------------------------------------------------

    def cache_path(self, fid: int) -> Path:
        return self.data_dir / str(fid)

    async def _ensure_fd(self, cf: CachedFile, direct: bool = False) -> int:
        if cf.fid is None:
            fid = next(self._free_fids, None) if self._free_fids is not None else None
            if fid is None:  # fids come in blocks: no journal round trip per new file
                self._free_fids = None
                block = await self.journal(self.journal.sync.reserve_fids, FID_BLOCK)
                self._free_fids = iter(block)
                fid = next(self._free_fids)
            if cf.fid is None:  # a concurrent task may have allocated one meanwhile
                cf.fid = fid
        if cf.fd is None:
            self.files[cf.fid] = cf
        elif not direct or cf.dfd is not None or not self.fds.can_direct:
            return self.fds.get(cf, "")  # open: no path needed (building one costs)
        path = str(self.cache_path(cf.fid))
        if direct:
            self.fds.get_direct(cf, path)  # opens the plain descriptor too
            assert cf.fd is not None
            return cf.fd
        return self.fds.get(cf, path)

    def _dfd(self, cf: CachedFile) -> int | None:
        """`cf`'s O_DIRECT descriptor, if open and O_DIRECT was not given up."""
        return cf.dfd if self.fds.can_direct else None

    def _give_up_direct(self, exc: OSError) -> None:
        """An O_DIRECT request was refused (EINVAL: e.g. a disk whose logical blocks are
        larger than ALIGN): from now on everything is buffered; the caller redoes it."""
        if exc.errno != errno.EINVAL:
            raise exc
        if self.fds.can_direct:
            log.warning("O_DIRECT I/O on the cache disk failed (%s): cache files are read "
                        "and written through the page cache from now on", exc)
            self.fds.stop_direct()

    async def _ensure_journalled(self, cf: CachedFile) -> None:
        """Give the file its row in the journal before any chunk of it is dirty."""
        if cf.in_journal or cf.unlinked:  # an unlinked file's bytes never go to S3
            return
        await self._ensure_fd(cf)
        assert cf.fid is not None
        cf.in_journal = True
        await self.journal(self.journal.sync.put_file, self.pending_record(cf))

    def pending_record(self, cf: CachedFile) -> PendingFile:
        """The journal row of `cf`, as a new intent (its generation bumped)."""
        assert cf.fid is not None
        cf.intent_gen += 1
        return PendingFile(intent_gen=cf.intent_gen,
            fid=cf.fid, key=cf.key, size=cf.size, mode=cf.mode, uid=cf.uid, gid=cf.gid,
            mtime_ns=cf.mtime_ns, base_key=cf.base_key, base_size=cf.base_size,
            upload_id=cf.upload_id, upload_key=cf.upload_key, symlink=cf.symlink, rdev=cf.rdev,
            passthrough=1 if cf.pt_writers else 0)

    async def new_file(self, cf: CachedFile) -> None:
        """A file created through the mount: pending until its first commit.

        A regular file's first chunk is journalled dirty with its row, in one transaction:
        its bytes can only come from the cache file anyway, and its first write then needs
        no journal round trip of its own (small files: one per file less).
        """
        if cf.symlink is not None:
            await self._ensure_journalled(cf)
            return
        await self._ensure_fd(cf)
        cf.in_journal = True  # the intent writes the file's row
        await self._mark_dirty(cf, [0], None)

    async def save_attrs(self, cf: CachedFile) -> None:
        """Attributes or size changed: the next commit writes them."""
        cf.version += 1
        if cf.unlinked:
            return
        await self._ensure_fd(cf)
        cf.in_journal = True
        await self.journal(self.journal.sync.put_file, self.pending_record(cf))

    async def rekey(self, cf: CachedFile, key: str, base_key: str | None) -> None:
        cf.key = key
        cf.base_key = base_key
        if cf.in_journal:
            assert cf.fid is not None
            await self.journal(self.journal.sync.rekey, cf.fid, key, base_key)
        if cf.fid is not None:
            await self.journal(self.journal.sync.rekey_cached, cf.fid, key)

    async def discard(self, cf: CachedFile) -> None:
        """The file was unlinked: forget what it still had to upload; abort its upload."""
        if cf.upload_id is not None and cf.upload_key is not None:
            upload_id, upload_key = cf.upload_id, cf.upload_key
            cf.upload_id = cf.upload_key = None
            try:
                await self.store.call(self.store.sync.abort_multipart, upload_key, upload_id)
                await self.journal(self.journal.sync.end_upload, upload_id)
            except Exception as exc:  # the orphan is aborted at the next mount
                log.warning("abort of upload for %s failed: %s", upload_key, exc)
        self._release_dirty(cf)
        if cf.in_journal and cf.fid is not None:
            await self.journal(self.journal.sync.drop_file, cf.fid)
        cf.in_journal = False
        cf.unlinked = True
        cf.version += 1

    def close_file(self, cf: CachedFile) -> None:
        """Last handle closed on an unlinked file: its cache file goes away."""
        for idx in list(cf.chunks):
            self._remove_chunk(cf, idx)
        self._forget_cached_later(cf)
        self.fds.close(cf)
        if cf.fid is not None:
            self.files.pop(cf.fid, None)
            self.cache_path(cf.fid).unlink(missing_ok=True)

    @asynccontextmanager
    async def _io(self, cf: CachedFile, direct: bool = False) -> AsyncIterator[int]:
        """The cache file's descriptor, kept open while an engine request uses it; with
        `direct`, its O_DIRECT twin `cf.dfd` too (None where there is none)."""
        fd = await self._ensure_fd(cf, direct)
        cf.io_busy += 1
        try:
            yield fd
        finally:
            cf.io_busy -= 1

    # -- chunk bookkeeping ------------------------------------------------------------

    def _new_chunk(self, cf: CachedFile, idx: int) -> Chunk:
        ch = cf.chunks.get(idx)
        if ch is None:
            ch = cf.chunks[idx] = Chunk(ChunkState.CLEAN, held=self._held(cf, idx))
            self.budget.added(ch.held)
            self.budget.clean((cf, idx), ch.held)
            self._maybe_evict()
        return ch

    def _held(self, cf: CachedFile, idx: int) -> int:
        return self.parts.held_bytes(idx, max(cf.size, cf.base_size))

    def _grow_held(self, cf: CachedFile, indices: range) -> None:
        """The file grew into these chunks: their new bytes count against the budgets."""
        grew = False
        for idx in indices:
            ch = cf.chunks.get(idx)
            held = self._held(cf, idx) if ch is not None else 0
            if ch is None or held <= ch.held:
                continue
            delta, ch.held, grew = held - ch.held, held, True
            self.budget.added(delta)
            if ch.state in DIRTY_STATES:
                self._account(delta)
            elif ch.state is ChunkState.CLEAN:
                self.budget.clean((cf, idx), held)
        if grew:
            self._maybe_evict()

    def _remove_chunk(self, cf: CachedFile, idx: int) -> None:
        ch = cf.chunks.get(idx)
        if ch is None:
            return
        self._fresh.pop((cf, idx), None)
        self.set_state(cf, ch, idx, ChunkState.CLEAN)
        del cf.chunks[idx]
        self.budget.not_clean((cf, idx))
        self.budget.removed(ch.held)

    def invalidate(self, cf: CachedFile) -> None:
        """The object changed in S3: cached clean bytes of the old version are void."""
        for idx in [i for i, c in cf.chunks.items() if c.state is ChunkState.CLEAN]:
            self._remove_chunk(cf, idx)
        self._forget_cached_later(cf)

    def _maybe_evict(self) -> None:
        if self.budget.over and not self._evicting and self._nursery is not None:
            self._evicting = True
            self._nursery.start_soon(self._evict)

    async def _evict(self) -> None:
        """Punch out least recently used clean chunks until the cache fits its budget."""
        try:
            while self.budget.over:
                if not await self.evict_bytes(self.budget.over + self.budget.capacity // 10):
                    return  # only dirty or pinned data left: writers wait on --max-dirty
        finally:
            self._evicting = False

    async def evict_bytes(self, nbytes: int) -> int:
        """Evict at least `nbytes` of clean chunks if there are that many; returns bytes freed.

        The victims go in one batch: one journal transaction for all of them, then their
        holes punched concurrently. A chunk at a time cost two round trips each, which a
        training set of small files (a chunk each) turns into thousands.
        """
        victims: list[tuple[CachedFile, int]] = []
        freed = 0
        for cf, idx in self.budget.victims(nbytes):
            ch = cf.chunks.get(idx)
            if self.budget.pinned((cf, idx)) or cf.unlinked or cf.pt_opens:
                continue  # in use (by the kernel itself in passthrough), or the only
                # copy left of an unlinked open file
            if ch is None or ch.state is not ChunkState.CLEAN or idx in cf.fetching:
                self.budget.not_clean((cf, idx))
                continue
            victims.append((cf, idx))
            freed += ch.held
        if not victims:
            return 0
        busy = trio.Event()  # readers and writers of these chunks wait for the holes
        for cf, idx in victims:
            cf.fetching[idx] = busy
            self._remove_chunk(cf, idx)
        try:
            await self.journal(self.journal.sync.drop_clean_many,
                               [(cf.fid, idx) for cf, idx in victims if cf.fid is not None])
            async with trio.open_nursery() as nursery:
                for cf, idx in victims:
                    nursery.start_soon(self._punch, cf, idx)
            self.metrics[m.CACHE_EVICTIONS] += len(victims)
        finally:
            for cf, idx in victims:
                del cf.fetching[idx]
            busy.set()
        return freed

    async def _punch(self, cf: CachedFile, idx: int) -> None:
        start, end = self.parts.chunk_range(idx)
        async with self._punch_slots:  # an fd in use cannot be closed by the fd budget
            if cf.fid is None or not self.cache_path(cf.fid).exists():
                return
            try:
                async with self._io(cf) as fd:
                    await self.engine.fallocate(fd, FALLOC_PUNCH_HOLE, start, end - start)
            except OSError as exc:  # the bytes stay on disk; the journal no longer uses them
                log.warning("evicting chunk %d of %s: %s", idx, cf.key, exc)

    # -- reading ----------------------------------------------------------------------

    async def read(self, cf: CachedFile, offset: int, size: int) -> bytes:
        return await self._read(cf, offset, size, self._read_cached)

    async def read_lent(self, cf: CachedFile, offset: int, size: int) -> bytes | memoryview:
        """`read` for a reply to the kernel: an aligned read of chunks stored with O_DIRECT
        skips the page cache too (see `direct`) and comes back as a read-only view of a
        reused buffer, which returns to the pool once that view is dropped. So the caller
        hands the view on whole and keeps no slice of it."""
        return await self._read(cf, offset, size, self._read_lent)

    async def _read(self, cf: CachedFile, offset: int, size: int,
                    read_cached: Callable[[CachedFile, int, int], Awaitable[T]]) -> T | bytes:
        end = min(cf.size, offset + size)
        if end <= offset:
            return b""
        touched = self.parts.chunks_between(offset, end)
        sequential = offset == cf.read_next or offset == 0
        cf.read_next = end
        if sequential:
            self._read_ahead(cf, touched[-1])
        with self._pinned(cf, touched):
            for idx in touched:
                await self._ensure_chunk(cf, idx)
                self.budget.touch((cf, idx))
            data = await read_cached(cf, offset, end)
        if self._fresh:  # a fetched chunk read to its end has served its reader
            for idx in touched:
                if end >= min(self.parts.chunk_range(idx)[1], cf.size):
                    self._settle_soon(cf, idx)
        return data

    def holds(self, cf: CachedFile, start: int, end: int) -> bool:
        """True if bytes [start, end) can be read without a GET."""
        return all(idx in cf.chunks for idx in self.parts.chunks_between(start, end))

    @contextmanager
    def _pinned(self, cf: CachedFile, indices: range | list[int]) -> Iterator[None]:
        """Chunks in use by a read or write: eviction leaves them alone."""
        refs = [(cf, idx) for idx in indices]
        for ref in refs:
            self.budget.pin(ref)
        try:
            yield
        finally:
            for ref in refs:
                self.budget.unpin(ref)

    def _read_ahead(self, cf: CachedFile, last: int) -> None:
        """A sequential reader: fetch the next chunks in parallel before it asks."""
        if self._nursery is None or cf.base_key is None:
            return
        stop = min(last + 1 + self.read_ahead, self.parts.chunk_count(cf.base_size))
        for idx in range(last + 1, stop):
            if idx not in cf.chunks and idx not in cf.fetching:
                self._nursery.start_soon(self._prefetch, cf, idx)

    async def _prefetch(self, cf: CachedFile, idx: int) -> None:
        try:
            await self._ensure_chunk(cf, idx)
        except Exception as exc:  # the reader itself will fetch (and report) it
            log.debug("readahead of %s chunk %d failed: %s", cf.key, idx, exc)

    async def _read_cached(self, cf: CachedFile, start: int, end: int) -> bytes:
        """Bytes [start, end) of the cache file; holes and a short cache file read as zeros."""
        async with self._io(cf) as fd:
            data = await self.engine.read(fd, end - start, start)
        if len(data) < end - start:
            data += bytes(end - start - len(data))
        return data

    async def _read_lent(self, cf: CachedFile, start: int, end: int) -> bytes | memoryview:
        """`_read_cached`, but an aligned range of up to BUFFER_SIZE in chunks that went to
        disk with O_DIRECT comes back with O_DIRECT, into a lent buffer."""
        buf = await self._read_direct(cf, start, end)
        if buf is None:
            return await self._read_cached(cf, start, end)
        return self._buffers.lend(buf, end - start)

    @asynccontextmanager
    async def part_reader(self, cf: CachedFile, start: int,
                          end: int) -> AsyncIterator[UploadSource]:
        """The cache file of [start, end) for the thread that uploads it, which reads it
        (or sends it) itself: no hop into the loop per piece. Meanwhile the chunks stay
        cached (fetched first where they are not: a base object's bytes) and pinned, the
        descriptors open; what went to disk with O_DIRECT comes back the same way."""
        touched = self.parts.chunks_between(start, end)
        with self._pinned(cf, touched):
            for idx in touched:
                await self._ensure_chunk(cf, idx)
            direct = aligned(start) and cf.all_direct(touched)
            async with self._io(cf, direct) as fd:
                yield UploadSource(fd, self._dfd(cf) if direct else None)

    async def _read_direct(self, cf: CachedFile, start: int, end: int) -> mmap.mmap | None:
        """Bytes [start, end) in an aligned buffer, read with O_DIRECT if its chunks were
        stored that way (through the page cache where one is fresh, see `_ensure_chunk`);
        None if they were not (or the range is unaligned or too long). (Trying the page
        cache first is no way to tell: preadv2(RWF_NOWAIT) starts the readahead it
        avoids.)"""
        size = end - start
        touched = self.parts.chunks_between(start, end)
        fresh = bool(self._fresh) and any((cf, idx) in self._fresh for idx in touched)
        if size > BUFFER_SIZE or not aligned(start) or not (fresh or cf.all_direct(touched)):
            return None
        buf = self._buffers.take()
        with memoryview(buf) as view:  # a failed or cancelled read may leave the kernel
            async with self._io(cf, direct=True) as fd:  # writing: then buf is dropped
                got = -1
                if not fresh and (dfd := self._dfd(cf)) is not None:
                    try:
                        got = await self.engine.read_into(dfd, view[:round_up(size)], start)
                    except OSError as exc:
                        self._give_up_direct(exc)
                if got < 0:
                    got = await self.engine.read_into(fd, view[:size], start)
            if got < size:
                view[got:size] = bytes(size - got)
        return buf

    def _base_span(self, cf: CachedFile, idx: int) -> tuple[int, int]:
        """The part of chunk `idx` that the committed object holds (empty if none)."""
        start, end = self.parts.chunk_range(idx)
        if cf.base_key is None:
            return start, start
        return start, max(start, min(end, cf.base_size))

    async def fetch_small_object(self, cf: CachedFile) -> ObjectInfo | None:
        """GET a small object whole at lookup (its open usually follows), for its metadata
        and its bytes: they go into the cache file as chunk 0 from the GET's own thread,
        so the read that follows sends no GET and the loop never handles the bytes."""
        expected = cf.base_size
        if (cf.pending or cf.chunks or cf.fetching or cf.base_key is None
                or not 0 < expected <= self.parts.chunk_range(0)[1]):
            return await self.store.head(cf.key)
        with self._fetching(cf, 0):  # writers of chunk 0 wait, as for any fetch
            async with self._fetch_slots, self._io(cf) as fd:
                def keep(body: bytes) -> bool:  # in the GET's thread
                    if len(body) != expected:
                        return False  # changed in S3: the read fetches what it needs
                    try:
                        write_on_this_thread(fd, body, 0)
                    except OSError as exc:  # e.g. a full cache disk: the read fetches it
                        log.debug("not caching %s at lookup: %s", cf.key, exc)
                        return False
                    return True

                got = await self.store.get_whole(cf.key, keep)
            if got is None:
                return None
            info, kept = got
            if kept and info.etag == cf.base_etag and not cf.pending and cf.fid is not None:
                self.journal.note_clean_later(cf.fid, cf.base_key, info.etag, expected, [0])
                self._new_chunk(cf, 0)
            return info

    async def _ensure_chunk(self, cf: CachedFile, idx: int, written_back: bool = False) -> None:
        """Make chunk `idx` readable from the cache file, fetching it from S3 if needed.

        The bytes go into the page cache. A chunk of 1 MiB or more that a reader waits for
        stays there until a read reaches its end (or FRESH_FOR seconds pass), so the
        reader takes it from memory; then it is written back to disk and dropped from the
        page cache, and only then noted in the journal (`_settle`). Reading each chunk back
        from the cache disk while the disk wrote the next ones cost a cold restore of
        8 x 256 MiB about a fifth of its speed here (0.26-0.34 against 0.36-0.42 GiB/s).
        With `written_back` (a warm-up: nobody waits) the chunk is written back at once,
        before it counts as cached."""
        while True:
            if idx in cf.chunks:
                return
            waiting = cf.fetching.get(idx)
            if waiting is None:
                break
            await waiting.wait()  # a concurrent reader fetches it; share its GET
        start, end = self._base_span(cf, idx)
        if end <= start:
            self._new_chunk(cf, idx)  # a hole: zeros in the sparse file
            return
        with self._fetching(cf, idx):
            assert cf.base_key is not None
            async with self._fetch_slots, self._io(cf) as fd:
                def write_piece(offset: int, piece: bytes) -> None:  # in the GET's thread
                    write_on_this_thread(fd, piece, offset)

                await self.store.get_range_into(cf.base_key, start, end, write_piece)
                if written_back:  # (fetched: kept even if the warm-up is being stopped)
                    with trio.CancelScope(shield=True):
                        await trio.to_thread.run_sync(write_back, fd, start, end)
            ch = self._new_chunk(cf, idx)
            if end - start >= BUFFER_SIZE and not written_back:
                self._fresh[(cf, idx)] = (ch, cf.base_etag, trio.current_time())
                return
            self._note_fetched(cf, idx)
            ch.direct = written_back and self.fds.can_direct  # (on disk: O_DIRECT reads see it)

    def _note_fetched(self, cf: CachedFile, idx: int) -> None:
        """Chunk `idx` holds the committed object's bytes: the next mount may reuse it."""
        if cf.base_key is not None and cf.base_etag is not None and cf.fid is not None:
            self.journal.note_clean_later(cf.fid, cf.base_key, cf.base_etag, cf.base_size,
                                          [idx])

    def _settle_soon(self, cf: CachedFile, idx: int) -> None:
        entry = self._fresh.pop((cf, idx), None)
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
                start, end = self._base_span(cf, idx)
                async with self._io(cf) as fd:
                    await trio.to_thread.run_sync(write_back, fd, start, end,
                                                  limiter=self._settle_slots)
        except OSError as exc:  # stays readable from the page cache, not reused after this mount
            log.warning("writing chunk %d of %s back to the cache disk: %s", idx, cf.key, exc)
            return
        finally:
            self._settling -= 1
        if cf.chunks.get(idx) is ch and ch.state is ChunkState.CLEAN and etag == cf.base_etag:
            self._note_fetched(cf, idx)
            ch.direct = self.fds.can_direct

    async def fetch_chunk(self, cf: CachedFile, idx: int) -> int:
        """Cache chunk `idx` of `cf` ahead of any reader (a warm-up); returns the bytes
        fetched from S3 for it (0 if it was cached). Nobody waits for a page of it, so
        it is written back as a whole (faster here than in O_DIRECT pieces)."""
        fetched = 0
        if idx not in cf.chunks:
            waited = idx in cf.fetching  # a reader's GET: that one counts it
            start, end = self._base_span(cf, idx)
            await self._ensure_disk_room(end - start)  # evicts clean data of others
            await self._ensure_chunk(cf, idx, written_back=True)
            fetched = 0 if waited else end - start
        self.budget.touch((cf, idx))
        return fetched

    @contextmanager
    def _fetching(self, cf: CachedFile, idx: int) -> Iterator[None]:
        """Chunk `idx` is being filled: readers share the fill, writers wait for it."""
        done = cf.fetching[idx] = trio.Event()
        try:
            yield
        finally:
            del cf.fetching[idx]
            done.set()

    # -- writing ----------------------------------------------------------------------

    async def write(self, cf: CachedFile, offset: int, data: bytes | memoryview) -> int:
        end = offset + len(data)
        if end <= offset:
            return 0
        touched = self.parts.chunks_between(offset, end)
        with self._pinned(cf, touched):
            return await self._write_pinned(cf, offset, end, data, touched)

    async def _write_pinned(self, cf: CachedFile, offset: int, end: int,
                            data: bytes | memoryview, touched: range) -> int:
        for idx in touched:
            while idx in cf.fetching:  # a fetch or an eviction of this chunk is under way
                await cf.fetching[idx].wait()
            if idx not in cf.chunks:
                bstart, bend = self._base_span(cf, idx)
                if bend > bstart and not (offset <= bstart and end >= bend):
                    await self._ensure_chunk(cf, idx)  # keep the bytes the write leaves
        grows_from = cf.size if end > cf.size else None
        await self._mark_dirty(cf, list(touched), grows_from)
        await self._write_room_permitting(cf, data, offset)
        for idx in touched:
            cf.chunks[idx].gen += 1
        if end > cf.size:
            cf.size = end
            self._grow_held(cf, touched)
        cf.version += 1
        first = touched[0]
        if first > 0:
            prev = cf.chunks.get(first - 1)
            if prev is not None and prev.state is ChunkState.DIRTY:
                self.on_chunk_full(cf, first - 1)
        return len(data)

    def disk_room(self, excluding: set[CachedFile]) -> int:
        """Bytes the cache disk can take in: free space above the journal's reserve, plus
        the clean chunks eviction can free (leaving out those of `excluding`)."""
        return max(0, self._free_above_reserve()) + self.budget.clean_bytes(excluding)

    def _free_above_reserve(self) -> int:
        """Free bytes of the cache disk beyond the journal's reserve (the part of it not yet
        allocated to the journal's files still counts as the reserve's)."""
        st = os.statvfs(self.data_dir)
        missing = self._reserve_size(st) - self.journal.sync.reserve_held()
        return st.f_bavail * st.f_frsize - max(0, missing)

    @staticmethod
    def _reserve_size(st: os.statvfs_result) -> int:
        return min(JOURNAL_RESERVE, st.f_blocks * st.f_frsize // 10)

    async def keep_journal_reserve(self) -> None:
        """Hold the journal's reserve on the cache disk (again, once SQLite has grown into
        it), evicting clean chunks to make room if it must. Never fatal: the cache
        directory may be gone from under a live mount (writes then fail and say so)."""
        try:
            st = os.statvfs(self.data_dir)
        except OSError:
            return
        wanted = self._reserve_size(st)
        held = self.journal.sync.reserve_held()
        if held >= wanted:
            return
        short = wanted - held - st.f_bavail * st.f_frsize
        if short > 0 and not await self.evict_bytes(short):
            return
        try:
            await self.journal(self.journal.sync.arm_reserve, wanted)
        except OSError as exc:
            log.debug("journal reserve not held: %s", exc)

    async def _ensure_disk_room(self, needed: int) -> None:
        """Before new dirty chunks (or a warm-up's fetch): room for them plus a reserve the
        journal always keeps.

        The journal must never be the thing that hits a full disk: an intent that cannot
        be recorded would leave a write that cannot be acknowledged safely.
        """
        deadline = trio.current_time() + ENOSPC_PATIENCE
        while True:
            free = self._free_above_reserve()
            if free >= needed:
                return
            self.metrics[m.CACHE_FULL_WAITS] += 1
            if await self.evict_bytes(needed - free):
                continue
            if trio.current_time() > deadline or not self.uploads_busy():
                log.error("cache disk %s is full: nothing left to evict or upload",
                          self.data_dir)
                raise OSError(errno.ENOSPC, "cache disk full")
            self.on_pressure()
            await trio.sleep(0.2)

    async def _write_room_permitting(self, cf: CachedFile, data: bytes | memoryview,
                                     offset: int) -> None:
        """A full cache disk: evict clean data, then wait for uploads; ENOSPC only after that.

        The chunk is journalled dirty already; a failed write leaves its old bytes (fetched
        before) or zeros in the cache file, which is what a short write promises anyway.
        """
        deadline = trio.current_time() + ENOSPC_PATIENCE
        while True:
            try:
                await self._write_cache_file(cf, data, offset)
                return
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                self.metrics[m.CACHE_FULL_WAITS] += 1
                if await self.evict_bytes(2 * len(data) + self.parts.part_size):
                    continue
                if trio.current_time() > deadline or not self.uploads_busy():
                    log.error("cache disk full: nothing left to evict or upload for %s", cf.key)
                    raise
                self.on_pressure()
                await trio.sleep(0.2)

    async def _write_cache_file(self, cf: CachedFile, data: bytes | memoryview,
                                offset: int) -> None:
        """Write into the cache file: the whole pages of a write of DIRECT_WRITE_MIN up to
        BUFFER_SIZE with O_DIRECT (copied into an aligned buffer), which also marks its
        chunks for O_DIRECT reads; the rest, and smaller or larger writes, buffered."""
        view = memoryview(data).cast("B")
        head, body = split_aligned(offset, len(view))
        direct = DIRECT_WRITE_MIN <= body and len(view) <= BUFFER_SIZE
        async with self._io(cf, direct) as fd:
            dfd = self._dfd(cf) if direct else None
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
                    self._give_up_direct(exc)
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
                with self._pinned(cf, [last]):
                    await self._ensure_chunk(cf, last)
                    await self._mark_dirty(cf, [last], None)
            first_gone = self.parts.chunk_count(size)
            for idx in [i for i in cf.chunks if i >= first_gone]:
                self._remove_chunk(cf, idx)
            if cf.in_journal:
                assert cf.fid is not None
                await self.journal(self.journal.sync.drop_chunks_from, cf.fid, first_gone)
            fd = await self._ensure_fd(cf)
            os.ftruncate(fd, size)  # metadata-only; never blocks on data
        else:
            await self._mark_dirty(cf, [], old)
            fd = await self._ensure_fd(cf)
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # the cache file's length is what recovery trusts
        cf.size = size
        if size > old:
            self._grow_held(cf, self.parts.chunks_between(max(old - 1, 0), size))
        await self.save_attrs(cf)

    async def take_over_written(self, cf: CachedFile, size: int,
                                keep: frozenset[int] = frozenset()) -> None:
        """The kernel wrote the cache file directly (FUSE passthrough) and it is now `size`
        bytes long: every chunk but those in `keep` (uploaded parts that still hold what the
        file holds) is dirty, journalled in one transaction, which also records whether
        passthrough writers remain."""
        count = self.parts.chunk_count(size)
        for idx in [i for i in cf.chunks if i >= count]:
            self._remove_chunk(cf, idx)
        cf.size = size
        indices = [i for i in range(count) if i not in keep]
        await self._ensure_fd(cf)
        assert cf.fid is not None
        await self.journal(self.journal.sync.mark_dirty, self.pending_record(cf), indices)
        cf.in_journal = True
        for idx in indices:
            ch = self._new_chunk(cf, idx)
            ch.gen += 1  # an upload of it in flight no longer counts
            ch.direct = False  # in the page cache: read it back buffered
            if ch.state is not ChunkState.DIRTY:
                self.set_state(cf, ch, idx, ChunkState.DIRTY)
        self._grow_held(cf, range(count))
        cf.version += 1
        cf.page_cache_etag = None  # the FUSE page cache of the file may be stale

    async def stream_written(self, cf: CachedFile, indices: list[int]) -> None:
        """Chunks a passthrough writer has left behind: dirty (journalled first), and to
        the flusher now, while the writer goes on."""
        await self._mark_dirty(cf, indices, None)
        for idx in indices:
            ch = cf.chunks[idx]
            ch.direct = False  # in the page cache: read it back buffered
            self.on_chunk_full(cf, idx)

    async def cached_crc(self, cf: CachedFile, start: int, end: int) -> int:
        """CRC-32C of bytes [start, end) as the cache file holds them now."""
        async with self.part_reader(cf, start, end) as source:
            return await trio.to_thread.run_sync(crc_of, source, start, end)

    def open_cache_file(self, cf: CachedFile) -> int:
        """A new descriptor of `cf`'s cache file, owned by the caller (the fd table may
        close its own at any time). Only files with a cache file (a fid) get here."""
        assert cf.fid is not None
        return self.fds.open_loose(cf, str(self.cache_path(cf.fid)))

    def set_state(self, cf: CachedFile, ch: Chunk, idx: int, state: ChunkState) -> None:
        """Every chunk state change goes through here, so dirty bytes stay exact."""
        was_dirty, dirty = ch.state in DIRTY_STATES, state in DIRTY_STATES
        ch.state = state
        ref = (cf, idx)
        if state is ChunkState.CLEAN:
            self.budget.clean(ref, ch.held)
        else:
            self.budget.not_clean(ref)
        if state is not ChunkState.UPLOADED:
            ch.etag = None
        if was_dirty != dirty:
            self._account(ch.held if dirty else -ch.held)

    async def _mark_dirty(self, cf: CachedFile, indices: list[int], grows_from: int | None) -> None:
        """Journal the chunks as dirty before the write that touches them is acknowledged."""
        if grows_from is not None and grows_from > 0:
            # Bytes past the old end were a hole; the old last chunk's part must grow too.
            tail = self.parts.chunk_of(grows_from - 1)
            if self.parts.chunk_range(tail)[1] > grows_from and tail not in indices:
                with self._pinned(cf, [tail]):
                    await self._ensure_chunk(cf, tail)
                    await self._mark_dirty(cf, [tail], None)
        for idx in indices:
            pending = cf.intent_pending.get(idx)
            if pending is not None:
                await pending.wait()
        need = [i for i in indices
                if cf.state(i) not in (ChunkState.DIRTY, ChunkState.UPLOADING)]
        if not need:
            return
        needed = sum(self._chunk_bytes(i) for i in need)
        await self._wait_for_dirty_room(needed)
        await self._ensure_disk_room(needed)
        await self._ensure_journalled(cf)
        done = trio.Event()
        for idx in need:
            cf.intent_pending[idx] = done
        try:
            assert cf.fid is not None
            if not cf.unlinked:
                await self.journal(self.journal.sync.mark_dirty, self.pending_record(cf), need)
                cf.in_journal = True
            for idx in need:
                ch = self._new_chunk(cf, idx)
                if ch.state not in DIRTY_STATES:
                    self.set_state(cf, ch, idx, ChunkState.DIRTY)
        finally:
            for idx in need:
                cf.intent_pending.pop(idx, None)
            done.set()

    def _chunk_bytes(self, idx: int) -> int:
        start, end = self.parts.chunk_range(idx)
        return end - start

    # -- dirty accounting and backpressure --------------------------------------------

    def _account(self, delta: int) -> None:
        self.dirty_bytes += delta
        if delta < 0:
            self._notify_dirty()

    def _notify_dirty(self) -> None:
        async def notify() -> None:
            async with self._dirty_changed:
                self._dirty_changed.notify_all()

        trio.lowlevel.spawn_system_task(notify)

    def chunk_committed(self, cf: CachedFile, idx: int) -> None:
        """A pending chunk reached S3 as part of a committed object: it is clean now."""
        ch = cf.chunks.get(idx)
        if ch is not None and ch.state is ChunkState.UPLOADED:
            self.set_state(cf, ch, idx, ChunkState.CLEAN)

    def _release_dirty(self, cf: CachedFile) -> None:
        for idx, ch in cf.chunks.items():
            self.set_state(cf, ch, idx, ChunkState.CLEAN)

    async def _wait_for_dirty_room(self, needed: int) -> None:
        """--max-dirty: a writer waits while the flusher drains, instead of failing."""
        waited = False
        while self.dirty_bytes + needed > self.max_dirty and self.dirty_bytes > 0:
            self.on_pressure()
            if not self.uploads_busy():
                break  # nothing can drain without this writer going on (open tails)
            if not waited:
                self.metrics[m.WRITER_WAITS] += 1
                waited = True
            async with self._dirty_changed:
                with trio.move_on_after(0.5):
                    await self._dirty_changed.wait()

    # -- durability -------------------------------------------------------------------

    async def fsync(self, cf: CachedFile, datasync: bool) -> None:
        """Local durability: the cache file and the journal reach the disk. A pending
        file's descriptor may have been closed (fds are bounded): its data is fsynced
        through a new one, since fsync acts on the file, not on the descriptor."""
        if cf.pending and cf.fid is not None:
            async with self._io(cf) as fd:
                await self.engine.fsync(fd, datasync=True)
        await self.journal(self.journal.sync.sync)

    def adopt(self, cf: CachedFile) -> None:
        """Take over a file rebuilt from the journal by recovery."""
        assert cf.fid is not None
        self.files[cf.fid] = cf
        for idx, ch in cf.chunks.items():
            ch.held = self._held(cf, idx)
            self.budget.added(ch.held)
            if ch.state in DIRTY_STATES:
                self._account(ch.held)

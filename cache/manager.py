"""The write-back chunk cache: file content on local disk, the journal, and the flusher's inputs.

The filesystem layer calls `CacheManager` with `CachedFile`s; it never sees S3 keys of
chunks, parts or the journal. Rules kept here (docs/durability.md):
- intent before write: a chunk is journalled dirty before bytes in it are acknowledged;
- a partial write into a chunk of a committed object first fills the chunk from S3;
- a dirty chunk is never dropped; it leaves the cache only as a part or object in S3.

`CacheManager` builds the parts and is the layers above's one interface to them, through
its own methods (docs/architecture.md); inside `cache/`, the flusher, uploads and recovery
call the parts it holds:
`CacheFiles` (fids, descriptors), `ChunkBook` (chunk states, dirty bytes), `Evictor`,
`DiskRoom` (the journal's reserve, waiting for space), `Fetcher` (GETs, readahead),
`Reader`, `Writer` (and the journal rows), `Passthrough`, `WarmCache`, `Spills` (parts
of files larger than the cache), and the `UploadDemand` the flusher serves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import trio

from lakefs_mount import metrics as m
from lakefs_mount.cache.asyncjournal import AsyncJournal
from lakefs_mount.cache.budget import CacheBudget
from lakefs_mount.cache.cachefile import CachedFile, Chunk, ChunkState, SpilledPart
from lakefs_mount.cache.cachefiles import CacheFiles
from lakefs_mount.cache.chunkbook import ChunkBook
from lakefs_mount.cache.demand import UploadDemand
from lakefs_mount.cache.direct import AlignedBuffers
from lakefs_mount.cache.diskroom import DiskRoom
from lakefs_mount.cache.eviction import Evictor
from lakefs_mount.cache.fdtable import FdTable
from lakefs_mount.cache.fetcher import Fetcher
from lakefs_mount.cache.journalschema import CleanNote
from lakefs_mount.cache.passthrough import Passthrough
from lakefs_mount.cache.reader import Reader
from lakefs_mount.cache.spills import Spills
from lakefs_mount.cache.stalewriters import StaleWriters
from lakefs_mount.cache.warm import WarmCache
from lakefs_mount.cache.writer import Writer
from lakefs_mount.config import HooksForTests
from lakefs_mount.filespan import SendSpan
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.layout import PartMap
from lakefs_mount.s3.objectstore import ObjectInfo
from lakefs_mount.uring import IoEngine

log = logging.getLogger(__name__)

NOTES_EVERY = 1.0  # seconds a note of a fetched chunk may wait for the next journal call


class CacheManager:
    def __init__(self, cache_dir: Path, engine: IoEngine, journal: AsyncJournal,
                 store: AsyncStore, parts: PartMap, metrics: m.Metrics, *,
                 max_dirty: int, cache_size: int = 1 << 62, read_ahead: int = 4,
                 open_files: int = 1024, direct_io: bool = True,
                 on_uploaded: Callable[[CachedFile, int], None] = lambda cf, held: None,
                 hooks: HooksForTests | None = None, prefix: str = "",
                 writer: str = "") -> None:
        """`on_uploaded`: told of the bytes of each chunk that reached S3 (status);
        `prefix`, `writer`: where this cache's spilled parts go in S3 (cache/spills)."""
        self.data_dir = cache_dir / "data"
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.engine = engine
        self.journal = journal
        self.store = store
        self.parts = parts
        self.metrics = metrics
        self.max_dirty = max_dirty
        self.read_ahead = read_ahead
        self.budget = CacheBudget(cache_size)
        self.spills = Spills(store, self.budget, prefix, writer)
        self.fds = FdTable(open_files, direct_io)  # cache files kept open between I/Os
        self.cachefiles = CacheFiles(self.data_dir, journal, self.fds)
        self.files = self.cachefiles.by_fid  # every file with a cache file, by fid
        self.demand = UploadDemand(parts, self.files)
        self.book = ChunkBook(parts, self.budget, self.demand, metrics, max_dirty,
                              on_uploaded)
        self.evictor = Evictor(self.book, self.cachefiles, journal, engine, metrics)
        self.room = DiskRoom(self.data_dir, journal, self.evictor, self.demand, metrics)
        self.fetcher = Fetcher(self.book, self.cachefiles, self.room, journal, store,
                               read_ahead, self.spills)
        buffers = AlignedBuffers()
        self.reader = Reader(self.book, self.cachefiles, self.fetcher, engine, buffers)
        self.writer = Writer(self.book, self.cachefiles, self.fetcher, self.room, journal,
                             self.demand, engine, buffers)
        self.warm = WarmCache(journal, self.budget, parts, self.cachefiles.path)
        self._nursery: trio.Nursery | None = None
        self.passthrough = Passthrough(self.cachefiles, self.book, self.room, self.reader,
                                       self.writer, parts, metrics,
                                       hooks or HooksForTests())
        self.stale_writers = StaleWriters(self.passthrough, self.cachefiles, self.demand)

    @property
    def dirty_bytes(self) -> int:
        return self.book.dirty_bytes

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Owns the background work of the cache: readahead and write-back of fetched chunks
        (the fetcher), eviction, the journal's reserve, writing the journal's notes of
        fetched chunks at least every NOTES_EVERY seconds, and streaming what passthrough
        writers wrote."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.fetcher.run, NOTES_EVERY)
            nursery.start_soon(self.evictor.run)
            nursery.start_soon(self.passthrough.run)
            nursery.start_soon(self.stale_writers.run)
            await self.room.keep_journal_reserve()
            task_status.started()
            while True:
                await trio.sleep(NOTES_EVERY)
                await self.room.keep_journal_reserve()
                await self.journal.write_notes()

    # -- what the filesystem layer asks of the cache (the parts do it) ------------------

    async def new_file(self, cf: CachedFile, passthrough: bool = False) -> None:
        await self.writer.new_file(cf, passthrough)

    async def save_attrs(self, cf: CachedFile) -> None:
        await self.writer.save_attrs(cf)

    async def write(self, cf: CachedFile, offset: int, data: bytes | memoryview) -> int:
        return await self.writer.write(cf, offset, data)

    async def truncate(self, cf: CachedFile, size: int) -> None:
        await self.writer.truncate(cf, size)

    async def read(self, cf: CachedFile, offset: int, size: int) -> bytes:
        return await self.reader.read(cf, offset, size)

    async def read_lent(self, cf: CachedFile, offset: int, size: int,
                        send: SendSpan | None = None) -> bytes | memoryview:
        return await self.reader.read_lent(cf, offset, size, send)

    def holds(self, cf: CachedFile, start: int, end: int) -> bool:
        return self.reader.holds(cf, start, end)

    async def cached_crc(self, cf: CachedFile, start: int, end: int) -> int:
        return await self.reader.cached_crc(cf, start, end)

    async def fetch_small_object(self, cf: CachedFile) -> ObjectInfo | None:
        return await self.fetcher.fetch_small_object(cf)

    async def settle_all(self) -> None:
        await self.fetcher.settle_all()

    # -- the warm cache a previous mount left ----------------------------------------

    async def load_warm(self) -> None:
        self.metrics[m.CACHE_FILES_REFUSED] += await self.warm.load(self.data_dir)

    def adopt_warm(self, cf: CachedFile) -> None:
        """A file seen in S3: if a previous mount cached this very version, reuse it."""
        entry, stale = self.warm.take(cf)
        if stale is not None and self._nursery is not None:
            self._nursery.start_soon(self.warm.drop, stale)
        if entry is None:
            return
        self.cachefiles.adopt(cf, entry.fid)
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
        (what the journal notes for the warm cache, with the commit), but those spilled
        since the commit took its parts (their bytes are newer)."""
        if cf.fid is None or cf.base.key is None or cf.base.etag is None:
            return None
        clean = [i for i, c in cf.chunks.items()
                 if c.state is ChunkState.CLEAN and i not in cf.spills]
        return cf.fid, cf.base.key, cf.base.etag, cf.base.size, clean

    # -- a file's life ------------------------------------------------------------------

    async def rekey(self, cf: CachedFile, key: str, base_key: str | None) -> None:
        cf.key = key
        cf.rebased(base_key)
        if cf.in_journal:
            assert cf.fid is not None
            await self.journal(self.journal.sync.rekey, cf.fid, key, base_key)
        if cf.fid is not None:
            await self.journal(self.journal.sync.rekey_cached, cf.fid, key)

    async def discard(self, cf: CachedFile, row_dropped: bool = False,
                      name_kept: bool = False) -> None:
        """The file was unlinked: forget what it still had to upload; abort its upload
        in the background (an unlink must not wait for S3). `row_dropped`: the caller's
        own transaction (its DELETE's) has dropped the file's journal row. `name_kept`:
        not unlinked, only its pending changes go (their base object is gone)."""
        self.detach_upload(cf)
        self.book.release_dirty(cf)
        self.forget_spills(cf)
        if cf.in_journal and cf.fid is not None and not row_dropped:
            await self.journal(self.journal.sync.drop_file, cf.fid)
        cf.discarded(unlinked=not name_kept)
        cf.changed()

    def forget_spills(self, cf: CachedFile) -> None:
        """The file's pending changes were dropped: its spilled parts go from S3 in the
        background."""
        if (cf.spills or cf.stale_spills) and cf.fid is not None:
            cf.spills.clear()
            cf.stale_spills.clear()
            if self._nursery is not None:
                self._nursery.start_soon(self.spills.remove_all, cf.fid)

    def spills_copied(self, cf: CachedFile, used: dict[int, SpilledPart]) -> list[str]:
        """A commit copied these spilled parts into the object it placed: those still
        the chunks' own are the object's bytes now. Returns the keys that may go once
        the journal has dropped their rows (`remove_spills`), the stale ones with them."""
        doomed = list(cf.stale_spills)
        cf.stale_spills.clear()
        for idx, part in used.items():
            if cf.spills.get(idx) is part:
                del cf.spills[idx]
                doomed.append((idx, part))
        return [self.spills.part_key(cf, i, p) for i, p in doomed]

    def remove_spills(self, keys: list[str]) -> None:
        if keys and self._nursery is not None:
            self._nursery.start_soon(self.spills.remove, keys)

    def detach_upload(self, cf: CachedFile) -> None:
        """Take the file's open upload off it, and abort it in the background: until the
        abort is done the upload is an orphan of the journal, which the next mount
        aborts. The caller makes the journal forget it (or drops the file's row)."""
        taken = cf.take_upload()
        if taken is not None and self._nursery is not None:
            self._nursery.start_soon(self._abort_orphan, *taken)

    async def _abort_orphan(self, upload_key: str, upload_id: str) -> None:
        try:
            # retried like data (an outage ends it; the unmount cancels it)
            await self.store.retrying(f"AbortMultipartUpload {upload_key}",
                                      self.store.sync.abort_multipart, upload_key, upload_id)
        except Exception as exc:  # the orphan is aborted at the next mount
            log.warning("abort of upload for %s failed: %s", upload_key, exc)
            return
        await self.journal(self.journal.sync.end_upload, upload_id)

    def close_file(self, cf: CachedFile) -> None:
        """Last handle closed on an unlinked file: its cache file goes away."""
        for idx in list(cf.chunks):
            self.book.remove_chunk(cf, idx)
        self._forget_cached_later(cf)
        self.cachefiles.remove(cf)

    def invalidate(self, cf: CachedFile) -> None:
        """The object changed in S3: cached clean bytes of the old version are void."""
        for idx in [i for i, c in cf.chunks.items() if c.state is ChunkState.CLEAN]:
            self.book.remove_chunk(cf, idx)
        self._forget_cached_later(cf)

    async def fsync(self, cf: CachedFile, datasync: bool) -> None:
        """Local durability: the cache file and the journal reach the disk. A pending
        file's descriptor may have been closed (fds are bounded): its data is fsynced
        through a new one, since fsync acts on the file, not on the descriptor."""
        if cf.pending and cf.fid is not None:
            async with self.cachefiles.io(cf) as fd:
                await self.engine.fsync(fd, datasync=True)
        await self.journal.durable()

    def adopt(self, cf: CachedFile) -> None:
        """Take over a file rebuilt from the journal by recovery."""
        self.cachefiles.adopt(cf)
        self.book.adopt(cf)

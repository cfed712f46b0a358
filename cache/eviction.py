"""Eviction: least recently used clean chunks leave the cache disk as punched holes.

Runs when the chunk book says the cache is over its budget, and on demand when the disk
itself is short of room (`evict_bytes`). Dirty chunks, pinned chunks, chunks the kernel
serves in passthrough and the only copy of an unlinked open file are never victims.
"""

from __future__ import annotations

import logging

import trio

from lakefs_mount import metrics as m
from lakefs_mount.cache.asyncjournal import AsyncJournal
from lakefs_mount.cache.cachefile import CachedFile, ChunkState
from lakefs_mount.cache.cachefiles import CacheFiles
from lakefs_mount.cache.chunkbook import ChunkBook
from lakefs_mount.uring import FALLOC_PUNCH_HOLE, IoEngine

log = logging.getLogger(__name__)


class Evictor:
    def __init__(self, book: ChunkBook, files: CacheFiles, journal: AsyncJournal,
                 engine: IoEngine, metrics: m.Metrics) -> None:
        self.book = book
        self.budget = book.budget
        self.parts = book.parts
        self.files = files
        self.journal = journal
        self.engine = engine
        self.metrics = metrics
        self._punch_slots = trio.CapacityLimiter(32)  # holes being punched by an eviction

    async def run(self) -> None:
        """Punch out least recently used clean chunks whenever the cache outgrows its
        budget, until it fits again (or only dirty or pinned data is left: writers then
        wait on --max-dirty)."""
        while True:
            await self.book.evict_wanted.wait()
            self.book.evict_wanted = trio.Event()
            while self.budget.over:
                if not await self.evict_bytes(self.budget.over + self.budget.capacity // 10):
                    break

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
            if self.budget.pinned((cf, idx)) or cf.unlinked or cf.pt.opens:
                continue  # in use (by the kernel itself in passthrough), or the only
                # copy left of an unlinked open file
            if ch is None or ch.state is not ChunkState.CLEAN or idx in cf.fetches.under_way:
                self.budget.not_clean((cf, idx))
                continue
            victims.append((cf, idx))
            freed += ch.held
        if not victims:
            return 0
        busy = trio.Event()  # readers and writers of these chunks wait for the holes
        for cf, idx in victims:
            cf.fetches.under_way[idx] = busy
            self.book.remove_chunk(cf, idx)
        try:
            await self.journal(self.journal.sync.drop_clean_many,
                               [(cf.fid, idx) for cf, idx in victims if cf.fid is not None])
            async with trio.open_nursery() as nursery:
                for cf, idx in victims:
                    nursery.start_soon(self._punch, cf, idx)
            self.metrics[m.CACHE_EVICTIONS] += len(victims)
        finally:
            for cf, idx in victims:
                del cf.fetches.under_way[idx]
            busy.set()
        return freed

    async def _punch(self, cf: CachedFile, idx: int) -> None:
        start, end = self.parts.chunk_range(idx)
        async with self._punch_slots:  # an fd in use cannot be closed by the fd budget
            if cf.fid is None or not self.files.path(cf.fid).exists():
                return
            try:
                async with self.files.io(cf) as fd:
                    await self.engine.fallocate(fd, FALLOC_PUNCH_HOLE, start, end - start)
            except OSError as exc:  # the bytes stay on disk; the journal no longer uses them
                log.warning("evicting chunk %d of %s: %s", idx, cf.key, exc)

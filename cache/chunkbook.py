"""The chunks of every cached file: their states, their sizes on disk, the dirty total.

Every chunk state change goes through `set_state`, so dirty bytes and the budget's list of
evictable (clean) chunks stay exact. Writers wait here while dirty data is over
--max-dirty. When cached bytes outgrow the budget, `evict_wanted` is set for the evictor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import trio

from lakefs_mount import metrics as m
from lakefs_mount.cache.budget import CacheBudget
from lakefs_mount.cache.cachefile import DIRTY_STATES, CachedFile, Chunk, ChunkState
from lakefs_mount.cache.demand import UploadDemand
from lakefs_mount.s3.layout import PartMap

# A fetched chunk a reader waits for, in the page cache and not yet on disk or in the
# journal: the chunk, S3's ETag it was fetched at, and when (see `Fetcher`).
Fresh = tuple[Chunk, str | None, float]


class ChunkBook:
    def __init__(self, parts: PartMap, budget: CacheBudget, demand: UploadDemand,
                 metrics: m.Metrics, max_dirty: int,
                 on_uploaded: Callable[[CachedFile, int], None] = lambda cf, held: None
                 ) -> None:
        self.parts = parts
        self.budget = budget
        self.demand = demand
        self.metrics = metrics
        self.max_dirty = max_dirty
        self.dirty_bytes = 0
        self._dirty_changed = trio.Condition()
        self.fresh: dict[tuple[CachedFile, int], Fresh] = {}
        self.evict_wanted = trio.Event()  # set when the cache is over its budget
        # told of each chunk whose bytes reached S3 (upload rates per directory, status)
        self.on_uploaded = on_uploaded

    def held(self, cf: CachedFile, idx: int) -> int:
        return self.parts.held_bytes(idx, max(cf.size, cf.base.size))

    def chunk_bytes(self, idx: int) -> int:
        start, end = self.parts.chunk_range(idx)
        return end - start

    def new_chunk(self, cf: CachedFile, idx: int) -> Chunk:
        """Chunk `idx` of `cf` is cached (clean) from now on, if it was not already."""
        ch = cf.chunks.get(idx)
        if ch is None:
            ch = cf.chunks[idx] = Chunk(ChunkState.CLEAN, held=self.held(cf, idx))
            self.budget.added(ch.held)
            self.budget.clean((cf, idx), ch.held)
            self._maybe_evict()
        return ch

    def grow_held(self, cf: CachedFile, indices: range) -> None:
        """The file grew into these chunks: their new bytes count against the budgets."""
        grew = False
        for idx in indices:
            ch = cf.chunks.get(idx)
            held = self.held(cf, idx) if ch is not None else 0
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

    def remove_chunk(self, cf: CachedFile, idx: int) -> None:
        ch = cf.chunks.get(idx)
        if ch is None:
            return
        self.fresh.pop((cf, idx), None)
        self.set_state(cf, ch, idx, ChunkState.CLEAN)
        del cf.chunks[idx]
        self.budget.not_clean((cf, idx))
        self.budget.removed(ch.held)

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
        if state is ChunkState.DIRTY and idx in cf.spills:  # its spilled part no longer
            cf.stale_spills.append((idx, cf.spills.pop(idx)))  # holds it
        if was_dirty != dirty:
            self._account(ch.held if dirty else -ch.held)
            ch.dirty_since = trio.current_time() if dirty else None
            if state is ChunkState.UPLOADED:
                self.on_uploaded(cf, ch.held)

    def chunk_committed(self, cf: CachedFile, idx: int) -> None:
        """A pending chunk reached S3 as part of a committed object: it is clean now."""
        ch = cf.chunks.get(idx)
        if ch is not None and ch.state is ChunkState.UPLOADED:
            self.set_state(cf, ch, idx, ChunkState.CLEAN)

    def release_dirty(self, cf: CachedFile) -> None:
        for idx, ch in cf.chunks.items():
            self.set_state(cf, ch, idx, ChunkState.CLEAN)

    def adopt(self, cf: CachedFile) -> None:
        """Count the chunks of a file rebuilt from the journal by recovery."""
        for idx, ch in cf.chunks.items():
            ch.held = self.held(cf, idx)
            self.budget.added(ch.held)
            if ch.state in DIRTY_STATES:
                self._account(ch.held)
                ch.dirty_since = trio.current_time()  # (its age before the crash is lost)

    def oldest_dirty_age(self, files: Iterable[CachedFile]) -> float | None:
        """Seconds the oldest chunk not yet in S3 has been dirty; None if there is none."""
        since = [ch.dirty_since for cf in files for ch in cf.chunks.values()
                 if ch.dirty_since is not None]
        return round(trio.current_time() - min(since), 1) if since else None

    @contextmanager
    def pinned(self, cf: CachedFile, indices: range | list[int]) -> Iterator[None]:
        """Chunks in use by a read or write: eviction leaves them alone."""
        refs = [(cf, idx) for idx in indices]
        for ref in refs:
            self.budget.pin(ref)
        try:
            yield
        finally:
            for ref in refs:
                self.budget.unpin(ref)

    def _maybe_evict(self) -> None:
        if self.budget.over:
            self.evict_wanted.set()

    # -- dirty bytes and --max-dirty ----------------------------------------------------

    def _account(self, delta: int) -> None:
        self.dirty_bytes += delta
        if delta < 0:
            self._notify_dirty()

    def _notify_dirty(self) -> None:
        async def notify() -> None:
            async with self._dirty_changed:
                self._dirty_changed.notify_all()

        trio.lowlevel.spawn_system_task(notify)

    async def wait_for_dirty_room(self, needed: int) -> None:
        """--max-dirty: a writer waits while the flusher drains, instead of failing."""
        waited = False
        while self.dirty_bytes + needed > self.max_dirty and self.dirty_bytes > 0:
            self.demand.pressure()
            if not self.demand.busy():
                break  # nothing can drain without this writer going on (open tails)
            if not waited:
                self.metrics[m.WRITER_WAITS] += 1
                waited = True
            async with self._dirty_changed:
                with trio.move_on_after(0.5):
                    await self._dirty_changed.wait()

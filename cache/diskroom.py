"""Room on the cache disk: the journal's reserve, and writers that wait for space.

The journal must never be the thing that hits a full disk: an intent that cannot be
recorded would leave a write that cannot be acknowledged safely. So space past the end of
the journal's own files stays allocated to it (`keep_journal_reserve`), and whatever needs
disk space (new dirty chunks, a write, a warm-up's fetch) goes through one loop: evict
clean chunks, else wait for uploads to free some, and ENOSPC only after ENOSPC_PATIENCE.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from lakefs_mount import metrics as m
from lakefs_mount.cache.asyncjournal import AsyncJournal
from lakefs_mount.cache.cachefile import CachedFile
from lakefs_mount.cache.demand import UploadDemand
from lakefs_mount.cache.eviction import Evictor

log = logging.getLogger(__name__)

ENOSPC_PATIENCE = 60.0  # seconds a writer waits for uploads to free a full cache disk
JOURNAL_RESERVE = 32 * 1024 * 1024  # free space kept for the journal (10 % on tiny disks)


class DiskRoom:
    def __init__(self, data_dir: Path, journal: AsyncJournal, evictor: Evictor,
                 demand: UploadDemand, metrics: m.Metrics) -> None:
        self.data_dir = data_dir
        self.journal = journal
        self.evictor = evictor
        self.demand = demand
        self.metrics = metrics

    def disk_room(self, excluding: set[CachedFile]) -> int:
        """Bytes the cache disk can take in: free space above the journal's reserve, plus
        the clean chunks eviction can free (leaving out those of `excluding`)."""
        return max(0, self.free_above_reserve()) + self.evictor.budget.clean_bytes(excluding)

    def free_above_reserve(self) -> int:
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
        if short > 0 and not await self.evictor.evict_bytes(short):
            return
        try:
            await self.journal(self.journal.sync.arm_reserve, wanted)
        except OSError as exc:
            log.debug("journal reserve not held: %s", exc)

    async def ensure(self, needed: int) -> None:
        """Before new dirty chunks (or a warm-up's fetch): room for them above the reserve."""
        async def attempt() -> int:
            return max(0, needed - self.free_above_reserve())

        await self.patiently(attempt, f"cache disk {self.data_dir}")

    async def patiently(self, attempt: Callable[[], Awaitable[int]], what: str) -> None:
        """Run `attempt` until it reports no bytes short: meanwhile evict clean chunks,
        else ask for every full chunk to go up and wait while uploads are under way.
        ENOSPC once nothing is left to evict or upload, or after ENOSPC_PATIENCE."""
        deadline = trio.current_time() + ENOSPC_PATIENCE
        while True:
            short = await attempt()
            if not short:
                return
            self.metrics[m.CACHE_FULL_WAITS] += 1
            if await self.evictor.evict_bytes(short):
                continue
            if trio.current_time() > deadline or not self.demand.busy():
                log.error("%s: the cache disk is full, nothing left to evict or upload", what)
                raise OSError(errno.ENOSPC, "cache disk full")
            self.demand.pressure()
            await trio.sleep(0.2)

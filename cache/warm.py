"""The warm cache: clean content a previous mount left in the cache directory.

A remount reuses the cached chunks of an object only while S3 still holds the very same
version (ETag and size); anything else in the directory is dropped at start (D19, D20).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from lakefs_mount.cache.budget import CacheBudget
from lakefs_mount.cache.cachefile import CachedFile
from lakefs_mount.cache.journal import AsyncJournal, WarmFile
from lakefs_mount.s3.layout import PartMap

log = logging.getLogger(__name__)


class WarmCache:
    def __init__(self, journal: AsyncJournal, budget: CacheBudget, parts: PartMap,
                 cache_path: Callable[[int], Path]) -> None:
        self.journal = journal
        self.budget = budget
        self.parts = parts
        self.cache_path = cache_path
        self.entries: dict[str, WarmFile] = {}

    def _bytes(self, entry: WarmFile) -> int:
        return sum(self.parts.held_bytes(idx, entry.size) for idx in entry.chunks)

    async def load(self, data_dir: Path) -> None:
        """Take stock of the cache directory: keep what the journal knows, drop the rest."""
        journal = self.journal
        self.entries = await journal(journal.sync.warm_files)
        known = await journal(journal.sync.known_fids)
        for path in data_dir.iterdir():
            if not path.name.isdigit() or int(path.name) not in known:
                path.unlink(missing_ok=True)  # a leftover of a crash or of an unlink
        for entry in self.entries.values():
            self.budget.added(self._bytes(entry))
        for key in sorted(self.entries, key=lambda k: self.entries[k].fid):
            if not self.budget.over:
                break
            await self.drop(self.entries.pop(key))
        if self.entries:
            log.info("warm cache: %d file(s) from the previous mount", len(self.entries))

    async def drop(self, entry: WarmFile) -> None:
        self.budget.removed(self._bytes(entry))
        await self.journal(self.journal.sync.forget_cached, entry.fid)
        self.cache_path(entry.fid).unlink(missing_ok=True)

    def take(self, cf: CachedFile) -> tuple[WarmFile | None, WarmFile | None]:
        """(usable entry, stale entry) for a file first seen in S3; at most one is set."""
        entry = self.entries.pop(cf.key, None)
        if entry is None:
            return None, None
        if entry.etag != cf.base_etag or entry.size != cf.base_size or cf.fid is not None:
            return None, entry  # changed in S3 since: the caller drops it
        return entry, None

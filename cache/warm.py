"""The warm cache: clean content a previous mount left in the cache directory.

A remount reuses the cached chunks of an object only while S3 still holds the very same
version (ETag and size) (D19). A cache file the journal does not name is never deleted at
start: after a crash or with a damaged or lost journal it may hold the only copy of
acknowledged bytes, so it goes to `orphans/` beside `data/`, and `status` counts it (D20).
A clean unmount deletes the cache files nobody needs (`sweep`), so orphans come only from
crashes and damaged journals.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from lakefs_mount.cache.asyncjournal import AsyncJournal
from lakefs_mount.cache.budget import CacheBudget
from lakefs_mount.cache.cachefile import CachedFile
from lakefs_mount.cache.journalschema import WarmFile
from lakefs_mount.config import orphans_dir
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
        """Take stock of the cache directory: keep what the journal knows; put the cache
        files it does not know aside (`orphans/`), unless they hold no byte."""
        journal = self.journal
        self.entries = await journal(journal.sync.warm_files)
        known = await journal(journal.sync.known_fids)
        aside = 0
        for path in data_dir.iterdir():
            if path.name.isdigit() and int(path.name) in known:
                continue
            if not path.name.isdigit() or path.stat().st_blocks == 0:
                path.unlink(missing_ok=True)  # not ours, or nothing in it (all evicted)
                continue
            aside += path.stat().st_size
            put_aside(path, orphans_dir(data_dir.parent))
        if aside:
            log.warning("%s: cache files the journal does not name (after a crash, or a "
                        "damaged or lost journal), %d bytes, kept in %s: check them and "
                        "delete them when they are not needed", data_dir.parent, aside,
                        orphans_dir(data_dir.parent))
        for entry in self.entries.values():
            self.budget.added(self._bytes(entry))
        for key in sorted(self.entries, key=lambda k: self.entries[k].fid):
            if not self.budget.over:
                break
            await self.drop(self.entries.pop(key))
        if self.entries:
            log.info("warm cache: %d file(s) from the previous mount", len(self.entries))

    async def sweep(self, data_dir: Path, in_use: set[int]) -> None:
        """At a clean unmount, the journal written: delete the cache files it does not
        name and no open file uses, so that the next start finds no orphan."""
        known = await self.journal(self.journal.sync.known_fids)
        for path in data_dir.iterdir():
            if path.name.isdigit() and int(path.name) not in known | in_use:
                path.unlink(missing_ok=True)

    async def drop(self, entry: WarmFile) -> None:
        self.budget.removed(self._bytes(entry))
        await self.journal(self.journal.sync.forget_cached, entry.fid)
        self.cache_path(entry.fid).unlink(missing_ok=True)

    def take(self, cf: CachedFile) -> tuple[WarmFile | None, WarmFile | None]:
        """(usable entry, stale entry) for a file first seen in S3; at most one is set."""
        entry = self.entries.pop(cf.key, None)
        if entry is None:
            return None, None
        if entry.etag != cf.base.etag or entry.size != cf.base.size or cf.fid is not None:
            return None, entry  # changed in S3 since: the caller drops it
        return entry, None


def put_aside(path: Path, orphans: Path) -> None:
    """Move a cache file into `orphans`, under a name no earlier orphan has."""
    orphans.mkdir(mode=0o700, exist_ok=True)
    target, n = orphans / path.name, 0
    while target.exists():
        n += 1
        target = orphans / f"{path.name}.{n}"
    path.rename(target)

"""The warm cache: clean content a previous mount left in the cache directory.

A remount reuses the cached chunks of an object only while S3 still holds the very same
version (ETag and size) (D19). A cache file the journal does not name is never deleted at
start: after a crash or with a damaged or lost journal it may hold the only copy of
acknowledged bytes, so it goes to `orphans/` beside `data/`, and `status` counts it (D20).
A clean unmount deletes the cache files nobody needs (`sweep`), so orphans come only from
crashes and damaged journals. An entry of `data/` that is not a regular file of the
daemon's own user (a symlink planted there, a device, another user's file) is never read
or followed: it goes to `refused/`, and a pending file whose cache file it was is lost
as if its cache file were gone (D27).
"""

from __future__ import annotations

import logging
import os
import stat
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

    async def load(self, data_dir: Path) -> int:
        """Take stock of the cache directory: refuse what is not a cache file (`refused/`;
        how many is returned); keep what the journal knows; put the cache files it does
        not know aside (`orphans/`), unless they hold no byte."""
        journal = self.journal
        self.entries = await journal(journal.sync.warm_files)
        known = await journal(journal.sync.known_fids)
        aside = 0
        refused: list[Path] = []
        for path in data_dir.iterdir():
            st = path.lstat()
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                refused.append(path)
                put_aside(path, refused_dir(data_dir.parent))
                continue
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
        if refused:
            log.error("%s: %d entr(ies) of data/ are not regular files of this user (%s): "
                      "moved to %s unread; files whose bytes they were meant to hold are "
                      "lost (see the recovery lines)", data_dir.parent, len(refused),
                      ", ".join(p.name for p in refused[:5]), refused_dir(data_dir.parent))
            gone = {int(p.name) for p in refused if p.name.isdigit()}
            for key in [k for k, e in self.entries.items() if e.fid in gone]:
                entry = self.entries.pop(key)
                await journal(journal.sync.forget_cached, entry.fid)
        for entry in self.entries.values():
            self.budget.added(self._bytes(entry))
        for key in sorted(self.entries, key=lambda k: self.entries[k].fid):
            if not self.budget.over:
                break
            await self.drop(self.entries.pop(key))
        if self.entries:
            log.info("warm cache: %d file(s) from the previous mount", len(self.entries))
        return len(refused)

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


def refused_dir(cache_dir: Path) -> Path:
    """Where a mount moves what it found in data/ and would not read (D27), beside data/."""
    return cache_dir / "refused"


def put_aside(path: Path, aside: Path) -> None:
    """Move an entry of data/ into `aside` (orphans/, refused/), under a name no earlier
    entry there has (a symlink is moved, not followed)."""
    aside.mkdir(mode=0o700, exist_ok=True)
    target, n = aside / path.name, 0
    while os.path.lexists(target):
        n += 1
        target = aside / f"{path.name}.{n}"
    path.rename(target)

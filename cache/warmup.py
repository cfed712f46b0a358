"""Warming the cache before a restore (`lakefs-mount warmup`): every chunk of some files
fetched from S3 with parallel ranged GETs, with no reader in the way.

A job that reads its checkpoint after a warm-up reads it from the cache disk; a scheduler
can run the warm-up while the job still starts (imports, process groups). The fetch goes
straight from S3 to the cache files: no FUSE request, and the cache disk only writes,
where a cold read has it write and read at once. Each chunk is on disk and out of the
page cache before it counts as cached (`Fetcher.fetch_chunk`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from lakefs_mount.cache.cachefile import CachedFile
from lakefs_mount.cache.manager import CacheManager
from lakefs_mount.config import human_bytes

WARM_TASKS = 16  # chunks asked for at once (the cache's GET slots bound the GETs too)
REPORT_EVERY = 1.0  # seconds between progress reports


class CacheTooSmall(ValueError):
    """The files would not fit in the cache: warming them would evict what it fetched."""


@dataclass
class WarmProgress:
    files: int  # files to warm
    bytes_total: int  # their size
    files_left: int  # files with chunks not yet cached
    bytes_left: int  # bytes of those chunks
    bytes_to_fetch: int = 0  # bytes_left at the start: what the warm-up covers
    # came from S3 while warming (the rest was cached): also the chunks a reader or the
    # readahead had under way, which this warm-up waited for instead of fetching again
    fetched_bytes: int = 0


async def warm_up(cache: CacheManager, files: list[CachedFile],
                  report: Callable[[WarmProgress], Awaitable[None]]) -> WarmProgress:
    """Cache every byte of `files` (objects in S3 without local changes); `report` is
    called about once a second. Raises CacheTooSmall before fetching anything when they
    are larger than the cache; an S3 error ends the warm-up (what came stays cached)."""
    parts = cache.parts
    total = sum(cf.size for cf in files)
    if total > cache.budget.capacity:
        raise CacheTooSmall(
            f"{len(files)} file{'s' if len(files) != 1 else ''} of {human_bytes(total)} do"
            f" not fit in the cache (--cache-size {human_bytes(cache.budget.capacity)}):"
            f" warming them would evict what it fetched first")

    def span(cf: CachedFile, idx: int) -> int:
        start, end = parts.chunk_range(idx)
        return max(0, min(end, cf.size) - start)

    todo = [(cf, idx) for cf in files for idx in range(parts.chunk_count(cf.size))
            if idx not in cf.chunks]
    left: dict[CachedFile, int] = {}
    for cf, _ in todo:
        left[cf] = left.get(cf, 0) + 1
    to_fetch = sum(span(*ref) for ref in todo)
    progress = WarmProgress(len(files), total, len(left), to_fetch, to_fetch)
    room = cache.room.disk_room(excluding=set(files))
    if progress.bytes_left > room:
        raise CacheTooSmall(
            f"{human_bytes(progress.bytes_left)} to fetch do not fit on the cache disk"
            f" ({cache.data_dir}): it has room for {human_bytes(room)} (free space and"
            f" clean data of other files)")
    queue = iter(todo)

    async def worker() -> None:
        for cf, idx in queue:  # shared by the workers: each chunk is taken once
            if not cf.unlinked:  # (removed meanwhile: its cache file is gone)
                await cache.fetcher.fetch_chunk(cf, idx)
                progress.fetched_bytes += span(cf, idx)
            progress.bytes_left -= span(cf, idx)
            left[cf] -= 1
            if not left[cf]:
                progress.files_left -= 1

    async def keep_reporting() -> None:
        while True:
            await trio.sleep(REPORT_EVERY)
            await report(progress)

    try:
        async with trio.open_nursery() as outer:
            outer.start_soon(keep_reporting)
            async with trio.open_nursery() as workers:
                for _ in range(min(WARM_TASKS, len(todo))):
                    workers.start_soon(worker)
            outer.cancel_scope.cancel()
    except BaseExceptionGroup as group:  # the first failure stopped the rest: that one
        first: BaseException = group
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from group
    return progress

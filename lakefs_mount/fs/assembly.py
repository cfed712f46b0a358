"""The parts of a mount below its FUSE session, built and started as one: the cache, the
namespace and its write-back log, the flusher and the POSIX core. The daemon serves the
`FileSystem` it holds to the kernel; the fs-API tests drive the same assembly directly."""

from __future__ import annotations

import logging
import stat
from collections.abc import Callable
from dataclasses import dataclass

import trio

from lakefs_mount import metrics as m
from lakefs_mount.cache.asyncjournal import AsyncJournal
from lakefs_mount.cache.cachefile import CachedFile
from lakefs_mount.cache.flusher import Flusher
from lakefs_mount.cache.manager import CacheManager
from lakefs_mount.cache.recovery import recover
from lakefs_mount.config import MountConfig
from lakefs_mount.fs.filesystem import FileSystem
from lakefs_mount.namespace.dirattrs import open_dir_attrs
from lakefs_mount.namespace.dirindex import parent_dir_key
from lakefs_mount.namespace.invalidations import Invalidations
from lakefs_mount.namespace.latewrites import LateWrites
from lakefs_mount.namespace.namelog import NameLog
from lakefs_mount.namespace.namespace import Namespace
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.layout import PartMap
from lakefs_mount.uring import IoEngine

log = logging.getLogger(__name__)


@dataclass
class MountCore:
    cache: CacheManager
    late_writes: LateWrites
    names: NameLog
    ns: Namespace
    flusher: Flusher
    fs: FileSystem

    def made_here(self, key: str) -> bool:
        """This mount has a file of its own at `key`: made or written since it started, or
        a pending change makes it."""
        cf = self.ns.file_by_key(key)
        return self.names.creating(key) or cf is not None and (
            cf.in_journal or cf.committed_version >= 0)

    async def start(self, nursery: trio.Nursery) -> None:
        """Start their tasks in the order recovery needs: the warm cache and the files
        the journal still holds are back before the root's first listing (which meets
        them) and before a replayed move (which rebases the recovered files it moves)."""
        await nursery.start(self.cache.run)
        await nursery.start(self.flusher.run)
        await nursery.start(self.ns.index.run)
        await self.cache.load_warm()
        files, _ = await recover(self.cache)
        for cf in files:
            self.ns.attach_path(cf.key[len(self.ns.prefix):], cf)
            self.flusher.request_commit(cf)
        await nursery.start(self.ns.run)
        await nursery.start(self.late_writes.run)  # (before names: it feeds it)
        await nursery.start(self.names.run)


async def assemble(config: MountConfig, engine: IoEngine, store: AsyncStore,
                   journal: AsyncJournal, metrics: m.Metrics, *, writer: str,
                   open_files: int, kernel: Invalidations | None = None,
                   on_uploaded: Callable[[CachedFile, int], None] = lambda cf, held: None,
                   on_record: Callable[[str, str, str | None], None] | None = None
                   ) -> MountCore:
    """`writer`: this cache's id in S3 (attribute indexes, late writes); `kernel`: where
    the namespace tells of changes in S3; `on_uploaded`, `on_record`: told of each chunk
    that reached S3 and each namespace change recorded."""
    cache = CacheManager(config.resolved_cache_dir(), engine, journal, store,
                         PartMap(config.part_size), metrics, max_dirty=config.max_dirty,
                         cache_size=config.cache_size, read_ahead=config.read_ahead,
                         open_files=open_files, on_uploaded=on_uploaded,
                         hooks=config.test_hooks, prefix=config.prefix, writer=writer)
    dir_attrs = await open_dir_attrs(store, journal, writer, config.prefix)
    late = LateWrites(store, journal, metrics, writer)
    names = NameLog(store, journal, metrics, dir_attrs=dir_attrs, on_record=on_record,
                    late=late, hold_after_copy=config.test_hooks.hold_move_after_copy)
    replayed = await names.load()
    if replayed:
        log.info("%d namespace change(s) of the last mount go to S3 first", replayed)
    ns = Namespace(store, cache, config.prefix, config.metadata_ttl, config.owner,
                   index_writer=writer, dir_attrs=dir_attrs, names=names, kernel=kernel,
                   modes=(stat.S_IFREG | config.file_mode, stat.S_IFDIR | config.dir_mode))
    flusher = Flusher(cache, config.upload_concurrency, commit_delay=config.commit_delay,
                      on_committed=lambda cf: ns.index_changed(
                          parent_dir_key(config.prefix, cf.key)),
                      gate=names, writer=writer, prefix=config.prefix)
    fs = FileSystem(ns, cache, flusher, names, read_only=config.read_only,
                    fsync_remote=config.fsync_mode == "remote",
                    hold_temporaries=config.hold_temporaries)
    core = MountCore(cache, late, names, ns, flusher, fs)
    # The namespace's two back-references, made once it exists: a move the log applies
    # re-keys the files it moved, and a late write is ours if the namespace made its key.
    names.rebase = ns.rebase
    late.made_here = core.made_here
    return core

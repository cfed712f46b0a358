"""A `FileSystem` wired as a mount wires it (lakefs_mount/daemon/daemon.py), over the
in-memory store and the thread I/O engine: the POSIX core without a kernel or S3."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import trio

from lakefs_mount import metrics as m
from lakefs_mount.cache.asyncjournal import AsyncJournal
from lakefs_mount.cache.flusher import Flusher
from lakefs_mount.cache.journal import Journal
from lakefs_mount.cache.manager import CacheManager
from lakefs_mount.fs.filesystem import FileSystem
from lakefs_mount.namespace.dirattrs import open_dir_attrs
from lakefs_mount.namespace.invalidations import Invalidations
from lakefs_mount.namespace.latewrites import LateWrites
from lakefs_mount.namespace.namelog import NameLog
from lakefs_mount.namespace.namespace import Namespace
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.layout import PartMap
from lakefs_mount.uring import open_engine
from tests.memstore import MemoryObjectStore

PART = 8 << 20
PREFIX = "ckpt/"
WRITER = "fs-tier"


@dataclass
class Core:
    fs: FileSystem
    store: MemoryObjectStore
    names: NameLog

    async def settled(self) -> None:
        """Every file committed and every namespace change applied in the store."""
        await self.fs.flush_files(self.fs.pending_files(None))


@asynccontextmanager
async def filesystem(tmp_path: Path, store: MemoryObjectStore | None = None,
                     ttl: float = 60.0) -> AsyncIterator[Core]:
    store = store or MemoryObjectStore()
    journal = Journal(tmp_path / "journal.db")
    metrics = m.Metrics()
    aio_journal, aio_store = AsyncJournal(journal), AsyncStore(store, metrics)
    async with trio.open_nursery() as nursery:
        async with open_engine("threads") as engine:
            cache = CacheManager(tmp_path / "cache", engine, aio_journal, aio_store,
                                 PartMap(PART), metrics, max_dirty=1 << 40,
                                 cache_size=1 << 40, open_files=256)
            dir_attrs = await open_dir_attrs(aio_store, aio_journal, WRITER)
            late = LateWrites(aio_store, aio_journal, metrics, WRITER,
                              made_here=lambda key: False)
            names = NameLog(aio_store, aio_journal, metrics, dir_attrs=dir_attrs,
                            rebase=lambda src, dst, etags: ns.rebase(src, dst, etags),
                            late=late)
            await names.load()
            ns = Namespace(aio_store, cache, PREFIX, ttl, (os.getuid(), os.getgid()),
                           index_writer=WRITER, dir_attrs=dir_attrs, names=names,
                           kernel=Invalidations())
            flusher = Flusher(cache, 4, commit_delay=0.0, gate=names, writer=WRITER)
            fs = FileSystem(ns, cache, flusher, names, read_only=False, fsync_remote=False,
                            hold_temporaries=0.0)
            await nursery.start(cache.run)
            await nursery.start(flusher.run)
            await nursery.start(ns.index.run)
            await nursery.start(ns.run)
            await nursery.start(late.run)
            await nursery.start(names.run)
            yield Core(fs, store, names)
            nursery.cancel_scope.cancel()
    journal.close()

"""A mount's core as the daemon assembles it (lakefs_mount/fs/assembly.py), over the
in-memory store and the thread I/O engine: the POSIX core without a kernel or S3."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import trio

from lakefs_mount import metrics as m
from lakefs_mount.cache.asyncjournal import AsyncJournal
from lakefs_mount.cache.journal import Journal
from lakefs_mount.config import MountConfig
from lakefs_mount.fs.assembly import MountCore, assemble
from lakefs_mount.fs.filesystem import FileSystem
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.uring import open_engine
from tests.memstore import MemoryObjectStore

PREFIX = "ckpt/"


@dataclass
class Core:
    core: MountCore
    store: MemoryObjectStore

    @property
    def fs(self) -> FileSystem:
        return self.core.fs

    async def settled(self) -> None:
        """Every file committed and every namespace change applied in the store."""
        await self.fs.flush_files(self.fs.pending_files(None))


@asynccontextmanager
async def filesystem(tmp_path: Path, store: MemoryObjectStore | None = None,
                     ttl: float = 60.0) -> AsyncIterator[Core]:
    store = store or MemoryObjectStore()
    journal = Journal(tmp_path / "journal.db")
    config = MountConfig(mountpoint=tmp_path / "mnt", bucket="b", prefix=PREFIX,
                         cache_dir=tmp_path / "cache", part_size=8 << 20, metadata_ttl=ttl,
                         commit_delay=0.0, hold_temporaries=0.0)
    metrics = m.Metrics()
    async with open_engine("threads") as engine, trio.open_nursery() as nursery:
        core = await assemble(config, engine, AsyncStore(store, metrics),
                              AsyncJournal(journal), metrics, writer="fs-tier",
                              open_files=256)
        await core.start(nursery)
        yield Core(core, store)
        nursery.cancel_scope.cancel()
    journal.close()

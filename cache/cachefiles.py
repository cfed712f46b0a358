"""Cache files on the local disk: one per file with cached bytes, named by its fid.

Owns the fids (allocated in blocks from the journal), the paths and the descriptors
(through the fd table, which bounds how many stay open). Nothing here knows chunks.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

from lakefs_mount.cache.asyncjournal import AsyncJournal
from lakefs_mount.cache.cachefile import CachedFile
from lakefs_mount.cache.fdtable import FdTable

log = logging.getLogger(__name__)

FID_BLOCK = 1024


class CacheFiles:
    def __init__(self, data_dir: Path, journal: AsyncJournal, fds: FdTable) -> None:
        self.data_dir = data_dir
        self.journal = journal
        self.fds = fds
        self.by_fid: dict[int, CachedFile] = {}  # every file with a cache file
        self._free_fids: Iterator[int] | None = None

    def path(self, fid: int) -> Path:
        return self.data_dir / str(fid)

    def adopt(self, cf: CachedFile, fid: int | None = None) -> None:
        """`cf` has a fid already (from the journal), or takes `fid` (the warm cache's)."""
        if fid is not None:
            cf.fid = fid
        assert cf.fid is not None
        self.by_fid[cf.fid] = cf

    async def ensure_fd(self, cf: CachedFile, direct: bool = False) -> int:
        """`cf`'s descriptor, with a fid and an open cache file; with `direct` its
        O_DIRECT twin is opened too."""
        if cf.fid is None:
            fid = next(self._free_fids, None) if self._free_fids is not None else None
            if fid is None:  # fids come in blocks: no journal round trip per new file
                self._free_fids = None
                block = await self.journal(self.journal.sync.reserve_fids, FID_BLOCK)
                self._free_fids = iter(block)
                fid = next(self._free_fids)
            if cf.fid is None:  # a concurrent task may have allocated one meanwhile
                cf.fid = fid
        if cf.io.fd is None:
            self.by_fid[cf.fid] = cf
        elif not direct or cf.io.dfd is not None or not self.fds.can_direct:
            return self.fds.get(cf, "")  # open: no path needed (building one costs)
        path = str(self.path(cf.fid))
        if direct:
            self.fds.get_direct(cf, path)  # opens the plain descriptor too
            assert cf.io.fd is not None
            return cf.io.fd
        return self.fds.get(cf, path)

    @asynccontextmanager
    async def io(self, cf: CachedFile, direct: bool = False) -> AsyncIterator[int]:
        """The cache file's descriptor, kept open while an engine request uses it; with
        `direct`, its O_DIRECT twin `cf.io.dfd` too (None where there is none)."""
        fd = await self.ensure_fd(cf, direct)
        cf.io.busy += 1
        try:
            yield fd
        finally:
            cf.io.busy -= 1

    def dfd(self, cf: CachedFile) -> int | None:
        """`cf`'s O_DIRECT descriptor, if open and O_DIRECT was not given up."""
        return cf.io.dfd if self.fds.can_direct else None

    def give_up_direct(self, exc: OSError) -> None:
        """An O_DIRECT request was refused (EINVAL: e.g. a disk whose logical blocks are
        larger than ALIGN): from now on everything is buffered; the caller redoes it."""
        if exc.errno != errno.EINVAL:
            raise exc
        if self.fds.can_direct:
            log.warning("O_DIRECT I/O on the cache disk failed (%s): cache files are read "
                        "and written through the page cache from now on", exc)
            self.fds.stop_direct()

    def open_loose(self, cf: CachedFile) -> int:
        """A new descriptor of `cf`'s cache file, owned by the caller (the fd table may
        close its own at any time). Only files with a cache file (a fid) get here."""
        assert cf.fid is not None
        return self.fds.open_loose(cf, str(self.path(cf.fid)))

    def remove(self, cf: CachedFile) -> None:
        """`cf`'s cache file goes away, with its descriptors."""
        self.fds.close(cf)
        if cf.fid is not None:
            self.by_fid.pop(cf.fid, None)
            self.path(cf.fid).unlink(missing_ok=True)

"""Open descriptors of cache files, bounded by the daemon's descriptor limit.

A cache file stays open between I/Os, so a file being read or written does not pay an
open() per request. Without a bound, every file ever read stayed open: a training set of
20,000 small files read once ran the daemon out of descriptors (EMFILE), which failed
reads and then the control socket. Past `limit`, the least recently used descriptors
that no I/O is using are closed (down to 3/4 of the limit, so that trimming is rare); the
next I/O of such a file opens it again. If the process runs out of descriptors anyway
(its limit lowered, or other descriptors grew), the bound shrinks to half of what is open
and the open is retried, leaving room for S3 connections and the control socket.
"""

from __future__ import annotations

import errno
import logging
import os
from collections import OrderedDict

from lakefs_mount.cache.cachefile import CachedFile

log = logging.getLogger(__name__)

OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC


class FdTable:
    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._lru: OrderedDict[CachedFile, None] = OrderedDict()  # files with an open fd

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, cf: CachedFile, path: str) -> int:
        """The open descriptor of `cf`'s cache file at `path`, created 0600 if missing."""
        if cf.fd is not None:
            self._lru.move_to_end(cf)
            return cf.fd
        try:
            cf.fd = os.open(path, OPEN_FLAGS, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE) or not self._lru:
                raise
            self.limit = max(1, len(self._lru) // 2)
            log.warning("out of file descriptors with %d cache files open: keeping at most "
                        "%d open from now on", len(self._lru), self.limit)
            self._trim(keep=cf)
            cf.fd = os.open(path, OPEN_FLAGS, 0o600)
        self._lru[cf] = None
        if len(self._lru) > self.limit:
            self._trim(keep=cf)
        return cf.fd

    def close(self, cf: CachedFile) -> None:
        """Close `cf`'s descriptor unless an I/O is using it."""
        if cf.fd is not None and cf.io_busy == 0:
            os.close(cf.fd)
            cf.fd = None
            self._lru.pop(cf, None)

    def _trim(self, keep: CachedFile) -> None:
        excess = len(self._lru) - self.limit * 3 // 4
        victims = []
        for cf in self._lru:  # least recently used first
            if excess <= 0:
                break
            if cf.io_busy == 0 and cf is not keep:
                victims.append(cf)
                excess -= 1
        for cf in victims:
            self.close(cf)

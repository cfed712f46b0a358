"""Open descriptors of cache files, bounded by the daemon's descriptor limit.

A cache file stays open between I/Os, so a file being read or written does not pay an
open() per request. Without a bound, every file ever read would stay open: a training set
of tens of thousands of small files read once would run the daemon out of descriptors
(EMFILE), failing reads and then the control socket. Past `limit`, the least recently
used descriptors that no I/O is using are closed (down to 3/4 of the limit, so that
trimming is rare); the next I/O of such a file opens it again. If the process runs out
of descriptors anyway (its limit lowered, or other descriptors grew), the bound shrinks
to half of what is open and the open is retried, leaving room for S3 connections and
the control socket.

A cache file may have a second descriptor opened with O_DIRECT (see `direct`); the
bound counts descriptors, and both close together.
"""

from __future__ import annotations

import errno
import logging
import os
from collections import OrderedDict
from collections.abc import Callable

from lakefs_mount.cache.cachefile import CachedFile
from lakefs_mount.cache.direct import DirectOpener

log = logging.getLogger(__name__)

# O_NOFOLLOW: a symlink planted in data/ is an error, never a file to read or write (D27)
OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW


class FdTable:
    def __init__(self, limit: int, direct: bool = True) -> None:
        self.limit = max(2, limit)
        self._lru: OrderedDict[CachedFile, None] = OrderedDict()  # files with an open fd
        self._open = 0  # descriptors, O_DIRECT ones included
        self._direct = DirectOpener(direct)

    def __len__(self) -> int:
        """How many descriptors are open."""
        return self._open

    @property
    def can_direct(self) -> bool:
        """False once the cache filesystem refused O_DIRECT (or it was turned off)."""
        return self._direct.supported

    def stop_direct(self) -> None:
        """No more O_DIRECT descriptors; those open close with their files."""
        self._direct.supported = False

    def get(self, cf: CachedFile, path: str) -> int:
        """The open descriptor of `cf`'s cache file at `path`, created 0600 if missing."""
        if cf.io.fd is not None:
            self._lru.move_to_end(cf)
            return cf.io.fd
        fd = self._open_retrying(cf, lambda: os.open(path, OPEN_FLAGS, 0o600))
        assert fd is not None
        cf.io.fd = fd
        self._lru[cf] = None
        return fd

    def get_direct(self, cf: CachedFile, path: str) -> int | None:
        """`cf`'s O_DIRECT descriptor (its plain one is opened first), or None where the
        filesystem has no O_DIRECT."""
        self.get(cf, path)
        if cf.io.dfd is None and self._direct.supported:
            cf.io.dfd = self._open_retrying(cf, lambda: self._direct.open(path))
        return cf.io.dfd

    def open_loose(self, cf: CachedFile, path: str) -> int:
        """A descriptor of `cf`'s cache file that the caller closes at once (the kernel keeps
        its own reference to a passthrough backing file): not kept, but on EMFILE the
        table gives up some of its own first."""
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = self._open_retrying(cf, lambda: os.open(path, flags))
        assert fd is not None
        self._open -= 1
        return fd

    def _open_retrying(self, cf: CachedFile, opener: Callable[[], int | None]) -> int | None:
        try:
            fd = opener()
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE) or not self._lru:
                raise
            self.limit = max(2, self._open // 2)
            log.warning("out of file descriptors with %d cache file descriptors open: "
                        "keeping at most %d open from now on", self._open, self.limit)
            self._trim(keep=cf)
            fd = opener()
        if fd is not None:
            self._open += 1
            if self._open > self.limit:
                self._trim(keep=cf)
        return fd

    def close(self, cf: CachedFile) -> None:
        """Close `cf`'s descriptor unless an I/O is using it."""
        if cf.io.fd is not None and cf.io.busy == 0:
            for fd in (cf.io.fd, cf.io.dfd):
                if fd is not None:
                    os.close(fd)
                    self._open -= 1
            cf.io.fd = cf.io.dfd = None
            self._lru.pop(cf, None)

    def _trim(self, keep: CachedFile) -> None:
        excess = self._open - self.limit * 3 // 4
        victims = []
        for cf in self._lru:  # least recently used first
            if excess <= 0:
                break
            if cf.io.busy == 0 and cf is not keep:
                victims.append(cf)
                excess -= 1 if cf.io.dfd is None else 2
        for cf in victims:
            self.close(cf)

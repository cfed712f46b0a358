"""Writers a crashed daemon left behind (docs/durability.md, D28).

A process that opened a file through FUSE passthrough writes the cache file through the
kernel, which needs no daemon for it: after a kill -9 of the daemon, a `fusermount3 -uz`
and a new mount of the same cache directory, the old descriptor still writes the same
cache file, and each write returns success. So those writes must reach S3.

A recovered file whose journal row says the kernel may write it (passthrough = 1) is
looked at before recovery takes its chunk map over: while anyone may still write its
cache file (a read lease is refused, EAGAIN, as long as any descriptor of the inode may
write), it counts as having one more passthrough writer (`Passthrough.adopt_stale`). The
watcher then streams what it writes, every commit and flush first takes over what the
cache file holds, and the journal row keeps its flag (a crash of this daemon too leaves
the file all dirty for the next). Every STALE_EVERY seconds the lease is tried again,
with the daemon's own descriptor of the file closed first; once it is granted, the last
stale descriptor is gone, and the writer leaves as any passthrough writer does.

Where the cache's file system has no leases, nobody can tell: the writer counts as there
until the unmount (whose commit takes over what the cache file holds then).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import threading
from pathlib import Path

import trio

from lakefs_mount.cache.cachefile import CachedFile
from lakefs_mount.cache.cachefiles import CacheFiles
from lakefs_mount.cache.demand import UploadDemand
from lakefs_mount.cache.passthrough import Passthrough

log = logging.getLogger(__name__)

STALE_EVERY = 1.0  # seconds between looks at whether the stale writers are gone


def written_elsewhere(path: Path) -> bool | None:
    """True if some descriptor may write the file (a read lease is refused), False if
    none may, None if this file system grants no leases. The lease is given back at once;
    an open for writing meanwhile waits only for that (SIGIO, its notice, is ignored)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EBUSY):
                return True
            if exc.errno in (errno.EINVAL, errno.ENOLCK, errno.EACCES, errno.EPERM):
                return None
            raise
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return False
    finally:
        os.close(fd)


class StaleWriters:
    def __init__(self, passthrough: Passthrough, cachefiles: CacheFiles,
                 demand: UploadDemand) -> None:
        self.passthrough = passthrough
        self.cachefiles = cachefiles
        self.demand = demand
        self.files: set[CachedFile] = set()  # with a writer a crashed daemon's mount left
        self._untold: set[CachedFile] = set()  # ... where leases cannot tell when it goes
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGIO, signal.SIG_IGN)  # a lease break's notice

    async def check(self, cf: CachedFile) -> None:
        """At recovery, for a file the kernel may have been writing at the crash."""
        if cf.fid is None:
            return
        held = self._written_elsewhere(cf)
        if held is False:
            return
        await self.passthrough.adopt_stale(cf)
        self.files.add(cf)
        if held is None:
            self._untold.add(cf)
            log.warning("%s may still be open for writing by a process of the crashed "
                        "daemon's mount (the cache's file system cannot tell): what it "
                        "writes is taken into S3 until this mount ends", cf.key)
        else:
            log.warning("%s is still open for writing by a process of the crashed daemon's "
                        "mount: what it writes goes to S3, as long as it keeps it open",
                        cf.key)

    async def run(self) -> None:
        while True:
            await trio.sleep(STALE_EVERY)
            for cf in list(self.files - self._untold):
                if cf.fid is not None and not cf.unlinked and self._written_elsewhere(cf):
                    continue
                self.files.discard(cf)
                log.info("the last descriptor a process of the crashed daemon's mount had "
                         "of %s is closed", cf.key)
                await self.passthrough.leave(cf, writable=True)
                self.demand.commit(cf)  # as at the last close of a writer

    def _written_elsewhere(self, cf: CachedFile) -> bool | None:
        assert cf.fid is not None
        self.cachefiles.fds.close(cf)  # (its own descriptor may write: not counted)
        try:
            return written_elsewhere(self.cachefiles.path(cf.fid))
        except OSError as exc:  # gone: nobody writes it any more
            log.debug("looking for writers of %s: %s", cf.key, exc)
            return False

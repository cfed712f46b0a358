"""Telling the kernel about names and files that changed in S3 behind its back.

The namespace learns of a change when it lists a directory or HEADs an object (an ETag or
size that moved, a name gone); the kernel may still hold the old name, attributes and
pages for their timeouts, or longer (pages kept across opens). Both FUSE sessions can drop
them: FUSE_NOTIFY_INVAL_ENTRY / INVAL_INODE (`fuse/native/`), pyfuse3.invalidate_entry /
invalidate_inode. This is what they share: the namespace queues, without waiting, and one
task sends each from a worker thread.

Why a task and a thread: the kernel holds such a write until it can lock what it touches
(the directory's inode for an entry, the pages for an inode), and the request holding that
lock (a LOOKUP in the directory, a READ of those pages) is answered by the trio loop. Sent
from the loop, or from the request that found the change, it would never return.
"""

from __future__ import annotations

import logging
import os
from typing import Protocol

import trio

log = logging.getLogger(__name__)


class KernelCaches(Protocol):
    """What a FUSE session offers; both calls block, and are made from a worker thread."""

    def invalidate_inode(self, ino: int) -> None: ...

    def invalidate_entry(self, parent: int, name: bytes) -> None: ...


class Invalidations:
    """Invalidations not sent yet, in order, at most one per inode and one per name: the
    queue is bounded by the namespace, and a file changed twice is dropped once."""

    def __init__(self) -> None:
        self._pending: dict[tuple[int, bytes | None], None] = {}
        self._wake = trio.Event()

    def inode(self, ino: int) -> None:
        """The file `ino` changed: its attributes and pages in the kernel are stale."""
        self._add((ino, None))

    def entry(self, parent: int, name: str) -> None:
        """The name `name` in directory `parent` is gone (or means another object)."""
        self._add((parent, os.fsencode(name)))

    def _add(self, key: tuple[int, bytes | None]) -> None:
        self._pending[key] = None
        self._wake.set()

    async def run(self, session: KernelCaches) -> None:
        """Send what is queued until cancelled (before the session closes)."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            while self._pending:
                key = next(iter(self._pending))
                del self._pending[key]
                await trio.to_thread.run_sync(_send, session, *key, abandon_on_cancel=True)


def _send(session: KernelCaches, ino: int, name: bytes | None) -> None:
    try:
        if name is None:
            session.invalidate_inode(ino)
        else:
            session.invalidate_entry(ino, name)
    except OSError as exc:  # e.g. ENOENT: the kernel does not hold it; nothing to drop
        log.debug("invalidation of %d %r not sent: %s", ino, name, exc)

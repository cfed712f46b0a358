"""What the cache asks of the flusher, in one object made before both of them.

The cache hands over full chunks to upload while writing goes on (`chunk_full`), asks for
every full chunk at once when it runs out of room (`pressure`), and asks whether uploads
under way will free any (`busy`). A temporary file (`hold`) keeps its full chunks back
until it has its final name or is closed (`release`), or for at most the hold. A file a
writer the daemon did not see has left is committed (`commit`), and so is a closed file
when the cache runs out of room. The cache makes it; the
flusher keeps its queues here and wakes on `wake`. Neither side is patched into the other
after construction.
"""

from __future__ import annotations

from collections.abc import Mapping

import trio

from lakefs_mount.cache.cachefile import CachedFile, ChunkState
from lakefs_mount.s3.layout import PartMap


class UploadDemand:
    def __init__(self, parts: PartMap, files: Mapping[int, CachedFile]) -> None:
        self._chunks = parts
        self._files = files  # every file with a cache file
        self.parts: set[tuple[CachedFile, int]] = set()  # full chunks to upload now
        self.committing: set[CachedFile] = set()
        self.commit_wanted: dict[CachedFile, float] = {}  # file -> when its commit is due
        self.in_flight = 0  # part uploads under way
        self.wake = trio.Event()
        self._held: dict[CachedFile, float] = {}  # temporary file -> end of its hold
        self.commits: set[CachedFile] = set()  # files whose commit the cache asks for
        self._passed: dict[CachedFile, set[int]] = {}  # chunks written past while open

    def commit(self, cf: CachedFile) -> None:
        """Commit `cf` now (the last writer of it that the daemon did not see has gone)."""
        self.commits.add(cf)
        self.wake.set()

    def chunk_full(self, cf: CachedFile, idx: int) -> None:
        """A full chunk of a file still being written: upload it now (a temporary's once
        its hold is over)."""
        until = self._held.get(cf)
        if until is not None:
            if trio.current_time() < until:
                return
            self.release(cf)  # held long enough: written like any file from now on
        self.parts.add((cf, idx))
        self.wake.set()

    def written_past(self, cf: CachedFile, idx: int) -> None:
        """A write went on beyond full chunk `idx` of a file still being written: upload
        it now, unless it went up already while the file is open. A file rewritten in
        place (random writes, the same region over and over) then sends each part once
        until its last writer closes it, not at every pass: its commit sends the rest."""
        passed = self._passed.setdefault(cf, set())
        if idx not in passed:
            passed.add(idx)
            self.chunk_full(cf, idx)

    def hold(self, cf: CachedFile, seconds: float) -> None:
        """`cf` is a temporary (created as mkstemp creates one): safetensors and tempfile
        users rename it as soon as it is written, and every part sent under its first
        name goes again under the final one, or the whole object is copied (D25). Its
        full chunks wait for the rename or the close, for at most `seconds`: S3 loses no
        more time than the parts sent again would have cost."""
        self._held[cf] = trio.current_time() + seconds

    def release(self, cf: CachedFile) -> None:
        """`cf` has its final name, or no writer: its full dirty chunks go up now."""
        self._passed.pop(cf, None)
        if self._held.pop(cf, None) is not None:
            self._queue_full(cf)
            self.wake.set()

    def pressure(self) -> None:
        """The cache is short of room: every full dirty chunk goes up now; a closed
        file's as its commit, now (a file of one part sent as a part of a multipart
        upload went again as a PutObject, the upload aborted)."""
        for cf in list(self._files.values()):
            if cf.writers or cf.pt.writers:
                self._queue_full(cf)
            elif any(ch.state is ChunkState.DIRTY for ch in cf.chunks.values()):
                self.commits.add(cf)
        self.wake.set()

    def _queue_full(self, cf: CachedFile) -> None:
        for idx, ch in cf.chunks.items():
            if ch.state is ChunkState.DIRTY and self._chunks.chunk_range(idx)[1] <= cf.size:
                self.parts.add((cf, idx))

    def busy(self) -> bool:
        """True while uploads or commits are under way or queued: data will drain."""
        return bool(self.in_flight or self.parts or self.committing or self.commit_wanted
                    or self.commits)

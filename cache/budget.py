"""The cache budget: how many bytes the cache files hold, and which clean chunks go first.

Only clean chunks are ever evicted (their bytes are in S3); dirty ones leave the cache
only by being uploaded. A chunk that a read or an upload is using is pinned.
"""

from __future__ import annotations

from collections import OrderedDict

from lakefs_mount.cache.cachefile import CachedFile

ChunkRef = tuple[CachedFile, int]


class CacheBudget:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._clean_lru: OrderedDict[ChunkRef, int] = OrderedDict()  # ref -> bytes
        # their sums, kept as they change: a passthrough writer's open asks for the room
        # eviction could free, and summing the LRU there made each create of many small
        # files slower than the last (every uploaded file adds a clean chunk)
        self._clean_total = 0
        self._clean_of: dict[CachedFile, int] = {}
        self._pins: dict[ChunkRef, int] = {}

    def added(self, nbytes: int) -> None:
        self.used += nbytes

    def removed(self, nbytes: int) -> None:
        self.used -= nbytes

    def clean(self, ref: ChunkRef, nbytes: int) -> None:
        """The chunk became clean (or was read): it is the newest eviction candidate."""
        self.not_clean(ref)
        self._clean_lru[ref] = nbytes  # (at the end: the newest)
        self._count(ref[0], nbytes)

    def touch(self, ref: ChunkRef) -> None:
        if ref in self._clean_lru:
            self._clean_lru.move_to_end(ref)

    def not_clean(self, ref: ChunkRef) -> None:
        nbytes = self._clean_lru.pop(ref, None)
        if nbytes is not None:
            self._count(ref[0], -nbytes)

    def _count(self, cf: CachedFile, nbytes: int) -> None:
        self._clean_total += nbytes
        left = self._clean_of.get(cf, 0) + nbytes
        if left:
            self._clean_of[cf] = left
        else:
            self._clean_of.pop(cf, None)

    def pin(self, ref: ChunkRef) -> None:
        self._pins[ref] = self._pins.get(ref, 0) + 1

    def unpin(self, ref: ChunkRef) -> None:
        left = self._pins[ref] - 1
        if left:
            self._pins[ref] = left
        else:
            del self._pins[ref]

    def pinned(self, ref: ChunkRef) -> bool:
        return ref in self._pins

    @property
    def over(self) -> int:
        """Bytes above the capacity (0 when within budget)."""
        return max(0, self.used - self.capacity)

    def victims(self, nbytes: int) -> list[ChunkRef]:
        """Least recently used clean, unpinned chunks worth at least `nbytes`."""
        out: list[ChunkRef] = []
        freed = 0
        for ref, size in self._clean_lru.items():
            if freed >= nbytes:
                break
            if ref in self._pins:
                continue
            out.append(ref)
            freed += size
        return out

    def clean_bytes(self, excluding: set[CachedFile]) -> int:
        """Bytes of clean chunks (what eviction can free), leaving out these files'."""
        return self._clean_total - sum(self._clean_of.get(cf, 0) for cf in excluding)

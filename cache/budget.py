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
        self._pins: dict[ChunkRef, int] = {}

    def added(self, nbytes: int) -> None:
        self.used += nbytes

    def removed(self, nbytes: int) -> None:
        self.used -= nbytes

    def clean(self, ref: ChunkRef, nbytes: int) -> None:
        """The chunk became clean (or was read): it is the newest eviction candidate."""
        self._clean_lru[ref] = nbytes
        self._clean_lru.move_to_end(ref)

    def touch(self, ref: ChunkRef) -> None:
        if ref in self._clean_lru:
            self._clean_lru.move_to_end(ref)

    def not_clean(self, ref: ChunkRef) -> None:
        self._clean_lru.pop(ref, None)

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
        return sum(n for (cf, _), n in self._clean_lru.items() if cf not in excluding)

    def forget_file(self, cf: CachedFile) -> None:
        for ref in [r for r in self._clean_lru if r[0] is cf]:
            del self._clean_lru[ref]

"""The cache budget (cache/budget.py): which clean chunks eviction takes first, and how many
bytes it could free, kept as the chunks change rather than summed on every question."""

from __future__ import annotations

import random
import stat

from lakefs_mount.cache.budget import CacheBudget, ChunkRef
from lakefs_mount.cache.cachefile import CachedFile


def _file(key: str) -> CachedFile:
    return CachedFile(key=key, size=0, mode=stat.S_IFREG | 0o644, uid=0, gid=0, mtime_ns=1)


def test_clean_bytes_follow_every_change_and_leave_out_the_files_asked() -> None:
    budget = CacheBudget(1 << 30)
    files = [_file(f"f{i}") for i in range(6)]
    clean: dict[ChunkRef, int] = {}
    rnd = random.Random(7)
    for _ in range(3000):
        ref = (rnd.choice(files), rnd.randrange(4))
        if rnd.random() < 0.6:  # cleaned (again: a chunk fetched anew has another size)
            clean[ref] = rnd.randrange(0, 1 << 20)
            budget.clean(ref, clean[ref])
        else:  # written to, or evicted: not a candidate any more (twice is harmless)
            clean.pop(ref, None)
            budget.not_clean(ref)
        excluding = set(rnd.sample(files, rnd.randrange(3)))
        want = sum(n for (cf, _), n in clean.items() if cf not in excluding)
        assert budget.clean_bytes(excluding) == want
    for ref in list(clean):
        budget.not_clean(ref)
    assert budget.clean_bytes(set()) == 0


def test_victims_are_the_least_recently_used_clean_chunks_that_are_not_pinned() -> None:
    budget = CacheBudget(1 << 30)
    a, b = _file("a"), _file("b")
    for ref in ((a, 0), (a, 1), (b, 0)):
        budget.clean(ref, 100)
    budget.touch((a, 0))  # read again: now the newest
    budget.pin((a, 1))  # being read or uploaded
    assert budget.victims(150) == [(b, 0), (a, 0)]
    budget.clean((b, 0), 100)  # cleaned again: the newest
    assert budget.victims(100) == [(a, 0)]
    budget.unpin((a, 1))
    assert budget.victims(100) == [(a, 1)]

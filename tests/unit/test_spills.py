"""A file larger than the cache (D30, cache/spills), without the kernel: its full chunks
spill as objects of their own once the cache cannot hold them, are evicted and read back
from S3, and the commit copies them into the object (end to end: mount/test_cache_full)."""

from __future__ import annotations

import random

import trio

from lakefs_mount import metrics as m
from lakefs_mount.cache.recovery import recover
from lakefs_mount.cache.spills import FOLDER
from tests.memstore import MemoryObjectStore
from tests.unit.test_cache import PART, core, run

CACHE = 4 * PART


def _spilled_objects(store) -> list[str]:
    return [k for k in store.objects if FOLDER in k]


async def _gone(store) -> None:
    with trio.fail_after(5):
        while _spilled_objects(store):
            await trio.sleep(0.01)


def test_a_file_four_times_the_cache_spills_stays_within_the_cache_and_lands_whole(tmp_path):
    data = random.randbytes(16 * PART)

    async def body() -> None:
        async with core(tmp_path, cache_size=CACHE, max_dirty=PART) as c:
            cf = c.new_file("big")
            await c.cache.new_file(cf)
            cf.writers += 1
            most = 0
            for off in range(0, len(data), PART // 2):
                await c.cache.write(cf, off, data[off:off + PART // 2])
                most = max(most, c.cache.budget.used)
            assert most <= CACHE + 2 * PART  # (the margin: a part going up, one being written)
            assert c.cache.metrics[m.PARTS_SPILLED] >= 8
            await c.close_and_flush(cf)
            assert c.store.objects["big"].body == data
            assert c.cache.metrics[m.PARTS_COPIED] == c.cache.metrics[m.PARTS_SPILLED]
            await _gone(c.store)
            assert c.journal.pending_files() == [] and not cf.spills
    run(body)


def test_an_evicted_spilled_chunk_is_read_back_and_written_into_before_the_commit(tmp_path):
    data = bytearray(random.randbytes(12 * PART))

    async def body() -> None:
        async with core(tmp_path, cache_size=CACHE, max_dirty=PART) as c:
            cf = await c.write_file("big", bytes(data), block=PART)
            spilled = sorted(cf.spills)
            assert spilled
            await c.cache.evictor.evict_bytes(1 << 40)
            first = spilled[0]
            assert first not in cf.chunks  # not cached: its bytes are only in S3
            at = first * PART + 100
            assert await c.cache.read(cf, at, 1000) == bytes(data[at:at + 1000])
            await c.cache.evictor.evict_bytes(1 << 40)
            await c.cache.write(cf, at, b"new bytes")  # a partial write: the rest is kept
            data[at:at + 9] = b"new bytes"
            assert first not in cf.spills  # stale now: the commit sends the chunk
            await c.close_and_flush(cf)
            assert c.store.objects["big"].body == bytes(data)
            await _gone(c.store)
    run(body)


def test_spilled_parts_survive_a_crash_and_the_next_mount_commits_them(tmp_path):
    data = random.randbytes(12 * PART)
    store = MemoryObjectStore()
    store.put(FOLDER + "local/999/0-deadbeef", b"left by a crash", {})  # no file names it

    async def crash() -> None:
        async with core(tmp_path, store, cache_size=CACHE, max_dirty=PART) as c:
            cf = await c.write_file("big", data, block=PART)
            assert cf.spills
            await c.cache.evictor.evict_bytes(1 << 40)

    async def remount() -> None:
        async with core(tmp_path, store, cache_size=CACHE, max_dirty=PART) as c:
            files, report = await recover(c.cache)
            assert report.spilled_parts_kept > 0 and report.spilled_parts_swept == 1
            for cf in files:
                c.flusher.request_commit(cf)
            await c.flusher.flush(files)
            assert store.objects["big"].body == data
            await _gone(store)

    run(crash)
    run(remount)

"""The write-back cache and flusher without the kernel, over the in-memory object store.

These pin down the upload protocol (which S3 calls, in which shape); the same
behaviours are proven end to end through a real mount in tests/mount/.
"""

from __future__ import annotations

import os
import random
import stat
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from lakefs_mount import metrics as m
from lakefs_mount.cache.asyncjournal import AsyncJournal
from lakefs_mount.cache.cachefile import DIRTY_STATES, CachedFile, ChunkState
from lakefs_mount.cache.flusher import Flusher
from lakefs_mount.cache.journal import Journal
from lakefs_mount.cache.manager import CacheManager
from lakefs_mount.cache.recovery import recover
from lakefs_mount.cache.warmup import CacheTooSmall, warm_up
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.crc import crc32c_of
from lakefs_mount.s3.layout import META_PARTS, PartMap
from lakefs_mount.s3.objectstore import CorruptRead, ObjectStore, ObjectStoreError
from lakefs_mount.s3.parttable import PartTable
from lakefs_mount.uring import open_engine
from tests.memstore import MemoryObjectStore

MiB = 1024 * 1024
PART = 8 * MiB


@dataclass
class Core:
    cache: CacheManager
    flusher: Flusher
    store: ObjectStore
    journal: Journal

    def new_file(self, key: str) -> CachedFile:
        return CachedFile(key=key, size=0, mode=stat.S_IFREG | 0o644, uid=0, gid=0, mtime_ns=1)

    def in_s3(self, key: str, size: int, etag: str | None = None) -> CachedFile:
        """The file of object `key` as a listing shows it: nothing of it cached yet."""
        cf = self.new_file(key)
        cf.size = cf.base.size = size
        cf.base.key, cf.base.etag = key, etag
        return cf

    async def write_file(self, key: str, data: bytes, block: int = MiB) -> CachedFile:
        cf = self.new_file(key)
        await self.cache.new_file(cf)
        cf.writers += 1
        for off in range(0, len(data), block):
            await self.cache.write(cf, off, data[off:off + block])
        return cf

    async def close_and_flush(self, cf: CachedFile) -> None:
        cf.writers -= 1
        self.flusher.request_commit(cf)
        await self.flusher.flush([cf])


@asynccontextmanager
async def core(tmp_path: Path, store: ObjectStore | None = None,
               max_dirty: int = 1 << 40, cache_size: int = 1 << 40,
               commit_delay: float = 0.0, open_files: int = 1024,
               direct_io: bool = True) -> AsyncIterator[Core]:
    store = store or MemoryObjectStore()
    journal = Journal(tmp_path / "journal.db")
    metrics = m.Metrics()
    async with open_engine("threads") as engine, trio.open_nursery() as nursery:
        cache = CacheManager(tmp_path, engine, AsyncJournal(journal), AsyncStore(store, metrics),
                             PartMap(PART), metrics, max_dirty=max_dirty, cache_size=cache_size,
                             open_files=open_files, direct_io=direct_io)
        flusher = Flusher(cache, 4, commit_delay=commit_delay)
        await nursery.start(cache.run)
        await nursery.start(flusher.run)
        yield Core(cache, flusher, store, journal)
        nursery.cancel_scope.cancel()
    journal.close()


def run(test: Callable[[], Awaitable[None]]) -> None:
    trio.run(test)


def test_small_file_is_one_put_object(tmp_path):
    async def body() -> None:
        async with core(tmp_path) as c:
            cf = await c.write_file("small", b"x" * 1000)
            await c.close_and_flush(cf)
            assert c.store.objects["small"].body == b"x" * 1000
            assert c.store.calls["put"] == 1 and c.store.calls["create_multipart"] == 0
            assert c.journal.pending_files() == []
    run(body)


def test_flush_progress_counts_the_bytes_of_the_file_not_whole_chunks(tmp_path):
    async def body() -> None:
        async with core(tmp_path) as c:
            six = await c.write_file("six", b"hello\n")
            half = await c.write_file("half", b"h" * (PART // 2 + 3))  # no full part: no upload yet
            assert c.flusher.progress([six, half]).bytes_left == 6 + PART // 2 + 3
    run(body)


def test_a_new_file_and_its_first_write_cost_one_journal_intent(tmp_path):
    """create() journals the file with its first chunk dirty; writes into that chunk are
    covered by it (the journal round trip was half the cost of a small file)."""
    async def body() -> None:
        async with core(tmp_path) as c:
            intents: list[list[int]] = []
            mark_dirty = c.journal.mark_dirty
            c.journal.mark_dirty = lambda rec, idx: (intents.append(idx), mark_dirty(rec, idx))
            cf = await c.write_file("small", random.randbytes(64 * 1024), block=4096)
            assert intents == [[0]]
            assert [p.fid for p in c.journal.pending_files()] == [cf.fid]
            await c.write_file("two-chunks", random.randbytes(PART + 1))
            assert intents == [[0], [0], [1]]
            await c.close_and_flush(cf)
            assert c.store.get("small") is not None
            assert cf.fid not in [p.fid for p in c.journal.pending_files()]
    run(body)


def test_a_closed_file_commits_once_its_commit_delay_has_passed_in_due_order(tmp_path):
    """Commits wait for the delay after the last close (a rename may still come), each
    file on its own schedule: a later close neither hurries nor holds back an earlier one."""
    clock = trio.testing.MockClock()  # virtual time moves only when the test jumps it

    async def real_pause() -> None:  # lets real I/O and S3 calls finish; virtual time stands
        await trio.to_thread.run_sync(time.sleep, 0.2)

    async def body() -> None:
        async with core(tmp_path, commit_delay=1.0) as c:
            first = await c.write_file("first", b"1" * 1000)
            second = await c.write_file("second", b"2" * 1000)

            def close(cf: CachedFile) -> None:
                cf.writers -= 1
                c.flusher.request_commit(cf, settle=True)

            def committed() -> set[str]:
                return {k for k in ("first", "second") if c.store.get(k) is not None}

            close(first)
            clock.jump(0.5)
            close(second)
            await real_pause()
            clock.jump(0.4)  # 0.9 s after the first close
            await real_pause()
            assert committed() == set()
            clock.jump(0.2)  # 1.1 s after the first close, 0.6 s after the second
            for _ in range(50):
                await real_pause()
                if committed():
                    break
            await real_pause()
            assert committed() == {"first"}
            clock.jump(0.5)
            for _ in range(50):
                await real_pause()
                if len(committed()) == 2:
                    break
            assert committed() == {"first", "second"}
            assert c.journal.pending_files() == []
    trio.run(body, clock=clock)


def test_full_chunks_stream_as_parts_before_close(tmp_path):
    async def body() -> None:
        async with core(tmp_path) as c:
            data = random.randbytes(3 * PART + 5)
            cf = await c.write_file("big", data)
            with trio.fail_after(10):
                while c.store.calls["upload_part"] < 3:
                    await trio.sleep(0.01)
            assert "big" not in c.store.objects  # still open: not committed
            await c.close_and_flush(cf)
            assert c.store.objects["big"].body == data
            assert c.store.calls["upload_part"] == 4  # three streamed, the tail at close
    run(body)


def test_random_overwrites_before_close_are_in_the_object(tmp_path):
    async def body() -> None:
        async with core(tmp_path) as c:
            expected = bytearray(random.randbytes(4 * PART + 77))
            cf = await c.write_file("f", bytes(expected))
            rnd = random.Random(7)
            for _ in range(40):
                off = rnd.randrange(len(expected) - 5000)
                patch = rnd.randbytes(rnd.randrange(1, 5000))
                expected[off:off + len(patch)] = patch
                await c.cache.write(cf, off, patch)
            await c.close_and_flush(cf)
            assert c.store.objects["f"].body == bytes(expected)
    run(body)


def test_editing_a_committed_object_copies_unchanged_parts_server_side(tmp_path):
    async def body() -> None:
        async with core(tmp_path) as c:
            data = random.randbytes(4 * PART)
            cf = await c.write_file("f", data)
            await c.close_and_flush(cf)
            uploads_before = c.store.calls["upload_part"]
            cf.chunks.clear()  # as after a remount: nothing cached
            cf.writers += 1
            await c.cache.write(cf, PART + 10, b"patch")
            await c.close_and_flush(cf)
            want = data[:PART + 10] + b"patch" + data[PART + 15:]
            assert c.store.objects["f"].body == want
            assert c.store.calls["upload_part"] - uploads_before == 1
            assert c.store.calls["upload_part_copy"] == 3
    run(body)


def test_chunks_of_a_multipart_object_are_checked_against_its_part_table(tmp_path):
    """A committed multipart object names the table of its parts' CRCs; a cold read of one
    of its chunks is checked against it: a chunk that does not match is fetched again,
    then refused (the read fails with CorruptRead, EIO to the kernel), and not cached."""
    store = MemoryObjectStore()
    data = random.randbytes(2 * PART + 5)
    (tmp_path / "w").mkdir()
    (tmp_path / "r").mkdir()

    async def body() -> None:
        async with core(tmp_path / "w", store) as c:
            cf = await c.write_file("big", data)
            await c.close_and_flush(cf)
        info = store.head("big")
        assert info is not None
        table_key = info.metadata[META_PARTS]
        table = PartTable.decode(store.objects[table_key].body, table_key)
        assert table.crcs == tuple(crc32c_of(data[i:i + PART]) for i in (0, PART, 2 * PART))
        wrong = PartTable(table.size, table.part_size,
                          (table.crcs[0], (table.crcs[1] or 0) ^ 1, table.crcs[2]))
        store.put(table_key, wrong.encode(), {})  # says part 2 holds other bytes
        async with core(tmp_path / "r", store) as c:
            cf = c.in_s3("big", len(data), info.etag)
            cf.base.meta = dict(info.metadata)
            assert await c.cache.read(cf, 0, 100) == data[:100]
            with pytest.raises(CorruptRead):
                await c.cache.read(cf, PART, 100)
            assert 1 not in cf.chunks
            assert c.cache.metrics[m.READ_CHECKSUM_ERRORS] >= 4  # every attempt (and readahead)
            assert await c.cache.read(cf, 2 * PART, 5) == data[2 * PART:]
            assert c.cache.metrics[m.BYTES_VERIFIED] == PART + 5
    run(body)


def test_a_row_written_while_an_upload_is_open_keeps_what_the_upload_needs(tmp_path):
    """Every write of a file's journal row (a new dirty chunk, new attributes) keeps its
    open upload's checksum mode and part table: they went back to 0 and NULL, and a
    recovered upload then completed without its parts' CRCs or its table."""
    async def body() -> None:
        async with core(tmp_path) as c:
            cf = await c.write_file("streamed", random.randbytes(2 * PART + 5))
            key, upload_id = await c.flusher.uploads.ensure(cf)
            await c.cache.save_attrs(cf)  # the row again, with the upload open
            [rec] = c.journal.pending_files()
            assert (rec.upload_id, rec.upload_key) == (upload_id, key)
            assert rec.upload_table == cf.upload.table is not None
            assert rec.upload_checksum == int(cf.upload.checksum)
    run(body)


def test_a_file_rewritten_in_place_sends_each_part_once_until_it_is_closed(tmp_path):
    """A writer going over the same region again and again (fsx, a log rewritten in
    place): each full chunk streams once while the file is open, not at every pass
    (issue 53 measured 11 GB uploaded for a few 32 MiB files); the close sends the rest."""
    data = [random.randbytes(3 * PART) for _ in range(6)]

    async def settle(c: Core) -> None:
        while c.cache.demand.busy():
            await trio.sleep(0.01)

    async def body() -> None:
        async with core(tmp_path) as c:
            cf = c.new_file("rewritten")
            await c.cache.new_file(cf)
            cf.writers += 1
            for version in data:  # six sequential passes over the same three chunks
                for off in range(0, len(version), MiB):
                    await c.cache.write(cf, off, version[off:off + MiB])
                await settle(c)
            assert c.store.calls["upload_part"] == 2  # chunks 0 and 1, once each
            await c.close_and_flush(cf)
            assert c.store.objects["rewritten"].body == data[-1]
            assert c.store.calls["upload_part"] <= 2 + 3
    run(body)


@pytest.mark.parametrize("write", ["done", "under way"])
def test_a_part_refused_because_a_write_changed_it_on_the_way_is_no_s3_error(tmp_path, write):
    """BadDigest for a part whose chunk a write changed while it was sent (its CRC taken
    before, its bytes read after) is the write's doing, not S3's: the chunk is dirty
    again, nothing counts as an error, and the commit sends it as it is then. Also while
    that write is still under way (it moves the chunk's gen only once its bytes are in:
    fsx through the pyfuse3 session counted these as errors)."""
    changed: list[CachedFile] = []
    writing: list[CachedFile] = []

    class ChangingUnderway(MemoryObjectStore):
        def upload_part(self, key, upload_id, part_number, body, checksum=False):
            if changed:  # a write lands while the part is on its way
                cf = changed.pop()
                if write == "done":
                    cf.chunks[part_number - 1].gen += 1
                else:
                    cf.writes.in_flight += 1
                    writing.append(cf)
                error = ObjectStoreError("BadDigest: the body does not match its CRC-32C")
                error.code, error.transient = "BadDigest", True
                raise error
            return super().upload_part(key, upload_id, part_number, body, checksum)

    store = ChangingUnderway()
    data = random.randbytes(2 * PART)

    async def body() -> None:
        async with core(tmp_path, store) as c:
            cf = c.new_file("raced")
            await c.cache.new_file(cf)
            cf.writers += 1
            changed.append(cf)
            for off in range(0, len(data), MiB):  # chunk 0 streams when chunk 1 begins
                await c.cache.write(cf, off, data[off:off + MiB])
            while c.cache.demand.busy():
                await trio.sleep(0.01)
            assert not changed and cf.chunks[0].state is ChunkState.DIRTY
            assert c.cache.metrics[m.ERRORS] == 0 and cf.errors.count == 0
            for under_way in writing:  # that write ends
                under_way.writes.in_flight -= 1
                under_way.chunks[0].gen += 1
            await c.close_and_flush(cf)
            assert store.objects["raced"].body == data
    run(body)


def test_a_part_found_stale_stays_to_check_until_it_is_sent_again(tmp_path):
    """An uploaded part a passthrough writer changed afterwards (its CRC no longer the
    cache file's) is found stale at the commit; if that commit is superseded before it
    sends the part again, the next commit must find it stale too. The check cleared its
    flag either way, and the next commit completed with the old part: S3 kept bytes the
    mount no longer showed (a rewrite workload under load, 1 run in 3)."""
    data = random.randbytes(PART + 5)

    async def body() -> None:
        async with core(tmp_path) as c:
            cf = await c.write_file("changed", data)
            await c.close_and_flush(cf)
            ch = cf.chunks[0]
            c.cache.book.set_state(cf, ch, 0, ChunkState.UPLOADED)  # as a streamed part
            ch.etag, ch.length, ch.sent_crc, ch.verify = "e", PART, crc32c_of(data[:PART]), True
            assert cf.fid is not None
            fd = os.open(c.cache.cachefiles.path(cf.fid), os.O_WRONLY)
            try:
                os.pwrite(fd, b"written by the kernel", 100)  # a passthrough writer's bytes
            finally:
                os.close(fd)
            assert await c.flusher.uploads._stale(cf, 0, ch)
            assert await c.flusher.uploads._stale(cf, 0, ch)  # (superseded: asked again)
    run(body)


def test_growing_an_object_never_read_keeps_its_bytes_in_s3(tmp_path):
    """truncate() past the end of an object whose bytes were never fetched: S3 gets the
    old bytes with zeros after them (a small file: in one PutObject, read from the cache
    file by the thread that sends it; a larger one: unchanged parts copied server-side)."""
    store = MemoryObjectStore()
    small, big = random.randbytes(100_000), random.randbytes(PART + 5000)
    store.put("small", small, {})
    store.put("big", big, {})

    async def body() -> None:
        async with core(tmp_path, store) as c:
            for key, data in (("small", small), ("big", big)):
                cf = c.in_s3(key, len(data))
                cf.writers += 1
                await c.cache.truncate(cf, len(data) + 3000)
                await c.close_and_flush(cf)
                assert store.objects[key].body == data + bytes(3000)
    run(body)


def test_truncate_then_grow_reads_zeros_and_commits_them(tmp_path):
    async def body() -> None:
        async with core(tmp_path) as c:
            cf = await c.write_file("t", b"a" * (PART + 100))
            await c.cache.truncate(cf, 10)
            await c.cache.truncate(cf, PART * 2 + 1)
            assert await c.cache.read(cf, 0, 20) == b"a" * 10 + bytes(10)
            await c.close_and_flush(cf)
            assert c.store.objects["t"].body == b"a" * 10 + bytes(PART * 2 + 1 - 10)
    run(body)


def test_recovery_rebuilds_pending_files_and_aborts_orphans(tmp_path):
    """D1 + D4 without the kernel: a fresh core on the same cache dir finishes the job."""
    store = MemoryObjectStore()
    data = random.randbytes(2 * PART + 3)

    async def crash() -> None:
        async with core(tmp_path, store) as c:
            cf = await c.write_file("r", data)
            with trio.fail_after(10):
                while sum(st == "uploaded" for st, _ in c.journal.chunks(cf.fid).values()) < 2:
                    await trio.sleep(0.01)
            orphan = store.create_multipart("orphan", {})
            c.journal.start_upload(cf.fid, orphan, "orphan")  # then superseded below
            c.journal.start_upload(cf.fid, cf.upload.id, cf.upload.key)

    async def remount() -> None:
        async with core(tmp_path, store) as c:
            files, report = await recover(c.cache)
            assert report.files == 1 and report.orphan_uploads_aborted == 1
            assert report.uploaded_parts_kept == 2
            await c.flusher.flush(files)
            assert store.objects["r"].body == data
            assert store.uploads == {}

    trio.run(crash)
    trio.run(remount)


def test_a_symlink_planted_as_a_pending_cache_file_is_refused_not_followed(tmp_path):
    """D27: between two mounts, data/<fid> of an acknowledged file became a symlink to
    another file. Recovery reads nothing through it: the link goes to refused/, the file
    counts as one whose cache file is gone, and the other file's bytes never reach S3."""
    store = MemoryObjectStore()
    secret = tmp_path / "secret"
    secret.write_bytes(b"not the mount's to upload" * 1000)
    (tmp_path / "c").mkdir()
    fids: list[int] = []

    async def crash() -> None:
        async with core(tmp_path / "c", store, commit_delay=3600) as c:
            cf = await c.write_file("pending.bin", b"acknowledged" * 1000)
            assert cf.fid is not None
            fids.append(cf.fid)

    async def remount() -> None:
        async with core(tmp_path / "c", store) as c:
            await c.cache.load_warm()
            files, report = await recover(c.cache)
            assert files == [] and report.missing_cache_files == 1
            assert c.cache.metrics[m.CACHE_FILES_REFUSED] == 1
            assert c.journal.pending_files() == []
            await c.flusher.flush([])

    trio.run(crash)
    data = tmp_path / "c" / "data" / str(fids[0])
    data.unlink()
    data.symlink_to(secret)
    trio.run(remount)
    assert all(b"not the mount's" not in o.body for o in store.objects.values())
    refused = tmp_path / "c" / "refused" / str(fids[0])
    assert refused.is_symlink() and secret.read_bytes().startswith(b"not the mount's")
    assert not data.exists() and not data.is_symlink()


class SlowStore(MemoryObjectStore):
    """Uploads take a while, like a real backend under load."""

    def upload_part(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.2)
        return super().upload_part(*args, **kwargs)


def test_max_dirty_makes_writers_wait_for_the_flusher(tmp_path):
    async def body() -> None:
        async with core(tmp_path, SlowStore(), max_dirty=2 * PART) as c:
            data = random.randbytes(6 * PART)
            cf = await c.write_file("bp", data)
            assert c.cache.metrics[m.WRITER_WAITS] >= 1
            assert c.cache.dirty_bytes <= 3 * PART
            await c.close_and_flush(cf)
            assert c.store.objects["bp"].body == data
    run(body)


def test_a_write_during_an_upload_sends_the_chunk_again(tmp_path):
    async def body() -> None:
        async with core(tmp_path) as c:
            cf = await c.write_file("w", b"1" * (2 * PART))
            with trio.fail_after(10):
                while cf.state(0) is ChunkState.DIRTY:
                    await trio.sleep(0)
            await c.cache.write(cf, 0, b"2")
            await c.close_and_flush(cf)
            assert c.store.objects["w"].body[:2] == b"21"
    run(body)


def test_reading_4x_the_cache_size_stays_within_it_and_reads_right(tmp_path):
    store = MemoryObjectStore()
    data = random.randbytes(16 * PART)
    store.put("big", data, {})

    async def body() -> None:
        async with core(tmp_path, store, cache_size=4 * PART, max_dirty=2 * PART) as c:
            cf = c.in_s3("big", len(data))
            peak = 0
            for off in range(0, len(data), MiB):  # sequential, with readahead
                assert await c.cache.read(cf, off, MiB) == data[off:off + MiB]
                peak = max(peak, c.cache.budget.used)
            rnd = random.Random(3)
            for _ in range(50):  # random
                off = rnd.randrange(len(data) - 1000)
                assert await c.cache.read(cf, off, 1000) == data[off:off + 1000]
                peak = max(peak, c.cache.budget.used)
            await trio.sleep(0.1)
            assert c.cache.budget.used <= 4 * PART
            assert peak <= 4 * PART + (c.cache.read_ahead + 2) * PART
            assert c.cache.metrics[m.CACHE_EVICTIONS] > 0
            blocks = (tmp_path / "data" / str(cf.fid)).stat().st_blocks * 512
            assert blocks <= 5 * PART  # holes really were punched
    run(body)


def _held_by_chunks(c: Core, files: list[CachedFile]) -> int:
    return sum(ch.held for cf in files for ch in cf.chunks.values())


def test_small_files_count_their_bytes_not_whole_chunks_against_the_cache(tmp_path):
    """A training set of 100 KiB objects fits a cache of that size: each file counts
    what it holds, not a whole chunk (which let a 64 GiB cache keep 4,096 of them)."""
    store = MemoryObjectStore()
    bodies = {f"train/f{i}": random.randbytes(100_000 + i) for i in range(300)}
    for key, data in bodies.items():
        store.put(key, data, {})
    total = sum(map(len, bodies.values()))  # ~29 MiB: less than 4 chunks of 8 MiB

    async def body() -> None:
        async with core(tmp_path, store, cache_size=4 * PART, max_dirty=2 * PART) as c:
            files = []
            for key, data in bodies.items():
                cf = c.in_s3(key, len(data))
                files.append(cf)
                assert await c.cache.read(cf, 0, len(data)) == data
            gets = store.calls["get_range"]
            for cf in files:  # a second epoch: all of it still cached
                assert await c.cache.read(cf, 0, cf.size) == bodies[cf.key]
            assert store.calls["get_range"] == gets
            assert c.cache.metrics[m.CACHE_EVICTIONS] == 0
            assert c.cache.budget.used == total == _held_by_chunks(c, files)
    run(body)


def test_cache_files_kept_open_stay_within_the_descriptor_budget(tmp_path):
    """Reading more files than the daemon may keep open closes the least recently used
    idle ones (each file read once kept its descriptor, until EMFILE); files being
    written keep working across a close and reopen."""
    store = MemoryObjectStore()
    bodies = {f"train/f{i}": random.randbytes(1000 + i) for i in range(200)}
    for key, data in bodies.items():
        store.put(key, data, {})

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def body() -> None:
        async with core(tmp_path, store, open_files=16) as c:
            before = open_fds()
            writing = await c.write_file("out/a", b"a" * 5000, block=1000)
            files = []
            for key, data in bodies.items():
                cf = c.in_s3(key, len(data))
                files.append(cf)
                assert await c.cache.read(cf, 0, len(data)) == data
                assert len(c.cache.fds) <= 16
            assert open_fds() - before <= 16
            assert writing.io.fd is None  # the least recently used: closed while idle
            await c.cache.write(writing, 5000, b"b" * 5000)  # opens it again
            for cf in files:  # a second epoch reads the cached bytes back through reopens
                assert await c.cache.read(cf, 0, cf.size) == bodies[cf.key]
            await c.close_and_flush(writing)
            assert c.store.objects["out/a"].body == b"a" * 5000 + b"b" * 5000
    run(body)


def test_fsync_reaches_the_disk_even_after_the_descriptor_was_closed(tmp_path):
    """The descriptor budget may close the cache file of a file still being written;
    fsync() must still flush that file's bytes (it skipped them when no fd was open)."""
    store = MemoryObjectStore()
    for i in range(8):
        store.put(f"other/f{i}", b"o" * 100, {})

    async def body() -> None:
        async with core(tmp_path, store, open_files=4) as c:
            written = await c.write_file("out/a", b"a" * 5000)
            for i in range(8):  # other files' reads push its descriptor out
                assert await c.cache.read(c.in_s3(f"other/f{i}", 100), 0, 100) == b"o" * 100
            assert written.io.fd is None
            synced: list[int] = []
            fsync = c.cache.engine.fsync

            async def counting_fsync(fd: int, datasync: bool = False) -> None:
                synced.append(fd)
                await fsync(fd, datasync)
            c.cache.engine.fsync = counting_fsync  # type: ignore[method-assign]
            await c.cache.fsync(written, datasync=False)
            assert len(synced) == 1
    run(body)


def test_a_training_set_larger_than_the_cache_is_evicted_in_batches(tmp_path):
    """Eviction frees many small chunks with one journal transaction, not one each, and
    the cache ends within its budget with every read right."""
    store = MemoryObjectStore()
    bodies = {f"big-set/f{i}": random.randbytes(60_000 + i) for i in range(400)}
    for key, data in bodies.items():
        store.put(key, data, {})

    async def body() -> None:
        async with core(tmp_path, store, cache_size=4 * MiB, max_dirty=2 * MiB) as c:
            batches: list[int] = []
            drop = c.journal.drop_clean_many
            c.journal.drop_clean_many = lambda chunks: (batches.append(len(chunks)),
                                                        drop(chunks))
            files = []
            for key, data in bodies.items():  # 24 MB through a 4 MiB cache
                cf = c.in_s3(key, len(data))
                files.append(cf)
                assert await c.cache.read(cf, 0, len(data)) == data
            await trio.sleep(0.2)
            evicted = c.cache.metrics[m.CACHE_EVICTIONS]
            assert evicted >= 300 and sum(batches) == evicted
            assert len(batches) < evicted // 4  # was one transaction per chunk
            assert c.cache.budget.used == _held_by_chunks(c, files) <= 4 * MiB
            for cf in files[-10:]:  # the newest are still cached
                assert 0 in cf.chunks
    run(body)


def test_dirty_bytes_count_what_was_written_as_the_file_grows(tmp_path):
    """--max-dirty is about bytes: many small pending files do not make writers wait,
    and a file written in small pieces counts exactly its size until it is uploaded."""
    async def body() -> None:
        async with core(tmp_path, max_dirty=2 * PART, cache_size=4 * PART) as c:
            small = [await c.write_file(f"s{i}", random.randbytes(10_000)) for i in range(50)]
            grown = await c.write_file("grown", random.randbytes(3 * MiB + 5), block=4096)
            files = [*small, grown]
            assert c.cache.dirty_bytes == 50 * 10_000 + 3 * MiB + 5
            assert c.cache.metrics[m.WRITER_WAITS] == 0
            await c.cache.truncate(grown, PART + 10)  # grows into a second chunk
            assert c.cache.budget.used == _held_by_chunks(c, files)
            for cf in files:
                await c.close_and_flush(cf)
            assert c.cache.dirty_bytes == 0
            assert c.cache.budget.used == _held_by_chunks(c, files) == 50 * 10_000 + PART + 10
    run(body)


def test_concurrent_readers_of_one_chunk_share_one_get(tmp_path):
    store = MemoryObjectStore()
    data = random.randbytes(PART)
    store.put("one", data, {})

    async def body() -> None:
        async with core(tmp_path, store) as c:
            cf = c.in_s3("one", len(data))
            results: list[bytes] = []

            async def reader(off: int) -> None:
                results.append(await c.cache.read(cf, off, 100))

            async with trio.open_nursery() as nursery:
                for i in range(10):
                    nursery.start_soon(reader, 1000 + i * 100)
            assert sorted(results) == sorted(data[1000 + i * 100:1100 + i * 100]
                                             for i in range(10))
            assert store.calls["get_range"] == 1
    run(body)


def test_a_warm_up_fetches_each_missing_chunk_once_even_beside_a_reader(tmp_path):
    store = MemoryObjectStore()
    bodies = {"a": random.randbytes(3 * PART + 5), "b": random.randbytes(PART), "c": b"xy"}
    for key, body in bodies.items():
        store.put(key, body, {})

    async def body() -> None:
        async with core(tmp_path, store, cache_size=8 * PART) as c:
            files = [c.in_s3(key, len(data)) for key, data in bodies.items()]
            await c.cache.read(files[0], 0, 1)  # chunk 0 of "a" is cached already
            async with trio.open_nursery() as nursery:  # a reader of "a" at the same time
                nursery.start_soon(c.cache.read, files[0], PART, PART)
                done = await warm_up(c.cache, files, _no_report)
            assert done.files == 3 and done.bytes_total == sum(map(len, bodies.values()))
            assert done.bytes_left == 0 and done.files_left == 0
            # what the reader's and the readahead's GETs brought counts as fetched too
            # (the readahead of chunk 0's read may have brought more before the warm-up)
            assert done.fetched_bytes == done.bytes_to_fetch <= done.bytes_total - PART
            assert store.calls["get_range"] == 4 + 1 + 1  # every chunk once, in all
            for cf, (key, data) in zip(files, bodies.items(), strict=True):
                assert await c.cache.read(cf, 0, len(data)) == data, key
            assert store.calls["get_range"] == 6
    run(body)


def test_a_warm_up_larger_than_the_cache_is_refused_before_any_get(tmp_path):
    store = MemoryObjectStore()
    store.put("big", random.randbytes(3 * PART), {})

    async def body() -> None:
        async with core(tmp_path, store, cache_size=2 * PART) as c:
            with pytest.raises(CacheTooSmall, match="do not fit in the cache"):
                await warm_up(c.cache, [c.in_s3("big", 3 * PART)], _no_report)
            assert store.calls["get_range"] == 0
    run(body)


async def _no_report(_progress: object) -> None:
    return None


def test_a_small_object_fetched_at_lookup_is_cached_only_if_it_is_the_listed_version(
        tmp_path):
    """The GET at lookup writes the bytes in its own thread; they count as the cached
    chunk only when size and ETag are those the listing gave (else the read fetches)."""
    store = MemoryObjectStore()
    listed = {name: store.put(name, b"x" * 1000, {}) for name in ("same", "resized", "edited")}
    store.put("resized", b"y" * 2000, {})  # changed in S3 after the listing
    store.put("edited", b"z" * 1000, {})

    async def body() -> None:
        async with core(tmp_path, store) as c:
            for name, etag in listed.items():
                cf = c.in_s3(name, 1000, etag)
                info = await c.cache.fetch_small_object(cf)
                assert info is not None and info.etag == store.head(name).etag
                assert (0 in cf.chunks) == (name == "same")
            gets = store.calls["get"] + store.calls["get_range"]
            cf = c.in_s3("same", 1000, listed["same"])
            assert await c.cache.fetch_small_object(cf) is not None
            assert await c.cache.read(cf, 0, 1000) == b"x" * 1000
            assert store.calls["get"] + store.calls["get_range"] == gets + 1  # no read GET
            gone = c.new_file("gone")
            gone.size = gone.base.size = 10
            gone.base.key, gone.base.etag = "gone", "e"
            assert await c.cache.fetch_small_object(gone) is None
    run(body)


def test_an_upload_created_but_never_recorded_is_aborted_at_the_next_mount(tmp_path):
    """D5: the intent row written before CreateMultipartUpload finds the hidden upload."""
    store = MemoryObjectStore()

    async def crash() -> None:
        async with core(tmp_path, store) as c:
            cf = await c.write_file("hidden", b"x")
            c.journal.intend_upload(cf.fid, "hidden")
            store.create_multipart("hidden", {})  # S3 made it; the daemon died before recording
            store.create_multipart("other-key", {})  # not ours to touch

    async def remount() -> None:
        async with core(tmp_path, store) as c:
            _, report = await recover(c.cache)
            assert report.orphan_uploads_aborted == 1
            assert [u.key for u in store.list_multipart_uploads("")] == ["other-key"]

    trio.run(crash)
    trio.run(remount)


@pytest.mark.parametrize("real_s3", [False, True])
def test_parts_stream_from_the_cache_file_in_pieces(tmp_path, request, real_s3):
    store = request.getfixturevalue("s3") if real_s3 else MemoryObjectStore()
    data = random.randbytes(3 * PART + 99)

    async def body() -> None:
        async with core(tmp_path, store) as c:
            cf = await c.write_file("streamed", data)
            await c.close_and_flush(cf)
    trio.run(body)
    assert store.get_range("streamed", 0, len(data) + 1) == data


@pytest.mark.timeout(60)
def test_rewriting_a_file_while_its_commit_runs_commits_the_new_content(tmp_path):
    """O_TRUNC + new writes during a multipart commit: the old commit gives way (it must
    neither spin nor mix versions), and the next commit lands exactly the new bytes."""
    async def body() -> None:
        async with core(tmp_path, SlowStore()) as c:
            cf = await c.write_file("re", random.randbytes(3 * PART + MiB))
            cf.writers -= 1
            c.flusher.request_commit(cf)
            with trio.fail_after(10):
                while cf not in c.flusher._committing:
                    await trio.sleep(0.01)
            cf.writers += 1
            await c.cache.truncate(cf, 0)
            new = random.randbytes(PART + MiB)
            for off in range(0, len(new), MiB):
                await c.cache.write(cf, off, new[off:off + MiB])
            with trio.fail_after(30):
                await c.close_and_flush(cf)
            assert c.store.objects["re"].body == new
            assert cf.errors.count == 0  # giving way is not an error
    run(body)


def test_a_reader_cancelled_while_its_get_is_held_stops_at_once_and_the_get_serves_the_rest(
        tmp_path):
    """An interrupted read (FUSE_INTERRUPT) cancels only its own wait: the GET it started
    goes on for the reader sharing it, and is not sent again."""
    release = threading.Event()

    class HeldStore(MemoryObjectStore):
        def get_range_into(self, key: str, start: int, end: int,
                           write: Callable[[int, bytes], None], *args: Any,
                           **kwargs: Any) -> tuple[int, bool]:
            release.wait(30)
            return super().get_range_into(key, start, end, write, *args, **kwargs)

    store = HeldStore()
    data = random.randbytes(PART)
    store.put("held", data, {})

    async def body() -> None:
        async with core(tmp_path, store) as c:
            cf = c.in_s3("held", len(data))
            shared: list[bytes] = []

            async def sharer() -> None:
                shared.append(await c.cache.read(cf, 4096, 100))

            async with trio.open_nursery() as nursery:
                with trio.move_on_after(0.3) as first:  # the reader that starts the GET
                    nursery.start_soon(sharer)
                    await c.cache.read(cf, 0, 100)
                assert first.cancelled_caught and not shared
                release.set()
            assert shared == [data[4096:4196]]
            assert await c.cache.read(cf, 0, 100) == data[:100]
            assert store.calls["get_range"] == 1
    run(body)


class HeldStore(MemoryObjectStore):
    """Part uploads of keys starting with "held" wait until `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def upload_part(self, key, *args, **kwargs):  # type: ignore[no-untyped-def]
        if key.startswith("held"):
            self.release.wait(30)
        return super().upload_part(key, *args, **kwargs)


def test_chunks_a_passthrough_writer_left_go_to_the_flusher_without_waiting_for_room(tmp_path):
    """The watcher hands the chunks behind a passthrough writer's frontier to the flusher.
    Their bytes are on the disk already, and the writer's last close waits for that
    hand-over: it must not wait for the dirty budget (that is, for S3) even when the
    budget is full. Before, it waited, and a last close arriving meanwhile took the
    chunks over as unsent: each part went up twice."""
    async def body() -> None:
        async with core(tmp_path, HeldStore(), max_dirty=3 * PART) as c:
            store = c.store
            assert isinstance(store, HeldStore)
            cf = c.new_file("pt")
            await c.cache.new_file(cf)
            held = await c.write_file("held", random.randbytes(2 * PART))  # fills the budget
            data = random.randbytes(3 * PART)
            fd = c.cache.cachefiles.open_loose(cf)  # the kernel writes the cache file itself
            try:
                os.pwrite(fd, data, 0)
            finally:
                os.close(fd)
            cf.pt.opens = cf.pt.writers = 1
            waits = c.cache.metrics[m.WRITER_WAITS]
            with trio.fail_after(10):  # S3 holds every upload: nothing drains meanwhile
                await c.cache.writer.stream_written(cf, [0, 1, 2])
            assert c.cache.metrics[m.WRITER_WAITS] == waits
            assert all(cf.chunks[i].state in DIRTY_STATES for i in range(3))
            cf.pt.opens = cf.pt.writers = 0  # the last release takes over and commits
            await c.cache.writer.take_over_written(cf, len(data), frozenset({0, 1, 2}))
            store.release.set()
            c.flusher.request_commit(cf)
            await c.flusher.flush([cf])
            assert c.store.objects["pt"].body == data
            await c.close_and_flush(held)
    run(body)


def test_a_create_the_full_cache_disk_refused_leaves_nothing_to_commit(tmp_path):
    """A create whose first chunk finds no room (a full cache disk) fails; the file it
    began was taken for pending and a flush committed it as an empty object, one the
    application was told it never made (CI, the 8-writer full-disk test)."""
    async def body() -> None:
        async with core(tmp_path) as c:
            cf = c.new_file("refused.bin")

            async def full(_nbytes: int) -> None:
                raise OSError(28, "cache disk full")

            c.cache.room.ensure = full  # type: ignore[method-assign]
            with pytest.raises(OSError):
                await c.cache.new_file(cf)
            assert not cf.pending and cf not in c.cache.files.values()
            await c.flusher.flush([f for f in c.cache.files.values() if f.pending])
            assert "refused.bin" not in c.store.objects
    run(body)


def test_a_commit_landing_after_a_truncate_below_it_brings_no_old_bytes_back(tmp_path):
    """fsx (pyfuse3, 1 run in 2): a commit of a 3-part file is under way; the file is cut
    to half a part and grown again, all before the commit lands. Its object then becomes
    the file's base, and the grown chunks, never cached, were read from it: the old bytes
    again, and the next commit copied them back. They are zeros."""
    entered, release = threading.Event(), threading.Event()

    class SlowComplete(MemoryObjectStore):
        def complete_multipart(self, *args, **kwargs):
            entered.set()
            release.wait(30)
            return super().complete_multipart(*args, **kwargs)

    store = SlowComplete()
    data = random.randbytes(3 * PART)
    cut = PART // 2
    want = data[:cut] + bytes(len(data) - cut)

    async def body() -> None:
        async with core(tmp_path, store) as c:
            cf = await c.write_file("f", data)
            cf.writers -= 1
            c.flusher.request_commit(cf)
            while not entered.is_set():
                await trio.sleep(0.01)
            await c.cache.writer.truncate(cf, cut)
            await c.cache.writer.truncate(cf, len(data))
            release.set()
            await c.flusher.flush([cf])
            for off in (0, cut, PART, 2 * PART):
                assert await c.cache.read(cf, off, 4096) == want[off:off + 4096], off
            for idx in range(3):  # nothing of it cached any more: read from S3 again
                c.cache.book.remove_chunk(cf, idx)
            assert await c.cache.read(cf, 2 * PART, 4096) == want[2 * PART:2 * PART + 4096]
            assert store.objects["f"].body == want
    run(body)


class GatedCreateStore(MemoryObjectStore):
    """CreateMultipartUpload says it was asked (`asked`), then waits for `go`."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = threading.Event()
        self.go = threading.Event()

    def create_multipart(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.asked.set()
        self.go.wait(10)
        return super().create_multipart(*args, **kwargs)


def test_a_file_removed_while_its_upload_is_created_leaves_no_upload_open(tmp_path):
    """The removal found no upload to abort (S3 had not answered the create yet), so the
    upload S3 then made must be aborted here, not left open until the next mount (issue
    51: a soak's kill -9, restart and rmtree of the recovered files left two open)."""
    store = GatedCreateStore()

    async def body() -> None:
        async with core(tmp_path, store) as c:
            cf = await c.write_file("gone", random.randbytes(2 * PART + 1))
            cf.writers -= 1
            c.flusher.request_commit(cf)
            with trio.fail_after(10):
                while not store.asked.is_set():
                    await trio.sleep(0.01)
            await c.cache.discard(cf)
            store.go.set()
            with trio.fail_after(10):
                while store.uploads or c.journal.orphan_uploads():
                    await trio.sleep(0.01)
            assert not store.objects
    run(body)

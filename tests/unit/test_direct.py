"""O_DIRECT cache-file I/O: what bypasses the page cache, and the buffers it lends.

Restores through a real mount read these paths end to end in tests/mount/test_restore.py.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import mmap
import os
import random
from pathlib import Path

import crc32c
import pytest
import trio

from lakefs_mount.cache import direct, fetcher, manager
from lakefs_mount.cache.direct import (
    ALIGN,
    BUFFER_SIZE,
    AlignedBuffers,
    read_through,
)
from lakefs_mount.cache.partbody import CachePartBody, UploadSource, crc_of
from lakefs_mount.uring._buffers import Pin
from tests.memstore import MemoryObjectStore
from tests.unit.test_cache import PART, core, run

MiB = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)


def cached_pages(path: Path) -> int:
    """How many pages of `path` the page cache holds (mincore of a private mapping)."""
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
        start = ctypes.c_char.from_buffer(mm)
        rc = _libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), vec)
        del start
    assert rc == 0, os.strerror(ctypes.get_errno())
    return sum(v & 1 for v in vec)


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def noted(c) -> list[int]:
    """Chunks of "ckpt" the journal holds for the next mount."""
    warm = c.journal.warm_files().get("ckpt")
    return [] if warm is None else warm.chunks


async def settled(cf, idx: int, within: float = 5.0) -> None:
    """Wait until chunk `idx` is on disk and read with O_DIRECT."""
    with trio.fail_after(within):
        while not cf.chunks[idx].direct:
            await trio.sleep(0.02)


def test_a_fetched_chunk_is_read_from_memory_then_written_back_and_noted(tmp_path):
    """A chunk a reader waits for stays in the page cache until a read reaches its end;
    then it goes to disk, leaves the page cache, is noted in the journal for the next
    mount, and is read back with O_DIRECT. Until then the journal does not know it."""
    store = MemoryObjectStore()
    data = random.randbytes(PART + 3 * MiB + 123)
    etag = store.put("ckpt", data, {})

    async def body() -> None:
        async with core(tmp_path, store) as c:
            cf = c.in_s3("ckpt", len(data), etag)
            first = await c.cache.read_lent(cf, 0, MiB)
            assert first == data[:MiB] and isinstance(first, memoryview) and first.readonly
            path = c.cache.cachefiles.path(cf.fid)
            assert cached_pages(path) >= PART // mmap.PAGESIZE  # chunk 0, in memory
            await c.cache.journal.write_notes()
            assert noted(c) == []
            assert not cf.chunks[0].direct
            got = [await c.cache.read_lent(cf, off, MiB) for off in range(MiB, PART, MiB)]
            assert b"".join([first, *got]) == data[:PART]
            await settled(cf, 0)  # (the write-back the last read started)
            await c.cache.journal.write_notes()
            assert noted(c) == [0]  # chunk 1, fetched ahead of the reader: not yet
            assert cached_pages(path) <= (len(data) - PART) // mmap.PAGESIZE + 1
            assert await c.cache.read_lent(cf, 2 * MiB, MiB) == data[2 * MiB:3 * MiB]
            rest = await c.cache.read(cf, PART, len(data) - PART)  # chunk 1, read whole
            assert rest == data[PART:]
            await settled(cf, 1)
            await c.cache.journal.write_notes()
            assert noted(c) == [0, 1]
            assert cached_pages(path) == 0 and path.read_bytes() == data
    run(body)


async def read_chunk_to_its_end(c, cf, idx: int, data: bytes) -> None:
    start = idx * PART
    assert await c.cache.read(cf, start + PART - MiB, MiB) == data[start + PART - MiB:
                                                                     start + PART]


def test_chunks_read_to_their_end_go_to_disk_once_the_restore_pauses(tmp_path):
    """While a restore goes on, the chunks it has read stay in the page cache (their
    write-back would compete with the fetch and the reader); once the reads pause for
    QUIET_FOR seconds, they all go to disk and into the journal."""
    store = MemoryObjectStore()
    data = random.randbytes(6 * PART)
    etag = store.put("ckpt", data, {})

    async def body() -> None:
        async with core(tmp_path, store) as c:
            cf = c.in_s3("ckpt", len(data), etag)
            for idx in range(6):  # a chunk read to its end every 0.2 s: 1.2 s of restore
                await read_chunk_to_its_end(c, cf, idx, data)
                assert not any(ch.direct for ch in cf.chunks.values())
                await trio.sleep(0.2)
            for idx in range(6):
                await settled(cf, idx, fetcher.QUIET_FOR + 3 * manager.NOTES_EVERY)
            await c.cache.journal.write_notes()
            assert noted(c) == list(range(6))
            assert cached_pages(c.cache.cachefiles.path(cf.fid)) == 0
    run(body)


def test_a_restore_larger_than_the_bound_writes_its_chunks_back_as_it_reads(tmp_path,
                                                                           monkeypatch):
    """Files read together that are larger than READ_THROUGH_MAX would not fit in the page
    cache until the restore pauses: their chunks go to disk as soon as they are read."""
    monkeypatch.setattr(fetcher, "READ_THROUGH_MAX", 2 * PART)
    monkeypatch.setattr(fetcher, "QUIET_FOR", 60.0)  # no pause within the test
    store = MemoryObjectStore()
    data = random.randbytes(4 * PART)
    etag = store.put("ckpt", data, {})

    async def body() -> None:
        async with core(tmp_path, store) as c:
            cf = c.in_s3("ckpt", len(data), etag)
            for idx in range(2):
                await read_chunk_to_its_end(c, cf, idx, data)
                await settled(cf, idx, 2.0)
    run(body)


def test_chunks_wait_for_the_pause_until_the_files_read_outgrow_the_bound(tmp_path,
                                                                         monkeypatch):
    """Reading one file that fits keeps its chunks in the page cache; once a second file
    makes the files read since the last pause larger than READ_THROUGH_MAX, the waiting
    chunks go at once, the oldest first, and so do those read after them."""
    monkeypatch.setattr(fetcher, "READ_THROUGH_MAX", 3 * PART)
    monkeypatch.setattr(fetcher, "QUIET_FOR", 60.0)
    store = MemoryObjectStore()
    data = {name: random.randbytes(2 * PART) for name in ("a", "b")}
    etags = {name: store.put(name, body, {}) for name, body in data.items()}

    async def body() -> None:
        async with core(tmp_path, store) as c:
            a, b = (c.in_s3(name, 2 * PART, etags[name]) for name in ("a", "b"))
            await read_chunk_to_its_end(c, a, 0, data["a"])
            await trio.sleep(0.5)
            assert not a.chunks[0].direct  # 2 of 3 PART: it waits
            await read_chunk_to_its_end(c, b, 0, data["b"])
            await settled(a, 0, 2.0)
            await settled(b, 0, 2.0)
            await read_chunk_to_its_end(c, a, 1, data["a"])
            await settled(a, 1, 2.0)
    run(body)


def test_files_smaller_than_a_part_count_their_bytes_against_the_bound(tmp_path,
                                                                      monkeypatch):
    """Eight 2 MiB files read together are 16 MiB, under a 24 MiB bound: all of them wait
    for the pause (counted as a part each, they went to disk from the fourth file on)."""
    monkeypatch.setattr(fetcher, "READ_THROUGH_MAX", 3 * PART)
    monkeypatch.setattr(fetcher, "QUIET_FOR", 60.0)
    store = MemoryObjectStore()
    data = {f"shard-{i}": random.randbytes(2 * MiB) for i in range(8)}
    etags = {name: store.put(name, body, {}) for name, body in data.items()}

    async def body() -> None:
        async with core(tmp_path, store) as c:
            files = [c.in_s3(name, 2 * MiB, etags[name]) for name in data]
            for cf, name in zip(files, data, strict=True):
                assert await c.cache.read(cf, MiB, MiB) == data[name][MiB:]
            await trio.sleep(0.5)
            assert not any(cf.chunks[0].direct for cf in files)
    run(body)


def test_a_fetched_chunk_nobody_reads_to_its_end_is_written_back_in_time(tmp_path):
    """A random reader, or readahead past where the reader stops: the chunk leaves the
    page cache FRESH_FOR seconds after its fetch all the same."""
    store = MemoryObjectStore()
    data = random.randbytes(2 * PART)
    etag = store.put("ckpt", data, {})

    async def body() -> None:
        async with core(tmp_path, store) as c:
            cf = c.in_s3("ckpt", len(data), etag)
            assert await c.cache.read(cf, PART + 5, 100) == data[PART + 5:PART + 105]
            path = c.cache.cachefiles.path(cf.fid)
            await settled(cf, 1, fetcher.FRESH_FOR + 3 * manager.NOTES_EVERY)
            await c.cache.journal.write_notes()
            assert cached_pages(path) == 0 and noted(c) == [1]
    run(body)


def test_a_warmed_up_chunk_is_on_disk_and_out_of_the_page_cache(tmp_path):
    """A warm-up writes a chunk through the page cache, then writes it back and drops it:
    before it counts as cached its bytes are on disk, none is left in the page cache, and
    reads take the O_DIRECT path as for any fetched chunk."""
    store = MemoryObjectStore()
    data = random.randbytes(PART + 3 * MiB + 123)
    store.put("ckpt", data, {})

    async def body() -> None:
        async with core(tmp_path, store) as c:
            cf = c.in_s3("ckpt", len(data))
            assert await c.cache.fetcher.fetch_chunk(cf, 0) == PART
            assert await c.cache.fetcher.fetch_chunk(cf, 1) == len(data) - PART
            path = c.cache.cachefiles.path(cf.fid)
            assert cached_pages(path) == 0
            assert cf.chunks[0].direct and cf.chunks[1].direct
            got = [await c.cache.read_lent(cf, off, MiB) for off in range(0, len(data), MiB)]
            assert b"".join(got) == data and isinstance(got[0], memoryview)
            assert await c.cache.fetcher.fetch_chunk(cf, 0) == 0  # cached: nothing fetched
    run(body)


def test_a_written_chunk_is_read_through_the_page_cache_and_commits_right(tmp_path):
    store = MemoryObjectStore()
    data = bytearray(random.randbytes(2 * MiB))
    store.put("ckpt", bytes(data), {})

    async def body() -> None:
        async with core(tmp_path, store) as c:
            cf = c.in_s3("ckpt", len(data))
            assert await c.cache.read_lent(cf, 0, MiB) == data[:MiB]
            cf.writers += 1
            await c.cache.write(cf, 5000, b"new")
            data[5000:5003] = b"new"
            assert not cf.chunks[0].direct
            assert await c.cache.read_lent(cf, 4096, 4096) == data[4096:8192]
            await c.close_and_flush(cf)
            assert c.store.objects["ckpt"].body == data
    run(body)


def test_large_writes_skip_the_page_cache_and_commit_right(tmp_path):
    """A checkpoint's 1 MiB writes go to the cache file with O_DIRECT (an unaligned one
    around its whole pages), the flusher reads its parts back the same way, and S3 gets
    every byte; small writes stay in the page cache."""
    data = random.randbytes(PART + 2 * MiB)  # two parts
    a, b = PART + 1000, PART + MiB + 1000

    async def body() -> None:
        async with core(tmp_path) as c:
            cf = await c.write_file("ckpt", data[:PART])  # aligned 1 MiB writes
            assert cf.chunks[0].direct
            path = c.cache.cachefiles.path(cf.fid)
            assert cached_pages(path) == 0
            await c.cache.write(cf, a, data[a:b])
            await c.cache.write(cf, PART, data[PART:a])
            await c.cache.write(cf, b, data[b:])
            assert cf.chunks[1].direct
            assert cached_pages(path) <= 3  # the unaligned head and tail pages only
            await c.close_and_flush(cf)
            assert c.store.objects["ckpt"].body == data
            assert c.store.calls["upload_part"] == 2
            assert cached_pages(path) <= 3  # the upload read it with O_DIRECT too
            small = await c.write_file("small", data[:64 * 1024])
            assert not small.chunks[0].direct
            await c.close_and_flush(small)
            assert c.store.objects["small"].body == data[:64 * 1024]
    run(body)


def test_split_aligned_cuts_a_write_at_page_boundaries():
    assert direct.split_aligned(0, 3 * ALIGN + 5) == (0, 3 * ALIGN)
    assert direct.split_aligned(100, 3 * ALIGN) == (ALIGN - 100, 2 * ALIGN)
    assert direct.split_aligned(100, 50) == (50, 0)
    assert direct.split_aligned(ALIGN, ALIGN - 1) == (0, 0)


@pytest.mark.parametrize("how", ["option", "filesystem"])
def test_without_o_direct_everything_goes_through_the_page_cache(tmp_path, monkeypatch, how):
    """`direct_io=False`, or a cache filesystem that refuses O_DIRECT (EINVAL)."""
    if how == "filesystem":
        def refuse(path: str) -> int:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        monkeypatch.setattr(direct, "open_direct", refuse)
    store = MemoryObjectStore()
    data = random.randbytes(2 * MiB + 5)
    store.put("ckpt", data, {})

    async def body() -> None:
        async with core(tmp_path, store, direct_io=how != "option") as c:
            cf = c.in_s3("ckpt", len(data))
            got = [await c.cache.read_lent(cf, off, MiB) for off in range(0, len(data), MiB)]
            assert b"".join(got) == data
            assert cf.io.dfd is None and not cf.chunks[0].direct
    run(body)


def test_a_disk_that_refuses_o_direct_requests_falls_back_to_the_page_cache(tmp_path):
    """EINVAL from an O_DIRECT request (a disk with blocks larger than a page): the
    request is redone buffered, and O_DIRECT is given up; nothing is lost."""
    store = MemoryObjectStore()
    old = random.randbytes(2 * MiB)
    store.put("old", old, {})
    new = random.randbytes(PART + MiB)

    async def body() -> None:
        async with core(tmp_path, store) as c:
            engine = c.cache.engine
            refused: list[int] = []

            class Refusing:  # the engine, but O_DIRECT descriptors answer EINVAL
                name = engine.name

                def __getattr__(self, attr: str):  # type: ignore[no-untyped-def]
                    call = getattr(engine, attr)

                    async def checked(fd: int, *args):  # type: ignore[no-untyped-def]
                        if fd in {cf.io.dfd for cf in c.cache.files.values()}:
                            refused.append(fd)
                            raise OSError(errno.EINVAL, "Invalid argument")
                        return await call(fd, *args)
                    return checked

            refusing = Refusing()  # the engine of the parts that read and write cache files
            c.cache.reader.engine = c.cache.writer.engine = refusing  # type: ignore[assignment]
            cf = c.in_s3("old", len(old))
            assert await c.cache.read(cf, 0, len(old)) == old  # fetched, then written back
            await settled(cf, 0)
            assert await c.cache.read_lent(cf, MiB, MiB) == old[MiB:]  # refused, redone
            assert refused and not c.cache.fds.can_direct
            assert await c.cache.read_lent(cf, 0, MiB) == old[:MiB]
            written = await c.write_file("new", new)
            assert not written.chunks[0].direct
            await c.close_and_flush(written)
            assert c.store.objects["new"].body == new
    run(body)


def test_descriptors_count_both_twins_against_the_budget(tmp_path):
    store = MemoryObjectStore()
    for i in range(20):
        store.put(f"f{i}", bytes([i]) * (MiB + i), {})

    async def body() -> None:
        async with core(tmp_path, store, open_files=8) as c:
            before = len(os.listdir("/proc/self/fd"))
            for i in range(20):
                cf = c.in_s3(f"f{i}", MiB + i)
                assert await c.cache.read_lent(cf, 0, MiB) == bytes([i]) * MiB
                assert cf.io.dfd is not None
                assert len(c.cache.fds) <= 8
            assert len(os.listdir("/proc/self/fd")) - before <= 8
    run(body)


def test_a_lent_buffer_comes_back_only_once_nobody_holds_its_view():
    pool = AlignedBuffers()
    first = pool.take()
    view = pool.lend(first, 100)
    assert pool.take() is not first
    pin = Pin(view)  # as pyfuse3 holds it while it replies: PyObject_GetBuffer
    del view
    gc.collect()
    assert pool.take() is not first
    pin.release()
    assert pool.take() is first


def test_read_through_reads_aligned_pieces_direct_and_pads_past_the_end(tmp_path):
    """The flusher's part reads, from the thread that sends the part: an aligned piece
    comes back with O_DIRECT (the page cache stays empty), an unaligned one or one
    without a twin buffered, and what lies past the end of the file reads as zeros."""
    path = tmp_path / "f"
    data = random.randbytes(2 * BUFFER_SIZE + 5000)
    path.write_bytes(data)
    drop_page_cache(path)
    fd = os.open(path, os.O_RDWR)
    dfd = direct.DirectOpener().open(str(path))
    assert dfd is not None
    try:
        n = BUFFER_SIZE
        assert read_through(fd, dfd, 0, n) == data[:n]
        assert read_through(fd, dfd, n, 2 * n) == data[n:2 * n]
        assert cached_pages(path) == 0
        assert read_through(fd, dfd, 2 * n, 3 * n) == data[2 * n:] + bytes(n - 5000)
        assert read_through(fd, dfd, 100, 200) == data[100:200]  # unaligned: buffered
        assert read_through(fd, None, ALIGN, 3 * ALIGN) == data[ALIGN:3 * ALIGN]
        assert read_through(fd, None, len(data) - 10, len(data) + 10) == data[-10:] + bytes(10)
    finally:
        os.close(dfd)
        os.close(fd)


def test_a_part_body_knows_the_crc_of_what_its_last_pass_sent(tmp_path):
    """What a passthrough writer's early parts are checked against (cache.passthrough)."""
    data = random.randbytes(3 * MiB + 5)
    path = tmp_path / "cache-file"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        source = UploadSource(fd, None)
        sent = CachePartBody(source, MiB, 2 * MiB)
        assert sent.sent_crc is None
        assert b"".join(bytes(p) for p in sent.pieces()) == data[MiB:3 * MiB]
        assert sent.sent_crc == crc32c.crc32c(data[MiB:3 * MiB])
        read = CachePartBody(source, MiB, 2 * MiB)
        read.read(1000)
        read.seek(5000)  # a pass that skips bytes proves nothing
        read.read()
        assert read.sent_crc is None
        read.seek(0)
        read.read()  # a whole second pass from the start does
        assert read.sent_crc == crc32c.crc32c(data[MiB:3 * MiB])
        assert crc_of(source, 0, len(data)) == crc32c.crc32c(data)
    finally:
        os.close(fd)

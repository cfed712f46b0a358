"""O_DIRECT cache-file I/O: what bypasses the page cache, and the buffers it lends.

Restores through a real mount read these paths end to end in tests/test_t4_restore.py.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import mmap
import os
import random
from pathlib import Path

import pytest

from lakefs_mount.cache import direct
from lakefs_mount.cache.direct import ALIGN, BUFFER_SIZE, ReadBuffers, write_through
from lakefs_mount.memstore import MemoryObjectStore
from lakefs_mount.uring._buffers import Pin
from tests.test_t3_cache import core, run

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


def test_a_fetched_chunk_skips_the_page_cache_and_reads_back_right(tmp_path):
    """An object's chunks go to the cache file with O_DIRECT (but for an unaligned tail)
    and are read back the same way: the cache file does not grow the page cache."""
    store = MemoryObjectStore()
    data = random.randbytes(3 * MiB + 123)
    store.put("ckpt", data, {})

    async def body() -> None:
        async with core(tmp_path, store) as c:
            cf = c.in_s3("ckpt", len(data))
            got = [await c.cache.read_lent(cf, off, MiB) for off in range(0, len(data), MiB)]
            assert b"".join(got) == data
            assert all(isinstance(v, memoryview) and v.readonly for v in got)
            assert cf.chunks[0].direct
            path = c.cache.cache_path(cf.fid)
            assert path.read_bytes() == data
            drop_page_cache(path)
            assert await c.cache.read_lent(cf, MiB, MiB) == data[MiB:2 * MiB]
            assert cached_pages(path) == 0
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
            assert cf.dfd is None and not cf.chunks[0].direct
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
                assert cf.dfd is not None
                assert len(c.cache.fds) <= 8
            assert len(os.listdir("/proc/self/fd")) - before <= 8
    run(body)


def test_a_lent_buffer_comes_back_only_once_nobody_holds_its_view():
    pool = ReadBuffers()
    first = pool.take()
    view = pool.lend(first, 100)
    assert pool.take() is not first
    pin = Pin(view)  # as pyfuse3 holds it while it replies: PyObject_GetBuffer
    del view
    gc.collect()
    assert pool.take() is not first
    pin.release()
    assert pool.take() is first


def test_write_through_puts_whole_pages_direct_and_the_rest_buffered(tmp_path):
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    dfd = direct.DirectOpener().open(str(path))
    assert dfd is not None
    try:
        data = random.randbytes(BUFFER_SIZE + 2 * ALIGN + 77)  # more than one buffer
        write_through(fd, dfd, data, ALIGN)  # aligned: pages direct, the tail buffered
        write_through(fd, dfd, b"odd", 1)  # unaligned: buffered
        write_through(fd, None, b"xyz", 8)  # no twin: buffered
        expect = bytearray(ALIGN) + data
        expect[1:4], expect[8:11] = b"odd", b"xyz"
        assert os.pread(fd, len(expect) + 10, 0) == expect
    finally:
        os.close(dfd)
        os.close(fd)

"""Behaviour of both cache-file I/O engines, run under trio."""

from __future__ import annotations

import errno
import gc
import logging
import mmap
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from lakefs_mount.uring import FALLOC_PUNCH_HOLE, open_engine, probe_uring
from lakefs_mount.uring.nowait import read_nowait

ENGINES = ["uring", "threads"]
MiB = 1 << 20
BAD_FD = 999_999  # never open: closing an fd here would let the ring reuse its number


def run(kind: str, body: Callable[..., Awaitable[None]]) -> None:
    """trio.run `body(engine)` inside open_engine(kind) (no pytest-trio here)."""

    async def main() -> None:
        async with open_engine(kind) as engine:
            assert engine.name == kind
            await body(engine)

    trio.run(main)


@pytest.fixture
def fd(tmp_path: Path):
    f = os.open(tmp_path / "cache", os.O_RDWR | os.O_CREAT, 0o600)
    yield f
    os.close(f)


@pytest.mark.parametrize("kind", ENGINES)
def test_write_read_offsets(kind, fd):
    async def body(e):
        assert await e.write(fd, b"hello", 0) == 5
        assert await e.write(fd, bytearray(b"world"), 10) == 5
        assert await e.write(fd, memoryview(b"..XY..")[2:4], 5) == 2
        assert await e.read(fd, 15, 0) == b"helloXY\0\0\0world"
        assert await e.read(fd, 3, 11) == b"orl"
        data = await e.read(fd, 5, 0)
        assert type(data) is bytes

    run(kind, body)
    assert os.pread(fd, 15, 0) == b"helloXY\0\0\0world"


@pytest.mark.parametrize("kind", ENGINES)
def test_non_contiguous_and_typed_buffers(kind, fd):
    async def body(e):
        assert await e.write(fd, memoryview(b"a-b-c-")[::2], 0) == 3
        assert await e.write(fd, memoryview(bytearray(8)).cast("I"), 3) == 8
        assert await e.read(fd, 11, 0) == b"abc" + bytes(8)

    run(kind, body)


@pytest.mark.parametrize("kind", ENGINES)
def test_sparse_file(kind, fd):
    async def body(e):
        await e.write(fd, b"tail", 1 << 30)
        assert await e.read(fd, 4096, (1 << 30) - 4096) == bytes(4096)
        assert await e.read(fd, 8, (1 << 30) - 4) == bytes(4) + b"tail"

    run(kind, body)
    st = os.fstat(fd)
    assert st.st_size == (1 << 30) + 4
    assert st.st_blocks * 512 < MiB  # really sparse


@pytest.mark.parametrize("kind", ENGINES)
def test_eof(kind, fd):
    async def body(e):
        await e.write(fd, b"0123456789", 0)
        assert await e.read(fd, 10, 10) == b""
        assert await e.read(fd, 10, 1000) == b""
        assert await e.read(fd, 100, 7) == b"789"
        assert await e.read(fd, 0, 0) == b""

    run(kind, body)


@pytest.mark.parametrize("kind", ENGINES)
def test_read_into_a_buffer_buffered_and_with_o_direct(kind, tmp_path):
    """read_into fills the caller's (page-aligned, for O_DIRECT) buffer; short at EOF."""
    path = tmp_path / "cache"
    data = os.urandom(2 * MiB + 100)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 3 * MiB)

    async def body(e):
        view = memoryview(buf)
        assert await e.read_into(fd, view[:10], 5) == 10
        assert buf[:10] == data[5:15]
        assert await e.read_into(dfd, view[:MiB], MiB) == MiB
        assert buf[:MiB] == data[MiB:2 * MiB]
        assert await e.read_into(dfd, view, 0) == len(data)  # short: end of file
        assert buf[:len(data)] == data
        assert await e.read_into(fd, view[:10], len(data)) == 0
        with pytest.raises(OSError) as exc:
            await e.read_into(dfd, view[1:4097], 0)  # unaligned memory
        assert exc.value.errno == errno.EINVAL
        with pytest.raises(OSError) as exc:
            await e.read_into(BAD_FD, view[:10], 0)
        assert exc.value.errno == errno.EBADF

    try:
        run(kind, body)
    finally:
        os.close(fd)
        os.close(dfd)


@pytest.mark.parametrize("kind", ENGINES)
def test_reads_the_page_cache_holds_inline_and_the_rest_from_disk(kind, fd):
    """What is cached comes inline (no request); what is not is read by the engine."""
    data = os.urandom(4 * MiB)
    os.pwrite(fd, data, 0)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: dropped
    assert read_nowait(fd, MiB, 0)[2] < MiB
    os.pread(fd, MiB, MiB)  # cache the second MiB only
    assert read_nowait(fd, MiB, MiB)[2] == MiB

    async def body(e):
        assert await e.read(fd, 2 * MiB, MiB) == data[MiB:3 * MiB]  # cached, then not
        assert await e.read(fd, 4 * MiB, 0) == data
        assert await e.read(fd, 2 * MiB, 3 * MiB) == data[3 * MiB:]  # cached up to EOF

    run(kind, body)


@pytest.mark.parametrize("kind", ENGINES)
def test_fsync_and_fdatasync(kind, fd):
    async def body(e):
        await e.write(fd, b"durable", 0)
        await e.fsync(fd)
        await e.fsync(fd, datasync=True)
        with pytest.raises(OSError) as exc:
            await e.fsync(BAD_FD, datasync=True)
        assert exc.value.errno == errno.EBADF

    run(kind, body)
    assert os.pread(fd, 7, 0) == b"durable"


@pytest.mark.parametrize("kind", ENGINES)
def test_punch_hole(kind, fd):
    data = os.urandom(4 * MiB)

    async def body(e):
        await e.write(fd, data, 0)
        await e.fsync(fd)
        before = os.fstat(fd).st_blocks
        await e.fallocate(fd, FALLOC_PUNCH_HOLE, MiB, 2 * MiB)
        after = os.fstat(fd).st_blocks
        assert after <= before - (2 * MiB) // 512
        assert await e.read(fd, 2 * MiB, MiB) == bytes(2 * MiB)
        assert await e.read(fd, MiB, 0) == data[:MiB]
        assert await e.read(fd, MiB, 3 * MiB) == data[3 * MiB :]

    run(kind, body)
    assert os.fstat(fd).st_size == 4 * MiB  # KEEP_SIZE


@pytest.mark.parametrize("kind", ENGINES)
def test_errors(kind, tmp_path):
    path = tmp_path / "wo"
    wo = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    ro = os.open(path, os.O_RDONLY)

    async def body(e):
        for call in (
            e.read(BAD_FD, 10, 0),
            e.write(BAD_FD, b"x", 0),
            e.read(wo, 10, 0),
            e.write(ro, b"x", 0),
        ):
            with pytest.raises(OSError) as exc:
                await call
            assert exc.value.errno == errno.EBADF
        with pytest.raises(OSError) as exc:
            await e.fallocate(ro, FALLOC_PUNCH_HOLE, 0, 4096)
        assert exc.value.errno == errno.EBADF
        assert await e.write(wo, b"still works", 0) == 11  # engine survives errors

    try:
        run(kind, body)
    finally:
        os.close(wo)
        os.close(ro)


@pytest.mark.parametrize("kind", ENGINES)
def test_thousand_concurrent(kind, fd):
    n, size = 1000, 4096

    def block(i: int) -> bytes:
        return i.to_bytes(4, "little") * (size // 4)

    async def body(e):
        async def write(i: int) -> None:
            assert await e.write(fd, block(i), i * size) == size

        results: dict[int, bytes] = {}

        async def read(i: int) -> None:
            results[i] = await e.read(fd, size, i * size)

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(write, i)
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(read, i)
        assert all(results[i] == block(i) for i in range(n))
        if kind == "uring":  # batched: far fewer io_uring_enter calls than requests
            assert e.submits < n

    run(kind, body)
    assert os.fstat(fd).st_size == n * size


@pytest.mark.parametrize("kind", ENGINES)
def test_cancel_in_flight(kind, tmp_path):
    files = [os.open(tmp_path / f"c{i}", os.O_RDWR | os.O_CREAT, 0o600) for i in range(8)]
    big = [bytes([i + 1]) * (16 * MiB) for i in range(8)]
    done: set[int] = set()

    async def body(e):
        async def write(i: int) -> None:
            await e.write(files[i], big[i], 0)
            done.add(i)

        with trio.move_on_after(0.001) as scope:
            async with trio.open_nursery() as nursery:
                for i in range(8):
                    nursery.start_soon(write, i)
                    nursery.start_soon(e.read, files[i], 16 * MiB, 0)
        if kind == "uring":  # worker threads cannot be interrupted; the ring's waits can
            assert scope.cancelled_caught
        gc.collect()
        for i in done:
            assert await e.read(files[i], 16 * MiB, 0) == big[i]
        # the engine keeps working after the cancellation
        assert await e.write(files[0], b"after", 0) == 5
        assert await e.read(files[0], 5, 0) == b"after"
        gc.collect()

    try:
        run(kind, body)
        gc.collect()
        for i in done:
            assert os.pread(files[i], 16, 16 * MiB - 16) == big[i][:16]
    finally:
        for f in files:
            os.close(f)


@pytest.mark.parametrize("kind", ENGINES)
def test_cancelled_buffer_outlives_task(kind, fd):
    """The only reference to the buffer is the cancelled call; the kernel still reads it."""

    async def body(e):
        with trio.move_on_after(0.001):
            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(e.write, fd, os.urandom(8 * MiB), i * 8 * MiB)
        gc.collect()
        garbage = [bytearray(8 * MiB) for _ in range(8)]  # reuse freed memory if any
        del garbage
        await e.fsync(fd)

    run(kind, body)


@pytest.mark.parametrize("kind", ENGINES)
def test_large_write(kind, fd):
    data = os.urandom(64 * MiB)

    async def body(e):
        assert await e.write(fd, data, 4096) == len(data)
        back = await e.read(fd, len(data), 4096)
        assert back == data

    run(kind, body)
    assert os.fstat(fd).st_size == 4096 + 64 * MiB


@pytest.mark.parametrize("kind", ENGINES)
def test_closes_cleanly(kind, fd):
    kept = []

    async def body(e):
        await e.write(fd, b"x", 0)
        kept.append(e)

    run(kind, body)
    if kind == "uring":
        engine = kept[0]
        assert engine._ring.fd == -1 and not engine._inflight

        async def after_close() -> None:
            with pytest.raises(trio.ClosedResourceError):
                await engine.write(fd, b"y", 0)

        trio.run(after_close)
    assert os.pread(fd, 2, 0) == b"x"


def test_close_while_requests_pending(fd):
    """Leaving open_engine with requests in flight waits for their CQEs, then closes."""

    async def main() -> None:
        with trio.move_on_after(0.002):
            async with open_engine("uring") as e:
                async with trio.open_nursery() as nursery:
                    for i in range(16):
                        nursery.start_soon(e.write, fd, bytes(4 * MiB), i * 4 * MiB)
        assert not e._inflight and e._ring.fd == -1

    trio.run(main)
    gc.collect()


def test_auto_picks_uring(caplog):
    assert Path("/proc/sys/kernel/io_uring_disabled").read_text().strip() == "0"
    assert probe_uring() is None

    async def main() -> None:
        async with open_engine("auto") as e:
            assert e.name == "uring"
        async with open_engine("threads") as e:
            assert e.name == "threads"

    with caplog.at_level(logging.INFO, logger="lakefs_mount.uring"):
        trio.run(main)
    assert "io engine: uring" in caplog.text


def test_unknown_kind():
    async def main() -> None:
        async with open_engine("spdk"):
            pass

    with pytest.raises(ValueError):
        trio.run(main)

"""Thread-pool engine: blocking positional syscalls run off the trio loop.

The fallback where io_uring is disabled (io_uring_disabled sysctl, seccomp, old
kernels). Each call runs its whole loop (short writes, short reads) in one worker thread
so a request costs one thread hop; the limiter bounds how many block at once.
"""

from __future__ import annotations

import ctypes
import os

import trio

from lakefs_mount.uring.nowait import read_nowait

_libc = ctypes.CDLL(None, use_errno=True)
_fallocate = getattr(_libc, "fallocate64", None) or _libc.fallocate
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_fallocate.restype = ctypes.c_int


def write_on_this_thread(fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
    """A blocking pwrite of all of `data`, for code already on a worker thread (a ranged
    GET streaming into the cache file): handing each piece back to the trio loop would
    cost the loop a task, a submission and a completion per MiB for nothing."""
    view = memoryview(data)
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    view = view.cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return done


def _pread_upto(fd: int, size: int, offset: int) -> bytes:
    first = os.pread(fd, size, offset)
    if len(first) == size or not first:
        return first
    parts = [first]
    got = len(first)
    while got < size:
        more = os.pread(fd, size - got, offset + got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _preadv_upto(fd: int, view: memoryview, offset: int) -> int:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def fallocate_sync(fd: int, mode: int, offset: int, length: int) -> None:
    """fallocate(2) on this thread (os.posix_fallocate has no mode)."""
    if _fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _fsync_sync(fd: int, datasync: bool) -> None:
    (os.fdatasync if datasync else os.fsync)(fd)


class ThreadEngine:
    """IoEngine running os.pwrite/pread/fsync/fallocate in trio worker threads."""

    name = "threads"

    def __init__(self, max_threads: int = 16) -> None:
        self._limiter = trio.CapacityLimiter(max_threads)

    async def write(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        """Write all of data at offset; the worker keeps `data` alive until done."""
        return await trio.to_thread.run_sync(write_on_this_thread, fd, data, offset,
                                             limiter=self._limiter)

    async def read(self, fd: int, size: int, offset: int) -> bytes:
        """Read up to size bytes at offset; short only at end of file."""
        if size <= 0:
            await trio.lowlevel.checkpoint()
            return b""
        buf, _, got = read_nowait(fd, size, offset)
        if got == size:  # still a checkpoint, as every engine call: others get their turn
            await trio.lowlevel.checkpoint()
            return buf
        rest = await trio.to_thread.run_sync(_pread_upto, fd, size - got, offset + got,
                                             limiter=self._limiter)
        return buf[:got] + rest if got else rest

    async def read_into(self, fd: int, view: memoryview, offset: int) -> int:
        """Fill view from offset in one worker; short only at end of file."""
        return await trio.to_thread.run_sync(_preadv_upto, fd, view, offset,
                                             limiter=self._limiter)

    async def fsync(self, fd: int, datasync: bool = False) -> None:
        """fsync(2) or fdatasync(2)."""
        await trio.to_thread.run_sync(_fsync_sync, fd, datasync, limiter=self._limiter)

    async def fallocate(self, fd: int, mode: int, offset: int, length: int) -> None:
        """fallocate(2) through libc (os.posix_fallocate has no mode)."""
        await trio.to_thread.run_sync(
            fallocate_sync, fd, mode, offset, length, limiter=self._limiter
        )

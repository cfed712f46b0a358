"""Reads that the page cache can answer, done inline: no ring round trip, no thread hop.

preadv2(RWF_NOWAIT) copies what the page cache holds and fails with EAGAIN instead of
waiting for the disk, so it never blocks the loop on I/O; io_uring tries every read
this way first too, from inside io_uring_enter. What it saves is the engine's own
overhead of a request (a task switch, a submission, a completion, or a thread hop),
which was most of the cost of reading a small file or a chunk a GET has just written.
"""

from __future__ import annotations

import ctypes
import errno
import os

from lakefs_mount.uring._buffers import new_bytes

_unsupported: set[int] = set()  # errnos that say this kernel or filesystem cannot do it


def read_nowait(fd: int, size: int, offset: int) -> tuple[bytes, int, int]:
    """A fresh bytes object of `size`, its payload address, and how many bytes of it
    (from the start) the page cache already filled; the caller reads the rest."""
    buf, address = new_bytes(size)
    if _unsupported:
        return buf, address, 0
    view = memoryview((ctypes.c_char * size).from_address(address)).cast("B")
    try:
        got = os.preadv(fd, [view], offset, os.RWF_NOWAIT)
    except BlockingIOError:  # not cached: the caller's path waits for the disk
        got = 0
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        _unsupported.add(exc.errno)
        got = 0
    finally:
        view.release()
    return buf, address, got

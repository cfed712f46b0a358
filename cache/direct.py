"""O_DIRECT access to cache files, so that bulk data bypasses the kernel's page cache.

Why: a page the page cache grows into is expensive the first time it is touched on a VM
whose host backs guest memory lazily and takes freed memory back, and the copy into
fresh page-cache pages is then a large part of the daemon's CPU of writing a
checkpoint. A restore through a buffered cache file grows the page cache twice (the
cache file, then the mount's own pages in the kernel).

Buffered I/O stays for whatever is small or unaligned, and for chunks written that way
(`Chunk.direct` says how a chunk was stored). Linux keeps the two coherent: an O_DIRECT
read writes back dirty pages of its range first, and an O_DIRECT write drops the range's
cached pages; so choosing wrongly costs time, never data.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import sys
import threading
from collections.abc import Iterator

log = logging.getLogger(__name__)

ALIGN = 4096  # offsets, lengths and memory of O_DIRECT I/O: the largest logical block size
BUFFER_SIZE = 1024 * 1024  # = the largest FUSE read (and the GET's piece size)
DIRECT_FLAGS = os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC | os.O_NOFOLLOW
DIRECT_WRITE_MIN = 128 * 1024  # smaller writes (small files) stay in the page cache


def open_direct(path: str) -> int:
    return os.open(path, DIRECT_FLAGS)


def aligned(n: int) -> bool:
    return n % ALIGN == 0


def round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def split_aligned(offset: int, size: int) -> tuple[int, int]:
    """(head, body) of a write of `size` bytes at `offset`: `head` bytes up to the next
    page boundary, then `body` bytes of whole pages; what is left is the tail."""
    head = min(size, -offset % ALIGN)
    return head, (size - head) // ALIGN * ALIGN


class DirectOpener:
    """Opens the O_DIRECT twin of a cache file; gives up for good on a filesystem that
    refuses O_DIRECT (EINVAL, e.g. tmpfs before Linux 6.6), where everything stays
    buffered."""

    def __init__(self, enabled: bool = True) -> None:
        self.supported = enabled

    def open(self, path: str) -> int | None:
        if not self.supported:
            return None
        try:
            return open_direct(path)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.supported = False
            log.info("the cache directory's filesystem does not support O_DIRECT: cache "
                     "files are read and written through the page cache")
            return None


class AlignedBuffers:
    """Page-aligned buffers of BUFFER_SIZE for the trio loop's O_DIRECT I/O. A buffer
    lent out as a view is reused only once nobody holds that view.

    A FUSE read returns its view to pyfuse3, which copies it to the kernel after the
    handler returns (so does an open that fills the kernel's page cache). So a buffer
    comes back when its view's reference count is down to the pool's own reference
    (compared with a probe kept the same way, whatever the interpreter counts).
    """

    def __init__(self, keep: int = 64) -> None:
        self._free: list[mmap.mmap] = []
        self._lent: list[tuple[mmap.mmap, memoryview]] = []
        self._keep = keep
        probe = memoryview(b"")
        self._probe = [(mmap.mmap(-1, ALIGN), probe)]
        del probe
        self._idle_refs = sys.getrefcount(self._probe[0][1])

    def take(self) -> mmap.mmap:
        """A buffer to fill or write from; give it back with `lend` or `give_back` (not
        at all if the kernel may still use it: a failed or cancelled request)."""
        if not self._free:
            self._reclaim()
        return self._free.pop() if self._free else mmap.mmap(-1, BUFFER_SIZE)

    def lend(self, buf: mmap.mmap, size: int) -> memoryview:
        """A read-only view of the first `size` bytes; `buf` returns once it is dropped."""
        view = memoryview(buf)[:size].toreadonly()
        self._lent.append((buf, view))
        return view

    def give_back(self, buf: mmap.mmap) -> None:
        if len(self._free) < self._keep:
            self._free.append(buf)
        else:
            buf.close()

    def _reclaim(self) -> None:
        still = []
        for i in range(len(self._lent)):
            if sys.getrefcount(self._lent[i][1]) <= self._idle_refs:
                buf, view = self._lent[i]
                view.release()
                self.give_back(buf)
            else:
                still.append(self._lent[i])
        self._lent = still


_thread_buffers = threading.local()
_ZEROS = memoryview(bytes(BUFFER_SIZE))  # what a range past the end of its file reads as


def _thread_buffer() -> mmap.mmap:
    """This worker thread's aligned buffer for O_DIRECT I/O (one per thread, reused)."""
    buf = getattr(_thread_buffers, "buf", None)
    if buf is None:
        buf = _thread_buffers.buf = mmap.mmap(-1, BUFFER_SIZE)
    return buf


def read_pieces(fd: int, dfd: int | None, start: int, end: int) -> Iterator[memoryview]:
    """Bytes [start, end) of a cache file, from a worker thread, in pieces of at most
    BUFFER_SIZE read into this thread's aligned buffer: with O_DIRECT where `dfd` is given
    and `start` is aligned, else (and from an EINVAL on: the disk refuses) buffered. What
    lies past the end of the file comes as zeros. A piece is valid only until the next
    is taken (the buffer is reused), so use each at once, one range at a time."""
    pos = start
    with memoryview(_thread_buffer()) as view:
        if dfd is not None and aligned(start):
            while pos < end:
                n = min(end - pos, BUFFER_SIZE)
                try:
                    got = min(os.preadv(dfd, [view[:round_up(n)]], pos), n)
                except OSError as exc:  # the loop gives O_DIRECT up at its next request
                    if exc.errno != errno.EINVAL:
                        raise
                    break
                if got:
                    yield view[:got]
                pos += got
                if got < n:  # end of file
                    break
        while pos < end and (got := os.preadv(fd, [view[:min(end - pos, BUFFER_SIZE)]],
                                              pos)):
            yield view[:got]
            pos += got
    while pos < end:
        n = min(end - pos, len(_ZEROS))
        yield _ZEROS[:n]
        pos += n


def read_through(fd: int, dfd: int | None, start: int, end: int) -> bytes:
    """Bytes [start, end) of a cache file as one bytes object (see `read_pieces`)."""
    return b"".join(bytes(piece) for piece in read_pieces(fd, dfd, start, end))


def write_back(fd: int, start: int, end: int) -> None:
    """From a worker thread: bytes [start, end), written through the page cache, reach the
    disk and then leave the page cache, as if they had been written with O_DIRECT. For a
    whole chunk at once the kernel's writeback is faster than O_DIRECT pieces of 1 MiB."""
    os.fdatasync(fd)
    os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)

"""Read replies that the kernel moves from the cache file to the reader itself (splice).

A reply the daemon copies costs every byte two copies in the daemon's time: the cache
file's page into a buffer, then the buffer into the reader's page (the kernel pins that
buffer page by page to copy out of it). Spliced, the cache file's pages go into a pipe by
reference, behind the reply's header, and the kernel copies them once, into the reader's
pages: one copy of every byte instead of two, which shows in the daemon's CPU time on a
cold restore.

The kernel takes a reply from a pipe only whole, so the pipe holds the header and every
page of the largest read: 2 MiB for 1 MiB reads, above the 1 MiB that `fs.pipe-max-size`
allows by default to a process without CAP_SYS_RESOURCE (packaging/setup.sh raises it).
Everything here runs in the trio loop and never waits: the pipe is empty at the start of
each reply, and the caller splices only what the page cache holds (`pagecache`).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os

from lakefs_mount.filespan import FileSpan
from lakefs_mount.fuse.native import wire
from lakefs_mount.fuse.splice import PIPE_BYTES_NEEDED, PIPE_MAX_SIZE

log = logging.getLogger(__name__)


class SplicedReplies:
    """One pipe, used by one reply at a time (a reply is made without a checkpoint)."""

    def __init__(self, max_read: int) -> None:
        self.pipe_bytes = max_read + 2 * mmap.PAGESIZE  # the header's page, an unaligned end
        self._read_end, self._write_end = self._new_pipe()

    @classmethod
    def open(cls, max_read: int) -> tuple[SplicedReplies | None, str]:
        """The replies, or None and why not."""
        try:
            return cls(max_read), ""
        except OSError as exc:
            if exc.errno != errno.EPERM:
                return None, f"no pipe for them: {exc.strerror}"
            return None, (f"a pipe for a {max_read // 1024} KiB reply exceeds fs.pipe-max-size "
                          f"({_pipe_max_size()} bytes) for a process without CAP_SYS_RESOURCE; "
                          f"`sysctl fs.pipe-max-size={PIPE_BYTES_NEEDED}` enables them for the "
                          f"next mount")

    def _new_pipe(self) -> tuple[int, int]:
        read_end, write_end = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, self.pipe_bytes)
        except OSError:
            os.close(read_end)
            os.close(write_end)
            raise
        return read_end, write_end

    def send(self, fuse_fd: int, unique: int, span: FileSpan) -> bool:
        """Reply to request `unique` with the bytes of `span`: True once the kernel took
        the reply (or the request was gone: interrupted, or unmounted), False if nothing
        was sent (the span could not go into the pipe, e.g. the cache file ends before
        it; the caller replies with a copy)."""
        size = wire.OUT_HEADER.size + span.length
        try:
            os.write(self._write_end, wire.OUT_HEADER.pack(size, 0, unique))
            moved = 0
            while moved < span.length:
                n = os.splice(span.fd, self._write_end, span.length - moved,
                              offset_src=span.offset + moved)
                if n == 0:
                    raise OSError(errno.ENODATA, "the cache file ends before the span")
                moved += n
        except OSError as exc:
            log.debug("read reply not spliced (%s): sent as a copy", exc)
            self._renew()
            return False
        try:
            os.splice(self._read_end, fuse_fd, size)
        except OSError as exc:
            self._renew()  # what the kernel did not take stays in the pipe
            if exc.errno not in (errno.ENOENT, errno.ENODEV):
                raise
        return True

    def _renew(self) -> None:
        """A fresh, empty pipe: a failed reply may have left bytes in the old one."""
        self.close()
        self._read_end, self._write_end = self._new_pipe()

    def close(self) -> None:
        if self._read_end >= 0:
            os.close(self._read_end)
            os.close(self._write_end)
            self._read_end = self._write_end = -1


def _pipe_max_size() -> str:
    try:
        return PIPE_MAX_SIZE.read_text().strip()
    except OSError:
        return "unknown"

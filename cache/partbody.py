"""A part body that streams from the cache file, so a 4 GiB part never sits in memory.

The uploading thread reads the cache file itself (`UploadSource`, see
`CacheManager.part_reader`): a hop into the trio loop per MiB cost the daemon a large
share of its upload CPU. The S3 store sends its `pieces` as they are read into the
thread's aligned buffer, or, once they are hashed, hands the kernel its `file_span` to
send (sendfile); boto3 reads it instead (16 KiB at a time, each sliced out of a copy),
maybe twice (payload hash, then send), seeking back in between, so it supports seek and
tell.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from dataclasses import dataclass

import crc32c

from lakefs_mount.cache.direct import read_pieces, read_through
from lakefs_mount.filespan import FileSpan

READ_PIECE = 1024 * 1024


@dataclass(frozen=True)
class UploadSource:
    """The open cache file of an upload, for the thread that sends it: `direct_fd` (its
    O_DIRECT twin) is given only where the range's chunks went to disk that way and its
    start is aligned."""
    fd: int
    direct_fd: int | None

    def read(self, start: int, end: int) -> bytes:
        return read_through(self.fd, self.direct_fd, start, end)

    def pieces(self, start: int, end: int) -> Iterator[memoryview]:
        return read_pieces(self.fd, self.direct_fd, start, end)


def crc_of(source: UploadSource, start: int, end: int) -> int:
    """CRC-32C of bytes [start, end) of a cache file (in a worker thread)."""
    crc = 0
    for piece in source.pieces(start, end):
        crc = crc32c.crc32c(piece, crc)
    return crc


class CachePartBody(io.RawIOBase):
    """`sent_crc`: the CRC-32C of the bytes of the last pass read from start to end in
    order (what the last attempt sent), None if the last pass skipped about. A FUSE
    passthrough writer changes the cache file behind the daemon's back: the CRC tells
    later whether a part streamed early still holds what the file holds."""

    def __init__(self, source: UploadSource, start: int, length: int) -> None:
        super().__init__()
        self._source = source
        self._start = start
        self._length = length
        self._pos = 0
        self._buf = b""
        self._buf_pos = 0
        self._crc: int | None = 0
        self._crc_pos = 0
        self._crc_done: int | None = None

    @property
    def sent_crc(self) -> int | None:
        return self._crc_done

    def _hashed(self, data: bytes | memoryview, at: int) -> None:
        if at == 0:
            self._crc, self._crc_pos = 0, 0
        if self._crc is None or at != self._crc_pos:
            self._crc = None
            return
        self._crc = crc32c.crc32c(data, self._crc)
        self._crc_pos += len(data)
        if self._crc_pos == self._length:
            self._crc_done = self._crc

    def file_span(self) -> FileSpan | None:
        """The body as a span of the cache file where it is read buffered: bytes written
        with O_DIRECT are not in the page cache, and sendfile would read them from the
        disk into it."""
        if self._source.direct_fd is not None:
            return None
        return FileSpan(self._source.fd, self._start, self._length)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def __len__(self) -> int:
        return self._length

    def pieces(self) -> Iterator[memoryview]:
        """The whole body (whatever the position), as `read_pieces` reads it."""
        at = 0
        for piece in self._source.pieces(self._start, self._start + self._length):
            self._hashed(piece, at)
            at += len(piece)
            yield piece

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = max(0, min(self._length, base + offset))
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            return self.readall()
        n = min(size, self._length - self._pos)
        if n <= 0:
            return b""
        rel = self._pos - self._buf_pos
        if not 0 <= rel < len(self._buf):  # urllib3 reads 16 KiB at a time: buffer 1 MiB
            off = self._start + self._pos
            piece = min(READ_PIECE, self._length - self._pos)
            self._buf = self._source.read(off, off + piece)
            self._buf_pos, rel = self._pos, 0
        data = self._buf[rel:rel + n]
        self._hashed(data, self._pos)
        self._pos += len(data)
        return data

    def readall(self) -> bytes:
        pieces = []
        while piece := self.read(READ_PIECE):
            pieces.append(piece)
        return b"".join(pieces)

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

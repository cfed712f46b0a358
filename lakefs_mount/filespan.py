"""A span of a cache file that the kernel moves itself, never copied into the daemon:
the body of a part (sendfile to S3), the bytes of a read reply (splice to FUSE)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class FileSpan:
    """Bytes [offset, offset + length) of a file open at `fd` (a part's body holds zeros
    past the file's end)."""
    fd: int
    offset: int
    length: int


# Hands a span to the kernel as the reply to a read: True once it went, False if nothing
# was sent (the reader then replies with the bytes).
SendSpan = Callable[[FileSpan], bool]

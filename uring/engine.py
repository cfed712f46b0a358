"""The asynchronous cache-file I/O interface the rest of lakefs-mount codes against.

Only this package knows io_uring. The filesystem and the cache call an `IoEngine`
from inside the trio loop; every implementation keeps the loop free of blocking I/O.
"""

from __future__ import annotations

from typing import Protocol


class IoEngine(Protocol):
    """Positional file I/O awaited from trio tasks."""

    name: str  # "uring" or "threads", shown by `lakefs-mount status`

    async def write(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        """Write all of `data` at `offset` (short writes are continued); return len(data)."""
        ...

    async def read(self, fd: int, size: int, offset: int) -> bytes:
        """Read up to `size` bytes at `offset`; fewer only at end of file."""
        ...

    async def read_into(self, fd: int, view: memoryview, offset: int) -> int:
        """Fill `view` from `offset` (an O_DIRECT fd needs it page-aligned); return how
        many bytes were read, fewer only at end of file."""
        ...

    async def fsync(self, fd: int, datasync: bool = False) -> None:
        """fsync(2) or, with datasync, fdatasync(2)."""
        ...

    async def fallocate(self, fd: int, mode: int, offset: int, length: int) -> None:
        """fallocate(2); mode FALLOC_FL_PUNCH_HOLE|FALLOC_FL_KEEP_SIZE frees cached data."""
        ...

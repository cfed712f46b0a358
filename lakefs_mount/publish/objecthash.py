"""CRC-32C of an object as S3 serves it: parallel ranged GETs, hashed as they arrive.

Each range is streamed in pieces of about 1 MiB and hashed in the worker thread that
receives it, so memory stays at a piece per GET under way whatever the object's size;
the ranges' CRCs are combined in order (`manifest.crc32c_combine`). One semaphore
bounds the GETs of all objects hashed at once (a verify of many files).
"""

from __future__ import annotations

import trio

from lakefs_mount import metrics as m
from lakefs_mount.concurrency import first_cause
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.crc import crc32c_combine, crc32c_of
from lakefs_mount.s3.objectstore import ObjectStoreError

MiB = 1024 * 1024
RANGE_BYTES = 16 * MiB  # one ranged GET
PARALLEL_GETS = 8


class ObjectChanged(ObjectStoreError):
    """The object is shorter than listed: it changed while it was read."""


class ObjectHasher:
    """Hashes objects of `store` with at most `parallel` ranged GETs under way."""

    def __init__(self, store: AsyncStore, parallel: int = PARALLEL_GETS,
                 range_bytes: int = RANGE_BYTES) -> None:
        self.store = store
        self.range_bytes = range_bytes
        self._gets = trio.Semaphore(parallel)
        self.bytes_read = 0

    async def crc(self, key: str, size: int, etag: str) -> int:
        """CRC-32C of the `size` bytes of the version `etag` of `key`; ObjectChanged if
        that version is gone or fewer bytes came."""
        starts = list(range(0, size, self.range_bytes))
        crcs = [0] * len(starts)

        async def one(i: int, start: int) -> None:
            end = min(start + self.range_bytes, size)
            state = [0, start]  # crc so far, next offset

            def write(offset: int, piece: bytes) -> None:  # (in the GET's worker thread)
                if offset == start:  # a retried GET starts over
                    state[0] = 0
                state[0] = crc32c_of(piece, state[0])
                state[1] = offset + len(piece)

            async with self._gets:
                try:
                    n, _ = await self.store.retrying(
                        f"GET {key}", self.store.sync.get_range_into, key, start, end, write,
                        etag, max_attempts=4, transient_only=True)
                except ObjectStoreError as exc:
                    if exc.code != "PreconditionFailed" and exc.status != 412:
                        raise
                    raise ObjectChanged(f"{key}: its ETag is no longer {etag}: the object "
                                        f"changed while it was read") from None
            self.store.metrics[m.GETS] += 1
            self.store.metrics[m.BYTES_DOWNLOADED] += n
            if n != end - start or state[1] != end:
                raise ObjectChanged(f"{key}: S3 sent {n} of bytes {start}-{end - 1}; the "
                                    f"object changed while it was read")
            crcs[i] = state[0]
            self.bytes_read += n

        try:
            async with trio.open_nursery() as nursery:
                for i, start in enumerate(starts):
                    nursery.start_soon(one, i, start)
        except BaseExceptionGroup as group:  # one GET's failure, as if it ran alone
            raise first_cause(group) from None
        total = 0
        for i, start in enumerate(starts):
            total = crc32c_combine(total, crcs[i], min(self.range_bytes, size - start))
        return total

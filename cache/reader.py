"""Reads out of the cache: for the kernel (whole replies), and for the uploading thread.

Every read first makes its chunks cached (`Fetcher.ensure_chunk`) and pins them, so that
eviction cannot punch them out while the bytes are read.
"""

from __future__ import annotations

import mmap
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import trio

from lakefs_mount.cache.cachefile import CachedFile
from lakefs_mount.cache.cachefiles import CacheFiles
from lakefs_mount.cache.chunkbook import ChunkBook
from lakefs_mount.cache.direct import BUFFER_SIZE, AlignedBuffers, aligned, round_up
from lakefs_mount.cache.fetcher import Fetcher
from lakefs_mount.cache.pagecache import all_cached
from lakefs_mount.cache.partbody import UploadSource, crc_of
from lakefs_mount.filespan import FileSpan, SendSpan
from lakefs_mount.uring import IoEngine

T = TypeVar("T", bound=bytes | memoryview)


class Reader:
    def __init__(self, book: ChunkBook, files: CacheFiles, fetcher: Fetcher, engine: IoEngine,
                 buffers: AlignedBuffers) -> None:
        self.book = book
        self.parts = book.parts
        self.files = files
        self.fetcher = fetcher
        self.engine = engine
        self._buffers = buffers

    async def read(self, cf: CachedFile, offset: int, size: int) -> bytes:
        return await self._read(cf, offset, size, self._read_cached)

    async def read_lent(self, cf: CachedFile, offset: int, size: int,
                        send: SendSpan | None = None) -> bytes | memoryview:
        """`read` for a reply to the kernel: an aligned read of chunks stored with O_DIRECT
        skips the page cache too (see `direct`) and comes back as a read-only view of a
        reused buffer, which returns to the pool once that view is dropped. So the caller
        hands the view on whole and keeps no slice of it.

        With `send` (a session that splices replies), a range the page cache holds whole
        (a chunk just fetched, or written) goes to `send` as a span of the cache file,
        while its chunks are pinned and the descriptor open: the kernel moves the bytes
        and the daemon never reads them. `send` returns True once the reply went (the
        result is then empty), False if it sent nothing (then they are read as above)."""
        async def read_cached(cf: CachedFile, start: int, end: int) -> bytes | memoryview:
            if send is not None and await self._sent(cf, start, end, send):
                return b""
            return await self._read_lent(cf, start, end)

        return await self._read(cf, offset, size, read_cached)

    async def _read(self, cf: CachedFile, offset: int, size: int,
                    read_cached: Callable[[CachedFile, int, int], Awaitable[T]]) -> T | bytes:
        end = min(cf.size, offset + size)
        if end <= offset:
            return b""
        touched = self.parts.chunks_between(offset, end)
        sequential = offset == cf.fetches.read_next or offset == 0
        cf.fetches.read_next = end
        if sequential:
            self.fetcher.read_ahead_of(cf, touched[-1])
        with self.book.pinned(cf, touched):
            for idx in touched:
                await self.fetcher.ensure_chunk(cf, idx)
                self.book.budget.touch((cf, idx))
            data = await read_cached(cf, offset, end)
        if self.book.fresh:  # a fetched chunk read to its end has served its reader
            for idx in touched:
                if end >= min(self.parts.chunk_range(idx)[1], cf.size):
                    self.fetcher.read_through(cf, idx)
        return data

    def holds(self, cf: CachedFile, start: int, end: int) -> bool:
        """True if bytes [start, end) can be read without a GET."""
        return all(idx in cf.chunks for idx in self.parts.chunks_between(start, end))

    async def _read_cached(self, cf: CachedFile, start: int, end: int) -> bytes:
        """Bytes [start, end) of the cache file; holes and a short cache file read as zeros."""
        async with self.files.io(cf) as fd:
            data = await self.engine.read(fd, end - start, start)
        if len(data) < end - start:
            data += bytes(end - start - len(data))
        return data

    async def _sent(self, cf: CachedFile, start: int, end: int, send: SendSpan) -> bool:
        """Bytes [start, end) went by `send`; not tried for chunks stored with O_DIRECT
        (read back the same way, they stay out of the page cache)."""
        touched = self.parts.chunks_between(start, end)
        if cf.all_direct(touched) and not any((cf, idx) in self.book.fresh for idx in touched):
            return False
        async with self.files.io(cf) as fd:
            return all_cached(fd, start, end) and send(FileSpan(fd, start, end - start))

    async def _read_lent(self, cf: CachedFile, start: int, end: int) -> bytes | memoryview:
        """`_read_cached`, but an aligned range of up to BUFFER_SIZE in chunks that went to
        disk with O_DIRECT comes back with O_DIRECT, into a lent buffer."""
        buf = await self._read_direct(cf, start, end)
        if buf is None:
            return await self._read_cached(cf, start, end)
        return self._buffers.lend(buf, end - start)

    async def _read_direct(self, cf: CachedFile, start: int, end: int) -> mmap.mmap | None:
        """Bytes [start, end) in an aligned buffer, read with O_DIRECT if its chunks were
        stored that way (through the page cache where one is fresh, see `Fetcher`);
        None if they were not (or the range is unaligned or too long). (Trying the page
        cache first is no way to tell: preadv2(RWF_NOWAIT) starts the readahead it
        avoids.)"""
        size = end - start
        touched = self.parts.chunks_between(start, end)
        fresh = bool(self.book.fresh) and any((cf, idx) in self.book.fresh for idx in touched)
        if size > BUFFER_SIZE or not aligned(start) or not (fresh or cf.all_direct(touched)):
            return None
        buf = self._buffers.take()
        with memoryview(buf) as view:  # a failed or cancelled read may leave the kernel
            async with self.files.io(cf, direct=True) as fd:  # writing: then buf is dropped
                got = -1
                if not fresh and (dfd := self.files.dfd(cf)) is not None:
                    try:
                        got = await self.engine.read_into(dfd, view[:round_up(size)], start)
                    except OSError as exc:
                        self.files.give_up_direct(exc)
                if got < 0:
                    got = await self.engine.read_into(fd, view[:size], start)
            if got < size:
                view[got:size] = bytes(size - got)
        return buf

    @asynccontextmanager
    async def part_reader(self, cf: CachedFile, start: int,
                          end: int) -> AsyncIterator[UploadSource]:
        """The cache file of [start, end) for the thread that uploads it, which reads it
        (or sends it) itself: no hop into the loop per piece. Meanwhile the chunks stay
        cached (fetched first where they are not: a base object's bytes) and pinned, the
        descriptors open; what went to disk with O_DIRECT comes back the same way."""
        touched = self.parts.chunks_between(start, end)
        with self.book.pinned(cf, touched):
            for idx in touched:
                await self.fetcher.ensure_chunk(cf, idx)
            direct = aligned(start) and cf.all_direct(touched)
            async with self.files.io(cf, direct) as fd:
                yield UploadSource(fd, self.files.dfd(cf) if direct else None)

    async def cached_crc(self, cf: CachedFile, start: int, end: int) -> int:
        """CRC-32C of bytes [start, end) as the cache file holds them now."""
        async with self.part_reader(cf, start, end) as source:
            return await trio.to_thread.run_sync(crc_of, source, start, end)

"""io_uring engine owned by the trio loop.

Tasks queue requests; one submitter task flushes everything queued during a loop turn
with a single io_uring_enter. The kernel signals an eventfd per completion; one reaper
task drains the CQ ring and reschedules exactly the task waiting on each request.
A request's buffer stays pinned in the in-flight table until its CQE arrives, even if
the waiting task was cancelled meanwhile (an async cancel is then sent best-effort).
"""

from __future__ import annotations

import errno
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import outcome
import trio

from lakefs_mount.uring._buffers import Pin
from lakefs_mount.uring._sys import (
    IORING_FSYNC_DATASYNC,
    OP_ASYNC_CANCEL,
    OP_FALLOCATE,
    OP_FSYNC,
    OP_READ,
    OP_WRITE,
    RawRing,
)
from lakefs_mount.uring.nowait import read_nowait

MAX_RW = 1 << 30  # sqe->len is 32-bit and Linux caps one read/write near 2 GiB anyway
_CANCEL_TAG = 1 << 63  # user_data of our own async-cancel requests: nobody waits on them
_DRAIN_TIMEOUT = 30.0
_LEAKED: list[Any] = []  # buffers of requests that outlived their ring (should stay empty)


class _Request:
    """One SQE from queueing to CQE; owns what the kernel may still touch."""

    __slots__ = ("id", "sqe", "keep", "task", "result", "submitted", "abandoned")

    def __init__(self, rid: int, sqe: tuple[int, int, int, int, int, int], keep: Any) -> None:
        self.id = rid
        self.sqe = sqe  # opcode, fd, off, addr, len, op_flags
        self.keep = keep  # Pin / bytes the kernel addresses; released at completion
        self.task: trio.lowlevel.Task | None = None
        self.result: int | None = None
        self.submitted = False
        self.abandoned = False


class UringEngine:
    """IoEngine over one io_uring; use `UringEngine.open()` to run its background tasks."""

    name = "uring"

    def __init__(self, ring: RawRing, efd: int, max_in_flight: int) -> None:
        self._ring = ring
        self._efd = efd
        self._slots = trio.Semaphore(max_in_flight)
        self._queue: list[_Request | int] = []  # requests, or ids to async-cancel
        self._inflight: dict[int, _Request] = {}
        self._next_id = 1
        self._wake_submitter = trio.Event()
        self._closed = False
        self.submits = 0  # io_uring_enter calls, for tests and benchmarks

    @classmethod
    @asynccontextmanager
    async def open(cls, entries: int = 256) -> AsyncIterator[UringEngine]:
        """Set up the ring, run submitter and reaper, and drain in-flight I/O on exit."""
        ring = RawRing(entries)
        efd = -1
        try:
            efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            ring.register_eventfd(efd)
            engine = cls(ring, efd, min(entries, ring.sq_entries))
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(engine._submitter)
                    nursery.start_soon(engine._reaper)
                    try:
                        yield engine
                    finally:
                        engine._closed = True
                        nursery.cancel_scope.cancel()
            finally:
                with trio.CancelScope(shield=True):
                    drained = await engine._drain()
                if not drained:  # the kernel may still use this memory: never free it
                    _LEAKED.extend(r.keep for r in engine._inflight.values())
                    engine._inflight.clear()
        finally:
            if efd >= 0:
                os.close(efd)
            ring.close()

    # -- IoEngine ---------------------------------------------------------------

    async def write(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        """Write all of data at offset; short writes are continued from where they ended."""
        pin = Pin(data)
        try:
            return await self._transfer(OP_WRITE, fd, pin, offset)
        finally:
            pin.release()

    async def read(self, fd: int, size: int, offset: int) -> bytes:
        """Read size bytes at offset into a fresh bytes object; short only at EOF."""
        if size <= 0:
            await trio.lowlevel.checkpoint()
            return b""
        buf, address, got = read_nowait(fd, size, offset)
        if got == size:  # still a checkpoint, as every engine call: others get their turn
            await trio.lowlevel.checkpoint()
        while got < size:
            n = min(size - got, MAX_RW)
            res = await self._call((OP_READ, fd, offset + got, address + got, n, 0), buf)
            if res == 0:
                break
            got += res
        return buf if got == size else buf[:got]

    async def read_into(self, fd: int, view: memoryview, offset: int) -> int:
        """Fill view from offset; short only at EOF. The view stays pinned until the
        kernel is done with it, also if the waiting task is cancelled."""
        pin = Pin(view)
        try:
            return await self._transfer(OP_READ, fd, pin, offset)
        finally:
            pin.release()

    async def _transfer(self, op: int, fd: int, pin: Pin, offset: int) -> int:
        """OP_READ or OP_WRITE of all of pin's memory, continued after short transfers;
        a read ends early at end of file, a write that makes no progress is EIO."""
        done = 0
        while done < pin.size:
            n = min(pin.size - done, MAX_RW)
            res = await self._call((op, fd, offset + done, pin.address + done, n, 0),
                                   pin.acquire())
            if res == 0:
                if op == OP_WRITE:
                    raise OSError(errno.EIO, "write made no progress")
                break
            done += res
        return done

    async def fsync(self, fd: int, datasync: bool = False) -> None:
        """fsync(2)/fdatasync(2) as IORING_OP_FSYNC."""
        await self._call((OP_FSYNC, fd, 0, 0, 0, IORING_FSYNC_DATASYNC if datasync else 0), None)

    async def fallocate(self, fd: int, mode: int, offset: int, length: int) -> None:
        """fallocate(2): the SQE carries length in addr and mode in len."""
        await self._call((OP_FALLOCATE, fd, offset, length, mode, 0), None)

    # -- request plumbing -----------------------------------------------------

    async def _call(self, sqe: tuple[int, int, int, int, int, int], keep: Any) -> int:
        """Queue one SQE, park until its CQE; negative res becomes OSError."""
        if self._closed:
            _release(keep)
            raise trio.ClosedResourceError("io engine is closed")
        try:
            await self._slots.acquire()
        except BaseException:
            _release(keep)
            raise
        req = _Request(self._next_id, sqe, keep)
        self._next_id += 1
        self._inflight[req.id] = req
        self._queue.append(req)
        self._wake_submitter.set()
        req.task = trio.lowlevel.current_task()

        def abort(_: Any) -> trio.lowlevel.Abort:
            req.task = None
            req.abandoned = True
            if req.submitted:
                self._queue.append(req.id)
                self._wake_submitter.set()
            return trio.lowlevel.Abort.SUCCEEDED

        res: int = await trio.lowlevel.wait_task_rescheduled(abort)
        if res < 0:
            raise OSError(-res, os.strerror(-res))
        return res

    def _complete(self, req: _Request, res: int) -> None:
        """Finish a request: unpin its memory, free its slot, wake its task if any."""
        self._inflight.pop(req.id, None)
        _release(req.keep)
        req.keep = None
        req.result = res
        self._slots.release()
        if req.task is not None:
            task, req.task = req.task, None
            trio.lowlevel.reschedule(task, outcome.Value(res))

    def _flush(self) -> None:
        """Write queued SQEs into the ring and submit them with as few enters as fit."""
        while self._queue:
            space = self._ring.sq_space()
            if space == 0:
                self._ring.submit()
                self.submits += 1
                if self._ring.sq_space() == 0:
                    return  # kernel took nothing; retried after the next reap
                continue
            batch, self._queue = self._queue[:space], self._queue[space:]
            for item in batch:
                if isinstance(item, int):
                    self._ring.put(OP_ASYNC_CANCEL, -1, 0, item, 0, 0, item | _CANCEL_TAG)
                elif item.abandoned:  # cancelled before the kernel ever saw it
                    self._complete(item, -errno.ECANCELED)
                else:
                    self._ring.put(*item.sqe, item.id)
                    item.submitted = True
        if self._ring.sq_space() < self._ring.sq_entries:
            try:
                self._ring.submit()
            except BlockingIOError:  # EAGAIN: kernel short of memory; retried after a reap
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY:  # EBUSY: CQ backlog; retried after a reap
                    raise
            self.submits += 1

    async def _submitter(self) -> None:
        """Flush once per loop turn in which at least one task queued something."""
        while True:
            await self._wake_submitter.wait()
            self._wake_submitter = trio.Event()
            self._flush()

    def _reap(self) -> None:
        for user_data, res in self._ring.completions():
            if user_data & _CANCEL_TAG:
                continue
            req = self._inflight.get(user_data)
            if req is not None:
                self._complete(req, res)

    async def _reaper(self) -> None:
        """Wait on the eventfd, reset it, then drain the CQ ring."""
        while True:
            await trio.lowlevel.wait_readable(self._efd)
            try:
                os.eventfd_read(self._efd)
            except BlockingIOError:
                pass
            self._reap()
            if self._ring.sq_space() < self._ring.sq_entries:
                self._wake_submitter.set()  # an earlier enter left SQEs behind

    async def _drain(self) -> bool:
        """On close: cancel and await everything in flight; False if it never finished."""
        for item in self._queue:
            if isinstance(item, _Request) and not item.submitted:
                self._complete(item, -errno.ECANCELED)
        self._queue = [rid for rid, r in self._inflight.items() if r.submitted]
        self._flush()
        with trio.move_on_after(_DRAIN_TIMEOUT):
            while self._inflight:
                self._reap()
                if not self._inflight:
                    break
                await trio.lowlevel.wait_readable(self._efd)
                try:
                    os.eventfd_read(self._efd)
                except BlockingIOError:
                    pass
        self._reap()
        return not self._inflight


def _release(keep: Any) -> None:
    if isinstance(keep, Pin):
        keep.release()

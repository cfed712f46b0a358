"""Engine selection: probe io_uring once, fall back to threads when it is unusable."""

from __future__ import annotations

import functools
import logging
import os
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from lakefs_mount.uring._sys import (
    OP_FALLOCATE,
    OP_NOP,
    OP_READ,
    OP_WRITE,
    RawRing,
)
from lakefs_mount.uring.engine import IoEngine
from lakefs_mount.uring.ring import UringEngine
from lakefs_mount.uring.threads import ThreadEngine

log = logging.getLogger("lakefs_mount.uring")

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_PUNCH_HOLE = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


class EngineUnavailable(OSError):
    """io_uring was requested explicitly but cannot be used here."""


def _probe_ops(ring: RawRing) -> None:
    """NOP, write, read and fallocate on a temp file: the ops the engine relies on."""
    with tempfile.TemporaryFile() as f:
        payload = b"lakefs-mount io_uring probe"
        buf = bytearray(len(payload))
        addr_in = _address(payload)
        addr_out = _address(buf)
        fd = f.fileno()
        checks = [
            (OP_NOP, -1, 0, 0, 0),
            (OP_WRITE, fd, 0, addr_in, len(payload)),
            (OP_READ, fd, 0, addr_out, len(buf)),
            (OP_FALLOCATE, fd, 0, 4096, 0),
        ]
        for i, (op, target, off, addr, length) in enumerate(checks):
            ring.put(op, target, off, addr, length, 0, i)
            ring.submit(wait=1)
            [(user_data, res)] = ring.completions()
            if res < 0:
                raise OSError(-res, f"io_uring opcode {op}: {os.strerror(-res)}")
        if bytes(buf) != payload:
            raise OSError(0, "io_uring read returned wrong data")


def _address(buf: bytes | bytearray) -> int:
    import ctypes

    if isinstance(buf, bytes):
        return ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p).value or 0
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


@functools.cache
def probe_uring() -> str | None:
    """None if io_uring works for cache-file I/O here, else why not (checked once)."""
    try:
        ring = RawRing(8)
    except OSError as exc:
        return f"io_uring_setup failed: {exc} (io_uring_disabled sysctl, seccomp or old kernel)"
    try:
        efd = os.eventfd(0, os.EFD_CLOEXEC)
        try:
            ring.register_eventfd(efd)
        finally:
            os.close(efd)
        _probe_ops(ring)
    except OSError as exc:
        return f"io_uring unusable: {exc}"
    finally:
        ring.close()
    return None


@asynccontextmanager
async def open_engine(
    kind: str = "auto", *, entries: int = 256, threads: int = 16
) -> AsyncIterator[IoEngine]:
    """Yield a running engine of `kind` ("auto" | "uring" | "threads") and close it on exit."""
    if kind not in ("auto", "uring", "threads"):
        raise ValueError(f"unknown io engine {kind!r}")
    if kind != "threads":
        reason = probe_uring()
        if reason is None:
            if kind == "auto":
                log.info("io engine: uring (%d entries)", entries)
            async with UringEngine.open(entries) as engine:
                yield engine
            return
        if kind == "uring":
            raise EngineUnavailable(f"io_uring requested but unavailable: {reason}")
        log.info("io engine: threads (io_uring unavailable: %s)", reason)
    yield ThreadEngine(threads)

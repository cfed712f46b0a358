"""Cache-file I/O engines: io_uring under trio, with a thread-pool fallback."""

from lakefs_mount.uring.choose import (
    FALLOC_FL_KEEP_SIZE,
    FALLOC_FL_PUNCH_HOLE,
    FALLOC_PUNCH_HOLE,
    EngineUnavailable,
    open_engine,
    probe_uring,
)
from lakefs_mount.uring.engine import IoEngine
from lakefs_mount.uring.ring import UringEngine
from lakefs_mount.uring.threads import ThreadEngine, fallocate_sync, write_on_this_thread

__all__ = [
    "FALLOC_FL_KEEP_SIZE",
    "FALLOC_FL_PUNCH_HOLE",
    "FALLOC_PUNCH_HOLE",
    "EngineUnavailable",
    "IoEngine",
    "ThreadEngine",
    "UringEngine",
    "fallocate_sync",
    "open_engine",
    "probe_uring",
    "write_on_this_thread",
]

"""Whether the page cache holds a range of a cache file, asked without touching it.

A read reply spliced from the cache file (`Reader.read_lent`, `send`) is made in the
trio loop itself, and splice(2) from a file waits for the disk where a page is missing.
cachestat(2) (Linux 6.5+) counts the cached pages of a range without reading them or
starting readahead, so the loop splices only what it will not wait for.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

SYS_CACHESTAT = 451  # the same number on every architecture (the unified syscall table)

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [("nr_cache", ctypes.c_uint64), ("nr_dirty", ctypes.c_uint64),
                ("nr_writeback", ctypes.c_uint64), ("nr_evicted", ctypes.c_uint64),
                ("nr_recently_evicted", ctypes.c_uint64)]


_supported = True


def all_cached(fd: int, start: int, end: int) -> bool:
    """True if every page of bytes [start, end) of the file at `fd` is in the page cache
    (pages past the file's end never are); False also where the kernel cannot tell."""
    global _supported
    if not _supported or end <= start:
        return False
    first = start - start % mmap.PAGESIZE
    rng, stat = _Range(first, end - first), _Stat()
    if _syscall(SYS_CACHESTAT, ctypes.c_int(fd), ctypes.byref(rng), ctypes.byref(stat),
                ctypes.c_uint(0)) != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
            _supported = False  # an old kernel, or a seccomp filter: never again
            return False
        raise OSError(err, os.strerror(err))
    return stat.nr_cache >= -(-(end - first) // mmap.PAGESIZE)

"""Whether libfuse can take write requests from the kernel through a pipe (splice) here.

libfuse reads each request with splice(2) into a pipe when it can size that pipe for a
whole request (1 MiB of data and a page of headers); pyfuse3's `write` then gets its bytes
in one copy out of the pipe. Otherwise libfuse read(2)s the request into a buffer of its
own (the kernel pins that buffer page by page while it copies) and copies it once more,
which costs the daemon more CPU for every byte written.

Sizing a pipe beyond fs.pipe-max-size (1 MiB by default) takes CAP_SYS_RESOURCE, which
root has on a plain host but not in most containers. libfuse says nothing about which
way it went, so the daemon asks the kernel the same question once, at start.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from pathlib import Path

FUSE_MAX_MAX_PAGES = 256  # libfuse's buffer: the largest request the kernel sends ...
FUSE_BUFFER_HEADER_SIZE = 0x1000  # ... and room for its headers
LIBFUSE_REQUEST_BYTES = FUSE_MAX_MAX_PAGES * mmap.PAGESIZE + FUSE_BUFFER_HEADER_SIZE
# The kernel rounds a pipe's size up to a power of two, and compares that with the limit.
PIPE_BYTES_NEEDED = 1 << (LIBFUSE_REQUEST_BYTES - 1).bit_length()
PIPE_MAX_SIZE = Path("/proc/sys/fs/pipe-max-size")  # the sysctl that allows it without the cap


def writes_can_splice() -> bool:
    """True if this process may size a pipe as libfuse needs to splice a write request."""
    read_end, write_end = os.pipe()
    try:
        fcntl.fcntl(read_end, fcntl.F_SETPIPE_SZ, LIBFUSE_REQUEST_BYTES)
    except OSError:  # EPERM: beyond fs.pipe-max-size without CAP_SYS_RESOURCE
        return False
    finally:
        os.close(read_end)
        os.close(write_end)
    return True


def advice() -> str:
    """What an operator can do when `writes_can_splice` is False."""
    return (f"libfuse copies every write request twice: it may not size a pipe to "
            f"{PIPE_BYTES_NEEDED} bytes to splice them (`sysctl fs.pipe-max-size="
            f"{PIPE_BYTES_NEEDED}`, or CAP_SYS_RESOURCE, saves that copy of every byte "
            f"written)")

"""The errors of filesystem operations, as errnos for either FUSE session.

`FSError(errno)` is what an operation fails with on purpose; an S3 failure inside a
namespace operation becomes EIO (`s3_errors`); a name whose key S3 cannot store is
ENAMETOOLONG before anything changes (`check_key`).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from lakefs_mount.namespace.dirattrs import DirAttrs, sidecar_fits
from lakefs_mount.s3.objectstore import MAX_KEY_BYTES, ObjectStoreError, key_fits

log = logging.getLogger(__name__)


class FSError(Exception):
    def __init__(self, err: int, message: str = "") -> None:
        super().__init__(message or os.strerror(err))
        self.errno = err


def errno_of(exc: Exception, what: str) -> int:
    """The errno a failed operation answers the kernel with, for either FUSE session.
    A failure of the cache disk (ENOSPC, ...) tells the caller why; anything unexpected
    is logged with its traceback and becomes EIO."""
    if isinstance(exc, FSError):
        return exc.errno
    if isinstance(exc, OSError):
        log.error("%s failed: %s", what, exc)
        return exc.errno or errno.EIO
    log.error("internal error in %s", what, exc_info=exc)
    return errno.EIO


@asynccontextmanager
async def s3_errors(what: str) -> AsyncIterator[None]:
    """A failed S3 call in a namespace operation becomes EIO, with the reason logged."""
    try:
        yield
    except ObjectStoreError as exc:
        log.error("%s failed: %s", what, exc)
        raise FSError(errno.EIO, str(exc)) from exc


def check_key(key: str, dir_attrs: DirAttrs | None) -> None:
    """The S3 key of a new name must fit, with the same limit for a file and a directory
    of that path: a directory's, whose marker ends with "/" and which, on a store that
    drops the metadata of markers, needs a sidecar key SIDECAR_OVERHEAD bytes longer for
    its attributes (dirattrs). `key` ends with "/" for a directory."""
    as_dir = key if key.endswith("/") else key + "/"
    if not key_fits(as_dir):
        raise FSError(errno.ENAMETOOLONG,
                      f"{key[:60]}... would need an S3 key over {MAX_KEY_BYTES} bytes")
    if dir_attrs is not None and dir_attrs.sidecars and not sidecar_fits(as_dir):
        raise FSError(errno.ENAMETOOLONG, f"{key[:60]}... leaves no room in S3's "
                      f"{MAX_KEY_BYTES} bytes for the key of a directory's attributes")

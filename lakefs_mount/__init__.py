"""lakefs-mount: a FUSE mount of an S3 bucket with a crash-safe write-back cache.

The Python API (lakefs_mount/api.py) loads on first use, so `import lakefs_mount` stays
cheap: flush(path), commit(path, expect_files=None, ...), verify(path), status(mountpoint),
and the exceptions LakefsMountError, NotALakefsMount and VerifyFailed.
"""

# Nothing imported at module level: every `lakefs-mount` command imports this package
# before its own interrupt handling starts (a Ctrl-C inside `typing` printed a traceback).
from __future__ import annotations

__all__ = ["flush", "commit", "verify", "status", "LakefsMountError", "NotALakefsMount",
           "VerifyFailed"]


def __getattr__(name: str) -> object:
    if name in __all__:
        from lakefs_mount import api

        return getattr(api, name)
    raise AttributeError(f"module 'lakefs_mount' has no attribute {name!r}")

"""One retry policy for every S3 request: which failures another attempt may fix, how
many attempts, and how long to wait between them.

The daemon's requests are retried in one place, `AsyncStore.retrying`, which counts and
logs every retry (`status` shows them) and whose waits a flush cuts short; its
`S3ObjectStore` makes a single attempt per request. Direct users of `S3ObjectStore` (the
embedded server, start-up probes, tests) get the same policy, blocking (`retried`).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from lakefs_mount.s3.objectstore import ObjectStoreError

F = TypeVar("F", bound=Callable[..., Any])

# What botocore's standard mode retries, and what the daemon retries on its own.
TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
TRANSIENT_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException",
                             "RequestTimeout", "RequestTimeTooSkewed", "InternalError",
                             "ServiceUnavailable",
                             # a body corrupted on the way (a trailer's: Invalid-)
                             "BadDigest", "InvalidDigest"})
QUICK_ATTEMPTS = 3  # a lookup or a namespace change: transient failures only
FIRST_DELAY = 0.2
MAX_DELAY = 30.0


def delay_after(attempt: int) -> float:
    """Seconds to wait after failed attempt number `attempt` (1, 2, ...): 0.2 s doubling
    up to 30 s."""
    return min(FIRST_DELAY * 2 ** (attempt - 1), MAX_DELAY)


def transient(exc: BaseException) -> bool:
    """Whether another attempt may succeed where this one failed (throttling, a 5xx, a
    connection refused, reset or timed out), as `S3ObjectStore` marked it."""
    return isinstance(exc, ObjectStoreError) and exc.transient


_depth = threading.local()


def retried(method: F) -> F:
    """A blocking `S3ObjectStore` method, retried on transient failures up to the store's
    `max_attempts` (1 in the daemon, whose AsyncStore retries instead). A call made from
    inside another retried call (a copy's HEAD) is not retried again on its own."""
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_depth, "n", 0)
        _depth.n = depth + 1
        try:
            attempt = 0
            while True:
                attempt += 1
                try:
                    return method(self, *args, **kwargs)
                except ObjectStoreError as exc:
                    if depth or attempt >= self.max_attempts or not transient(exc):
                        raise
                time.sleep(delay_after(attempt))
        finally:
            _depth.n = depth

    return wrapper  # type: ignore[return-value]

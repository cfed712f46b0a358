"""How long each S3 request took and how each failed request failed, measured around the
object store without touching it.

Why a wrapper: every request of the daemon goes through one `ObjectStore`, so timing its
calls gives the latency of each S3 operation (histograms for Prometheus, counts for
`status`) and one structured log line per failed request, without code in the store, the
cache or the flusher. In the daemon a call is one request: its store makes one attempt per
call (s3/retry), and each retry of AsyncStore is a new call (counted in `attempt`).
"""

from __future__ import annotations

import bisect
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# Upper bounds (seconds) of the latency buckets: from a small HEAD to a 512 MiB part.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# ObjectStore method -> the S3 operation it sends. list_recursive is left out: it returns
# a generator whose requests happen while the caller iterates, outside the call.
OPERATIONS = {
    "check_bucket": "HeadBucket", "head": "HeadObject", "get": "GetObject",
    "get_range": "GetObject", "get_range_into": "GetObject", "put": "PutObject",
    "list_dir": "ListObjectsV2", "delete": "DeleteObject", "delete_many": "DeleteObjects",
    "copy": "CopyObject", "create_multipart": "CreateMultipartUpload",
    "upload_part": "UploadPart", "upload_part_copy": "UploadPartCopy",
    "complete_multipart": "CompleteMultipartUpload",
    "abort_multipart": "AbortMultipartUpload", "list_parts": "ListParts",
    "list_multipart_uploads": "ListMultipartUploads",
}


@dataclass
class OperationStats:
    """Requests of one operation: how many, how many failed, their latency histogram."""

    count: int = 0
    failures: int = 0
    seconds_sum: float = 0.0
    in_bucket: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))

    def snapshot(self) -> dict[str, Any]:
        cumulative, running = {}, 0
        for bound, n in zip((*map(str, BUCKETS), "+Inf"), self.in_bucket, strict=True):
            running += n
            cumulative[bound] = running
        return {"count": self.count, "failures": self.failures,
                "seconds_sum": round(self.seconds_sum, 6), "buckets": cumulative}


def failure_fields(exc: BaseException) -> dict[str, Any]:
    """HTTP status and S3 error code of a failed request, where S3 answered at all: on the
    store's exception (`ObjectStoreError.status`, `.code`) or on S3's reply it was raised
    from."""
    for source in (exc, exc.__cause__):
        status = getattr(source, "status", None)
        if isinstance(status, int):
            return {"status": status, "s3_error_code": getattr(source, "code", None) or None}
    return {"status": None, "s3_error_code": None}


class S3Stats:
    """Thread-safe totals of the requests the store made (they run in worker threads)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._ops: dict[str, OperationStats] = {}
        self._streaks: dict[tuple[str, str | None], int] = {}
        self._clock = clock
        self.last_error_at: float | None = None

    def record(self, op: str, key: str | None, seconds: float,
               error: BaseException | None = None) -> int:
        """Count one request; returns its attempt number (failures in a row of `op` on
        `key`, this one included; 0 for a success)."""
        with self._lock:
            stats = self._ops.setdefault(op, OperationStats())
            stats.count += 1
            stats.seconds_sum += seconds
            stats.in_bucket[bisect.bisect_left(BUCKETS, seconds)] += 1
            if error is None:
                self._streaks.pop((op, key), None)
                return 0
            stats.failures += 1
            self.last_error_at = self._clock()
            attempt = self._streaks.get((op, key), 0) + 1
            self._streaks[(op, key)] = attempt
            return attempt

    def snapshot(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {op: stats.snapshot() for op, stats in sorted(self._ops.items())}


class TimedStore:
    """An ObjectStore that times every request of the one it wraps and logs each failed
    one as a structured line (fields s3_op, key, status, s3_error_code, attempt, seconds);
    everything else passes through unchanged."""

    def __init__(self, store: Any, stats: S3Stats) -> None:
        self._store = store
        self._stats = stats

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        op = OPERATIONS.get(name)
        if op is None:
            return attr
        return functools.partial(self._timed, op, attr)

    def _timed(self, op: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        key = args[0] if args and isinstance(args[0], str) else None
        started = time.perf_counter()
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:
            seconds = time.perf_counter() - started
            attempt = self._stats.record(op, key, seconds, exc)
            fields = {"s3_op": op, "key": key, **failure_fields(exc), "attempt": attempt,
                      "seconds": round(seconds, 3)}
            log.info("S3 request failed: %s %s (attempt %d): %s", op, key or "", attempt, exc,
                     extra=fields)
            raise
        self._stats.record(op, key, time.perf_counter() - started)
        return result

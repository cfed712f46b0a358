"""How long each S3 request took and how each failed request failed, measured around the
object store without touching it.

Why a wrapper: every request of the daemon goes through one `ObjectStore`, so timing its
calls gives the latency of each S3 operation (histograms for Prometheus, counts for
`status`) and one structured log line per failed request, without code in the store, the
cache or the flusher. In the daemon a call is one request: its store makes one attempt per
call (s3/retry), and each retry of AsyncStore is a new call (counted in `attempt`).

It also sees every request start, so it knows the ones under way: a request stuck in a
black hole shows in `status` (`waiting`) while it waits, not only once its time bound
(s3/timeouts) has run out.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lakefs_mount.s3.objectstore import NoSuchKey, NoSuchUpload

log = logging.getLogger(__name__)

# Upper bounds (seconds) of the latency buckets: from a small HEAD to a 512 MiB part.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# ObjectStore method -> the S3 operation it sends. list_recursive is left out: it returns
# a generator whose requests happen while the caller iterates, outside the call.
OPERATIONS = {
    "check_bucket": "HeadBucket", "head": "HeadObject", "get": "GetObject",
    "get_range": "GetObject", "get_range_into": "GetObject", "put": "PutObject",
    "put_body": "PutObject",
    "list_dir": "ListObjectsV2", "delete": "DeleteObject", "delete_many": "DeleteObjects",
    "copy": "CopyObject", "create_multipart": "CreateMultipartUpload",
    "upload_part": "UploadPart", "upload_part_copy": "UploadPartCopy",
    "complete_multipart": "CompleteMultipartUpload",
    "abort_multipart": "AbortMultipartUpload", "list_parts": "ListParts",
    "list_multipart_uploads": "ListMultipartUploads",
}
# A request under way this long counts as waiting in `status` (s3_waiting): well above
# what S3 takes to answer anything but a big transfer, well below the 10 s a user allows.
WAITING_AFTER = 5.0
# How long a failure stays `status`'s last error when nothing retries its request.
ERROR_SHOWN_FOR = 120.0
# The `code` of failures (a Prometheus label) is S3's error code, its HTTP status where it
# gave none, or where S3 did not answer the exception's class (RequestTimedOut,
# EndpointUnreachable, CorruptRead); past MAX_CODES codes of one operation, or for a code
# that is not a plain word, OTHER_CODE: an endpoint cannot make the values grow unbounded.
OTHER_CODE = "Other"
MAX_CODES = 16
_CODE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789.")


@dataclass(frozen=True)
class Failure:
    """The latest failure of one (operation, key): how many in a row, when, and why."""

    attempt: int
    at: float
    message: str | None  # None: an answer the caller expects (no such key), not trouble


@dataclass
class OperationStats:
    """Requests of one operation: how many, how many failed, their latency histogram."""

    count: int = 0
    failures: int = 0
    seconds_sum: float = 0.0
    in_bucket: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    failure_codes: dict[str, int] = field(default_factory=dict)  # code -> failures

    def fail(self, error: BaseException) -> None:
        self.failures += 1
        code = failure_code(error)
        if code not in self.failure_codes and len(self.failure_codes) >= MAX_CODES:
            code = OTHER_CODE
        self.failure_codes[code] = self.failure_codes.get(code, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        cumulative, running = {}, 0
        for bound, n in zip((*map(str, BUCKETS), "+Inf"), self.in_bucket, strict=True):
            running += n
            cumulative[bound] = running
        return {"count": self.count, "failures": self.failures,
                "failure_codes": dict(sorted(self.failure_codes.items())),
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


def failure_code(exc: BaseException) -> str:
    """The `code` a failure counts under (see MAX_CODES)."""
    fields = failure_fields(exc)
    if fields["status"] is None:
        code = type(exc).__name__
    else:
        code = str(fields["s3_error_code"] or fields["status"])
    return code if len(code) <= 64 and _CODE_CHARS.issuperset(code) else OTHER_CODE


class S3Stats:
    """Thread-safe totals of the requests the store made (they run in worker threads)."""

    def __init__(self, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._ops: dict[str, OperationStats] = {}
        self._streaks: dict[tuple[str, str | None], Failure] = {}
        self._clock = clock
        self._monotonic = monotonic
        self._under_way: dict[int, tuple[str, str | None, float]] = {}
        self._tickets = itertools.count()
        self.last_error_at: float | None = None
        # (monotonic) when S3 last answered a request, with data or "no such key": a
        # sign of life however slow it is (listings.answered_while_alive)
        self.last_answer_at = -math.inf

    def begin(self, op: str, key: str | None) -> int:
        """Note a request that starts now; `record` with the ticket when it ends."""
        ticket = next(self._tickets)
        with self._lock:
            self._under_way[ticket] = (op, key, self._monotonic())
        return ticket

    def forget(self, ticket: int) -> None:
        """A request that ended without an answer or an error of S3's."""
        with self._lock:
            self._under_way.pop(ticket, None)

    def record(self, op: str, key: str | None, seconds: float,
               error: BaseException | None = None, ticket: int | None = None) -> int:
        """Count one request; returns its attempt number (failures in a row of `op` on
        `key`, this one included; 0 for a success)."""
        with self._lock:
            if ticket is not None:
                self._under_way.pop(ticket, None)
            stats = self._ops.setdefault(op, OperationStats())
            stats.count += 1
            stats.seconds_sum += seconds
            stats.in_bucket[bisect.bisect_left(BUCKETS, seconds)] += 1
            if error is None or isinstance(error, NoSuchKey | NoSuchUpload):
                self.last_answer_at = self._monotonic()
            if error is None:
                self._streaks.pop((op, key), None)
                return 0
            stats.fail(error)
            self.last_error_at = self._clock()
            before = self._streaks.get((op, key))
            attempt = (before.attempt if before else 0) + 1
            trouble = not isinstance(error, NoSuchKey | NoSuchUpload)
            self._streaks[(op, key)] = Failure(attempt, self._monotonic(),
                                               str(error) if trouble else None)
            return attempt

    def waiting(self) -> dict[str, Any]:
        """The requests under way for `status`: how many (`s3_in_flight`), how many for
        longer than WAITING_AFTER (`s3_waiting`), and the oldest one (operation, key,
        seconds so far; None when none is under way)."""
        now = self._monotonic()
        with self._lock:
            under_way = list(self._under_way.values())
        oldest = min(under_way, key=lambda r: r[2], default=None)
        return {
            "s3_in_flight": len(under_way),
            "s3_waiting": sum(now - started >= WAITING_AFTER for *_, started in under_way),
            "s3_oldest_request": None if oldest is None else {
                "operation": oldest[0], "key": oldest[1],
                "age_s": round(now - oldest[2], 1)},
        }

    def waiting_on(self) -> str | None:
        """The oldest request under way for longer than WAITING_AFTER, in words
        ("PutObject step_1/model.pt for 12 s"): why a flush is not moving."""
        oldest = self.waiting()["s3_oldest_request"]
        if oldest is None or oldest["age_s"] < WAITING_AFTER:
            return None
        key = f" {oldest['key']}" if oldest["key"] else ""
        return f"{oldest['operation']}{key} for {oldest['age_s']:.0f} s"

    def current_error(self, since: float | None = None) -> str | None:
        """The latest failure of a request that has not succeeded since (and is at most
        ERROR_SHOWN_FOR old, and not older than `since`, a monotonic time): what S3 is
        doing wrong now, for `status`'s last error and a flush's progress."""
        horizon = max(self._monotonic() - ERROR_SHOWN_FOR, since or -float("inf"))
        with self._lock:
            recent = [f for f in self._streaks.values() if f.at >= horizon and f.message]
        return max(recent, key=lambda f: f.at).message if recent else None

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
        self.stats = stats

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        op = OPERATIONS.get(name)
        if op is None:
            return attr
        return functools.partial(self._timed, op, attr)

    def _timed(self, op: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        key = args[0] if args and isinstance(args[0], str) else None
        ticket = self._stats.begin(op, key)
        started = time.perf_counter()
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:
            seconds = time.perf_counter() - started
            attempt = self._stats.record(op, key, seconds, exc, ticket)
            fields = {"s3_op": op, "key": key, **failure_fields(exc), "attempt": attempt,
                      "seconds": round(seconds, 3)}
            log.info("S3 request failed: %s %s (attempt %d): %s", op, key or "", attempt, exc,
                     extra=fields)
            raise
        except BaseException:
            self._stats.forget(ticket)  # (not a failure of S3's: an interruption)
            raise
        self._stats.record(op, key, time.perf_counter() - started, ticket=ticket)
        return result

"""All metric names in one place (`status`, logs, Prometheus and tests use the same names),
the daemon's counters, and the FUSE sessions' latency histograms."""

from __future__ import annotations

from bisect import bisect_left as _bisect
from collections import Counter
from typing import Any

PROMETHEUS_PREFIX = "lakefs_mount_"

BYTES_UPLOADED = "bytes_uploaded"
BYTES_DOWNLOADED = "bytes_downloaded"
BYTES_VERIFIED = "bytes_verified"
BYTES_UNVERIFIED = "bytes_unverified"
READ_CHECKSUM_ERRORS = "read_checksum_errors"
PARTS_UPLOADED = "parts_uploaded"
PARTS_COPIED = "parts_copied"
PARTS_SPILLED = "parts_spilled"
OBJECTS_PUT = "objects_put"
UPLOADS_COMPLETED = "uploads_completed"
SERVER_SIDE_COPIES = "server_side_copies"
GETS = "gets"
HEADS = "heads"
LISTS = "lists"
DELETES = "deletes"
RETRIES = "retries"
ERRORS = "errors"
FILES_COMMITTED = "files_committed"
ORPHAN_UPLOADS_ABORTED = "orphan_uploads_aborted"
RECOVERED_FILES = "recovered_files"
CACHE_FILES_REFUSED = "cache_files_refused"
CACHE_EVICTIONS = "cache_evictions"
WRITER_WAITS = "writer_waits"
CACHE_FULL_WAITS = "cache_full_waits"
INDEX_READS = "index_reads"
INDEX_WRITES = "index_writes"
PAGE_CACHE_FILLS = "page_cache_fills"
PASSTHROUGH_OPENS = "passthrough_opens"
READ_REQUESTS = "read_requests"
SPLICED_READS = "spliced_reads"
WRITE_REQUESTS = "write_requests"
TEMPORARIES_HELD = "temporaries_held"
LATE_COMMITS_UNDONE = "late_commits_undone"
STREAMING_HELD = "streaming_held"
PASSTHROUGH_WRITES_HELD = "passthrough_writes_held"
INTENTS_JOURNALLED = "intents_journalled"

# Every counter with what it counts: the help text of its Prometheus counter.
COUNTERS: dict[str, str] = {
    BYTES_UPLOADED: "Bytes of file data sent to S3 (parts and whole objects).",
    BYTES_DOWNLOADED: "Bytes fetched from S3 into the cache.",
    BYTES_VERIFIED: "Bytes fetched from S3 whose CRC-32C was checked before any use.",
    BYTES_UNVERIFIED: ("Bytes fetched from S3 with no CRC-32C to check them against (an "
                       "object another tool wrote without one, a part copied server-side)."),
    READ_CHECKSUM_ERRORS: ("GETs whose bytes did not match their CRC-32C: fetched again, "
                           "never served, cached or uploaded."),
    PARTS_UPLOADED: "Multipart parts uploaded (UploadPart).",
    PARTS_COPIED: "Parts reused server-side for unchanged ranges (UploadPartCopy).",
    PARTS_SPILLED: ("Parts of files larger than the cache sent as objects of their own "
                    "(PutObject), then copied into their upload at the commit."),
    OBJECTS_PUT: "Objects written with a single PutObject.",
    UPLOADS_COMPLETED: "Multipart uploads completed.",
    SERVER_SIDE_COPIES: "Whole objects copied server-side (rename, chmod).",
    GETS: "Ranged GETs issued to fill the cache.",
    HEADS: "HEAD requests.",
    LISTS: "LIST requests.",
    DELETES: "DELETE requests.",
    RETRIES: "S3 requests retried after a failure.",
    ERRORS: "S3 requests that failed.",
    FILES_COMMITTED: "Files whose data was committed in S3.",
    ORPHAN_UPLOADS_ABORTED: "Multipart uploads of earlier runs aborted at recovery.",
    RECOVERED_FILES: "Files with dirty data found in the journal at mount.",
    CACHE_FILES_REFUSED: "Entries of the cache's data/ that are not regular files of the "
                         "daemon's user (a symlink, a device, another user's file), moved to "
                         "refused/ at mount instead of read.",
    CACHE_EVICTIONS: "Clean chunks evicted from the cache.",
    WRITER_WAITS: "Writes that waited for --max-dirty backpressure.",
    CACHE_FULL_WAITS: "Cache-file writes that hit ENOSPC and made room.",
    INDEX_READS: "GETs of directories' attribute indexes.",
    INDEX_WRITES: "PUTs of this mount's attribute indexes.",
    PAGE_CACHE_FILLS: "Small files handed to the kernel with their open.",
    PASSTHROUGH_OPENS: "Opens the kernel serves from the cache file itself.",
    STREAMING_HELD: ("Looks at passthrough writers that left their parts for later, since"
                     " the writers kept every core busy."),
    PASSTHROUGH_WRITES_HELD: ("Reads and writes of files written in passthrough that waited"
                              " for --max-dirty or cache disk room (fanotify)."),
    READ_REQUESTS: "FUSE READs the daemon served (none for passthrough opens).",
    SPLICED_READS: "FUSE READs answered with the cache file's pages, spliced (no copy).",
    WRITE_REQUESTS: "FUSE WRITEs the daemon served.",
    TEMPORARIES_HELD: "Files made as mkstemp makes one, whose parts waited for their final name.",
    INTENTS_JOURNALLED: ("Journal transactions that wrote a file's row before its change was"
                         " acknowledged (a create, chunks made dirty, attributes)."),
    LATE_COMMITS_UNDONE: "Objects a killed daemon's commit landed after the file's replayed "
                         "DELETE, deleted again.",
}

# Keys of the `status` dict exported as Prometheus gauges: status key -> (name, help).
GAUGES: dict[str, tuple[str, str]] = {
    "dirty_bytes": ("dirty_bytes", "Bytes written here and not yet committed in S3."),
    "files_pending": ("dirty_files", "Files with data not yet committed in S3."),
    "oldest_dirty_s": ("oldest_dirty_seconds",
                       "Age of the oldest data not yet committed in S3 (absent: none)."),
    "name_changes_pending": ("name_changes_pending",
                             "Namespace changes (mkdir, rmdir, unlink, rename) not yet in S3."),
    "max_dirty": ("dirty_limit_bytes", "Dirty bytes at which writers wait (--max-dirty)."),
    "uploads_in_flight": ("uploads_in_flight", "Part and object uploads running now."),
    "parts_queued": ("parts_queued", "Parts waiting for an upload slot."),
    "files_committing": ("files_committing", "Files whose commit is running now."),
    "cache_used": ("cache_used_bytes", "Bytes the cache files take on disk."),
    "cache_size": ("cache_budget_bytes", "Cache size beyond which clean chunks are evicted."),
    "uptime_s": ("uptime_seconds", "Seconds since the daemon started."),
    "last_s3_error_at": ("last_s3_error_timestamp_seconds",
                         "Unix time of the last failed S3 request."),
    "s3_in_flight": ("s3_requests_in_flight", "S3 requests under way now."),
    "s3_waiting": ("s3_requests_waiting",
                   "S3 requests under way for longer than 5 s (a slow or stuck S3)."),
    "s3_oldest_request_s": ("s3_oldest_request_seconds",
                            "Age of the oldest S3 request under way (absent: none)."),
}

# Counters `status` keeps (the CLI and tests read them) that Prometheus would see twice:
# per operation they are `s3_request_duration_seconds_count` and `s3_request_failures_total`.
NOT_EXPORTED = frozenset({GETS, HEADS, LISTS, DELETES, ERRORS})
EXPORTED_COUNTERS = {name: text for name, text in COUNTERS.items() if name not in NOT_EXPORTED}

# Per S3 operation (label `operation`), from the `s3_requests` of `status` (see s3/stats.py).
S3_REQUEST_SECONDS = "s3_request_duration_seconds"  # histogram
S3_REQUEST_FAILURES = "s3_request_failures"  # counter, also labelled `code`
# Per FUSE request (label `operation`: the kernel's opcode, lower case), from the
# `fuse_requests` of `status` (`Latencies` below).
FUSE_REQUEST_SECONDS = "fuse_request_duration_seconds"  # histogram


def prometheus_counter(name: str) -> str:
    """The Prometheus name of a counter, unit last: bytes_uploaded -> lakefs_mount_uploaded_
    bytes_total (the client adds `_total`)."""
    if name.startswith("bytes_"):
        name = name.removeprefix("bytes_") + "_bytes"
    return PROMETHEUS_PREFIX + name


class Metrics(Counter[str]):
    """Monotonic counters of the daemon, keyed by the names above."""


# FUSE request latency. Why not prometheus_client's Histogram: `/metrics` is built from
# `status` (ops/metrics_server.py), and an observe here is a bisect and two additions with
# no lock: each session observes in its trio loop, where `status` also reads the snapshot.
# Upper bounds (seconds): from a cached getattr (tens of µs) to an fsync that waits for S3.
FUSE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _Histogram:
    __slots__ = ("counts", "seconds")

    def __init__(self, size: int) -> None:
        self.counts = [0] * size  # per bucket, the last one +Inf
        self.seconds = 0.0


class Latencies:
    """Per operation, a histogram of seconds. A request timed costs about 1 µs: two
    perf_counter calls and an `observe` (measured on a shared 2-core VM)."""

    def __init__(self, buckets: tuple[float, ...] = FUSE_BUCKETS) -> None:
        self._bounds = buckets
        self._ops: dict[str, _Histogram] = {}

    def observe(self, op: str, seconds: float) -> None:
        hist = self._ops.get(op)
        if hist is None:
            hist = self._ops[op] = _Histogram(len(self._bounds) + 1)
        hist.counts[_bisect(self._bounds, seconds)] += 1
        hist.seconds += seconds

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """{operation: {count, seconds_sum, buckets: {upper bound: cumulative count}}},
        the shape of `status`'s s3_requests (without failures)."""
        out: dict[str, dict[str, Any]] = {}
        labels = (*map(str, self._bounds), "+Inf")
        for op in sorted(self._ops):
            hist = self._ops[op]
            cumulative, running = {}, 0
            for label, n in zip(labels, hist.counts, strict=True):
                running += n
                cumulative[label] = running
            out[op] = {"count": running, "seconds_sum": round(hist.seconds, 6),
                       "buckets": cumulative}
        return out

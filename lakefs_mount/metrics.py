"""All metric names in one place: `status`, logs and tests use the same names."""

from __future__ import annotations

from collections import Counter

BYTES_UPLOADED = "bytes_uploaded"
BYTES_DOWNLOADED = "bytes_downloaded"
PARTS_UPLOADED = "parts_uploaded"
PARTS_COPIED = "parts_copied"  # UploadPartCopy: unchanged ranges reused server-side
OBJECTS_PUT = "objects_put"
UPLOADS_COMPLETED = "uploads_completed"
SERVER_SIDE_COPIES = "server_side_copies"  # CopyObject of a whole object (rename, chmod)
GETS = "gets"  # ranged GETs issued to fill the cache
HEADS = "heads"
LISTS = "lists"
DELETES = "deletes"
RETRIES = "retries"
ERRORS = "errors"
FILES_COMMITTED = "files_committed"
ORPHAN_UPLOADS_ABORTED = "orphan_uploads_aborted"
RECOVERED_FILES = "recovered_files"
CACHE_EVICTIONS = "cache_evictions"
WRITER_WAITS = "writer_waits"  # writes that waited for --max-dirty backpressure
CACHE_FULL_WAITS = "cache_full_waits"  # cache-file writes that hit ENOSPC and made room
INDEX_READS = "index_reads"  # GETs of directories' attribute indexes (see dirindex)
INDEX_WRITES = "index_writes"  # PUTs of this mount's attribute indexes
PAGE_CACHE_FILLS = "page_cache_fills"  # small files handed to the kernel with their open
PASSTHROUGH_OPENS = "passthrough_opens"  # opens the kernel serves from the cache file itself
READ_REQUESTS = "read_requests"  # FUSE READs the daemon served (none for passthrough opens)
WRITE_REQUESTS = "write_requests"  # FUSE WRITEs the daemon served


class Metrics(Counter[str]):
    """Monotonic counters of the daemon, keyed by the names above."""

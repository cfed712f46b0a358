"""How long one S3 request may take: a base for the round trip, plus time for its bytes
at a floor rate.

Why scaled, and why these numbers: one fixed read timeout is either too short for a big
part on a slow link or far too long for a HEAD in a black hole (60 s, 3 attempts, keep an
`open(O_CREAT)` waiting minutes behind a stuck load balancer). So each request is
bounded by what it carries:

- BASE_SECONDS (10 s) for the round trip itself: S3 answers a HEAD, a LIST page, a
  DELETE or a CreateMultipartUpload in well under a second, and SeaweedFS on a loaded
  small machine in a few; 10 s is a margin of several times that, short enough that a
  black hole costs a retry, not a minute.
- FLOOR_BYTES_PER_S (1 MiB/s) for the bytes of a part, an object or a ranged GET: the
  slowest rate a single request is expected to keep. `--upload-concurrency` (8) parts
  share the node's link, so 1 MiB/s per request means the link moves at least
  8 MiB/s (~70 Mbit/s); a 16 MiB part gets 26 s, a 512 MiB part 8.7 min.
- COPY_BYTES_PER_S (8 MiB/s) for server-side copies (CopyObject, UploadPartCopy): the
  bytes never cross the node's link, and stores copy at tens to hundreds of MiB/s;
  a 5 GiB CopyObject gets 11 min.
- SECONDS_PER_PART for CompleteMultipartUpload (S3 assembles the parts; AWS documents
  it as taking up to minutes for large objects) and SECONDS_PER_KEY for DeleteObjects.

A link slower than the floor would otherwise never get a big part through (every
attempt cut off, the next one starting over), so a request that timed out gets twice the
time for its bytes on its next attempt, up to MAX_STRETCH times (`stretched`): a slow link
gets there in the end, while the base is never stretched, so a HEAD or a listing in a
black hole costs 10 s an attempt however often it is retried.

On lakefs-mount's own connections (`wire`) the bound is a deadline for the whole request.
Requests botocore sends get it as botocore's read timeout, which bounds each wait for a
byte rather than the whole request.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["RequestTimeouts", "stretched", "stretch_after", "BASE_SECONDS",
           "CONNECT_SECONDS", "FLOOR_BYTES_PER_S", "COPY_BYTES_PER_S", "MAX_STRETCH"]

MiB = 1024 * 1024
CONNECT_SECONDS = 5.0  # a TCP (and TLS) handshake; every request's connect gets this
BASE_SECONDS = 10.0
FLOOR_BYTES_PER_S = 1 * MiB
COPY_BYTES_PER_S = 8 * MiB
SECONDS_PER_PART = 0.05  # CompleteMultipartUpload: 10,000 parts get 510 s
SECONDS_PER_KEY = 0.02  # DeleteObjects: 1,000 keys get 30 s
MAX_STRETCH = 8

_local = threading.local()


@contextmanager
def stretched(factor: float) -> Iterator[None]:
    """Give the requests this thread sends meanwhile `factor` times their time (a retry
    of a request that timed out)."""
    before = getattr(_local, "factor", 1.0)
    _local.factor = factor
    try:
        yield
    finally:
        _local.factor = before


def stretch_after(timeouts: int) -> float:
    """The stretch of an attempt that follows `timeouts` attempts cut off by their bound."""
    return float(min(2 ** timeouts, MAX_STRETCH))


@dataclass(frozen=True)
class RequestTimeouts:
    """The bounds of one store's requests, in seconds; `base` is the store's
    `read_timeout` (tests make it small)."""

    connect: float = CONNECT_SECONDS
    base: float = BASE_SECONDS
    floor_bytes_per_s: float = FLOOR_BYTES_PER_S
    copy_bytes_per_s: float = COPY_BYTES_PER_S

    def _plus(self, work: float) -> float:
        """The base plus `work` seconds, stretched on a retry after a timeout."""
        return self.base + max(0.0, work) * getattr(_local, "factor", 1.0)

    def small(self) -> float:
        """A request that moves no bulk data: HEAD, LIST page, DELETE, create/abort."""
        return self.base

    def transfer(self, nbytes: int) -> float:
        """A request that sends or receives `nbytes` of data (PUT, UploadPart, GET)."""
        return self._plus(nbytes / self.floor_bytes_per_s)

    def per_byte(self) -> float:
        """Seconds a response body adds per byte, once its length is known."""
        return getattr(_local, "factor", 1.0) / self.floor_bytes_per_s

    def copy(self, nbytes: int) -> float:
        """A server-side copy of `nbytes` (CopyObject, UploadPartCopy)."""
        return self._plus(nbytes / self.copy_bytes_per_s)

    def complete(self, parts: int) -> float:
        """CompleteMultipartUpload of `parts` parts."""
        return self._plus(parts * SECONDS_PER_PART)

    def delete_batch(self, keys: int) -> float:
        """DeleteObjects of `keys` keys."""
        return self._plus(keys * SECONDS_PER_KEY)

    def rung(self, seconds: float) -> float:
        """`seconds` rounded up to base x 2^k: the read timeout of the botocore client
        that sends such a request (one client per rung, so few are ever made)."""
        rung = self.base
        while rung < seconds:
            rung *= 2
        return rung

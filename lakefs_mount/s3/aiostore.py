"""The object store as seen from the trio loop: every call in a worker thread, bounded,
and retried here, in the one place that decides (s3/retry): counted, logged, and cut
short by `wake_retries` when a flush asks."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, TypeVarTuple

import trio

from lakefs_mount import metrics as m
from lakefs_mount.s3.objectstore import (
    AccessDenied,
    CorruptRead,
    Listing,
    NoSuchBucket,
    NoSuchKey,
    NoSuchUpload,
    ObjectInfo,
    ObjectStore,
    ObjectStoreError,
    PartCopyUnsupported,
    RequestTimedOut,
)
from lakefs_mount.s3.retry import QUICK_ATTEMPTS, delay_after, transient
from lakefs_mount.s3.timeouts import stretch_after, stretched

log = logging.getLogger(__name__)
T = TypeVar("T")
Args = TypeVarTuple("Args")

# Errors that retrying cannot fix; everything else (timeouts, 5xx, resets) is retried.
PERMANENT = (NoSuchUpload, NoSuchKey, PartCopyUnsupported)


class AsyncStore:
    """Runs `ObjectStore` calls in threads behind one limiter and counts what they do."""

    def __init__(self, store: ObjectStore, metrics: m.Metrics, max_threads: int = 16) -> None:
        self.sync = store
        self.metrics = metrics
        self._limiter = trio.CapacityLimiter(max_threads)
        self._retry_now = trio.Event()
        self._under_way: set[trio.CancelScope] = set()
        self._abandoned = False

    async def _once(self, fn: Callable[..., T], *args: Any, stretch: float = 1.0,
                    abandon: bool = False) -> T:
        """One attempt in a worker thread. A cancelled caller still waits for it (its
        time bound ends it): what it did to S3 must be known before anything else is
        sent. A call that changes nothing (`abandon`: a HEAD, a listing, whose request
        was interrupted) is left behind at once, as is every call after
        `abandon_requests`, at an exit that cannot wait."""
        def attempt() -> T:
            with stretched(stretch):
                return fn(*args)

        if abandon:
            return await trio.to_thread.run_sync(attempt, limiter=self._limiter,
                                                 abandon_on_cancel=True)
        with trio.CancelScope(shield=True) as request:
            if self._abandoned:
                request.cancel()
            self._under_way.add(request)
            try:
                return await trio.to_thread.run_sync(attempt, limiter=self._limiter,
                                                     abandon_on_cancel=True)
            finally:
                self._under_way.discard(request)
        await trio.lowlevel.checkpoint()  # the exit's cancellation, which abandoned it
        raise ObjectStoreError("the request was abandoned: the daemon is exiting")

    def abandon_requests(self) -> None:
        """Stop waiting for the requests under way and any later one (their threads run
        on until the process exits): for an exit told not to wait, whose journal keeps
        what they were sending for the next mount, as after a crash."""
        self._abandoned = True
        for request in self._under_way:
            request.cancel()

    async def call(self, fn: Callable[[*Args], T], *args: *Args, what: str | None = None,
                   abandon: bool = False, attempts: int = QUICK_ATTEMPTS) -> T:
        """One S3 operation, retried only where the failure is transient (a 503, a
        connection refused), QUICK_ATTEMPTS times: lookups and namespace changes."""
        if what is None:
            shown: tuple[object, ...] = args
            what = " ".join(str(a) for a in (getattr(fn, "__name__", "S3 call"), *shown[:1]))
        return await self.retrying(what, fn, *args, max_attempts=attempts,
                                   transient_only=True, abandon=abandon)

    async def retrying(self, what: str, fn: Callable[[*Args], T], *args: *Args,
                       on_error: Callable[[Exception], None] | None = None,
                       max_attempts: float = math.inf, transient_only: bool = False,
                       abandon: bool = False) -> T:
        """Retry with exponential backoff (`retry.delay_after`) until it works, or until
        `max_attempts`; with `transient_only`, a failure that is not transient ends it.

        Dirty data is never dropped, so the flusher retries forever; `on_error` lets it
        publish the failure (status, waiting flushes) while it keeps trying. Every failed
        attempt counts as an error, every new attempt as a retry, each with a log line.
        An attempt that follows one cut off by its time bound gets more time
        (`timeouts.stretch_after`): a link slower than the floor rate gets there too.
        """
        attempt = timeouts = 0
        while True:
            attempt += 1
            try:
                return await self._once(fn, *args, stretch=stretch_after(timeouts),
                                        abandon=abandon)
            except PERMANENT:
                raise
            except (ObjectStoreError, OSError) as exc:
                timeouts += isinstance(exc, RequestTimedOut)
                self.metrics[m.ERRORS] += 1
                if isinstance(exc, CorruptRead):
                    self.metrics[m.READ_CHECKSUM_ERRORS] += 1
                if on_error is not None:
                    on_error(exc)
                if attempt >= max_attempts or (transient_only and not transient(exc)):
                    raise
                delay = delay_after(attempt)
                if isinstance(exc, (AccessDenied, NoSuchBucket, CorruptRead)):
                    log.error("%s failed: %s (retrying in %.1f s)", what, exc, delay)
                else:
                    log.warning("%s failed: %s (retrying in %.1f s)", what, exc, delay)
                self.metrics[m.RETRIES] += 1
                await self.backoff(delay)

    async def backoff(self, delay: float) -> None:
        """Sleep before a retry; `wake_retries` cuts it short."""
        with trio.move_on_after(delay):
            await self._retry_now.wait()

    def wake_retries(self) -> None:
        """Cut every backoff short (a flush was asked for: S3 may be back)."""
        self._retry_now.set()
        self._retry_now = trio.Event()

    async def head(self, key: str, checksum: bool = False,
                   attempts: int = QUICK_ATTEMPTS) -> ObjectInfo | None:
        self.metrics[m.HEADS] += 1
        # abandoned when cancelled: nothing waits on the thread, and an interrupted lookup
        # (FUSE_INTERRUPT) returns at once instead of when S3 answers
        return await self.call(self.sync.head, key, checksum, abandon=True,
                               attempts=attempts)

    async def list_dir(self, prefix: str) -> Listing:
        self.metrics[m.LISTS] += 1
        return await self.call(self.sync.list_dir, prefix, abandon=True)

    async def list_recursive(self, prefix: str) -> list[ObjectInfo]:
        def collect() -> list[ObjectInfo]:
            it: Iterator[ObjectInfo] = self.sync.list_recursive(prefix)
            return list(it)

        self.metrics[m.LISTS] += 1
        return await self.call(collect, what=f"list {prefix}")  # (listed again whole)

    async def get_whole(self, key: str, keep: Callable[[bytes], bool]
                        ) -> tuple[ObjectInfo, bool] | None:
        """GET a whole object and hand its body to `keep` in the same worker thread (no
        hop back to the loop for the bytes); returns its info and what `keep` said."""
        def fetch() -> tuple[ObjectInfo, bool] | None:
            got = self.sync.get(key)
            return None if got is None else (got[0], keep(got[1]))

        self.metrics[m.GETS] += 1
        got = await self.call(fetch, what=f"get {key}")  # a lookup: fails as fast as a HEAD
        if got is not None:
            self.metrics[m.BYTES_DOWNLOADED] += got[0].size
            checked = got[0].crc32c is not None  # (the store checked the body against it)
            self.metrics[m.BYTES_VERIFIED if checked else m.BYTES_UNVERIFIED] += got[0].size
        return got

    async def get_range_into(self, key: str, start: int, end: int,
                             write: Callable[[int, bytes], None], expect_crc: int | None = None,
                             whole: bool = False) -> int:
        """A ranged GET streamed to `write` in a worker thread, retried as a whole, also
        when its bytes do not match their CRC (`ObjectStore.get_range_into`)."""
        self.metrics[m.GETS] += 1
        n, checked = await self.retrying(f"GET {key}", self.sync.get_range_into, key, start,
                                         end, write, None, expect_crc, whole, max_attempts=4)
        self.metrics[m.BYTES_DOWNLOADED] += n
        self.metrics[m.BYTES_VERIFIED if checked else m.BYTES_UNVERIFIED] += n
        return n

    async def delete(self, key: str) -> None:
        self.metrics[m.DELETES] += 1
        await self.call(self.sync.delete, key)

    async def copy(self, src: str, dst: str, metadata: dict[str, str] | None) -> str:
        self.metrics[m.SERVER_SIDE_COPIES] += 1
        return await self.call(self.sync.copy, src, dst, metadata)

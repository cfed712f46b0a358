"""The flusher: streams full chunks as parts while files are written, commits closed files.

Small files go up with one PutObject; larger ones are multipart uploads whose parts
follow the fixed chunk mapping, so a chunk written again is simply uploaded again.
Unchanged ranges of an object that existed before are copied server-side
(UploadPartCopy); the upload and its parts are `Uploads` (cache/uploads.py), the flusher
decides when they go. Every S3 call is retried with backoff; dirty data is never dropped.
Memory is bounded: each of at most `concurrency` uploads holds one 1 MiB piece of its part.
Every part and object declares the CRC-32C of its bytes (s3/checksums), taken by the
sending thread from the bytes it reads out of the cache file.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import crc32c
import trio

from lakefs_mount import metrics as m
from lakefs_mount.cache.cachefile import (
    DIRTY_STATES,
    PENDING_STATES,
    CachedFile,
    ChunkState,
    SpilledPart,
)
from lakefs_mount.cache.manager import CacheManager
from lakefs_mount.cache.slots import Slots
from lakefs_mount.cache.uploads import CommitSuperseded, Uploads
from lakefs_mount.s3.checksums import ChecksumUse
from lakefs_mount.s3.layout import MAX_OBJECT_SIZE, META_PARTS
from lakefs_mount.s3.objectstore import NoSuchKey, NoSuchUpload, ObjectStoreError

log = logging.getLogger(__name__)

ERRORS_BEFORE_FLUSH_FAILS = 5


class FlushFailed(Exception):
    pass


@dataclass
class FlushProgress:
    files_left: int
    bytes_left: int
    last_error: str | None


class KeyGate(Protocol):
    """Changes of names that must reach S3 before a commit of a key (the namespace's
    write-back log: an unlink's DELETE of the key, a directory's marker above it); with
    `upto`, only those recorded before the change that waits for that event."""

    def busy(self, key: str, upto: trio.Event | None = None) -> bool: ...

    async def wait_clear(self, key: str, upto: trio.Event | None = None) -> None: ...

    async def retire_tables(self, tables: Sequence[tuple[str, str]]) -> None:
        """Journal the removal of tables of part CRCs (table, key) that the objects a
        commit replaced at `key` named."""


class Flusher:
    def __init__(self, cache: CacheManager, concurrency: int, commit_delay: float = 0.0,
                 on_committed: Callable[[CachedFile], None] = lambda cf: None,
                 gate: KeyGate | None = None, writer: str = "", prefix: str = "") -> None:
        self.cache = cache
        self.demand = demand = cache.demand  # what the cache asks of the flusher
        self.store = cache.store
        self.journal = cache.journal
        self.parts = cache.parts
        self.metrics = cache.metrics
        express = max(1, concurrency // 4)  # for the files a flush waits for (cache/slots)
        self._slots = Slots(concurrency, express)
        self._commit_slots = Slots(max(2, concurrency), express)
        self._flushing: Counter[CachedFile] = Counter()  # targets of the flushes under way
        self._part_queue = demand.parts
        self._committing = demand.committing
        self._commit_wanted = demand.commit_wanted
        # The same dues in time order; an entry whose due is no longer the file's is stale
        # and skipped. A file whose commit is running leaves the heap until it ends.
        self._due_heap: list[tuple[float, int, CachedFile]] = []
        self._due_seq = itertools.count()
        self._sleeping_until = -math.inf  # the run loop's next wake-up, when it is parked
        # A closed file waits this long before its commit starts, so that the rename a
        # checkpoint saver does right after writing is a journal update, not a copy.
        self.commit_delay = commit_delay
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        self.on_committed = on_committed  # an object is now in S3 (its directory's index)
        self.gate = gate
        self.checksums = ChecksumUse.from_environment()  # the probe: whether S3 checks
        self.uploads = Uploads(cache, self._slots, lambda cf: cf in self._flushing,
                               self.checksums, self._progress_changed, writer, prefix)

    # -- scheduling -------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                self._sleeping_until = self._due_heap[0][0] if self._due_heap else math.inf
                with trio.move_on_at(self._sleeping_until):
                    await self.demand.wake.wait()
                self._sleeping_until = -math.inf
                self.demand.wake = trio.Event()
                for cf, idx in list(self._part_queue):
                    self._part_queue.discard((cf, idx))
                    nursery.start_soon(self.uploads.stream_part, cf, idx)
                while self.demand.commits:
                    self.request_commit(self.demand.commits.pop())
                self._start_due_commits(nursery)

    def _start_due_commits(self, nursery: trio.Nursery) -> None:
        now = trio.current_time()
        heap = self._due_heap
        while heap and heap[0][0] <= now:
            due, _, cf = heapq.heappop(heap)
            if self._commit_wanted.get(cf) != due or cf in self._committing:
                continue  # stale, or re-queued by _commit_task when its commit ends
            del self._commit_wanted[cf]
            self._committing.add(cf)
            nursery.start_soon(self._commit_task, cf)

    def _queue_due(self, cf: CachedFile, due: float) -> None:
        """Put `cf` on the heap; wake the run loop only if it sleeps past the new due
        (a closed file's commit is due a whole commit delay later: usually it does not)."""
        heapq.heappush(self._due_heap, (due, next(self._due_seq), cf))
        if due < self._sleeping_until:
            self.demand.wake.set()

    def request_commit(self, cf: CachedFile, settle: bool = False) -> None:
        """Commit `cf`; with `settle` (a last close) only after the commit delay."""
        if cf.pending and not cf.unlinked:
            due = trio.current_time() + (self.commit_delay if settle else 0.0)
            if due < self._commit_wanted.get(cf, math.inf):
                self._commit_wanted[cf] = due
                self._queue_due(cf, due)

    def _progress_changed(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- flush ------------------------------------------------------------------------

    async def flush(self, files: list[CachedFile], report: object = None,
                    on_progress: object = None) -> None:
        """Return once every file has committed the version it had at the call (with
        what a passthrough writer's last close, under way, brings)."""
        for cf in files:
            await self.cache.passthrough.left(cf)
            if cf.pt.writers and not cf.unlinked:  # what the kernel wrote so far counts
                await self.cache.passthrough.sync(cf)
        targets = [(cf, cf.version) for cf in files if cf.pending and not cf.unlinked]
        errors_before = {cf: cf.errors.count for cf, _ in targets}
        started = time.monotonic()
        self.store.wake_retries()  # S3 may be back: do not sit out a long backoff
        self._flushing.update(cf for cf, _ in targets)
        try:
            for slots in (self._slots, self._commit_slots):  # ahead of the background
                slots.prioritize(self._flushing.__contains__)
            await self._flush_wait(targets, errors_before, started, on_progress)
        finally:
            self._flushing.subtract(cf for cf, _ in targets)
            self._flushing = +self._flushing  # (drops the files no flush waits for)

    async def _flush_wait(self, targets: list[tuple[CachedFile, int]],
                          errors_before: dict[CachedFile, int], started: float,
                          on_progress: object) -> None:
        for cf, _ in targets:
            self.request_commit(cf)
        while True:
            left = [(cf, v) for cf, v in targets
                    if cf.committed_version < v and not cf.unlinked and cf.pending]
            if not left:
                return
            failing = [cf for cf, _ in left if cf.errors.streak >= ERRORS_BEFORE_FLUSH_FAILS
                       and cf.errors.count - errors_before[cf] >= ERRORS_BEFORE_FLUSH_FAILS]
            if failing:
                raise FlushFailed(
                    f"uploading {failing[0].key} keeps failing: {failing[0].errors.last}; "
                    f"{len(left)} file(s) not yet committed (the daemon keeps retrying)")
            if callable(on_progress):
                await on_progress(self.progress([cf for cf, _ in left], since=started))
            with trio.move_on_after(1.0):
                await self._changed.wait()
            for cf, _ in left:
                self.request_commit(cf)

    def progress(self, files: list[CachedFile], since: float = -math.inf) -> FlushProgress:
        """Bytes and files left, and the error of a file that failed `since` (monotonic):
        a flush started after S3 came back shows no error from before it."""
        bytes_left = sum(  # not yet sent; uploaded parts only wait for their Complete
            self.parts.held_bytes(i, cf.size)
            for cf in files for i, c in cf.chunks.items() if c.state in DIRTY_STATES)
        errors = [cf.errors.last for cf in files
                  if cf.errors.streak and cf.errors.last_at >= since]
        return FlushProgress(len(files), bytes_left, errors[0] if errors else None)

    # -- commits ----------------------------------------------------------------------

    async def _commit_task(self, cf: CachedFile) -> None:
        failed = False
        try:
            while self.gate is not None and self._gate_busy(cf):  # (a rename may change
                await self.gate.wait_clear(cf.commit_key(), cf.upload.moves)  # the key)
            async with self._commit_slots.hold(cf, cf in self._flushing), cf.commit_lock:
                while True:
                    if self._gate_busy(cf):
                        break  # a change of its name came first: re-requested below
                    try:
                        await self._commit(cf)
                        break
                    except NoSuchUpload:
                        await self.uploads.forget(cf)
                    except CommitSuperseded:
                        break  # re-requested below once the file is closed again
                    except NoSuchKey:
                        if not await self._base_vanished(cf):
                            raise
                        break
        except Exception as exc:
            failed = True
            self.uploads.background_failure(cf, "commit", exc)
        finally:
            self._committing.discard(cf)
            if cf in self._commit_wanted:  # requested meanwhile: it may start now
                self._queue_due(cf, self._commit_wanted[cf])
            self._progress_changed()
        if failed:  # the commit is tried again after this: a retry too
            self.metrics[m.RETRIES] += 1
            await self.store.backoff(min(30.0, 0.5 * 2 ** min(cf.errors.streak, 6)))
        if cf.pending and cf.writers == 0 and cf.committed_version < cf.version:
            self.request_commit(cf)

    def _gate_busy(self, cf: CachedFile) -> bool:
        """Changes of names must reach S3 before this commit: those touching where it
        puts the object (for an upload a rename kept, its old key, and only the changes
        recorded before the move that waits for it)."""
        return self.gate is not None and self.gate.busy(cf.commit_key(), cf.upload.moves)

    async def _commit(self, cf: CachedFile) -> None:
        if not cf.pending or cf.unlinked:
            return
        await self.cache.passthrough.left(cf)
        written = self.cache.passthrough.size_now(cf) if cf.pt.writers else cf.size
        if written > MAX_OBJECT_SIZE:  # grown there by a passthrough writer: the daemon
            # saw no write to refuse with EFBIG. Kept, and flush says why it cannot finish.
            raise ObjectStoreError(f"{cf.key} is {written} bytes, larger than S3's largest "
                                   "object (5 TiB): truncate it below that, or remove it")
        if cf.pt.writers:  # the kernel writes it directly: commit what it holds now
            await self.cache.passthrough.sync(cf)
        version, size, seen_gen = cf.version, cf.size, cf.intent_gen
        cf.low_water = size
        meta = self.uploads.metadata(cf)
        nchunks = self.parts.chunk_count(size)
        if cf.upload.moves is not None and (nchunks <= 1 or cf.symlink is not None):
            # an upload a rename kept that this commit would not complete: it goes (the
            # move waiting for it finds nothing), and the commit comes again behind it
            await self.uploads.abandon(cf)
            raise CommitSuperseded
        started = time.monotonic()
        placed = cf.key  # where the object lands: an upload a rename kept, at its old key
        copied: dict[int, SpilledPart] = {}  # the spilled parts the object holds
        pending_idx = [i for i, c in cf.chunks.items() if c.state in PENDING_STATES]
        attrs_only = (not pending_idx and cf.base.key == cf.key and size == cf.base.size
                      and cf.upload.id is None and cf.symlink is None and not cf.spills)
        crc: int | None = None  # of the new object, where known
        if cf.symlink is not None:
            body = cf.symlink.encode()
            size = len(body)  # the object's size, as listings show it (the index checks it)
            crc = crc32c.crc32c(body) if self.checksums.send else None
            etag = await self.uploads.call(cf, f"PutObject {cf.key}", self.store.sync.put,
                                           cf.key, body, meta, crc, places_object=True)
            self.metrics[m.OBJECTS_PUT] += 1
            committed: list[int] = []
        elif attrs_only and size > 0:
            table = None if cf.base.meta is None else cf.base.meta.get(META_PARTS)
            if table is not None:  # the same bytes: the same parts
                meta[META_PARTS] = table
            etag = await self.uploads.call(cf, f"CopyObject {cf.key}", self.store.sync.copy,
                                           cf.key, cf.key, meta, places_object=True)
            self.metrics[m.SERVER_SIDE_COPIES] += 1
            committed = []
            if cf.base.crc is not None and cf.base.crc[0] == cf.base.etag:
                crc = cf.base.crc[1]  # the same bytes
        elif nchunks <= 1:
            if cf.upload.id is not None:
                await self.uploads.abort(cf)
            if 0 in cf.spills:  # (a file cut to one part after it spilled): cached first
                with self.cache.book.pinned(cf, [0]):
                    await self.cache.fetcher.ensure_chunk(cf, 0)
                    await self.cache.writer.mark_dirty(cf, [0], None)
            sent = {i: (c, c.gen) for i, c in cf.chunks.items() if c.state in PENDING_STATES}
            key = cf.key
            declare = self.checksums.send
            crcs: list[int] = []
            async with (self._slots.hold(cf, cf in self._flushing),
                        self.cache.reader.part_reader(cf, 0, size) as source):
                def put() -> str:  # the file is read here too, not in the trio loop
                    data = source.read(0, size)
                    crcs[:] = [crc32c.crc32c(data)] if declare else []
                    return self.store.sync.put(key, data, meta, crcs[0] if crcs else None)

                etag = await self.uploads.call(cf, f"PutObject {key}", put, places_object=True)
            crc = crcs[0] if crcs else None
            self.metrics[m.OBJECTS_PUT] += 1
            self.metrics[m.BYTES_UPLOADED] += size
            committed = []
            for i, (ch, gen) in sent.items():  # (also a part streamed meanwhile, or still
                # on its way into the upload aborted above: the object holds its bytes)
                if cf.chunks.get(i) is ch and ch.gen == gen and ch.state in PENDING_STATES:
                    self.cache.book.set_state(cf, ch, i, ChunkState.UPLOADED)  # made clean below
                    committed.append(i)
        else:
            key, upload_id = await self.uploads.ensure(cf)
            results: dict[int, tuple[str, int | None]] = {}

            async def one(idx: int) -> None:
                number, etag, part_crc, spilled = await self.uploads.part_for_commit(
                    cf, idx, size, version, key, upload_id)
                results[number] = etag, part_crc
                if spilled is not None:
                    copied[idx] = spilled

            try:
                async with trio.open_nursery() as nursery:
                    for idx in range(nchunks):
                        nursery.start_soon(one, idx)
            except ExceptionGroup as group:  # NoSuchUpload, CommitSuperseded: see the caller
                raise group.exceptions[0] from group
            parts = [(n, etag) for n, (etag, _) in sorted(results.items())]
            part_crcs = [c for _, (_, c) in sorted(results.items())]
            crc = self.uploads.full_crc(part_crcs, size)
            if cf.upload.table is not None:
                meta[META_PARTS] = cf.upload.table  # (as its CreateMultipartUpload said)
            etag = await self.uploads.complete(cf, key, upload_id, parts, part_crcs, crc, size)
            self.metrics[m.UPLOADS_COMPLETED] += 1
            await self.journal(self.journal.sync.end_upload, upload_id)
            cf.take_upload(completed=True)
            placed = key
            committed = [i for i in range(nchunks)]
        await self._retire_replaced_tables(cf, placed, meta)
        for i in committed:
            self.cache.book.chunk_committed(cf, i)
        self.uploads.uploaded_to_dirty(cf)  # parts of an upload that no longer exists
        cf.committed(placed, size, str(etag), crc, meta)  # (clean_note below needs it)
        if cf.low_water < min(size, cf.size):  # cut below what this commit placed
            await self.cache.writer.zeros_past_cut(cf, cf.low_water, cf.size)
        spilled_keys = self.cache.spills_copied(cf, copied)  # (the object holds them now)
        keep = cf.version != version or bool(cf.spills) or any(
            c.state in PENDING_STATES for c in cf.chunks.values())
        assert cf.fid is not None
        # no passthrough writer: the row's flag, if any, is stale (see Writer.row_covers)
        flag_stale = not self.cache.passthrough.kernel_writes(cf)
        if not keep:
            cf.flag_doubtful()
        kept = await self.journal(self.journal.sync.finish_commit, cf.fid, committed, keep,
                                  placed, size, seen_gen, flag_stale,
                                  self.cache.clean_note(cf), crc,
                                  [(i, p.token) for i, p in copied.items()])
        self.cache.remove_spills(spilled_keys)
        cf.committed_version = version
        # An intent that raced with finish_commit kept (or re-created) the row.
        if kept or cf.version != version or cf.spills or any(
                c.state in PENDING_STATES for c in cf.chunks.values()):
            cf.row_written()
        else:
            cf.row_dropped()
        if cf.unlinked and cf.in_journal:  # unlinked while this commit ran (its DELETE
            await self.journal(self.journal.sync.drop_file, cf.fid)  # waited for it)
            cf.row_dropped()
        self.metrics[m.FILES_COMMITTED] += 1
        if placed == cf.key:
            self.on_committed(cf)
        else:  # the move to its key may go now: the file's base is the object it moves
            cf.release_move()
        log.debug("committed %s (%d bytes) in %.2f s", cf.key, size, time.monotonic() - started)

    async def _retire_replaced_tables(self, cf: CachedFile, placed: str,
                                      meta: dict[str, str]) -> None:
        """The object just placed at `placed` replaced one whose table of part CRCs the
        mount knows (the file's base there, or a file a rename put this one over): that
        table goes (namelog TABLE; a crash before this leaves it to `sweep-tables`)."""
        replaced: set[str | None] = set()
        if cf.replaces == placed:  # (the object a rename put this file over is replaced)
            replaced.add(cf.replaced_table)
            cf.replaces = cf.replaced_table = None
        if cf.base.key == placed and cf.base.meta is not None:
            replaced.add(cf.base.meta.get(META_PARTS))
        tables = [(t, placed) for t in replaced if t is not None and t != meta.get(META_PARTS)]
        if tables and self.gate is not None:
            await self.gate.retire_tables(tables)

    async def _base_vanished(self, cf: CachedFile) -> bool:
        """The object holding the unchanged bytes is gone: deleted (an unlink that crashed
        half-way, D15) or by another node. The file's pending state goes with it."""
        if cf.base.key is None or await self.store.head(cf.base.key) is not None:
            return False
        log.error("%s: its committed object %s was deleted; dropping its pending changes",
                  cf.key, cf.base.key)
        await self.cache.discard(cf, name_kept=True)
        return True

    def status(self) -> dict[str, object]:
        return {
            "uploads_in_flight": self.demand.in_flight,
            "files_committing": len(self._committing),
            "parts_queued": len(self._part_queue),
            "checksums": self.checksums.describe(),
        }

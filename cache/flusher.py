"""The flusher: streams full chunks as parts while files are written, commits closed files.

Small files go up with one PutObject; larger ones are multipart uploads whose parts
follow the fixed chunk mapping, so a chunk written again is simply uploaded again.
Unchanged ranges of an object that existed before are copied server-side
(UploadPartCopy). Every S3 call is retried with backoff; dirty data is never dropped.
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import crc32c
import trio

from lakefs_mount import metrics as m
from lakefs_mount.cache.cachefile import (
    DIRTY_STATES,
    PENDING_STATES,
    CachedFile,
    Chunk,
    ChunkState,
)
from lakefs_mount.cache.manager import CacheManager
from lakefs_mount.cache.partbody import CachePartBody
from lakefs_mount.cache.slots import Slots
from lakefs_mount.s3.checksums import ChecksumUse
from lakefs_mount.s3.crc import crc32c_combine
from lakefs_mount.s3.layout import MAX_OBJECT_SIZE, META_SYMLINK, encode_attrs
from lakefs_mount.s3.objectstore import NoSuchKey, NoSuchUpload, ObjectStoreError

log = logging.getLogger(__name__)

ERRORS_BEFORE_FLUSH_FAILS = 5
COMMIT_ATTEMPTS = 3  # per S3 call inside one commit attempt


def _note_error(cf: CachedFile, message: str) -> None:
    cf.last_error, cf.last_error_at = message, time.monotonic()


class FlushFailed(Exception):
    pass


class CommitSuperseded(Exception):
    """The file changed while its commit ran, and the commit would need bytes of the
    version it started with: it gives way, and the next commit takes the new content."""


@dataclass
class FlushProgress:
    files_left: int
    bytes_left: int
    last_error: str | None


class KeyGate(Protocol):
    """Changes of names that must reach S3 before a commit of a key (the namespace's
    write-back log: an unlink's DELETE of the key, a directory's marker above it)."""

    def busy(self, key: str) -> bool: ...

    async def wait_clear(self, key: str) -> None: ...


class Flusher:
    def __init__(self, cache: CacheManager, concurrency: int, commit_delay: float = 0.0,
                 on_committed: Callable[[CachedFile], None] = lambda cf: None,
                 gate: KeyGate | None = None) -> None:
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
                    nursery.start_soon(self._stream_part, cf, idx)
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
        """Return once every file has committed the version it had at the call."""
        targets = [(cf, cf.version) for cf in files if cf.pending and not cf.unlinked]
        errors_before = {cf: cf.error_count for cf, _ in targets}
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
            failing = [cf for cf, _ in left if cf.error_streak >= ERRORS_BEFORE_FLUSH_FAILS
                       and cf.error_count - errors_before[cf] >= ERRORS_BEFORE_FLUSH_FAILS]
            if failing:
                raise FlushFailed(
                    f"uploading {failing[0].key} keeps failing: {failing[0].last_error}; "
                    f"{len(left)} file(s) not yet committed (the daemon keeps retrying)")
            if callable(on_progress):
                await on_progress(self.progress([cf for cf, _ in left], since=started))
            with trio.move_on_after(1.0):
                await self._changed.wait()
            for cf, _ in left:
                self.request_commit(cf)

    def progress(self, files: list[CachedFile], since: float = -math.inf) -> FlushProgress:
        """Bytes and files left, and the error of a file that failed `since` (monotonic):
        a flush started after S3 came back shows no error from before it (issue 29)."""
        bytes_left = sum(  # not yet sent; uploaded parts only wait for their Complete
            self.parts.held_bytes(i, cf.size)
            for cf in files for i, c in cf.chunks.items() if c.state in DIRTY_STATES)
        errors = [cf.last_error for cf in files
                  if cf.error_streak and cf.last_error_at >= since]
        return FlushProgress(len(files), bytes_left, errors[0] if errors else None)

    # -- S3 calls with error bookkeeping ---------------------------------------------

    async def _s3(self, cf: CachedFile, what: str, fn: object, *args: object) -> object:
        """An S3 call of a commit: its failed attempts show in status at once; the call
        counts as one failure of the file (`error_streak`, which fails a waiting flush
        after ERRORS_BEFORE_FLUSH_FAILS) once all its attempts failed."""
        def on_error(exc: Exception) -> None:
            _note_error(cf, str(exc))
            self._progress_changed()

        # A few quick attempts only: a commit holds the file's lock, which a rename needs;
        # the commit task itself backs off (without the lock) and tries again.
        try:
            result: object = await self.store.retrying(
                what, fn, *args, on_error=on_error,  # type: ignore[arg-type]
                max_attempts=COMMIT_ATTEMPTS)
        except NoSuchUpload:
            # most often a rename's abort of the upload this request was part of: not a
            # failure of the file (_forget_upload counts one where its upload vanished)
            raise
        except Exception:
            cf.error_streak += 1
            cf.error_count += 1
            raise
        cf.error_streak = 0
        cf.last_error = None
        return result

    def _metadata(self, cf: CachedFile) -> dict[str, str]:
        meta = encode_attrs(cf.mode, cf.uid, cf.gid, cf.mtime_ns, cf.rdev)
        if cf.symlink is not None:
            meta[META_SYMLINK] = "1"
        return meta

    async def _ensure_upload(self, cf: CachedFile) -> tuple[str, str]:
        """The file's open upload, created for its key now. A rename while the upload was
        being created (the rename found none to take off) leaves it at the old key: it
        is abandoned as the rename would have, and one is created for the new key."""
        async with cf.upload_lock:
            while True:
                if cf.upload_id is not None and cf.upload_key is not None:
                    if cf.upload_key == cf.key:
                        return cf.upload_key, cf.upload_id
                    await self.abandon_upload(cf)
                key = cf.key
                assert cf.fid is not None
                await self.journal(self.journal.sync.intend_upload, cf.fid, key)
                # S3 keeps the whole object's CRC-32C only if every part has one: not
                # where parts may be copied from a base object (UploadPartCopy)
                checksum = self.checksums.full_object and cf.base_key is None
                upload_id = await self._s3(cf, f"CreateMultipartUpload {key}",
                                           self.store.sync.create_multipart, key,
                                           self._metadata(cf), checksum)
                assert isinstance(upload_id, str) and cf.fid is not None
                cf.start_upload(upload_id, key, checksum)
                await self.journal(self.journal.sync.start_upload, cf.fid, upload_id, key,
                                   checksum)

    async def _forget_upload(self, cf: CachedFile) -> None:
        """An upload vanished (aborted elsewhere, expired): its parts go up again.

        Only if the file's current upload is the one gone: a request that raced with a
        rename's abort must not throw away the upload that replaced it.
        """
        upload_id, upload_key = cf.upload_id, cf.upload_key
        if upload_id is None or upload_key is None:
            return
        try:
            await self.store.call(self.store.sync.list_parts, upload_key, upload_id)
            return  # still there: the failure was an older upload's
        except NoSuchUpload:
            pass
        if cf.upload_id != upload_id:
            return
        log.warning("multipart upload of %s is gone; uploading its parts again", cf.key)
        cf.error_streak += 1
        cf.error_count += 1
        _note_error(cf, f"its multipart upload {upload_id} vanished from S3 (aborted or "
                        f"expired behind the mount)")
        await self.journal(self.journal.sync.end_upload, upload_id)
        cf.take_upload()
        self._uploaded_to_dirty(cf)
        assert cf.fid is not None
        await self.journal(self.journal.sync.forget_uploads, cf.fid)

    def _uploaded_to_dirty(self, cf: CachedFile) -> None:
        for idx, ch in cf.chunks.items():
            if ch.state is ChunkState.UPLOADED:
                self.cache.set_state(cf, ch, idx, ChunkState.DIRTY)

    # -- parts ------------------------------------------------------------------------

    async def _stream_part(self, cf: CachedFile, idx: int) -> None:
        try:
            await self._upload_chunk(cf, idx)
        except NoSuchUpload:
            await self._forget_upload(cf)
        except Exception as exc:  # never take the daemon down; the commit retries it
            self._background_failure(cf, f"upload of part {idx + 1}", exc)
            self.metrics[m.RETRIES] += 1  # (the part is still dirty: the commit sends it)

    def _background_failure(self, cf: CachedFile, what: str, exc: Exception) -> None:
        """A flusher task failed outside the S3 retry loop (e.g. a full journal disk)."""
        log.error("%s of %s failed: %s", what, cf.key, exc,
                  exc_info=not isinstance(exc, ObjectStoreError))
        cf.error_streak += 1
        cf.error_count += 1
        _note_error(cf, f"{what}: {exc}")
        self._progress_changed()

    async def _upload_chunk(self, cf: CachedFile, idx: int) -> None:
        """DIRTY -> UPLOADING -> UPLOADED, unless a write moved the chunk meanwhile."""
        ch = cf.chunks.get(idx)
        if ch is None or ch.state is not ChunkState.DIRTY or cf.unlinked:
            return
        start, end = self.parts.chunk_range(idx)
        end = min(end, cf.size)
        if end <= start:
            return
        self.cache.set_state(cf, ch, idx, ChunkState.UPLOADING)
        ch.settled = trio.Event()
        gen = ch.gen
        try:
            async with self._slots.hold(cf, cf in self._flushing):
                self.demand.in_flight += 1
                try:
                    key, upload_id = await self._ensure_upload(cf)
                    etag, crc = await self._send_part(cf, key, upload_id, idx, start, end)
                finally:
                    self.demand.in_flight -= 1
        except BaseException:
            if ch.state is ChunkState.UPLOADING:
                self.cache.set_state(cf, ch, idx, ChunkState.DIRTY)
            ch.settled.set()
            raise
        self.metrics[m.PARTS_UPLOADED] += 1
        self.metrics[m.BYTES_UPLOADED] += end - start
        current = cf.upload_id == upload_id  # not aborted by a rename meanwhile
        if (ch.gen == gen and ch.state is ChunkState.UPLOADING and cf.chunks.get(idx) is ch
                and current):
            self.cache.set_state(cf, ch, idx, ChunkState.UPLOADED)
            ch.etag, ch.length, ch.sent_crc = str(etag), end - start, crc
            assert cf.fid is not None
            await self.journal(self.journal.sync.mark_uploaded, cf.fid, idx, str(etag), crc)
        elif ch.state is ChunkState.UPLOADING:
            self.cache.set_state(cf, ch, idx, ChunkState.DIRTY)  # changed meanwhile: again
        ch.settled.set()
        self._progress_changed()

    async def _send_part(self, cf: CachedFile, key: str, upload_id: str, idx: int,
                         start: int, end: int) -> tuple[str, int | None]:
        """UploadPart of bytes [start, end) of the cache file, streamed in 1 MiB pieces
        (bounded memory whatever the part size); its ETag and the CRC-32C of what it sent.
        The store declares that CRC to S3 (s3/checksums) only in an upload created with
        a checksum type: AWS refuses a part's checksum in an upload created without one
        ("Checksum Type mismatch"), which the probe not yet done at the upload's start,
        a base object to copy parts from, or an older journal make."""
        what = f"UploadPart {key} #{idx + 1}"
        bodies: list[CachePartBody] = []
        declare = cf.upload_checksum and cf.upload_id == upload_id
        async with self.cache.part_reader(cf, start, end) as source:
            def send() -> str:  # a fresh body for every attempt
                body = CachePartBody(source, start, end - start)
                bodies[:] = [body]
                return self.store.sync.upload_part(  # file-like, and a PiecewiseBody
                    key, upload_id, idx + 1, body, declare)  # type: ignore[arg-type]

            etag = str(await self._s3(cf, what, send))
        return etag, bodies[-1].sent_crc

    async def _part_for_commit(self, cf: CachedFile, idx: int, size: int, version: int,
                               key: str, upload_id: str) -> tuple[int, str, int | None]:
        """The number, ETag and CRC-32C (None if not known) of part idx+1 holding bytes
        of chunk idx up to `size` (of `version`)."""
        start, end = self.parts.chunk_range(idx)
        end = min(end, size)
        while True:
            ch = cf.chunks.get(idx)
            if ch is not None and ch.state is ChunkState.UPLOADING and ch.settled is not None:
                await ch.settled.wait()
                continue
            if (ch is not None and ch.state is ChunkState.UPLOADED and ch.length == end - start
                    and (ch.sent_crc is not None or not cf.upload_checksum)
                    and not await self._stale(cf, idx, ch)):
                assert ch.etag is not None
                return idx + 1, ch.etag, ch.sent_crc
            in_base = cf.base_key is not None and end <= cf.base_size
            if (ch is None or ch.state is ChunkState.CLEAN) and in_base:
                assert cf.base_key is not None
                async with self._slots.hold(cf, cf in self._flushing):
                    etag = await self._s3(cf, f"UploadPartCopy {key} #{idx + 1}",
                                          self.store.sync.upload_part_copy, key, upload_id,
                                          idx + 1, cf.base_key, start, end)
                self.metrics[m.PARTS_COPIED] += 1
                return idx + 1, str(etag), None
            if cf.version != version or cf.unlinked:
                raise CommitSuperseded  # what this part should hold is no longer cached
            if ch is None or ch.state in (ChunkState.CLEAN, ChunkState.UPLOADED):
                # A hole, a part of another length, of older bytes or of no known CRC in
                # an upload that needs it: the cached bytes go up as they are.
                await self.cache.mark_dirty(cf, [idx], None)
            await self._upload_chunk(cf, idx)

    async def _stale(self, cf: CachedFile, idx: int, ch: Chunk) -> bool:
        """An uploaded part a passthrough writer may have changed since (`Chunk.verify`):
        True unless its CRC-32C still matches the cache file."""
        if not ch.verify:
            return False
        ch.verify = False
        start = self.parts.chunk_range(idx)[0]
        return (ch.sent_crc is None
                or await self.cache.cached_crc(cf, start, start + ch.length) != ch.sent_crc)

    # -- commits ----------------------------------------------------------------------

    async def _commit_task(self, cf: CachedFile) -> None:
        failed = False
        try:
            while self.gate is not None and self.gate.busy(cf.key):
                await self.gate.wait_clear(cf.key)  # (a rename may change the key)
            async with self._commit_slots.hold(cf, cf in self._flushing), cf.commit_lock:
                while True:
                    if self.gate is not None and self.gate.busy(cf.key):
                        break  # a change of its name came first: re-requested below
                    try:
                        await self._commit(cf)
                        break
                    except NoSuchUpload:
                        await self._forget_upload(cf)
                    except CommitSuperseded:
                        break  # re-requested below once the file is closed again
                    except NoSuchKey:
                        if not await self._base_vanished(cf):
                            raise
                        break
        except Exception as exc:
            failed = True
            self._background_failure(cf, "commit", exc)
        finally:
            self._committing.discard(cf)
            if cf in self._commit_wanted:  # requested meanwhile: it may start now
                self._queue_due(cf, self._commit_wanted[cf])
            self._progress_changed()
        if failed:  # the commit is tried again after this: a retry too
            self.metrics[m.RETRIES] += 1
            await self.store.backoff(min(30.0, 0.5 * 2 ** min(cf.error_streak, 6)))
        if cf.pending and cf.writers == 0 and cf.committed_version < cf.version:
            self.request_commit(cf)

    async def _commit(self, cf: CachedFile) -> None:
        if not cf.pending or cf.unlinked:
            return
        written = self.cache.passthrough.size_now(cf) if cf.pt_writers else cf.size
        if written > MAX_OBJECT_SIZE:  # grown there by a passthrough writer: the daemon
            # saw no write to refuse with EFBIG. Kept, and flush says why it cannot finish.
            raise ObjectStoreError(f"{cf.key} is {written} bytes, larger than S3's largest "
                                   "object (5 TiB): truncate it below that, or remove it")
        if cf.pt_writers:  # the kernel writes it directly: commit what it holds now
            await self.cache.passthrough.sync(cf)
        version, size, seen_gen = cf.version, cf.size, cf.intent_gen
        meta = self._metadata(cf)
        nchunks = self.parts.chunk_count(size)
        started = time.monotonic()
        pending_idx = [i for i, c in cf.chunks.items() if c.state in PENDING_STATES]
        attrs_only = (not pending_idx and cf.base_key == cf.key and size == cf.base_size
                      and cf.upload_id is None and cf.symlink is None)
        crc: int | None = None  # of the new object, where known
        if cf.symlink is not None:
            body = cf.symlink.encode()
            size = len(body)  # the object's size, as listings show it (the index checks it)
            crc = crc32c.crc32c(body) if self.checksums.send else None
            etag = await self._s3(cf, f"PutObject {cf.key}", self.store.sync.put,
                                  cf.key, body, meta, crc)
            self.metrics[m.OBJECTS_PUT] += 1
            committed: list[int] = []
        elif attrs_only and size > 0:
            etag = await self._s3(cf, f"CopyObject {cf.key}", self.store.sync.copy,
                                  cf.key, cf.key, meta)
            self.metrics[m.SERVER_SIDE_COPIES] += 1
            committed = []
            if cf.committed_crc is not None and cf.committed_crc[0] == cf.base_etag:
                crc = cf.committed_crc[1]  # the same bytes
        elif nchunks <= 1:
            if cf.upload_id is not None:
                await self._abort_upload(cf)
            sent = {i: (c, c.gen) for i, c in cf.chunks.items() if c.state in PENDING_STATES}
            key = cf.key
            declare = self.checksums.send
            crcs: list[int] = []
            async with (self._slots.hold(cf, cf in self._flushing),
                        self.cache.part_reader(cf, 0, size) as source):
                def put() -> str:  # the file is read here too, not in the trio loop
                    data = source.read(0, size)
                    crcs[:] = [crc32c.crc32c(data)] if declare else []
                    return self.store.sync.put(key, data, meta, crcs[0] if crcs else None)

                etag = await self._s3(cf, f"PutObject {key}", put)
            crc = crcs[0] if crcs else None
            self.metrics[m.OBJECTS_PUT] += 1
            self.metrics[m.BYTES_UPLOADED] += size
            committed = []
            for i, (ch, gen) in sent.items():
                if cf.chunks.get(i) is ch and ch.gen == gen and ch.state is ChunkState.DIRTY:
                    self.cache.set_state(cf, ch, i, ChunkState.UPLOADED)  # made clean below
                    committed.append(i)
        else:
            key, upload_id = await self._ensure_upload(cf)
            results: dict[int, tuple[str, int | None]] = {}

            async def one(idx: int) -> None:
                number, etag, part_crc = await self._part_for_commit(cf, idx, size, version,
                                                                     key, upload_id)
                results[number] = etag, part_crc

            try:
                async with trio.open_nursery() as nursery:
                    for idx in range(nchunks):
                        nursery.start_soon(one, idx)
            except ExceptionGroup as group:  # NoSuchUpload, CommitSuperseded: see the caller
                raise group.exceptions[0] from group
            parts = [(n, etag) for n, (etag, _) in sorted(results.items())]
            crc = self._full_crc([c for _, (_, c) in sorted(results.items())], size)
            listed = ([c for _, (_, c) in sorted(results.items())]  # (all known: see above)
                      if cf.upload_checksum else None)
            etag = await self._s3(cf, f"CompleteMultipartUpload {key}",
                                  self.store.sync.complete_multipart, key, upload_id, parts,
                                  listed, crc if cf.upload_checksum else None)
            self.metrics[m.UPLOADS_COMPLETED] += 1
            await self.journal(self.journal.sync.end_upload, upload_id)
            cf.take_upload()
            committed = [i for i in range(nchunks)]
        for i in committed:
            self.cache.chunk_committed(cf, i)
        self._uploaded_to_dirty(cf)  # parts of an upload that no longer exists
        cf.base_key, cf.base_size, cf.base_etag = cf.key, size, str(etag)
        cf.committed_crc = None if crc is None else (str(etag), crc)
        cf.s3_meta = meta
        keep = cf.version != version or any(
            c.state in PENDING_STATES for c in cf.chunks.values())
        assert cf.fid is not None
        kept = await self.journal(self.journal.sync.finish_commit, cf.fid, committed, keep,
                                  cf.key, size, seen_gen, self.cache.clean_note(cf), crc)
        # An intent that raced with finish_commit kept (or re-created) the row.
        cf.in_journal = kept or cf.version != version or any(
            c.state in PENDING_STATES for c in cf.chunks.values())
        cf.committed_version = version
        if cf.unlinked and cf.in_journal:  # unlinked while this commit ran (its DELETE
            await self.journal(self.journal.sync.drop_file, cf.fid)  # waited for it)
            cf.in_journal = False
        self.metrics[m.FILES_COMMITTED] += 1
        self.on_committed(cf)
        log.debug("committed %s (%d bytes) in %.2f s", cf.key, size, time.monotonic() - started)

    def _full_crc(self, crcs: list[int | None], size: int) -> int | None:
        """The whole object's CRC-32C from its parts' (None unless all are known)."""
        total = 0
        for idx, part_crc in enumerate(crcs):
            if part_crc is None:
                return None
            start, end = self.parts.chunk_range(idx)
            total = crc32c_combine(total, part_crc, min(end, size) - start)
        return total

    async def _base_vanished(self, cf: CachedFile) -> bool:
        """The object holding the unchanged bytes is gone: deleted (an unlink that crashed
        half-way, D15) or by another node. The file's pending state goes with it."""
        if cf.base_key is None or await self.store.head(cf.base_key) is not None:
            return False
        log.error("%s: its committed object %s was deleted; dropping its pending changes",
                  cf.key, cf.base_key)
        await self.cache.discard(cf)
        cf.unlinked = False
        return True

    async def abandon_upload(self, cf: CachedFile) -> None:
        """A rename of a file whose upload is open at the old key: the parts go again, to
        the new key, from the cache. The upload is aborted in the background (a rename
        never waits for S3); nothing is ever completed at the old name."""
        if cf.upload_id is not None:
            self.cache.detach_upload(cf)
            self._uploaded_to_dirty(cf)
            assert cf.fid is not None
            await self.journal(self.journal.sync.forget_uploads, cf.fid)

    async def _abort_upload(self, cf: CachedFile) -> None:
        assert cf.upload_id is not None and cf.upload_key is not None
        await self._s3(cf, f"AbortMultipartUpload {cf.upload_key}",
                       self.store.sync.abort_multipart, cf.upload_key, cf.upload_id)
        await self.journal(self.journal.sync.end_upload, cf.upload_id)
        cf.take_upload()
        self._uploaded_to_dirty(cf)
        assert cf.fid is not None
        await self.journal(self.journal.sync.forget_uploads, cf.fid)

    def status(self) -> dict[str, object]:
        return {
            "uploads_in_flight": self.demand.in_flight,
            "files_committing": len(self._committing),
            "parts_queued": len(self._part_queue),
            "checksums": self.checksums.describe(),
        }

"""A file's way into S3 as a multipart upload: the upload itself and its parts.

The upload is created for the file's current key (and abandoned, aborted in the
background, when a rename moves the file); parts stream while the file is written, a
commit takes each part as uploaded, copies it from the base object (UploadPartCopy) or
sends it again. S3 calls made for a file count against it (`errors.streak`), which is how
a flush learns that a file keeps failing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from lakefs_mount import metrics as m
from lakefs_mount.cache.cachefile import CachedFile, Chunk, ChunkState, SpilledPart
from lakefs_mount.cache.manager import CacheManager
from lakefs_mount.cache.partbody import CachePartBody
from lakefs_mount.cache.slots import Slots
from lakefs_mount.s3.checksums import ChecksumUse
from lakefs_mount.s3.crc import crc32c_combine, crc32c_of
from lakefs_mount.s3.layout import (
    META_PARTS,
    META_SYMLINK,
    META_WRITER,
    encode_attrs,
    writer_tag,
)
from lakefs_mount.s3.objectstore import NoSuchUpload, ObjectStoreError, PartCopyUnsupported
from lakefs_mount.s3.parttable import PartTable, new_table_key

log = logging.getLogger(__name__)

COMMIT_ATTEMPTS = 3  # per S3 call inside one commit attempt


class PartChanged(Exception):
    """S3 refused a part (BadDigest) because a write changed the chunk while it was sent:
    not an S3 error; the chunk is dirty again and goes up later."""


class CommitSuperseded(Exception):
    """The file changed while its commit ran, and the commit would need bytes of the
    version it started with: it gives way, and the next commit takes the new content."""


class Uploads:
    def __init__(self, cache: CacheManager, slots: Slots, urgent: Callable[[CachedFile], bool],
                 checksums: ChecksumUse, on_progress: Callable[[], None],
                 writer: str = "", prefix: str = "") -> None:
        self.cache = cache
        self.demand = cache.demand
        self.store = cache.store
        self.journal = cache.journal
        self.parts = cache.parts
        self.metrics = cache.metrics
        self.slots = slots
        self.urgent = urgent  # a flush waits for the file: its S3 calls go first
        self.checksums = checksums
        self.on_progress = on_progress
        self.writer = writer  # this cache's name in its objects' META_WRITER ("": none)
        self.prefix = prefix  # the mount's: its tables of part CRCs go under it
        self.copies_parts = True  # UploadPartCopy works here (until an answer says not)

    async def call(self, cf: CachedFile, what: str, fn: object, *args: object,
                   places_object: bool = False) -> object:
        """An S3 call of a commit: its failed attempts show in status at once; the call
        counts as one failure of the file (`errors.streak`, which fails a waiting flush
        after ERRORS_BEFORE_FLUSH_FAILS) once all its attempts failed. `places_object`:
        the call puts an object at the file's key; an attempt S3 never answered may still
        do so (`commit_unknown`)."""
        def on_error(exc: Exception) -> None:
            cf.errors.note(str(exc))
            if places_object and getattr(exc, "status", None) is None:
                cf.commit_answer_lost()
            self.on_progress()

        # A few quick attempts only: a commit holds the file's lock, which a rename needs;
        # the commit task itself backs off (without the lock) and tries again.
        try:
            result: object = await self.store.retrying(
                what, fn, *args, on_error=on_error,  # type: ignore[arg-type]
                max_attempts=COMMIT_ATTEMPTS)
        except (NoSuchUpload, PartChanged, PartCopyUnsupported):
            # most often a rename's abort of the upload this request was part of: not a
            # failure of the file (`forget` counts one where its upload vanished); or a
            # write changed the part on its way; or the endpoint copies no parts (sent)
            raise
        except Exception:
            cf.errors.failed()
            raise
        cf.errors.succeeded()
        return result

    def metadata(self, cf: CachedFile) -> dict[str, str]:
        meta = encode_attrs(cf.mode, cf.uid, cf.gid, cf.mtime_ns, cf.rdev, cf.atime_ns,
                            cf.ctime_ns)
        if cf.symlink is not None:
            meta[META_SYMLINK] = "1"
        if self.writer and cf.fid is not None:
            meta[META_WRITER] = writer_tag(self.writer, cf.fid)
        return meta

    async def ensure(self, cf: CachedFile) -> tuple[str, str]:
        """The file's open upload, created for its key now. A rename while the upload was
        being created (the rename found none to take off) leaves it at the old key: it
        is abandoned as the rename would have, and one is created for the new key. A
        removal meanwhile leaves it to nobody: it is aborted, and NoSuchUpload stops the
        part (its callers take that as the upload gone)."""
        async with cf.upload_lock:
            while True:
                if cf.unlinked:  # removed while this part waited, or while S3 created the
                    # upload below (the removal found none to abort): nothing goes up
                    self.cache.detach_upload(cf)  # (aborted in the background)
                    raise NoSuchUpload(f"{cf.key} was removed; its upload is not needed")
                if cf.upload.id is not None and cf.upload.key is not None:
                    if cf.upload.key == cf.commit_key():  # (a rename may have kept it)
                        return cf.upload.key, cf.upload.id
                    await self.abandon(cf)
                key = cf.key
                assert cf.fid is not None
                await self.journal(self.journal.sync.intend_upload, cf.fid, key)
                # S3 keeps the whole object's CRC-32C only if every part has one: not
                # where parts may be copied from a base object or spilled parts
                # (UploadPartCopy; a part that spills later gives its CRC with it)
                checksum = (self.checksums.full_object and cf.base.key is None
                            and not cf.spills)
                table = new_table_key(self.prefix)  # written with the Complete
                upload_id = await self.call(cf, f"CreateMultipartUpload {key}",
                                           self.store.sync.create_multipart, key,
                                           {**self.metadata(cf), META_PARTS: table}, checksum)
                assert isinstance(upload_id, str) and cf.fid is not None
                cf.start_upload(upload_id, key, checksum, table)
                await self.journal(self.journal.sync.start_upload, cf.fid, upload_id, key,
                                   checksum, table)

    async def forget(self, cf: CachedFile) -> None:
        """An upload vanished (aborted elsewhere, expired): its parts go up again.

        Only if the file's current upload is the one gone: a request that raced with a
        rename's abort must not throw away the upload that replaced it.
        """
        upload_id, upload_key = cf.upload.id, cf.upload.key
        if upload_id is None or upload_key is None:
            return
        try:
            await self.store.call(self.store.sync.list_parts, upload_key, upload_id)
            return  # still there: the failure was an older upload's
        except NoSuchUpload:
            pass
        if cf.upload.id != upload_id:
            return
        log.warning("multipart upload of %s is gone; uploading its parts again", cf.key)
        cf.errors.failed(f"its multipart upload {upload_id} vanished from S3 (aborted or expired "
                  "behind the mount)")
        await self.journal(self.journal.sync.end_upload, upload_id)
        cf.take_upload()
        self.uploaded_to_dirty(cf)
        assert cf.fid is not None
        await self.journal(self.journal.sync.forget_uploads, cf.fid)

    def uploaded_to_dirty(self, cf: CachedFile) -> None:
        for idx, ch in cf.chunks.items():
            if ch.state is ChunkState.UPLOADED:
                self.cache.book.set_state(cf, ch, idx, ChunkState.DIRTY)

    async def stream_part(self, cf: CachedFile, idx: int) -> None:
        try:
            await self.upload_chunk(cf, idx, may_spill=True)
        except NoSuchUpload:
            await self.forget(cf)
        except Exception as exc:  # never take the daemon down; the commit retries it
            self.background_failure(cf, f"upload of part {idx + 1}", exc)
            self.metrics[m.RETRIES] += 1  # (the part is still dirty: the commit sends it)

    def background_failure(self, cf: CachedFile, what: str, exc: Exception) -> None:
        """A flusher task failed outside the S3 retry loop (e.g. a full journal disk)."""
        log.error("%s of %s failed: %s", what, cf.key, exc,
                  exc_info=not isinstance(exc, ObjectStoreError))
        cf.errors.failed(f"{what}: {exc}")
        self.on_progress()

    async def upload_chunk(self, cf: CachedFile, idx: int, may_spill: bool = False) -> None:
        """DIRTY -> UPLOADING -> UPLOADED, unless a write moved the chunk meanwhile; with
        `may_spill` (a part streamed while the file is written), to CLEAN as a spilled
        part where the cache is short of room (cache/spills)."""
        ch = cf.chunks.get(idx)
        if ch is None or ch.state is not ChunkState.DIRTY or cf.unlinked:
            return
        start, chunk_end = self.parts.chunk_range(idx)
        end = min(chunk_end, cf.size)
        if end <= start:
            return
        if may_spill and end == chunk_end and self.cache.spills.wanted(cf, end - start):
            await self._spill_chunk(cf, idx, ch, start, end)
            return
        self.cache.book.set_state(cf, ch, idx, ChunkState.UPLOADING)
        ch.settled = trio.Event()
        ch.reading = False
        gen = ch.gen
        try:
            async with self.slots.hold(cf, self.urgent(cf)):
                ch.reading = True
                self.demand.in_flight += 1
                try:
                    key, upload_id = await self.ensure(cf)
                    # (a write under way has not moved the gen yet, a passthrough writer
                    # never does, a truncate drops the chunk: each may be what changed
                    # the bytes S3 refused)
                    etag, crc = await self._send_part(
                        cf, key, upload_id, idx, start, end,
                        lambda: (ch.gen != gen or cf.chunks.get(idx) is not ch
                                 or cf.writes.in_flight > 0 or cf.pt.writers > 0))
                finally:
                    self.demand.in_flight -= 1
        except BaseException as exc:
            if ch.state is ChunkState.UPLOADING:
                self.cache.book.set_state(cf, ch, idx, ChunkState.DIRTY)
            ch.settled.set()
            if not isinstance(exc, PartChanged):
                raise
            log.debug("part %d of %s changed while it was sent; it goes again", idx + 1, cf.key)
            return
        self.metrics[m.PARTS_UPLOADED] += 1
        self.metrics[m.BYTES_UPLOADED] += end - start
        current = cf.upload.id == upload_id  # not aborted by a rename meanwhile
        if (ch.gen == gen and ch.state is ChunkState.UPLOADING and cf.chunks.get(idx) is ch
                and current):
            self.cache.book.set_state(cf, ch, idx, ChunkState.UPLOADED)
            ch.etag, ch.length, ch.sent_crc = str(etag), end - start, crc
            assert cf.fid is not None
            await self.journal(self.journal.sync.mark_uploaded, cf.fid, idx, str(etag), crc)
        elif ch.state is ChunkState.UPLOADING:
            self.cache.book.set_state(cf, ch, idx, ChunkState.DIRTY)  # changed meanwhile: again
        ch.settled.set()
        self.on_progress()

    async def _spill_chunk(self, cf: CachedFile, idx: int, ch: Chunk, start: int,
                           end: int) -> None:
        """DIRTY -> UPLOADING -> CLEAN: the chunk's bytes as its spilled part (a
        PutObject with their CRC-32C), unless a write moved the chunk meanwhile."""
        assert cf.fid is not None
        self.cache.book.set_state(cf, ch, idx, ChunkState.UPLOADING)
        ch.settled = trio.Event()
        ch.reading = False
        token = self.cache.spills.new_token()
        gen, key = ch.gen, self.cache.spills.key(cf.fid, idx, token)
        try:
            async with self.slots.hold(cf, self.urgent(cf)):
                ch.reading = True
                self.demand.in_flight += 1
                try:
                    bodies: list[CachePartBody] = []
                    declare = self.checksums.send
                    async with self.cache.reader.part_reader(cf, start, end) as source:
                        def send() -> str:  # a fresh body for every attempt
                            body = CachePartBody(source, start, end - start)
                            bodies[:] = [body]
                            return self.store.sync.put_body(key, body, declare)  # type: ignore[arg-type]

                        etag = str(await self.call(cf, f"PutObject {key}", send))
                finally:
                    self.demand.in_flight -= 1
        except BaseException:
            if ch.state is ChunkState.UPLOADING:
                self.cache.book.set_state(cf, ch, idx, ChunkState.DIRTY)
            ch.settled.set()
            raise
        self.metrics[m.PARTS_SPILLED] += 1
        self.metrics[m.BYTES_UPLOADED] += end - start
        if ch.gen == gen and ch.state is ChunkState.UPLOADING and cf.chunks.get(idx) is ch:
            crc = bodies[-1].sent_crc
            # (at once, as upload_chunk marks a part uploaded: a write from here on makes
            # the chunk dirty again, journalled after this row; kept until the row is
            # written, so no hole is punched where the journal still says dirty)
            with self.cache.book.pinned(cf, [idx]):
                self.cache.book.set_state(cf, ch, idx, ChunkState.CLEAN)
                cf.spills[idx] = SpilledPart(token, etag, end - start, crc)
                self.cache.book.on_uploaded(cf, ch.held)
                await self.journal(self.journal.sync.mark_spilled, cf.fid, idx, token, etag,
                                   crc)
        elif ch.state is ChunkState.UPLOADING:
            self.cache.book.set_state(cf, ch, idx, ChunkState.DIRTY)  # changed meanwhile: again
        ch.settled.set()
        self.on_progress()

    async def _send_part(self, cf: CachedFile, key: str, upload_id: str, idx: int,
                         start: int, end: int, changed: Callable[[], bool]
                         ) -> tuple[str, int | None]:
        """UploadPart of bytes [start, end) of the cache file, streamed in 1 MiB pieces
        (bounded memory whatever the part size); its ETag and the CRC-32C of what it sent.
        The store declares that CRC to S3 (s3/checksums) only in an upload created with
        a checksum type: AWS refuses a part's checksum in an upload created without one
        ("Checksum Type mismatch"), which the probe not yet done at the upload's start,
        a base object to copy parts from, or an older journal make."""
        what = f"UploadPart {key} #{idx + 1}"
        bodies: list[CachePartBody] = []
        declare = cf.upload.checksum and cf.upload.id == upload_id
        async with self.cache.reader.part_reader(cf, start, end) as source:
            def send() -> str:  # a fresh body for every attempt
                body = CachePartBody(source, start, end - start)
                bodies[:] = [body]
                try:
                    return self.store.sync.upload_part(  # file-like, and a PiecewiseBody
                        key, upload_id, idx + 1, body, declare)  # type: ignore[arg-type]
                except ObjectStoreError as exc:
                    if exc.code == "BadDigest" and changed():  # (a write, not the network)
                        raise PartChanged from exc
                    raise

            etag = str(await self.call(cf, what, send))
        return etag, bodies[-1].sent_crc

    async def part_for_commit(self, cf: CachedFile, idx: int, size: int, version: int,
                               key: str, upload_id: str
                               ) -> tuple[int, str, int | None, SpilledPart | None]:
        """The number, ETag and CRC-32C (None if not known) of part idx+1 holding bytes
        of chunk idx up to `size` (of `version`), and the spilled part it copied, if any."""
        start, end = self.parts.chunk_range(idx)
        end = min(end, size)
        while True:
            ch = cf.chunks.get(idx)
            if ch is not None and ch.state is ChunkState.UPLOADING and ch.settled is not None:
                await ch.settled.wait()
                continue
            if (ch is not None and ch.state is ChunkState.UPLOADED and ch.length == end - start
                    and (ch.sent_crc is not None or not cf.upload.checksum)
                    and not await self._stale(cf, idx, ch)):
                assert ch.etag is not None
                return idx + 1, ch.etag, ch.sent_crc, None
            spilled = cf.spills.get(idx)  # (else the bytes not cached are the base's)
            in_base = spilled is None and cf.base.key is not None and end <= cf.base.size
            if (ch is None or ch.state is ChunkState.CLEAN) and (in_base or spilled is not None):
                whole_spill = spilled is not None and spilled.length == end - start
                if self.copies_parts and (in_base or whole_spill):
                    if in_base:
                        assert cf.base.key is not None
                        src, at = cf.base.key, start
                    else:
                        assert spilled is not None
                        src, at = self.cache.spills.part_key(cf, idx, spilled), 0
                    try:
                        async with self.slots.hold(cf, self.urgent(cf)):
                            etag = await self.call(
                                cf, f"UploadPartCopy {key} #{idx + 1}",
                                self.store.sync.upload_part_copy, key, upload_id, idx + 1,
                                src, at, at + end - start)
                        self.metrics[m.PARTS_COPIED] += 1
                        return idx + 1, str(etag), None if spilled is None else spilled.crc, spilled
                    except PartCopyUnsupported as exc:
                        if self.copies_parts:
                            self.copies_parts = False
                            log.warning("%s; unchanged parts are fetched and sent instead "
                                        "from now on", exc)
                        # (the endpoint may have taken the copy for an empty part, which it
                        # will not let be replaced: the upload starts again)
                        if cf.upload.id == upload_id:
                            await self.abandon(cf)
                        raise CommitSuperseded from None
                with self.cache.book.pinned(cf, [idx]):  # its bytes from S3, then up
                    await self.cache.fetcher.ensure_chunk(cf, idx)
                    await self.cache.writer.mark_dirty(cf, [idx], None)
                await self.upload_chunk(cf, idx)
                continue
            if cf.version != version or cf.unlinked:
                raise CommitSuperseded  # what this part should hold is no longer cached
            if ch is None or ch.state in (ChunkState.CLEAN, ChunkState.UPLOADED):
                # A hole, a part of another length, of older bytes or of no known CRC in
                # an upload that needs it: the cached bytes go up as they are.
                await self.cache.writer.mark_dirty(cf, [idx], None)
            await self.upload_chunk(cf, idx)

    async def _stale(self, cf: CachedFile, idx: int, ch: Chunk) -> bool:
        """An uploaded part a passthrough writer may have changed since (`Chunk.verify`):
        True unless its CRC-32C still matches the cache file."""
        if not ch.verify:
            return False
        ch.verify = False  # (before the look: a take-over meanwhile sets it again)
        start = self.parts.chunk_range(idx)[0]
        stale = (ch.sent_crc is None
                 or await self.cache.cached_crc(cf, start, start + ch.length) != ch.sent_crc)
        if stale:  # still to check if this commit is superseded before it sends it again:
            ch.verify = True  # the next one would have taken the old part as it is
        return stale

    async def complete(self, cf: CachedFile, key: str, upload_id: str,
                       parts: list[tuple[int, str]], crcs: list[int | None],
                       full_crc: int | None, size: int) -> str:
        """CompleteMultipartUpload (with every part's CRC and the whole object's, where
        the upload was created to need them), and meanwhile the PUT of the table of the
        parts' CRCs that the object's metadata names."""
        checksum = cf.upload.checksum  # (then every CRC is known: see part_for_commit)
        async with trio.open_nursery() as nursery:
            if cf.upload.table is not None:
                nursery.start_soon(self._put_table, cf, cf.upload.table, crcs, size)
            etag = await self.call(
                cf, f"CompleteMultipartUpload {key}", self.store.sync.complete_multipart, key,
                upload_id, parts, crcs if checksum else None, full_crc if checksum else None,
                places_object=True)
        return str(etag)

    async def _put_table(self, cf: CachedFile, table_key: str, crcs: list[int | None],
                         size: int) -> None:
        """The table of the parts' CRCs (those copied server-side from the base object
        taken from its table, where this mount holds it). Tried as long as S3's failures
        are transient, as the commit's own requests are (three attempts left a table
        unwritten in a 503 storm); one S3 refuses for good (a policy that denies the key)
        only leaves the object's parts unchecked when read: the commit goes on."""
        base = self.cache.fetcher.tables.known(
            None if cf.base.meta is None else cf.base.meta.get(META_PARTS))
        if base is not None:
            crcs = [base.crc_of(i, cf.base.size, self.parts.part_size) if c is None else c
                    for i, c in enumerate(crcs)]
        table = PartTable(size, self.parts.part_size, tuple(crcs))
        self.cache.fetcher.tables.keep(table_key, table)
        body = table.encode()
        declared = crc32c_of(body) if self.checksums.send else None
        try:
            await self.store.retrying(f"PUT {table_key}", self.store.sync.put, table_key,
                                      body, {}, declared, transient_only=True)
        except ObjectStoreError as exc:
            log.warning("%s: its table of part CRCs %s was not written (%s): its parts "
                        "will be read without a check", cf.key, table_key, exc)

    def full_crc(self, crcs: list[int | None], size: int) -> int | None:
        """The whole object's CRC-32C from its parts' (None unless all are known)."""
        total = 0
        for idx, part_crc in enumerate(crcs):
            if part_crc is None:
                return None
            start, end = self.parts.chunk_range(idx)
            total = crc32c_combine(total, part_crc, min(end, size) - start)
        return total

    async def abandon(self, cf: CachedFile) -> None:
        """A rename of a file whose upload is open at the old key: the parts go again, to
        the new key, from the cache. The upload is aborted in the background (a rename
        never waits for S3); nothing is ever completed at the old name."""
        if cf.upload.id is not None:
            self.cache.detach_upload(cf)
            self.uploaded_to_dirty(cf)
            assert cf.fid is not None
            await self.journal(self.journal.sync.forget_uploads, cf.fid)

    async def abort(self, cf: CachedFile) -> None:
        assert cf.upload.id is not None and cf.upload.key is not None
        await self.call(cf, f"AbortMultipartUpload {cf.upload.key}",
                       self.store.sync.abort_multipart, cf.upload.key, cf.upload.id)
        await self.journal(self.journal.sync.end_upload, cf.upload.id)
        cf.take_upload()
        self.uploaded_to_dirty(cf)
        assert cf.fid is not None
        await self.journal(self.journal.sync.forget_uploads, cf.fid)

"""Mount-time recovery: every file the journal calls pending goes back into the flusher.

Idempotent: running it twice (a crash during recovery) does the same work again and
ends in the same S3 state. The rows of docs/durability.md name what each step repairs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from lakefs_mount import metrics as m
from lakefs_mount.cache.cachefile import (
    CachedFile,
    Chunk,
    ChunkState,
    CommittedBase,
    OpenUpload,
    SpilledPart,
)
from lakefs_mount.cache.journalschema import CHUNK_UPLOADED, INTENT, PendingFile
from lakefs_mount.cache.manager import CacheManager
from lakefs_mount.s3.objectstore import NoSuchUpload

log = logging.getLogger(__name__)


@dataclass
class RecoveryReport:
    files: int = 0
    dirty_chunks: int = 0
    uploaded_parts_kept: int = 0
    uploads_restarted: int = 0
    orphan_uploads_aborted: int = 0
    missing_cache_files: int = 0
    spilled_parts_kept: int = 0
    spilled_parts_swept: int = 0

    def describe(self) -> str:
        return (f"recovered {self.files} file(s) with {self.dirty_chunks} dirty chunk(s); "
                f"kept {self.uploaded_parts_kept} uploaded part(s); restarted "
                f"{self.uploads_restarted} upload(s); aborted {self.orphan_uploads_aborted} "
                f"orphan upload(s); kept {self.spilled_parts_kept} spilled part(s), deleted "
                f"{self.spilled_parts_swept} no longer needed")


async def recover(cache: CacheManager) -> tuple[list[CachedFile], RecoveryReport]:
    """Rebuild the pending files from the journal; the caller attaches and commits them."""
    journal, store = cache.journal, cache.store
    report = RecoveryReport()
    referenced = {rec.upload_id for rec in await journal(journal.sync.pending_files)}
    for key, upload_id in await journal(journal.sync.orphan_uploads):
        # D4: created and recorded, but no file needs it (crash after completion or unlink).
        # D5: an intent: the crash hid the id S3 chose, so every unreferenced upload of
        # exactly this key goes (writers on other nodes write other keys).
        if upload_id.startswith(INTENT):
            open_uploads = await store.retrying(
                f"ListMultipartUploads {key}", store.sync.list_multipart_uploads, key)
            doomed = [u.upload_id for u in open_uploads
                      if u.key == key and u.upload_id not in referenced]
        else:
            doomed = [upload_id]
        for doomed_id in doomed:
            await store.retrying(f"AbortMultipartUpload {key}", store.sync.abort_multipart,
                                 key, doomed_id)
            report.orphan_uploads_aborted += 1
            cache.metrics[m.ORPHAN_UPLOADS_ABORTED] += 1
        await journal(journal.sync.end_upload, upload_id)
    files = []
    for rec in await journal(journal.sync.pending_files):
        if not cache.cachefiles.path(rec.fid).exists():
            log.error("journal names %s but its cache file %s is gone; its unflushed data "
                      "is lost", rec.key, cache.cachefiles.path(rec.fid))
            report.missing_cache_files += 1
            if rec.upload_id is not None and rec.upload_key is not None:
                await store.retrying(f"AbortMultipartUpload {rec.upload_key}",
                                     store.sync.abort_multipart, rec.upload_key, rec.upload_id)
                await journal(journal.sync.end_upload, rec.upload_id)
            await journal(journal.sync.drop_file, rec.fid)
            continue
        cf = await _restore_file(cache, rec, report)
        files.append(cf)
        report.files += 1
    # (before any part spills again: every object there that no row names is garbage)
    report.spilled_parts_swept = await cache.spills.sweep(
        {cache.spills.part_key(cf, i, p) for cf in files for i, p in cf.spills.items()})
    cache.metrics[m.RECOVERED_FILES] += report.files
    if report.files or report.orphan_uploads_aborted:
        log.info(report.describe())
    return files, report


async def _restore_file(cache: CacheManager, rec: PendingFile,
                        report: RecoveryReport) -> CachedFile:
    journal, store, parts = cache.journal, cache.store, cache.parts
    # Writes extend the cache file in step with the file but do not touch the journal row:
    # the larger of the two is the size the application last saw. The kernel's writes
    # (passthrough) give the cache file its mtime too, as they gave the file's.
    st = cache.cachefiles.path(rec.fid).lstat()  # (a regular file: WarmCache.load)
    size = max(rec.size, st.st_size)
    mtime_ns = max(rec.mtime_ns, st.st_mtime_ns) if rec.passthrough else rec.mtime_ns
    cf = CachedFile(key=rec.key, size=size, mode=rec.mode, uid=rec.uid, gid=rec.gid,
                    mtime_ns=mtime_ns, atime_ns=rec.atime_ns, ctime_ns=rec.ctime_ns,
                    fid=rec.fid,
                    base=CommittedBase(rec.base_key, rec.base_size or 0),
                    upload=OpenUpload(rec.upload_id, rec.upload_key,
                                      bool(rec.upload_checksum), rec.upload_table),
                    symlink=rec.symlink, rdev=rec.rdev, in_journal=True, commit_unknown=True,
                    intent_gen=rec.intent_gen)
    chunks = await journal(journal.sync.chunks, rec.fid)
    for idx, (token, spilled_etag, crc) in (await journal(journal.sync.spilled,
                                                           rec.fid)).items():
        start, end = parts.chunk_range(idx)  # (a part spills only whole)
        cf.spills[idx] = SpilledPart(token, spilled_etag, end - start, crc)
        chunks.pop(idx, None)  # not cached, as far as recovery knows: read from S3
        report.spilled_parts_kept += 1
    crcs = await journal(journal.sync.part_crcs, rec.fid)
    remote_parts: dict[int, str] | None = None
    if cf.upload.id is not None and cf.upload.key is not None and cf.upload.key != cf.key:
        # Renamed while its upload was open, by a mount older than the background abort
        # (Uploads.abandon): nothing completes at the old name; the parts go again.
        await store.retrying(f"AbortMultipartUpload {cf.upload.key}",
                             store.sync.abort_multipart, cf.upload.key, cf.upload.id)
        await journal(journal.sync.forget_uploads, rec.fid)
        await journal(journal.sync.end_upload, cf.upload.id)
        cf.take_upload()
        report.uploads_restarted += 1
    elif cf.upload.id is not None and cf.upload.key is not None:
        try:
            remote_parts = await store.retrying(
                f"ListParts {cf.upload.key}", store.sync.list_parts, cf.upload.key, cf.upload.id)
        except NoSuchUpload:
            await journal(journal.sync.forget_uploads, rec.fid)
            await journal(journal.sync.end_upload, cf.upload.id)
            cf.take_upload()
            report.uploads_restarted += 1
    for idx, (state, etag) in chunks.items():
        start, end = parts.chunk_range(idx)
        if start >= cf.size:
            continue
        if (state == CHUNK_UPLOADED and remote_parts is not None
                and remote_parts.get(idx + 1) == etag):
            cf.chunks[idx] = Chunk(ChunkState.UPLOADED, etag=etag,
                                   length=min(end, cf.size) - start, sent_crc=crcs.get(idx))
            report.uploaded_parts_kept += 1
        else:
            cf.chunks[idx] = Chunk(ChunkState.DIRTY)
            report.dirty_chunks += 1
    cache.adopt(cf)
    if rec.passthrough:  # D21: the kernel wrote the cache file directly: any byte may be new
        await cache.stale_writers.check(cf)  # D28: and may still write it (keeps the flag)
        await cache.writer.take_over_written(cf, cf.size, frozenset(cf.spills))
        report.dirty_chunks = sum(1 for c in cf.chunks.values() if c.state is ChunkState.DIRTY)
    return cf

"""Orphaned cache files (docs/durability.md, D20): list them, and upload them to S3.

A mount that finds cache files its journal does not name (after a crash together with a
lost or damaged journal) moves them to `<cache dir>/orphans/`: they may hold the only copy
of acknowledged bytes, but their names are lost. `lakefs-mount orphans` asks the daemon
to list them, or to upload them into a directory of the mount (`lost+found/` by default)
as `<host>-<file name>`: the daemon holds the bucket's credentials and endpoint, and the
objects then show in the mount, where ordinary tools can look at them and move them to
their real names. An orphan is never uploaded over an existing object, and it is removed
only once a HEAD shows the object with its size and ETag (the S3 MD5 form computed from
the local bytes, where S3 answers with one).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.checksums import ChecksumUse
from lakefs_mount.s3.crc import crc32c_combine, crc32c_of
from lakefs_mount.s3.layout import PartMap, encode_attrs, key_for

log = logging.getLogger(__name__)

UPLOAD_ATTEMPTS = 5  # per request, with the usual backoff; then this orphan fails
DEFAULT_DIR = "lost+found"
ORPHAN_MODE = stat.S_IFREG | 0o600  # private, like the cache file it was


@dataclass(frozen=True)
class Orphan:
    path: Path
    size: int
    allocated: int  # bytes on disk: holes (evicted chunks) read as zeros
    mtime: float

    @property
    def fid(self) -> int | None:
        """The file id it had (`<fid>` or `<fid>.<n>` when a name was taken)."""
        head = self.path.name.split(".", 1)[0]
        return int(head) if head.isdigit() else None

    def describe(self) -> dict[str, Any]:
        return {"name": self.path.name, "fid": self.fid, "size": self.size,
                "allocated": self.allocated, "mtime": self.mtime, "path": str(self.path)}


def list_orphans(directory: Path) -> list[Orphan]:
    """The orphans in `directory`, oldest first (none when it does not exist)."""
    found = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            found.append(Orphan(Path(entry.path), st.st_size, st.st_blocks * 512, st.st_mtime))
    return sorted(found, key=lambda o: (o.mtime, o.path.name))


def md5_etag(path: Path, parts: PartMap, size: int) -> str:
    """The ETag S3 gives an unencrypted object of these bytes uploaded with this part
    map: the MD5, or for several parts the MD5 of their MD5s and `-<parts>`."""
    count = parts.chunk_count(size)
    with open(path, "rb") as f:
        digests = []
        for idx in range(max(count, 1)):
            start, end = parts.chunk_range(idx)
            h = hashlib.md5(usedforsecurity=False)
            f.seek(start)
            left = min(end, size) - start
            while left > 0:
                piece = f.read(min(left, 1 << 20))
                if not piece:
                    raise OSError(f"{path} shrank while it was read")
                h.update(piece)
                left -= len(piece)
            digests.append(h.digest())
    if count <= 1:
        return digests[0].hex()
    return hashlib.md5(b"".join(digests), usedforsecurity=False).hexdigest() + f"-{count}"


def _looks_md5(etag: str) -> bool:
    head = etag.split("-", 1)[0]
    return len(head) == 32 and all(c in "0123456789abcdef" for c in head.lower())


class OrphanError(Exception):
    """One orphan could not be uploaded; it stays where it is."""


@dataclass
class UploadReport:
    uploaded: list[dict[str, Any]]
    failed: list[dict[str, str]]


class OrphanUploader:
    """Uploads orphans one after the other (they are rare; a recovery tool, not a hot
    path), each part read from the file in a worker thread."""

    def __init__(self, store: AsyncStore, parts: PartMap, prefix: str,
                 checksums: ChecksumUse, host: str | None = None) -> None:
        self.store = store
        self.parts = parts
        self.prefix = prefix
        self.checksums = checksums  # the flusher's: what it declares, these declare
        self.host = host or socket.gethostname()
        self._busy = trio.Lock()

    def key_of(self, orphan: Orphan, directory: str) -> str:
        name = f"{self.host}-{orphan.path.name}"
        return key_for(self.prefix, f"{directory.strip('/')}/{name}" if directory.strip("/")
                       else name)

    async def upload_all(self, orphans: list[Orphan], directory: str, keep: bool,
                         progress: Callable[[dict], Awaitable[None]]) -> UploadReport:
        if self._busy.locked():
            raise ValueError("an upload of the orphans is already running; wait for it")
        report = UploadReport([], [])
        async with self._busy:
            left = list(orphans)
            while left:
                await progress({"files_left": len(left),
                                "bytes_left": sum(o.size for o in left)})
                orphan = left.pop(0)
                key = self.key_of(orphan, directory)
                try:
                    etag = await self._upload_one(orphan, key)
                except OrphanError as exc:
                    log.warning("orphan %s not uploaded: %s", orphan.path, exc)
                    report.failed.append({"name": orphan.path.name, "key": key,
                                          "error": str(exc)})
                    continue
                if not keep:
                    orphan.path.unlink(missing_ok=True)
                log.info("orphan %s (%d bytes) uploaded to %s (ETag %s)%s", orphan.path,
                         orphan.size, key, etag, "" if keep else "; removed")
                report.uploaded.append({"name": orphan.path.name, "key": key,
                                        "path": key[len(self.prefix):],
                                        "size": orphan.size, "etag": etag,
                                        "removed": not keep})
        if not keep and orphans:
            with_dir = orphans[0].path.parent
            try:
                with_dir.rmdir()  # empty now: status stops counting orphans
            except OSError:
                pass
        return report

    async def _upload_one(self, orphan: Orphan, key: str) -> str:
        """Upload and confirm: returns the ETag S3 holds for exactly these bytes."""
        size = orphan.size
        try:
            local = await trio.to_thread.run_sync(md5_etag, orphan.path, self.parts, size)
        except OSError as exc:
            raise OrphanError(f"cannot read it: {exc}") from None
        try:
            before = await self.store.retrying(f"HeadObject {key}", self.store.sync.head, key,
                                               max_attempts=UPLOAD_ATTEMPTS)
            if before is not None:
                if before.size == size and before.etag == local:
                    return before.etag  # uploaded by an earlier run that stopped short
                raise OrphanError(f"{key} already exists in S3 with other content; choose "
                                  "another --to")
            meta = encode_attrs(ORPHAN_MODE, os.getuid(), os.getgid(),
                                int(orphan.mtime * 1e9))
            if self.parts.chunk_count(size) <= 1:
                body = await trio.to_thread.run_sync(_read, orphan.path, 0, size)
                sent = await self.store.retrying(f"PutObject {key}", self.store.sync.put,
                                                 key, body, meta, self.checksums.crc_of(body),
                                                 max_attempts=UPLOAD_ATTEMPTS)
            else:
                sent = await self._multipart(orphan, key, meta)
            after = await self.store.retrying(f"HeadObject {key}", self.store.sync.head, key,
                                              max_attempts=UPLOAD_ATTEMPTS)
        except OrphanError:
            raise
        except Exception as exc:  # S3 after its retries, the cache disk
            raise OrphanError(str(exc)) from None
        if after is None or after.size != size or after.etag != sent:
            raise OrphanError(f"S3 does not show {key} as uploaded ({size} bytes, ETag "
                              f"{sent}) but {after and (after.size, after.etag)}")
        if _looks_md5(sent) and sent != local:
            raise OrphanError(f"S3's ETag {sent} of {key} is not the MD5 of the local bytes "
                              f"({local}); the object may be damaged")
        return sent

    async def _multipart(self, orphan: Orphan, key: str, meta: dict[str, str]) -> str:
        """As the flusher sends a file: where the endpoint checks checksums, an upload of
        type FULL_OBJECT whose parts declare their CRC-32C (S3 refuses a part's CRC on an
        upload created without one) and whose Complete lists them and the object's."""
        store = self.store
        checksum = self.checksums.full_object
        upload_id = await store.retrying(f"CreateMultipartUpload {key}",
                                         store.sync.create_multipart, key, meta, checksum,
                                         max_attempts=UPLOAD_ATTEMPTS)
        try:
            done, crcs, whole = [], [], 0
            for idx in range(self.parts.chunk_count(orphan.size)):
                start, end = self.parts.chunk_range(idx)
                body = await trio.to_thread.run_sync(_read, orphan.path, start,
                                                     min(end, orphan.size))
                etag = await store.retrying(f"UploadPart {key} #{idx + 1}",
                                            store.sync.upload_part, key, upload_id, idx + 1,
                                            body, checksum, max_attempts=UPLOAD_ATTEMPTS)
                done.append((idx + 1, etag))
                if checksum:
                    crcs.append(crc32c_of(body))
                    whole = crc32c_combine(whole, crcs[-1], len(body))
            return await store.retrying(f"CompleteMultipartUpload {key}",
                                        store.sync.complete_multipart, key, upload_id, done,
                                        crcs if checksum else None,
                                        whole if checksum else None,
                                        max_attempts=UPLOAD_ATTEMPTS)
        except BaseException:
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                try:
                    await store.call(store.sync.abort_multipart, key, upload_id)
                except Exception as exc:  # left for a lifecycle rule; says so
                    log.warning("abort of the upload of %s failed: %s", key, exc)
            raise


def _read(path: Path, start: int, end: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    if len(data) != end - start:
        raise OSError(f"{path} shrank while it was read")
    return data

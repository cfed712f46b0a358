"""`verify`: does a checkpoint in S3 match its manifest? Every object present with the
manifest's size, ETag and CRC-32C (its bytes read back with parallel ranged GETs), and
no object the manifest does not list. Runs in the daemon (`verify MOUNTPOINT PATH`) or
in the CLI's own process (`verify s3://...`), over the same `AsyncStore`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import trio

from lakefs_mount.publish.manifest import (
    MANIFEST_NAME,
    Entry,
    ManifestError,
    Problem,
    compare_checksum,
    compare_listing,
    encode_crc,
    parse,
    part_of_checkpoint,
)
from lakefs_mount.publish.objecthash import ObjectHasher
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.objectstore import CorruptRead, ObjectStoreError


@dataclass
class VerifyReport:
    bucket: str
    prefix: str  # the checkpoint's key prefix, ending in "/"
    manifest: str = "found"  # found | missing | unreadable
    files: int = 0
    bytes: int = 0
    bytes_read: int = 0
    checked_by_s3: int = 0  # files whose CRC-32C S3 keeps: compared without reading them
    committed_at: float | None = None
    committed_by: dict[str, Any] | None = None
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.manifest == "found" and not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "bucket": self.bucket, "prefix": self.prefix,
                "manifest": self.manifest, "files": self.files, "bytes": self.bytes,
                "bytes_read": self.bytes_read, "checked_by_s3": self.checked_by_s3,
                "committed_at": self.committed_at,
                "committed_by": self.committed_by,
                "problems": [p.to_json() for p in self.problems]}


def listed_under(objects: list[Any], prefix: str) -> dict[str, Any]:
    """Relative key -> ObjectInfo of the objects of a checkpoint (from a recursive
    listing of `prefix`)."""
    out = {}
    for info in objects:
        rel = info.key[len(prefix):]
        if info.key.startswith(prefix) and part_of_checkpoint(rel):
            out[rel] = info
    return out


async def stored_crc(store: AsyncStore, key: str, entry: Entry) -> str | None:
    """The whole-object CRC-32C S3 keeps for this version of `key` (S3 checked it against
    the bytes when they arrived), or None where it keeps none or only per-part ones."""
    info = await store.head(key, checksum=True)
    if info is None or info.etag != entry.etag:
        return None
    return info.crc32c


async def verify_checkpoint(store: AsyncStore, prefix: str, parallel: int = 8) -> VerifyReport:
    """Check the checkpoint at key prefix `prefix` (ending in "/") against its manifest."""
    report = VerifyReport(store.sync.bucket, prefix)
    try:
        got = await store.call(store.sync.get, prefix + MANIFEST_NAME, what="GET manifest")
        if got is None:
            report.manifest = "missing"
            return report
        doc, entries = parse(got[1])
    except (ManifestError, CorruptRead) as exc:  # (CorruptRead: S3's own CRC of it)
        report.manifest = "unreadable"
        report.problems.append(Problem("unreadable", MANIFEST_NAME, str(exc)))
        return report
    report.committed_at = doc.get("committed_at")
    report.committed_by = doc.get("committed_by")
    report.files, report.bytes = len(entries), sum(e.size for e in entries)
    listed = listed_under(await store.list_recursive(prefix), prefix)
    problems, to_hash = compare_listing(
        entries, {k: (i.size, i.etag) for k, i in listed.items()})
    report.problems.extend(problems)
    hasher = ObjectHasher(store, parallel)

    async def check(entry: Entry) -> None:
        try:
            crc = await stored_crc(store, prefix + entry.key, entry) if entry.crc32c else None
            if crc is not None:
                report.checked_by_s3 += 1
            else:
                crc = encode_crc(await hasher.crc(prefix + entry.key, entry.size, entry.etag))
        except ObjectStoreError as exc:
            report.problems.append(Problem("unreadable", entry.key, str(exc)))
            return
        problem = compare_checksum(entry, crc)
        if problem is not None:
            report.problems.append(problem)

    async with trio.open_nursery() as nursery:
        for entry in to_hash:
            nursery.start_soon(check, entry)
    report.bytes_read = hasher.bytes_read
    report.problems.sort(key=lambda p: (p.key, p.kind))
    return report

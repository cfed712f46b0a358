"""The checkpoint manifest `PATH/.lakefs-commit.json`: its format, and what makes a
checkpoint in S3 match it.

Why a manifest object: S3 has no directory commit. Written as the very last object of
a checkpoint, its presence says "complete", and its content says what complete means
(each object's size, ETag and CRC-32C), so a reader can check a checkpoint before
loading it with nothing but boto3 (docs/checkpoints.md).

Checksums are CRC-32C written as S3 writes `x-amz-checksum-crc32c` (base64 of the four
big-endian bytes), so a later S3-stored full-object checksum fills the same field;
`source` says where the value came from (`cache`: this node's cache file, `read`: the
object read back from S3, `s3`: S3's own stored checksum).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lakefs_mount.s3.crc import crc32c_combine, crc32c_of, encode_crc  # noqa: F401 (re-export)

MANIFEST_NAME = ".lakefs-commit.json"
FORMAT = "lakefs-mount/commit"
FORMAT_VERSION = 1
ALGORITHM = "CRC32C"
RESERVED = ".lakefs-mount"  # the mount's own records (dirindex): never part of a checkpoint
# The CRC-32C of the manifest itself, as `canonical` writes it without this field: a
# manifest changed after it was written (or on the way) is never read as another one.
SELF_CHECK = "manifest_crc32c"

# -- the manifest -----------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One object of a checkpoint; `key` is relative to the checkpoint's prefix."""

    key: str
    size: int
    etag: str
    mtime: float  # the file's mtime from the mount's metadata, else S3's LastModified
    crc32c: str | None  # encode_crc(), None where not known
    source: str = "read"  # cache | read | s3

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "size": self.size, "etag": self.etag, "mtime": self.mtime,
                "checksum": {"algorithm": ALGORITHM, "value": self.crc32c,
                             "source": self.source}}


def part_of_checkpoint(rel: str) -> bool:
    """A relative key that belongs in a manifest: not the manifest itself, not a
    directory marker, nothing of the mount's own records."""
    return (bool(rel) and rel != MANIFEST_NAME and not rel.endswith("/")
            and RESERVED not in rel.split("/"))


def build(entries: list[Entry], *, bucket: str, prefix: str, committed_at: float,
          committed_by: dict[str, Any]) -> bytes:
    """The manifest object's body: sorted entries, totals, who and when."""
    files = sorted(entries, key=lambda e: e.key)
    doc = {
        "format": FORMAT, "version": FORMAT_VERSION,
        "bucket": bucket, "prefix": prefix,
        "checksum_algorithm": ALGORITHM,
        "committed_at": committed_at,
        "committed_by": committed_by,
        "file_count": len(files), "total_bytes": sum(e.size for e in files),
        "files": [e.to_json() for e in files],
    }
    doc[SELF_CHECK] = encode_crc(crc32c_of(canonical(doc)))
    return canonical(doc)


def canonical(doc: dict[str, Any]) -> bytes:
    """The manifest's bytes for `doc` (what SELF_CHECK is the CRC of, without itself)."""
    return json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n"


class ManifestError(ValueError):
    """The manifest object is not one this version can read."""


def parse(body: bytes) -> tuple[dict[str, Any], list[Entry]]:
    """The manifest's document and its entries; ManifestError if it is not one."""
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise ManifestError(f"not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ManifestError(f"not a lakefs-mount commit manifest (format "
                            f"{doc.get('format') if isinstance(doc, dict) else None!r})")
    if doc.get("version") != FORMAT_VERSION:
        raise ManifestError(f"format version {doc.get('version')!r}; this lakefs-mount "
                            f"reads version {FORMAT_VERSION}: upgrade it")
    if SELF_CHECK in doc:  # (manifests of earlier releases have none)
        rest = {k: v for k, v in doc.items() if k != SELF_CHECK}
        if encode_crc(crc32c_of(canonical(rest))) != doc[SELF_CHECK]:
            raise ManifestError("its own CRC-32C does not match its content: it changed "
                                "after it was written, or on the way")
    try:
        entries = [Entry(f["key"], int(f["size"]), str(f["etag"]), float(f["mtime"]),
                         f["checksum"].get("value"), f["checksum"].get("source", "read"))
                   for f in doc["files"]]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ManifestError(f"a file entry is malformed ({exc!r})") from None
    return doc, entries


@dataclass(frozen=True)
class Problem:
    """One way a checkpoint differs from its manifest."""

    kind: str  # missing | size | etag | checksum | extra | unreadable
    key: str
    detail: str

    def line(self) -> str:
        return f"{self.kind}: {self.key}: {self.detail}"

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "key": self.key, "detail": self.detail}


def compare_listing(entries: list[Entry], listed: dict[str, tuple[int, str]]
                    ) -> tuple[list[Problem], list[Entry]]:
    """Problems visible from a listing (relative key -> (size, ETag)): missing objects,
    other sizes or ETags, extra objects; and the entries still to hash."""
    problems: list[Problem] = []
    to_hash: list[Entry] = []
    wanted = {e.key for e in entries}
    for e in entries:
        got = listed.get(e.key)
        if got is None:
            problems.append(Problem("missing", e.key, "in the manifest, not in S3"))
        elif got[0] != e.size:
            problems.append(Problem("size", e.key, f"manifest says {e.size} bytes, S3 has "
                                    f"{got[0]}"))
        elif got[1] != e.etag:
            problems.append(Problem("etag", e.key, f"manifest says ETag {e.etag}, S3 has "
                                    f"{got[1]} (changed after the commit)"))
        else:
            to_hash.append(e)
    for key in sorted(set(listed) - wanted):
        problems.append(Problem("extra", key, "in S3, not in the manifest"))
    return problems, to_hash


def compare_checksum(entry: Entry, crc: str) -> Problem | None:
    if entry.crc32c is None or entry.crc32c == crc:
        return None
    return Problem("checksum", entry.key, f"manifest says CRC32C {entry.crc32c}, the "
                   f"object's bytes give {crc}")

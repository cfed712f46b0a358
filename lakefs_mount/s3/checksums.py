"""End-to-end checksums of uploads: what the mount sends, and whether the endpoint checks it.

Every UploadPart and PutObject declares the CRC-32C of its body (`x-amz-checksum-crc32c`),
computed from the cache file by the thread that sends it; an endpoint that checks it
rejects a body corrupted on the way (BadDigest) and the part is sent again. Whether the
endpoint checks is not in any reply: `probe` asks once at mount with a PutObject whose
checksum is deliberately wrong, to a reserved key under the mount's prefix. Multipart
uploads are created with ChecksumAlgorithm CRC32C (type FULL_OBJECT, so S3 stores the
same whole-object CRC-32C a manifest holds) only where the probe saw the endpoint check:
such an upload's Complete must list every part's checksum.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import crc32c
import trio

from lakefs_mount.s3.objectstore import ObjectStore, ObjectStoreError

log = logging.getLogger(__name__)

OFF_VARIABLE = "LAKEFS_MOUNT_UPLOAD_CHECKSUMS"  # "off": none sent (benchmarks/checksums.py)
PROBE_KEY = ".lakefs-mount/checksum-probe"  # under the mount's prefix (RESERVED)
PROBE_SECONDS = 10.0  # a slow endpoint leaves the answer unknown, never the mount waiting


@dataclass
class ChecksumUse:
    """`send`: parts and objects declare their CRC-32C (off only for measurements).
    `verified`: the endpoint rejected a wrong checksum (True), accepted it (False), or the
    probe could not tell (None)."""

    send: bool = True
    verified: bool | None = None

    @classmethod
    def from_environment(cls) -> ChecksumUse:
        """On unless OFF_VARIABLE is "off": for measuring what they cost, not an option
        for users (a corrupted transfer would then land in S3)."""
        return cls(send=os.environ.get(OFF_VARIABLE, "").lower() != "off")

    @property
    def full_object(self) -> bool:
        """Create multipart uploads with ChecksumAlgorithm CRC32C / FULL_OBJECT."""
        return self.send and self.verified is True

    def describe(self) -> str:
        if not self.send:
            return "off"
        if self.verified is None:
            return "crc32c (whether this endpoint verifies it is unknown)"
        return "crc32c (verified by S3)" if self.verified else \
            "crc32c (not verified by this endpoint)"

    def to_json(self) -> dict[str, object]:
        return {"algorithm": "crc32c" if self.send else None, "verified": self.verified}


def probe(store: ObjectStore, prefix: str) -> bool | None:
    """Whether the endpoint rejects a PutObject whose x-amz-checksum-crc32c is wrong
    (blocking, in a worker thread): True rejected, False stored, None unknown (the
    probe itself failed). The probe object is deleted whichever way it went."""
    key = prefix + PROBE_KEY
    body = os.urandom(64)
    wrong = crc32c.crc32c(body) ^ 0xFFFFFFFF
    try:
        store.put(key, body, {}, wrong)
    except ObjectStoreError as exc:
        if exc.code in ("BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch"):
            return True
        log.info("checksum probe of the endpoint failed: %s", exc)
        return None
    try:
        store.delete(key)
    except ObjectStoreError as exc:
        log.info("could not delete the checksum probe %s: %s", key, exc)
    return False


async def probe_endpoint(store: ObjectStore, prefix: str, use: ChecksumUse) -> None:
    """Run `probe` in a thread and note its answer in `use`; after PROBE_SECONDS the
    answer stays unknown (the thread is left to finish on its own). `store` is the plain
    store: the expected rejection is no error of the mount's, for status or metrics."""
    if not use.send:
        return
    with trio.move_on_after(PROBE_SECONDS):
        use.verified = await trio.to_thread.run_sync(probe, store, prefix,
                                                     abandon_on_cancel=True)
    log.info("upload checksums: %s", use.describe())

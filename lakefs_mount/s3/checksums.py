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
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import crc32c
import trio

from lakefs_mount.s3.crc import crc32c_of
from lakefs_mount.s3.objectstore import ObjectStore, ObjectStoreError

log = logging.getLogger(__name__)

OFF_VARIABLE = "LAKEFS_MOUNT_UPLOAD_CHECKSUMS"  # "off": none sent (to measure their cost)
PROBE_KEY = ".lakefs-mount/checksum-probe"  # under the mount's prefix (RESERVED)
PROBE_SECONDS = 10.0  # a slow endpoint leaves the answer unknown, never the mount waiting


@dataclass
class ChecksumUse:
    """`send`: parts and objects declare their CRC-32C (off only for measurements).
    `verified`: the endpoint rejected a wrong checksum (True), accepted it (False), or the
    probe could not tell (None). `trailer`: it takes a part's CRC-32C in an aws-chunked
    trailer (parts are read once) rather than only in a header (hashed first).
    `sendfile`: parts go with their CRC in a header, hashed first and then sent from the
    cache file by the kernel (plain HTTP to an endpoint that checks: cheaper still)."""

    send: bool = True
    verified: bool | None = None
    trailer: bool = False
    sendfile: bool = False

    @classmethod
    def from_environment(cls) -> ChecksumUse:
        """On unless OFF_VARIABLE is "off": for measuring what they cost, not an option
        for users (a corrupted transfer would then land in S3)."""
        return cls(send=os.environ.get(OFF_VARIABLE, "").lower() != "off")

    def crc_of(self, body: bytes) -> int | None:
        """The CRC-32C a PutObject of `body` declares (None with checksums off): in a
        header, after a pass over it, which for a manifest or an index is a few KiB."""
        return crc32c_of(body) if self.send else None

    @property
    def full_object(self) -> bool:
        """Create multipart uploads with ChecksumAlgorithm CRC32C / FULL_OBJECT."""
        return self.send and self.verified is True

    def describe(self) -> str:
        if not self.send:
            return "off"
        if self.verified is None:
            return "crc32c (whether this endpoint verifies it is unknown)"
        if not self.verified:
            return "crc32c (not verified by this endpoint)"
        if self.sendfile:
            return "crc32c (verified by S3, in a header; parts sent by sendfile)"
        return "crc32c (verified by S3, " + ("in an aws-chunked trailer)" if self.trailer
                                            else "in a header)")

    def to_json(self) -> dict[str, object]:
        return {"algorithm": "crc32c" if self.send else None, "verified": self.verified,
                "trailer": self.trailer, "sendfile": self.sendfile}


REJECTED = ("BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch")


class _Sent:
    """A body as a PiecewiseBody, with the CRC it claims to have (for the trailer)."""

    def __init__(self, data: bytes, sent_crc: int) -> None:
        self.data, self.sent_crc = data, sent_crc

    def __len__(self) -> int:
        return len(self.data)

    def pieces(self) -> Iterator[memoryview]:
        yield memoryview(self.data)


def _answer(send: Callable[[], object]) -> bool | ObjectStoreError:
    """True: S3 refused the request for its checksum; False: it took it; else the failure."""
    try:
        send()
    except ObjectStoreError as exc:
        return True if exc.code in REJECTED else exc
    return False


def _trailer_checked(store: ObjectStore, put_piecewise: Callable[..., object], key: str,
                     body: bytes, good: int) -> bool:
    """Whether the endpoint refuses a wrong aws-chunked CRC-32C trailer, takes the right
    one and stores the bytes as sent. Asked only after the same credentials put `key`
    with the CRC in a header: a refusal here is about the trailer form, not the keys
    (SeaweedFS without identities answers every unsigned trailer 403 InvalidAccessKeyId)."""
    wrong = _answer(lambda: put_piecewise(key, _Sent(body, good ^ 0xFFFFFFFF), True))
    right = _answer(lambda: put_piecewise(key, _Sent(body, good), True)) if wrong is True \
        else None
    failed = next((a for a in (wrong, right) if isinstance(a, ObjectStoreError)), None)
    if failed is not None and failed.status is None:  # no answer: not a statement
        log.info("checksum probe of aws-chunked trailers failed: %s", failed)
        return False
    if failed is not None:
        log.info("the endpoint does not take a CRC-32C in an aws-chunked trailer (it answers"
                 " HTTP %s %s, though it took the same PutObject with the CRC in a header):"
                 " parts send their CRC-32C in a header", failed.status, failed.code)
        return False
    if wrong is False:
        log.info("the endpoint does not check a CRC-32C in an aws-chunked trailer:"
                 " parts send their CRC-32C in a header")
        return False
    try:
        got = store.get(key)
    except ObjectStoreError as exc:
        log.info("checksum probe of aws-chunked trailers failed: %s", exc)
        return False
    return got is not None and got[1] == body


def probe(store: ObjectStore, prefix: str) -> bool | None:
    """Whether the endpoint rejects a PutObject whose x-amz-checksum-crc32c is wrong
    (blocking, in a worker thread): True rejected, False stored, None unknown (the
    probe itself failed). Where it does, whether it takes the checksum as an aws-chunked
    trailer and checks that too: then `store.trailing_checksums` is set. The probe
    object is deleted whichever way it went."""
    key = prefix + PROBE_KEY
    body = os.urandom(4096)  # (SeaweedFS answers IncompleteBody to a wrong trailer of 64)
    good = crc32c.crc32c(body)
    header = _answer(lambda: store.put(key, body, {}, good ^ 0xFFFFFFFF))
    if isinstance(header, ObjectStoreError):
        log.info("checksum probe of the endpoint failed: %s", header)
    verified = None if isinstance(header, ObjectStoreError) else header
    put_piecewise = getattr(store, "put_piecewise", None)  # (not on every store)
    if verified and put_piecewise is not None:
        store.trailing_checksums = _trailer_checked(  # type: ignore[attr-defined]
            store, put_piecewise, key, body, good)
    if verified:  # a part whose bytes changed after its CRC was taken is refused
        store.checked_checksums = True  # type: ignore[attr-defined]
    try:
        store.delete(key)
    except ObjectStoreError as exc:
        log.info("could not delete the checksum probe %s: %s", key, exc)
    return verified


async def probe_endpoint(store: ObjectStore, prefix: str, use: ChecksumUse) -> None:
    """Run `probe` in a thread and note its answer in `use`; after PROBE_SECONDS the
    answer stays unknown (the thread is left to finish on its own). `store` is the plain
    store: the expected rejection is no error of the mount's, for status or metrics."""
    if not use.send:
        return
    with trio.move_on_after(PROBE_SECONDS):
        try:
            use.verified = await trio.to_thread.run_sync(probe, store, prefix,
                                                         abandon_on_cancel=True)
        except Exception as exc:  # (a probe never fails the mount)
            log.warning("checksum probe of the endpoint failed: %s", exc)
    use.trailer = bool(getattr(store, "trailing_checksums", False))
    use.sendfile = bool(getattr(store, "parts_from_file", False))
    log.info("upload checksums: %s", use.describe())

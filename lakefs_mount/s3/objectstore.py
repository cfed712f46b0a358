"""The narrow object-store interface: everything lakefs-mount asks of S3.

`lakefs_mount.s3.store` implements it with boto3 (with `lean` and `failures`, the only
modules that know boto3);
`tests/memstore.py` implements it in memory for fast unit tests of the core.
Methods are synchronous: the daemon calls them from worker threads behind a limiter.
Keys are full keys inside the bucket (the mount prefix already applied).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO, Protocol

import crc32c

MAX_KEY_BYTES = 1024  # S3's limit on the length of a key


def key_fits(key: str) -> bool:
    """S3 refuses longer keys: the mount refuses a name that would need one when it is
    made (ENAMETOOLONG), instead of accepting data whose commit can never succeed."""
    return len(os.fsencode(key)) <= MAX_KEY_BYTES


class ObjectStoreError(Exception):
    """An S3 call failed; `str()` is a message fit for the user. `transient`: another
    attempt may succeed (throttling, a 5xx, a connection failure; see s3/retry)."""

    transient = False
    code = ""  # S3's error code, where S3 answered (e.g. "SlowDown")
    status: int | None = None  # the HTTP status of that answer


class NoSuchBucket(ObjectStoreError):
    pass


class AccessDenied(ObjectStoreError):
    """Wrong credentials or missing permissions."""


class EndpointUnreachable(ObjectStoreError):
    pass


class NoSuchKey(ObjectStoreError):
    pass


class RequestTimedOut(ObjectStoreError):
    """S3 took longer than the request's bound (s3/timeouts) to answer it: a black hole,
    a stuck proxy, or a link slower than the floor rate. Transient."""


class NoSuchUpload(ObjectStoreError):
    """The multipart upload id is unknown (aborted, completed or expired)."""


class PartCopyUnsupported(ObjectStoreError):
    """The endpoint answered an UploadPartCopy without copying (rclone serve s3 takes it
    for an UploadPart of no bytes): unchanged parts must be fetched and sent instead."""


class CorruptRead(ObjectStoreError):
    """A GET's bytes do not have the CRC-32C they were stored with: changed on the way (a
    bad NIC, a middlebox) or at rest. Transient: asked again; never served, cached or
    uploaded again."""

    transient = True
    code = "ChecksumMismatch"


class ReadCheck:
    """The CRC-32C of a GET's body as it streams past, held against the one expected
    (`expect`, None: nothing to check against) once the body has ended."""

    def __init__(self, what: str, expect: int | None) -> None:
        self.what = what
        self.expect = expect
        self.crc = 0

    def add(self, piece: bytes | memoryview) -> None:
        if self.expect is not None:
            self.crc = crc32c.crc32c(piece, self.crc)

    def done(self) -> bool:
        """True if the body was checked (and matched); raises CorruptRead if it did not."""
        if self.expect is None:
            return False
        if self.crc != self.expect:
            raise CorruptRead(f"{self.what}: the bytes S3 sent have CRC-32C {self.crc:08x},"
                              f" not the {self.expect:08x} they were stored with")
        return True


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str  # without quotes
    mtime: float  # LastModified as a POSIX timestamp
    metadata: dict[str, str] = field(default_factory=dict)  # user metadata, lower-case names
    # S3's CRC-32C of the whole object as x-amz-checksum-crc32c writes it (base64), where it
    # keeps one and was asked for it (head(checksum=True)); None for a composite "...-N"
    crc32c: str | None = None


@dataclass(frozen=True)
class Listing:
    """One delimiter listing of a prefix: objects directly under it and sub-prefixes."""

    objects: list[ObjectInfo]
    prefixes: list[str]  # full keys ending in "/"


@dataclass(frozen=True)
class PendingUpload:
    key: str
    upload_id: str


class PiecewiseBody(Protocol):
    """A part body a store may send in the pieces it yields instead of reading it into
    one bytes object (a 16 MiB part then costs no 16 MiB of memory and no extra copies).
    Each piece is valid only until the next is taken. A body that also offers `sent_crc`
    (the CRC-32C of what its last complete pass yielded) is not hashed again to send it
    with its checksum; one that offers `file_span()` (a FileSpan, or None) may be sent
    from that file by the kernel once its checksum is in the request's header, where
    the endpoint checks it: bytes changed since that pass are then refused (BadDigest)."""

    def __len__(self) -> int: ...

    def pieces(self) -> Iterator[memoryview]: ...


class ObjectStore(Protocol):
    bucket: str

    def check_bucket(self) -> None:
        """Raise NoSuchBucket / AccessDenied / EndpointUnreachable with a clear message."""
        ...

    def head(self, key: str, checksum: bool = False) -> ObjectInfo | None:
        """Size, ETag and user metadata of `key`, or None if it does not exist. `checksum`:
        ask for S3's stored checksum too (ChecksumMode ENABLED: only `verify` does, since
        on AWS it needs kms:Decrypt for KMS-encrypted objects)."""
        ...

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of `key` (fewer if the object is shorter)."""
        ...

    def get(self, key: str) -> tuple[ObjectInfo, bytes] | None:
        """A whole (small) object with its metadata in one request, or None if absent.
        Its body is checked against the CRC-32C S3 keeps for the whole object, where it
        keeps one (then in the info's `crc32c`); CorruptRead if it does not match."""
        ...

    def get_range_into(self, key: str, start: int, end: int,
                       write: Callable[[int, bytes], None], if_match: str | None = None,
                       expect_crc: int | None = None, whole: bool = False) -> tuple[int, bool]:
        """Bytes [start, end) of `key`, handed to write(offset, piece) in pieces of about
        1 MiB as they arrive (memory stays bounded); returns how many bytes there were
        and whether they were checked. `if_match`: only of the version with that ETag
        (else an ObjectStoreError with code PreconditionFailed). `expect_crc`: the bytes'
        CRC-32C; `whole`: [start, end) is the whole object as the caller knows it, sent
        for without a Range so that S3's CRC-32C of the object comes with it. CorruptRead
        if the bytes do not match what they are checked against."""
        ...

    def put(self, key: str, body: bytes | memoryview, metadata: dict[str, str],
            crc: int | None = None) -> str:
        """PutObject; returns the ETag. `crc`: the body's CRC-32C, declared so that S3
        rejects a body that does not match it (s3/checksums)."""
        ...

    def list_dir(self, prefix: str) -> Listing:
        """All pages of ListObjectsV2(Prefix=prefix, Delimiter='/')."""
        ...

    def list_recursive(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with `prefix` (no delimiter)."""
        ...

    def delete(self, key: str) -> None:
        """Delete `key`; deleting a missing key is not an error."""
        ...

    def delete_many(self, keys: list[str]) -> None:
        ...

    def copy(self, src: str, dst: str, metadata: dict[str, str] | None = None) -> str:
        """Server-side copy (multipart copy above 5 GiB); metadata None keeps the source's."""
        ...

    def create_multipart(self, key: str, metadata: dict[str, str],
                         checksum: bool = False) -> str:
        """Returns the upload id. `checksum`: S3 keeps the object's CRC-32C (FULL_OBJECT),
        and its Complete must give every part's."""
        ...

    def upload_part(self, key: str, upload_id: str, part_number: int,
                    body: bytes | memoryview | BinaryIO, checksum: bool = False) -> str:
        """Returns the part's ETag; a file-like body is read from its current position,
        unless it is a PiecewiseBody that the store sends piece by piece instead.
        `checksum`: declare the body's CRC-32C, so that S3 rejects a body that does not
        match (as a trailer taken while the body streams where the endpoint takes one,
        else in a header, from a first pass over the body)."""
        ...

    def put_body(self, key: str, body: bytes | memoryview | BinaryIO,
                 checksum: bool = False) -> str:
        """PutObject of a body sent as `upload_part` sends a part's; returns the ETag."""
        ...

    def upload_part_copy(self, key: str, upload_id: str, part_number: int,
                         src_key: str, start: int, end: int) -> str:
        """Copy bytes [start, end) of `src_key` as a part; returns the part's ETag."""
        ...

    def complete_multipart(self, key: str, upload_id: str,
                           parts: list[tuple[int, str]], crcs: list[int] | None = None,
                           full_crc: int | None = None) -> str:
        """Complete with (part_number, etag) pairs in order; returns the object's ETag.
        `crcs`, `full_crc`: each part's and the whole object's CRC-32C (an upload created
        with `checksum`)."""
        ...

    def abort_multipart(self, key: str, upload_id: str) -> None:
        """Abort; an unknown upload id is not an error."""
        ...

    def list_parts(self, key: str, upload_id: str) -> dict[int, str]:
        """Part number -> ETag of an open upload; raises NoSuchUpload if it is gone."""
        ...

    def list_multipart_uploads(self, prefix: str) -> list[PendingUpload]:
        ...

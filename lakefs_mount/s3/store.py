"""`ObjectStore` on boto3: with `lean` (the lean transport) and `failures` (what a failed
request means), the only modules of lakefs-mount that import boto3/botocore.

Every botocore failure is turned into one of the `objectstore` exceptions with a
message meant for a human (never containing credentials), so the rest of the code
base can report S3 problems without knowing anything about botocore.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import boto3
import botocore.exceptions as bce
import botocore.session
import crc32c
from botocore.config import Config

from lakefs_mount.filespan import FileSpan
from lakefs_mount.s3.crc import decode_crc, encode_crc
from lakefs_mount.s3.failures import Failures
from lakefs_mount.s3.lean import LeanTransport, listing_pages
from lakefs_mount.s3.objectstore import (
    AccessDenied,
    Listing,
    NoSuchKey,
    NoSuchUpload,
    ObjectInfo,
    ObjectStoreError,
    PartCopyUnsupported,
    PendingUpload,
    PiecewiseBody,
    ReadCheck,
)
from lakefs_mount.s3.replies import (
    META_PREFIX,
    info_from_headers,
    quote_etag,
    read_body,
    strip_etag,
)
from lakefs_mount.s3.retry import retried
from lakefs_mount.s3.timeouts import BASE_SECONDS, CONNECT_SECONDS, RequestTimeouts
from lakefs_mount.s3.trailer import TrailedBody

__all__ = ["S3ObjectStore", "MAX_COPY_OBJECT_SIZE", "COPY_PART_SIZE"]

MAX_COPY_OBJECT_SIZE = 5 * 1024**3  # CopyObject refuses sources larger than 5 GiB
COPY_PART_SIZE = 1024**3  # part size of the multipart copy used above that limit
DELETE_BATCH = 1000  # DeleteObjects accepts at most 1000 keys
CRC_HEADER = "x-amz-checksum-crc32c"  # S3 checks the body against it (BadDigest if not)
FULL_OBJECT = {"ChecksumAlgorithm": "CRC32C", "ChecksumType": "FULL_OBJECT"}
STREAM_PIECE = 1024 * 1024  # GET bodies are read and handed on in pieces of this size
# A GET of a whole object asks for its stored CRC-32C, to check the body against (no more
# rights than the GET: on AWS a KMS-encrypted object's GET needs kms:Decrypt anyway)
CHECKSUM_MODE = {"x-amz-checksum-mode": "ENABLED"}


def _stored_crc(info: ObjectInfo) -> int | None:
    """The CRC-32C S3 keeps for the whole object, if it keeps one and sent it."""
    return None if info.crc32c is None else decode_crc(info.crc32c)


def _client_config(endpoint_url: str | None, max_pool: int, connect_timeout: float,
                   read_timeout: float) -> Config:
    """Build the botocore Config; checksum options only where this botocore has them.

    botocore >= 1.36 adds CRC checksums to every request by default, which several
    S3-compatible servers (SeaweedFS included) reject or mangle, hence "when_required".
    Bodies are sent as UNSIGNED-PAYLOAD (what boto3 itself does over HTTPS): over plain
    HTTP botocore would otherwise read every part twice, once only to SHA-256 it for the
    signature; the headers are still signed.
    botocore makes one attempt per request: retries follow lakefs-mount's own policy
    (`retry`).
    """
    kwargs: dict[str, Any] = {
        "connect_timeout": connect_timeout,
        "read_timeout": read_timeout,
        "retries": {"mode": "standard", "total_max_attempts": 1},
        "max_pool_connections": max_pool,
    }
    kwargs["s3"] = {"payload_signing_enabled": False}
    if endpoint_url:
        kwargs["s3"]["addressing_style"] = "path"
    options = getattr(Config, "OPTION_DEFAULTS", {})
    if "request_checksum_calculation" in options:
        kwargs["request_checksum_calculation"] = "when_required"
    if "response_checksum_validation" in options:
        kwargs["response_checksum_validation"] = "when_required"
    return Config(**kwargs)


def _crc_first(body: bytes | memoryview | BinaryIO) -> int:
    """The CRC-32C of a body whose checksum goes in a header: a pass before sending it
    (a file-like body is read from its position, then put back there)."""
    if isinstance(body, bytes | memoryview):
        return int(crc32c.crc32c(body))
    crc = 0
    if hasattr(body, "pieces"):
        if hasattr(body, "sent_crc"):  # it hashes what it yields (see PiecewiseBody)
            for _ in body.pieces():
                pass
            inner: int | None = getattr(body, "sent_crc", None)
            if inner is not None:
                return inner
        for piece in body.pieces():
            crc = crc32c.crc32c(piece, crc)
        return crc
    start = body.tell()
    while chunk := body.read(STREAM_PIECE):
        crc = crc32c.crc32c(chunk, crc)
    body.seek(start)
    return crc


class S3ObjectStore:
    """One bucket of an S3(-compatible) endpoint; safe to share between threads.

    boto3 clients are thread-safe once created, so a single client (with a connection
    pool of `max_pool`) serves all worker threads of the daemon. Optional: `access_key`
    and `secret_key` (the embedded server, the tests), `connect_timeout`, `read_timeout`
    and `max_attempts` (the start-up probe, callers that retry themselves, the tests).
    Every request is bounded by `timeouts` (`read_timeout` is their base): scaled to its
    bytes on the lean path, and through the botocore client whose read timeout is the
    next rung above its bound (`_botocore`) otherwise.
    """

    def __init__(self, bucket: str, *, endpoint_url: str | None = None,
                 region: str | None = None, profile: str | None = None,
                 max_pool: int = 32, access_key: str | None = None,
                 secret_key: str | None = None, connect_timeout: float = CONNECT_SECONDS,
                 read_timeout: float = BASE_SECONDS, max_attempts: int = 3) -> None:
        self.bucket = bucket
        self.endpoint_url = endpoint_url
        settings = botocore.session.Session()  # (its settings are read by LeanTransport too)
        try:
            session = boto3.session.Session(
                botocore_session=settings,
                profile_name=profile,
                aws_access_key_id=access_key,
                aws_secret_access_key=secret_key,
            )
        except bce.ProfileNotFound as exc:
            raise AccessDenied(
                f"AWS profile {profile!r} is not defined in the AWS config/credentials files"
            ) from exc
        # A custom endpoint (SeaweedFS, MinIO, ...) does not care about the region but
        # SigV4 needs one; AWS itself needs the real one (taken from the profile/env).
        region = region or session.region_name or ("us-east-1" if endpoint_url else None)
        self.region = region
        self._where = endpoint_url or f"AWS S3 ({region or 'default region'})"
        self._errors = Failures(bucket, self._where, region)
        self.timeouts = RequestTimeouts(connect=connect_timeout, base=read_timeout)

        def client(read_timeout: float) -> Any:
            return session.client("s3", endpoint_url=endpoint_url, region_name=region,
                                  config=_client_config(endpoint_url, max_pool,
                                                        connect_timeout, read_timeout))

        self._new_client = client
        self._client = client(read_timeout)
        self._clients: dict[float, Any] = {read_timeout: self._client}
        self._clients_lock = threading.Lock()
        self._lean = LeanTransport(session, settings, self._client, bucket, region,
                                   max_pool, self.timeouts)
        self.max_attempts = max(1, max_attempts)  # per call, transient failures (`retry`)
        # The endpoint takes a part's CRC-32C as an aws-chunked trailer and checks it
        # (s3/checksums probes it): parts are then read once, not hashed first.
        self.trailing_checksums = False
        # It checks a part's CRC-32C in the header (s3/checksums probes it): on a plain
        # TCP connection a part whose CRC is taken first (a read, a hash) then goes from
        # the cache file by sendfile, cheaper than a trailer (a read, a hash, a copy
        # into the socket): bytes changed in between are refused (BadDigest).
        self.checked_checksums = False

    @property
    def parts_from_file(self) -> bool:
        """Parts that offer a `file_span` go by sendfile (see `checked_checksums`)."""
        return self.checked_checksums and self._lean.plain

    def __repr__(self) -> str:
        return f"S3ObjectStore(bucket={self.bucket!r}, endpoint={self._where!r})"

    def _botocore(self, seconds: float) -> Any:
        """The botocore client for a request bounded by `seconds`: botocore's timeouts
        are per client, so there is one per rung (base x 2^k), made when first needed."""
        rung = self.timeouts.rung(seconds)
        with self._clients_lock:  # (boto3 sessions may not make clients concurrently)
            if rung not in self._clients:
                self._clients[rung] = self._new_client(rung)
            return self._clients[rung]

    # ------------------------------------------------------------- bucket level

    @retried
    def check_bucket(self) -> None:
        """HeadBucket: 404/403 come back without an error body, so map by HTTP status."""
        with self._errors("HeadBucket"):
            self._lean.send("HeadBucket", "HEAD", "").raw.release_conn()

    @retried
    def create_bucket(self) -> None:
        """Create the bucket (embedded server and tests only); existing is fine."""
        try:
            with self._errors("CreateBucket"):
                self._client.create_bucket(Bucket=self.bucket)
        except ObjectStoreError as exc:
            if exc.code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                return
            raise

    @retried
    def delete_bucket(self) -> None:
        """Delete the bucket (tests only); SeaweedFS allows it even when not empty."""
        with self._errors("DeleteBucket"):
            self._client.delete_bucket(Bucket=self.bucket)

    # ------------------------------------------------------------------ objects

    @retried
    def head(self, key: str, checksum: bool = False) -> ObjectInfo | None:
        try:
            with self._errors("HeadObject", key):
                response = self._lean.send(
                    "HeadObject", "HEAD", key,
                    headers=dict(CHECKSUM_MODE) if checksum else None)
                response.raw.release_conn()
        except NoSuchKey:
            return None
        return info_from_headers(key, response.headers)

    @retried
    def get(self, key: str) -> tuple[ObjectInfo, bytes] | None:
        try:
            with self._errors("GetObject", key):
                response = self._lean.send("GetObject", "GET", key, dict(CHECKSUM_MODE))
                info = info_from_headers(key, response.headers)
                check = ReadCheck(f"GET {key}", _stored_crc(info))
                pieces = []
                for piece in read_body(response):
                    check.add(piece)
                    pieces.append(piece)
                check.done()
        except NoSuchKey:
            return None
        return info, b"".join(pieces)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        pieces: list[bytes] = []
        self.get_range_into(key, start, end, lambda _offset, piece: pieces.append(piece))
        return b"".join(pieces)

    @retried
    def get_range_into(self, key: str, start: int, end: int,
                       write: Callable[[int, bytes], None], if_match: str | None = None,
                       expect_crc: int | None = None, whole: bool = False) -> tuple[int, bool]:
        if start < 0 or end <= start:
            return 0, False
        whole = whole and start == 0
        done = 0
        headers = dict(CHECKSUM_MODE) if whole else {"Range": f"bytes={start}-{end - 1}"}
        if if_match is not None:  # only that version (else 412 PreconditionFailed)
            headers["If-Match"] = f'"{if_match}"'
        try:
            with self._errors("GetObject", key):
                response = self._lean.send("GetObject", "GET", key, headers)
                if whole:
                    info = info_from_headers(key, response.headers)
                    if info.size != end:  # not the object the caller knows: its first bytes
                        whole = False
                        response.raw.close()  # (the rest is not read: not reused)
                        return self.get_range_into(key, start, end, write, if_match)
                    expect_crc = _stored_crc(info) if expect_crc is None else expect_crc
                check = ReadCheck(f"GET {key} bytes {start}-{end - 1}", expect_crc)
                for piece in read_body(response, STREAM_PIECE):
                    check.add(piece)
                    write(start + done, piece)
                    done += len(piece)
                checked = check.done()
        except ObjectStoreError as exc:
            if exc.code == "InvalidRange" or exc.status == 416:
                return 0, False  # start is at or past the end of the object
            raise
        return done, checked

    @retried
    def put(self, key: str, body: bytes | memoryview, metadata: dict[str, str],
            crc: int | None = None) -> str:
        data = body if isinstance(body, bytes) else bytes(body)
        headers = {META_PREFIX + name: value for name, value in metadata.items()}
        if crc is not None:
            headers[CRC_HEADER] = encode_crc(crc)
        return self._lean_put("PutObject", key, headers, data)

    @retried
    def put_piecewise(self, key: str, body: PiecewiseBody, checksum: bool = False) -> str:
        """PutObject of a body sent piece by piece, its CRC-32C as a trailer with
        `checksum` (the checksum probe; the lean path's own connections only)."""
        if not self._lean.direct:
            raise ObjectStoreError("a piecewise PUT needs a direct connection to S3")
        trailed = TrailedBody(body) if checksum else None
        return self._lean_put("PutObject", key, {} if trailed is None else trailed.headers,
                              body if trailed is None else trailed)

    def _lean_put(self, op: str, key: str, headers: dict[str, str],
                  body: bytes | PiecewiseBody, query: dict[str, str] | None = None,
                  span: FileSpan | None = None) -> str:
        """A PUT the lean path sends (an object, a part), given time for its bytes;
        returns the ETag. `span`: where the kernel sends the body from (sendfile)."""
        with self._errors(op, key):
            response = self._lean.send(op, "PUT", key, headers, body, query,
                                       self.timeouts.transfer(len(body)), span)
            b"".join(read_body(response))
        return strip_etag(response.headers.get("ETag"))

    @retried
    def list_dir(self, prefix: str) -> Listing:
        objects: list[ObjectInfo] = []
        prefixes: list[str] = []
        with self._errors("ListObjectsV2", prefix):
            for page_objects, page_prefixes in listing_pages(self._lean, prefix, "/"):
                objects.extend(page_objects)
                prefixes.extend(page_prefixes)
        return Listing(objects=objects, prefixes=prefixes)

    def list_recursive(self, prefix: str) -> Iterator[ObjectInfo]:
        with self._errors("ListObjectsV2", prefix):
            for page_objects, _ in listing_pages(self._lean, prefix, None):
                yield from page_objects

    @retried
    def delete(self, key: str) -> None:
        try:
            with self._errors("DeleteObject", key):
                self._botocore(self.timeouts.small()).delete_object(Bucket=self.bucket, Key=key)
        except NoSuchKey:
            pass

    @retried
    def delete_many(self, keys: list[str]) -> None:
        for i in range(0, len(keys), DELETE_BATCH):
            batch = keys[i:i + DELETE_BATCH]
            with self._errors("DeleteObjects", batch[0]):
                resp = self._botocore(self.timeouts.delete_batch(len(batch))).delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
                )
            errors = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                raise ObjectStoreError(
                    f"S3 DeleteObjects failed for {len(errors)} key(s) of bucket"
                    f" '{self.bucket}', e.g. '{first.get('Key')}': {first.get('Code')}:"
                    f" {first.get('Message')}")

    @retried
    def copy(self, src: str, dst: str, metadata: dict[str, str] | None = None) -> str:
        info = self.head(src)
        if info is None:
            raise NoSuchKey(f"'s3://{self.bucket}/{src}' does not exist (copy source)")
        if info.size > MAX_COPY_OBJECT_SIZE:
            return self._multipart_copy(src, dst, info.size,
                                        info.metadata if metadata is None else metadata)
        kwargs: dict[str, Any] = {"MetadataDirective": "COPY"}
        if metadata is not None:
            kwargs = {"MetadataDirective": "REPLACE", "Metadata": dict(metadata)}
        with self._errors("CopyObject", dst):
            resp = self._botocore(self.timeouts.copy(info.size)).copy_object(
                Bucket=self.bucket, Key=dst,
                CopySource={"Bucket": self.bucket, "Key": src}, **kwargs)
        return strip_etag(resp.get("CopyObjectResult", {}).get("ETag"))

    def _multipart_copy(self, src: str, dst: str, size: int,
                        metadata: dict[str, str]) -> str:
        """CopyObject stops at 5 GiB: copy in 1 GiB UploadPartCopy parts instead."""
        upload_id = self.create_multipart(dst, metadata)
        try:
            parts = []
            for number, start in enumerate(range(0, size, COPY_PART_SIZE), start=1):
                end = min(start + COPY_PART_SIZE, size)
                parts.append((number, self.upload_part_copy(dst, upload_id, number, src,
                                                            start, end)))
            return self.complete_multipart(dst, upload_id, parts)
        except BaseException:
            try:
                self.abort_multipart(dst, upload_id)
            except ObjectStoreError:
                pass
            raise

    # ---------------------------------------------------------------- multipart

    @retried
    def create_multipart(self, key: str, metadata: dict[str, str],
                         checksum: bool = False) -> str:
        with self._errors("CreateMultipartUpload", key):
            resp = self._botocore(self.timeouts.small()).create_multipart_upload(
                Bucket=self.bucket, Key=key, Metadata=dict(metadata),
                **(FULL_OBJECT if checksum else {}))
        return str(resp["UploadId"])

    @retried
    def upload_part(self, key: str, upload_id: str, part_number: int,
                    body: bytes | memoryview | BinaryIO, checksum: bool = False) -> str:
        def by_botocore(data: object, extra: dict[str, str], size: int) -> dict[str, object]:
            return self._botocore(self.timeouts.transfer(size)).upload_part(
                Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=part_number,
                Body=data, **extra)

        return self._put_body("UploadPart", key, body, checksum, by_botocore,
                              {"partNumber": str(part_number), "uploadId": upload_id})

    @retried
    def put_body(self, key: str, body: bytes | memoryview | BinaryIO,
                 checksum: bool = False) -> str:
        def by_botocore(data: object, extra: dict[str, str], size: int) -> dict[str, object]:
            return self._botocore(self.timeouts.transfer(size)).put_object(
                Bucket=self.bucket, Key=key, Body=data, **extra)

        return self._put_body("PutObject", key, body, checksum, by_botocore)

    def _put_body(self, op: str, key: str, body: bytes | memoryview | BinaryIO,
                  checksum: bool, by_botocore: Callable[[object, dict[str, str], int],
                                                        dict[str, object]],
                  query: dict[str, str] | None = None) -> str:
        """A part's or object's body, sent by the lean path where it can (from a file
        span or piece by piece), else by botocore (`by_botocore(data, extra args, size)`)."""
        piecewise = hasattr(body, "pieces") and self._lean.direct
        offers = piecewise and checksum and self.parts_from_file and hasattr(body, "file_span")
        span: FileSpan | None = body.file_span() if offers else None  # type: ignore[union-attr]
        if piecewise and checksum and self.trailing_checksums and span is None:
            trailed = TrailedBody(body)  # type: ignore[arg-type]
            return self._lean_put(op, key, trailed.headers, trailed, query)
        crc = _crc_first(body) if checksum else None  # (the header goes before the body)
        if piecewise:
            # by the kernel from the span, or piece by piece as the body reads them: a
            # fraction of the CPU of botocore, which takes 16 KiB at a time, each sliced
            # from a copy
            headers = {} if crc is None else {CRC_HEADER: encode_crc(crc)}
            return self._lean_put(op, key, headers, body,  # type: ignore[arg-type]
                                  query, span)
        data = body if isinstance(body, bytes) or hasattr(body, "read") else bytes(body)
        size = len(data) if hasattr(data, "__len__") else 0  # (any file-like: base only)
        extra = {} if crc is None else {"ChecksumCRC32C": encode_crc(crc)}
        with self._errors(op, key):
            resp = by_botocore(data, extra, size)
        return strip_etag(resp.get("ETag"))  # type: ignore[arg-type]

    @retried
    def upload_part_copy(self, key: str, upload_id: str, part_number: int,
                         src_key: str, start: int, end: int) -> str:
        with self._errors("UploadPartCopy", key):
            resp = self._botocore(self.timeouts.copy(end - start)).upload_part_copy(
                Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=part_number,
                CopySource={"Bucket": self.bucket, "Key": src_key},
                CopySourceRange=f"bytes={start}-{end - 1}")
        etag = strip_etag(resp.get("CopyPartResult", {}).get("ETag"))
        if not etag:
            # rclone serve s3 takes an UploadPartCopy for an UploadPart of no bytes: 200,
            # no ETag, a part of 0 bytes, and InvalidPart only at the Complete
            # (docs/compatibility.md). Say so here, not "InvalidPart" later.
            raise PartCopyUnsupported(
                f"S3 UploadPartCopy on 's3://{self.bucket}/{key}' answered without an "
                f"ETag: this endpoint does not copy parts (UploadPartCopy)")
        return etag

    @retried
    def complete_multipart(self, key: str, upload_id: str,
                           parts: list[tuple[int, str]], crcs: list[int] | None = None,
                           full_crc: int | None = None) -> str:
        """`crcs` (each part's, in order) and `full_crc` (the whole object's) complete an
        upload created with `checksum`, which S3 requires and checks."""
        listed: list[dict[str, Any]] = [{"PartNumber": n, "ETag": quote_etag(etag)}
                                        for n, etag in parts]
        extra: dict[str, Any] = {}
        if crcs is not None:
            for part, crc in zip(listed, crcs, strict=True):
                part["ChecksumCRC32C"] = encode_crc(crc)
        if full_crc is not None:
            extra = {"ChecksumCRC32C": encode_crc(full_crc), "ChecksumType": "FULL_OBJECT"}
        with self._errors("CompleteMultipartUpload", key):
            resp = self._botocore(self.timeouts.complete(len(parts))).complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id,
                MultipartUpload={"Parts": listed}, **extra)
        return strip_etag(resp.get("ETag"))

    @retried
    def abort_multipart(self, key: str, upload_id: str) -> None:
        try:
            with self._errors("AbortMultipartUpload", key):
                self._botocore(self.timeouts.small()).abort_multipart_upload(
                    Bucket=self.bucket, Key=key, UploadId=upload_id)
        except NoSuchUpload:
            pass

    @retried
    def list_parts(self, key: str, upload_id: str) -> dict[int, str]:
        parts: dict[int, str] = {}
        paginator = self._botocore(self.timeouts.small()).get_paginator("list_parts")
        with self._errors("ListParts", key):
            for page in paginator.paginate(Bucket=self.bucket, Key=key, UploadId=upload_id):
                for part in page.get("Parts", []):
                    parts[int(part["PartNumber"])] = strip_etag(part.get("ETag"))
        return parts

    @retried
    def list_multipart_uploads(self, prefix: str) -> list[PendingUpload]:
        uploads: list[PendingUpload] = []
        paginator = self._botocore(self.timeouts.small()).get_paginator(
            "list_multipart_uploads")
        with self._errors("ListMultipartUploads", prefix):
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                uploads.extend(PendingUpload(key=u["Key"], upload_id=u["UploadId"])
                               for u in page.get("Uploads", []))
        return uploads

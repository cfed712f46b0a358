"""`ObjectStore` on boto3: the only module of lakefs-mount that imports boto3/botocore.

Every botocore failure is turned into one of the `objectstore` exceptions with a
message meant for a human (never containing credentials), so the rest of the code
base can report S3 problems without knowing anything about botocore.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO, NoReturn
from urllib.parse import quote, urlsplit

import boto3
import botocore.exceptions as bce
import botocore.session
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.httpsession import URLLib3Session, get_cert_path
from botocore.utils import get_environ_proxies

from lakefs_mount.s3.objectstore import (
    AccessDenied,
    EndpointUnreachable,
    Listing,
    NoSuchBucket,
    NoSuchKey,
    NoSuchUpload,
    ObjectInfo,
    ObjectStoreError,
    PendingUpload,
    PiecewiseBody,
    RequestTimedOut,
)
from lakefs_mount.s3.replies import (
    META_PREFIX,
    BodyLost,
    ErrorReply,
    info_from_headers,
    parse_listing_page,
    quote_etag,
    read_body,
    strip_etag,
)
from lakefs_mount.s3.retry import TRANSIENT_CODES, TRANSIENT_STATUS, retried
from lakefs_mount.s3.timeouts import BASE_SECONDS, CONNECT_SECONDS, RequestTimeouts
from lakefs_mount.s3.wire import (
    CertificateRefused,
    ConnectFailed,
    ConnectionLost,
    ConnectTimedOut,
    Keys,
    ReadTimedOut,
    WireError,
    WirePool,
    canonical_query,
    sign,
)

__all__ = ["S3ObjectStore", "MAX_COPY_OBJECT_SIZE", "COPY_PART_SIZE"]

MAX_COPY_OBJECT_SIZE = 5 * 1024**3  # CopyObject refuses sources larger than 5 GiB
COPY_PART_SIZE = 1024**3  # part size of the multipart copy used above that limit
DELETE_BATCH = 1000  # DeleteObjects accepts at most 1000 keys
STREAM_PIECE = 1024 * 1024  # GET bodies are read and handed on in pieces of this size

_AUTH_CODES = frozenset({
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden", "403",
    "ExpiredToken", "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled",
    "InvalidSecurity",
})
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
# What each connection failure means to a user (the class name means nothing to them).
_CONNECT_FAILURES: dict[type, str] = {
    bce.EndpointConnectionError: "could not connect",
    ConnectFailed: "could not connect",
    bce.ConnectTimeoutError: "could not connect: connection timed out",
    ConnectTimedOut: "could not connect: connection timed out",
    bce.ConnectionClosedError: "the connection was closed",
    ConnectionLost: "the connection was closed",
}


def _client_config(endpoint_url: str | None, max_pool: int, connect_timeout: float,
                   read_timeout: float) -> Config:
    """Build the botocore Config; checksum options only where this botocore has them.

    botocore >= 1.36 adds CRC checksums to every request by default, which several
    S3-compatible servers (SeaweedFS included) reject or mangle, hence "when_required".
    Bodies are sent as UNSIGNED-PAYLOAD (what boto3 itself does over HTTPS): over plain
    HTTP botocore would otherwise read every part twice, once only to SHA-256 it for the
    signature, which cost ~0.85 CPU s/GiB here; the headers are still signed.
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


class _Lean:
    """GET, HEAD and PUT of one object and listings, signed and sent without botocore's
    pipeline.

    These are the requests whose number grows with the number of files (small-file
    reads, `ls -l`, small-file commits, listing pages of thousands of keys). botocore's
    `get_object` spends most of its CPU on parameter validation, endpoint rules, event
    hooks and response parsing, all under the daemon's one GIL; signed and sent by
    `wire` the same request costs a fifth of that (benchmarks/README.md, "Figures behind
    the design"). So `wire` carries them, with the client's endpoint,
    addressing style, credentials (refreshed as botocore refreshes them), timeouts and
    TLS verification; where botocore would go through a proxy or present a client
    certificate, they take a botocore HTTP session set up as botocore sets up its own
    (public settings only: the client's config, the session's `ca_bundle`, the
    environment's proxies). One attempt per request, as
    for botocore's calls (`retry` decides about more). Unlike botocore it does not follow
    S3's redirects to a bucket's region: `check_bucket` goes this way too, so a wrong
    region fails at mount time, naming the right one.
    """

    def __init__(self, session: boto3.session.Session, settings: botocore.session.Session,
                 client: Any, bucket: str, region: str | None, max_pool: int,
                 timeouts: RequestTimeouts) -> None:
        self._credentials = session.get_credentials()
        self._client = client
        self._bucket = bucket
        self._region = region or "us-east-1"
        self._config = client.meta.config
        # The CA bundle botocore's client verifies with (AWS_CA_BUNDLE, the profile's
        # ca_bundle, then REQUESTS_CA_BUNDLE), read where botocore reads it.
        self._verify: bool | str = (settings.get_config_variable("ca_bundle")
                                    or os.environ.get("REQUESTS_CA_BUNDLE") or True)
        self._http: URLLib3Session | None = None  # through a proxy or with a client cert
        self._max_idle = max_pool
        self.timeouts = timeouts
        self._origin = ""  # scheme://host[:port] and the bucket's path, as botocore
        self._prefix = ""  # addresses it (path or virtual-host style): set on first use
        self._wire: WirePool | None = None

    def _address(self) -> None:
        probe = self._client.generate_presigned_url(
            "get_object", Params={"Bucket": self._bucket, "Key": "k"}, ExpiresIn=60)
        parts = urlsplit(probe)
        origin = f"{parts.scheme}://{parts.netloc}"
        self._prefix = parts.path[:-1]
        proxies = self._config.proxies or get_environ_proxies(probe)
        if proxies.get(parts.scheme) or self._config.client_cert:
            self._http = URLLib3Session(  # (its read timeout bounds each wait for a byte)
                verify=self._verify, proxies=proxies,
                timeout=(self.timeouts.connect, self.timeouts.base),
                max_pool_connections=self._max_idle, client_cert=self._config.client_cert,
                proxies_config=self._config.proxies_config)
        else:
            verify = self._verify
            self._wire = WirePool(origin, verify=verify if verify is False
                                  else get_cert_path(verify), max_idle=self._max_idle,
                                  connect_timeout=self.timeouts.connect,
                                  read_timeout=self.timeouts.base)
        self._origin = origin  # last: threads that see it see the rest too

    @property
    def direct(self) -> bool:
        """Whether requests go out on wire's connections (no proxy, no client
        certificate), which take a PiecewiseBody."""
        if not self._origin:
            self._address()
        return self._wire is not None

    def send(self, op: str, method: str, key: str, headers: dict[str, str] | None = None,
             body: bytes | PiecewiseBody = b"", query: dict[str, str] | None = None,
             timeout: float | None = None) -> Any:
        """One signed request; raises ErrorReply for non-2xx, WireError for a failed
        connection or one that took longer than `timeout` (`timeouts.small()` if None;
        an answer's body gets time for its bytes on top).
        The response has `status_code`, `headers` and the body stream as `raw`."""
        if self._credentials is None:
            raise bce.NoCredentialsError()
        if not self._origin:
            self._address()
        target = self._prefix + quote(key, safe="/~")
        if query:  # SigV4 signs the query string as sent: escape it the way it wants
            target += "?" + canonical_query(query)
        response = self._send_once(method, target, headers or {}, body,
                                   self.timeouts.small() if timeout is None else timeout)
        if response.status_code < 300:
            return response
        content = b"" if method == "HEAD" else response.raw.read()
        response.raw.release_conn()
        raise ErrorReply.parse(response.status_code, content,
                               response.headers.get("x-amz-bucket-region"))

    def _send_once(self, method: str, target: str, headers: dict[str, str],
                   body: bytes | PiecewiseBody, timeout: float) -> Any:
        frozen = self._credentials.get_frozen_credentials()
        if self._wire is None:
            assert isinstance(body, bytes) and self._http is not None
            request = AWSRequest(method=method, url=self._origin + target,
                                 headers=dict(headers), data=body, stream_output=True)
            request.context["client_config"] = self._config
            S3SigV4Auth(frozen, "s3", self._region).add_auth(request)
            return self._http.send(request.prepare())
        path, _, query = target.partition("?")
        signed = sign(method, self._wire.host, path, query, headers,
                      Keys(frozen.access_key, frozen.secret_key, frozen.token),
                      self._region)
        return self._wire.request(method, target, signed, body, timeout=timeout,
                                  per_byte=self.timeouts.per_byte())


def _listing_pages(lean: _Lean, prefix: str, delimiter: str | None
                   ) -> Iterator[tuple[list[ObjectInfo], list[str]]]:
    """ListObjectsV2 page by page: (objects, common prefixes) of each page."""
    query = {"list-type": "2", "prefix": prefix, "encoding-type": "url"}
    if delimiter:
        query["delimiter"] = delimiter
    while True:
        response = lean.send("ListObjectsV2", "GET", "", query=query)
        objects, prefixes, token = parse_listing_page(b"".join(read_body(response)), prefix)
        yield objects, prefixes
        if token is None:
            return
        query["continuation-token"] = token


def _transient(exc: Exception) -> bool:
    """Whether a failure is one another attempt may fix (as botocore's standard mode
    judges: throttling, 5xx, connections refused, reset or timed out)."""
    if isinstance(exc, ErrorReply):
        return exc.status in TRANSIENT_STATUS or exc.code in TRANSIENT_CODES
    if isinstance(exc, WireError):
        return not isinstance(exc, CertificateRefused)
    return isinstance(exc, bce.EndpointConnectionError | bce.ConnectionClosedError
                      | bce.ReadTimeoutError | bce.ConnectTimeoutError
                      | bce.ResponseStreamingError | bce.IncompleteReadError)


class S3ObjectStore:
    """One bucket of an S3(-compatible) endpoint; safe to share between threads.

    boto3 clients are thread-safe once created, so a single client (with a connection
    pool of `max_pool`) serves all worker threads of the daemon. `access_key`,
    `secret_key`, `connect_timeout`, `read_timeout` and `max_attempts` are optional
    extras beyond the design card, used by the embedded server and the tests.
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
        settings = botocore.session.Session()  # (its settings are read by _Lean too)
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
        self.timeouts = RequestTimeouts(connect=connect_timeout, base=read_timeout)

        def client(read_timeout: float) -> Any:
            return session.client("s3", endpoint_url=endpoint_url, region_name=region,
                                  config=_client_config(endpoint_url, max_pool,
                                                        connect_timeout, read_timeout))

        self._new_client = client
        self._client = client(read_timeout)
        self._clients: dict[float, Any] = {read_timeout: self._client}
        self._clients_lock = threading.Lock()
        self._lean = _Lean(session, settings, self._client, bucket, region, max_pool,
                           self.timeouts)
        self.max_attempts = max(1, max_attempts)  # per call, transient failures (`retry`)

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

    # ------------------------------------------------------------------ errors

    def _raise(self, exc: Exception, op: str, key: str | None) -> NoReturn:
        """Translate a failure (S3's error reply, botocore's or the lean transport's
        exception) into the interface's exceptions."""
        where = f"'s3://{self.bucket}/{key}'" if key is not None else f"bucket '{self.bucket}'"
        reply = ErrorReply.of(exc) if isinstance(exc, bce.ClientError) else exc
        if isinstance(reply, ErrorReply):
            code, status = reply.code, reply.status
            if code == "NoSuchBucket" or (op == "HeadBucket" and status == 404):
                raise NoSuchBucket(
                    f"bucket '{self.bucket}' does not exist at {self._where}; check the name "
                    f"and the endpoint (--endpoint-url, --region), or create it") from exc
            if code in _AUTH_CODES or status == 403:
                raise AccessDenied(
                    f"access denied to bucket '{self.bucket}' at {self._where} ({code or status}):"
                    " check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, the"
                    " profile) and that they grant access to this bucket") from exc
            if code == "NoSuchUpload":
                raise NoSuchUpload(
                    f"multipart upload of {where} does not exist (aborted, completed or"
                    " expired)") from exc
            if code in _NOT_FOUND_CODES:
                raise NoSuchKey(f"{where} does not exist") from exc
            if status == 301 or code in ("PermanentRedirect", "AuthorizationHeaderMalformed"):
                right = f" ({reply.region})" if reply.region else ""
                raise ObjectStoreError(
                    f"bucket '{self.bucket}' is in another region than {self.region!r}:"
                    f" pass the right region{right}") from exc
            raise ObjectStoreError(f"S3 {op} on {where} failed: {code}:"
                                   f" {reply.message or status}") from exc
        if isinstance(exc, bce.NoCredentialsError | bce.PartialCredentialsError):
            raise AccessDenied(
                f"no usable S3 credentials for bucket '{self.bucket}' at {self._where}: set"
                " AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or pass a profile configured in"
                " ~/.aws/credentials") from exc
        if isinstance(exc, bce.SSLError | CertificateRefused):
            why = exc if isinstance(exc, CertificateRefused) else exc.kwargs.get("error")
            raise EndpointUnreachable(
                f"S3 endpoint {self._where} is unreachable: its TLS certificate was not"
                f" accepted ({why}); if it is signed by a private CA,"
                " point AWS_CA_BUNDLE at that CA's certificate") from exc
        if isinstance(exc, BodyLost):
            raise ObjectStoreError(f"S3 {op} on {where} failed: {exc}") from exc
        if isinstance(exc, ReadTimedOut | bce.ReadTimeoutError):
            raise RequestTimedOut(
                f"S3 {op} on {where} timed out waiting for {self._where} ({exc})") from exc
        if isinstance(exc, bce.EndpointConnectionError | bce.ConnectTimeoutError
                      | bce.ConnectionClosedError | WireError):
            how = _CONNECT_FAILURES.get(type(exc), "could not connect")
            raise EndpointUnreachable(
                f"S3 endpoint {self._where} is unreachable ({how}): is the server running"
                " and the address right?") from exc
        if isinstance(exc, bce.BotoCoreError):
            raise ObjectStoreError(
                f"S3 {op} on {where} failed: {type(exc).__name__}: {exc}") from exc
        raise exc

    @contextmanager
    def _errors(self, op: str, key: str | None = None) -> Iterator[None]:
        try:
            yield
        except (bce.ClientError, bce.BotoCoreError, ErrorReply, WireError) as exc:
            try:
                self._raise(exc, op, key)
            except ObjectStoreError as err:
                reply = ErrorReply.of(exc) if isinstance(exc, bce.ClientError) else exc
                if isinstance(reply, ErrorReply):
                    err.code, err.status = reply.code, reply.status
                err.transient = _transient(reply)
                raise

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
    def head(self, key: str) -> ObjectInfo | None:
        try:
            with self._errors("HeadObject", key):
                response = self._lean.send("HeadObject", "HEAD", key)
                response.raw.release_conn()
        except NoSuchKey:
            return None
        return info_from_headers(key, response.headers)

    @retried
    def get(self, key: str) -> tuple[ObjectInfo, bytes] | None:
        try:
            with self._errors("GetObject", key):
                response = self._lean.send("GetObject", "GET", key)
                data = b"".join(read_body(response))
        except NoSuchKey:
            return None
        return info_from_headers(key, response.headers), data

    def get_range(self, key: str, start: int, end: int) -> bytes:
        pieces: list[bytes] = []
        self.get_range_into(key, start, end, lambda _offset, piece: pieces.append(piece))
        return b"".join(pieces)

    @retried
    def get_range_into(self, key: str, start: int, end: int,
                       write: Callable[[int, bytes], None], if_match: str | None = None) -> int:
        if start < 0 or end <= start:
            return 0
        done = 0
        headers = {"Range": f"bytes={start}-{end - 1}"}
        if if_match is not None:  # only that version (else 412 PreconditionFailed)
            headers["If-Match"] = f'"{if_match}"'
        try:
            with self._errors("GetObject", key):
                response = self._lean.send("GetObject", "GET", key, headers)
                for piece in read_body(response, STREAM_PIECE):
                    write(start + done, piece)
                    done += len(piece)
        except ObjectStoreError as exc:
            if exc.code == "InvalidRange" or exc.status == 416:
                return 0  # start is at or past the end of the object
            raise
        return done

    @retried
    def put(self, key: str, body: bytes | memoryview, metadata: dict[str, str]) -> str:
        data = body if isinstance(body, bytes) else bytes(body)
        headers = {META_PREFIX + name: value for name, value in metadata.items()}
        return self._lean_put("PutObject", key, headers, data)

    def _lean_put(self, op: str, key: str, headers: dict[str, str],
                  body: bytes | PiecewiseBody, query: dict[str, str] | None = None) -> str:
        """A PUT the lean path sends (an object, a part), given time for its bytes;
        returns the ETag."""
        with self._errors(op, key):
            response = self._lean.send(op, "PUT", key, headers, body, query,
                                       self.timeouts.transfer(len(body)))
            b"".join(read_body(response))
        return strip_etag(response.headers.get("ETag"))

    @retried
    def list_dir(self, prefix: str) -> Listing:
        objects: list[ObjectInfo] = []
        prefixes: list[str] = []
        with self._errors("ListObjectsV2", prefix):
            for page_objects, page_prefixes in _listing_pages(self._lean, prefix, "/"):
                objects.extend(page_objects)
                prefixes.extend(page_prefixes)
        return Listing(objects=objects, prefixes=prefixes)

    def list_recursive(self, prefix: str) -> Iterator[ObjectInfo]:
        with self._errors("ListObjectsV2", prefix):
            for page_objects, _ in _listing_pages(self._lean, prefix, None):
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
    def create_multipart(self, key: str, metadata: dict[str, str]) -> str:
        with self._errors("CreateMultipartUpload", key):
            resp = self._botocore(self.timeouts.small()).create_multipart_upload(
                Bucket=self.bucket, Key=key, Metadata=dict(metadata))
        return str(resp["UploadId"])

    @retried
    def upload_part(self, key: str, upload_id: str, part_number: int,
                    body: bytes | memoryview | BinaryIO) -> str:
        if hasattr(body, "pieces") and self._lean.direct:
            # piece by piece as the body reads them: a fraction of the CPU of botocore,
            # which takes 16 KiB at a time, each sliced from a copy
            return self._lean_put("UploadPart", key, {}, body,  # type: ignore[arg-type]
                                  {"partNumber": str(part_number), "uploadId": upload_id})
        data = body if isinstance(body, bytes) or hasattr(body, "read") else bytes(body)
        size = len(data) if hasattr(data, "__len__") else 0  # (any file-like: base only)
        with self._errors("UploadPart", key):
            resp = self._botocore(self.timeouts.transfer(size)).upload_part(
                Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=part_number,
                Body=data)
        return strip_etag(resp.get("ETag"))

    @retried
    def upload_part_copy(self, key: str, upload_id: str, part_number: int,
                         src_key: str, start: int, end: int) -> str:
        with self._errors("UploadPartCopy", key):
            resp = self._botocore(self.timeouts.copy(end - start)).upload_part_copy(
                Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=part_number,
                CopySource={"Bucket": self.bucket, "Key": src_key},
                CopySourceRange=f"bytes={start}-{end - 1}")
        return strip_etag(resp.get("CopyPartResult", {}).get("ETag"))

    @retried
    def complete_multipart(self, key: str, upload_id: str,
                           parts: list[tuple[int, str]]) -> str:
        with self._errors("CompleteMultipartUpload", key):
            resp = self._botocore(self.timeouts.complete(len(parts))).complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id,
                MultipartUpload={"Parts": [{"PartNumber": n, "ETag": quote_etag(etag)}
                                           for n, etag in parts]})
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

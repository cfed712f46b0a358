"""What a failed S3 request means: S3's error replies and botocore's or the lean transport's
exceptions turned into the `objectstore` exceptions, each with a message meant for a human
(never containing credentials) and whether another attempt may fix it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import botocore.exceptions as bce

from lakefs_mount.s3.objectstore import (
    AccessDenied,
    EndpointUnreachable,
    NoSuchBucket,
    NoSuchKey,
    NoSuchUpload,
    ObjectStoreError,
    RequestTimedOut,
)
from lakefs_mount.s3.replies import BodyLost, ErrorReply
from lakefs_mount.s3.retry import TRANSIENT_CODES, TRANSIENT_STATUS
from lakefs_mount.s3.wire import (
    CertificateRefused,
    ConnectFailed,
    ConnectionLost,
    ConnectTimedOut,
    ReadTimedOut,
    WireError,
)

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


class Failures:
    """The failures of requests to one bucket (`bucket` at `where`, in `region`): used as
    `with failures(op, key): ...` around a request, which raises the interface's
    exception in place of the request's own."""

    def __init__(self, bucket: str, where: str, region: str | None) -> None:
        self.bucket = bucket
        self._where = where
        self.region = region

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
            if code in ("BadDigest", "InvalidDigest") and op in ("PutObject", "UploadPart"):
                raise ObjectStoreError(  # (SeaweedFS words it as if about Content-MD5)
                    f"S3 {op} on {where} failed: {code}: the bytes S3 received do not"
                    " match their checksum: corrupted on the way") from exc
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
    def __call__(self, op: str, key: str | None = None) -> Iterator[None]:
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

"""S3's answers, read: error replies, listing pages, object headers, response bodies.

Pure parsing, shared by both ways a request goes out (the lean transport and botocore's
HTTP session): no botocore here, so the one module that knows it (`store`) stays small.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import unquote_plus
from xml.etree import ElementTree

import urllib3.exceptions

from lakefs_mount.s3.objectstore import ObjectInfo, ObjectStoreError
from lakefs_mount.s3.wire import ConnectionLost, ReadTimedOut, WireError

META_PREFIX = "x-amz-meta-"
_ERROR_CODE = re.compile(rb"<Code>([^<]*)</Code>")
_ERROR_MESSAGE = re.compile(rb"<Message>([^<]*)</Message>")


def strip_etag(etag: str | None) -> str:
    """S3 quotes ETags (SeaweedFS sometimes does not); the interface never does."""
    return (etag or "").strip().strip('"')


def quote_etag(etag: str) -> str:
    return f'"{strip_etag(etag)}"'


class ErrorReply(Exception):
    """An S3 error response, however it arrived: on the lean path (`parse`), or as
    botocore's ClientError (`of`). `S3ObjectStore` maps it to the interface's exceptions."""

    def __init__(self, status: int | None, code: str, message: str, region: str) -> None:
        super().__init__(f"{code}: {message}")
        self.status, self.code, self.message, self.region = status, code, message, region

    @classmethod
    def parse(cls, status: int, content: bytes, region: str | None) -> ErrorReply:
        code = _ERROR_CODE.search(content)
        message = _ERROR_MESSAGE.search(content)
        return cls(status, code.group(1).decode() if code else str(status),
                   message.group(1).decode() if message else "", region or "")

    @classmethod
    def of(cls, client_error: Any) -> ErrorReply:
        """From botocore's ClientError (its `response` dict)."""
        response = client_error.response
        err = response.get("Error", {})
        return cls(response.get("ResponseMetadata", {}).get("HTTPStatusCode"),
                   str(err.get("Code", "")), str(err.get("Message", "")),
                   str(err.get("Region", "")))


class BodyLost(WireError):
    """A response body that could not be read whole (cut short, reset, timed out)."""


def read_body(response: Any, piece: int | None = None) -> Iterator[bytes]:
    """The body in pieces, checked against Content-Length; the connection goes back
    to the pool only when the body was read whole."""
    expected = response.headers.get("Content-Length")
    raw = response.raw
    got = 0
    try:
        while data := raw.read(piece):
            got += len(data)
            yield data
            if piece is None:
                break
    except (urllib3.exceptions.ReadTimeoutError, ReadTimedOut) as exc:  # as botocore's
        raw.close()  # StreamingBody does
        raise BodyLost(f"timed out reading the response ({exc})") from exc
    except (urllib3.exceptions.ProtocolError, ConnectionLost) as exc:
        raw.close()
        raise BodyLost(f"the connection was lost reading the response ({exc})") from exc
    except BaseException:
        raw.close()
        raise
    if expected is not None and got != int(expected):
        raw.close()
        raise BodyLost(f"the response ended after {got} of its {expected} bytes")
    raw.release_conn()


def parse_listing_page(content: bytes, prefix: str
                       ) -> tuple[list[ObjectInfo], list[str], str | None]:
    """One ListObjectsV2 page: its objects, its common prefixes, and the continuation
    token of the next page (None on the last)."""
    try:
        root = ElementTree.fromstring(content)
        ns = root.tag[:root.tag.index("}") + 1] if root.tag.startswith("{") else ""
        # Keys come URL-encoded (so that any byte survives XML) when the server says so.
        name = unquote_plus if root.findtext(ns + "EncodingType") == "url" else str
        objects = [ObjectInfo(
            key=name(item.findtext(ns + "Key") or ""),
            size=int(item.findtext(ns + "Size") or 0),
            etag=strip_etag(item.findtext(ns + "ETag")),
            mtime=datetime.fromisoformat(item.findtext(ns + "LastModified") or "")
            .timestamp(),
        ) for item in root.iterfind(ns + "Contents")]
    except (ElementTree.ParseError, ValueError) as exc:
        raise ObjectStoreError(f"S3 ListObjectsV2 of '{prefix}' returned a listing that"
                               f" cannot be read ({exc})") from exc
    prefixes = [name(p.findtext(ns + "Prefix") or "")
                for p in root.iterfind(ns + "CommonPrefixes")]
    token = root.findtext(ns + "NextContinuationToken")
    more = root.findtext(ns + "IsTruncated") == "true" and token
    return objects, prefixes, token if more else None


def info_from_headers(key: str, headers: Any) -> ObjectInfo:
    modified = headers.get("Last-Modified")
    return ObjectInfo(
        key=key,
        size=int(headers.get("Content-Length", 0)),
        etag=strip_etag(headers.get("ETag")),
        mtime=parsedate_to_datetime(modified).timestamp() if modified else 0.0,
        metadata={k.lower()[len(META_PREFIX):]: v for k, v in headers.items()
                  if k.lower().startswith(META_PREFIX)},
        crc32c=_full_object_crc(headers),
    )


def _full_object_crc(headers: Any) -> str | None:
    """x-amz-checksum-crc32c where it is the whole object's (a single PUT, or a multipart
    upload of type FULL_OBJECT), not a composite of its parts' ("...-N")."""
    value = headers.get("x-amz-checksum-crc32c")
    if not value or "-" in value or headers.get("x-amz-checksum-type", "FULL_OBJECT") not in (
            "FULL_OBJECT", ""):
        return None
    return str(value)

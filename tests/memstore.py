"""In-memory `ObjectStore` for fast unit tests of the core.

It follows S3 closely where the core could get S3 wrong (multipart part sizes and
numbers, unknown upload ids, ranges) so that a bug fails here first instead of
against a real server. `calls` counts every method call so tests can assert things
like "the rename did not copy".
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import crc32c

from lakefs_mount.s3.objectstore import (
    Listing,
    NoSuchKey,
    NoSuchUpload,
    ObjectInfo,
    ObjectStoreError,
    PendingUpload,
    ReadCheck,
)

__all__ = ["MemoryObjectStore", "MIN_PART_SIZE", "MAX_PART_NUMBER"]

PIECE = 1024 * 1024
MIN_PART_SIZE = 5 * 1024 * 1024  # every part but the last must be at least this big
MAX_PART_NUMBER = 10_000


@dataclass
class _Object:
    body: bytes
    etag: str
    mtime: float
    metadata: dict[str, str]


@dataclass
class _Upload:
    key: str
    metadata: dict[str, str]
    parts: dict[int, tuple[bytes, str]] = field(default_factory=dict)


def _md5(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def _check_crc(data: bytes, crc: int | None) -> None:
    """As S3 checks x-amz-checksum-crc32c."""
    if crc is not None and crc32c.crc32c(data) != crc:
        error = ObjectStoreError("BadDigest: the body does not match its CRC-32C")
        error.code, error.transient = "BadDigest", True
        raise error


class MemoryObjectStore:
    """A thread-safe dict-backed bucket with S3's multipart rules."""

    def __init__(self, bucket: str = "test") -> None:
        self.bucket = bucket
        self.calls: Counter[str] = Counter()
        self.objects: dict[str, _Object] = {}
        self.uploads: dict[str, _Upload] = {}
        self._lock = threading.RLock()
        self._ids = itertools.count(1)

    def _count(self, name: str) -> None:
        with self._lock:
            self.calls[name] += 1

    def _info(self, key: str, obj: _Object, with_metadata: bool) -> ObjectInfo:
        return ObjectInfo(key=key, size=len(obj.body), etag=obj.etag, mtime=obj.mtime,
                          metadata=dict(obj.metadata) if with_metadata else {})

    def _upload(self, key: str, upload_id: str) -> _Upload:
        upload = self.uploads.get(upload_id)
        if upload is None or upload.key != key:
            raise NoSuchUpload(f"multipart upload of 's3://{self.bucket}/{key}' does not exist")
        return upload

    @staticmethod
    def _check_part_number(part_number: int) -> None:
        if not 1 <= part_number <= MAX_PART_NUMBER:
            raise ObjectStoreError(
                f"InvalidArgument: part number {part_number} is outside 1..{MAX_PART_NUMBER}")

    @staticmethod
    def _norm_metadata(metadata: dict[str, str]) -> dict[str, str]:
        return {k.lower(): str(v) for k, v in metadata.items()}

    # ------------------------------------------------------------------ objects

    def check_bucket(self) -> None:
        self._count("check_bucket")

    def head(self, key: str, checksum: bool = False) -> ObjectInfo | None:
        self._count("head")
        with self._lock:
            obj = self.objects.get(key)
            return None if obj is None else self._info(key, obj, with_metadata=True)

    def get(self, key: str) -> tuple[ObjectInfo, bytes] | None:
        self._count("get")
        with self._lock:
            obj = self.objects.get(key)
            return None if obj is None else (self._info(key, obj, with_metadata=True), obj.body)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        self._count("get_range")
        with self._lock:
            obj = self.objects.get(key)
            if obj is None:
                raise NoSuchKey(f"'s3://{self.bucket}/{key}' does not exist")
            if start < 0 or end <= start:
                return b""
            return obj.body[start:end]

    def get_range_into(self, key: str, start: int, end: int,
                       write: Callable[[int, bytes], None], if_match: str | None = None,
                       expect_crc: int | None = None, whole: bool = False) -> tuple[int, bool]:
        """(Keeps no CRC of its own: only `expect_crc` is checked.)"""
        info = self.head(key) if if_match is not None else None
        if info is not None and info.etag != if_match:
            error = ObjectStoreError(f"GetObject {key}: PreconditionFailed")
            error.code, error.status = "PreconditionFailed", 412
            raise error
        data = self.get_range(key, start, end)
        check = ReadCheck(f"GET {key}", expect_crc)
        for off in range(0, len(data), PIECE):
            check.add(data[off:off + PIECE])
            write(start + off, data[off:off + PIECE])
        return len(data), check.done()

    def put(self, key: str, body: bytes | memoryview, metadata: dict[str, str],
            crc: int | None = None) -> str:
        self._count("put")
        data = bytes(body)
        _check_crc(data, crc)
        obj = _Object(data, _md5(data), time.time(), self._norm_metadata(metadata))
        with self._lock:
            self.objects[key] = obj
        return obj.etag

    def list_dir(self, prefix: str) -> Listing:
        self._count("list_dir")
        objects: list[ObjectInfo] = []
        prefixes: list[str] = []
        with self._lock:
            for key in sorted(k for k in self.objects if k.startswith(prefix)):
                rest = key[len(prefix):]
                slash = rest.find("/")
                if slash >= 0:
                    sub = prefix + rest[:slash + 1]
                    if not prefixes or prefixes[-1] != sub:
                        prefixes.append(sub)
                else:
                    objects.append(self._info(key, self.objects[key], with_metadata=False))
        return Listing(objects=objects, prefixes=prefixes)

    def list_recursive(self, prefix: str) -> Iterator[ObjectInfo]:
        self._count("list_recursive")
        with self._lock:  # snapshot, like pages of a real listing
            infos = [self._info(k, o, with_metadata=False)
                     for k, o in sorted(self.objects.items()) if k.startswith(prefix)]
        yield from infos

    def delete(self, key: str) -> None:
        self._count("delete")
        with self._lock:
            self.objects.pop(key, None)

    def delete_many(self, keys: list[str]) -> None:
        self._count("delete_many")
        with self._lock:
            for key in keys:
                self.objects.pop(key, None)

    def copy(self, src: str, dst: str, metadata: dict[str, str] | None = None) -> str:
        self._count("copy")
        with self._lock:
            obj = self.objects.get(src)
            if obj is None:
                raise NoSuchKey(f"'s3://{self.bucket}/{src}' does not exist (copy source)")
            meta = dict(obj.metadata) if metadata is None else self._norm_metadata(metadata)
            new = _Object(obj.body, _md5(obj.body), time.time(), meta)
            self.objects[dst] = new
            return new.etag

    # ---------------------------------------------------------------- multipart

    def create_multipart(self, key: str, metadata: dict[str, str],
                         checksum: bool = False) -> str:
        self._count("create_multipart")
        with self._lock:
            upload_id = f"mem-{next(self._ids)}"
            self.uploads[upload_id] = _Upload(key, self._norm_metadata(metadata))
        return upload_id

    def upload_part(self, key: str, upload_id: str, part_number: int,
                    body: bytes | memoryview | BinaryIO, checksum: bool = False) -> str:
        self._count("upload_part")
        self._check_part_number(part_number)
        data = body.read() if hasattr(body, "read") else bytes(body)
        etag = _md5(data)
        with self._lock:
            self._upload(key, upload_id).parts[part_number] = (data, etag)
        return etag

    def put_body(self, key: str, body: bytes | memoryview | BinaryIO,
                 checksum: bool = False) -> str:
        return self.put(key, body.read() if hasattr(body, "read") else bytes(body), {})

    def upload_part_copy(self, key: str, upload_id: str, part_number: int,
                         src_key: str, start: int, end: int) -> str:
        self._count("upload_part_copy")
        self._check_part_number(part_number)
        with self._lock:
            upload = self._upload(key, upload_id)
            src = self.objects.get(src_key)
            if src is None:
                raise NoSuchKey(f"'s3://{self.bucket}/{src_key}' does not exist (copy source)")
            if not 0 <= start < end <= len(src.body):
                raise ObjectStoreError(
                    f"InvalidRange: bytes {start}-{end - 1} are outside '{src_key}'"
                    f" ({len(src.body)} bytes)")
            data = src.body[start:end]
            etag = _md5(data)
            upload.parts[part_number] = (data, etag)
        return etag

    def complete_multipart(self, key: str, upload_id: str,
                           parts: list[tuple[int, str]], crcs: list[int] | None = None,
                           full_crc: int | None = None) -> str:
        self._count("complete_multipart")
        with self._lock:
            upload = self._upload(key, upload_id)
            if not parts:
                raise ObjectStoreError("MalformedXML: a multipart upload needs at least one part")
            numbers = [n for n, _ in parts]
            if numbers != sorted(set(numbers)):
                raise ObjectStoreError("InvalidPartOrder: parts must be in ascending order")
            chunks: list[bytes] = []
            for index, (number, etag) in enumerate(parts):
                stored = upload.parts.get(number)
                if stored is None or stored[1] != etag.strip('"'):
                    raise ObjectStoreError(
                        f"InvalidPart: part {number} was not uploaded or its ETag differs")
                if index < len(parts) - 1 and len(stored[0]) < MIN_PART_SIZE:
                    raise ObjectStoreError(
                        f"EntityTooSmall: part {number} is {len(stored[0])} bytes; every part"
                        f" but the last must be at least {MIN_PART_SIZE}")
                chunks.append(stored[0])
            digest = hashlib.md5(
                b"".join(bytes.fromhex(upload.parts[n][1]) for n in numbers),
                usedforsecurity=False).hexdigest()
            etag = f"{digest}-{len(parts)}"
            self.objects[key] = _Object(b"".join(chunks), etag, time.time(), upload.metadata)
            del self.uploads[upload_id]
        return etag

    def abort_multipart(self, key: str, upload_id: str) -> None:
        self._count("abort_multipart")
        with self._lock:
            upload = self.uploads.get(upload_id)
            if upload is not None and upload.key == key:
                del self.uploads[upload_id]

    def list_parts(self, key: str, upload_id: str) -> dict[int, str]:
        self._count("list_parts")
        with self._lock:
            upload = self._upload(key, upload_id)
            return {n: etag for n, (_, etag) in sorted(upload.parts.items())}

    def list_multipart_uploads(self, prefix: str) -> list[PendingUpload]:
        self._count("list_multipart_uploads")
        with self._lock:
            return sorted((PendingUpload(u.key, uid) for uid, u in self.uploads.items()
                           if u.key.startswith(prefix)), key=lambda p: (p.key, p.upload_id))

"""s3/wire keeps its connections alive safely: the pool against SeaweedFS, behind the fault
proxy where a test needs connections to die or answers to stall. The signatures:
tests/unit/test_s3wire.py."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import crc32c
import pytest

import tests.tlsproxy as tlsproxy
from lakefs_mount.cache.partbody import CachePartBody, UploadSource
from lakefs_mount.s3.checksums import probe
from lakefs_mount.s3.embedded import EmbeddedS3
from lakefs_mount.s3.objectstore import AccessDenied, EndpointUnreachable, ObjectStoreError
from lakefs_mount.s3.store import S3ObjectStore
from lakefs_mount.s3.wire import (
    Keys,
    ReadTimedOut,
    WirePool,
    sign,
)
from tests.faultproxy import FaultProxy
from tests.tlsproxy import TlsProxy

MiB = 1024 * 1024
def test_a_wrong_secret_is_refused_and_the_right_one_accepted(
        s3_auth_server: EmbeddedS3) -> None:
    s3_auth_server.create_bucket("wirebucket")
    pool = WirePool(s3_auth_server.endpoint_url, max_idle=2, connect_timeout=5,
                    read_timeout=30)
    right = Keys(s3_auth_server.access_key or "", s3_auth_server.secret_key or "")
    wrong = Keys(right.access_key, right.secret_key + "x")

    def put(keys: Keys) -> int:
        headers = sign("PUT", pool.host, "/wirebucket/k", "", {}, keys, "us-east-1")
        response = pool.request("PUT", "/wirebucket/k", headers, b"payload")
        response.read()
        response.release_conn()
        return response.status_code

    assert put(wrong) == 403
    assert put(right) == 200
    pool.close()


def test_connections_are_kept_alive_and_replaced_when_the_server_drops_them(
        fault_proxy: FaultProxy, bucket: str) -> None:
    store = S3ObjectStore(bucket, endpoint_url=fault_proxy.endpoint_url, max_attempts=1)
    store.put("k", b"hello", {})
    before = fault_proxy.connections_total
    for _ in range(20):
        assert store.get("k") is not None
        assert store.head("k") is not None
    assert fault_proxy.connections_total == before  # one kept-alive connection did all

    fault_proxy.fail = True  # kills the idle pooled connection under the store
    time.sleep(0.2)
    fault_proxy.fail = False
    got = store.get("k")  # max_attempts=1: no retry budget, only the pool's own redial
    assert got is not None and got[1] == b"hello"
    assert fault_proxy.connections_total == before + 1


def test_threads_share_the_pool_without_mixing_answers(s3: S3ObjectStore) -> None:
    bodies = {f"t/{i}": os.urandom(1000 + i) for i in range(64)}
    for key, body in bodies.items():
        s3.put(key, body, {})
    errors: list[str] = []

    def worker(keys: list[str]) -> None:
        for _ in range(5):
            for key in keys:
                got = s3.get(key)
                if got is None or got[1] != bodies[key]:
                    errors.append(key)

    keys = sorted(bodies)
    threads = [threading.Thread(target=worker, args=(keys[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_server_that_stops_answering_is_a_read_timeout(fault_proxy: FaultProxy,
                                                        bucket: str) -> None:
    S3ObjectStore(bucket, endpoint_url=fault_proxy.endpoint_url).put("k", b"v", {})
    pool = WirePool(fault_proxy.endpoint_url, max_idle=1, connect_timeout=5,
                    read_timeout=0.3)
    fault_proxy.delay_seconds = 1.0
    headers = sign("GET", pool.host, f"/{bucket}/k", "", {}, Keys("a", "b"), "us-east-1")
    started = time.monotonic()
    with pytest.raises(ReadTimedOut):
        pool.request("GET", f"/{bucket}/k", headers)
    assert time.monotonic() - started < 0.9
    slow = S3ObjectStore(bucket, endpoint_url=fault_proxy.endpoint_url, read_timeout=0.3,
                         max_attempts=1)
    with pytest.raises(ObjectStoreError, match="timed out"):
        slow.get("k")


def test_requests_go_through_a_configured_proxy(fault_proxy: FaultProxy, bucket: str,
                                                s3_server: EmbeddedS3,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Where botocore would use HTTP_PROXY, so does the store (through botocore's
    session); NO_PROXY still lets it talk to the endpoint itself."""
    monkeypatch.setenv("HTTP_PROXY", fault_proxy.endpoint_url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    proxied = S3ObjectStore(bucket, endpoint_url=s3_server.endpoint_url)
    before = fault_proxy.connections_total
    proxied.put("via-proxy", b"through the proxy", {})
    got = proxied.get("via-proxy")
    assert got is not None and got[1] == b"through the proxy"
    assert fault_proxy.connections_total > before

    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    direct = S3ObjectStore(bucket, endpoint_url=s3_server.endpoint_url)
    before = fault_proxy.connections_total
    got = direct.get("via-proxy")
    assert got is not None and got[1] == b"through the proxy"
    assert fault_proxy.connections_total == before


def test_https_endpoints_verify_the_certificate_as_botocore_does(
        s3_server: EmbeddedS3, bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """AWS_CA_BUNDLE names the CA to trust (the test certificate signs itself); without
    it the certificate is refused and the error says the endpoint is unreachable."""
    tls = TlsProxy(s3_server.port)
    try:
        monkeypatch.setenv("AWS_CA_BUNDLE", str(tlsproxy.CERT))
        store = S3ObjectStore(bucket, endpoint_url=tls.endpoint_url, max_attempts=1)
        store.check_bucket()
        body = os.urandom(300 * 1024)
        store.put("tls/k", body, {"mode": "33188"})
        got = store.get("tls/k")
        assert got is not None and got[1] == body and got[0].metadata == {"mode": "33188"}
        assert store.get_range("tls/k", 5, 105) == body[5:105]
        assert [o.key for o in store.list_dir("tls/").objects] == ["tls/k"]

        monkeypatch.delenv("AWS_CA_BUNDLE")
        untrusting = S3ObjectStore(bucket, endpoint_url=tls.endpoint_url, max_attempts=1)
        with pytest.raises(EndpointUnreachable, match=f"127.0.0.1:{tls.port}") as info:
            untrusting.check_bucket()
        assert "TLS certificate was not accepted" in str(info.value)
        assert "AWS_CA_BUNDLE" in str(info.value)
    finally:
        tls.close()


class _PiecesBody:
    """A part body that offers its bytes in pieces (as the cache's part bodies do)."""

    def __init__(self, data: bytes, piece: int) -> None:
        self.data, self.piece = data, piece

    def __len__(self) -> int:
        return len(self.data)

    def pieces(self) -> Iterator[memoryview]:
        view = memoryview(self.data)
        for i in range(0, len(self.data), self.piece):
            yield view[i:i + self.piece]

    def read(self, size: int = -1) -> bytes:
        raise AssertionError("a store that sends the pieces must not read the body")


@pytest.mark.parametrize("size,piece", [(0, 1), (1, 1), (5 * 1024 * 1024 + 3, 1024 * 1024),
                                        (300_000, 4096)])
def test_a_piecewise_body_is_sent_piece_by_piece(s3: S3ObjectStore, size: int,
                                                 piece: int) -> None:
    data = os.urandom(size)
    upload_id = s3.create_multipart("pieces", {})
    etag = s3.upload_part("pieces", upload_id, 1, _PiecesBody(data, piece))  # type: ignore[arg-type]
    s3.complete_multipart("pieces", upload_id, [(1, etag)])
    got = s3.get("pieces")
    assert got is not None and got[1] == data


def test_a_body_refused_midway_reports_the_refusal(s3_auth_server: EmbeddedS3) -> None:
    """The server answers 403 while 32 MiB are still on their way and closes: the store
    reads that answer (access denied), not just a broken connection."""
    s3_auth_server.create_bucket("spanauth")
    url = s3_auth_server.endpoint_url
    good = S3ObjectStore("spanauth", endpoint_url=url, access_key=s3_auth_server.access_key,
                         secret_key=s3_auth_server.secret_key)
    bad = S3ObjectStore("spanauth", endpoint_url=url, access_key=s3_auth_server.access_key,
                        secret_key="not-the-secret", max_attempts=1)
    upload_id = good.create_multipart("k", {})
    try:
        with pytest.raises(AccessDenied):
            bad.upload_part("k", upload_id, 1, _PiecesBody(  # type: ignore[arg-type]
                os.urandom(32 * 1024 * 1024), 1024 * 1024))
    finally:
        good.abort_multipart("k", upload_id)


def _file_part(tmp_path, data: bytes) -> tuple[UploadSource, int]:
    path = tmp_path / "cache-file"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDWR)
    return UploadSource(fd, None), fd


@pytest.fixture
def checked(s3: S3ObjectStore) -> S3ObjectStore:
    """The store after the mount's checksum probe: SeaweedFS checks a part's CRC-32C."""
    assert probe(s3, "") is True
    assert s3.parts_from_file
    return s3


@pytest.mark.parametrize("size,length", [(5 * MiB + 3, 5 * MiB + 3), (2 * MiB + 5, 3 * MiB)],
                         ids=["whole-file", "past-its-end"])
def test_a_part_of_a_cache_file_goes_by_sendfile_with_its_crc_first(
        checked: S3ObjectStore, tmp_path, monkeypatch, size: int, length: int) -> None:
    """Over plain HTTP to an endpoint that checks CRCs, the kernel sends a part's bytes
    from the cache file (the daemon hashes them once, copies none into the socket); past
    the file's end the part holds zeros, as a read gives them, and S3 takes the CRC."""
    carried = []
    real_sendfile = os.sendfile

    def sendfile(out_fd: int, in_fd: int, offset: int, count: int) -> int:
        sent = real_sendfile(out_fd, in_fd, offset, count)
        carried.append(sent)
        return sent

    monkeypatch.setattr(os, "sendfile", sendfile)
    data = os.urandom(size)
    source, fd = _file_part(tmp_path, data)
    try:
        upload_id = checked.create_multipart("sent", {}, checksum=True)
        body = CachePartBody(source, 0, length)
        etag = checked.upload_part("sent", upload_id, 1, body, True)  # type: ignore[arg-type]
        expected = data + bytes(length - size)
        checked.complete_multipart("sent", upload_id, [(1, etag)],
                                   crcs=[crc32c.crc32c(expected)])
    finally:
        os.close(fd)
    assert sum(carried) == min(size, length)
    assert body.sent_crc == crc32c.crc32c(expected)
    got = checked.get("sent")
    assert got is not None and got[1] == expected


class _ChangedAfterItsCrc(CachePartBody):
    """A part whose cache file a passthrough writer changes right after its first pass
    (the CRC for the header), before the kernel sends it."""

    def __init__(self, source: UploadSource, length: int, fd: int, new: bytes) -> None:
        super().__init__(source, 0, length)
        self.fd, self.new, self.passes = fd, new, 0

    def pieces(self) -> Iterator[memoryview]:
        yield from super().pieces()
        self.passes += 1
        if self.passes == 1:
            os.pwrite(self.fd, self.new, 0)


def test_a_part_changed_between_its_crc_and_its_sending_is_refused_and_sent_again(
        checked: S3ObjectStore, tmp_path) -> None:
    """S3 refuses the bytes sendfile took from the changed file (BadDigest); the next
    attempt hashes and sends what the file holds then, and the part's CRC says so."""
    old, new = os.urandom(3 * MiB), os.urandom(3 * MiB)
    source, fd = _file_part(tmp_path, old)
    try:
        upload_id = checked.create_multipart("changed", {}, checksum=True)
        body = _ChangedAfterItsCrc(source, len(old), fd, new)
        etag = checked.upload_part("changed", upload_id, 1, body, True)  # type: ignore[arg-type]
        checked.complete_multipart("changed", upload_id, [(1, etag)],
                                   crcs=[crc32c.crc32c(new)])
    finally:
        os.close(fd)
    assert body.passes == 2  # refused once, then hashed and sent anew
    assert body.sent_crc == crc32c.crc32c(new)
    got = checked.get("changed")
    assert got is not None and got[1] == new

"""The ObjectStore contract against the real SeaweedFS store: the tests of
tests/unit/test_objectstore.py again, and what only a real server shows (escapes,
throttling, endpoints that fail)."""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import time

import pytest
import trio

from lakefs_mount import metrics as m
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.embedded import EmbeddedS3
from lakefs_mount.s3.objectstore import (
    AccessDenied,
    EndpointUnreachable,
    NoSuchBucket,
    ObjectStore,
    ObjectStoreError,
)
from lakefs_mount.s3.store import S3ObjectStore
from tests.faultproxy import FaultProxy
from tests.unit import test_objectstore as contract

MiB = 1024 * 1024


@pytest.fixture
def store(s3: ObjectStore) -> ObjectStore:
    """SeaweedFS: the specifications of tests/unit/test_objectstore.py run here against it."""
    return s3


# The contract's tests that take a `store`, collected here a second time with SeaweedFS.
for _name, _test in vars(contract).items():
    if _name.startswith("test_") and "store" in inspect.signature(_test).parameters:
        globals()[_name] = _test


def _md5(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def test_check_bucket(s3: S3ObjectStore, s3_server: EmbeddedS3) -> None:
    s3.check_bucket()
    missing = S3ObjectStore("no-such-bucket-lm", endpoint_url=s3_server.endpoint_url)
    with pytest.raises(NoSuchBucket, match="'no-such-bucket-lm' does not exist at http://"):
        missing.check_bucket()


def test_put_into_missing_bucket_fails(s3_server: EmbeddedS3) -> None:
    missing = S3ObjectStore("no-such-bucket-lm2", endpoint_url=s3_server.endpoint_url)
    with pytest.raises(ObjectStoreError):
        missing.put("k", b"x", {})
    with pytest.raises(NoSuchBucket):
        missing.check_bucket()  # autoCreateBucket is off


def test_wrong_credentials(s3_auth_server: EmbeddedS3) -> None:
    s3_auth_server.create_bucket("authbucket")
    url = s3_auth_server.endpoint_url
    access_key, secret_key = s3_auth_server.access_key, s3_auth_server.secret_key
    assert access_key and secret_key
    good = S3ObjectStore("authbucket", endpoint_url=url,
                         access_key=access_key, secret_key=secret_key)
    good.check_bucket()
    good.put("k", b"v", {})
    for access, secret in ((access_key, "wrong-secret"), ("wrongkey", secret_key),
                           ("test", "test")):
        bad = S3ObjectStore("authbucket", endpoint_url=url, access_key=access,
                            secret_key=secret)
        with pytest.raises(AccessDenied) as info:
            bad.check_bucket()
        assert "access denied to bucket 'authbucket'" in str(info.value)
        assert secret not in str(info.value) and secret_key not in str(info.value)
        with pytest.raises(AccessDenied):
            bad.get_range("k", 0, 1)


def test_keys_that_need_escaping_are_signed_and_read_back(s3_auth_server: EmbeddedS3) -> None:
    """GET, HEAD and PUT are signed outside botocore's pipeline: the URL escaping and
    the signature must agree for every character a file name can hold."""
    s3_auth_server.create_bucket("escapes")
    store = S3ObjectStore("escapes", endpoint_url=s3_auth_server.endpoint_url,
                          access_key=s3_auth_server.access_key,
                          secret_key=s3_auth_server.secret_key)
    keys = ["dir with space/a b.bin", "plus+sign=eq&amp?q#hash", "pct%20lit~tilde",
            "ünï/cödé ✓.pt", "semi;colon,comma'quote(paren)*star$at@!"]
    for i, key in enumerate(keys):
        body = os.urandom(1000 + i)
        etag = store.put(key, body, {"mode": "33188", "i": str(i)})
        assert etag == _md5(body)
        info = store.head(key)
        assert info is not None and info.size == len(body) and info.etag == etag
        assert info.metadata == {"mode": "33188", "i": str(i)}
        got = store.get(key)
        assert got is not None and got[1] == body and got[0].metadata == info.metadata
        assert store.get_range(key, 10, 20) == body[10:20]
    listed = {o.key for o in store.list_recursive("")}
    assert set(keys) <= listed
    root = store.list_dir("")
    assert {"dir with space/", "ünï/"} <= set(root.prefixes)
    assert {o.key for o in store.list_dir("ünï/").objects} == {"ünï/cödé ✓.pt"}
    assert {o.key for o in store.list_dir("dir with space/").objects} == {
        "dir with space/a b.bin"}


def test_a_body_cut_short_is_an_error_not_short_data(fault_proxy: FaultProxy,
                                                     bucket: str) -> None:
    fault_proxy.truncate_responses_at = 600 * 1024  # headers plus part of the body
    via = S3ObjectStore(bucket, endpoint_url=fault_proxy.endpoint_url, max_attempts=1)
    body = os.urandom(2 * MiB)
    via.put("cut", body, {})
    with pytest.raises(ObjectStoreError, match="GetObject"):
        via.get_range("cut", 0, len(body))
    with pytest.raises(ObjectStoreError, match="GetObject"):
        via.get("cut")
    fault_proxy.truncate_responses_at = None
    assert via.get_range("cut", 0, len(body)) == body


def test_fault_proxy_outage_and_delay(fault_proxy: FaultProxy, bucket: str) -> None:
    via = S3ObjectStore(bucket, endpoint_url=fault_proxy.endpoint_url, max_attempts=1)
    via.put("k", b"hello", {})
    assert via.get_range("k", 0, 5) == b"hello"

    fault_proxy.fail = True
    started = time.monotonic()
    with pytest.raises((EndpointUnreachable, ObjectStoreError)):
        via.get_range("k", 0, 5)
    with pytest.raises((EndpointUnreachable, ObjectStoreError)):
        via.check_bucket()
    assert time.monotonic() - started < 10

    fault_proxy.fail = False
    fault_proxy.delay_seconds = 0.2
    started = time.monotonic()
    assert via.get_range("k", 0, 5) == b"hello"
    assert time.monotonic() - started >= 0.2


def test_fault_proxy_bandwidth(fault_proxy: FaultProxy, bucket: str) -> None:
    via = S3ObjectStore(bucket, endpoint_url=fault_proxy.endpoint_url)
    body = os.urandom(512 * 1024)
    via.put("k", body, {})
    fault_proxy.bandwidth_bytes_per_s = 1 * MiB
    started = time.monotonic()
    assert via.get_range("k", 0, len(body)) == body
    assert time.monotonic() - started >= 0.4


def test_a_503_slowdown_is_retried_with_the_policy_and_a_403_is_not(
        fault_proxy: FaultProxy, bucket: str) -> None:
    """s3/retry: throttling is transient (another attempt follows), a refusal is not."""
    fault_proxy.parse_requests = True
    store = S3ObjectStore(bucket, endpoint_url=fault_proxy.endpoint_url)  # 3 attempts
    fault_proxy.answer_with(503, "SlowDown", 2, frozenset({"PUT"}))
    store.put("throttled", b"landed", {})
    assert fault_proxy.answered == 2 and store.get("throttled")[1] == b"landed"
    fault_proxy.answer_with(403, "AccessDenied", 1, frozenset({"PUT"}))
    with pytest.raises(AccessDenied) as refused:
        store.put("refused", b"x", {})
    assert not refused.value.transient and fault_proxy.answered == 3
    once = S3ObjectStore(bucket, endpoint_url=fault_proxy.endpoint_url, max_attempts=1)
    fault_proxy.answer_with(503, "SlowDown", 1, frozenset({"PUT"}))
    with pytest.raises(ObjectStoreError) as throttled:
        once.put("once", b"x", {})
    assert throttled.value.transient and "SlowDown" in str(throttled.value)


def test_the_daemons_retries_are_counted_and_logged_in_one_place(
        fault_proxy: FaultProxy, bucket: str, caplog: pytest.LogCaptureFixture) -> None:
    """The daemon's store makes one attempt per request; AsyncStore retries, and every
    retry shows in the metrics (`status`) and in the log, with S3's error code."""
    fault_proxy.parse_requests = True
    once = S3ObjectStore(bucket, endpoint_url=fault_proxy.endpoint_url, max_attempts=1)
    metrics = m.Metrics()
    store = AsyncStore(once, metrics)

    async def body() -> None:
        fault_proxy.answer_with(503, "SlowDown", 2, frozenset({"PUT"}))
        await store.call(once.put, "dirmarker/", b"", {})
        assert metrics[m.RETRIES] == 2 and metrics[m.ERRORS] == 2
        fault_proxy.answer_with(400, "InvalidArgument", 1, frozenset({"PUT"}))
        with pytest.raises(ObjectStoreError):  # not transient: a lookup gives up at once
            await store.call(once.put, "bad", b"", {})
        assert metrics[m.RETRIES] == 2 and metrics[m.ERRORS] == 3
        fault_proxy.answer_with(500, "InternalError", 1, frozenset({"PUT"}))
        await store.retrying("PutObject data", once.put, "data", b"x", {})  # the flusher's
        assert metrics[m.RETRIES] == 3 and fault_proxy.answered == 4

    with caplog.at_level(logging.WARNING, logger="lakefs_mount.s3.aiostore"):
        trio.run(body)
    assert sum("SlowDown" in r.getMessage() for r in caplog.records) == 2

"""s3/timeouts.py and its use: every S3 request is bounded by a time scaled to its bytes,
a retry after a timeout gets more time, and the requests under way are visible (s3/stats)
while they wait (issue 30, "Every S3 call bounded")."""

from __future__ import annotations

import time

import pytest

from lakefs_mount.s3.objectstore import RequestTimedOut
from lakefs_mount.s3.store import S3ObjectStore
from lakefs_mount.s3.wire import Keys, ReadTimedOut, WirePool, sign
from tests.faultproxy import FaultProxy

MiB = 1024 * 1024


def test_a_black_holed_request_ends_at_its_bound_not_at_a_fixed_minute(
        fault_proxy: FaultProxy, bucket: str) -> None:
    store = S3ObjectStore(bucket, endpoint_url=fault_proxy.endpoint_url, read_timeout=1.0,
                          max_attempts=1)
    store.put("k", b"v", {})
    fault_proxy.hang = True  # the kept-alive connection goes quiet too
    started = time.monotonic()
    with pytest.raises(RequestTimedOut, match="timed out"):
        store.head("k")
    assert 0.9 < time.monotonic() - started < 5
    started = time.monotonic()
    with pytest.raises(RequestTimedOut):
        store.put("big", b"x" * (2 * MiB), {})  # 1 s + 2 MiB at 1 MiB/s
    assert 2.9 < time.monotonic() - started < 8
    fault_proxy.hang = False


def test_requests_botocore_sends_end_at_their_bound_too(fault_proxy: FaultProxy,
                                                         bucket: str) -> None:
    store = S3ObjectStore(bucket, endpoint_url=fault_proxy.endpoint_url, read_timeout=1.0,
                          max_attempts=1)
    upload = store.create_multipart("mp", {})
    fault_proxy.hang = True
    for call in (lambda: store.delete("k"), lambda: store.abort_multipart("mp", upload)):
        started = time.monotonic()
        with pytest.raises(RequestTimedOut, match="timed out"):
            call()
        assert 0.9 < time.monotonic() - started < 5
    fault_proxy.hang = False
    store.abort_multipart("mp", upload)


def test_a_big_copy_goes_through_a_botocore_client_whose_read_timeout_covers_it(s3):
    bound = s3.timeouts.copy(1024 * MiB)  # an UploadPartCopy of 1 GiB: 138 s
    assert s3._botocore(bound).meta.config.read_timeout == 160
    assert s3._botocore(1.0) is s3._botocore(10.0)  # one client per rung
    assert s3._botocore(1.0).meta.config.retries["total_max_attempts"] == 1


def test_a_body_gets_time_for_its_bytes_beyond_the_base(fault_proxy: FaultProxy,
                                                       bucket: str) -> None:
    """A 3 MiB answer through a 2 MiB/s link takes ~1.5 s: more than the 0.5 s base, less
    than the base plus its bytes at the 1 MiB/s floor."""
    payload = b"y" * (3 * MiB)
    S3ObjectStore(bucket, endpoint_url=fault_proxy.endpoint_url).put("k", payload, {})
    slow = S3ObjectStore(bucket, endpoint_url=fault_proxy.endpoint_url, read_timeout=0.5,
                         max_attempts=1)
    fault_proxy.bandwidth_bytes_per_s = 2 * MiB
    assert slow.get_range("k", 0, len(payload)) == payload
    slow.put("k2", payload, {})  # the same for a body sent
    pool = WirePool(fault_proxy.endpoint_url, max_idle=1, connect_timeout=5,
                    read_timeout=0.5)
    headers = sign("GET", pool.host, f"/{bucket}/k", "", {}, Keys("a", "b"), "us-east-1")
    response = pool.request("GET", f"/{bucket}/k", headers)  # no time given for bytes
    with pytest.raises(ReadTimedOut, match="within 0.5 s"):
        while response.read(64 * 1024):
            pass
    pool.close()



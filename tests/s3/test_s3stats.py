"""s3/stats.py: the latency and failures of every S3 request, measured around a real store
(SeaweedFS), and one structured log line per failed request."""

from __future__ import annotations

import logging

import pytest

from lakefs_mount.s3.objectstore import NoSuchKey
from lakefs_mount.s3.stats import S3Stats, TimedStore


def test_requests_of_a_real_store_are_counted_by_operation(s3):
    stats = S3Stats()
    store = TimedStore(s3, stats)
    store.put("a", b"hello", {})
    assert store.head("a").size == 5
    assert store.get_range("a", 0, 2) == b"he"
    assert store.bucket == s3.bucket  # what is not a request passes through
    counts = {op: s["count"] for op, s in stats.snapshot().items()}
    assert counts == {"PutObject": 1, "HeadObject": 1, "GetObject": 1}
    assert stats.last_error_at is None


def test_a_failed_request_logs_operation_key_status_s3_code_and_attempt(s3, caplog):
    stats = S3Stats(clock=lambda: 1234.5)
    store = TimedStore(s3, stats)
    caplog.set_level(logging.INFO, logger="lakefs_mount.s3.stats")
    for _ in range(2):
        with pytest.raises(NoSuchKey):
            store.get_range("missing", 0, 10)
    first, second = [r for r in caplog.records if r.name == "lakefs_mount.s3.stats"]
    assert (first.s3_op, first.key, first.status, first.attempt) == \
        ("GetObject", "missing", 404, 1)
    assert first.s3_error_code == "NoSuchKey"
    assert second.attempt == 2
    assert stats.snapshot()["GetObject"]["failures"] == 2
    assert stats.snapshot()["GetObject"]["failure_codes"] == {"NoSuchKey": 2}
    assert stats.last_error_at == 1234.5
    store.put("missing", b"x", {})
    store.get_range("missing", 0, 1)  # a success ends the streak
    store.delete("missing")
    with pytest.raises(NoSuchKey):
        store.get_range("missing", 0, 1)
    assert caplog.records[-1].attempt == 1

"""s3/stats.py: the latency and failures of every S3 request, measured around a real store
(SeaweedFS), and one structured log line per failed request."""

from __future__ import annotations

import pytest

from lakefs_mount.metrics import Latencies
from lakefs_mount.s3.objectstore import ObjectStoreError, RequestTimedOut
from lakefs_mount.s3.stats import BUCKETS, MAX_CODES, OTHER_CODE, S3Stats


def test_histogram_buckets_are_cumulative_and_end_with_every_request():
    stats = S3Stats()
    for seconds in (0.003, 0.2, 0.2, 100.0):
        stats.record("PutObject", "k", seconds)
    put = stats.snapshot()["PutObject"]
    assert (put["count"], put["failures"]) == (4, 0)
    assert put["buckets"]["0.005"] == 1
    assert put["buckets"]["0.25"] == 3
    assert put["buckets"][str(BUCKETS[-1])] == 3 and put["buckets"]["+Inf"] == 4
    assert put["seconds_sum"] == pytest.approx(100.403)




def _answered(code: str, status: int) -> ObjectStoreError:
    exc = ObjectStoreError(f"{code} ({status})")
    exc.code, exc.status = code, status
    return exc


def test_failures_count_by_s3_error_code_and_the_codes_of_an_operation_are_bounded():
    """The `code` label of lakefs_mount_s3_request_failures_total (issue 52)."""
    stats = S3Stats()
    stats.record("PutObject", "k", 0.1, _answered("SlowDown", 503))
    stats.record("PutObject", "k", 0.1, _answered("SlowDown", 503))
    stats.record("PutObject", "k", 0.1, _answered("", 500))  # an answer with no code
    stats.record("PutObject", "k", 5.0, RequestTimedOut("timed out"))  # no answer at all
    stats.record("PutObject", "k", 0.1, _answered("Bad code\n{x}", 400))
    put = stats.snapshot()["PutObject"]
    assert put["failure_codes"] == {"SlowDown": 2, "500": 1, "RequestTimedOut": 1,
                                    OTHER_CODE: 1}
    assert put["failures"] == 5
    for i in range(3 * MAX_CODES):  # an endpoint making up a new code for every answer
        stats.record("GetObject", "k", 0.1, _answered(f"Code{i}", 400))
    codes = stats.snapshot()["GetObject"]["failure_codes"]
    assert len(codes) == MAX_CODES + 1 and codes[OTHER_CODE] == 2 * MAX_CODES
    assert sum(codes.values()) == 3 * MAX_CODES


def test_fuse_latencies_are_cumulative_histograms_per_operation():
    latencies = Latencies()
    for seconds in (0.00003, 0.0002, 0.0002, 100.0):
        latencies.observe("getattr", seconds)
    latencies.observe("write", 0.002)
    snap = latencies.snapshot()
    assert list(snap) == ["getattr", "write"]
    getattr_ = snap["getattr"]
    assert getattr_["count"] == 4 and getattr_["buckets"]["+Inf"] == 4
    assert getattr_["buckets"]["5e-05"] == 1 and getattr_["buckets"]["0.00025"] == 3
    assert getattr_["buckets"]["60.0"] == 3
    assert getattr_["seconds_sum"] == pytest.approx(100.00043)
    assert snap["write"]["count"] == 1

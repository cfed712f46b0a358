"""s3/stats.py: the latency and failures of every S3 request, measured around a real store
(SeaweedFS), and one structured log line per failed request."""

from __future__ import annotations

import pytest

from lakefs_mount.s3.stats import BUCKETS, S3Stats


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



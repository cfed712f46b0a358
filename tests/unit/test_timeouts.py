"""s3/timeouts.py and its use: every S3 request is bounded by a time scaled to its bytes,
a retry after a timeout gets more time, and the requests under way are visible (s3/stats)
while they wait (issue 30, "Every S3 call bounded")."""

from __future__ import annotations

import threading

import pytest
import trio

from lakefs_mount import metrics as m
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.objectstore import NoSuchKey, ObjectStoreError, RequestTimedOut
from lakefs_mount.s3.stats import WAITING_AFTER, S3Stats
from lakefs_mount.s3.timeouts import (
    BASE_SECONDS,
    MAX_STRETCH,
    RequestTimeouts,
    stretch_after,
    stretched,
)

MiB = 1024 * 1024


def test_a_small_request_gets_the_base_and_a_transfer_time_for_its_bytes_at_the_floor():
    t = RequestTimeouts()
    assert t.small() == BASE_SECONDS == 10.0
    assert t.transfer(0) == 10.0
    assert t.transfer(16 * MiB) == pytest.approx(26.0)  # a default part: 10 s + 16 MiB / 1 MiB/s
    assert t.transfer(512 * MiB) == pytest.approx(522.0)  # the largest part
    assert t.per_byte() * MiB == pytest.approx(1.0)


def test_server_side_work_scales_with_what_the_server_does():
    t = RequestTimeouts()
    assert t.copy(5 * 1024 * MiB) == pytest.approx(10 + 640)  # 5 GiB CopyObject at 8 MiB/s
    assert t.copy(1024 * MiB) < t.transfer(1024 * MiB)  # no bytes cross the node's link
    assert t.complete(10_000) == pytest.approx(510.0)
    assert t.delete_batch(1000) == pytest.approx(30.0)


def test_botocore_clients_come_in_doubling_rungs_at_or_above_the_bound():
    t = RequestTimeouts(base=10.0)
    assert [t.rung(s) for s in (1, 10, 10.5, 26, 80, 81)] == [10, 10, 20, 40, 80, 160]


def test_an_attempt_after_timeouts_gets_twice_the_time_for_its_bytes_up_to_the_limit():
    assert [stretch_after(n) for n in range(6)] == [1, 2, 4, 8, 8, 8]
    assert MAX_STRETCH == 8
    t = RequestTimeouts()
    with stretched(4):
        assert t.transfer(16 * MiB) == pytest.approx(10 + 64)
        assert t.copy(8 * MiB) == pytest.approx(14.0)
        assert t.small() == 10.0  # a HEAD in a black hole costs the base, retried or not
        seen: list[float] = []
        other = threading.Thread(target=lambda: seen.append(t.transfer(MiB)))
        other.start()
        other.join()
        assert seen == [11.0]  # only the thread that retries is stretched
    assert t.transfer(MiB) == 11.0


def test_a_retry_of_a_timed_out_request_runs_with_more_time():
    bounds: list[float] = []

    def request() -> str:
        bounds.append(RequestTimeouts().transfer(4 * MiB))
        if len(bounds) < 3:
            raise RequestTimedOut("no answer")
        return "done"

    async def main() -> str:
        store = AsyncStore(object(), m.Metrics())  # type: ignore[arg-type]
        store.wake_retries()
        return await store.retrying("HEAD k", request)

    assert trio.run(main) == "done"
    assert bounds == [14.0, 18.0, 26.0]


def test_requests_under_way_show_with_their_age_and_the_oldest_is_named():
    now = [100.0]
    stats = S3Stats(monotonic=lambda: now[0])
    assert stats.waiting() == {"s3_in_flight": 0, "s3_waiting": 0, "s3_oldest_request": None}
    put = stats.begin("PutObject", "step_1/model.pt")
    now[0] += WAITING_AFTER
    head = stats.begin("HeadObject", "step_1")
    now[0] += 2
    assert stats.waiting() == {
        "s3_in_flight": 2, "s3_waiting": 1,
        "s3_oldest_request": {"operation": "PutObject", "key": "step_1/model.pt",
                              "age_s": WAITING_AFTER + 2}}
    assert stats.waiting_on() == f"PutObject step_1/model.pt for {WAITING_AFTER + 2:.0f} s"
    stats.record("PutObject", "step_1/model.pt", 7.0, ticket=put)
    assert stats.waiting()["s3_oldest_request"]["operation"] == "HeadObject"
    assert stats.waiting_on() is None  # the HEAD is only 2 s old
    stats.record("HeadObject", "step_1", 2.0, RequestTimedOut("timed out"), ticket=head)
    assert stats.waiting()["s3_in_flight"] == 0


def test_the_current_error_is_the_latest_failure_not_yet_followed_by_a_success():
    now = [0.0]
    stats = S3Stats(monotonic=lambda: now[0])
    stats.record("HeadObject", "a", 10.0, RequestTimedOut("HEAD a timed out"))
    now[0] += 1
    stats.record("GetObject", "gone", 0.1, NoSuchKey("'gone' does not exist"))
    assert stats.current_error() == "HEAD a timed out"  # a missing key is no trouble
    stats.record("PutObject", "b", 10.0, ObjectStoreError("PUT b: SlowDown"))
    assert stats.current_error() == "PUT b: SlowDown"
    stats.record("PutObject", "b", 0.1)
    assert stats.current_error() == "HEAD a timed out"
    now[0] += 600
    assert stats.current_error() is None  # old, and nothing retried it

"""`status --watch`: the status again every interval, with upload and download rates and
the time until everything is in S3; redrawn in place on a terminal, JSON lines with --json."""

from __future__ import annotations

import io
import json
import os
import re

from lakefs_mount.cli.status import format_status
from lakefs_mount.cli.watch import CLEAR, Rates, rates, render, watch_status
from tests.terminal import run_on_terminal

MiB = 1024 * 1024
WATCH_SECONDS = 4.0


def _status(uploaded: int, dirty: int, downloaded: int = 0) -> dict:
    return {"bytes_uploaded": uploaded, "dirty_bytes": dirty,
            "counters": {"bytes_downloaded": downloaded}}


def test_rates_are_counter_differences_per_second_and_eta_is_dirty_over_upload_rate():
    r = rates(_status(10 * MiB, 40 * MiB, 0), _status(30 * MiB, 20 * MiB, 4 * MiB), 2.0)
    assert r == Rates(upload=10 * MiB, download=2 * MiB, eta_seconds=2.0)


def test_no_upload_progress_means_no_eta_and_nothing_dirty_means_clean():
    stalled = _status(5, 100)
    r = rates(stalled, stalled, 1.0)
    assert r.eta_seconds is None
    assert re.search(r"time to clean +unknown \(no upload progress",
                     render(stalled, r, format_status))
    clean = _status(5, 0)
    assert re.search(r"time to clean +clean \(everything is in S3\)",
                     render(clean, rates(clean, clean, 1), format_status))


def test_json_watch_writes_one_object_per_sample_with_rates_after_the_first():
    samples = iter([_status(0, 8 * MiB), _status(4 * MiB, 4 * MiB)])
    out = io.StringIO()

    def fetch() -> dict:
        try:
            return next(samples)
        except StopIteration:
            raise KeyboardInterrupt from None

    try:
        watch_status(fetch, 0.1, True, format_status, out)
    except KeyboardInterrupt:
        pass
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["upload_bytes_per_s"] is None
    assert second["upload_bytes_per_s"] > 0 and second["time_to_clean_s"] > 0
    assert CLEAR not in out.getvalue()


def test_watch_on_a_terminal_redraws_rates_and_time_to_clean_during_a_slow_flush(
        mount_factory, fault_proxy):
    m = mount_factory(endpoint_url=fault_proxy.endpoint_url)
    fault_proxy.bandwidth_bytes_per_s = 4 * MiB
    (m.path / "ckpt.bin").write_bytes(os.urandom(24 * MiB))
    try:
        code, text = run_on_terminal("status", str(m.path), "--watch", "--interval", "0.5",
                                     interrupt_after=WATCH_SECONDS)
    finally:
        fault_proxy.bandwidth_bytes_per_s = None
    assert code == 0, text  # Ctrl-C ends a watch normally
    frames = text.split(CLEAR)[1:]
    assert len(frames) >= 4, text
    assert "upload rate" not in frames[0]  # one sample gives no rate
    rated = [f for f in frames[1:] if "s at the current rate" in f]
    assert rated, frames[-1]
    assert not re.search(r"upload rate +0 B/s", rated[0]), rated[0]

"""Progress of `flush` and `warmup`: a bar with bytes, rate and ETA on a terminal that
ends at 100 %, a plain line every 10 s in a log, JSON lines with --json."""

from __future__ import annotations

import io
import json
import os
import re
import time

from lakefs_mount.cli.progress import ProgressPrinter
from tests.terminal import run_on_terminal

MiB = 1024 * 1024


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_bar_shows_fraction_bytes_rate_and_eta_and_ends_at_100_percent():
    clock, screen = Clock(), Terminal()
    printer = ProgressPrinter("flushing", stream=screen, clock=clock)
    printer({"bytes_left": 24 * MiB, "files_left": 1})
    clock.now = 2.0
    printer({"bytes_left": 16 * MiB, "files_left": 1})
    assert screen.getvalue().endswith("flushing [########----------------]  33%  8 MiB / 24 MiB"
                                      "  4 MiB/s  ETA 4 s")
    clock.now = 2.1  # within REDRAW of the last frame: not drawn
    printer({"bytes_left": 15 * MiB, "files_left": 1})
    assert "38%" not in screen.getvalue()
    clock.now = 4.0
    printer.done(finished=True)
    assert screen.getvalue().endswith("flushing [########################] 100%  24 MiB / "
                                      "24 MiB  6 MiB/s\n")


def test_the_bar_counts_from_what_the_daemon_says_the_operation_covers():
    """A warm-up's first report comes a second into it: the bar's total is the bytes it
    set out to fetch, not what was left then."""
    clock, screen = Clock(), Terminal()
    printer = ProgressPrinter("warming", stream=screen, clock=clock)
    clock.now = 1.0
    printer({"bytes_left": 16 * MiB, "bytes_total": 48 * MiB, "files_left": 1})
    assert screen.getvalue().endswith("warming [################--------]  67%  32 MiB / "
                                      "48 MiB  32 MiB/s  ETA 0 s")


def test_a_failed_operation_clears_the_bar_and_an_error_shows_on_it():
    clock, screen = Clock(), Terminal()
    printer = ProgressPrinter("flushing", stream=screen, clock=clock)
    printer({"bytes_left": MiB, "last_error": "S3 endpoint unreachable"})
    assert screen.getvalue().endswith("retrying after: S3 endpoint unreachable")
    printer.done(finished=False)
    assert screen.getvalue().endswith("\r\x1b[K") and "100%" not in screen.getvalue()


def test_a_request_waiting_on_s3_shows_on_the_bar_and_in_the_plain_line():
    clock, screen = Clock(), Terminal()
    printer = ProgressPrinter("flushing", stream=screen, clock=clock)
    printer({"bytes_left": MiB, "waiting_on": "PutObject step_1/model.pt for 12 s"})
    assert screen.getvalue().endswith("waiting on S3: PutObject step_1/model.pt for 12 s")
    log = io.StringIO()
    plain = ProgressPrinter("flushing", stream=log, clock=clock)
    plain({"bytes_left": MiB, "files_left": 1, "waiting_on": "PutObject k for 30 s",
           "last_error": "S3 PutObject on 's3://b/k' timed out"})
    assert log.getvalue() == ("flushing: 1 MiB left, 1 file, waiting on S3: PutObject k for "
                              "30 s (last error: S3 PutObject on 's3://b/k' timed out)\n")


def test_without_a_terminal_a_plain_line_every_ten_seconds():
    clock, log = Clock(), io.StringIO()
    printer = ProgressPrinter("flushing", stream=log, clock=clock)
    for second in range(25):
        clock.now = float(second)
        printer({"bytes_left": (25 - second) * MiB, "files_left": 2})
    printer.done(finished=True)
    assert log.getvalue().splitlines() == ["flushing: 25 MiB left, 2 files",
                                           "flushing: 15 MiB left, 2 files",
                                           "flushing: 5 MiB left, 2 files"]


def test_flush_on_a_terminal_draws_a_bar_that_ends_at_100_percent(mount_factory, fault_proxy):
    m = mount_factory(endpoint_url=fault_proxy.endpoint_url)
    fault_proxy.bandwidth_bytes_per_s = 4 * MiB
    (m.path / "ckpt.bin").write_bytes(os.urandom(24 * MiB))
    try:
        code, text = run_on_terminal("flush", str(m.path))
    finally:
        fault_proxy.bandwidth_bytes_per_s = None
    assert code == 0, text
    frames = [f for f in text.split("\r\x1b[K") if f.startswith("flushing [")]
    assert len(frames) >= 3, text
    assert any(" 0%" not in f and "100%" not in f for f in frames), frames  # in between
    assert re.match(r"flushing \[#{24}\] 100%  ([\d.]+ MiB) / \1  ", frames[-1]), frames[-1]
    assert f"{m.path} is in S3" in text


def test_flush_json_prints_progress_lines_and_the_result_for_scripts(mount_factory,
                                                                    fault_proxy):
    m = mount_factory(endpoint_url=fault_proxy.endpoint_url)
    fault_proxy.bandwidth_bytes_per_s = 8 * MiB
    (m.path / "ckpt.bin").write_bytes(os.urandom(24 * MiB))
    try:
        proc = m.flush("--json")
    finally:
        fault_proxy.bandwidth_bytes_per_s = None
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    progress = [line["progress"] for line in lines[:-1]]
    total = progress[0]["total_bytes"]  # dirty when the flush began (parts stream earlier)
    assert progress and 0 < total <= 24 * MiB
    assert all(p["done_bytes"] + p["bytes_left"] == total for p in progress)
    assert lines[-1]["result"]["files"] == 1


def test_the_first_progress_line_after_s3_came_back_shows_no_old_error(mount_factory,
                                                                      fault_proxy):
    """Issue 29 defect 8: a flush started after an outage ended reported the outage's
    error on its first progress line, before any request of its own had failed."""
    m = mount_factory(endpoint_url=fault_proxy.endpoint_url)
    fault_proxy.fail = True
    (m.path / "ckpt.bin").write_bytes(os.urandom(MiB))
    deadline = time.monotonic() + 60
    while m.counters().get("retries", 0) < 3:  # a few failed commits: a long backoff now
        assert time.monotonic() < deadline, m.status()
        time.sleep(0.2)
    assert m.status()["last_error"]
    fault_proxy.bandwidth_bytes_per_s = 256 * 1024  # the commit takes ~4 s once S3 is
    fault_proxy.fail = False  # back: the flush finds it under way (not done already)
    proc = m.flush("--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert "progress" in lines[0] and lines[0]["progress"]["last_error"] is None, lines[0]
    assert all(line.get("progress", {}).get("last_error") is None for line in lines), lines


def test_a_piped_flush_ends_with_one_summary_line_as_on_a_terminal(mount_factory,
                                                                   fault_proxy):
    """stdout and stderr are pipes (a CI log, `| tee`): the outcome is said once at the
    end, what was flushed and how long it took; stdout stays empty for scripts."""
    m = mount_factory(endpoint_url=fault_proxy.endpoint_url, name="piped")
    fault_proxy.bandwidth_bytes_per_s = 8 * MiB  # a few seconds: progress reports come
    (m.path / "a.bin").write_bytes(os.urandom(12 * MiB))
    (m.path / "b.bin").write_bytes(os.urandom(4 * MiB))
    try:
        proc = m.flush()  # subprocess.run with both captured: neither is a terminal
    finally:
        fault_proxy.bandwidth_bytes_per_s = None
    assert proc.returncode == 0 and proc.stdout == "", proc
    last = proc.stderr.splitlines()[-1]
    shown = re.fullmatch(rf"lakefs-mount: {re.escape(str(m.path))} is in S3: 2 files, "
                         r"([\d.]+) MiB flushed in ([\d.]+) s", last)
    assert shown, proc.stderr
    assert 0 < float(shown.group(1)) <= 16 and float(shown.group(2)) > 0.5, last
    nothing = m.flush()
    assert re.fullmatch(rf"lakefs-mount: {re.escape(str(m.path))} is in S3: 0 files "
                        r"flushed in [\d.]+ s", nothing.stderr.strip()), nothing.stderr

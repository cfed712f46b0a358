"""Prometheus `/metrics` (`--metrics-addr`): off by default, every counter of metrics.py as
`lakefs_mount_..._total`, gauges that say what `status --json` says, scraped live."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from lakefs_mount import metrics as m
from lakefs_mount.cli.main import cli
from lakefs_mount.config import parse_metrics_addr
from lakefs_mount.ops.metrics_server import MetricsServer
from lakefs_mount.ops.mountpoint import is_mounted
from tests.mounting import CLI

MiB = 1024 * 1024
SCRAPE_INTERVAL = 0.2


def scrape_samples(address: str) -> list:
    """The samples of one GET /metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def scrape(address: str, samples: list | None = None) -> dict[str, float]:
    """Sample name -> value of the samples without an `operation` label."""
    samples = scrape_samples(address) if samples is None else samples
    return {s.name: s.value for s in samples if "operation" not in s.labels}


def by_operation(samples: list, name: str) -> dict[str, float]:
    """S3 operation -> value of the samples called `name`."""
    return {s.labels["operation"]: s.value for s in samples if s.name == name}


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:9567", ("127.0.0.1", 9567)),
    (":9567", ("127.0.0.1", 9567)),
    ("[::1]:0", ("::1", 0)),
    ("0.0.0.0:80", ("0.0.0.0", 80)),
])
def test_metrics_addr_is_host_and_port_and_a_bare_port_means_loopback(text, expected):
    assert parse_metrics_addr(text) == expected


@pytest.mark.parametrize("text", ["9567", "localhost", "127.0.0.1:http", "127.0.0.1:70000"])
def test_a_bad_metrics_addr_is_a_usage_error(tmp_path, text):
    result = CliRunner().invoke(cli, ["mount", "--metrics-addr", text, "s3://b",
                                      str(tmp_path)])
    assert result.exit_code == 2
    assert "--metrics-addr" in result.stderr and "not HOST:PORT" in result.stderr


def test_every_counter_is_exported_with_its_value_and_unknown_status_keys_are_not():
    status = {"counters": {m.BYTES_UPLOADED: 123, m.RETRIES: 2}, "dirty_bytes": 7,
              "cache_size": 1 << 30, "bucket": "b", "last_error": "boom", "max_dirty": None}
    server = MetricsServer("127.0.0.1:0", lambda: status)
    try:
        samples = scrape(server.address)
    finally:
        server.close()
    for name in m.COUNTERS:
        assert samples[m.prometheus_counter(name) + "_total"] == \
            status["counters"].get(name, 0)
    assert samples["lakefs_mount_uploaded_bytes_total"] == 123
    assert samples["lakefs_mount_dirty_bytes"] == 7
    assert samples["lakefs_mount_cache_budget_bytes"] == 1 << 30
    assert "lakefs_mount_dirty_limit_bytes" not in samples  # None: not known, not 0
    assert samples["lakefs_mount_info"] == 1
    assert all(name.startswith("lakefs_mount_") for name in samples)


def test_a_taken_metrics_port_is_an_error_that_names_the_option():
    first = MetricsServer("127.0.0.1:0", lambda: None)
    try:
        with pytest.raises(OSError, match=f"--metrics-addr {first.address}: "):
            MetricsServer(first.address, lambda: None)
        assert scrape(first.address) == {}  # no status yet: no numbers, not zeros
    finally:
        first.close()


def test_metrics_during_a_slowed_flush_go_down_to_zero_and_match_status(
        mount_factory, fault_proxy):
    mnt = mount_factory("--metrics-addr", "127.0.0.1:0", endpoint_url=fault_proxy.endpoint_url)
    address = mnt.status()["metrics_addr"]
    assert address.startswith("127.0.0.1:")
    fault_proxy.bandwidth_bytes_per_s = 4 * MiB
    data = os.urandom(24 * MiB)
    (mnt.path / "ckpt.bin").write_bytes(data)
    deadline = time.monotonic() + 30  # with passthrough the daemon learns of the bytes at
    while not mnt.status()["dirty_bytes"] and time.monotonic() < deadline:
        time.sleep(0.05)  # the kernel's RELEASE, which comes after close() returned
    flush = subprocess.Popen([CLI, "flush", str(mnt.path)], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    dirty: list[float] = []
    ages: list[float] = []
    try:
        while flush.poll() is None:
            samples = scrape(address)
            dirty.append(samples["lakefs_mount_dirty_bytes"])
            if "lakefs_mount_oldest_dirty_seconds" in samples:
                ages.append(samples["lakefs_mount_oldest_dirty_seconds"])
            time.sleep(SCRAPE_INTERVAL)
        assert flush.wait(timeout=300) == 0, flush.stderr.read()
    finally:
        if flush.poll() is None:
            flush.kill()
            flush.wait()
    fault_proxy.bandwidth_bytes_per_s = None
    assert len(dirty) >= 3 and dirty[0] > 0, dirty
    assert dirty == sorted(dirty, reverse=True), dirty
    assert any(0 < d < dirty[0] for d in dirty), dirty  # parts land one by one
    assert ages and max(ages) > 0, ages  # the oldest dirty data ages while it drains
    all_samples = scrape_samples(address)
    status = mnt.status()
    samples = scrape(address, all_samples)
    assert samples["lakefs_mount_dirty_bytes"] == status["dirty_bytes"] == 0
    assert status["oldest_dirty_s"] is None  # nothing dirty: no age, and no gauge
    assert "lakefs_mount_oldest_dirty_seconds" not in samples
    assert samples["lakefs_mount_dirty_files"] == status["files_pending"] == 0
    assert samples["lakefs_mount_uploads_in_flight"] == status["uploads_in_flight"] == 0
    assert samples["lakefs_mount_cache_budget_bytes"] == status["cache_size"]
    assert samples["lakefs_mount_dirty_limit_bytes"] == status["max_dirty"]
    for name in m.COUNTERS:
        assert samples[m.prometheus_counter(name) + "_total"] == \
            status["counters"].get(name, 0), name
    assert samples["lakefs_mount_uploaded_bytes_total"] >= len(data)
    requests = status["s3_requests"]
    assert requests["UploadPart"]["count"] >= 2 and requests["UploadPart"]["seconds_sum"] > 1
    for suffix, field in (("_count", "count"), ("_sum", "seconds_sum")):
        exported = by_operation(all_samples, "lakefs_mount_s3_request_duration_seconds" + suffix)
        assert exported == pytest.approx({op: s[field] for op, s in requests.items()})
    assert by_operation(all_samples, "lakefs_mount_s3_request_failures_total") == \
        {op: s["failures"] for op, s in requests.items()}


def test_operating_doc_lists_every_exported_metric():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "operating.md").read_text()
    names = [m.prometheus_counter(name) + "_total" for name in m.COUNTERS]
    names += [m.PROMETHEUS_PREFIX + name for name, _ in m.GAUGES.values()]
    names += [m.PROMETHEUS_PREFIX + m.S3_REQUEST_SECONDS,
              m.PROMETHEUS_PREFIX + m.S3_REQUEST_FAILURES + "_total"]
    missing = [name for name in names + ["lakefs_mount_info"] if f"`{name}`" not in doc]
    assert not missing, missing


def test_a_mount_whose_metrics_port_is_taken_fails_cleanly_and_one_without_serves_none(
        mount_factory):
    taken = MetricsServer("127.0.0.1:0", lambda: None)
    try:
        m = mount_factory(start=False)
        with pytest.raises(AssertionError, match=f"--metrics-addr {taken.address}: "):
            m.start("--metrics-addr", taken.address)
        assert not is_mounted(m.path)
    finally:
        taken.close()
    assert mount_factory(name="plain").status()["metrics_addr"] is None

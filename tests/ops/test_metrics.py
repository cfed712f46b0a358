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
# Prometheus names that repeated s3_request_duration_seconds_count{operation} and
# s3_request_failures_total (issue 52): gone from /metrics, kept in `status`.
DUPLICATES = frozenset(f"lakefs_mount_{name}_total"
                       for name in ("gets", "heads", "lists", "deletes", "errors"))


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
    for name in m.EXPORTED_COUNTERS:
        assert samples[m.prometheus_counter(name) + "_total"] == \
            status["counters"].get(name, 0)
    assert samples["lakefs_mount_uploaded_bytes_total"] == 123
    assert samples["lakefs_mount_dirty_bytes"] == 7
    assert samples["lakefs_mount_cache_budget_bytes"] == 1 << 30
    assert "lakefs_mount_dirty_limit_bytes" not in samples  # None: not known, not 0
    assert samples["lakefs_mount_info"] == 1
    assert all(name.startswith(("lakefs_mount_", "process_")) for name in samples)
    assert not DUPLICATES & set(samples)


def test_a_taken_metrics_port_is_an_error_that_names_the_option():
    first = MetricsServer("127.0.0.1:0", lambda: None)
    try:
        with pytest.raises(OSError, match=f"--metrics-addr {first.address}: "):
            MetricsServer(first.address, lambda: None)
        # no status yet: no numbers of the mount, not zeros (the process's own: yes)
        assert {name for name in scrape(first.address)
                if not name.startswith("process_")} == set()
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
    for name in m.EXPORTED_COUNTERS:
        assert samples[m.prometheus_counter(name) + "_total"] == \
            status["counters"].get(name, 0), name
    assert samples["lakefs_mount_uploaded_bytes_total"] >= len(data)
    requests = status["s3_requests"]
    assert requests["UploadPart"]["count"] >= 2 and requests["UploadPart"]["seconds_sum"] > 1
    for suffix, field in (("_count", "count"), ("_sum", "seconds_sum")):
        exported = by_operation(all_samples, "lakefs_mount_s3_request_duration_seconds" + suffix)
        assert exported == pytest.approx({op: s[field] for op, s in requests.items()})
    failed: dict[str, float] = {}
    for sample in all_samples:
        if sample.name == "lakefs_mount_s3_request_failures_total":
            op = sample.labels["operation"]
            failed[op] = failed.get(op, 0) + sample.value
    assert failed == {op: s["failures"] for op, s in requests.items() if s["failures"]}


def test_operating_doc_lists_every_exported_metric_and_none_it_dropped():
    """Every name a scrape of a status with every field gives (process_* too) is in
    docs/operating.md; the duplicates dropped in issue 52 are not."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "operating.md").read_text()
    op = {"count": 1, "failures": 1, "failure_codes": {"SlowDown": 1}, "seconds_sum": 0.1,
          "buckets": {"0.25": 1, "+Inf": 1}}
    status = {"counters": {}, **{key: 1 for key in m.GAUGES}, "s3_requests": {"PutObject": op},
              "fuse_requests": {"lookup": op}}
    server = MetricsServer("127.0.0.1:0", lambda: status)
    try:
        with urllib.request.urlopen(f"http://{server.address}/metrics", timeout=10) as resp:
            families = list(text_string_to_metric_families(resp.read().decode()))
    finally:
        server.close()
    names = {f.name if f.type == "histogram" else s.name for f in families for s in f.samples}
    assert {"lakefs_mount_info", "process_cpu_seconds_total",
            "lakefs_mount_fuse_request_duration_seconds"} <= names
    missing = sorted(name for name in names if f"`{name}`" not in doc)
    assert not missing, missing
    assert not [name for name in DUPLICATES if name in doc]


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


@pytest.mark.parametrize("fuse_session", ["native", "pyfuse3"], indirect=True)
def test_a_scrape_after_io_has_fuse_latencies_process_metrics_and_s3_error_codes_only_once(
        mount_factory, fault_proxy, fuse_session):
    """Issue 52, through a real mount of each FUSE session: FUSE requests in a latency
    histogram per operation, the process's CPU and memory, a throttled PUT counted
    under code="SlowDown", and none of the counters that repeated the S3 histograms."""
    fault_proxy.parse_requests = True  # before the mount: every connection is parsed
    mnt = mount_factory("--metrics-addr", "127.0.0.1:0", endpoint_url=fault_proxy.endpoint_url)
    mnt.probed()  # the checksum probe's PUTs (no error of the mount's) come first
    address = mnt.status()["metrics_addr"]
    fault_proxy.answer_with(503, "SlowDown", 2, frozenset({"PUT"}))
    data = os.urandom(3 * MiB)
    (mnt.path / "d").mkdir()
    (mnt.path / "d" / "f.bin").write_bytes(data)
    assert os.listdir(mnt.path / "d") == ["f.bin"]
    assert (mnt.path / "d" / "f.bin").read_bytes() == data
    assert mnt.flush().returncode == 0, mnt.log_tail()
    status = mnt.status()
    families = {}
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        for family in text_string_to_metric_families(resp.read().decode()):
            families[family.name] = family
    names = {s.name for f in families.values() for s in f.samples}
    assert not DUPLICATES & names, DUPLICATES & names

    fuse = families["lakefs_mount_fuse_request_duration_seconds"]
    assert fuse.type == "histogram"
    count = {s.labels["operation"]: s.value for s in fuse.samples if s.name.endswith("_count")}
    total = {s.labels["operation"]: s.value for s in fuse.samples if s.name.endswith("_sum")}
    assert {"lookup", "mkdir", "create", "release"} <= set(count), count
    if not status["passthrough"]:  # else the kernel writes the cache file itself
        assert count.get("write", 0) >= 1, count
    for op, n in count.items():
        buckets = [(float(s.labels["le"]), s.value) for s in fuse.samples
                   if s.name.endswith("_bucket") and s.labels["operation"] == op]
        assert [v for _, v in sorted(buckets)] == sorted(v for _, v in buckets)  # cumulative
        assert max(buckets)[1] == n >= 1, (op, buckets)
        assert 0 < total[op] < 10 * n, (op, total[op], n)  # seconds, not µs or ns
    assert status["fuse_requests"]["mkdir"]["count"] == count["mkdir"] == 1

    process = {s.name: s.value for f in families.values() for s in f.samples
               if s.name.startswith("process_")}
    assert process["process_cpu_seconds_total"] > 0
    assert process["process_resident_memory_bytes"] > 10 * MiB
    assert process["process_open_fds"] >= 3
    assert abs(process["process_start_time_seconds"]
               - (time.time() - status["uptime_s"])) < 30

    failures = [(s.labels["operation"], s.labels["code"], s.value)
                for s in families["lakefs_mount_s3_request_failures"].samples]
    assert sum(v for _, code, v in failures if code == "SlowDown") == 2, failures
    assert failures == [(op, code, n) for op, s in status["s3_requests"].items()
                        for code, n in s["failure_codes"].items()]

"""Prometheus `/metrics` of a mount (`--metrics-addr HOST:PORT`), off unless asked for.

Why every scrape reads the daemon's `status` dict instead of keeping Prometheus objects
updated next to the counters: the two can then never disagree, and the hot paths of the
cache and flusher stay free of exporter code. The HTTP server runs in prometheus-client's
own thread; `snapshot` must be callable from there (the daemon runs its status in the trio
loop and hands the result over).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import ProcessCollector, start_http_server
from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from lakefs_mount.config import parse_metrics_addr
from lakefs_mount.metrics import (
    EXPORTED_COUNTERS,
    FUSE_REQUEST_SECONDS,
    GAUGES,
    PROMETHEUS_PREFIX,
    S3_REQUEST_FAILURES,
    S3_REQUEST_SECONDS,
    prometheus_counter,
)

log = logging.getLogger(__name__)

INFO_LABELS = ("mountpoint", "bucket", "prefix", "fuse_session", "io_engine")


class StatusCollector(Collector):
    """Turns one `status` snapshot into the mount's metric families."""

    def __init__(self, snapshot: Callable[[], dict[str, Any] | None]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        status = self.snapshot()
        if status is None:  # the daemon is starting or has stopped: no numbers to give
            return
        counters = status.get("counters", {})
        for name, help_text in EXPORTED_COUNTERS.items():
            yield CounterMetricFamily(prometheus_counter(name), help_text,
                                      value=counters.get(name, 0))
        for key, (name, help_text) in GAUGES.items():
            value = status.get(key)
            if isinstance(value, int | float):
                yield GaugeMetricFamily(PROMETHEUS_PREFIX + name, help_text, value=value)
        yield from _request_metrics(status.get("s3_requests") or {})
        yield _latency(FUSE_REQUEST_SECONDS, "Time the daemon took to serve FUSE requests, by"
                       " operation (the kernel's opcode, lower case).",
                       status.get("fuse_requests") or {})
        info = GaugeMetricFamily(PROMETHEUS_PREFIX + "info", "What this mount serves.",
                                 labels=INFO_LABELS)
        info.add_metric([str(status.get(k, "")) for k in INFO_LABELS], 1)
        yield info


def _latency(name: str, help_text: str, ops: dict[str, dict[str, Any]]) -> Metric:
    """A histogram labelled `operation` from a snapshot of s3/stats.py or metrics.Latencies."""
    latency = HistogramMetricFamily(PROMETHEUS_PREFIX + name, help_text, labels=["operation"])
    for op, stats in ops.items():
        latency.add_metric([op], buckets=list(stats["buckets"].items()),
                           sum_value=stats["seconds_sum"])
    return latency


def _request_metrics(requests: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """Latency histogram of each S3 operation the mount has sent, and its failures by
    S3's error code (bounded: s3/stats.py)."""
    yield _latency(S3_REQUEST_SECONDS, "Time S3 requests took, by operation.", requests)
    failures = CounterMetricFamily(PROMETHEUS_PREFIX + S3_REQUEST_FAILURES,
                                   "S3 requests that failed, by operation and error code.",
                                   labels=["operation", "code"])
    for op, stats in requests.items():
        for code, n in stats.get("failure_codes", {}).items():
            failures.add_metric([op, code], n)
    yield failures


class MetricsServer:
    """The running `/metrics` endpoint; `address` is where it listens (port 0 resolved)."""

    def __init__(self, addr: str, snapshot: Callable[[], dict[str, Any] | None]) -> None:
        host, port = parse_metrics_addr(addr)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(StatusCollector(snapshot))
        ProcessCollector(registry=registry)  # process_cpu_seconds_total, ..._memory_bytes
        try:
            self._server, self._thread = start_http_server(port, host, registry)
        except OSError as exc:
            raise OSError(exc.errno, f"--metrics-addr {addr}: {exc.strerror}") from None
        bound_host, bound_port = str(self._server.server_address[0]), self._server.server_port
        self.address = (f"[{bound_host}]:{bound_port}" if ":" in bound_host
                        else f"{bound_host}:{bound_port}")
        log.info("Prometheus metrics at http://%s/metrics", self.address)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

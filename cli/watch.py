"""`lakefs-mount status --watch`: the status of a mount, again every few seconds, with the
rates and the time to clean that one snapshot cannot give.

Why rates here and not in the daemon: they are differences of counters the daemon already
keeps, over whatever interval the watcher picks; Prometheus users get the same from
`rate()` over the counters of /metrics.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from lakefs_mount.config import human_bytes

CLEAR = "\x1b[H\x1b[J"  # cursor home, erase to the end of the screen


@dataclass(frozen=True)
class Rates:
    """Bytes per second over the last interval, and when dirty data runs out at that pace."""

    upload: float
    download: float
    eta_seconds: float | None  # None: nothing dirty, or no upload progress to judge by


def _downloaded(status: dict[str, Any]) -> int:
    return int(status.get("counters", {}).get("bytes_downloaded", 0))


def rates(before: dict[str, Any], after: dict[str, Any], seconds: float) -> Rates:
    """Rates between two status snapshots taken `seconds` apart."""
    seconds = max(seconds, 1e-6)
    upload = max(0, after.get("bytes_uploaded", 0) - before.get("bytes_uploaded", 0)) / seconds
    download = max(0, _downloaded(after) - _downloaded(before)) / seconds
    dirty = after.get("dirty_bytes") or 0
    eta = dirty / upload if dirty and upload > 0 else None
    return Rates(upload, download, eta)


def describe_eta(status: dict[str, Any], r: Rates) -> str:
    if not status.get("dirty_bytes"):
        return "clean (everything is in S3)"
    if r.eta_seconds is None:
        return "unknown (no upload progress in the last interval)"
    return f"{r.eta_seconds:.0f} s at the current rate"


def render(status: dict[str, Any], r: Rates | None,
           format_status: Callable[[dict], str]) -> str:
    """The status table, with the rates and the time to clean once there are two samples."""
    if r is not None:
        status = {**status, "upload_rate": f"{human_bytes(r.upload)}/s",
                  "download_rate": f"{human_bytes(r.download)}/s",
                  "time_to_clean": describe_eta(status, r)}
    return format_status(status)


def watch_status(fetch: Callable[[], dict[str, Any]], interval: float, as_json: bool,
                 format_status: Callable[[dict], str], out: TextIO = sys.stdout) -> None:
    """Print the status every `interval` seconds until interrupted: redrawn in place on a
    terminal, one block per sample otherwise, or one JSON object per line with --json."""
    tty = out.isatty() and not as_json
    before: tuple[float, dict[str, Any]] | None = None
    while True:
        status = fetch()
        now = time.monotonic()
        r = rates(before[1], status, now - before[0]) if before else None
        before = (now, status)
        if as_json:
            sample = {**status, "upload_bytes_per_s": r.upload if r else None,
                      "download_bytes_per_s": r.download if r else None,
                      "time_to_clean_s": r.eta_seconds if r else None}
            text = json.dumps(sample, sort_keys=True, default=str) + "\n"
        else:
            text = render(status, r, format_status)
            text = f"{CLEAR}{text}\n" if tty else f"{text}\n\n"
        out.write(text)
        out.flush()
        time.sleep(interval)

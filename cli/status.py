"""`lakefs-mount status`: the daemon's status as a table (or JSON), once or --watch; secrets
never shown."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from lakefs_mount.cli.params import MOUNT_POINT, abs_path
from lakefs_mount.config import human_bytes
from lakefs_mount.ops import controlclient
from lakefs_mount.s3.stats import WAITING_AFTER

_SECRET_WORDS = ("secret", "password", "token", "credential", "access_key")

STATUS_ROWS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("mountpoint", "mount point", str),
    ("source", "source", str),
    ("bucket", "bucket", str),
    ("prefix", "prefix", lambda v: v or "(whole bucket)"),
    ("endpoint", "endpoint", str),
    ("pid", "daemon pid", str),
    ("uptime_s", "up for", lambda s: _duration(float(s))),
    ("io_engine", "io engine", str),
    ("fuse_session", "FUSE session", str),
    ("passthrough", "passthrough", str),  # (booleans: on, or off and why: _on_off)
    ("passthrough_reason", "", str),
    ("splice_writes", "spliced writes", str),
    ("spliced_reads", "spliced reads", str),
    ("spliced_reads_reason", "", str),
    ("checksums", "checksums", str),
    ("dirty_bytes", "dirty (not in S3)", human_bytes),
    ("oldest_dirty_s", "oldest dirty data", lambda v: f"{v:g} s old"),
    ("max_dirty", "max dirty", human_bytes),
    ("files_pending", "files pending", str),
    ("stale_writers", "files a crashed mount writes",
     lambda n: f"{n} (still open there: watched, see the log)"),
    ("uploads_in_flight", "uploads in flight", str),
    ("bytes_uploaded", "bytes uploaded", human_bytes),
    ("upload_rate", "upload rate", str),  # these three: status --watch
    ("download_rate", "download rate", str),
    ("time_to_clean", "time to clean", str),
    ("retries", "retries", str),
    ("errors", "errors", str),
    ("last_error", "last error", str),
    ("s3_in_flight", "S3 requests under way", str),
    ("s3_waiting", "S3 requests waiting",
     lambda n: f"{n} (under way for over {WAITING_AFTER:g} s)" if n else "0"),
    ("s3_oldest_request", "oldest S3 request", lambda r: " ".join(
        filter(None, (r["operation"], r["key"], f"for {r['age_s']:g} s")))),
    ("s3_oldest_request_s", "", str),  # (its age again, as one number for /metrics)
    ("last_s3_error_at", "last S3 error at",
     lambda ts: time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))),
    ("s3_requests", "S3 requests", lambda ops: ", ".join(
        f"{op} {s['count']}" + (f" ({s['failures']} failed)" if s["failures"] else "")
        for op, s in ops.items()) or "none"),
    ("hidden_objects", "names not shown",
     lambda n: f"{n} (an object and a directory of one name: see the log)"),
    ("hidden_examples", "", str),  # (the first few keys: status --json)
    ("cache_used", "cache used", human_bytes),
    ("orphans", "orphaned cache files",
     lambda v: f"{human_bytes(v)} (see: lakefs-mount orphans list)"),
    ("cache_size", "cache size", human_bytes),
    ("cache_dir", "cache dir", str),
    ("log_file", "log file", str),
    ("counters", "counters", lambda c: ", ".join(
        f"{name} {n}" for name, n in sorted(c.items()) if n) or "all 0"),
]


def _duration(seconds: float) -> str:
    """12 s, 5 min 3 s, 2 h 7 min, 3 d 4 h."""
    s = int(seconds)
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "min", 60),
                                      ("min", 60, "s", 1)):
        if s >= size:
            rest = (s % size) // sub_size
            return f"{s // size} {unit}" + (f" {rest} {sub}" if rest else "")
    return f"{seconds:.0f} s"


# Booleans of the status and the key that says why one is off (None: see the log)
ON_OFF = {"passthrough": "passthrough_reason", "splice_writes": None,
          "spliced_reads": "spliced_reads_reason"}


def _on_off(status: dict, key: str) -> str:
    """`on`, or `off (why)`: what a person reads where --json has true or false."""
    if status[key]:
        return "on"
    reason_key = ON_OFF[key]
    why = status.get(reason_key) if reason_key else None
    return f"off ({why or 'see the log'})"


# Shown in sections of their own below the table (see format_checkpoints).
SECTIONS = ("checkpoints", "commits")


def format_status(status: dict) -> str:
    """A two-column table of the status dict; unknown keys follow, secrets never; then
    the pending uploads per top-level directory and the commits under way."""
    rows = []
    known = set(SECTIONS)
    for key, label, fmt in STATUS_ROWS:
        known.add(key)
        if label and key in status and status[key] is not None:
            rows.append((label, _on_off(status, key) if key in ON_OFF else fmt(status[key])))
    for key in sorted(status):
        if key in known or any(w in key.lower() for w in _SECRET_WORDS):
            continue
        value = status[key]
        if value is None:
            continue
        text = json.dumps(value) if isinstance(value, dict | list) else str(value)
        rows.append((key.replace("_", " "), text))
    width = max((len(label) for label, _ in rows), default=0)
    table = "\n".join(f"{label:<{width}}  {value}" for label, value in rows)
    return "\n\n".join(filter(None, (table, format_checkpoints(status))))


def format_checkpoints(status: dict) -> str:
    """Per top-level directory (a checkpoint, as training jobs lay them out): its bytes
    and files not yet in S3 and its upload rate; then the commits under way. Empty if
    there is nothing of either."""
    dirs: dict[str, dict] = status.get("checkpoints") or {}
    commits: list[dict] = status.get("commits") or []
    lines = []
    if dirs:
        rows = [("directory", "pending", "files", "uploaded/s")] + [
            (name, human_bytes(d["pending_bytes"]), str(d["pending_files"]),
             "-" if d.get("upload_rate") is None else f"{human_bytes(d['upload_rate'])}/s")
            for name, d in dirs.items()]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines += [f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:>{widths[2]}}  {d}".rstrip()
                  for a, b, c, d in rows]
    if commits:
        lines += ["", "commits under way"] if lines else ["commits under way"]
        lines += [f"{c['path']}  {c['stage']} (for {c['for_s']:g} s)" for c in commits]
    return "\n".join(lines)


@click.command()
@click.argument("mountpoint", type=MOUNT_POINT)
@click.option("--json", "as_json", is_flag=True, help="Print the raw status as JSON.")
@click.option("--timeout", type=click.FloatRange(min=0), default=10.0, show_default=True,
              metavar="SECONDS")
@click.option("--watch", is_flag=True, help="Show it again every --interval, with upload "
              "and download rates and the time to clean, until interrupted.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              metavar="SECONDS", help="Seconds between samples of --watch.")
def status(mountpoint: Path, as_json: bool, timeout: float, watch: bool,
           interval: float) -> None:
    """Show dirty data, uploads, errors and cache use of a mount."""
    def fetch() -> dict:
        result = controlclient.call(abs_path(mountpoint), {"op": "status"}, timeout=timeout)
        return {k: v for k, v in result.items()
                if not any(w in k.lower() for w in _SECRET_WORDS)}

    if watch:
        from lakefs_mount.cli.watch import watch_status

        try:
            watch_status(fetch, interval, as_json, format_status)
        except KeyboardInterrupt:
            return
    result = fetch()
    if as_json:
        click.echo(json.dumps(result, indent=2, sort_keys=True, default=str))
    else:
        click.echo(format_status(result))

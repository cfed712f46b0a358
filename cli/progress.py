"""Progress of a flush, warm-up or unmount as the daemon reports it (bytes and files left,
the last S3 error), shown to a person or a script.

On a terminal a bar with bytes, rate and ETA is redrawn in place at most every REDRAW
seconds, and stays at 100 % when the operation ends; in a log (not a terminal) a plain
line every PLAIN_INTERVAL seconds; with --json every report as one JSON line on stdout.
The display only reads reports the daemon sends anyway (about one a second), so it
cannot slow the operation down.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from lakefs_mount.config import human_bytes

REDRAW = 0.2  # seconds between redraws of the bar
PLAIN_INTERVAL = 10.0  # seconds between plain lines when stderr is not a terminal
BAR_WIDTH = 24


def left_bytes(info: dict | None) -> int | None:
    """Bytes not yet in S3 from a progress report (the daemon says bytes_left)."""
    info = info or {}
    left = info.get("bytes_left", info.get("dirty_bytes"))
    return left if isinstance(left, int) else None


def count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def describe_progress(info: dict) -> str:
    """One human line from a progress report; the last S3 error says why it is slow."""
    parts = []
    left = left_bytes(info)
    if left is not None:
        parts.append(f"{human_bytes(left)} left")
    files = info.get("files_left", info.get("files"))
    if isinstance(files, int):
        parts.append(count(files, "file"))
    if "uploaded_bytes" in info:
        parts.append(f"{human_bytes(info['uploaded_bytes'])} uploaded")
    why = why_waiting(info)
    if why:
        parts.append(why)
    if not parts:
        parts = [f"{k}={v}" for k, v in info.items()]
    return ", ".join(parts)


def why_waiting(info: dict) -> str | None:
    """What holds an operation up, from a progress report: an S3 request under way for
    seconds (`waiting_on`), and the last S3 error."""
    waiting, error = info.get("waiting_on"), info.get("last_error")
    if waiting and error:
        return f"waiting on S3: {waiting} (last error: {error})"
    if waiting:
        return f"waiting on S3: {waiting}"
    return f"retrying after: {error}" if error else None


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


class ProgressPrinter:
    """Turns the daemon's progress reports into a bar, plain lines or JSON lines."""

    def __init__(self, verb: str, as_json: bool = False, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.verb = verb
        self.as_json = as_json
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() and not as_json
        self.clock = clock
        self.started = clock()
        self.last_print = -float("inf")
        self.last: dict | None = None
        self.total = 0  # the most bytes left ever reported: what the operation covers
        self.dirty_line = False

    def measure(self, left: int) -> dict[str, Any]:
        """Done and total bytes, average rate and ETA for `left` bytes left now."""
        self.total = max(self.total, left)
        done = self.total - left
        elapsed = self.clock() - self.started
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = left / rate if rate > 0 else None
        return {"done_bytes": done, "total_bytes": self.total, "bytes_per_s": round(rate),
                "eta_s": None if eta is None else round(eta, 1)}

    def bar(self, left: int, why: str | None = None) -> str:
        m = self.measure(left)
        fraction = m["done_bytes"] / m["total_bytes"] if m["total_bytes"] else 1.0
        filled = round(fraction * BAR_WIDTH)
        eta = "" if m["eta_s"] is None or not left else f"  ETA {_duration(m['eta_s'])}"
        text = (f"{self.verb} [{'#' * filled}{'-' * (BAR_WIDTH - filled)}] "
                f"{fraction * 100:3.0f}%  {human_bytes(m['done_bytes'])} / "
                f"{human_bytes(m['total_bytes'])}  {human_bytes(m['bytes_per_s'])}/s{eta}")
        return f"{text}  {why}" if why else text

    def __call__(self, info: dict) -> None:
        self.last = info
        left = left_bytes(info)
        if left is not None:  # (also between plain lines: the summary tells the total)
            # what the daemon says the operation covers (a warm-up's bytes to fetch: more
            # than were left at its first report, a second into it), else the most left
            self.total = max(self.total, left, info.get("bytes_total") or 0)
        if self.as_json:
            extra = self.measure(left) if left is not None else {}
            print(json.dumps({"progress": {**info, **extra}}, default=str), flush=True)
            return
        now = self.clock()
        if now - self.last_print < (REDRAW if self.tty else PLAIN_INTERVAL):
            return
        self.last_print = now
        if self.tty and left is not None:
            self._redraw(self.bar(left, why_waiting(info)))
        elif self.tty:
            self._redraw(f"{self.verb}: {describe_progress(info)}")
        else:
            self.stream.write(f"{self.verb}: {describe_progress(info)}\n")
            self.stream.flush()

    def _redraw(self, text: str) -> None:
        self.stream.write("\r\x1b[K" + text)
        self.stream.flush()
        self.dirty_line = True

    def done(self, finished: bool = False) -> None:
        """End the display: a bar that was shown ends at 100 % when the operation
        `finished`, and is cleared when it failed (the error line follows)."""
        if not self.dirty_line:
            return
        if finished:
            self.stream.write("\r\x1b[K" + self.bar(0) + "\n")
        else:
            self.stream.write("\r\x1b[K")
        self.stream.flush()
        self.dirty_line = False

"""Per-checkpoint progress for `status`: what each top-level directory of the mount still
has to upload, how fast its bytes go up, and the commits under way.

A training job writes one checkpoint directory per step at the mount's top level
(`step_100/`, `checkpoint-7/`); an operator wants to see which of them is still uploading.
The pending bytes come from one pass over the files with something pending (the files
`status` walks already), not from counters kept at every chunk change: a rename moves a
file from `tmp-checkpoint-7/` to `checkpoint-7/`, and counters per directory would have
to follow every rename. The upload rate needs history, so the chunk book reports each
chunk that reaches S3 (`uploaded`), and a short window of those per directory is kept.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from lakefs_mount.cache.cachefile import DIRTY_STATES, CachedFile

RATE_WINDOW = 10.0  # seconds of uploads an upload rate is the average over
ROOT = "/"  # the files at the top level of the mount itself


@dataclass
class CommitUnderWay:
    path: str
    started: float = field(default_factory=time.monotonic)
    stage: str = "flushing"


class DirProgress:
    """Uploads per top-level directory of a mount of `prefix`, and its commits under way."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._uploads: dict[str, deque[tuple[float, int]]] = {}  # dir -> (when, bytes)
        self._first_upload: dict[str, float] = {}
        self._commits: dict[int, CommitUnderWay] = {}

    def top(self, key: str) -> str:
        """The top-level directory of the mount that `key` lies in (`step_1/`), or ROOT."""
        head, slash, _ = key[len(self.prefix):].partition("/")
        return head + "/" if slash else ROOT

    def uploaded(self, cf: CachedFile, nbytes: int) -> None:
        """A chunk of `cf` reached S3 (a part, or the object itself): the chunk book
        calls this for every one, so it only appends."""
        top, now = self.top(cf.key), time.monotonic()
        window = self._uploads.get(top)
        if window is None:
            window = self._uploads[top] = deque()
            self._first_upload[top] = now
        window.append((now, nbytes))
        self._trim(top, window, now)

    def _trim(self, top: str, window: deque[tuple[float, int]], now: float) -> None:
        while window and window[0][0] < now - RATE_WINDOW:
            window.popleft()
        if not window:
            del self._uploads[top], self._first_upload[top]

    def rate(self, top: str, now: float) -> int | None:
        """Bytes per second that reached S3 for `top` over the last RATE_WINDOW seconds
        (or since its first upload in them); None if none did."""
        window = self._uploads.get(top)
        if window is None:
            return None
        self._trim(top, window, now)
        if top not in self._uploads:
            return None
        span = min(RATE_WINDOW, max(1.0, now - self._first_upload[top]))
        return round(sum(n for _, n in window) / span)

    @contextmanager
    def commit(self, path: str) -> Iterator[CommitUnderWay]:
        """A commit of `path` under way for as long as the block runs; the block sets its
        `stage` as it goes."""
        under_way = CommitUnderWay(path)
        self._commits[id(under_way)] = under_way
        try:
            yield under_way
        finally:
            del self._commits[id(under_way)]

    def status(self, pending: Iterable[CachedFile]) -> dict[str, object]:
        """`checkpoints`: per top-level directory with pending files or recent uploads,
        its bytes not yet in S3, its pending files and its upload rate; `commits`: the
        commits under way, oldest first. One pass over `pending`, whose chunks it sums."""
        now = time.monotonic()
        totals: dict[str, list[int]] = {}  # dir -> [pending files, pending bytes]
        start = len(self.prefix)
        for cf in pending:  # (plain loops, `top` inlined: every status walks them all)
            key = cf.key
            slash = key.find("/", start)
            name = ROOT if slash < 0 else key[start:slash + 1]
            acc = totals.get(name)
            if acc is None:
                acc = totals[name] = [0, 0]
            acc[0] += 1
            for ch in cf.chunks.values():
                if ch.state in DIRTY_STATES:
                    acc[1] += ch.held
        dirs: dict[str, dict[str, int | None]] = {
            name: {"pending_bytes": nbytes, "pending_files": nfiles}
            for name, (nfiles, nbytes) in totals.items()}
        for top in list(self._uploads):
            dirs.setdefault(top, {"pending_bytes": 0, "pending_files": 0})
        for top, entry in dirs.items():
            entry["upload_rate"] = self.rate(top, now)
        commits = sorted(self._commits.values(), key=lambda c: c.started)
        return {"checkpoints": dict(sorted(dirs.items())),
                "commits": [{"path": "/" + c.path, "stage": c.stage,
                             "for_s": round(now - c.started, 1)} for c in commits]}

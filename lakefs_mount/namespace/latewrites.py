"""Commits that reach S3 after the DELETE that was meant to follow them.

An unlink that comes while the file's commit is under way journals the file's DELETE to
run once that commit has ended (fs/names.py). Yet the commit's PutObject may land after the
DELETE: the daemon was killed while the request sat in the kernel's socket buffers or in
a proxy (the next mount replays the DELETE at once, and S3 carries out the dead process's
request when it arrives), or the request timed out here and S3 took it later. Nothing can
order such a request, so the mount watches: for WINDOW_SECONDS after such a DELETE (the
journal keeps the watch across crashes), an object at the key that the unlinked file
wrote (its META_WRITER tag) is deleted again. Objects of other writers are left alone, and
so is a file of that name this mount made since (a stale commit landing on it is logged).
A CompleteMultipartUpload that late fails instead: the upload was aborted (a mount's
recovery aborts the uploads its journal no longer references).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from lakefs_mount import metrics as m
from lakefs_mount.cache.asyncjournal import AsyncJournal
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.layout import META_WRITER, writer_tag
from lakefs_mount.s3.objectstore import ObjectStoreError

log = logging.getLogger(__name__)

# How long a late request is waited for. S3 drops a request whose bytes stop coming, and a
# killed process's socket gives up retransmitting within minutes; a request held longer
# than this somewhere on the way is not undone (docs/durability.md, D26).
WINDOW_SECONDS = 600.0
FIRST_LOOK_SECONDS = 0.5  # then each look waits 1.5 x longer, up to LONGEST_WAIT_SECONDS
LONGEST_WAIT_SECONDS = 15.0
LOOKS_AT_ONCE = 4  # HEADs in flight for all the watches (an rmtree after a crash: many)


class LateWrites:
    def __init__(self, store: AsyncStore, journal: AsyncJournal, metrics: m.Metrics,
                 writer: str) -> None:
        self.store = store
        self.journal = journal
        self.metrics = metrics
        self.writer = writer  # this cache's name in its objects' META_WRITER
        # the mount has a file of its own at the key (created or written since it started);
        # set by the assembly once the namespace exists
        self.made_here: Callable[[str], bool] = lambda key: True
        self._nursery: trio.Nursery | None = None
        self._looks = trio.CapacityLimiter(LOOKS_AT_ONCE)

    @staticmethod
    def until() -> float:
        """When a watch starting now ends (wall clock: it outlives the process)."""
        return time.time() + WINDOW_SECONDS

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Go on with the watches an earlier mount left, then with each one `follow`ed."""
        watches = await self.journal(self.journal.sync.late_watches, time.time())
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for key, fid, until in watches:
                nursery.start_soon(self._watch, key, fid, until)
            task_status.started()
            await trio.sleep_forever()

    def follow(self, key: str, fid: int, until: float) -> None:
        """Watch `key` for what file `fid` lands there (the journal has the watch)."""
        assert self._nursery is not None, "LateWrites.run first"
        self._nursery.start_soon(self._watch, key, fid, until)

    async def _watch(self, key: str, fid: int, until: float) -> None:
        tag = writer_tag(self.writer, fid)
        wait = FIRST_LOOK_SECONDS
        while time.time() < until:
            await trio.sleep(wait)
            wait = min(wait * 1.5, LONGEST_WAIT_SECONDS)
            try:
                async with self._looks:
                    info = await self.store.head(key, attempts=1)
                if info is None or info.metadata.get(META_WRITER) != tag:
                    continue
                if self.made_here(key):  # (not deleted: that would lose it too)
                    log.error("%s: a commit under way at the file's unlink landed after its "
                              "DELETE, and a file of that name was made here since: if "
                              "that one was committed before, S3 holds the old bytes until "
                              "it is written again", key)
                    return
                await self.store.delete(key)
            except ObjectStoreError as exc:  # S3 in trouble: look again later
                log.debug("%s: not looked at for late commits: %s", key, exc)
                continue
            self.metrics[m.LATE_COMMITS_UNDONE] += 1
            log.warning("%s: a commit under way at the file's unlink landed after its "
                        "DELETE; deleted again", key)

"""Commits of a killed daemon that reach S3 after the next mount replayed their DELETE.

A process killed while its PutObject sits in the kernel's socket buffers (or in a proxy,
a load balancer) does not take the request back: S3 carries it out when it arrives. An
unlink that came while that commit was under way journaled the file's DELETE to run after
it (fsnames); the next mount replays the DELETE at once, and the dead daemon's request
may land afterwards and bring the file back. (A CompleteMultipartUpload that late fails:
recovery aborts the uploads the journal no longer references.) No journal can order a
dead process's request, so the mount watches: it looks at the key of such a DELETE for
WINDOW_SECONDS (the journal keeps the watch across crashes), and an object there that the
unlinked file wrote (its META_WRITER tag) is deleted again. Objects of other writers are
left alone, and so is a file of that name this mount made since (a stale commit landing
on it is logged).
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

# How long a request of a dead daemon is waited for. S3 drops a request whose bytes stop
# coming, and a killed process's socket gives up retransmitting within minutes; a request
# held longer than this somewhere on the way is not undone (docs/durability.md).
WINDOW_SECONDS = 600.0
FIRST_LOOK_SECONDS = 0.5  # then each look waits 1.5 x longer, up to LONGEST_WAIT_SECONDS
LONGEST_WAIT_SECONDS = 15.0


class LateWrites:
    def __init__(self, store: AsyncStore, journal: AsyncJournal, metrics: m.Metrics,
                 writer: str, *, made_here: Callable[[str], bool]) -> None:
        self.store = store
        self.journal = journal
        self.metrics = metrics
        self.writer = writer  # this cache's name in its objects' META_WRITER
        # the mount has a file of its own at the key (created or written since it started)
        self.made_here = made_here

    async def run(self, replayed: list[tuple[str, int]], *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Watch the keys of the `replayed` DELETEs (key, fid of the unlinked file), and
        those an earlier mount was still watching, each until its window is over."""
        now = time.time()
        watches = await self.journal(self.journal.sync.late_watches, replayed,
                                     now + WINDOW_SECONDS, now)
        task_status.started()
        async with trio.open_nursery() as nursery:
            for key, fid, until in watches:
                nursery.start_soon(self._watch, key, fid, until)

    async def _watch(self, key: str, fid: int, until: float) -> None:
        """Until `until` (wall clock), delete whatever file `fid` lands at `key`. (Before
        the replayed DELETE is applied too: it would delete the same object.)"""
        tag = writer_tag(self.writer, fid)
        wait = FIRST_LOOK_SECONDS
        while time.time() < until:
            await trio.sleep(wait)
            wait = min(wait * 1.5, LONGEST_WAIT_SECONDS)
            try:
                info = await self.store.head(key, attempts=1)
                if info is None or info.metadata.get(META_WRITER) != tag:
                    continue
                if self.made_here(key):  # (not deleted: that would lose it too)
                    log.error("%s: a commit the killed daemon had under way landed after "
                              "the file's unlink, and a file of that name was made here "
                              "since: if that one was committed before, S3 holds the "
                              "old bytes until it is written again", key)
                    return
                await self.store.delete(key)
            except ObjectStoreError as exc:  # S3 in trouble: look again later
                log.debug("%s: not looked at for late commits: %s", key, exc)
                continue
            self.metrics[m.LATE_COMMITS_UNDONE] += 1
            log.warning("%s: a commit the killed daemon had under way landed after the "
                        "file's unlink; deleted again", key)

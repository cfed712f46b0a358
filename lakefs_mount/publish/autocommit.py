"""`--commit-on-rename GLOB`: commit a directory once it is renamed to a matching name.

Hugging Face, Megatron and DeepSpeed save into a temporary directory and rename it when
done (`tmp-checkpoint-100` -> `checkpoint-100`): with this option that rename publishes
the checkpoint (its manifest written last, as `lakefs-mount commit` does), and the
training script changes nothing. The commit waits for the rename to reach S3 (a flush
of the new name drains the namespace changes under it first).
"""

from __future__ import annotations

import fnmatch
import logging
import math

import trio

from lakefs_mount.namespace.namelog import MOVE
from lakefs_mount.publish.publisher import CommittingMount, commit_request, no_progress

log = logging.getLogger(__name__)

SETTLE_POLL = 0.05  # seconds between looks for files still at the old name
SETTLE_MAX = 10.0


class RenameCommits:
    """Notices directory renames to a name matching `pattern` (the namespace log tells
    `noticed` of each change it records) and commits each."""

    def __init__(self, daemon: CommittingMount, pattern: str) -> None:
        self.daemon = daemon
        self.pattern = pattern
        self._send, self._receive = trio.open_memory_channel[tuple[str, str]](math.inf)

    def noticed(self, op: str, key: str, dst: str | None) -> None:
        if op != MOVE or dst is None or not key.endswith("/"):
            return
        name = dst.rstrip("/").rsplit("/", 1)[-1]
        if fnmatch.fnmatchcase(name, self.pattern):
            self._send.send_nowait((key, dst))

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            async for src, dst in self._receive:
                nursery.start_soon(self._commit, src, dst)

    async def _commit(self, src: str, dst: str) -> None:
        path = dst[len(self.daemon.config.prefix):].strip("/")
        await self._settled(src)
        try:
            result = await commit_request(self.daemon, {"path": path}, no_progress)
        except Exception as exc:  # (logged: nobody waits for it)
            log.error("commit of /%s on its rename failed: %s; run lakefs-mount commit",
                      path, exc)
            return
        log.info("committed /%s on its rename: %d files, manifest %s", path,
                 result["files"], result["manifest"])

    async def _settled(self, src: str) -> None:
        """Until the renamed files carry their new keys (the rename rekeys them right
        after it is recorded), so that the commit's flush finds them there."""
        with trio.move_on_after(SETTLE_MAX):
            while any(cf.key.startswith(src) and cf.pending
                      for cf in list(self.daemon.core.cache.files.values())):
                await trio.sleep(SETTLE_POLL)

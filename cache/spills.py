"""Parts of a file larger than the cache, kept readable in S3 while the file is open (D30).

S3 cannot read back the parts of a multipart upload before it is completed, so a file open
for writing keeps in the cache every byte it has sent: one file larger than --cache-size
overfilled it. Once the bytes eviction cannot free (dirty chunks, and uploaded parts that
wait for their file's commit) pass SPILL_AT of --cache-size, each further full chunk of a
file still open for writing goes up as an object of its own, a *spilled part*:

    PREFIX/.lakefs-mount/spill/<writer>/<fid>/<chunk index>-<token>

(PutObject with its CRC-32C; the journal records it, D30). Its chunk is clean from then on:
evicted like any other, read back from that object and checked against the CRC, and the
commit copies it into the file's multipart upload server-side (UploadPartCopy), as it
copies unchanged parts from a base object. A write to the chunk makes it dirty again (the
object is then stale; a new spill of it gets a new token, so a commit that copied the old
one never deletes the new). The objects go once a commit has copied them (the stale ones
of the file with them) or the file is removed; a crash before that leaves them to the next
mount of this cache directory (`sweep`), which deletes every object under its folder that
its journal does not name.

The daemon sees every write of such a file: a file with FUSE passthrough opens never
spills, and a file with spilled parts is not opened in passthrough (its bytes are not all
in the cache file). While the cache is that short of room, no file is opened for writing
in passthrough: its parts could not spill.
"""

from __future__ import annotations

import logging
import secrets

from lakefs_mount.cache.budget import CacheBudget
from lakefs_mount.cache.cachefile import CachedFile, SpilledPart
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.layout import RESERVED_NAME
from lakefs_mount.s3.objectstore import ObjectStoreError

log = logging.getLogger(__name__)

SPILL_AT = 0.75  # share of --cache-size that bytes eviction cannot free may reach unspilled
FOLDER = RESERVED_NAME + "/spill/"


def short_of_room(budget: CacheBudget, nbytes: int = 0) -> bool:
    """The bytes eviction cannot free, with `nbytes` more, pass SPILL_AT of the cache."""
    return budget.used - budget.clean_bytes(set()) + nbytes > SPILL_AT * budget.capacity


class Spills:
    """Where a mount's spilled parts live, when a part spills, and their removal."""

    def __init__(self, store: AsyncStore, budget: CacheBudget, prefix: str,
                 writer: str) -> None:
        self.store = store
        self.budget = budget
        self.folder = f"{prefix}{FOLDER}{writer or 'local'}/"

    def file_folder(self, fid: int) -> str:
        return f"{self.folder}{fid}/"

    def key(self, fid: int, idx: int, token: str) -> str:
        return f"{self.file_folder(fid)}{idx}-{token}"

    def part_key(self, cf: CachedFile, idx: int, part: SpilledPart) -> str:
        assert cf.fid is not None
        return self.key(cf.fid, idx, part.token)

    @staticmethod
    def new_token() -> str:
        return secrets.token_hex(6)

    def wanted(self, cf: CachedFile, nbytes: int) -> bool:
        """Should a full chunk of `nbytes` of `cf` go up as a spilled part? Only while a
        writer the daemon sees holds the file open (a closed file's parts are clean at
        its commit, soon) and the cache could not otherwise hold it."""
        if not cf.writers or cf.pt.opens or cf.pt.writers or cf.pt.flagged or cf.fid is None:
            return False
        return short_of_room(self.budget, nbytes)

    async def remove(self, keys: list[str]) -> None:
        """Spilled parts nothing needs any more: gone from S3. A failure is logged: the
        next mount's `sweep` finds them."""
        try:
            for key in keys:
                await self.store.delete(key)
        except ObjectStoreError as exc:
            log.warning("spilled parts left in S3 for now (%s): %s", keys[0], exc)

    async def remove_all(self, fid: int) -> None:
        """Every spilled part of file `fid` (its pending changes were dropped)."""
        try:
            found = await self.store.list_recursive(self.file_folder(fid))
        except ObjectStoreError as exc:
            log.warning("spilled parts under %s left in S3 for now: %s",
                        self.file_folder(fid), exc)
            return
        await self.remove([obj.key for obj in found])

    async def sweep(self, named: set[str]) -> int:
        """At mount, before any part spills: delete every object under this cache's
        folder that the journal does not name (a crash came before their deletion).
        Returns how many."""
        try:
            doomed = [o.key for o in await self.store.list_recursive(self.folder)
                      if o.key not in named]
        except ObjectStoreError as exc:
            log.warning("spilled parts under %s not swept: %s", self.folder, exc)
            return 0
        if doomed:
            await self.remove(doomed)
        return len(doomed)

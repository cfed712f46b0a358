"""Directory attributes in S3 that survive a remount, on any S3 store.

A directory's mode, owner and mtime go on its `dir/` marker as user metadata, as s3fs and
rclone read them. Some stores drop user metadata on keys ending in "/" (SeaweedFS: its
filer turns such a key into a folder), so a mount asks once per cache directory (probe, the
answer kept in the journal) and, where markers lose it, also writes a sidecar key that holds
the attributes in its name:

    <prefix>.lakefs-mount/dirs/<parent path>.lakefs-mount/<name>/<mode>.<uid>.<gid>.<mtime_ns>

under the mount's prefix, as every other key of the mount's own: a bucket policy scoped to
the prefix covers them. (Earlier versions wrote them at the bucket root, named by the whole
key; a mount moves those of its prefix once: `move_root_sidecars`.) One listing of a
parent's sidecar folder gives the attributes of all its subdirectories (no HEAD, no GET
per directory). No directory can be named `.lakefs-mount`, so no sidecar key is
ever also a folder (SeaweedFS refuses that). Where a name holds several sidecar keys (a
crash between writing the new one and deleting the old, or two nodes), the newest wins, and
of equally new ones the one that grants the fewest permissions.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass

import trio

from lakefs_mount.cache.asyncjournal import AsyncJournal
from lakefs_mount.namespace.dirindex import RESERVED_NAME
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.layout import decode_attrs
from lakefs_mount.s3.objectstore import MAX_KEY_BYTES, ObjectInfo, ObjectStoreError

log = logging.getLogger(__name__)

SIDECAR_ROOT = RESERVED_NAME + "/dirs/"
CHILDREN = RESERVED_NAME + "/"  # after a directory's key: the folder of its children's keys
PROBE_META = "lakefs-mount-probe"
JOURNAL_META = "dir_markers_keep_metadata"  # "1" or "0", the probe's answer
MOVED_META = "dir_sidecars_under_prefix"  # "1" once the bucket root's were moved (or none)
# The longest sidecar key beyond its directory's own key: the two folders, a "/" and the
# longest name of a mode, uid, gid and mtime.
SIDECAR_OVERHEAD = len(SIDECAR_ROOT) + len(CHILDREN) + 1 + len("65535.4294967295.4294967295.") + 20
HEAD_CONCURRENCY = 32


@dataclass(frozen=True)
class DirStat:
    """What a directory's sidecar key stores."""

    mode: int
    uid: int
    gid: int
    mtime_ns: int

    def leaf(self) -> str:
        return f"{self.mode}.{self.uid}.{self.gid}.{self.mtime_ns}"

    @staticmethod
    def parse(leaf: str) -> DirStat | None:
        try:
            mode, uid, gid, mtime_ns = (int(part) for part in leaf.split("."))
        except ValueError:
            return None
        return DirStat(mode, uid, gid, mtime_ns) if stat.S_ISDIR(mode) else None


def _split(dir_key: str) -> tuple[str, str]:
    """'a/b/' -> ('a/', 'b')."""
    head, _, name = dir_key.rstrip("/").rpartition("/")
    return head + "/" if head else "", name


def entry_folder(dir_key: str, prefix: str = "") -> str:
    """Where the sidecar key of the directory `dir_key` ('p/a/b/', under `prefix` 'p/') lives."""
    parent, name = _split(dir_key)
    return sidecar_root(prefix) + parent[len(prefix):] + CHILDREN + name + "/"


def sidecar_root(prefix: str) -> str:
    return prefix + SIDECAR_ROOT


def sidecar_fits(dir_key: str) -> bool:
    return len(os.fsencode(dir_key)) + SIDECAR_OVERHEAD <= MAX_KEY_BYTES


def _newest(candidates: list[tuple[ObjectInfo, DirStat]]) -> DirStat:
    """The newest; of equally new ones, the one granting the fewest permission bits."""
    return max(candidates,
               key=lambda c: (c[0].mtime, -bin(stat.S_IMODE(c[1].mode)).count("1")))[1]


class DirAttrs:
    """Reads and writes directory attributes; `keeps_marker_metadata` is the probe's answer
    (None: unknown, so both places are read and the sidecar is written)."""

    def __init__(self, store: AsyncStore, keeps_marker_metadata: bool | None,
                 prefix: str = "") -> None:
        self.store = store
        self.keeps_marker_metadata = keeps_marker_metadata
        self.prefix = prefix
        self.root = sidecar_root(prefix)

    @property
    def sidecars(self) -> bool:
        return self.keeps_marker_metadata is not True

    @property
    def lists_siblings(self) -> bool:
        """One request reads every subdirectory of a parent (no HEAD per marker)."""
        return self.keeps_marker_metadata is False

    # -- reading -------------------------------------------------------------------------

    async def load(self, parent_key: str, names: list[str]) -> dict[str, DirStat]:
        """Stored attributes of the subdirectories `names` of `parent_key`; a name without
        any is left out. ObjectStoreError when S3 cannot say."""
        found: dict[str, DirStat] = {}
        if self.sidecars:
            found = await self._load_sidecars(parent_key)
        if self.keeps_marker_metadata is not False:
            missing = [name for name in names if name not in found]
            found.update(await self._load_markers(parent_key, missing))
        return {name: found[name] for name in names if name in found}

    async def _load_sidecars(self, parent_key: str) -> dict[str, DirStat]:
        folder = self.root + parent_key[len(self.prefix):] + CHILDREN
        candidates: dict[str, list[tuple[ObjectInfo, DirStat]]] = {}
        for obj in await self.store.list_recursive(folder):
            name, sep, leaf = obj.key[len(folder):].partition("/")
            parsed = DirStat.parse(leaf) if sep and "/" not in leaf else None
            if parsed is not None:
                candidates.setdefault(name, []).append((obj, parsed))
        return {name: _newest(found) for name, found in candidates.items()}

    async def _load_markers(self, parent_key: str, names: list[str]) -> dict[str, DirStat]:
        found: dict[str, DirStat] = {}
        limiter = trio.CapacityLimiter(HEAD_CONCURRENCY)

        async def head(name: str) -> None:
            async with limiter:
                info = await self.store.head(parent_key + name + "/")
            attrs = decode_attrs(info.metadata) if info is not None else None
            if attrs is not None and attrs.mode is not None:
                found[name] = DirStat(stat.S_IFDIR | stat.S_IMODE(attrs.mode),
                                      attrs.uid or 0, attrs.gid or 0, attrs.mtime_ns or 0)

        async with trio.open_nursery() as nursery:
            for name in names:
                nursery.start_soon(head, name)
        return found

    # -- writing -------------------------------------------------------------------------

    async def save(self, dir_key: str, attrs: DirStat, *, replace: bool) -> None:
        """Write the sidecar key (the caller writes the marker); `replace`: delete the keys
        it replaces (a new directory has none)."""
        if not self.sidecars:
            return
        folder = entry_folder(dir_key, self.prefix)
        await self.store.call(self.store.sync.put, folder + attrs.leaf(), b"", {})
        if replace:
            await self._delete_keys([o.key for o in await self.store.list_recursive(folder)
                                     if o.key != folder + attrs.leaf()])

    async def remove(self, dir_key: str) -> None:
        """The directory is gone: its sidecar keys go (a failure is logged: a stale key
        only matters if the same path is made again by a tool other than a mount)."""
        if not self.sidecars:
            return
        try:
            folder = entry_folder(dir_key, self.prefix)
            await self._delete_keys([o.key for o in await self.store.list_recursive(folder)])
        except ObjectStoreError as exc:
            log.warning("attributes of removed directory %s left in S3: %s", dir_key, exc)

    async def copy_tree(self, old_key: str, new_key: str, attrs: DirStat
                        ) -> tuple[list[str], list[str]]:
        """A directory rename, before its objects move: the sidecar keys of the directory
        and of every directory below it at the new place. Returns (old keys, new keys): the
        old go once the rename is done, the new if it fails."""
        if not self.sidecars:
            return [], []
        old_below, new_below = (self.root + key[len(self.prefix):] for key in (old_key, new_key))
        below = await self.store.list_recursive(old_below)
        own = await self.store.list_recursive(entry_folder(old_key, self.prefix))
        new_keys = [entry_folder(new_key, self.prefix) + attrs.leaf()]
        await self.store.call(self.store.sync.put, new_keys[0], b"", {})
        for obj in below:
            moved = new_below + obj.key[len(old_below):]
            await self.store.copy(obj.key, moved, None)
            new_keys.append(moved)
        return [o.key for o in own + below if o.key not in new_keys], new_keys

    async def _delete_keys(self, keys: list[str]) -> None:
        for key in keys:
            await self.store.delete(key)


async def probe_markers(store: AsyncStore, writer: str, prefix: str = "") -> bool | None:
    """Does the store keep user metadata on a key ending in "/"? None if it cannot tell
    (a read-only bucket): then both places are read. The probe's key is under the mount's
    `prefix`: a policy that lets the mount write there only must not fail it (on S3, whose
    markers keep their metadata, nothing else of this module writes outside the prefix)."""
    key = f"{prefix}{RESERVED_NAME}/probe-{writer}/"
    try:  # (not counted with the lookups' HEADs: the metrics say what serving files costs)
        await store.call(store.sync.put, key, b"", {PROBE_META: "1"})
        info = await store.call(store.sync.head, key)
        await store.call(store.sync.delete, key)
    except ObjectStoreError as exc:
        log.info("directory markers not probed (%s): reading attributes from both places", exc)
        return None
    return info is not None and info.metadata.get(PROBE_META) == "1"


async def move_root_sidecars(store: AsyncStore, prefix: str) -> int | None:
    """Move the sidecar keys that earlier versions wrote at the bucket root for directories
    under `prefix` to the prefix's own folder (the name holds the attributes: a PUT of an
    empty key, then the DELETE). Returns how many, or None if S3 refused or failed (the
    next mount tries again): a policy scoped to the prefix may deny the root's listing."""
    old_root = SIDECAR_ROOT + prefix
    try:
        found = await store.list_recursive(old_root)
        for obj in found:
            await store.call(store.sync.put, sidecar_root(prefix) + obj.key[len(old_root):],
                             b"", {})
            await store.delete(obj.key)
    except ObjectStoreError as exc:
        log.info("sidecar keys at the bucket root (%s) not moved under %s: %s", old_root,
                 prefix, exc)
        return None
    if found:
        log.info("moved %d sidecar key(s) from the bucket root under %s", len(found), prefix)
    return len(found)


async def open_dir_attrs(store: AsyncStore, journal: AsyncJournal, writer: str,
                         prefix: str = "") -> DirAttrs:
    """The mount's DirAttrs, from the probe's answer that the journal recorded, or a new
    probe; on a store that drops marker metadata, first moves the sidecar keys of earlier
    versions under the prefix (once per cache directory)."""
    recorded = await journal(journal.sync.get_meta, JOURNAL_META)
    keeps = None if recorded is None else recorded == "1"
    if keeps is None:
        keeps = await probe_markers(store, writer, prefix)
        if keeps is not None:
            await journal(journal.sync.set_meta, JOURNAL_META, "1" if keeps else "0")
    if keeps is not True and prefix and \
            await journal(journal.sync.get_meta, MOVED_META) is None and \
            await move_root_sidecars(store, prefix) is not None:
        await journal(journal.sync.set_meta, MOVED_META, "1")
    log.info("directory attributes: %s", "on the dir/ markers" if keeps else
             "in sidecar keys under " + sidecar_root(prefix) +
             " (this store drops marker metadata)" if keeps is False else
             "on markers and in sidecar keys")
    return DirAttrs(store, keeps, prefix)

"""Directory attributes in S3 without the kernel: the probe, the sidecar keys and what wins
when a name holds several (the end-to-end behaviour is in mount/test_dir_attrs.py)."""

from __future__ import annotations

import stat

import trio

from lakefs_mount.metrics import Metrics
from lakefs_mount.namespace.dirattrs import (
    SIDECAR_ROOT,
    DirAttrs,
    DirStat,
    entry_folder,
    move_root_sidecars,
    probe_markers,
    sidecar_fits,
)
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.layout import encode_attrs
from lakefs_mount.s3.objectstore import MAX_KEY_BYTES, AccessDenied
from tests.memstore import MemoryObjectStore

PRIVATE = DirStat(stat.S_IFDIR | 0o700, 1000, 100, 1_600_000_000_123_456_789)
OPEN = DirStat(stat.S_IFDIR | 0o777, 1000, 100, 1_600_000_000_123_456_789)


class _MarkerMetadataDroppingStore(MemoryObjectStore):
    """What SeaweedFS does: a key ending in "/" keeps no user metadata."""

    def put(self, key: str, body: bytes | memoryview, metadata: dict[str, str]) -> str:
        return super().put(key, body, {} if key.endswith("/") else metadata)


def _run(store: MemoryObjectStore, fn) -> object:
    async def main() -> object:
        return await fn(AsyncStore(store, Metrics()))

    return trio.run(main)


def test_the_probe_tells_a_store_that_keeps_marker_metadata_from_one_that_drops_it():
    keeps, drops = MemoryObjectStore(), _MarkerMetadataDroppingStore()
    assert _run(keeps, lambda s: probe_markers(s, "w1")) is True
    assert _run(drops, lambda s: probe_markers(s, "w1")) is False
    assert keeps.objects == {} and drops.objects == {}  # the probe leaves nothing behind


class _PrefixScopedStore(MemoryObjectStore):
    """A bucket policy that lets the mount write under its prefix only."""

    def put(self, key: str, body: bytes | memoryview, metadata: dict[str, str]) -> str:
        if not key.startswith("team/"):
            raise AccessDenied(f"{key}: access denied")
        return super().put(key, body, metadata)


def test_the_probe_of_a_prefix_mount_writes_under_its_prefix():
    """A mount of s3://bucket/team/ whose policy covers team/ only can still probe (it
    wrote at the bucket root, was refused, and wrote sidecar keys there too)."""
    store = _PrefixScopedStore()
    assert _run(store, lambda s: probe_markers(s, "w1", "team/")) is True
    assert store.objects == {}


def test_a_prefix_mount_keeps_its_sidecar_keys_under_its_prefix():
    """A policy that lets the mount write under team/ only: saving, loading and renaming
    directories' attributes never reach outside it."""
    store = _PrefixScopedStore()

    async def tree(s: AsyncStore) -> dict[str, DirStat]:
        attrs = DirAttrs(s, False, "team/")
        for key in ("team/d/", "team/d/sub/"):
            await attrs.save(key, PRIVATE, replace=True)
        await attrs.copy_tree("team/d/", "team/e/", OPEN)
        return await attrs.load("team/", ["d", "e"]) | await attrs.load("team/e/", ["sub"])

    assert _run(store, tree) == {"d": PRIVATE, "e": OPEN, "sub": PRIVATE}
    assert all(k.startswith("team/" + SIDECAR_ROOT) for k in store.objects)
    assert entry_folder("team/e/sub/", "team/") + PRIVATE.leaf() in store.objects


def test_the_sidecar_keys_earlier_versions_wrote_at_the_bucket_root_move_under_the_prefix():
    store = _MarkerMetadataDroppingStore()
    store.put(entry_folder("team/d/") + PRIVATE.leaf(), b"", {})  # where they were
    store.put(entry_folder("teammate/d/") + OPEN.leaf(), b"", {})  # another prefix's

    async def move(s: AsyncStore) -> tuple[int | None, dict[str, DirStat]]:
        moved = await move_root_sidecars(s, "team/")
        return moved, await DirAttrs(s, False, "team/").load("team/", ["d"])

    assert _run(store, move) == (1, {"d": PRIVATE})
    assert sorted(store.objects) == sorted([entry_folder("team/d/", "team/") + PRIVATE.leaf(),
                                            entry_folder("teammate/d/") + OPEN.leaf()])


def test_a_root_that_s3_will_not_list_leaves_the_move_for_the_next_mount():
    class _RootDenied(_MarkerMetadataDroppingStore):
        def list_recursive(self, prefix: str):
            if not prefix.startswith("team/"):
                raise AccessDenied(f"{prefix}: access denied")
            return super().list_recursive(prefix)

    assert _run(_RootDenied(), lambda s: move_root_sidecars(s, "team/")) is None


def test_sidecar_keys_hold_the_attributes_and_are_never_a_folder_of_another_key():
    store = _MarkerMetadataDroppingStore()

    async def save_tree(s: AsyncStore) -> None:
        attrs = DirAttrs(s, False)
        for key in ("a/", "a/b/", "a/b/c/", "ab/", "pre/x/"):
            await attrs.save(key, PRIVATE, replace=False)

    _run(store, save_tree)
    keys = sorted(store.objects)
    assert all(k.startswith(SIDECAR_ROOT) and k.endswith("/" + PRIVATE.leaf()) for k in keys)
    for key in keys:  # SeaweedFS cannot hold a key that is also a folder
        assert not any(other.startswith(key + "/") for other in keys)
    assert DirStat.parse(PRIVATE.leaf()) == PRIVATE
    assert DirStat.parse("33188.0.0.1") is None  # a regular file's mode is no directory


def test_of_several_keys_of_one_directory_the_newest_wins_then_the_strictest():
    store = _MarkerMetadataDroppingStore()
    folder = entry_folder("d/")
    store.put(folder + OPEN.leaf(), b"", {})
    store.put(folder + PRIVATE.leaf(), b"", {})
    store.objects[folder + OPEN.leaf()].mtime -= 10  # written before: the private one wins
    load = lambda s: DirAttrs(s, False).load("", ["d", "e"])  # noqa: E731
    assert _run(store, load) == {"d": PRIVATE}
    store.objects[folder + OPEN.leaf()].mtime = store.objects[folder + PRIVATE.leaf()].mtime
    assert _run(store, load) == {"d": PRIVATE}  # as new: the one granting less


def test_a_changed_directory_replaces_its_sidecar_key():
    store = _MarkerMetadataDroppingStore()

    async def chmod(s: AsyncStore) -> dict[str, DirStat]:
        attrs = DirAttrs(s, False)
        await attrs.save("d/", OPEN, replace=False)
        await attrs.save("d/", PRIVATE, replace=True)
        return await attrs.load("", ["d"])

    assert _run(store, chmod) == {"d": PRIVATE}
    assert list(store.objects) == [entry_folder("d/") + PRIVATE.leaf()]


def test_where_markers_keep_metadata_they_are_read_and_no_sidecar_is_written():
    store = MemoryObjectStore()
    store.put("p/d/", b"", encode_attrs(PRIVATE.mode, PRIVATE.uid, PRIVATE.gid,
                                        PRIVATE.mtime_ns))
    store.put("p/e/", b"", {})  # made by another tool: no attributes, defaults

    async def load(s: AsyncStore) -> dict[str, DirStat]:
        attrs = DirAttrs(s, True)
        await attrs.save("p/d/", OPEN, replace=True)
        return await attrs.load("p/", ["d", "e"])

    assert _run(store, load) == {"d": PRIVATE}  # (save left the marker to its caller)
    assert sorted(store.objects) == ["p/d/", "p/e/"]


def test_unknown_probe_reads_sidecars_first_and_markers_for_the_rest():
    store = MemoryObjectStore()
    store.put("m/", b"", encode_attrs(OPEN.mode, 7, 8, 1))
    store.put(entry_folder("s/") + PRIVATE.leaf(), b"", {})
    found = _run(store, lambda s: DirAttrs(s, None).load("", ["m", "s"]))
    assert found == {"m": DirStat(OPEN.mode, 7, 8, 1), "s": PRIVATE}


def test_a_renamed_directory_takes_its_attributes_and_those_below_it_along():
    store = _MarkerMetadataDroppingStore()

    async def rename(s: AsyncStore) -> tuple[list[str], list[str]]:
        attrs = DirAttrs(s, False)
        for key in ("a/", "a/b/", "a/b/c/"):
            await attrs.save(key, PRIVATE, replace=False)
        return await attrs.copy_tree("a/", "z/y/", OPEN)

    old, new = _run(store, rename)
    assert sorted(old) == sorted(entry_folder(k) + PRIVATE.leaf() for k in ("a/", "a/b/",
                                                                            "a/b/c/"))
    assert sorted(new) == sorted([entry_folder("z/y/") + OPEN.leaf(),
                                  entry_folder("z/y/b/") + PRIVATE.leaf(),
                                  entry_folder("z/y/b/c/") + PRIVATE.leaf()])
    assert set(store.objects) == set(old) | set(new)  # the old go once the rename is done


def test_a_directory_key_leaves_room_for_its_sidecar_key():
    assert sidecar_fits("a/" * 100)
    assert not sidecar_fits("k" * (MAX_KEY_BYTES - 20) + "/")

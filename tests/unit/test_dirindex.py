"""Attribute indexes of directories: a fresh mount shows the modes, owners, mtimes and
symlinks of files other mounts wrote (`ls -l`) without one HEAD per file, and an index
never stands for an object that changed since it was written."""

from __future__ import annotations

import trio

from lakefs_mount.metrics import Metrics
from lakefs_mount.namespace.dirindex import (
    INDEX_FOLDER,
    DirIndex,
    IndexEntry,
    decode,
    encode,
    index_folder,
    parent_dir_key,
)
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.objectstore import AccessDenied
from tests.memstore import MemoryObjectStore


def test_an_index_round_trips_and_skips_what_it_cannot_read():
    entries = {"a": IndexEntry("e1", 3, {"mode": "33188"}), "b c": IndexEntry("e2", 0, {})}
    assert decode(encode(entries)) == entries
    assert decode(b"garbage") == {}
    assert decode(b'{"format": 99, "entries": {}}') == {}
    assert decode(b'{"format": 1, "entries": {"ok": ["e", 1, {}], "bad": ["e", "1", {}],'
                  b' "short": ["e"], "meta": ["e", 1, {"mode": 5}]}}') == {
        "ok": IndexEntry("e", 1, {})}


def test_index_keys_sit_in_the_reserved_folder_under_the_mount_prefix():
    assert index_folder("pre/", "pre/") == "pre/" + INDEX_FOLDER
    assert index_folder("pre/", "pre/a/b/") == "pre/" + INDEX_FOLDER + "a/b/"
    assert parent_dir_key("pre/", "pre/a/b/f") == "pre/a/b/"
    assert parent_dir_key("pre/", "pre/f") == "pre/"
    assert parent_dir_key("", "f") == ""


# -- the index writer ---------------------------------------------------------------------

class _RefusingStore(MemoryObjectStore):
    """An S3 that refuses the index objects (a bucket policy, say) until told otherwise."""

    refuse = True

    def put(self, key: str, body: bytes | memoryview, metadata: dict[str, str],
            crc: int | None = None) -> str:
        if self.refuse and key.startswith(INDEX_FOLDER):
            raise AccessDenied(f"PutObject {key}: AccessDenied")
        return super().put(key, body, metadata, crc)


def test_an_index_that_cannot_be_written_stays_due_and_never_raises():
    store = _RefusingStore()
    entries = {"f": IndexEntry("e", 1, {"mode": "33188"})}

    async def snapshot(dir_key: str) -> dict[str, IndexEntry] | None:
        return entries if dir_key == "d/" else None

    async def main() -> None:
        index = DirIndex(AsyncStore(store, Metrics()), "", "w1", snapshot)
        index.changed("d/")
        assert await index.write_changed() is False
        assert await index.load("d/") == {}
        store.refuse = False
        assert await index.write_changed() is True  # still due: written now
        assert await index.load("d/") == {"f": [entries["f"]]}
        assert await index.write_changed() is True  # nothing due any more
        index.changed("d/")
        entries["f"] = IndexEntry("e2", 2, {})
        assert await index.write_changed() is True
        assert await index.load("d/") == {"f": [entries["f"]]}

    trio.run(main)

"""The namespace write-back log (lakefs_mount/namespace/namelog.py) against the in-memory store:
the order of dependent changes, replay after a crash, and what listings are told.
End to end through a mount and SeaweedFS: mount/test_namespace_writeback.py."""

from __future__ import annotations

import json
from pathlib import Path

import trio

from lakefs_mount import metrics as m
from lakefs_mount.cache.asyncjournal import AsyncJournal
from lakefs_mount.cache.journal import Journal
from lakefs_mount.namespace.namelog import DELETE, DIR, MOVE, RMDIR, TABLE, NameLog, overlap
from lakefs_mount.s3.aiostore import AsyncStore
from lakefs_mount.s3.layout import META_PARTS
from tests.memstore import MemoryObjectStore

ATTRS = json.dumps({"mode": 0o40755, "uid": 0, "gid": 0, "mtime_ns": 1, "replace": False})


def make_log(tmp_path: Path, store: MemoryObjectStore
             ) -> tuple[NameLog, list[tuple[str, str, list[str]]]]:
    rebased: list[tuple[str, str, list[str]]] = []
    names = NameLog(AsyncStore(store, m.Metrics()), AsyncJournal(Journal(tmp_path / "j.db")),
                    m.Metrics(), dir_attrs=None)
    names.rebase = lambda src, dst, etags: rebased.append((src, dst, sorted(etags)))
    return names, rebased


def test_overlap_is_a_key_itself_or_a_directory_and_what_is_below_it():
    assert overlap("a/", "a/b") and overlap("a/b", "a/") and overlap("x", "x")
    assert not overlap("a", "a/b") and not overlap("a/b", "a/c") and not overlap("ab/", "a/")


def test_changes_of_one_key_apply_in_order_and_the_log_drains(tmp_path):
    store = MemoryObjectStore()
    store.put("f", b"old", {})

    async def body() -> None:
        names, rebased = make_log(tmp_path, store)
        async with trio.open_nursery() as nursery:
            await nursery.start(names.run)
            await names.record(DIR, "d/", arg=ATTRS)
            await names.record(RMDIR, "d/")  # after its marker, never before
            await names.record(MOVE, "f", "g")
            await names.record(DELETE, "g")  # after the copy it follows
            assert names.busy("d/x") and names.busy("g") and not names.busy("h")
            assert names.removing("f") and names.creating("g")
            await names.drain()
            nursery.cancel_scope.cancel()
        assert set(store.objects) == set()
        assert rebased == [("f", "g", ["g"])]
        assert names.status() == {"name_changes_pending": 0, "name_changes_error": None}

    trio.run(body)


def test_a_table_goes_after_its_object_and_stays_while_an_object_still_names_it(tmp_path):
    """An unlink's DELETE comes first, then its object's table; a table whose object is
    still there naming it (a replay of a replacement that never landed) is kept; the
    removal of a table holds up no commit."""
    store = MemoryObjectStore()
    for name in ("gone", "kept"):
        store.put(name, b"object", {META_PARTS: f"parts/{name}"})
        store.put(f"parts/{name}", b"table", {})

    async def body() -> None:
        names, _ = make_log(tmp_path, store)
        await names.record(DELETE, "gone", tables=[("parts/gone", "gone")])
        await names.retire_tables([("parts/kept", "kept")])
        assert not names.busy("kept")  # (a commit of it never waits for the table)
        assert [op.row.op for op in names._ready()] == [DELETE, TABLE]
        async with trio.open_nursery() as nursery:
            await nursery.start(names.run)
            await names.drain()
            nursery.cancel_scope.cancel()
        assert set(store.objects) == {"kept", "parts/kept"}

    trio.run(body)


def test_changes_left_in_the_journal_are_applied_by_the_next_log(tmp_path):
    store = MemoryObjectStore()
    store.put("a", b"content", {})

    async def crash() -> None:  # recorded, never applied: the daemon dies first
        names, _ = make_log(tmp_path, store)
        await names.record(DIR, "new/", arg=ATTRS)
        await names.record(MOVE, "a", "new/a")

    async def remount() -> None:
        names, _ = make_log(tmp_path, store)
        assert await names.load() == 2
        assert names.dirs_made_in("") == ["new/"]
        async with trio.open_nursery() as nursery:
            await nursery.start(names.run)
            await names.drain()
            nursery.cancel_scope.cancel()

    trio.run(crash)
    assert set(store.objects) == {"a"}
    trio.run(remount)
    assert set(store.objects) == {"new/", "new/a"}
    assert store.objects["new/a"].body == b"content"


def test_a_directory_moves_with_everything_below_it_and_its_files_rebase(tmp_path):
    store = MemoryObjectStore()
    for key in ("a/", "a/x", "a/s/y", "ab"):
        store.put(key, key.encode(), {})

    async def body() -> None:
        names, rebased = make_log(tmp_path, store)
        await names.record(MOVE, "a/", "b/", arg=ATTRS)
        assert names.creating("b/s/y") and names.object_key("b/x", "a/x") == "b/x"
        assert names.busy("b/new") and not names.busy("ab")
        async with trio.open_nursery() as nursery:
            await nursery.start(names.run)
            await names.drain()
            nursery.cancel_scope.cancel()
        assert rebased == [("a/", "b/", ["b/s/y", "b/x"])]
        assert not names.creating("b/s/y")

    trio.run(body)
    assert {k: o.body for k, o in store.objects.items()} == {
        "b/": b"", "b/x": b"a/x", "b/s/y": b"a/s/y", "ab": b"ab"}


def test_a_directory_made_and_removed_again_is_not_shown_as_being_made(tmp_path):
    """pjdfstest mkdir/05, rename/09: `mkdir s; rmdir s` twice below `d`, with the second
    pair still pending, made the listing of `d` show `s` (a pending mkdir of it), so
    `rmdir d` failed ENOTEMPTY. The latest pending change of a key says what it is."""

    async def body() -> None:
        names, _ = make_log(tmp_path, MemoryObjectStore())
        for _ in range(2):  # recorded, not applied (no run)
            await names.record(DIR, "d/s/", arg=ATTRS)
            await names.record(RMDIR, "d/s/")
        assert names.dirs_made_in("d/") == []
        await names.record(DIR, "d/s/", arg=ATTRS)
        assert names.dirs_made_in("d/") == ["d/s/"]

    trio.run(body)

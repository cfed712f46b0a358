"""The journal's schema, sentinels and transitions (docs/durability.md)."""

from __future__ import annotations

import os
import sqlite3
import stat
import threading

import trio

from lakefs_mount.cache.asyncjournal import AsyncJournal
from lakefs_mount.cache.journal import Journal
from lakefs_mount.cache.journalschema import CHUNK_DIRTY, CHUNK_UPLOADED, MIGRATIONS, PendingFile


def _file(j: Journal, key: str = "a") -> PendingFile:
    rec = PendingFile(j.allocate_fid(), key, 0, stat.S_IFREG | 0o644, 0, 0, 1)
    j.put_file(rec)
    return rec


def test_journal_file_is_private_and_in_wal_mode(tmp_path):
    j = Journal(tmp_path / "journal.db")
    assert stat.S_IMODE(os.stat(tmp_path / "journal.db").st_mode) == 0o600
    assert j.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_fids_are_never_reused_across_reopen(tmp_path):
    j = Journal(tmp_path / "j.db")
    first = j.allocate_fid()
    j.close()
    assert Journal(tmp_path / "j.db").allocate_fid() > first


def test_dirty_then_uploaded_then_committed_leaves_nothing(tmp_path):
    j = Journal(tmp_path / "j.db")
    rec = _file(j)
    j.mark_dirty(rec, [0, 1])
    j.start_upload(rec.fid, "U1", "a")
    j.mark_uploaded(rec.fid, 0, "e0")
    assert j.chunks(rec.fid) == {0: (CHUNK_UPLOADED, "e0"), 1: (CHUNK_DIRTY, None)}
    j.mark_uploaded(rec.fid, 1, "e1")
    j.end_upload("U1")
    j.note_clean(rec.fid, "a", "old-etag", 3, [0, 1, 2])  # what the file was based on
    assert not j.finish_commit(rec.fid, [0, 1], keep_file=False, base_key="a", base_size=5,
                               seen_gen=0, clean=(rec.fid, "a", "new-etag", 5, [0, 1]))
    assert j.pending_files() == [] and j.chunks(rec.fid) == {}
    assert j.orphan_uploads() == []
    warm = j.warm_files()["a"]  # the warm cache learnt the new object with the commit
    assert (warm.etag, warm.size, warm.chunks) == ("new-etag", 5, [0, 1])


def test_a_commit_keeps_the_row_of_a_file_the_kernel_may_still_be_writing(tmp_path):
    """D21: `passthrough = 1` outlives commits until the chunks catch up with the file."""
    j = Journal(tmp_path / "j.db")
    rec = _file(j)
    rec.passthrough = 1
    j.put_file(rec)
    assert j.finish_commit(rec.fid, [], keep_file=False, base_key="a", base_size=0,
                           seen_gen=rec.intent_gen)
    assert j.pending_files()[0].passthrough == 1
    rec.passthrough = 0  # the last passthrough writer left: every chunk dirty, flag off
    j.mark_dirty(rec, [0, 1, 2])
    (left,) = j.pending_files()
    assert left.passthrough == 0 and set(j.chunks(rec.fid)) == {0, 1, 2}


def test_a_commit_after_the_last_passthrough_writer_drops_the_row_flag_and_all(tmp_path):
    """A file created in passthrough keeps the flag of its create to the commit (its
    chunks were dirty from the start): once no writer is left, the flag is stale."""
    j = Journal(tmp_path / "j.db")
    rec = _file(j)
    rec.passthrough = 1
    j.mark_dirty(rec, [0])
    assert not j.finish_commit(rec.fid, [], keep_file=False, base_key="a", base_size=9,
                               seen_gen=rec.intent_gen, flag_stale=True)
    assert j.pending_files() == [] and j.chunks(rec.fid) == {}


def test_a_write_during_commit_keeps_the_file_pending_on_the_new_base(tmp_path):
    j = Journal(tmp_path / "j.db")
    rec = _file(j)
    j.mark_dirty(rec, [0, 1])
    j.mark_uploaded(rec.fid, 0, "e0")
    assert j.finish_commit(rec.fid, [0], keep_file=True, base_key="a", base_size=10,
                           seen_gen=0)
    (left,) = j.pending_files()
    assert left.base_key == "a" and left.base_size == 10 and left.upload_id is None
    assert j.chunks(rec.fid) == {1: (CHUNK_DIRTY, None)}


def test_upload_no_file_references_is_an_orphan(tmp_path):
    """D4: an upload created but not (or no longer) referenced is aborted at mount."""
    j = Journal(tmp_path / "j.db")
    rec = _file(j, "k")
    j.start_upload(rec.fid, "U1", "k")
    assert j.orphan_uploads() == []
    j.drop_file(rec.fid)
    assert j.orphan_uploads() == [("k", "U1")]


def test_forget_uploads_makes_uploaded_parts_dirty_again(tmp_path):
    j = Journal(tmp_path / "j.db")
    rec = _file(j)
    j.start_upload(rec.fid, "U1", "a")
    j.mark_dirty(rec, [3])
    j.mark_uploaded(rec.fid, 3, "e")
    j.forget_uploads(rec.fid)
    assert j.chunks(rec.fid) == {3: (CHUNK_DIRTY, None)}
    assert j.pending_files()[0].upload_id is None


def test_sync_survives_and_the_schema_migrates_only_once(tmp_path):
    j = Journal(tmp_path / "j.db")
    _file(j)
    j.sync()
    j.close()
    again = Journal(tmp_path / "j.db")
    assert len(again.pending_files()) == 1
    assert again.db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)


def test_a_namespace_change_and_its_file_row_change_are_one_transaction(tmp_path):
    j = Journal(tmp_path / "j.db")
    unlinked, renamed = _file(j), _file(j)
    j.rekey(renamed.fid, renamed.key, "old")
    j.add_name_op("delete", "gone", drop_fid=unlinked.fid)
    seq = j.add_name_op("move", "old", "new", rekey=(renamed.fid, "new", "old"))
    assert [(r.op, r.key, r.dst, r.step) for r in j.name_ops()] == [
        ("delete", "gone", None, 0), ("move", "old", "new", 0)]
    assert [(f.fid, f.key, f.base_key) for f in j.pending_files()] == [
        (renamed.fid, "new", "old")]
    j.name_op_copied(seq, "old", "new")  # the copy is in S3: the base moves with it
    assert j.pending_files()[0].base_key == "new" and j.name_ops()[1].step == 1
    j.end_name_op(seq)
    assert [r.op for r in j.name_ops()] == ["delete"]


def test_a_late_commit_watch_starts_with_the_end_of_its_delete_and_outlives_a_reopen(
        tmp_path):
    j = Journal(tmp_path / "j.db")
    seq = j.add_name_op("delete", "gone", arg="7")
    j.end_name_op(seq, ("gone", 7, 100.0))
    j.end_name_op(j.add_name_op("delete", "gone", arg="7"), ("gone", 7, 200.0))  # kept: 100
    assert j.name_ops() == []
    j.close()
    again = Journal(tmp_path / "j.db")
    assert again.late_watches(now=50.0) == [("gone", 7, 100.0)]
    assert again.late_watches(now=100.0) == []  # over: dropped
    assert again.late_watches(now=0.0) == []


def test_a_device_row_keeps_its_rdev_through_intent_and_replacement(tmp_path):
    j = Journal(tmp_path / "j.db")
    rec = PendingFile(j.allocate_fid(), "dev", 0, stat.S_IFCHR | 0o600, 0, 0, 1,
                      rdev=os.makedev(1, 3))
    j.mark_dirty(rec, [0])
    assert j.pending_files()[0].rdev == os.makedev(1, 3)
    j.put_file(PendingFile(**{**vars(rec), "mode": stat.S_IFCHR | 0o640}))
    assert (j.pending_files()[0].mode, j.pending_files()[0].rdev) == (
        stat.S_IFCHR | 0o640, os.makedev(1, 3))


def test_warm_cache_rows_list_clean_chunks_of_files_with_nothing_pending(tmp_path):
    j = Journal(tmp_path / "j.db")
    j.note_clean(7, "k", "etag1", 100, [0, 2])
    j.note_clean(7, "k", "etag1", 100, [3])
    pending = _file(j, "p")
    j.note_clean(pending.fid, "p", "e", 5, [0])
    warm = j.warm_files()
    assert set(warm) == {"k"}
    assert warm["k"].chunks == [0, 2, 3] and warm["k"].etag == "etag1"
    j.note_clean(7, "k", "etag2", 50, [1], replace=True)
    assert j.warm_files()["k"].chunks == [1]
    j.drop_clean_many([(7, 1), (pending.fid, 0)])
    assert j.warm_files()["k"].chunks == []
    assert j.db.execute("SELECT COUNT(*) FROM clean_chunks").fetchone()[0] == 0
    assert j.known_fids() == {7, pending.fid}
    j.forget_cached(7)
    assert j.warm_files() == {}


def test_a_commit_never_drops_an_intent_that_came_after_it_started(tmp_path):
    """The race of a truncate with a finishing commit: the newer intent survives."""
    j = Journal(tmp_path / "j.db")
    rec = _file(j)
    commit_saw = rec.intent_gen
    newer = PendingFile(**{**vars(rec), "intent_gen": rec.intent_gen + 1})
    j.mark_dirty(newer, [4])
    assert j.finish_commit(rec.fid, [], keep_file=False, base_key="a", base_size=1,
                           seen_gen=commit_saw)
    assert j.chunks(rec.fid) == {4: (CHUNK_DIRTY, None)}
    assert j.pending_files()[0].base_key == "a"


def test_notes_of_fetched_chunks_go_in_with_the_next_call_in_call_order(tmp_path):
    async def main() -> None:
        j = AsyncJournal(Journal(tmp_path / "j.db"))
        j.note_clean_later(7, "k", "e", 100, [0, 1])
        j.note_clean_later(8, "m", "e", 10, [0])
        assert j.sync.warm_files() == {}  # no thread hop, no transaction yet
        await j(j.sync.drop_clean_many, [(7, 1)])  # a later drop is not undone by the note
        warm = j.sync.warm_files()
        assert warm["k"].chunks == [0] and warm["m"].chunks == [0]
        j.note_clean_later(9, "n", "e", 10, [0])
        await j.write_notes()
        assert j.sync.warm_files()["n"].chunks == [0]
        await j.write_notes()  # nothing left: a no-op

    trio.run(main)


def test_calls_queued_behind_a_running_one_share_one_thread_hop_in_order(tmp_path):
    async def main() -> None:
        j = AsyncJournal(Journal(tmp_path / "j.db"))
        order: list[int] = []
        threads: set[int] = set()

        def step(i: int) -> int:
            threads.add(threading.get_ident())
            order.append(i)
            if i == 3:
                raise ValueError("three")
            return i * 10

        results: dict[int, object] = {}

        async def call(i: int) -> None:
            try:
                results[i] = await j(step, i)
            except ValueError as exc:
                results[i] = exc

        hops = 0
        real = trio.to_thread.run_sync

        async def counting(*args: object, **kwargs: object) -> object:
            nonlocal hops
            hops += 1
            return await real(*args, **kwargs)

        trio.to_thread.run_sync = counting  # type: ignore[assignment]
        try:
            async with trio.open_nursery() as nursery:
                for i in range(8):
                    nursery.start_soon(call, i)
                    await trio.sleep(0)  # they queue in this order
        finally:
            trio.to_thread.run_sync = real  # type: ignore[assignment]
        assert order == list(range(8))
        assert {i: r for i, r in results.items() if i != 3} == {i: i * 10 for i in range(8)
                                                               if i != 3}
        assert isinstance(results[3], ValueError)  # the error reaches its own caller only
        assert hops < 8

        running, release = threading.Event(), threading.Event()

        def slow() -> None:
            running.set()
            release.wait(10)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(j, slow)
            await trio.to_thread.run_sync(running.wait, 10)
            with trio.move_on_after(0.05):  # queued behind `slow`, then cancelled
                await j(step, 99)
            release.set()
        await j(step, 100)
        assert 99 not in order and order[-1] == 100

    trio.run(main)


def test_a_sync_with_nothing_committed_since_the_last_one_writes_nothing(tmp_path):
    j = Journal(tmp_path / "j.db")
    wal = tmp_path / "j.db-wal"
    _file(j)
    j.sync()
    synced = wal.stat().st_size
    j.sync()  # a second fsync of the same file: no WAL frame, no fsync
    assert wal.stat().st_size == synced
    _file(j, key="b")
    j.sync()
    assert wal.stat().st_size > synced


def test_syncs_queued_behind_a_running_batch_share_one_at_its_end(tmp_path):
    """`durable` from sixteen writers' fsyncs at once: one WAL fsync, after the calls
    queued with them, and its failure reaches every caller that shared it."""
    runs: list[int] = []

    class Counting(Journal):
        fail = False

        def sync(self) -> None:
            runs.append(len(self.pending_files()))  # what the sync covers
            if self.fail:
                raise sqlite3.OperationalError("disk I/O error")
            super().sync()

    async def main() -> None:
        journal = Counting(tmp_path / "j.db")
        j = AsyncJournal(journal)
        running, release = threading.Event(), threading.Event()

        def slow() -> None:
            running.set()
            release.wait(10)

        async def sixteen() -> list[BaseException | None]:
            outcomes: list[BaseException | None] = []

            async def one() -> None:
                try:
                    await j.durable()
                    outcomes.append(None)
                except sqlite3.Error as exc:
                    outcomes.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(j, slow)
                await trio.to_thread.run_sync(running.wait, 10)
                for _ in range(16):
                    nursery.start_soon(one)
                nursery.start_soon(j, _file, journal, "queued last")
                await trio.sleep(0.05)
                release.set()
            return outcomes

        assert await sixteen() == [None] * 16
        assert runs == [1]  # once, covering the row queued after the syncs
        journal.fail, runs[:] = True, []
        failed = await sixteen()
        assert runs == [2] and len(failed) == 16
        assert all(isinstance(exc, sqlite3.OperationalError) for exc in failed)

    trio.run(main)


def test_the_journal_keeps_disk_space_allocated_past_the_end_of_its_own_files(tmp_path):
    """What SQLite grows into when writers the daemon does not see fill the disk."""
    j = Journal(tmp_path / "journal.db")
    before = j.reserve_held()
    j.arm_reserve(4 << 20)
    held = j.reserve_held()
    assert held >= before + (4 << 20) - 8192
    size = os.stat(tmp_path / "journal.db").st_size
    for i in range(200):  # the files grow into the reserve: it shrinks, data is intact
        _file(j, key=f"k{i}")
    assert os.stat(tmp_path / "journal.db").st_size >= size
    assert len(j.pending_files()) == 200
    j.arm_reserve(4 << 20)  # taken back in full
    assert j.reserve_held() >= (4 << 20) - 8192

"""The SQLite journal (WAL): what must still reach S3, written before data is acknowledged.

The tables, what each row and sentinel means, and their migrations are in
`journalschema.py` (see docs/durability.md for the crash table); `asyncjournal.py`
is the journal from the trio loop.

sqlite-utils' role is the schema: creating tables and adding columns in the migrations,
WAL mode, and a few reads and updates off the hot path (`pending_files`, `rekey`). Everything a
write or a commit runs (intents, chunk states, commits, meta) is plain SQL on the same
connection, because its helpers inspect the table on every call, several times slower
per small file.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Sequence
from pathlib import Path

import sqlite_utils

from lakefs_mount.cache.journalschema import (
    CHUNK_DIRTY,
    CHUNK_SPILLED,
    CHUNK_UPLOADED,
    INTENT,
    MIGRATIONS,
    CleanNote,
    NameOpRow,
    PendingFile,
    WarmFile,
)
from lakefs_mount.uring import FALLOC_FL_KEEP_SIZE, fallocate_sync


class JournalDamaged(Exception):
    """The journal cannot be trusted: the mount refuses to start and deletes nothing."""


class Journal:
    """Synchronous journal access; the daemon calls it from one worker thread at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fresh = not path.exists()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.close(fd)
        os.chmod(path, 0o600)
        self._conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._synced_changes = -1  # the connection's total_changes at the last `sync`
        try:
            self.db = sqlite_utils.Database(self._conn)
            self.db.enable_wal()
            self._conn.execute("PRAGMA synchronous=NORMAL")  # durable against a daemon crash
            self._conn.execute("PRAGMA foreign_keys=ON")
            problems = [r[0] for r in self._conn.execute("PRAGMA quick_check")]
            if problems != ["ok"]:
                raise sqlite3.DatabaseError("; ".join(problems[:3]))
            self._migrate()
        except sqlite3.DatabaseError as exc:
            self._conn.close()
            raise JournalDamaged(
                f"the journal {path} is damaged ({exc}): what it says is still to upload "
                f"cannot be trusted, so nothing was mounted and nothing deleted. Move "
                f"{path.parent} aside (its data/ files are the cached bytes) and mount with "
                f"a new --cache-dir") from exc
        for suffix in ("-wal", "-shm"):
            side = Path(str(path) + suffix)
            if side.exists():
                os.chmod(side, 0o600)
        self.fresh = fresh

    def _migrate(self) -> None:
        version = self._conn.execute("PRAGMA user_version").fetchone()[0]
        for number, step in enumerate(MIGRATIONS[version:], start=version + 1):
            with self.db.conn:
                self._conn.execute("BEGIN IMMEDIATE")
                step(self.db)
                self._conn.execute(f"PRAGMA user_version={number}")

    def close(self) -> None:
        self._conn.close()

    # -- the disk space the journal keeps for itself ------------------------------------

    def _own_files(self) -> list[Path]:
        return [self.path, Path(str(self.path) + "-wal")]

    def reserve_held(self) -> int:
        """Bytes of disk allocated past the end of the journal's files (database, WAL),
        which SQLite grows into without asking the disk for more."""
        held = 0
        for path in self._own_files():
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            held += max(0, st.st_blocks * 512 - st.st_size)
        return held

    def arm_reserve(self, size: int) -> None:
        """Allocate `size` bytes past the end of the journal's files (a quarter for the
        database, the rest for the WAL, which SQLite reuses from its start after each
        checkpoint and never truncates while open).

        Writers the daemon does not see (FUSE passthrough) can fill the cache disk to the
        last block; space bound to the journal's own files stays its own. ENOSPC if the
        disk has not that much free."""
        for path, share in zip(self._own_files(), (size // 4, size - size // 4), strict=True):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:  # no WAL yet: SQLite makes it at its first write
                continue
            try:
                fallocate_sync(fd, FALLOC_FL_KEEP_SIZE, 0, os.fstat(fd).st_size + share)
            finally:
                os.close(fd)

    # -- meta -------------------------------------------------------------------------

    def get_meta(self, name: str) -> str | None:
        row = self._conn.execute("SELECT value FROM meta WHERE name=?", (name,)).fetchone()
        return None if row is None else row[0]

    def set_meta(self, name: str, value: str) -> None:
        self._conn.execute("INSERT OR REPLACE INTO meta(name, value) VALUES (?, ?)", (name, value))

    def reserve_fids(self, count: int) -> range:
        """`count` fids never used before (a crash only skips the unused rest)."""
        with self._conn:
            self._conn.execute("BEGIN IMMEDIATE")
            first = int(self.get_meta("next_fid") or "1")
            self.set_meta("next_fid", str(first + count))
        return range(first, first + count)

    def allocate_fid(self) -> int:
        return self.reserve_fids(1)[0]

    # -- files ------------------------------------------------------------------------

    def put_file(self, rec: PendingFile) -> None:
        """Record (or replace) a file that must be committed (plain SQL: sqlite-utils'
        upsert inspects the table on every call, several times slower per small file)."""
        row = vars(rec)
        names = ", ".join(row)
        updates = ", ".join(f"{n}=excluded.{n}" for n in row if n != "fid")
        self._conn.execute(
            f"INSERT INTO files({names}) VALUES ({', '.join('?' * len(row))})"
            f" ON CONFLICT(fid) DO UPDATE SET {updates}", tuple(row.values()))

    def drop_file(self, fid: int) -> None:
        """The file is committed (or gone): nothing of it is pending any more."""
        with self._conn:
            self._conn.execute("BEGIN IMMEDIATE")
            self._conn.execute("DELETE FROM chunks WHERE fid=?", (fid,))
            self._conn.execute("DELETE FROM files WHERE fid=?", (fid,))

    def pending_files(self) -> list[PendingFile]:
        return [PendingFile(**row) for row in self.db.table("files").rows_where(order_by="fid")]

    def rekey(self, fid: int, key: str, base_key: str | None) -> None:
        self.db.table("files").update(fid, {"key": key, "base_key": base_key})

    # -- namespace changes ------------------------------------------------------------

    def add_name_op(self, op: str, key: str, dst: str | None = None, arg: str | None = None,
                    *, drop_fid: int | None = None,
                    rekey: tuple[int, str, str | None] | None = None,
                    rekey_prefix: tuple[str, str] | None = None) -> int:
        """Record a namespace change, with the change of `files` rows that goes with it
        (an unlink drops the row, a rename rekeys it, a directory's rename every row
        below it) in the same transaction; its seq."""
        return self.add_name_ops([(op, key, dst, arg)], drop_fid=drop_fid, rekey=rekey,
                                 rekey_prefix=rekey_prefix)[0]

    def add_name_ops(self, ops: Sequence[tuple[str, str, str | None, str | None]], *,
                     drop_fid: int | None = None,
                     rekey: tuple[int, str, str | None] | None = None,
                     rekey_prefix: tuple[str, str] | None = None) -> list[int]:
        """`add_name_op` of changes (op, key, dst, arg) made together, in this order and
        one transaction (an unlink's DELETE and the removal of its object's table); their
        seqs."""
        with self._conn:
            self._conn.execute("BEGIN IMMEDIATE")
            seqs = [self._conn.execute(
                "INSERT INTO name_ops(op, key, dst, arg) VALUES (?, ?, ?, ?)", row).lastrowid
                for row in ops]
            if drop_fid is not None:
                self._conn.execute("DELETE FROM chunks WHERE fid=?", (drop_fid,))
                self._conn.execute("DELETE FROM files WHERE fid=?", (drop_fid,))
            if rekey is not None:
                fid, new_key, base_key = rekey
                self._conn.execute("UPDATE files SET key=?, base_key=? WHERE fid=?",
                                   (new_key, base_key, fid))
            if rekey_prefix is not None:
                self._move_prefix("key", *rekey_prefix)
        return [seq for seq in seqs if seq is not None]

    def name_ops(self) -> list[NameOpRow]:
        rows = self._conn.execute("SELECT seq, op, key, dst, arg, step FROM name_ops"
                                  " ORDER BY seq")
        return [NameOpRow(*row) for row in rows]

    def name_op_copied(self, seq: int, src: str, dst: str) -> None:
        """A move's copy is in S3: files based on `src` (below it, for a directory's
        "prefix/") are now based on `dst`."""
        with self._conn:
            self._conn.execute("BEGIN IMMEDIATE")
            self._conn.execute("UPDATE name_ops SET step=1 WHERE seq=?", (seq,))
            if src.endswith("/"):
                self._move_prefix("base_key", src, dst)
            else:
                self._conn.execute("UPDATE files SET base_key=? WHERE base_key=?", (dst, src))

    def _move_prefix(self, column: str, src: str, dst: str) -> None:
        """`column` of every files row below the directory key `src` moves below `dst`
        (substr, not LIKE: keys may hold % and _)."""
        self._conn.execute(
            f"UPDATE files SET {column} = ? || substr({column}, ?)"
            f" WHERE substr({column}, 1, ?) = ?", (dst, len(src) + 1, len(src), src))

    def end_name_op(self, seq: int, watch: tuple[str, int, float] | None = None) -> None:
        """A change is in S3. `watch` (key, fid, until): a DELETE that followed a commit
        whose request may still land; the key is watched (late_watches) from now on."""
        with self._conn:
            self._conn.execute("BEGIN IMMEDIATE")
            self._conn.execute("DELETE FROM name_ops WHERE seq=?", (seq,))
            if watch is not None:
                self._conn.execute("INSERT OR IGNORE INTO late_watches(key, fid, until)"
                                   " VALUES (?, ?, ?)", watch)

    def late_watches(self, now: float) -> list[tuple[str, int, float]]:
        """The keys still watched at `now` (key, fid, until); those over are dropped."""
        with self._conn:
            self._conn.execute("BEGIN IMMEDIATE")
            self._conn.execute("DELETE FROM late_watches WHERE until <= ?", (now,))
            rows = self._conn.execute("SELECT key, fid, until FROM late_watches")
            return [(key, fid, until) for key, fid, until in rows]

    # -- chunks -----------------------------------------------------------------------

    def mark_dirty(self, rec: PendingFile, indices: list[int]) -> None:
        """The intent record: written before the bytes of these chunks are acknowledged.

        The file row is written in the same transaction: a commit that just dropped it
        (nothing was pending a moment ago) must not leave these chunks without a file.
        """
        fid = rec.fid
        with self._conn:
            self._conn.execute("BEGIN")
            self._conn.execute(
                "INSERT OR IGNORE INTO files(fid, key, size, mode, uid, gid, mtime_ns, base_key,"
                " base_size, upload_id, upload_key, symlink, rdev)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (fid, rec.key, rec.size, rec.mode, rec.uid, rec.gid, rec.mtime_ns, rec.base_key,
                 rec.base_size, rec.upload_id, rec.upload_key, rec.symlink, rec.rdev))
            self._conn.execute("UPDATE files SET intent_gen=?, passthrough=? WHERE fid=?",
                               (rec.intent_gen, rec.passthrough, fid))
            self._conn.executemany(
                "INSERT OR REPLACE INTO chunks(fid, idx, state, etag) VALUES (?, ?, ?, NULL)",
                [(fid, i, CHUNK_DIRTY) for i in indices],
            )

    def mark_uploaded(self, fid: int, idx: int, etag: str, crc: int | None = None) -> None:
        self._conn.execute(
            "UPDATE chunks SET state=?, etag=?, crc=? WHERE fid=? AND idx=?",
            (CHUNK_UPLOADED, etag, crc, fid, idx),
        )

    def mark_spilled(self, fid: int, idx: int, token: str, etag: str,
                     crc: int | None) -> None:
        """The chunk's bytes are the object of its spilled part (D30, cache/spills)."""
        self._conn.execute(
            "UPDATE chunks SET state=?, spill=?, etag=?, crc=? WHERE fid=? AND idx=?",
            (CHUNK_SPILLED, token, etag, crc, fid, idx),
        )

    def spilled(self, fid: int) -> dict[int, tuple[str, str, int | None]]:
        """Chunk index -> (token, ETag, CRC-32C) of its spilled part."""
        rows = self._conn.execute(
            "SELECT idx, spill, etag, crc FROM chunks WHERE fid=? AND state=?",
            (fid, CHUNK_SPILLED))
        return {idx: (token, etag, crc) for idx, token, etag, crc in rows}

    def chunks(self, fid: int) -> dict[int, tuple[str, str | None]]:
        rows = self._conn.execute("SELECT idx, state, etag FROM chunks WHERE fid=?", (fid,))
        return {idx: (state, etag) for idx, state, etag in rows}

    def part_crcs(self, fid: int) -> dict[int, int]:
        """Chunk index -> CRC-32C of its uploaded part, where the journal has it."""
        rows = self._conn.execute(
            "SELECT idx, crc FROM chunks WHERE fid=? AND state=? AND crc IS NOT NULL",
            (fid, CHUNK_UPLOADED))
        return {idx: crc for idx, crc in rows}

    def forget_uploads(self, fid: int) -> None:
        """The upload is gone: its parts must be sent again, so they are dirty again
        (spilled parts are objects of their own: they stay)."""
        with self._conn:
            self._conn.execute("BEGIN")
            self._conn.execute(
                "UPDATE chunks SET state=?, etag=NULL, crc=NULL WHERE fid=? AND state!=?",
                (CHUNK_DIRTY, fid, CHUNK_SPILLED))
            self._conn.execute("UPDATE files SET upload_id=NULL, upload_key=NULL,"
                               " upload_checksum=0, upload_table=NULL WHERE fid=?", (fid,))

    def drop_chunks_from(self, fid: int, first_idx: int) -> None:
        """Chunks past a truncation no longer exist."""
        self._conn.execute("DELETE FROM chunks WHERE fid=? AND idx>=?", (fid, first_idx))

    def finish_commit(self, fid: int, committed_idx: list[int], keep_file: bool,
                      base_key: str, base_size: int, seen_gen: int, flag_stale: bool = False,
                      clean: CleanNote | None = None, crc: int | None = None,
                      spills: Sequence[tuple[int, str]] = ()) -> bool:
        """After CompleteMultipartUpload/PutObject: drop what the new object holds.

        The file row goes only if no intent newer than `seen_gen` (the commit's start)
        reached the journal, and it carries no passthrough flag unless `flag_stale` (no
        passthrough writer is left, and the object holds what the last one wrote);
        returns whether the row is kept. `clean` replaces what was
        noted of the file's clean chunks (the new object is their base), in the same
        transaction: a journal round trip per committed file less; `crc` is the new
        object's CRC-32C, noted with it; `spills`: (chunk, token) of the spilled parts
        it copied (a chunk spilled again meanwhile keeps its row).
        """
        with self._conn:
            self._conn.execute("BEGIN")
            if clean is not None:
                self._replace_clean(*clean)
                if crc is not None:
                    self._conn.execute("UPDATE cached_files SET crc=? WHERE fid=?",
                                       (crc, clean[0]))
            self._conn.executemany(
                "DELETE FROM chunks WHERE fid=? AND idx=? AND state=?",
                [(fid, i, CHUNK_UPLOADED) for i in committed_idx],
            )
            self._conn.executemany(
                "DELETE FROM chunks WHERE fid=? AND idx=? AND state=? AND spill=?",
                [(fid, i, CHUNK_SPILLED, token) for i, token in spills],
            )
            if not keep_file:
                row = self._conn.execute(
                    "SELECT intent_gen, passthrough FROM files WHERE fid=?", (fid,)).fetchone()
                if row is None or (row[0] <= seen_gen and (flag_stale or not row[1])):
                    self._conn.execute("DELETE FROM chunks WHERE fid=?", (fid,))
                    self._conn.execute("DELETE FROM files WHERE fid=?", (fid,))
                    return False
            self._conn.execute(
                "UPDATE files SET base_key=?, base_size=?, upload_id=NULL, upload_key=NULL,"
                " upload_checksum=0, upload_table=NULL WHERE fid=?", (base_key, base_size, fid))
            self._conn.execute(
                "UPDATE chunks SET state=?, etag=NULL, crc=NULL WHERE fid=? AND state!=?",
                (CHUNK_DIRTY, fid, CHUNK_SPILLED))
            return True

    # -- multipart uploads ------------------------------------------------------------

    def intend_upload(self, fid: int, key: str) -> None:
        """Written before CreateMultipartUpload, so a crash cannot hide the new upload."""
        self._conn.execute("INSERT OR REPLACE INTO uploads(upload_id, key) VALUES (?, ?)",
                           (f"{INTENT}{fid}", key))

    def start_upload(self, fid: int, upload_id: str, key: str, checksum: bool = False,
                     table: str | None = None) -> None:
        """`checksum`: created with ChecksumAlgorithm CRC32C (see `upload_checksum`);
        `table`: the key of its table of part CRCs (see `upload_table`)."""
        with self._conn:
            self._conn.execute("BEGIN")
            self._conn.execute("DELETE FROM uploads WHERE upload_id=?", (f"{INTENT}{fid}",))
            self._conn.execute(
                "INSERT OR REPLACE INTO uploads(upload_id, key) VALUES (?, ?)", (upload_id, key))
            self._conn.execute(
                "UPDATE files SET upload_id=?, upload_key=?, upload_checksum=?, upload_table=?"
                " WHERE fid=?", (upload_id, key, int(checksum), table, fid))

    def end_upload(self, upload_id: str) -> None:
        """The upload was completed or aborted."""
        self._conn.execute("DELETE FROM uploads WHERE upload_id=?", (upload_id,))

    def orphan_uploads(self) -> list[tuple[str, str]]:
        """(key, upload_id) of uploads no pending file needs any more."""
        rows = self._conn.execute(
            "SELECT key, upload_id FROM uploads WHERE upload_id NOT IN"
            " (SELECT upload_id FROM files WHERE upload_id IS NOT NULL)")
        return [(k, u) for k, u in rows]

    # -- the warm cache ---------------------------------------------------------------

    def note_clean(self, fid: int, key: str, etag: str, size: int, indices: list[int],
                   replace: bool = False) -> None:
        """Chunks of fid now hold object key@etag; `replace` drops what was noted before."""
        if replace:
            with self._conn:
                self._conn.execute("BEGIN")
                self._replace_clean(fid, key, etag, size, indices)
        else:
            self.note_clean_many([(fid, key, etag, size, indices)])

    def note_clean_many(self, notes: list[CleanNote]) -> None:
        """Several `note_clean`s in one transaction."""
        if not notes:
            return
        with self._conn:
            self._conn.execute("BEGIN")
            for note in notes:
                self._note_clean(*note)

    def _note_clean(self, fid: int, key: str, etag: str, size: int,
                    indices: list[int]) -> None:
        self._conn.execute(
            "INSERT OR REPLACE INTO cached_files(fid, key, etag, size) VALUES (?,?,?,?)",
            (fid, key, etag, size))
        self._conn.executemany("INSERT OR IGNORE INTO clean_chunks(fid, idx) VALUES (?, ?)",
                               [(fid, i) for i in indices])

    def _replace_clean(self, fid: int, key: str, etag: str, size: int,
                       indices: list[int]) -> None:
        self._conn.execute("DELETE FROM clean_chunks WHERE fid=?", (fid,))
        self._note_clean(fid, key, etag, size, indices)

    def drop_clean_many(self, chunks: list[tuple[int, int]]) -> None:
        """Evicted chunks, (fid, idx) pairs of any files, in one transaction."""
        with self._conn:
            self._conn.execute("BEGIN")
            self._conn.executemany("DELETE FROM clean_chunks WHERE fid=? AND idx=?", chunks)

    def forget_cached(self, fid: int) -> None:
        with self._conn:
            self._conn.execute("BEGIN")
            self._conn.execute("DELETE FROM clean_chunks WHERE fid=?", (fid,))
            self._conn.execute("DELETE FROM cached_files WHERE fid=?", (fid,))

    def cached_crc(self, fid: int, etag: str) -> int | None:
        """The CRC-32C noted with the commit of the object version `etag` cached in fid."""
        row = self._conn.execute("SELECT crc FROM cached_files WHERE fid=? AND etag=?",
                                 (fid, etag)).fetchone()
        return None if row is None else row[0]

    def rekey_cached(self, fid: int, key: str) -> None:
        self._conn.execute("UPDATE cached_files SET key=? WHERE fid=?", (key, fid))

    def warm_files(self) -> dict[str, WarmFile]:
        """Key -> warm cache entry, for files with nothing pending."""
        out: dict[str, WarmFile] = {}
        rows = self._conn.execute(
            "SELECT fid, key, etag, size FROM cached_files"
            " WHERE fid NOT IN (SELECT fid FROM files)")
        for fid, key, etag, size in rows.fetchall():
            chunks = [r[0] for r in self._conn.execute(
                "SELECT idx FROM clean_chunks WHERE fid=? ORDER BY idx", (fid,))]
            out[key] = WarmFile(fid, etag, size, chunks)
        return out

    def known_fids(self) -> set[int]:
        """Every fid whose cache file is still needed (pending or warm)."""
        rows = self._conn.execute("SELECT fid FROM files UNION SELECT fid FROM cached_files")
        return {r[0] for r in rows}

    # -- durability -------------------------------------------------------------------

    def sync(self) -> None:
        """Make every earlier commit survive a machine crash (an fsync of the WAL); none
        when nothing was committed since the last one (e.g. a second fsync of a file)."""
        if self._conn.total_changes == self._synced_changes:
            return
        self._conn.execute("PRAGMA synchronous=FULL")
        with self._conn:
            self._conn.execute("BEGIN IMMEDIATE")
            self.set_meta("last_sync", "1")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._synced_changes = self._conn.total_changes

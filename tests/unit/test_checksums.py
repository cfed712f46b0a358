"""End-to-end checksums (issue 24): every UploadPart and PutObject declares the CRC-32C
of the bytes read out of the cache file, so S3 rejects a body corrupted on the way and
the mount sends it again; the object ends with S3's full-object CRC-32C and the
journal's; the mount probes whether the endpoint checks, and status says so."""

from __future__ import annotations

import sqlite3
import stat

import sqlite_utils

from lakefs_mount.cache.journal import Journal
from lakefs_mount.cache.journalschema import MIGRATIONS, PendingFile

MiB = 1024 * 1024
def test_a_journal_of_the_previous_schema_opens_and_keeps_its_upload(tmp_path) -> None:
    """A v6 journal with an open upload and an uploaded part (no CRC, no checksum mode)
    opens: the upload completes without part checksums as it was created; new parts
    note their CRC."""
    path = tmp_path / "journal.db"
    db = sqlite_utils.Database(sqlite3.connect(str(path), isolation_level=None))
    for step in MIGRATIONS[:6]:
        step(db)
    db.execute("PRAGMA user_version=6")
    db["files"].insert({"fid": 7, "key": "k", "size": 9 * MiB, "mode": stat.S_IFREG | 0o644,
                        "uid": 0, "gid": 0, "mtime_ns": 1, "upload_id": "U", "upload_key": "k"})
    db["chunks"].insert({"fid": 7, "idx": 0, "state": "uploaded", "etag": "e0"})
    db.conn.close()

    j = Journal(path)
    [rec] = j.pending_files()
    assert isinstance(rec, PendingFile) and rec.upload_id == "U"
    assert rec.upload_checksum == 0
    assert j.chunks(7) == {0: ("uploaded", "e0")} and j.part_crcs(7) == {}
    j.mark_dirty(rec, [1])
    j.mark_uploaded(7, 1, "e1", 0x1234)
    assert j.part_crcs(7) == {1: 0x1234}



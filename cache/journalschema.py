"""The journal's tables, their migrations (one function per schema version, run in
order by `Journal`) and the rows read from them.

Schema and sentinels (see docs/durability.md for the crash table):

files      one row per file whose content or attributes are not yet committed in S3.
  fid          stable id; the cache file is `<cache_dir>/data/<fid>`
  key          S3 key the file commits to (a rename updates it)
  size         logical file size
  mode/uid/gid/mtime_ns  attributes to write as object metadata
  base_key     object that unchanged chunks are copied from server-side;
               NULL = the file has no committed predecessor (every byte is in the cache)
  base_size    size of base_key's object; ignored when base_key IS NULL
  upload_id    open multipart upload; NULL = none started
  upload_key   key that upload_id was created for; differs from key after a rename
  symlink      NULL = regular file; else the link target (body of the object)
  intent_gen   (v3) bumped by every intent (put_file, mark_dirty); a commit drops the row
               only if no intent came after the one it started from
  passthrough  (v4) 1 = the kernel may be writing the cache file directly (FUSE
               passthrough), so any byte of it may be dirty whatever `chunks` says;
               set before such an open is answered, cleared with the chunk rows that
               bring `chunks` in line with the cache file. A commit keeps a row while set.
  rdev         (v5) device number of a character or block device (mode says which);
               0 for every other file
  upload_checksum  (v7) 1 = upload_id was created with ChecksumAlgorithm CRC32C (type
               FULL_OBJECT): its Complete must give every part's CRC-32C
  upload_table  (v9) the key its object's metadata names for the table of its parts'
               CRC-32C (s3/parttable), written with its Complete; NULL = none
  atime_ns     (v10) atime set by utimensat; NULL = none (reads as mtime)
  ctime_ns     (v10) when its content or attributes last changed; 0 = not known (mtime)
chunks     one row per chunk that is not clean.
  state = 'dirty'     the cache file holds bytes of chunk idx that are in no part yet
  state = 'uploaded'  part idx+1 of the file's upload_id holds the chunk; etag set
  state = 'spilled'   the object spill/<writer>/<fid>/<idx>-<spill> holds the chunk
                      (D30); etag set; the cache file may no longer (evicted)
  spill      (v11) the token that names the spilled part's object
  crc        (v7) CRC-32C of the uploaded part's bytes (sent as x-amz-checksum-crc32c);
             NULL = not known (a part uploaded before v7, or with checksums off)
uploads    every multipart upload this journal created and has not yet completed or
           aborted; one that no files row references is an orphan and is aborted at mount.
           upload_id LIKE 'intent:%' = CreateMultipartUpload was about to be sent for key:
           after a crash, the mount aborts every open upload of exactly that key that the
           journal does not reference (the id S3 chose never reached the journal).
cached_files  (v2) the clean bytes of object key@etag (size bytes) are cached in file fid;
           lets a remount reuse the warm cache. Ignored for fids that have a files row.
  crc      (v7) CRC-32C of the whole object key@etag, as this mount uploaded it
           (crc32c_combine of its parts); NULL = not known
clean_chunks  (v2) which chunks of a cached_files row hold those bytes.
name_ops   (v6) namespace changes not yet applied to S3, in the order they were made
           (`seq`): op 'dir' (PUT the directory marker `key`; arg = its attributes as
           JSON, with "replace"), 'rmdir' (DELETE the marker `key`), 'delete' (DELETE the
           object `key`), 'move' (CopyObject `key` -> `dst`, then DELETE `key`; `step` 1 =
           the copy is done, and files whose base_key was `key` now say `dst`; for keys
           ending in "/", a directory: every object below `key` moves below `dst`). Written
           before the change is acknowledged, in the transaction that changes the `files`
           row it goes with; a row goes once its change is in S3.
late_watches  (v8) keys where a commit that was under way at its file's unlink may still
           land after the file's DELETE (lakefs_mount.namespace.latewrites): `fid` names the file
           (its objects' META_WRITER), `until` (wall-clock seconds) ends the watch. Added
           in the transaction that ends that DELETE's `name_ops` row, so a crash never
           ends a watch early; rows past `until` go at the next mount.
meta       name/value pairs: next_fid, bucket, prefix, part_size, index_writer (dirindex),
           dir_markers_keep_metadata ("1"/"0": the dirattrs probe's answer for the bucket).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import sqlite_utils

CHUNK_DIRTY = "dirty"
CHUNK_UPLOADED = "uploaded"
CHUNK_SPILLED = "spilled"
INTENT = "intent:"  # upload_id prefix of an upload about to be created


@dataclass
class PendingFile:
    fid: int
    key: str
    size: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    base_key: str | None = None
    base_size: int = 0
    upload_id: str | None = None
    upload_key: str | None = None
    symlink: str | None = None
    rdev: int = 0
    intent_gen: int = 0  # how many intents the daemon had issued for the file
    passthrough: int = 0  # 1: the kernel may write the cache file directly
    upload_checksum: int = 0  # 1: upload_id's Complete needs every part's CRC-32C
    upload_table: str | None = None  # the key of its table of part CRCs
    atime_ns: int | None = None  # set explicitly (utimensat); NULL: reads as mtime
    ctime_ns: int = 0  # when its content or attributes last changed


def _migrate_v1(db: sqlite_utils.Database) -> None:
    db.table("meta").create({"name": str, "value": str}, pk="name")
    db.table("files").create(
        {
            "fid": int, "key": str, "size": int, "mode": int, "uid": int, "gid": int,
            "mtime_ns": int, "base_key": str, "base_size": int, "upload_id": str,
            "upload_key": str, "symlink": str,
        },
        pk="fid",
        not_null={"key", "size", "mode", "uid", "gid", "mtime_ns"},
        defaults={"base_size": 0},
    )
    db.table("chunks").create(
        {"fid": int, "idx": int, "state": str, "etag": str},
        pk=("fid", "idx"),
        not_null={"state"},
        foreign_keys=[("fid", "files", "fid")],
    )
    db.table("uploads").create({"upload_id": str, "key": str}, pk="upload_id")


def _migrate_v2(db: sqlite_utils.Database) -> None:
    db.table("cached_files").create({"fid": int, "key": str, "etag": str, "size": int}, pk="fid",
                              not_null={"key", "etag", "size"})
    db.table("clean_chunks").create({"fid": int, "idx": int}, pk=("fid", "idx"))


def _migrate_v3(db: sqlite_utils.Database) -> None:
    db.table("files").add_column("intent_gen", int, not_null_default=0)


def _migrate_v4(db: sqlite_utils.Database) -> None:
    db.table("files").add_column("passthrough", int, not_null_default=0)


def _migrate_v5(db: sqlite_utils.Database) -> None:
    db.table("files").add_column("rdev", int, not_null_default=0)


def _migrate_v6(db: sqlite_utils.Database) -> None:
    db.execute("CREATE TABLE name_ops (seq INTEGER PRIMARY KEY AUTOINCREMENT,"
               " op TEXT NOT NULL, key TEXT NOT NULL, dst TEXT, arg TEXT,"
               " step INTEGER NOT NULL DEFAULT 0)")


def _migrate_v7(db: sqlite_utils.Database) -> None:
    db.table("files").add_column("upload_checksum", int, not_null_default=0)
    db.table("chunks").add_column("crc", int)
    db.table("cached_files").add_column("crc", int)


def _migrate_v8(db: sqlite_utils.Database) -> None:
    db.execute("CREATE TABLE late_watches (key TEXT NOT NULL, fid INTEGER NOT NULL,"
               " until REAL NOT NULL, PRIMARY KEY (key, fid))")


def _migrate_v9(db: sqlite_utils.Database) -> None:
    db.table("files").add_column("upload_table", str)


def _migrate_v10(db: sqlite_utils.Database) -> None:
    db.table("files").add_column("atime_ns", int)
    db.table("files").add_column("ctime_ns", int, not_null_default=0)


def _migrate_v11(db: sqlite_utils.Database) -> None:
    db.table("chunks").add_column("spill", str)


MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [
    _migrate_v1, _migrate_v2, _migrate_v3, _migrate_v4, _migrate_v5, _migrate_v6,
    _migrate_v7, _migrate_v8, _migrate_v9, _migrate_v10, _migrate_v11]


@dataclass
class NameOpRow:
    """One namespace change waiting for S3 (see the `name_ops` table)."""

    seq: int
    op: str
    key: str
    dst: str | None = None
    arg: str | None = None
    step: int = 0


@dataclass
class WarmFile:
    """Clean cached content of one object, as a previous mount left it."""

    fid: int
    etag: str
    size: int
    chunks: list[int]


CleanNote = tuple[int, str, str, int, list[int]]  # fid, key, etag, size, chunk indices

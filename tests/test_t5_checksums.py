"""End-to-end checksums (issue 24): every UploadPart and PutObject declares the CRC-32C
of the bytes read out of the cache file, so S3 rejects a body corrupted on the way and
the mount sends it again; the object ends with S3's full-object CRC-32C and the
journal's; the mount probes whether the endpoint checks, and status says so."""

from __future__ import annotations

import os
import sqlite3
import stat
import time

import boto3
import crc32c
import sqlite_utils
from botocore.config import Config
from mounting import cli

from lakefs_mount.cache.journal import Journal
from lakefs_mount.cache.journalschema import MIGRATIONS, PendingFile
from lakefs_mount.manifest import encode_crc

MiB = 1024 * 1024
VERIFIED = "crc32c (verified by S3)"


def _client(endpoint_url: str):  # S3's own view, for what the mount cannot tell
    return boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1",
                        config=Config(request_checksum_calculation="when_required",
                                      response_checksum_validation="when_required",
                                      s3={"addressing_style": "path"}))


def _wait_probed(m, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = m.status()
        if "whether" not in status["checksums"] or time.monotonic() > deadline:
            return status
        time.sleep(0.1)


def test_a_corrupted_part_and_object_are_rejected_by_s3_and_sent_again(
        mount_factory, fault_proxy, s3, s3_server) -> None:
    """The proxy flips one byte in the 2nd UploadPart and in the small file's PutObject:
    SeaweedFS answers BadDigest, the flusher sends them again, both objects end byte-
    identical with S3's CRC-32C of the whole object (FULL_OBJECT for the multipart one),
    status counts the retries and shows the checksum line, and the journal noted the
    committed objects' CRCs."""
    fault_proxy.parse_requests = True  # before the mount: every connection is parsed
    m = mount_factory("--part-size", "8M", "--commit-delay", "0",
                      endpoint_url=fault_proxy.endpoint_url)
    status = _wait_probed(m)
    assert status["checksums"] == VERIFIED, status["checksums"]
    text = cli("status", str(m.path), check=True).stdout
    assert any(line.strip().startswith("checksums") and line.endswith(VERIFIED)
               for line in text.splitlines()), text
    before = m.status()["retries"]

    big, small = os.urandom(20 * MiB + 12345), os.urandom(300_000)
    fault_proxy.corrupt_body("partNumber=", nth=2)
    fault_proxy.corrupt_body("small.bin")
    (m.path / "big.bin").write_bytes(big)
    (m.path / "small.bin").write_bytes(small)
    done = m.flush()
    assert done.returncode == 0, done.stderr + m.log_tail()

    assert len(fault_proxy.corrupted) == 2, fault_proxy.corrupted  # both were hit
    for key, data in (("big.bin", big), ("small.bin", small)):
        got = s3.get(key)
        assert got is not None and got[1] == data, key
    assert m.status()["retries"] - before >= 2
    assert m.log_tail(400).count("BadDigest") >= 2

    client = _client(s3_server.endpoint_url)
    head = client.head_object(Bucket=s3.bucket, Key="big.bin", ChecksumMode="ENABLED")
    assert head.get("ChecksumCRC32C") == encode_crc(crc32c.crc32c(big)), head
    assert head.get("ChecksumType") == "FULL_OBJECT", head
    head = client.head_object(Bucket=s3.bucket, Key="small.bin", ChecksumMode="ENABLED")
    assert head.get("ChecksumCRC32C") == encode_crc(crc32c.crc32c(small)), head

    with sqlite3.connect(m.cache_dir / "journal.db") as db:  # (WAL: a reader is fine)
        noted = dict(db.execute("SELECT key, crc FROM cached_files"))
    assert noted == {"big.bin": crc32c.crc32c(big), "small.bin": crc32c.crc32c(small)}, noted


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

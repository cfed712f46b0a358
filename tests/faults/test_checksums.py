"""End-to-end checksums (issue 24): every UploadPart and PutObject declares the CRC-32C
of the bytes read out of the cache file, so S3 rejects a body corrupted on the way and
the mount sends it again; the object ends with S3's full-object CRC-32C and the
journal's; the mount probes whether the endpoint checks, and status says so."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import stat
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import crc32c
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from lakefs_mount.namespace.dirindex import INDEX_FOLDER
from lakefs_mount.publish.manifest import MANIFEST_NAME, SELF_CHECK, canonical, encode_crc
from lakefs_mount.s3 import trailer
from lakefs_mount.s3.embedded import EmbeddedS3
from lakefs_mount.s3.store import S3ObjectStore
from tests.conftest import AUTH_ACCESS_KEY, AUTH_SECRET_KEY
from tests.faultproxy import FaultProxy
from tests.mounting import CLI, Mount, cli

MiB = 1024 * 1024
# Over plain HTTP to an endpoint that checks, parts go with their CRC in a header, hashed
# first and then sent from the cache file by sendfile, whether it takes aws-chunked
# trailers (SeaweedFS does only from a known key) or not.
SENDFILE = "crc32c (verified by S3, in a header; parts sent by sendfile)"


def _client(endpoint_url: str):  # S3's own view, for what the mount cannot tell
    return boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1",
                        aws_access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                        config=Config(request_checksum_calculation="when_required",
                                      response_checksum_validation="when_required",
                                      s3={"addressing_style": "path"}))


@pytest.fixture
def auth_setup(s3_auth_server, tmp_path, monkeypatch) -> Iterator[tuple]:
    """A bucket of the server that checks credentials (SeaweedFS takes aws-chunked
    trailers only from a known key), a fault proxy before it, and a mount through it."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", AUTH_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AUTH_SECRET_KEY)
    bucket = f"c-{uuid.uuid4().hex[:16]}"
    s3_auth_server.create_bucket(bucket)
    store = S3ObjectStore(bucket, endpoint_url=s3_auth_server.endpoint_url,
                          region="us-east-1", access_key=AUTH_ACCESS_KEY,
                          secret_key=AUTH_SECRET_KEY)
    with FaultProxy("127.0.0.1", s3_auth_server.port) as proxy:
        proxy.parse_requests = True  # before the mount: every connection is parsed
        m = Mount(tmp_path / "m", bucket, proxy.endpoint_url,
                  options=("--part-size", "8M", "--commit-delay", "0"))
        try:
            m.start()
            yield m, proxy, store, s3_auth_server
        finally:
            m.cleanup()


def test_a_corrupted_part_and_object_are_rejected_by_s3_and_sent_again(auth_setup) -> None:
    """The proxy flips one byte in the 2nd UploadPart (its CRC in a header, its bytes
    sent by sendfile) and in the small file's PutObject: SeaweedFS rejects both, the
    flusher sends them again, both objects end byte-identical with S3's CRC-32C of the
    whole object (FULL_OBJECT for the multipart one), status counts the retries and shows
    the checksum line, and the journal noted the committed objects' CRCs."""
    m, fault_proxy, s3, server = auth_setup
    status = m.probed()
    assert status["checksums"] == SENDFILE, status["checksums"]
    assert f"upload checksums: {SENDFILE}" in m.log_tail(), m.log_tail()
    text = cli("status", str(m.path), check=True).stdout
    assert any(line.strip().startswith("checksums") and line.endswith(SENDFILE)
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
    assert m.log_tail(400).count("do not match their checksum") >= 2

    client = _client(server.endpoint_url)
    head = client.head_object(Bucket=s3.bucket, Key="big.bin", ChecksumMode="ENABLED")
    assert head.get("ChecksumCRC32C") == encode_crc(crc32c.crc32c(big)), head
    assert head.get("ChecksumType") == "FULL_OBJECT", head
    head = client.head_object(Bucket=s3.bucket, Key="small.bin", ChecksumMode="ENABLED")
    assert head.get("ChecksumCRC32C") == encode_crc(crc32c.crc32c(small)), head

    assert AUTH_SECRET_KEY not in json.dumps(m.status()) + m.log_tail(2000)
    with sqlite3.connect(m.cache_dir / "journal.db") as db:  # (WAL: a reader is fine)
        noted = dict(db.execute("SELECT key, crc FROM cached_files"))
    assert noted == {"big.bin": crc32c.crc32c(big), "small.bin": crc32c.crc32c(small)}, noted


def test_part_crcs_survive_a_crash_and_complete_the_upload_with_s3s_checksum(
        mount_factory, s3, s3_server) -> None:
    """Parts streamed while the file is still open note their CRC in the journal; kill -9,
    remount: the kept parts complete the checksummed upload (S3 requires every part's
    CRC), and the object carries the whole object's CRC-32C."""
    m = mount_factory("--part-size", "8M")
    assert m.probed()["checksums"] == SENDFILE
    data = os.urandom(20 * MiB + 999)
    journal = m.cache_dir / "journal.db"
    f = open(m.path / "ckpt.bin", "wb", buffering=0)  # noqa: SIM115 (open across the crash)
    try:
        f.write(data)
        deadline = time.monotonic() + 30
        while True:  # the two full chunks stream as parts while the file is open
            with sqlite3.connect(journal) as db:
                kept = db.execute("SELECT idx, crc FROM chunks WHERE state='uploaded'"
                                  " AND crc IS NOT NULL ORDER BY idx").fetchall()
            if len(kept) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert kept == [(i, crc32c.crc32c(data[i * 8 * MiB:(i + 1) * 8 * MiB]))
                        for i in range(2)], kept
        m.kill9()
    finally:
        with contextlib.suppress(OSError):
            f.close()
    m.start()
    done = m.flush()
    assert done.returncode == 0, done.stderr + m.log_tail()
    assert "kept 2 uploaded part(s)" in m.log_tail(400), m.log_tail()
    got = s3.get("ckpt.bin")
    assert got is not None and got[1] == data
    head = _client(s3_server.endpoint_url).head_object(Bucket=s3.bucket, Key="ckpt.bin",
                                                       ChecksumMode="ENABLED")
    assert head.get("ChecksumCRC32C") == encode_crc(crc32c.crc32c(data)), head


def test_a_failed_probe_leaves_the_mount_working_with_checksums_unverified(
        mount_factory, fault_proxy, s3) -> None:
    """Every PUT is answered 500 while the mount starts and probes: the mount serves on,
    status says the endpoint's checking is unknown, and files still go up (each with its
    CRC in a header, multipart uploads without S3's stored checksum)."""
    fault_proxy.parse_requests = True
    fault_proxy.answer_share(500, "InternalError", 1.0, frozenset({"PUT"}))
    m = mount_factory("--part-size", "8M", endpoint_url=fault_proxy.endpoint_url)
    deadline = time.monotonic() + 20
    while "upload checksums:" not in m.log_tail() and time.monotonic() < deadline:
        time.sleep(0.1)
    fault_proxy.answer_share(500, "InternalError", 0.0)
    assert fault_proxy.answered >= 1
    status = m.status()
    assert status["checksums"] == "crc32c (whether this endpoint verifies it is unknown)"
    data = os.urandom(9 * MiB)
    (m.path / "f.bin").write_bytes(data)
    done = m.flush()
    assert done.returncode == 0, done.stderr + m.log_tail()
    got = s3.get("f.bin")
    assert got is not None and got[1] == data


class _Pieces:
    """A piecewise body in pieces of `size` bytes (no CRC of its own)."""

    def __init__(self, data: bytes, size: int) -> None:
        self.data, self.size = data, size

    def __len__(self) -> int:
        return len(self.data)

    def pieces(self) -> Iterator[memoryview]:
        view = memoryview(self.data)
        for at in range(0, len(self.data), self.size):
            yield view[at:at + self.size]


def test_trailed_bodies_of_any_shape_land_byte_identical(s3_auth_server, monkeypatch) -> None:
    """aws-chunked framing with chunks of 1000 bytes: bodies shorter, equal to and longer
    than a chunk, in pieces smaller and larger than one, reach SeaweedFS intact."""
    monkeypatch.setattr(trailer, "CHUNK", 1000)
    bucket = f"c-{uuid.uuid4().hex[:16]}"
    s3_auth_server.create_bucket(bucket)
    store = S3ObjectStore(bucket, endpoint_url=s3_auth_server.endpoint_url,
                          region="us-east-1", access_key=AUTH_ACCESS_KEY,
                          secret_key=AUTH_SECRET_KEY)
    for size in (1, 999, 1000, 1001, 4500):
        for piece in (7, 3000):
            data = os.urandom(size)
            store.put_piecewise(f"k{size}-{piece}", _Pieces(data, piece), True)
            got = store.get(f"k{size}-{piece}")
            assert got is not None and got[1] == data, (size, piece)


def test_verify_takes_s3s_stored_checksums_and_reads_back_only_what_has_none(
        mount_factory, s3, s3_server) -> None:
    """A checkpoint committed through the mount carries S3's whole-object CRC-32C on every
    object (a single PUT and a multipart upload of type FULL_OBJECT): `verify` compares
    those with the manifest and reads back no byte. An object rewritten behind the mount
    without a CRC-32C (boto3's default is CRC32, or none) is read back and hashed: a
    changed byte is still found."""
    m = mount_factory("--part-size", "8M")
    assert m.probed()["checksums"] == SENDFILE
    (m.path / "ck").mkdir()
    big, small = os.urandom(20 * MiB + 5), os.urandom(4096)
    (m.path / "ck" / "model.bin").write_bytes(big)
    (m.path / "ck" / "config.json").write_bytes(small)
    assert cli("commit", str(m.path), "ck").returncode == 0
    report = json.loads(cli("verify", "--json", f"s3://{s3.bucket}/ck/",
                            "--endpoint-url", s3_server.endpoint_url).stdout)
    assert report["ok"] and report["files"] == 2, report
    assert (report["checked_by_s3"], report["bytes_read"]) == (2, 0), report
    # the same bytes, uploaded again without a CRC-32C: equal, but only reading tells
    changed = bytearray(small)
    changed[100] ^= 1
    client = _client(s3_server.endpoint_url)
    client.put_object(Bucket=s3.bucket, Key="ck/config.json", Body=bytes(changed))
    etag = client.head_object(Bucket=s3.bucket, Key="ck/config.json")["ETag"].strip('"')
    manifest = json.loads(client.get_object(Bucket=s3.bucket,
                                            Key="ck/.lakefs-commit.json")["Body"].read())
    for entry in manifest["files"]:  # keep the listing's check quiet: only the CRC differs
        if entry["key"] == "config.json":
            entry["etag"] = etag
    del manifest[SELF_CHECK]  # (edited as a whole: its own CRC-32C made again)
    manifest[SELF_CHECK] = encode_crc(crc32c.crc32c(canonical(manifest)))
    client.put_object(Bucket=s3.bucket, Key="ck/.lakefs-commit.json",
                      Body=canonical(manifest))
    proc = cli("verify", "--json", f"s3://{s3.bucket}/ck/", "--endpoint-url",
               s3_server.endpoint_url)
    report = json.loads(proc.stdout)
    assert proc.returncode != 0 and not report["ok"], report
    assert [p["kind"] for p in report["problems"]] == ["checksum"], report
    assert (report["checked_by_s3"], report["bytes_read"]) == (1, len(small)), report


class _EmbeddedMount(Mount):
    """`lakefs-mount mount MOUNTPOINT` without a SOURCE: its own SeaweedFS in `state`."""

    def __init__(self, root, state, options: tuple[str, ...]) -> None:
        super().__init__(root, "lakefs-mount", "", options=options)
        self.state = state

    def start(self, *extra: str) -> None:
        proc = cli("mount", str(self.path), "--embedded-dir", str(self.state),
                   "--cache-dir", str(self.cache_dir), "--log-file", str(self.log_file),
                   "--log-level", "DEBUG", *self.options, *extra)
        assert proc.returncode == 0, proc.stderr + self.log_tail()
        self.pid = int(self.status()["pid"])


def _cmdlines() -> str:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                found.append(Path(entry.path, "cmdline").read_bytes().decode(errors="replace"))
    return "\n".join(found)


def test_an_embedded_mount_keys_its_server_and_sends_checked_parts(tmp_path) -> None:
    """Without a SOURCE the mount starts SeaweedFS with a key generated for this start
    (in weed's environment only): the probe finds checksums checked, a multipart file lands
    byte-identical with S3's CRC-32C, a request without the key is refused, `verify
    s3://...` reaches the server through the 0600 credentials file, and the secret is in
    no log, no status and no process's command line; the file goes with the server."""
    state = tmp_path / "embedded"
    m = _EmbeddedMount(tmp_path / "e", state, ("--part-size", "8M", "--commit-delay", "0"))
    try:
        m.start()
        status = m.probed()
        assert status["checksums"] == SENDFILE, status["checksums"] + m.log_tail()
        text = cli("status", str(m.path), check=True).stdout
        creds = state / "credentials"
        assert stat.S_IMODE(creds.stat().st_mode) == 0o600
        keys = dict(line.split(" = ", 1) for line in creds.read_text().splitlines()[1:])
        secret = keys["aws_secret_access_key"]
        assert len(secret) >= 30

        (m.path / "ck").mkdir()
        data = os.urandom(20 * MiB + 4321)
        (m.path / "ck" / "model.bin").write_bytes(data)
        assert cli("commit", str(m.path), "ck").returncode == 0, m.log_tail()
        endpoint = status["endpoint"]
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                              aws_access_key_id=keys["aws_access_key_id"],
                              aws_secret_access_key=secret,
                              config=Config(request_checksum_calculation="when_required",
                                            response_checksum_validation="when_required",
                                            s3={"addressing_style": "path"}))
        got = client.get_object(Bucket="lakefs-mount", Key="ck/model.bin")["Body"].read()
        assert got == data
        head = client.head_object(Bucket="lakefs-mount", Key="ck/model.bin",
                                  ChecksumMode="ENABLED")
        assert head.get("ChecksumCRC32C") == encode_crc(crc32c.crc32c(data)), head
        assert head.get("ChecksumType") == "FULL_OBJECT", head
        with pytest.raises(ClientError, match="InvalidAccessKeyId"):
            _client(endpoint).get_object(Bucket="lakefs-mount", Key="ck/model.bin")

        proc = subprocess.run(
            [CLI, "verify", "--json", "--profile", "embedded", "--endpoint-url", endpoint,
             "s3://lakefs-mount/ck/"], capture_output=True, text=True, timeout=120,
            env={**os.environ, "AWS_SHARED_CREDENTIALS_FILE": str(creds)})
        report = json.loads(proc.stdout)
        assert proc.returncode == 0 and report["ok"], proc.stderr + proc.stdout
        assert (report["files"], report["checked_by_s3"]) == (1, 1), report

        seen = [m.log_file.read_text(), json.dumps(m.status()), text, _cmdlines(),
                (state / "weed.log").read_text()]
        assert not [i for i, where in enumerate(seen) if secret in where]
        assert m.unmount().returncode == 0
        assert not creds.exists()
    finally:
        m.cleanup()
        for pid in EmbeddedS3(state)._leftover_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_corrupted_manifest_and_index_are_refused_by_s3_and_sent_again(
        mount_factory, fault_proxy, s3) -> None:
    """The commit manifest and the directory's attribute index go up with their CRC-32C
    in a header, as file objects do: the proxy flips a byte in each PUT, SeaweedFS
    refuses both, the mount sends them again, and both land as written."""
    fault_proxy.parse_requests = True  # before the mount: every connection is parsed
    m = mount_factory("--commit-delay", "0", endpoint_url=fault_proxy.endpoint_url)
    assert m.probed()["checksums"] == SENDFILE
    fault_proxy.corrupt_body(INDEX_FOLDER)
    (m.path / "ck").mkdir()
    data = os.urandom(100_000)
    (m.path / "ck" / "a.bin").write_bytes(data)
    assert m.flush().returncode == 0, m.log_tail()
    fault_proxy.corrupt_body(MANIFEST_NAME)
    done = cli("commit", str(m.path), "ck")
    assert done.returncode == 0, done.stderr + m.log_tail()

    deadline = time.monotonic() + 20  # (the index goes up after the flush, in its own time)
    while len(fault_proxy.corrupted) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sorted(INDEX_FOLDER in t for t in fault_proxy.corrupted) == [False, True], \
        fault_proxy.corrupted
    assert any(t.split("?")[0].endswith(MANIFEST_NAME) for t in fault_proxy.corrupted)
    assert m.log_tail(400).count("do not match their checksum") >= 2, m.log_tail(400)
    got = s3.get(f"ck/{MANIFEST_NAME}")
    assert got is not None
    manifest = json.loads(got[1])
    assert [(f["key"], f["checksum"]["value"]) for f in manifest["files"]] == \
        [("a.bin", encode_crc(crc32c.crc32c(data)))]
    head = s3.head(f"ck/{MANIFEST_NAME}", checksum=True)
    assert head is not None and head.crc32c == encode_crc(crc32c.crc32c(got[1])), head
    indexes = [o.key for o in s3.list_recursive(INDEX_FOLDER)]
    assert indexes, "no attribute index was written"
    for key in indexes:
        body = s3.get(key)
        assert body is not None and json.loads(body[1]), key  # whole, parseable
        head = s3.head(key, checksum=True)
        assert head is not None and head.crc32c == encode_crc(crc32c.crc32c(body[1])), key


def test_parts_declare_a_checksum_only_in_an_upload_created_with_one(auth_setup) -> None:
    """An upload that copies unchanged parts from the file's committed object is created
    without a checksum type (S3 keeps a whole-object CRC only if every part has one). AWS
    refuses a part's checksum in such an upload ("Checksum Type mismatch"), for ever, so
    its UploadParts must declare none; SeaweedFS accepts either, so the test reads the
    requests themselves at the proxy."""
    m, fault_proxy, s3, _ = auth_setup
    m.probed()
    data = bytearray(os.urandom(24 * MiB + 5))
    (m.path / "model.bin").write_bytes(data)
    assert m.flush().returncode == 0, m.log_tail()

    def requests_since(mark: int) -> list[tuple[str, str, frozenset[str]]]:
        return [(method, target, names) for (method, target), names in zip(
            fault_proxy.requests_log[mark:], fault_proxy.requests_headers[mark:],
            strict=True)]

    def parts(requests):  # (UploadPart, UploadPartCopy) of the file
        sent = [names for method, target, names in requests
                if method == "PUT" and "partNumber=" in target and "model.bin" in target]
        return ([n for n in sent if "x-amz-copy-source" not in n],
                [n for n in sent if "x-amz-copy-source" in n])

    first, _ = parts(requests_since(0))
    assert first and all({"x-amz-trailer", "x-amz-checksum-crc32c"} & n for n in first)

    mark = len(fault_proxy.requests_log)
    with open(m.path / "model.bin", "r+b") as f:  # a new version over a committed one
        f.seek(9 * MiB)
        f.write(b"\x01" * MiB)
    data[9 * MiB:10 * MiB] = b"\x01" * MiB
    assert m.flush().returncode == 0, m.log_tail()
    later = requests_since(mark)
    [create] = [names for method, target, names in later
                if method == "POST" and target.endswith("?uploads")]
    assert "x-amz-checksum-algorithm" not in create, create
    sent, _ = parts(later)  # (a passthrough writer's file goes up whole: no copies)
    assert sent, later
    assert not any({"x-amz-trailer", "x-amz-checksum-crc32c"} & n for n in sent), sent
    got = s3.get("model.bin")
    assert got is not None and got[1] == bytes(data)

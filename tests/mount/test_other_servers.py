"""The end-to-end core against S3 servers other than SeaweedFS (issue 49, item 4): `rclone
serve s3` over a local directory and moto's standalone server, each a real HTTP server in
a process of its own (tests/servers.py). What differs between them, and what the mount does
about it, is docs/compatibility.md; each test below says what it holds the server to."""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import crc32c
import pytest

from lakefs_mount.publish.manifest import MANIFEST_NAME, encode_crc
from tests.faultproxy import FaultProxy
from tests.mounting import Mount, cli, mount_maker, write_fsync
from tests.servers import OtherServer, other_server  # noqa: F401 (the fixture)

MiB = 1024 * 1024
RESERVED = ".lakefs-mount/"  # the mount's own keys (probes, attribute indexes, sidecars)

# What the mount's checksum probe finds (status "checksums"): neither server rejects a
# PutObject whose x-amz-checksum-crc32c is wrong, so neither checks the CRC the mount sends.
CHECKSUMS = {"rclone": "crc32c (not verified by this endpoint)",
             "moto": "crc32c (not verified by this endpoint)"}
# Whether HEAD with x-amz-checksum-mode: ENABLED returns a CRC-32C for an object of a single
# PutObject: rclone keeps the x-amz-checksum-crc32c it was sent (unchecked), moto none.
PUT_CRC_RETURNED = {"rclone": True, "moto": False}
# Whether the server keeps a directory marker (a key ending in "/") as such. rclone serve s3
# over a directory stores PutObject "d/" as a plain file "d" (then nothing can go below
# d/: InternalError), or fails it with InternalError when d/ already holds files.
KEEPS_MARKERS = {"rclone": False, "moto": True}
# Whether UploadPartCopy copies: rclone serve s3 answers it 200 with no ETag and records a
# part of 0 bytes (the Complete then fails with InvalidPart).
COPIES_PARTS = {"rclone": False, "moto": True}


@pytest.fixture
def server(other_server: OtherServer, monkeypatch: pytest.MonkeyPatch) -> OtherServer:  # noqa: F811
    """The module's server; this test and the mounts it starts sign with its keys."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", other_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", other_server.secret_key)
    if not other_server.running:
        pytest.fail(f"{other_server.name} died: {other_server.log_tail()}")
    return other_server


@pytest.fixture
def bucket(server: OtherServer) -> str:
    name = f"t-{uuid.uuid4().hex[:16]}"
    server.create_bucket(name)
    return name


@pytest.fixture
def mounts(server: OtherServer, bucket: str, tmp_path: Path) -> Iterator:
    """`mounts(*options, endpoint_url=...)`: started Mounts of the bucket, always cleaned up."""
    with mount_maker(tmp_path, bucket, server.endpoint_url) as make:
        yield make


@pytest.fixture
def proxy(server: OtherServer) -> Iterator[FaultProxy]:
    with FaultProxy("127.0.0.1", server.port) as p:
        yield p


def _get(server: OtherServer, bucket: str, key: str) -> bytes:
    return server.client().get_object(Bucket=bucket, Key=key)["Body"].read()


def _keys(server: OtherServer, bucket: str) -> list[str]:
    """Every key of the bucket but the mount's own, by ListObjectsV2 without a delimiter."""
    keys: list[str] = []
    for page in server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys.extend(o["Key"] for o in page.get("Contents", []))
    return sorted(k for k in keys if not k.startswith(RESERVED))


def _files(server: OtherServer, bucket: str) -> list[str]:
    """The keys that are no directory markers (nor the seeds of _seed_dirs)."""
    return [k for k in _keys(server, bucket) if not k.endswith("/") and
            not k.endswith("/" + SEED)]


SEED = "seed.txt"  # an object that makes its folder a directory without a marker


def _seed_dirs(server: OtherServer, bucket: str, paths) -> None:
    """Where the server cannot keep directory markers, the folders of `paths` are made in
    S3 as another tool would (an object in each); the mount then never writes a marker
    for them. Where it can, nothing: the mount's mkdir writes the markers."""
    if KEEPS_MARKERS[server.name]:
        return
    folders = {str(Path(p).parent) for p in paths} - {"."}
    for folder in sorted(folders):
        server.client().put_object(Bucket=bucket, Key=f"{folder}/{SEED}", Body=b"seed")


def _flushed(m: Mount, *args: str) -> None:
    done = m.flush(*args, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr + m.log_tail()


def test_small_files_and_a_multipart_file_land_byte_identical(server, bucket, mounts):
    """Small files (one PutObject each) and a 21 MiB file (three 8 MiB parts), flushed:
    flush exits 0 and boto3 reads exactly those bytes back from the server."""
    m = mounts("--part-size", "8M")
    files = {f"small-{i}.txt": random.randbytes(size)
             for i, size in enumerate((0, 1, 4096, 300_001))}
    files["big.bin"] = random.randbytes(21 * MiB + 17)
    for name, data in files.items():
        (m.path / name).write_bytes(data)
    _flushed(m)
    for name, data in files.items():
        assert _get(server, bucket, name) == data, name
    assert _keys(server, bucket) == sorted(files)
    assert (m.path / "big.bin").read_bytes() == files["big.bin"]


def test_kill9_mid_upload_then_remount_lands_every_acknowledged_byte(server, bucket,
                                                                     mounts, proxy):
    """Uploads crawl through a throttled proxy; the daemon is killed -9 while they are
    under way; a mount with the same cache directory uploads every fsync'ed byte."""
    files = {"ckpt/model.bin": random.randbytes(20 * MiB + 123),
             "ckpt/meta.json": b'{"step": 100}\n', "ckpt/opt.bin": random.randbytes(500_000)}
    _seed_dirs(server, bucket, files)
    m = mounts("--part-size", "8M", endpoint_url=proxy.endpoint_url)
    proxy.bandwidth_bytes_per_s = 2 * MiB
    for name, data in files.items():
        write_fsync(m.path / name, data)
    deadline = time.monotonic() + 30
    while m.status()["s3_in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert m.status()["s3_in_flight"] > 0, "nothing was under way to be killed"
    m.kill9()
    proxy.bandwidth_bytes_per_s = None
    m.start()
    _flushed(m)
    for name, data in files.items():
        assert _get(server, bucket, name) == data, name
    assert _files(server, bucket) == sorted(files)


def _parts(requests: list[tuple[str, str]], key: str) -> list[tuple[str, int]]:
    """(upload id, part number) of each UploadPart of `key` among logged requests."""
    found = []
    for method, target in requests:
        path, _, query = target.partition("?")
        if method == "PUT" and path.endswith("/" + key) and "partNumber=" in query:
            args = dict(a.split("=", 1) for a in query.split("&"))
            found.append((args["uploadId"], int(args["partNumber"])))
    return found


def test_kill9_after_parts_went_up_resumes_the_multipart_upload(server, bucket, mounts,
                                                               proxy):
    """A 40 MiB file held open streams 8 MiB parts; kill -9 once two are in S3; the remount
    finds the upload (ListParts), keeps the parts it had recorded and sends only the others
    in the same upload, and the object is right. (The pyfuse3 session: with passthrough a
    crash makes every chunk dirty again, durability.md D21, and all parts go again.)"""
    proxy.parse_requests = True  # every connection parsed: the proxy logs each request
    m = mounts("--part-size", "8M", "--fuse-session", "pyfuse3",
               endpoint_url=proxy.endpoint_url)
    data = random.randbytes(40 * MiB)
    fd = os.open(m.path / "resume.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)  # held open: parts stream, the object is not completed
        os.fsync(fd)
        deadline = time.monotonic() + 60
        while m.counters().get("parts_uploaded", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert m.counters().get("parts_uploaded", 0) >= 2, m.log_tail()
        m.kill9()
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)  # the daemon is gone: close can only fail
    assert "resume.bin" not in _keys(server, bucket)
    time.sleep(1.0)  # (requests the proxy read before the kill are logged as forwarded)
    mark = len(proxy.requests_log)
    before = _parts(proxy.requests_log, "resume.bin")
    m.start()
    _flushed(m)
    assert _get(server, bucket, "resume.bin") == data
    log = m.log_tail(2000)
    kept = int(log.split(" uploaded part(s)", 1)[0].rsplit("kept ", 1)[1])
    assert kept >= 2, log
    after = _parts(proxy.requests_log[mark:], "resume.bin")
    assert {upload for upload, _ in after} == {before[0][0]}, (before, after)  # resumed
    assert len(after) == 5 - kept, (before, after)  # only the parts not yet in S3
    assert not server.client().list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_checksums_as_negotiated_and_as_the_server_reports_them(server, bucket, mounts):
    """Neither server rejects a wrong x-amz-checksum-crc32c, so the mount says its CRCs are
    not verified and creates multipart uploads without a checksum type; the CRC-32C the
    server returns for an object (HEAD, checksum mode on) is the object's where it
    returns one at all."""
    m = mounts("--part-size", "8M")
    status = m.probed()
    assert status["checksums"] == CHECKSUMS[server.name], status["checksums"]
    small, big = random.randbytes(100_000), random.randbytes(17 * MiB + 5)
    (m.path / "small.bin").write_bytes(small)
    (m.path / "big.bin").write_bytes(big)
    _flushed(m)
    client = server.client()
    head = client.head_object(Bucket=bucket, Key="small.bin", ChecksumMode="ENABLED")
    if PUT_CRC_RETURNED[server.name]:
        assert head.get("ChecksumCRC32C") == encode_crc(crc32c.crc32c(small)), head
    else:
        assert "ChecksumCRC32C" not in head, head
    head = client.head_object(Bucket=bucket, Key="big.bin", ChecksumMode="ENABLED")
    assert "ChecksumCRC32C" not in head, head  # (an upload created without a checksum)
    assert _get(server, bucket, "big.bin") == big
    assert (m.path / "small.bin").read_bytes() == small  # (a GET checked against it)


def _tree(root: Path) -> tuple[set[str], set[str]]:
    """(files, directories) under root, as relative paths."""
    files, dirs = set(), set()
    for top, dirnames, filenames in os.walk(root):
        rel = Path(top).relative_to(root)
        dirs.update(str(rel / d) for d in dirnames)
        files.update(str(rel / f) for f in filenames)
    return files, dirs


def test_namespace_changes_leave_the_keys_the_mount_shows(server, bucket, mounts):
    """Rename of a file, unlink (and mkdir, rmdir, rename of a directory where the server
    keeps markers: a renamed directory gets a marker): after a flush the bucket holds a
    key per file the mount shows, a directory the mount shows has a key in or below it,
    and nothing is left of the old names."""
    written = {"a/f1": b"one", "a/f2": b"two", "a/sub/x": b"x" * 1000}
    _seed_dirs(server, bucket, written)
    m = mounts()
    root = m.path
    for rel, data in written.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    markers = KEEPS_MARKERS[server.name]
    if markers:
        (root / "gone").mkdir()
    _flushed(m)
    (root / "a" / "f1").rename(root / "a" / "g1")
    (root / "a" / "f2").unlink()
    sub = "a/sub"
    if markers:
        (root / "a" / "sub").rename(root / "b")
        sub = "b"
        (root / "gone").rmdir()
        (root / "empty").mkdir()
    _flushed(m)
    files, dirs = _tree(root)
    seeds = set() if markers else {"a/" + SEED, "a/sub/" + SEED}
    assert files == {"a/g1", f"{sub}/x"} | seeds
    assert dirs == ({"a", "b", "empty"} if markers else {"a", "a/sub"})
    keys = _keys(server, bucket)
    assert {k for k in keys if not k.endswith("/")} == files, keys
    for d in dirs:
        assert any(k.startswith(d + "/") for k in keys), (d, keys)
    gone = ("gone", "a/sub", "a/f1", "a/f2") if markers else ("a/f1", "a/f2")
    assert not any(k.startswith(gone) for k in keys), keys
    assert _get(server, bucket, f"{sub}/x") == b"x" * 1000
    assert _get(server, bucket, "a/g1") == b"one"


def test_mkdir_where_the_server_keeps_markers_and_where_it_cannot(server, bucket, mounts):
    """mkdir writes the marker "d/". moto keeps it (an empty directory survives a remount,
    a file in it lands below it). rclone serve s3 stores it as a plain file "d", so
    nothing can go below d/ any more: the file's upload fails with InternalError and the
    flush exits 1 saying so, never 0 (docs/compatibility.md)."""
    m = mounts()
    (m.path / "d").mkdir()
    (m.path / "empty").mkdir()
    (m.path / "d" / "f").write_bytes(b"in d")
    done = m.flush("--timeout", "60", timeout=120)
    keys = _keys(server, bucket)
    if KEEPS_MARKERS[server.name]:
        assert done.returncode == 0, done.stderr + m.log_tail()
        assert {"d/", "d/f", "empty/"} <= set(keys), keys
        assert _get(server, bucket, "d/f") == b"in d"
        assert m.unmount().returncode == 0
        m.start()
        assert (m.path / "empty").is_dir() and (m.path / "d" / "f").read_bytes() == b"in d"
        return
    assert done.returncode != 0, done.stdout + done.stderr
    assert "InternalError" in done.stderr, done.stderr
    assert "d/f" not in keys and "d" in keys, keys  # the marker became a file
    assert server.client().head_object(Bucket=bucket, Key="d")["ContentLength"] == 0


def test_a_directory_rename_lands_or_fails_for_its_marker(server, bucket, mounts):
    """Renaming a directory copies its objects and gives the new name a marker. On moto
    it lands (b/ and b/x, nothing under a/). On rclone
    serve s3 the marker's PutObject "b/" fails with InternalError once b/ holds files, for
    ever: the flush exits 1 and names the move. The copied bytes are in rclone's directory;
    (rclone's own listing then shows a 0-byte "b" and hides b/x until its directory cache
    expires: docs/compatibility.md)."""
    _seed_dirs(server, bucket, ["a/x"])
    m = mounts()
    (m.path / "a").mkdir(exist_ok=True)
    (m.path / "a" / "x").write_bytes(b"x")
    _flushed(m)
    (m.path / "a").rename(m.path / "b")
    done = m.flush("--timeout", "30", timeout=120)
    if KEEPS_MARKERS[server.name]:
        assert done.returncode == 0, done.stderr + m.log_tail()
        assert _keys(server, bucket) == ["b/", "b/x"]
        assert _get(server, bucket, "b/x") == b"x"
        return
    assert done.returncode != 0, done.stdout + done.stderr
    assert "move a/ -> b/" in done.stderr and "InternalError" in done.stderr, done.stderr
    assert server.data_dir is not None
    assert (server.data_dir / bucket / "b" / "x").read_bytes() == b"x"


def test_commit_then_verify_by_s3_url(server, bucket, mounts):
    """`commit MOUNT DIR` writes the manifest with each file's CRC-32C; `verify
    s3://bucket/DIR/` against the server itself exits 0, reading the bytes back where the
    server returns no CRC-32C."""
    files = {"model.bin": random.randbytes(20 * MiB + 5), "config.json": b'{"a": 1}\n'}
    _seed_dirs(server, bucket, [f"ck/{name}" for name in files])
    if not KEEPS_MARKERS[server.name]:
        files[SEED] = b"seed"  # (another node's file: in the manifest too)
    m = mounts("--part-size", "8M")
    for name, data in files.items():
        write_fsync(m.path / "ck" / name, data)
    done = cli("commit", str(m.path), "ck")
    assert done.returncode == 0, done.stdout + done.stderr + m.log_tail()
    manifest = json.loads(_get(server, bucket, f"ck/{MANIFEST_NAME}"))
    assert {f["key"]: f["checksum"]["value"] for f in manifest["files"]} == \
        {k: encode_crc(crc32c.crc32c(v)) for k, v in files.items()}
    proc = cli("verify", "--json", f"s3://{bucket}/ck/", "--endpoint-url",
               server.endpoint_url)
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["ok"], proc.stdout + proc.stderr
    assert report["files"] == len(files), report
    # verify trusts a CRC-32C the server returns: rclone's for each single PutObject (the
    # one the mount declared, which rclone stores unchecked), moto's for none; the rest
    # is read back and hashed
    single = sum(len(data) < 8 * MiB for data in files.values())
    assert report["checked_by_s3"] == (single if PUT_CRC_RETURNED[server.name] else 0), report


def test_one_part_of_a_large_file_in_s3_rewritten(server, bucket, mounts):
    """A 20 MiB object the mount never cached, 10 bytes of its last part rewritten: the
    commit copies the unchanged parts server-side (UploadPartCopy) where the server can.
    rclone serve s3 cannot (200 without an ETag): the mount says so once in its log, then
    fetches the unchanged parts and sends them. Either way the object ends with exactly
    the new bytes."""
    data = bytearray(random.randbytes(20 * MiB + 99))
    server.client().put_object(Bucket=bucket, Key="big.bin", Body=bytes(data))
    m = mounts("--part-size", "8M")
    with open(m.path / "big.bin", "r+b") as f:
        f.seek(17 * MiB)
        f.write(b"0123456789")
    data[17 * MiB:17 * MiB + 10] = b"0123456789"
    _flushed(m)
    assert _get(server, bucket, "big.bin") == bytes(data)
    copied = m.counters().get("parts_copied", 0)
    if COPIES_PARTS[server.name]:
        assert copied == 2, m.counters()
    else:
        assert copied == 0, m.counters()
        assert "does not copy parts (UploadPartCopy)" in m.log_tail(300)

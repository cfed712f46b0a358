"""Crash guarantees through a real mount: rows of docs/durability.md proven end to end."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

MiB = 1024 * 1024
pytestmark = pytest.mark.parametrize("fuse_session", ["native", "pyfuse3"], indirect=True)


def _write_fsync(path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def test_kill9_with_s3_down_then_remount_uploads_everything(mount_factory, s3, fault_proxy):
    """D1: acknowledged writes survive a daemon crash; the next mount uploads them."""
    m = mount_factory("--part-size", "8M", endpoint_url=fault_proxy.endpoint_url)
    big = random.randbytes(30 * MiB + 123)
    small = b"tiny file\n"
    (m.path / "ckpt").mkdir()
    fault_proxy.fail = True  # nothing can reach S3 before the crash
    _write_fsync(m.path / "ckpt" / "model.bin", big)
    _write_fsync(m.path / "ckpt" / "meta.json", small)
    m.kill9()
    assert s3.head("ckpt/model.bin") is None
    fault_proxy.fail = False
    m.start()
    assert m.counters().get("recovered_files", 0) == 2
    assert m.flush().returncode == 0
    assert s3.get_range("ckpt/model.bin", 0, len(big) + 1) == big
    assert s3.get_range("ckpt/meta.json", 0, 100) == small
    assert (m.path / "ckpt" / "model.bin").read_bytes() == big


def test_kill9_after_parts_uploaded_resumes_the_multipart_upload(mount_factory, s3):
    """D3: parts recorded as uploaded are kept (ListParts) and only the rest is sent."""
    m = mount_factory("--part-size", "8M")
    data = random.randbytes(40 * MiB)
    fd = os.open(m.path / "resume.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, data)  # held open: streamed parts go up, the object is not completed
    os.fsync(fd)
    deadline = time.monotonic() + 30
    while m.counters().get("parts_uploaded", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    m.kill9()
    with contextlib.suppress(OSError):
        os.close(fd)  # the daemon is gone: close can only fail
    assert s3.head("resume.bin") is None
    m.start()
    assert m.flush().returncode == 0
    assert hashlib.sha256(s3.get_range("resume.bin", 0, len(data))).digest() == \
        hashlib.sha256(data).digest()
    assert not s3.list_multipart_uploads("")  # nothing left open after completion


def test_parallel_writers_land_byte_identical_in_s3(mount, s3):
    """8 writers x 256 MiB through the mount, then flush: 8 identical objects."""
    size = 256 * MiB
    block = 1 * MiB

    def write(i: int) -> str:
        rnd = random.Random(i)
        digest = hashlib.sha256()
        with open(mount.path / f"rank{i}.bin", "wb") as f:
            for _ in range(size // block):
                buf = rnd.randbytes(block)
                digest.update(buf)
                f.write(buf)
        return digest.hexdigest()

    with ThreadPoolExecutor(8) as pool:
        expected = list(pool.map(write, range(8)))
    assert mount.flush().returncode == 0
    for i, want in enumerate(expected):
        info = s3.head(f"rank{i}.bin")
        assert info is not None and info.size == size
        got = hashlib.sha256()
        for off in range(0, size, 64 * MiB):
            got.update(s3.get_range(f"rank{i}.bin", off, off + 64 * MiB))
        assert got.hexdigest() == want


def test_a_file_rewritten_while_its_commit_runs_ends_with_the_new_bytes(mount_factory, s3,
                                                                        fault_proxy):
    """O_TRUNC and new writes while the multipart commit of the old content is under way:
    the mount stays responsive and S3 ends with exactly the new content (this once hung
    the daemon's event loop)."""
    m = mount_factory("--part-size", "8M", "--commit-delay", "0",
                      endpoint_url=fault_proxy.endpoint_url)
    path = m.path / "rewritten.bin"
    fault_proxy.bandwidth_bytes_per_s = 4 * MiB  # keep the first commit in flight
    path.write_bytes(random.randbytes(27 * MiB))  # (passthrough: done before any upload)
    deadline = time.monotonic() + 30
    while m.status()["files_committing"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert m.status()["files_committing"] == 1
    new = random.randbytes(10 * MiB + 7)
    path.write_bytes(new)
    fault_proxy.bandwidth_bytes_per_s = None
    assert m.flush(timeout=120).returncode == 0
    assert s3.get_range("rewritten.bin", 0, 64 * MiB) == new
    assert path.read_bytes() == new

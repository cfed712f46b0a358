"""The shortest end-to-end promise, once per I/O engine: write, flush, the object is in S3."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.parametrize("io_engine", ["uring", "threads"], indirect=True)


def test_file_written_through_mount_is_in_s3_after_flush(mount, s3, io_engine):
    (mount.path / "hello.txt").write_bytes(b"hello world")
    assert mount.flush().returncode == 0
    assert s3.get_range("hello.txt", 0, 100) == b"hello world"
    assert mount.status()["io_engine"] == io_engine

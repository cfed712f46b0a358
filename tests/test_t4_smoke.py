"""The shortest end-to-end promise: write through the mount, flush, the object is in S3."""

from __future__ import annotations


def test_file_written_through_mount_is_in_s3_after_flush(mount, s3):
    (mount.path / "hello.txt").write_bytes(b"hello world")
    assert mount.flush().returncode == 0
    assert s3.get_range("hello.txt", 0, 100) == b"hello world"

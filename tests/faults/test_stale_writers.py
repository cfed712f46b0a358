"""A descriptor that outlives its daemon (issue 50, item 2; docs/durability.md, D28): a
process holding a file open through FUSE passthrough keeps writing the cache file after
kill -9 of the daemon and `fusermount3 -uz`, through the kernel, and each write returns
success. The next mount of the cache directory finds the file still open for writing,
watches it like a passthrough writer of its own, and every such write reaches S3 by the
next flush; once the process closes it, the file is an ordinary one again."""

from __future__ import annotations

import os
import time

import pytest

MiB = 1024 * 1024
pytestmark = pytest.mark.parametrize("fuse_session", ["native"], indirect=True)


def _settled(m, timeout: float = 15.0) -> dict:
    """The status once nothing is pending and no stale writer is counted."""
    deadline = time.monotonic() + timeout
    while True:
        status = m.status()
        if not status.get("stale_writers") and status["files_pending"] == 0:
            return status
        assert time.monotonic() < deadline, {k: status.get(k) for k in (
            "stale_writers", "files_pending", "last_error")}
        time.sleep(0.2)


def test_writes_through_a_descriptor_that_outlived_its_daemon_reach_s3(mount_factory, s3):
    m = mount_factory("--commit-delay", "0")
    assert m.status()["passthrough"] is True
    first = os.urandom(4 * MiB)
    fd = os.open(m.path / "f.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert os.write(fd, first) == len(first)
        os.fsync(fd)
        assert m.counters()["passthrough_opens"] >= 1
        m.kill9()  # and fusermount3 -uz, as an operator (or systemd) would
        m.start()  # the same cache directory: recovery
        status = m.status()
        assert status["stale_writers"] == 1
        assert "still open for writing by a process of the crashed daemon" in m.log_tail(200)

        later = os.urandom(MiB)
        assert os.pwrite(fd, later, 5 * MiB) == MiB  # the old descriptor: the kernel writes
        assert m.flush().returncode == 0
        expected = first + bytes(MiB) + later
        assert s3.get_range("f.bin", 0, 8 * MiB) == expected
        assert (m.path / "f.bin").read_bytes() == expected  # the new mount shows the same

        tail = os.urandom(1000)
        assert os.pwrite(fd, tail, len(expected)) == len(tail)  # past the end: it grows
        expected += tail
        assert m.flush().returncode == 0
        assert s3.get_range("f.bin", 0, 8 * MiB) == expected
        assert (m.path / "f.bin").stat().st_size == len(expected)
    finally:
        os.close(fd)
    _settled(m)  # its last descriptor closed: an ordinary file, nothing pending
    assert "is closed" in m.log_tail(200)
    assert m.unmount().returncode == 0
    assert s3.get_range("f.bin", 0, 8 * MiB) == expected

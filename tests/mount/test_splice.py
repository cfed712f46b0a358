"""Spliced FUSE I/O: write requests under pyfuse3 (lakefs_mount/fuse/splice.py) and read replies
under the native session (lakefs_mount/fuse/native/splicereply.py). `status` and the log say
whether this machine allows them, the daemon does what they say, and the data is right
either way. fs.pipe-max-size is set for each case and restored afterwards."""

from __future__ import annotations

import fcntl
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lakefs_mount.fuse.splice import PIPE_BYTES_NEEDED, PIPE_MAX_SIZE

# fs.pipe-max-size is the machine's: one test at a time (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("machine")

MiB = 1 << 20
CAP_SYS_RESOURCE = 24


def _has_cap_sys_resource() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1)
    return False


def _pipe_sizes(pid: int) -> set[int]:
    """Sizes of the pipes process `pid` holds (opened anew through /proc)."""
    sizes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for entry in fd_dir.iterdir():
        if os.readlink(entry).startswith("pipe:"):
            fd = os.open(entry, os.O_RDONLY | os.O_NONBLOCK)
            try:
                sizes.add(fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ))
            finally:
                os.close(fd)
    return sizes


@pytest.fixture
def pipe_max_size() -> Iterator[Callable[[int], None]]:
    old = PIPE_MAX_SIZE.read_text()
    try:
        yield lambda n: PIPE_MAX_SIZE.write_text(f"{n}\n")
    finally:
        PIPE_MAX_SIZE.write_text(old)


@pytest.mark.parametrize("limit", [MiB, PIPE_BYTES_NEEDED])
def test_status_says_whether_writes_are_spliced_and_data_lands_either_way(
        mount_factory, s3, pipe_max_size, limit):
    pipe_max_size(limit)
    m = mount_factory("--fuse-session", "pyfuse3")  # libfuse's; the native session reads
    # requests into buffers of its own
    spliced = m.status()["splice_writes"]
    assert spliced == (limit >= PIPE_BYTES_NEEDED or _has_cap_sys_resource())
    assert ("fs.pipe-max-size" in m.log_file.read_text()) == (not spliced)

    data = random.randbytes(3 * MiB + 5)
    with open(m.path / "ckpt", "wb", buffering=0) as f:
        for off in range(0, len(data), MiB):
            f.write(data[off:off + MiB])
    assert m.pid is not None
    assert (PIPE_BYTES_NEEDED in _pipe_sizes(m.pid)) == spliced  # libfuse's own pipe
    assert m.flush().returncode == 0
    assert s3.get_range("ckpt", 0, len(data) + 1) == data


@pytest.mark.parametrize("limit", [MiB, PIPE_BYTES_NEEDED])
def test_cold_reads_are_spliced_where_a_pipe_holds_a_reply_and_right_either_way(
        mount_factory, s3, pipe_max_size, limit):
    pipe_max_size(limit)  # a 1 MiB read's reply needs a 2 MiB pipe (its header's page)
    data = random.randbytes(20 * MiB + 12345)
    s3.put("cold.bin", data, {})
    m = mount_factory("--fuse-session", "native")
    spliced = limit >= PIPE_BYTES_NEEDED or _has_cap_sys_resource()
    assert m.status()["spliced_reads"] is spliced
    assert ("read replies are copied" in m.log_file.read_text()) == (not spliced)

    with open(m.path / "cold.bin", "rb", buffering=0) as f:
        got = b"".join(iter(lambda: f.read(MiB), b""))
        assert got == data
        for _ in range(10):  # again from the cache, the kernel's copy dropped each time
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            off, n = random.randrange(len(data)), random.randrange(1, 3 * MiB)
            assert os.pread(f.fileno(), n, off) == data[off:off + n]
    counters = m.counters()
    assert counters["read_requests"] >= 20
    if spliced:  # every read of chunks just fetched (the cold pass) went by splice
        assert counters["spliced_reads"] >= 20
    else:
        assert "spliced_reads" not in counters

"""Spliced write requests (lakefs_mount/splice.py): `status` and the log say whether libfuse
can splice them on this machine, libfuse does what they say, and the data is right either
way. fs.pipe-max-size is set for each case and restored afterwards."""

from __future__ import annotations

import fcntl
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lakefs_mount.splice import PIPE_BYTES_NEEDED, PIPE_MAX_SIZE

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

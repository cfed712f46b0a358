"""A full cache disk never loses acknowledged data: evict clean, wait for uploads, ENOSPC last."""

from __future__ import annotations

import errno
import os
import random
import subprocess

import pytest
from mounting import cli

MiB = 1024 * 1024


@pytest.fixture
def tiny_cache_mount(mount_factory):
    """A mount whose cache directory is a 48 MiB tmpfs."""
    m = mount_factory("--part-size", "8M", "--max-dirty", "16M", "--cache-size", "1G",
                      start=False)
    m.cache_dir.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m,mode=0700", "tmpfs",
                    str(m.cache_dir)], check=True)
    try:
        m.start()
        yield m
    finally:
        m.cleanup()
        subprocess.run(["umount", "-l", str(m.cache_dir)], check=False)


def test_many_closed_files_larger_than_the_cache_disk_all_reach_s3(tiny_cache_mount, s3):
    m = tiny_cache_mount
    files = {f"f{i}.bin": random.randbytes(8 * MiB - 1000) for i in range(14)}  # ~112 MiB
    for name, data in files.items():
        (m.path / name).write_bytes(data)
    assert m.flush().returncode == 0
    for name, data in files.items():
        assert s3.get_range(name, 0, len(data) + 1) == data
    assert os.statvfs(m.cache_dir).f_bfree > 0


def test_one_file_larger_than_the_cache_disk_gets_enospc_and_keeps_what_was_written(
        tiny_cache_mount, s3):
    m = tiny_cache_mount
    block = random.randbytes(MiB)
    written = 0
    fd = os.open(m.path / "huge.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with pytest.raises(OSError) as err:
            for _ in range(200):  # a write may be short just before the disk is full
                written += os.write(fd, block)
        assert err.value.errno == errno.ENOSPC
    finally:
        os.close(fd)
    assert written >= 16 * MiB
    assert m.flush().returncode == 0
    info = s3.head("huge.bin")
    assert info is not None and info.size >= written
    assert s3.get_range("huge.bin", 0, written) == (block * (written // MiB + 1))[:written]


def test_a_warm_up_larger_than_the_cache_disk_is_refused_and_one_that_fits_runs(
        tiny_cache_mount, s3):
    m = tiny_cache_mount  # --cache-size 1G on a 48 MiB disk
    for i in range(6):
        s3.put(f"ckpt/{i}.bin", random.randbytes(8 * MiB), {})
    refused = cli("warmup", str(m.path), "ckpt")
    assert refused.returncode == 1
    assert "do not fit on the cache disk" in refused.stderr, refused.stderr
    assert m.counters().get("gets", 0) == 0
    done = cli("warmup", str(m.path), "ckpt/0.bin")
    assert done.returncode == 0, done.stderr
    before = m.counters()["gets"]
    assert (m.path / "ckpt/0.bin").read_bytes() == s3.get_range("ckpt/0.bin", 0, 8 * MiB)
    assert m.counters()["gets"] == before


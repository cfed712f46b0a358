"""pagecache.all_cached: a range is "cached" only if the page cache holds every page of
it, so that a reply spliced from it in the trio loop never waits for the disk."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from lakefs_mount.cache.pagecache import all_cached

MiB = 1 << 20
PAGE = mmap.PAGESIZE


@pytest.fixture
def fd(tmp_path: Path) -> Iterator[int]:
    fd = os.open(tmp_path / "cache-file", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        yield fd
    finally:
        os.close(fd)


def test_bytes_just_written_are_cached_to_the_last_byte(fd):
    os.pwrite(fd, os.urandom(3 * MiB + 10), 0)
    assert all_cached(fd, 0, 3 * MiB + 10)
    assert all_cached(fd, 100, 2 * MiB + 7)  # unaligned ends: the pages they touch


def test_a_range_past_the_end_of_the_file_is_not(fd):
    os.pwrite(fd, bytes(MiB), 0)
    assert not all_cached(fd, 0, MiB + 1)
    assert not all_cached(fd, MiB, MiB + PAGE)


def test_a_hole_is_not(fd):
    os.pwrite(fd, b"x" * MiB, 0)
    os.ftruncate(fd, 4 * MiB)  # [MiB, 4 MiB) a hole: zeros the disk never held
    assert all_cached(fd, 0, MiB)
    assert not all_cached(fd, 2 * MiB, 3 * MiB)


def test_pages_written_back_and_dropped_are_not_until_read_again(fd):
    os.pwrite(fd, os.urandom(MiB), 0)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    assert not all_cached(fd, 0, PAGE)
    os.pread(fd, PAGE, 0)
    assert all_cached(fd, 0, PAGE)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.pread(fd, PAGE, 2 * PAGE)  # readahead may bring a few pages more, not the first
    assert not all_cached(fd, 0, MiB)


def test_an_empty_range_is_never_sent(fd):
    os.pwrite(fd, b"x", 0)
    assert not all_cached(fd, 0, 0)

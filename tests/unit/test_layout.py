"""The fixed offset-to-part mapping and the attribute metadata codec."""

from __future__ import annotations

import os
import stat

import pytest

from lakefs_mount.s3.layout import (
    MAX_PARTS,
    MiB,
    PartMap,
    decode_attrs,
    encode_attrs,
)

TiB = 1024 * 1024 * MiB


@pytest.mark.parametrize("part_mib", [8, 16, 64, 512])
def test_a_5_tib_file_fits_in_s3s_10000_parts_of_at_most_5_gib(part_mib):
    parts = PartMap(part_mib * MiB)
    count = parts.chunk_count(5 * TiB)
    assert count <= MAX_PARTS
    start, end = parts.chunk_range(count - 1)
    assert end - start <= 5 * 1024 * MiB
    assert end >= 5 * TiB


def test_chunks_tile_the_offsets_without_gaps():
    parts = PartMap(16 * MiB)
    prev_end = 0
    for idx in list(range(0, 1010)) + list(range(1990, 2010)):
        start, end = parts.chunk_range(idx)
        if idx in (0, 1990):
            prev_end = start
        assert start == prev_end
        assert parts.chunk_of(start) == idx and parts.chunk_of(end - 1) == idx
        prev_end = end
    assert parts.chunk_range(1000)[1] - parts.chunk_range(1000)[0] == 32 * MiB


def test_first_tier_uses_the_configured_part_size():
    parts = PartMap(16 * MiB)
    assert parts.chunk_range(0) == (0, 16 * MiB)
    assert parts.chunk_of(16 * MiB - 1) == 0 and parts.chunk_of(16 * MiB) == 1
    assert parts.chunk_count(0) == 0 and parts.chunk_count(1) == 1
    assert list(parts.chunks_between(10, 40 * MiB)) == [0, 1, 2]


@pytest.mark.parametrize("bad", [4 * MiB, 8 * MiB + 1, 1024 * MiB])
def test_part_sizes_outside_8m_to_512m_are_refused(bad):
    with pytest.raises(ValueError):
        PartMap(bad)


def test_attributes_roundtrip_through_metadata():
    meta = encode_attrs(stat.S_IFREG | 0o640, 1000, 100, 1_700_000_000_123_456_789)
    attrs = decode_attrs(meta)
    assert (attrs.mode, attrs.uid, attrs.gid) == (stat.S_IFREG | 0o640, 1000, 100)
    assert abs(attrs.mtime_ns - 1_700_000_000_123_456_789) < 1000
    assert not attrs.is_symlink


def test_device_number_travels_only_with_devices():
    meta = encode_attrs(stat.S_IFBLK | 0o660, 0, 6, 1, os.makedev(8, 1))
    assert decode_attrs(meta).rdev == os.makedev(8, 1)
    assert "rdev" not in encode_attrs(stat.S_IFIFO | 0o644, 0, 0, 1)
    assert decode_attrs({"mode": str(stat.S_IFIFO | 0o644), "rdev": "5"}).rdev == 0


def test_a_mode_that_names_a_directory_or_no_known_type_decodes_as_a_regular_file():
    for mode in (stat.S_IFDIR | 0o700, 0o050000 | 0o644):  # 0o05: no file type
        assert decode_attrs({"mode": str(mode)}).mode == stat.S_IFREG | stat.S_IMODE(mode)


def test_foreign_objects_without_metadata_decode_to_defaults():
    attrs = decode_attrs({"mode": "garbage"})
    assert attrs.mode is None and attrs.uid is None and attrs.mtime_ns is None
    assert decode_attrs({"symlink": "1"}).is_symlink

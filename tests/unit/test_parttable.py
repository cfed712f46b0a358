"""The table of a multipart object's part CRCs (s3/parttable): read back as written, never
taken for a table when a byte of it changed, silent where it cannot say."""

from __future__ import annotations

import pytest

from lakefs_mount.s3.objectstore import CorruptRead, ReadCheck
from lakefs_mount.s3.parttable import FOLDER, PartTable, new_table_key

MiB = 1024 * 1024
TABLE = PartTable(20 * MiB + 3, 8 * MiB, (0x1234ABCD, None, 0xFFFFFFFF))


def test_a_table_reads_back_as_written():
    assert PartTable.decode(TABLE.encode(), "t") == TABLE


def test_a_table_with_any_byte_changed_is_refused():
    body = TABLE.encode()
    for at in range(len(body)):
        damaged = body[:at] + bytes([body[at] ^ 0x01]) + body[at + 1:]
        with pytest.raises(CorruptRead):
            PartTable.decode(damaged, "t")
    for other in (b"", b"{}\n0\n", b"<Error/>", body[:-4]):
        with pytest.raises(CorruptRead):
            PartTable.decode(other, "t")


def test_a_table_says_nothing_for_another_size_part_size_or_part():
    assert TABLE.crc_of(0, TABLE.size, 8 * MiB) == 0x1234ABCD
    assert TABLE.crc_of(1, TABLE.size, 8 * MiB) is None  # copied server-side: not known
    assert TABLE.crc_of(0, TABLE.size + 1, 8 * MiB) is None
    assert TABLE.crc_of(0, TABLE.size, 16 * MiB) is None
    assert TABLE.crc_of(3, TABLE.size, 8 * MiB) is None


def test_every_table_gets_a_key_of_its_own_under_the_mounts_prefix():
    keys = {new_table_key("ckpt/") for _ in range(100)}
    assert len(keys) == 100 and all(k.startswith("ckpt/" + FOLDER) for k in keys)


def test_a_read_check_passes_matching_bytes_and_refuses_others():
    check = ReadCheck("GET k", 0xE3069283)  # CRC-32C of b"123456789"
    for piece in (b"1234", b"56789"):
        check.add(piece)
    assert check.done()
    assert not ReadCheck("GET k", None).done()  # nothing to check against
    bad = ReadCheck("GET k", 0xE3069283)
    bad.add(b"123456788")
    with pytest.raises(CorruptRead, match="e3069283"):
        bad.done()

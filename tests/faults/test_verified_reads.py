"""Verified reads (issue 50, item 1): every byte fetched from S3 is checked against its
CRC-32C before it is served, cached or uploaded again. A proxy flips one bit in the body
of GETs on their way back; the mount retries, then answers EIO, counts the mismatches in
status, keeps nothing of them, and S3 never receives a flipped byte in a later upload.

What the bytes are checked against: a whole object, the CRC-32C S3 keeps for it (sent with
a GET of the whole object); a part of a multipart object the mount wrote, the table of its
parts' CRCs that the object's metadata names, which travels with it through renames."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lakefs_mount.s3.crc import crc32c_of
from lakefs_mount.s3.layout import META_PARTS
from lakefs_mount.s3.parttable import FOLDER
from tests.faultproxy import FaultProxy, key_of
from tests.reliability import Row

MiB = 1024 * 1024
PART = ("--part-size", "8M", "--commit-delay", "0")
FILES = {"ckpt/small.bin": 1 * MiB, "ckpt/mid.bin": 40 * MiB, "ckpt/large.bin": 100 * MiB}


class Corrupter:
    """Which GETs the proxy damages, changeable while connections stay open."""

    def __init__(self) -> None:
        self.keys: Callable[[str], bool] = lambda key: False

    def __call__(self, method: str, target: str) -> bool:
        return "list-type=" not in target and self.keys(key_of(target))


@pytest.fixture
def corrupting(s3_server) -> Iterator[tuple[FaultProxy, Corrupter]]:
    corrupter = Corrupter()
    with FaultProxy("127.0.0.1", s3_server.port) as proxy:
        proxy.parse_requests = proxy.parse_responses = True  # before any mount
        proxy.corrupt_responses(corrupter)
        yield proxy, corrupter


def _committed(mount_factory, files: dict[str, bytes]) -> None:
    """The files written through a mount and in S3 (its unmount returned 0)."""
    writer = mount_factory(*PART, name="writer")
    for name, data in files.items():
        (writer.path / name).parent.mkdir(parents=True, exist_ok=True)
        (writer.path / name).write_bytes(data)
    assert writer.unmount().returncode == 0


def _read_error(path: Path) -> int | None:
    """The errno a whole read of `path` fails with (None: it read to its end)."""
    try:
        path.read_bytes()
    except OSError as exc:
        return exc.errno
    return None


def test_damaged_gets_are_never_served_cached_or_uploaded_again(mount_factory, corrupting, s3,
                                                                reliability):
    proxy, corrupter = corrupting
    files = {name: os.urandom(size) for name, size in FILES.items()}
    _committed(mount_factory, files)
    for name, size in FILES.items():  # the mount's multipart objects name their part table
        info = s3.head(name)
        assert info is not None and info.size == size
        assert (META_PARTS in info.metadata) == (size > 8 * MiB), info.metadata

    corrupter.keys = lambda key: key.startswith("ckpt/")
    reader = mount_factory(*PART, name="reader", endpoint_url=proxy.endpoint_url)
    began = time.monotonic()
    for name in FILES:  # cold reads: every GET of their bytes arrives with a bit flipped
        assert _read_error(reader.path / name) == errno.EIO, name
    counters = reader.counters()
    assert counters["read_checksum_errors"] >= 3 * 4  # each file's first chunk, 4 attempts
    assert counters.get("bytes_verified", 0) == 0
    assert "checksum" in reader.log_tail(400).lower()

    # a write that needs the damaged bytes fails; S3 keeps the object as it was
    with pytest.raises(OSError) as raised, (reader.path / "ckpt/small.bin").open("ab") as f:
        f.write(b"one more line\n")
    assert raised.value.errno == errno.EIO
    reader.flush()
    assert s3.get_range("ckpt/small.bin", 0, 2 * MiB) == files["ckpt/small.bin"]

    corrupter.keys = lambda key: False  # the link heals: nothing damaged was kept
    assert proxy.responses_corrupted
    for name, data in files.items():
        assert (reader.path / name).read_bytes() == data, name
    assert reader.counters().get("bytes_verified", 0) >= sum(FILES.values())
    with (reader.path / "ckpt/small.bin").open("ab") as f:
        f.write(b"one more line\n")
    assert reader.flush().returncode == 0
    assert s3.get_range("ckpt/small.bin", 0, 2 * MiB) == files["ckpt/small.bin"] + \
        b"one more line\n"
    assert reader.unmount().returncode == 0

    again = mount_factory(*PART, name="reader", endpoint_url=proxy.endpoint_url)  # warm
    for name, data in files.items():
        expected = data + b"one more line\n" if name == "ckpt/small.bin" else data
        assert (again.path / name).read_bytes() == expected, name
    reliability(Row(
        scenario="damaged GETs: one bit flipped in every answer", injects="a bit flipped in "
        "the body of every GET of the files, cold cache; then the link heals",
        acknowledged=len(files), lost=0, corrupt=0, seconds=round(time.monotonic() - began, 1),
        notes=f"every read of the 3 files (1, 40, 100 MiB) failed with EIO; "
              f"{counters['read_checksum_errors']} GETs refused (read_checksum_errors); an "
              f"append needing the damaged bytes failed with EIO and S3 kept the object; "
              f"after healing every byte read right, also from a warm remount"))


def test_a_renamed_object_keeps_its_part_table_and_a_damaged_table_fails_the_read(
        mount_factory, corrupting, s3):
    proxy, corrupter = corrupting
    data = os.urandom(24 * MiB + 5)
    _committed(mount_factory, {"a/big.bin": data})
    mover = mount_factory(*PART, name="mover")
    (mover.path / "a/big.bin").rename(mover.path / "a/moved.bin")
    assert mover.unmount().returncode == 0
    info = s3.head("a/moved.bin")
    assert info is not None and s3.head("a/big.bin") is None
    table_key = info.metadata[META_PARTS]
    assert FOLDER in table_key

    corrupter.keys = lambda key: key == "a/moved.bin"
    reader = mount_factory(*PART, name="reader", endpoint_url=proxy.endpoint_url)
    with (reader.path / "a/moved.bin").open("rb") as f:  # a chunk in the middle
        f.seek(9 * MiB)
        with pytest.raises(OSError) as raised:
            f.read(MiB)
    assert raised.value.errno == errno.EIO

    corrupter.keys = lambda key: key == table_key  # the bytes arrive whole, the table not
    fresh = mount_factory(*PART, name="fresh", endpoint_url=proxy.endpoint_url)
    assert _read_error(fresh.path / "a/moved.bin") == errno.EIO
    assert fresh.counters()["read_checksum_errors"] >= 1

    corrupter.keys = lambda key: False
    assert (fresh.path / "a/moved.bin").read_bytes() == data
    counters = fresh.counters()
    assert counters.get("bytes_verified", 0) >= len(data)
    assert counters.get("bytes_unverified", 0) == 0


def test_objects_other_tools_wrote_are_checked_where_s3_keeps_a_crc(
        mount_factory, corrupting, s3):
    """An object written with its CRC-32C (as aws s3 cp does) is checked against S3's;
    one without any is served unchecked, and status counts its bytes as unverified."""
    proxy, corrupter = corrupting
    with_crc, without = os.urandom(3 * MiB), os.urandom(2 * MiB)
    s3.put("tool/with-crc.bin", with_crc, {}, crc32c_of(with_crc))
    s3.put("tool/without.bin", without, {})

    corrupter.keys = lambda key: key == "tool/with-crc.bin"
    m = mount_factory(*PART, endpoint_url=proxy.endpoint_url)
    assert _read_error(m.path / "tool/with-crc.bin") == errno.EIO
    assert (m.path / "tool/without.bin").read_bytes() == without
    counters = m.counters()
    assert counters["read_checksum_errors"] >= 1
    assert counters.get("bytes_unverified", 0) >= len(without)

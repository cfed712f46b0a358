"""`lakefs-mount orphans list|upload` through a real mount and SeaweedFS (issue 29 defect 2,
D20): orphans made the way a user gets them (acknowledged files, a crash while S3 was
down, the journal lost), listed, uploaded byte-identical into lost+found/, removed only
once S3 has them; bad input and failures end in one line with the documented status."""

from __future__ import annotations

import json
import socket
import time

import pytest

from lakefs_mount.s3.crc import crc32c_of, encode_crc
from tests.faults.test_durability import crash_with_pending_files
from tests.mounting import cli

MiB = 1024 * 1024
HOST = socket.gethostname()
SIZES = (200_000, 20 * MiB + 3, 0 + 1)  # one PutObject, one multipart (8 MiB parts), 1 byte


def _orphaned(mount_factory, fault_proxy, *options: str):
    """A mount whose previous daemon crashed with unflushed files and lost its journal."""
    m = mount_factory("--part-size", "8M", "--metadata-ttl", "0", *options,
                      endpoint_url=fault_proxy.endpoint_url)
    bodies = crash_with_pending_files(m, fault_proxy, SIZES)
    for path in m.cache_dir.glob("journal.db*"):
        path.unlink()
    m.start()
    return m, bodies


def _errors(proc) -> list[str]:
    """The error lines (a progress line every 10 s may come before them off a terminal)."""
    lines = proc.stderr.strip().splitlines()
    assert all(line.startswith(("lakefs-mount: ", "uploading orphans: ")) for line in lines)
    return [line for line in lines if line.startswith("lakefs-mount: ")]


def _listed(m) -> list[dict]:
    proc = cli("orphans", "list", str(m.path), "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["orphans"]


def test_orphans_are_listed_then_uploaded_byte_identical_and_removed(mount_factory, s3,
                                                                    fault_proxy):
    m, bodies = _orphaned(mount_factory, fault_proxy)
    deadline = time.monotonic() + 20  # the checksum probe: whether S3 checks CRCs
    while "whether" in m.status()["checksums"] and time.monotonic() < deadline:
        time.sleep(0.1)
    listed = _listed(m)
    assert sorted(o["size"] for o in listed) == sorted(map(len, bodies))
    assert all(isinstance(o["fid"], int) and o["mtime"] > 0 for o in listed)
    table = cli("orphans", "list", str(m.path))
    assert table.returncode == 0 and all(o["name"] in table.stdout for o in listed)
    assert "3 files" in table.stdout

    proc = cli("orphans", "upload", str(m.path))
    assert proc.returncode == 0, proc.stderr + m.log_tail()
    by_size = {len(b): b for b in bodies}
    for o in listed:
        key = f"lost+found/{HOST}-{o['name']}"
        assert s3.get_range(key, 0, o["size"] + 1) == by_size[o["size"]], key
        head = s3.head(key, checksum=True)  # each went up with its CRC-32C, S3 kept it
        assert head is not None and head.crc32c == encode_crc(crc32c_of(by_size[o["size"]]))
        assert f"{o['name']} -> {m.path}/{key}" in proc.stdout
        assert (m.path / key).read_bytes() == by_size[o["size"]]  # seen in the mount too
    assert not (m.cache_dir / "orphans").exists()
    assert m.status().get("orphans") is None
    assert not s3.list_multipart_uploads("")
    assert cli("orphans", "list", str(m.path)).stdout.startswith("no orphaned cache files")
    again = cli("orphans", "upload", str(m.path))
    assert again.returncode == 0 and "no orphaned cache files" in again.stdout


def test_an_orphan_is_never_uploaded_over_other_content_and_keep_keeps_them(
        mount_factory, s3, fault_proxy):
    m, bodies = _orphaned(mount_factory, fault_proxy)
    listed = _listed(m)
    small = next(o for o in listed if o["size"] == SIZES[0])
    taken = f"saved/{HOST}-{small['name']}"
    s3.put(taken, b"somebody else's object", {})

    proc = cli("orphans", "upload", str(m.path), "--to", "saved", "--keep")
    assert proc.returncode == 1
    lines = _errors(proc)
    assert len(lines) == 1 and lines[0].startswith("lakefs-mount: 1 orphan not uploaded"), \
        proc.stderr
    assert "already exists in S3 with other content; choose another --to" in lines[0]
    assert s3.get_range(taken, 0, 100) == b"somebody else's object"
    assert len(_listed(m)) == 3  # --keep: the two uploaded stay, and the one refused

    s3.delete(taken)
    proc = cli("orphans", "upload", str(m.path), "--to", f"{m.path}/saved", "--json")
    assert proc.returncode == 0, proc.stderr  # the two already there are confirmed, kept no more
    result = json.loads(proc.stdout.splitlines()[-1])["result"]
    assert sorted(u["size"] for u in result["uploaded"]) == sorted(SIZES)
    # S3's ETags are MD5s of the bytes (3 parts of 8 MiB for 20 MiB): the local check ran
    assert {u["size"]: u["etag"][-2:] for u in result["uploaded"]}[SIZES[1]] == "-3"
    by_size = {len(b): b for b in bodies}
    for o in listed:
        assert s3.get_range(f"saved/{HOST}-{o['name']}", 0, o["size"] + 1) == \
            by_size[o["size"]]
    assert _listed(m) == []


def test_an_upload_into_an_unreachable_s3_fails_in_one_line_and_keeps_the_orphans(
        mount_factory, s3, fault_proxy):
    m, _ = _orphaned(mount_factory, fault_proxy)
    before = _listed(m)
    fault_proxy.fail = True
    try:
        proc = cli("orphans", "upload", str(m.path), timeout=300)
    finally:
        fault_proxy.fail = False
    assert proc.returncode == 1
    lines = _errors(proc)
    assert len(lines) == 1 and "3 orphans not uploaded" in lines[0], proc.stderr
    assert "unreachable" in lines[0] and "run it again" in lines[0]
    assert "Traceback" not in proc.stderr
    assert _listed(m) == before
    assert not s3.list_multipart_uploads("")


@pytest.mark.parametrize("args, code, needle", [
    (["upload", "{mp}", "--to", "/etc"], 2, "outside the mount"),
    (["upload", "{mp}", "--to", ".lakefs-mount/x"], 2, "reserved"),
    (["list", "{tmp}"], 1, "no lakefs-mount daemon serves"),
    (["upload", "{tmp}"], 1, "no lakefs-mount daemon serves"),
])
def test_orphans_bad_input_is_one_line_with_its_status(mount, tmp_path, args, code, needle):
    args = [a.format(mp=mount.path, tmp=tmp_path / "nothing") for a in args]
    (tmp_path / "nothing").mkdir()
    proc = cli("orphans", *args)
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lakefs-mount: ") and needle in lines[0], \
        proc.stderr

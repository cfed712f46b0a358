"""Objects other tools wrote carry no owner or mode: they show --uid, --gid, --file-mode
and --dir-mode (the mounter and 0644 / 0755 by default); what this mount wrote keeps its
own; --allow-root reaches FUSE and excludes --allow-other."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import boto3
import pytest

from tests.mounting import cli

pytestmark = pytest.mark.parametrize("fuse_session", ["native", "pyfuse3"], indirect=True)


def _put_foreign(endpoint_url: str, bucket: str, key: str, body: bytes) -> None:
    """As another tool uploads: plain boto3, no POSIX metadata."""
    client = boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1",
                          aws_access_key_id="any", aws_secret_access_key="any")
    client.put_object(Bucket=bucket, Key=key, Body=body)


def _shown(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


def test_foreign_objects_show_the_owner_and_modes_the_mount_was_given(
        mount_factory, s3_server, bucket):
    _put_foreign(s3_server.endpoint_url, bucket, "dataset/shard-0.bin", b"x" * 1000)
    m = mount_factory("--uid", "1234", "--gid", "2345", "--file-mode", "0640",
                      "--dir-mode", "750")
    assert _shown(m.path / "dataset" / "shard-0.bin") == (1234, 2345, 0o640)
    assert _shown(m.path / "dataset") == (1234, 2345, 0o750)
    assert _shown(m.path) == (1234, 2345, 0o750)
    assert [(e.name, _shown(Path(e.path))) for e in os.scandir(m.path / "dataset")] == \
        [("shard-0.bin", (1234, 2345, 0o640))]  # readdirplus answers the same
    mine = m.path / "mine.bin"
    mine.write_bytes(b"y")
    os.chmod(mine, 0o600)
    assert _shown(mine) == (os.getuid(), os.getgid(), 0o600)  # its own, not the defaults
    os.chmod(m.path / "dataset" / "shard-0.bin", 0o604)  # stored now: it wins from here on
    assert m.flush().returncode == 0
    again = mount_factory("--uid", "77", "--file-mode", "0400", name="again")  # new cache
    assert _shown(again.path / "dataset" / "shard-0.bin") == (1234, 2345, 0o604)


def test_without_options_foreign_objects_show_the_mounter_and_0644_0755(
        mount_factory, s3_server, bucket):
    _put_foreign(s3_server.endpoint_url, bucket, "d/f", b"z")
    m = mount_factory()
    assert _shown(m.path / "d" / "f") == (os.getuid(), os.getgid(), 0o644)
    assert _shown(m.path / "d") == (os.getuid(), os.getgid(), 0o755)


@pytest.mark.parametrize(("option", "value", "said"), [
    ("--file-mode", "0849", "not an octal mode"),
    ("--dir-mode", "17777", "0 to 07777"),
    ("--uid", "-1", "Invalid value for '--uid'"),
    ("--gid", "abc", "Invalid value for '--gid'"),
])
def test_bad_owner_or_mode_fails_with_one_line_and_status_2(tmp_path, fuse_session, option,
                                                            value, said):
    (tmp_path / "mnt").mkdir()
    proc = cli("mount", "s3://b", str(tmp_path / "mnt"), option, value)
    assert proc.returncode == 2
    assert said in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_allow_root_and_allow_other_exclude_each_other(tmp_path, fuse_session):
    (tmp_path / "mnt").mkdir()
    proc = cli("mount", "s3://b", str(tmp_path / "mnt"), "--allow-root", "--allow-other")
    assert proc.returncode == 2 and "exclude each other" in proc.stderr, proc.stderr

"""Checkpoints in progress (issue 24): `status` shows per top-level directory what is not
yet in S3 and the commits under way, and one directory's flush or commit does not wait
for another directory's uploads. The fault proxy holds back the requests on one
directory's keys (`delay_keys`); the other directory's go through."""

from __future__ import annotations

import json
import os
import time

from tests.faults.test_s3_black_hole import wait_for
from tests.mounting import cli
from tests.publish.test_publish import _crc, _manifest, _running, _write

MiB = 1024 * 1024


def _held_mount(mount_factory, fault_proxy, held: str, *args: str):
    """A mount through the proxy that uploads at once (8 MiB parts), the keys under `held`
    held back."""
    fault_proxy.parse_requests = True
    fault_proxy.delay_keys(held)
    return mount_factory("--commit-delay", "0", "--part-size", "8M", *args,
                         endpoint_url=fault_proxy.endpoint_url)


def test_status_shows_the_bytes_pending_per_directory_and_the_commits_under_way(
        mount_factory, fault_proxy, s3):
    m = _held_mount(mount_factory, fault_proxy, "slow/")
    slow, fast = os.urandom(3 * MiB + 5), os.urandom(2 * MiB)
    _write(m.path / "slow" / "a.bin", slow)
    _write(m.path / "fast" / "b.bin", fast)
    _write(m.path / "fast" / "c.bin", b"c" * 1000)
    assert m.flush("fast").returncode == 0, m.log_tail()
    assert wait_for(lambda: fault_proxy.requests_held, 20), "slow/a.bin's upload never began"

    dirs = m.status()["checkpoints"]
    assert dirs["slow/"]["pending_bytes"] == len(slow), dirs
    assert dirs["slow/"]["pending_files"] == 1 and dirs["slow/"]["upload_rate"] is None
    assert dirs["fast/"]["pending_bytes"] == 0 and dirs["fast/"]["pending_files"] == 0, dirs
    assert dirs["fast/"]["upload_rate"] >= len(fast) // 10  # over the last 10 s at most
    text = cli("status", str(m.path), check=True).stdout
    assert "\ndirectory  pending  files  uploaded/s\n" in text, text
    assert [line.split() for line in text.splitlines() if line.startswith("slow/")] == [
        ["slow/", "3", "MiB", "1", "-"]], text

    with _running("commit", str(m.path), "slow") as proc:
        assert wait_for(lambda: m.status()["commits"], 10), "no commit under way in status"
        [commit] = m.status()["commits"]
        assert commit["path"] == "/slow" and commit["stage"] == "flushing", commit
        assert "commits under way\n/slow  flushing (for " in cli(
            "status", str(m.path), check=True).stdout
        fault_proxy.release_keys()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err + m.log_tail()
    after = m.status()
    assert after["commits"] == []
    assert after["checkpoints"]["slow/"]["pending_bytes"] == 0, after["checkpoints"]
    assert after["checkpoints"]["slow/"]["upload_rate"] > 0
    assert s3.get("slow/a.bin")[1] == slow


def test_flush_and_commit_of_one_directory_return_while_another_is_held_back(
        mount_factory, fault_proxy, s3):
    """The held directory's parts take every upload slot (2) and do not end: the files a
    flush waits for go ahead of them, in an express slot (cache/slots.py)."""
    m = _held_mount(mount_factory, fault_proxy, "none/", "--upload-concurrency", "2")
    (m.path / "held").mkdir()
    held = os.urandom(40 * MiB + 1)  # 6 parts
    free = {f"rank{i}.pt": os.urandom(MiB + i) for i in range(3)}
    with open(m.path / "held" / "x.bin", "wb") as f:
        f.write(held[:16 * MiB + 1])
        f.flush()
        # its marker and its upload in S3: then only parts and the Complete wait
        assert wait_for(lambda: s3.list_multipart_uploads("held/"), 20), m.log_tail()
        fault_proxy.delay_keys("held/")
        f.write(held[16 * MiB + 1:])
    assert wait_for(lambda: m.status()["uploads_in_flight"] == 2, 20), m.status()
    for rel, data in free.items():
        _write(m.path / "free" / rel, data)

    started = time.monotonic()
    proc = m.flush("free", timeout=60)
    assert proc.returncode == 0, proc.stderr + m.log_tail()
    for rel, data in free.items():
        assert s3.get(f"free/{rel}")[1] == data
    proc = cli("commit", str(m.path), "free", "--expect-files", "3", "--json", timeout=60)
    assert proc.returncode == 0, proc.stderr + m.log_tail()
    assert json.loads(proc.stdout.splitlines()[-1])["result"]["files"] == 3
    assert {f["key"]: f["checksum"]["value"] for f in _manifest(s3, "free/")["files"]} == {
        rel: _crc(data) for rel, data in free.items()}
    assert time.monotonic() - started < 15  # (first come first served: until timeouts)
    assert s3.head("held/x.bin") is None  # still held back all along
    assert m.status()["checkpoints"]["held/"]["pending_bytes"] >= 2 * 8 * MiB  # (held parts)

    fault_proxy.release_keys()
    assert m.flush(timeout=120).returncode == 0, m.log_tail()
    assert s3.get("held/x.bin")[1] == held

"""Crash guarantees through a real mount: rows of docs/durability.md proven end to end."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import signal
import sqlite3
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from lakefs_mount.ops.mountpoint import is_mounted
from tests.mounting import cli, write_fsync
from tests.reliability import Row

MiB = 1024 * 1024
pytestmark = pytest.mark.parametrize("fuse_session", ["native", "pyfuse3"], indirect=True)


def test_kill9_with_s3_down_then_remount_uploads_everything(mount_factory, s3, fault_proxy):
    """D1: acknowledged writes survive a daemon crash; the next mount uploads them."""
    m = mount_factory("--part-size", "8M", endpoint_url=fault_proxy.endpoint_url)
    big = random.randbytes(30 * MiB + 123)
    small = b"tiny file\n"
    (m.path / "ckpt").mkdir()
    fault_proxy.fail = True  # nothing can reach S3 before the crash
    write_fsync(m.path / "ckpt" / "model.bin", big)
    write_fsync(m.path / "ckpt" / "meta.json", small)
    m.kill9()
    assert s3.head("ckpt/model.bin") is None
    fault_proxy.fail = False
    m.start()
    assert m.counters().get("recovered_files", 0) == 2
    assert m.flush().returncode == 0
    assert s3.get_range("ckpt/model.bin", 0, len(big) + 1) == big
    assert s3.get_range("ckpt/meta.json", 0, 100) == small
    assert (m.path / "ckpt" / "model.bin").read_bytes() == big


def test_kill9_after_parts_uploaded_resumes_the_multipart_upload(mount_factory, s3):
    """D3: parts recorded as uploaded are kept (ListParts) and only the rest is sent."""
    m = mount_factory("--part-size", "8M")
    data = random.randbytes(40 * MiB)
    fd = os.open(m.path / "resume.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, data)  # held open: streamed parts go up, the object is not completed
    os.fsync(fd)
    deadline = time.monotonic() + 30
    while m.counters().get("parts_uploaded", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    m.kill9()
    with contextlib.suppress(OSError):
        os.close(fd)  # the daemon is gone: close can only fail
    assert s3.head("resume.bin") is None
    m.start()
    assert m.flush().returncode == 0
    assert hashlib.sha256(s3.get_range("resume.bin", 0, len(data))).digest() == \
        hashlib.sha256(data).digest()
    assert not s3.list_multipart_uploads("")  # nothing left open after completion


def test_parallel_writers_land_byte_identical_in_s3(mount, s3):
    """8 writers x 256 MiB through the mount, then flush: 8 identical objects."""
    size = 256 * MiB
    block = 1 * MiB

    def write(i: int) -> str:
        rnd = random.Random(i)
        digest = hashlib.sha256()
        with open(mount.path / f"rank{i}.bin", "wb") as f:
            for _ in range(size // block):
                buf = rnd.randbytes(block)
                digest.update(buf)
                f.write(buf)
        return digest.hexdigest()

    with ThreadPoolExecutor(8) as pool:
        expected = list(pool.map(write, range(8)))
    assert mount.flush().returncode == 0
    for i, want in enumerate(expected):
        info = s3.head(f"rank{i}.bin")
        assert info is not None and info.size == size
        got = hashlib.sha256()
        for off in range(0, size, 64 * MiB):
            got.update(s3.get_range(f"rank{i}.bin", off, off + 64 * MiB))
        assert got.hexdigest() == want


def test_a_file_rewritten_while_its_commit_runs_ends_with_the_new_bytes(mount_factory, s3,
                                                                        fault_proxy):
    """O_TRUNC and new writes while the multipart commit of the old content is under way:
    the mount stays responsive and S3 ends with exactly the new content (this once hung
    the daemon's event loop)."""
    m = mount_factory("--part-size", "8M", "--commit-delay", "0",
                      endpoint_url=fault_proxy.endpoint_url)
    path = m.path / "rewritten.bin"
    fault_proxy.bandwidth_bytes_per_s = 4 * MiB  # keep the first commit in flight
    path.write_bytes(random.randbytes(27 * MiB))  # (passthrough: done before any upload)
    deadline = time.monotonic() + 30
    while m.status()["files_committing"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert m.status()["files_committing"] == 1
    new = random.randbytes(10 * MiB + 7)
    path.write_bytes(new)
    fault_proxy.bandwidth_bytes_per_s = None
    assert m.flush(timeout=120).returncode == 0
    assert s3.get_range("rewritten.bin", 0, 64 * MiB) == new
    assert path.read_bytes() == new


def crash_with_pending_files(m, fault_proxy, sizes=(200_000, 200_001, 200_002),
                             rng: random.Random | None = None) -> list[bytes]:
    """Acknowledged (fsync'ed) files ckpt/pending-<i>.bin that never reached S3, then a
    kill -9: the journal alone knows them."""
    (m.path / "ckpt").mkdir()  # new: its names need no lookup in S3
    fault_proxy.fail = True
    bodies = [(rng or random).randbytes(size) for size in sizes]
    for i, body in enumerate(bodies):
        write_fsync(m.path / "ckpt" / f"pending-{i}.bin", body)
    m.kill9()
    fault_proxy.fail = False
    return bodies


def test_a_lost_journal_leaves_the_cached_bytes_aside_not_deleted(mount_factory, s3,
                                                                   fault_proxy, reliability):
    """Issue 29 defect 2, D20: the journal is gone after a crash, so the next mount cannot
    tell what the cache files hold; it keeps them in orphans/ (not deleted), says so in
    the log and in status, and a clean unmount leaves them there."""
    m = mount_factory(endpoint_url=fault_proxy.endpoint_url)
    bodies = crash_with_pending_files(m, fault_proxy)
    for path in m.cache_dir.glob("journal.db*"):
        path.unlink()
    began = time.monotonic()
    m.start()
    mount_s = time.monotonic() - began
    orphans = m.cache_dir / "orphans"
    assert sorted(p.read_bytes() for p in orphans.iterdir()) == sorted(bodies)
    assert m.status()["orphans"] >= sum(map(len, bodies))
    assert "kept in" in m.log_tail(200)
    assert not any((m.path / "ckpt" / f"pending-{i}.bin").exists() for i in range(3))
    assert m.unmount().returncode == 0
    kept = sorted(p.read_bytes() for p in orphans.iterdir())
    reliability(Row(
        scenario="missing journal: journal.db* deleted after a crash, data/ kept",
        injects="kill -9 with 3 fsync'ed files not in S3, then the journal files deleted",
        acknowledged=len(bodies), lost=sum(body not in kept for body in bodies), corrupt=0,
        seconds=round(mount_s, 1),
        notes="mounted; the cache files are kept in orphans/ (log line, status 'orphans'), "
              "also after a clean unmount; the files are not shown"))
    assert kept == sorted(bodies)


def test_a_damaged_journal_is_refused_and_nothing_is_deleted(mount_factory, fault_proxy,
                                                              reliability):
    """Issue 29 defect 2: a journal SQLite cannot read is refused with a clear message;
    every cache file stays where it was."""
    m = mount_factory(endpoint_url=fault_proxy.endpoint_url)
    crash_with_pending_files(m, fault_proxy)
    data = sorted((p.name, p.read_bytes()) for p in (m.cache_dir / "data").iterdir())
    db = sqlite3.connect(m.cache_dir / "journal.db")  # its pages from the WAL into the file
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    with open(m.cache_dir / "journal.db", "r+b") as journal:
        journal.seek(4096)
        journal.write(b"\xa5" * 4096)  # a page of a table
    began = time.monotonic()
    proc = cli("mount", m.source, str(m.path), "--endpoint-url", m.endpoint_url,
               "--cache-dir", str(m.cache_dir), "--log-file", str(m.log_file))
    after = sorted((p.name, p.read_bytes()) for p in (m.cache_dir / "data").iterdir())
    reliability(Row(
        scenario="damaged journal: a page of journal.db overwritten",
        injects="kill -9 with 3 fsync'ed files not in S3, WAL checkpointed, then 4 KiB of "
                "0xa5 over a table page of journal.db",
        acknowledged=len(data), lost=len(set(data) - set(after)), corrupt=0,
        seconds=round(time.monotonic() - began, 1),
        notes=f"refused with exit {proc.returncode}: "
              f"'{proc.stderr.strip().replace(str(m.cache_dir), '<cache dir>')}'; "
              f"data/ untouched"))
    assert proc.returncode == 1  # as the README lists it
    assert "journal" in proc.stderr and "damaged" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "sub-exception" not in proc.stderr
    assert after == data


def test_a_symlink_planted_in_the_cache_is_refused_and_its_target_never_uploaded(
        mount_factory, s3, fault_proxy, tmp_path):
    """D27: after a crash, data/<fid> of one pending file is replaced by a symlink to a
    file the mount must not publish. The next mount moves the link to refused/ unread,
    says so (log, status), loses that one file as if its cache file were gone, and
    uploads the others intact."""
    m = mount_factory(endpoint_url=fault_proxy.endpoint_url)
    bodies = crash_with_pending_files(m, fault_proxy)
    secret = tmp_path / "secret"
    secret.write_bytes(b"someone else's bytes " * 10_000)
    victim = next(p for p in (m.cache_dir / "data").iterdir()
                  if p.read_bytes()[:len(bodies[1])] == bodies[1])
    victim.unlink()
    victim.symlink_to(secret)
    m.start()
    assert m.flush().returncode == 0, m.log_tail()
    assert m.status()["counters"]["cache_files_refused"] == 1
    assert "not regular files" in m.log_tail(200)
    assert (m.cache_dir / "refused" / victim.name).is_symlink()
    assert s3.get("ckpt/pending-0.bin")[1] == bodies[0]
    assert s3.get("ckpt/pending-2.bin")[1] == bodies[2]
    assert s3.head("ckpt/pending-1.bin") is None
    assert not any(b"someone else's" in s3.get(o.key)[1] for o in s3.list_recursive(""))


def _wait_exit(pid: int, timeout: float) -> float | None:
    """Seconds until `pid` is gone (a zombie counts as gone), None if it outlived `timeout`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return time.monotonic() - started
        except (FileNotFoundError, ProcessLookupError):
            return time.monotonic() - started
        time.sleep(0.05)
    return None


@pytest.mark.parametrize("outage", ["fail", "hang"])
def test_a_second_sigterm_ends_the_exit_flush_at_once_and_the_next_mount_uploads(
        mount_factory, s3, fault_proxy, outage):
    """Issue 29 defect 8: a daemon flushing before exit into an unreachable S3 exits at
    once on a second SIGTERM, says that its data is safe in the journal, and the next
    mount uploads every byte."""
    m = mount_factory("--part-size", "8M", endpoint_url=fault_proxy.endpoint_url)
    (m.path / "ckpt").mkdir()
    assert m.flush().returncode == 0  # the directory marker is in S3
    setattr(fault_proxy, outage, True)
    bodies = {f"ckpt/f{i}.bin": random.randbytes(size)
              for i, size in enumerate((100_000, 20 * MiB + 1))}
    for name, body in bodies.items():
        write_fsync(m.path / name, body)
    pid = m.pid
    assert pid is not None
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while "before exit" not in m.log_tail(400):  # unmounted, flushing into the outage
        assert time.monotonic() < deadline, m.log_tail()
        time.sleep(0.1)
    time.sleep(1.0)
    assert _wait_exit(pid, 0.1) is None, "the daemon gave up flushing by itself"
    os.kill(pid, signal.SIGTERM)
    took = _wait_exit(pid, 30)
    assert took is not None and took < 5, (took, m.log_tail())
    m.pid = None
    assert "safe in the journal" in m.log_tail(400)
    assert not is_mounted(m.path)
    setattr(fault_proxy, outage, False)
    m.start()
    assert m.flush(timeout=120).returncode == 0
    for name, body in bodies.items():
        assert s3.get_range(name, 0, len(body) + 1) == body, name
    assert not s3.list_multipart_uploads("")


def test_one_sigterm_after_an_umount_lets_the_exit_upload_finish(mount_factory, s3,
                                                                   fault_proxy):
    """D23's other side: after a plain `umount`, the daemon uploads what is left before it
    exits; one SIGTERM then (systemd stopping the unit) does not cut that short, only a
    second one would."""
    m = mount_factory(endpoint_url=fault_proxy.endpoint_url)
    (m.path / "ckpt").mkdir()
    assert m.flush().returncode == 0
    fault_proxy.fail = True
    body = random.randbytes(300_000)
    write_fsync(m.path / "ckpt" / "late.bin", body)
    pid = m.pid
    assert pid is not None
    subprocess.run(["umount", str(m.path)], check=True)
    deadline = time.monotonic() + 30
    while "before exit" not in m.log_tail(400):
        assert time.monotonic() < deadline, m.log_tail()
        time.sleep(0.1)
    os.kill(pid, signal.SIGTERM)
    assert _wait_exit(pid, 2.0) is None, m.log_tail()
    fault_proxy.fail = False
    assert _wait_exit(pid, 60) is not None, m.log_tail()
    m.pid = None
    assert "safe in the journal" not in m.log_tail(400)
    assert s3.get_range("ckpt/late.bin", 0, len(body) + 1) == body

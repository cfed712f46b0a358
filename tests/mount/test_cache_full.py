"""A full cache disk never loses acknowledged data: evict clean, wait for uploads, ENOSPC last."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.mounting import cli
from tests.reliability import Row

MiB = 1024 * 1024


@contextlib.contextmanager
def _cache_on(mount_factory, size: str, *options: str, endpoint_url: str | None = None,
                    fs: str = "tmpfs"):
    """A mount whose cache directory is a file system of `size` of its own: tmpfs, or
    ext4 on a loop device (a file system that reports pre-content events)."""
    m = mount_factory("--part-size", "8M", "--cache-size", "1G", *options, start=False,
                      endpoint_url=endpoint_url)
    m.cache_dir.mkdir(parents=True)
    if fs == "ext4":
        image = m.cache_dir.parent / "cache.img"
        with open(image, "wb") as f:
            f.truncate(int(size.rstrip("m")) * MiB)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
        subprocess.run(["mount", "-o", "loop", str(image), str(m.cache_dir)], check=True)
        os.chmod(m.cache_dir, 0o700)
    else:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                        str(m.cache_dir)], check=True)
    try:
        m.start()
        yield m
    finally:
        m.cleanup()
        subprocess.run(["umount", "-l", str(m.cache_dir)], check=False)


@pytest.fixture
def tiny_cache_mount(mount_factory):
    """A mount whose cache directory is a 48 MiB tmpfs."""
    with _cache_on(mount_factory, "48m", "--max-dirty", "16M") as m:
        yield m


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
    assert info is not None and info.size == written  # not a byte of the failed write
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



@pytest.mark.parametrize(("fuse_session", "writers"),
                         [("native", 1), ("native", 4), ("native", 8), ("pyfuse3", 4)],
                         indirect=["fuse_session"])
def test_writers_filling_the_cache_disk_at_once_all_reach_s3_up_to_their_enospc(
        mount_factory, s3, reliability, fuse_session: str, writers: int):
    """Issue 29's first defect, as it was found (256 MiB cache disk, 4 writers of 256 MiB):
    several writers used to eat the journal's free-space reserve between them, SQLite hit
    the full disk first ('database or disk is full') and nothing could drain. The reserve
    is a file now; with 1, 4 or 8 writers the disk fills, each writer ends with ENOSPC
    (a late one already at its create), the flush exits 0 without anything freed by
    hand, what each writer was told it wrote is in S3 and a file whose create failed is
    not (defect 4); the mount then takes new files."""
    began = time.monotonic()
    with _cache_on(mount_factory, "256m", "--max-dirty", "64M") as m:
        rng = random.Random(29 + writers)
        blocks = {f"w{k}.bin": rng.randbytes(MiB) for k in range(writers)}
        written = dict.fromkeys(blocks, 0)
        errors: list[int] = []
        refused: list[str] = []  # creates the full disk failed: never acknowledged

        def fill(name: str) -> None:
            try:
                fd = os.open(m.path / name, os.O_WRONLY | os.O_CREAT, 0o644)
            except OSError as exc:
                errors.append(exc.errno)
                refused.append(name)
                return
            try:
                for _ in range(256):
                    written[name] += os.write(fd, blocks[name])
            except OSError as exc:
                errors.append(exc.errno)
            finally:
                os.close(fd)

        with ThreadPoolExecutor(writers) as pool:
            list(pool.map(fill, blocks))
        flushed = m.flush()
        seconds = time.monotonic() - began
        kept = {name: n for name, n in written.items() if n}
        lost = [name for name in kept if s3.head(name) is None]
        corrupt = [name for name, n in kept.items() if name not in lost and (
            s3.head(name).size != n
            or s3.get_range(name, 0, n) != (blocks[name] * (n // MiB + 1))[:n])]
        phantoms = [name for name in refused if s3.head(name) is not None]
        reliability(Row(
            scenario=f"full cache disk, {writers} writer{'s' if writers > 1 else ''} "
                     f"({fuse_session} session)",
            injects=f"a 256 MiB tmpfs as the cache disk; {writers} x 256 MiB written at once",
            acknowledged=len(kept), lost=len(lost), corrupt=len(corrupt),
            seconds=round(seconds, 1),
            notes=f"{sum(written.values()) / MiB:.0f} MiB acknowledged before ENOSPC "
                  f"(ENOSPC for {errors.count(errno.ENOSPC)} of {writers} writers, other "
                  f"errors: {[e for e in errors if e != errno.ENOSPC]}; {len(refused)} creates "
                  f"refused, {len(phantoms)} of them in S3 after); the flush exited "
                  f"{flushed.returncode} with nothing freed by hand, and the mount takes "
                  f"new files after it"))
        assert flushed.returncode == 0, flushed.stderr
        assert not lost and not corrupt, (lost, corrupt)
        assert not phantoms, phantoms  # what the application was told failed
        assert set(errors) <= {errno.ENOSPC}, errors
        assert sum(written.values()) < writers * 256 * MiB  # the disk did fill up
        (m.path / "after.bin").write_bytes(blocks["w0.bin"])  # not wedged
        assert m.flush().returncode == 0
        assert s3.get_range("after.bin", 0, MiB + 1) == blocks["w0.bin"]


@pytest.mark.parametrize("fuse_session", ["native", "pyfuse3"], indirect=True)
def test_bytes_of_writes_that_failed_never_reach_s3_even_after_a_crash(mount_factory, s3):
    """Issue 29 defect 4: a write() answered ENOSPC could leave part of its bytes past
    the end of the cache file, and recovery, which trusts the cache file's length,
    committed them after a crash: objects came back larger than what was acknowledged.
    Four writers fill the disk, the daemon is killed with their files open, and each
    object ends up exactly as long as what its writer was told it wrote."""
    with _cache_on(mount_factory, "256m", "--max-dirty", "64M") as m:
        blocks = {f"w{k}.bin": random.randbytes(MiB) for k in range(4)}
        written = dict.fromkeys(blocks, 0)
        fds = {name: os.open(m.path / name, os.O_WRONLY | os.O_CREAT, 0o644)
               for name in blocks}

        def fill(name: str) -> None:
            with contextlib.suppress(OSError):  # ENOSPC ends it, as for any writer
                for _ in range(256):
                    written[name] += os.write(fds[name], blocks[name])

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(fill, blocks))
        assert sum(written.values()) < 4 * 256 * MiB  # the disk did fill up
        m.kill9()
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        m.start()
        flushed = m.flush()
        assert flushed.returncode == 0, flushed.stderr
        for name, n in written.items():
            info = s3.head(name)
            assert info is not None and info.size == n, (name, n, info)
            assert s3.get_range(name, 0, n) == (blocks[name] * (n // MiB + 1))[:n]


@pytest.mark.parametrize("fuse_session", ["native"], indirect=True)  # (pyfuse3: 60 s a call)
def test_files_whose_create_failed_on_a_full_cache_disk_never_reach_s3(
        mount_factory, s3, fault_proxy):
    """Issue 29 defect 4: `touch` and `echo >` that failed with ENOSPC later appeared as
    0-byte objects. With the cache disk full and S3 unreachable (nothing can drain),
    creates fail; after a crash and a remount with S3 back, S3 holds what was
    acknowledged and nothing else: no empty objects, nothing past the last write."""
    with _cache_on(mount_factory, "64m", "--max-dirty", "256M",
                         endpoint_url=fault_proxy.endpoint_url) as m:
        (m.path / "d").mkdir()
        assert m.flush().returncode == 0
        fault_proxy.fail = True
        block = random.randbytes(MiB)
        written = 0
        fd = os.open(m.path / "d" / "big.bin", os.O_WRONLY | os.O_CREAT, 0o644)
        with pytest.raises(OSError) as err:
            while True:
                written += os.write(fd, block)
        assert err.value.errno == errno.ENOSPC
        for shell in (f"touch {m.path}/d/touched", f"echo hi > {m.path}/d/echoed",
                      f"head -c 3000000 /dev/zero > {m.path}/d/copied"):
            proc = subprocess.run(["sh", "-c", shell], capture_output=True, text=True)
            assert proc.returncode != 0 and "No space left" in proc.stderr, proc.stderr
        assert os.listdir(m.path / "d") == ["big.bin"]
        m.kill9()
        os.close(fd)
        fault_proxy.fail = False
        m.start()
        assert m.flush().returncode == 0
        assert sorted((o.key, o.size) for o in s3.list_recursive("d/")) == [
            ("d/", 0), ("d/big.bin", written)]
        assert s3.get_range("d/big.bin", 0, written) == (block * (written // MiB + 1))[:written]


@pytest.mark.parametrize("fs", ["ext4", "tmpfs"])
def test_a_passthrough_writer_finds_room_evicted_on_a_disk_full_of_clean_chunks(
        mount_factory, s3, fs):
    """Clean chunks (uploaded files) fill the cache disk; a new file written through
    passthrough (the kernel writes into the cache file, the daemon sees nothing) must
    find room evicted for it, as a write through the daemon does, not ENOSPC. Where the
    file system cannot hold the kernel's writes (tmpfs: no pre-content events), the
    writer takes the daemon path on a disk that short of room."""
    with _cache_on(mount_factory, "48m", "--max-dirty", "16M", fs=fs) as m:
        old = {f"old{i}.bin": random.randbytes(8 * MiB) for i in range(5)}
        try:
            for name, data in old.items():
                (m.path / name).write_bytes(data)
        except OSError as exc:
            pytest.fail(f"{exc}\n{m.log_tail(20)}")
        assert m.flush().returncode == 0
        # each file of one part went up once, as one PutObject
        assert m.status()["counters"]["bytes_uploaded"] == 40 * MiB, str(m.status()["counters"])
        for name, data in old.items():  # read back: every chunk cached, and clean
            assert (m.path / name).read_bytes() == data
        free = os.statvfs(m.cache_dir)
        assert free.f_bavail * free.f_frsize < 16 * MiB, "the clean chunks fill the disk"
        new = random.randbytes(28 * MiB)
        try:
            with open(m.path / "new.bin", "wb") as f:
                for off in range(0, len(new), MiB):
                    f.write(new[off:off + MiB])
        except OSError as exc:
            pytest.fail(f"{exc}\n{m.log_tail(20)}")
        assert m.flush().returncode == 0, m.log_tail()
        assert s3.get_range("new.bin", 0, len(new) + 1) == new
        counters = m.status()["counters"]
        if fs == "ext4":  # the kernel wrote it, and waited while clean chunks were evicted
            assert counters["passthrough_opens"] > 0 and counters["cache_evictions"] > 0


def test_a_cold_read_on_a_cache_disk_full_of_clean_chunks_evicts_for_itself(
        mount_factory, s3):
    """Objects read through a 48 MiB cache disk (--cache-size 1G: the budget never asks
    for eviction): once the disk is full of their clean chunks, the next read's fetch
    evicts the oldest for itself, as a write does; its GET failed with ENOSPC before."""
    objects = {f"o{i}.bin": random.randbytes(8 * MiB) for i in range(8)}
    for key, data in objects.items():
        s3.put(key, data, {})
    with _cache_on(mount_factory, "48m", "--max-dirty", "16M") as m:
        for _ in range(2):
            for key, data in objects.items():
                assert (m.path / key).read_bytes() == data, key
        assert m.counters()["cache_evictions"] > 0


@pytest.mark.parametrize("fuse_session", ["pyfuse3"], indirect=True)
def test_one_file_three_times_the_cache_disk_is_written_whole_and_the_cache_stays_bounded(
        mount_factory, s3):
    """A 144 MiB file through a 48 MiB cache disk (--cache-size 32M): its full chunks go up
    as spilled parts once the cache cannot hold them, are evicted, and the commit copies
    them into the object (D30). Before, the uploaded parts of an open file stayed in the
    cache until its commit: the writer got ENOSPC."""
    data = random.randbytes(144 * MiB)
    with _cache_on(mount_factory, "48m", "--cache-size", "32M", "--max-dirty", "16M") as m:
        most = 0
        with open(m.path / "big.bin", "wb") as f:
            for at in range(0, len(data), 4 * MiB):
                f.write(data[at:at + 4 * MiB])
                most = max(most, m.status()["cache_used"])
        assert m.flush().returncode == 0
        assert s3.get("big.bin")[1] == data
        assert most <= 32 * MiB + 16 * MiB  # the cache size and a margin of two parts
        counters = m.counters()
        assert counters["parts_spilled"] >= 6 and counters["parts_copied"] >= 6
        with open(m.path / "big.bin", "rb") as f:  # (from S3: evicted long ago)
            f.seek(100 * MiB)
            assert f.read(MiB) == data[100 * MiB:101 * MiB]
        assert [o.key for o in s3.list_recursive(".lakefs-mount/spill/")] == []


@pytest.mark.parametrize("fuse_session", ["native"], indirect=True)
def test_while_the_cache_is_short_a_new_writer_takes_the_daemon_path_and_its_parts_spill(
        mount_factory, s3):
    """A passthrough writer holds 40 MiB of a 32 MiB cache open (the daemon cannot evict
    behind it); a file written meanwhile is not opened in passthrough, so its parts can
    spill (D30), and both land whole."""
    first, second = random.randbytes(40 * MiB), random.randbytes(64 * MiB)
    with _cache_on(mount_factory, "256m", "--cache-size", "32M", "--max-dirty", "8M") as m:
        with open(m.path / "first.bin", "wb") as f:
            f.write(first)
            f.flush()
            opened = m.counters().get("passthrough_opens", 0)
            assert opened == 1
            (m.path / "second.bin").write_bytes(second)
            counters = m.counters()
            assert counters.get("passthrough_opens", 0) == opened  # the daemon path
            assert counters["parts_spilled"] >= 3
        assert m.flush().returncode == 0
        assert s3.get("first.bin")[1] == first and s3.get("second.bin")[1] == second
        assert [o.key for o in s3.list_recursive(".lakefs-mount/spill/")] == []

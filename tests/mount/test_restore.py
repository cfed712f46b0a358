"""The restore path through a real mount: objects made by other tools, ranged GETs into the
cache, readahead, eviction under --cache-size, and a warm cache that survives a remount."""

from __future__ import annotations

import hashlib
import os
import random
import resource
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from lakefs_mount.ops.mountpoint import SYSFS_BDI, find_mount

MiB = 1024 * 1024
PART = 8 * MiB


def _upload(s3, bodies: dict[str, bytes]) -> None:
    """Objects made by another tool (boto3), as a training set would be."""
    for key, body in bodies.items():
        s3.put(key, body, {})


def _assert_reads(m, bodies: dict[str, bytes]) -> None:
    """Every file reads back through the mount byte for byte, one after the other."""
    for key, body in bodies.items():
        assert (m.path / key).read_bytes() == body


@pytest.mark.parametrize("size", [0, 1, PART - 1, PART, PART + 1, 5 * PART + 12345])
def test_objects_made_with_boto3_read_byte_identical(mount_factory, s3, size):
    data = random.randbytes(size)
    s3.put(f"obj-{size}", data, {})
    m = mount_factory("--part-size", "8M")
    assert (m.path / f"obj-{size}").read_bytes() == data
    assert os.stat(m.path / f"obj-{size}").st_size == size


def test_the_kernel_reads_ahead_in_whole_1_mib_requests(mount):
    """128 KiB, the kernel's default for a FUSE mount, would make a sequential reader
    cost eight daemon round trips per MiB."""
    entry = find_mount(mount.path)
    assert entry is not None and entry.fstype == "fuse.lakefs-mount"
    assert (SYSFS_BDI / entry.device / "read_ahead_kb").read_text().strip() == "1024"


def test_partial_unaligned_and_concurrent_reads(mount_factory, s3):
    data = random.randbytes(3 * PART + 777)
    s3.put("r.bin", data, {})
    m = mount_factory("--part-size", "8M", "--read-ahead", "0")
    rnd = random.Random(5)
    ranges = [(rnd.randrange(len(data)), rnd.randrange(1, 3 * MiB)) for _ in range(40)]

    def read(r: tuple[int, int]) -> bool:
        off, n = r
        with open(m.path / "r.bin", "rb") as f:
            f.seek(off)
            return f.read(n) == data[off:off + n]

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(read, ranges))
    assert m.counters()["gets"] <= 4  # one GET per chunk, however many readers


def _settled_counters(m, within: float = 5.0) -> dict[str, int]:
    """The daemon's counters once readahead in flight has finished (unchanged for 0.5 s)."""
    deadline = time.monotonic() + within
    last = m.counters()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = m.counters()
        if now == last:
            return now
        last = now
    return last


def test_a_random_reader_fetches_only_the_chunks_it_touches(mount_factory, s3):
    data = random.randbytes(12 * PART)
    s3.put("rand.bin", data, {})
    m = mount_factory("--part-size", "8M", "--read-ahead", "4")
    with open(m.path / "rand.bin", "rb") as f:
        for idx in (9, 2, 6):  # never at offset 0, never where the last read ended
            off = idx * PART + MiB
            f.seek(off)
            assert f.read(4096) == data[off:off + 4096]
    counters = _settled_counters(m)
    assert counters["gets"] == 3
    assert counters["bytes_downloaded"] == 3 * PART


def test_a_sequential_reader_has_the_next_chunks_fetched_ahead_and_no_more(mount_factory, s3):
    data = random.randbytes(12 * PART)
    s3.put("seq.bin", data, {})
    m = mount_factory("--part-size", "8M", "--read-ahead", "4")
    with open(m.path / "seq.bin", "rb") as f:
        assert f.read(4096) == data[:4096]
        counters = _settled_counters(m)
        assert counters["gets"] == 1 + 4  # its chunk, then --read-ahead chunks after it
        assert counters["bytes_downloaded"] == 5 * PART
        f.seek(PART)
        assert f.read() == data[PART:]  # the chunks fetched ahead are not fetched again
    assert m.counters()["gets"] == 12


def test_file_4x_the_cache_size_reads_right_and_the_cache_stays_under_its_cap(
        mount_factory, s3):
    data = random.randbytes(16 * PART)
    s3.put("huge.bin", data, {})
    m = mount_factory("--part-size", "8M", "--cache-size", "32M", "--max-dirty", "16M")
    digest = hashlib.sha256()
    with open(m.path / "huge.bin", "rb") as f:
        while chunk := f.read(MiB):
            digest.update(chunk)
            assert m.status()["cache_used"] <= 32 * MiB + 8 * PART
    assert digest.digest() == hashlib.sha256(data).digest()
    rnd = random.Random(9)
    with open(m.path / "huge.bin", "rb") as f:
        for _ in range(30):
            off = rnd.randrange(len(data) - 5000)
            f.seek(off)
            assert f.read(5000) == data[off:off + 5000]
    time.sleep(0.5)
    status = m.status()
    assert status["cache_used"] <= 40 * MiB
    assert status["counters"]["cache_evictions"] > 0


def test_remount_reuses_the_warm_cache_without_gets(mount_factory, s3):
    data = random.randbytes(3 * PART + 5)
    s3.put("warm.bin", data, {})
    m = mount_factory("--part-size", "8M")
    assert (m.path / "warm.bin").read_bytes() == data
    assert m.counters()["gets"] >= 1
    assert m.unmount().returncode == 0
    m.start()
    assert (m.path / "warm.bin").read_bytes() == data
    assert m.counters().get("gets", 0) == 0


def test_an_object_changed_in_s3_while_unmounted_is_not_served_from_the_cache(
        mount_factory, s3):
    s3.put("c.bin", b"old" * 1000, {})
    m = mount_factory("--part-size", "8M")
    assert (m.path / "c.bin").read_bytes() == b"old" * 1000
    assert m.unmount().returncode == 0
    s3.put("c.bin", b"new!" * 1000, {})
    m.start()
    assert (m.path / "c.bin").read_bytes() == b"new!" * 1000


def test_an_object_overwritten_with_boto3_reads_new_content_after_the_ttl(mount_factory, s3):
    s3.put("o.txt", b"version one", {})
    m = mount_factory("--metadata-ttl", "0.5")
    assert (m.path / "o.txt").read_bytes() == b"version one"
    s3.put("o.txt", b"version two, longer", {})
    time.sleep(1.5)
    os.listdir(m.path)  # a listing after the TTL sees the new ETag
    assert (m.path / "o.txt").read_bytes() == b"version two, longer"


def test_tiny_max_dirty_with_a_slow_backend_still_lands_every_byte(mount_factory, s3,
                                                                   fault_proxy):
    """Writers wait for the flusher instead of failing; nothing is dropped."""
    fault_proxy.delay_seconds = 0.05
    m = mount_factory("--part-size", "8M", "--max-dirty", "16M", "--cache-size", "64M",
                      endpoint_url=fault_proxy.endpoint_url)
    files = {f"bp{i}.bin": random.randbytes(12 * MiB + i) for i in range(3)}
    for name, data in files.items():
        (m.path / name).write_bytes(data)
    assert m.flush().returncode == 0
    for name, data in files.items():
        assert hashlib.sha256(s3.get_range(name, 0, len(data) + 1)).digest() == \
            hashlib.sha256(data).digest()
    assert m.counters().get("writer_waits", 0) > 0


def test_a_small_object_opened_by_name_costs_one_get_and_no_head(mount_factory, s3):
    """Training data: lookup + open + read of a small object is one GET (its metadata comes
    with the body), not a HEAD and then a GET."""
    bodies = {f"train/f{i:03d}.bin": random.randbytes(100 * 1024 + i) for i in range(20)}
    _upload(s3, bodies)
    m = mount_factory()
    before = m.counters()
    _assert_reads(m, bodies)
    after = m.counters()
    assert after.get("heads", 0) - before.get("heads", 0) == 0
    assert after.get("gets", 0) - before.get("gets", 0) == len(bodies)
    # their cache entries reach the journal (batched) before a clean exit: a remount is warm
    assert m.unmount().returncode == 0
    m.start()
    _assert_reads(m, bodies)
    assert m.counters().get("gets", 0) == 0


def test_a_training_set_that_fits_the_cache_size_stays_cached_across_a_remount(
        mount_factory, s3):
    """--cache-size counts the bytes small files hold: 5 MB of 50 KB objects fit a 16 MiB
    cache (counted as whole 16 MiB chunks, one file at a time fitted and the rest were
    evicted), so the next epoch, even after a remount, sends no GET."""
    bodies = {f"set/f{i:03d}.bin": random.randbytes(50_000 + i) for i in range(100)}
    _upload(s3, bodies)
    m = mount_factory("--cache-size", "16M", "--max-dirty", "16M")
    _assert_reads(m, bodies)
    assert m.counters().get("cache_evictions", 0) == 0
    assert m.unmount().returncode == 0
    m.start()
    _assert_reads(m, bodies)
    assert m.counters().get("gets", 0) == 0


def test_more_files_than_the_daemon_may_open_read_and_write_right(mount_factory, s3):
    """A training set of more files than the daemon has descriptors: reads once kept every
    cache file open, until EMFILE failed the reads and then killed the daemon (found with
    20,000 files). Cache files beyond the budget are closed and reopened on demand."""
    bodies = {f"train/f{i:04d}.bin": random.randbytes(2000 + i) for i in range(500)}
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda kv: s3.put(kv[0], kv[1], {}), bodies.items()))
    m = mount_factory()
    assert m.pid is not None
    in_use = len(os.listdir(f"/proc/{m.pid}/fd"))
    limit = in_use + 100
    resource.prlimit(m.pid, resource.RLIMIT_NOFILE, (limit, limit))
    _assert_reads(m, bodies)
    written = {f"out/f{i:03d}": random.randbytes(3000 + i) for i in range(150)}
    for name, body in written.items():
        (m.path / name).parent.mkdir(exist_ok=True)
        (m.path / name).write_bytes(body)
    assert m.flush().returncode == 0
    for name, body in written.items():
        got = s3.get(name)
        assert got is not None and got[1] == body
    _assert_reads(m, bodies)  # a second epoch
    assert len(os.listdir(f"/proc/{m.pid}/fd")) <= limit
    assert m.unmount().returncode == 0


def test_after_the_ttl_one_listing_revalidates_a_directory_instead_of_a_head_per_open(
        mount_factory, s3):
    """Training epochs: once the TTL has passed, the lookup's LIST of the directory confirms
    the ETag of every file in it, so reopening them costs no HEAD each (close-to-open
    still holds: a file changed in S3 shows a new ETag in that listing)."""
    bodies = {f"epoch/f{i}.bin": random.randbytes(50_000 + i) for i in range(10)}
    _upload(s3, bodies)
    m = mount_factory("--metadata-ttl", "0.5")
    _assert_reads(m, bodies)
    bodies["epoch/f0.bin"] = b"written elsewhere"
    s3.put("epoch/f0.bin", bodies["epoch/f0.bin"], {})
    time.sleep(1.5)  # past the TTL and the kernel's entry and attribute timeouts
    before = m.counters()
    _assert_reads(m, bodies)
    after = m.counters()
    assert after.get("heads", 0) - before.get("heads", 0) == 0
    assert after.get("gets", 0) - before.get("gets", 0) == 1  # only the changed file
    assert after.get("lists", 0) - before.get("lists", 0) >= 1


def test_readers_revalidating_a_directory_share_one_listing(mount_factory, s3,
                                                           fault_proxy):
    """After the TTL every lookup in a directory needs its listing again: the ones that
    arrive while it is under way wait for it instead of each sending the same LIST."""
    bodies = {f"shared/f{i}.bin": random.randbytes(2000 + i) for i in range(8)}
    _upload(s3, bodies)
    m = mount_factory("--metadata-ttl", "0.5", endpoint_url=fault_proxy.endpoint_url)

    def read_all() -> dict[str, bytes]:
        with ThreadPoolExecutor(len(bodies)) as pool:
            read = pool.map(lambda k: (m.path / k).read_bytes(), bodies)
            return dict(zip(bodies, read, strict=True))

    assert read_all() == bodies
    time.sleep(1.5)  # past the TTL and the kernel's entry and attribute timeouts
    before = m.counters().get("lists", 0)
    fault_proxy.delay_seconds = 0.3  # the LIST is still under way when all 8 look up
    assert read_all() == bodies
    fault_proxy.delay_seconds = 0
    assert m.counters().get("lists", 0) - before <= 2  # "shared/" and perhaps the root


@pytest.mark.parametrize("fuse_session", ["native", "pyfuse3"], indirect=True)
def test_a_small_file_comes_with_its_open_and_stays_coherent(mount_factory, s3):
    """A small file opened for reading, with all its bytes cached, goes into the kernel's
    page cache with the open (pyfuse3), or the kernel reads its cache file itself (native
    session, passthrough): its first read costs no request; a version written elsewhere
    replaces it after the TTL, and a writer's bytes replace it at once."""
    bodies = {f"fill/f{i}.bin": random.randbytes(1000 * (i + 1)) for i in range(8)}
    _upload(s3, bodies)
    m = mount_factory("--metadata-ttl", "0.5")
    _assert_reads(m, bodies)
    c = m.counters()
    assert c.get("page_cache_fills", 0) + c.get("passthrough_opens", 0) == len(bodies)
    if m.status()["fuse_session"] == "native":
        assert c.get("read_requests", 0) == 0
    s3.put("fill/f0.bin", b"new version", {})
    time.sleep(1.5)
    assert (m.path / "fill/f0.bin").read_bytes() == b"new version"
    (m.path / "fill/f1.bin").write_bytes(b"written here")
    assert (m.path / "fill/f1.bin").read_bytes() == b"written here"
    with open(m.path / "fill/f2.bin", "r+b") as f:
        f.seek(10)
        f.write(b"XY")
    expected = bodies["fill/f2.bin"][:10] + b"XY" + bodies["fill/f2.bin"][12:]
    assert (m.path / "fill/f2.bin").read_bytes() == expected


def test_metadata_of_a_small_object_fetched_at_lookup_is_applied(mount_factory, s3):
    writer = mount_factory(name="writer")
    (writer.path / "secret.txt").write_bytes(b"k" * 5000)
    os.chmod(writer.path / "secret.txt", 0o600)
    os.utime(writer.path / "secret.txt", ns=(1_600_000_000_123_456_789,) * 2)
    assert writer.unmount().returncode == 0
    reader = mount_factory(name="reader")  # empty cache: everything comes from S3
    st = os.stat(reader.path / "secret.txt")
    assert (st.st_mode & 0o7777, st.st_mtime_ns, st.st_size) == \
        (0o600, 1_600_000_000_123_456_789, 5000)
    assert (reader.path / "secret.txt").read_bytes() == b"k" * 5000
    assert reader.counters().get("heads", 0) == 0

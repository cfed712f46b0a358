"""A training loop's namespace in a black-holed S3 (issue 30, what the first pass left):
the first step after S3 goes quiet runs at local speed, also when the mount never listed
the directories it writes in; a directory rename, an unlink of an open file and a kill -9
during the black hole lose nothing and wait for nothing. A real mount, SeaweedFS and the
fault proxy (`hang`: connections accepted, never answered)."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import threading
import time

import pytest

from lakefs_mount.s3.layout import encode_attrs
from tests.faultproxy import listing
from tests.mount.test_namespace_writeback import bucket_tree, save_checkpoint, tree

MiB = 1024 * 1024


def training_steps(run, steps) -> list[float]:
    """Seconds each step of a training-like loop took (makedirs, save, rename, delete)."""
    seconds = []
    for step in steps:
        started = time.monotonic()
        os.makedirs(run / f"logs/step_{step}", exist_ok=True)
        save_checkpoint(run / f"tmp-{step}", step)
        os.rename(run / f"tmp-{step}", run / f"checkpoint-{step}")
        if (run / f"checkpoint-{step - 2}").exists():
            shutil.rmtree(run / f"checkpoint-{step - 2}")
        seconds.append(time.monotonic() - started)
    return seconds


def test_the_first_step_in_a_black_hole_runs_at_local_speed(mount_factory, s3, fault_proxy):
    """Names in directories listed before the TTL ran out: the lookup that finds S3 quiet
    waits a moment measured from S3's own listing times, not 2 s."""
    m = mount_factory("--metadata-ttl", "1", endpoint_url=fault_proxy.endpoint_url)
    run = m.path / "run"
    healthy = training_steps(run, [0, 1])
    assert m.flush().returncode == 0
    time.sleep(1.2)  # past the TTL: the step looks its names up in S3 again
    fault_proxy.hang = True
    try:
        quiet = training_steps(run, [2, 3])
    finally:
        fault_proxy.hang = False
    print("seconds per step, healthy:", healthy, "black hole:", quiet)
    assert quiet[0] < 1.0, (quiet, m.log_tail(80))
    assert m.flush().returncode == 0, m.log_tail()
    assert bucket_tree(s3) == {"run/" + k: v for k, v in tree(run).items()}


def test_a_first_step_in_directories_never_listed_does_not_wait_for_s3(
        mount_factory, s3, fault_proxy):
    """A mount whose user never listed its root (nor the run directory a job resumes in)
    when S3 goes quiet: the first step waited 31 s (the attributes of `run/`, a listing of
    3 attempts of 10 s, then its listing). The root's listing at mount shows the outage in
    a moment; `run/`'s attributes and listing land later, and the names the loop makes
    replace any remote ones."""
    s3.put("run/checkpoint-0/meta.json", b"old", {})
    m = mount_factory("--metadata-ttl", "1", endpoint_url=fault_proxy.endpoint_url)
    fault_proxy.hang = True
    try:
        quiet = training_steps(m.path / "run", [2, 3])
    finally:
        fault_proxy.hang = False
    print("seconds per step in a black hole, nothing listed before:", quiet)
    assert quiet[0] < 1.0, (quiet, m.log_tail(80))
    assert quiet[1] < 1.0, (quiet, m.log_tail(80))
    assert m.flush().returncode == 0, m.log_tail()
    assert bucket_tree(s3) == {"run/" + k: v for k, v in tree(m.path / "run").items()}


def test_unlink_of_an_open_file_not_cached_returns_at_once_and_the_descriptor_reads_it(
        mount_factory, s3, fault_proxy):
    """The unlink used to read the whole object first (so that the open descriptor could
    still read it): in a black hole it waited for S3. Now the object stays in S3 until
    the descriptor's bytes are in the cache, and its DELETE goes after."""
    data = os.urandom(40 * 1024 * 1024)
    s3.put("shard.bin", data, {})
    m = mount_factory("--read-ahead", "0", "--part-size", "8M",
                      endpoint_url=fault_proxy.endpoint_url)
    with open(m.path / "shard.bin", "rb") as f:
        assert f.read(4096) == data[:4096]  # one 8 MiB chunk cached, 4 only in S3
        fault_proxy.hang = True
        try:
            started = time.monotonic()
            os.unlink(m.path / "shard.bin")
            took = time.monotonic() - started
            assert not (m.path / "shard.bin").exists()
            time.sleep(10)  # a black hole of 10 s
        finally:
            fault_proxy.hang = False
        assert took < 1.0, (took, m.log_tail())
        assert f.read() == data[4096:]  # POSIX: the open descriptor reads every byte
    assert m.flush().returncode == 0, m.log_tail()
    assert s3.head("shard.bin") is None
    assert "shard.bin" not in os.listdir(m.path)


def test_renaming_a_directory_never_listed_in_a_black_hole_is_written_back_later(
        mount_factory, s3, fault_proxy):
    """The rename needed the names below it and failed with EIO after 30 s; now the move
    of the prefix is journaled at once and S3 lists the tree when it applies it. In the
    meantime the mount lists the moved directories where S3 still has them."""
    bodies = {"ckpt/shards/a.bin": os.urandom(1000), "ckpt/shards/deep/b.bin": b"b",
              "ckpt/meta.json": b"{}"}
    for key, body in bodies.items():
        s3.put(key, body, {})
    m = mount_factory(endpoint_url=fault_proxy.endpoint_url)
    assert "ckpt" in os.listdir(m.path)  # known by name; nothing below it listed yet
    fault_proxy.hang = True
    try:
        started = time.monotonic()
        os.rename(m.path / "ckpt", m.path / "ckpt-final")
        took = time.monotonic() - started
        (m.path / "ckpt-final" / "new.txt").write_bytes(b"new")
    finally:
        fault_proxy.hang = False
    assert took < 6.0, (took, m.log_tail())
    want = {k.replace("ckpt/", "ckpt-final/", 1): v for k, v in bodies.items()}
    want["ckpt-final/new.txt"] = b"new"
    assert {"ckpt-final/" + k: v for k, v in tree(m.path / "ckpt-final").items()} == want
    assert m.flush().returncode == 0, m.log_tail()
    assert bucket_tree(s3) == want
    assert not (m.path / "ckpt").exists()


def test_a_listed_file_whose_attributes_were_never_read_answers_from_the_listing(
        mount_factory, s3, fault_proxy):
    """Objects of another tool: the listing gave their size, time and ETag, their mode and
    owner are in user metadata a HEAD reads. In a black hole a lookup waited 30 s for it;
    now it answers from the listing within a lookup's patience (said once per directory),
    and the metadata lands when S3 answers."""
    meta = encode_attrs(stat.S_IFREG | 0o600, os.getuid(), os.getgid(), 1_600_000_000 * 10**9)
    big = os.urandom(300_000)  # above the size a lookup fetches whole
    s3.put("data/shard-0.bin", big, meta)
    s3.put("data/shard-1.bin", b"x" * 100, meta)
    s3.put("data/latest", b"shard-0.bin", {"symlink": "1"})  # a symlink s3fs-style
    m = mount_factory("--metadata-ttl", "1", endpoint_url=fault_proxy.endpoint_url)
    assert not (m.path / "data" / "absent").exists()  # lists data/, reads no attributes
    fault_proxy.hang = True
    try:
        started = time.monotonic()
        first = os.stat(m.path / "data" / "shard-0.bin")
        took = time.monotonic() - started
        second = os.stat(m.path / "data" / "shard-1.bin")
        link = os.lstat(m.path / "data" / "latest")
        took_all = time.monotonic() - started
    finally:
        fault_proxy.hang = False
    assert took < 3.0 and took_all < 3.0, (took, took_all, m.log_tail())
    assert (first.st_size, second.st_size) == (300_000, 100)
    assert stat.S_ISREG(first.st_mode) and stat.S_ISREG(link.st_mode)  # (S3 cannot say)
    assert abs(first.st_mtime - time.time()) < 600  # the listing's LastModified
    assert m.log_tail(200).count("answered from the listing") == 1, m.log_tail()

    def metadata_landed() -> bool:
        st = os.stat(m.path / "data" / "shard-0.bin")
        return stat.S_IMODE(st.st_mode) == 0o600 and int(st.st_mtime) == 1_600_000_000

    deadline = time.monotonic() + 40
    while not metadata_landed() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert metadata_landed(), m.log_tail()
    assert (m.path / "data" / "shard-0.bin").read_bytes() == big

    def is_a_symlink() -> bool:  # (its name gets a new inode: the old one's type is wrong)
        try:
            return os.readlink(m.path / "data" / "latest") == "shard-0.bin"
        except OSError:
            return False

    while not is_a_symlink() and time.monotonic() < deadline + 15:
        time.sleep(0.5)
    assert is_a_symlink(), m.log_tail()
    assert (m.path / "data" / "latest").read_bytes() == big


def test_ls_and_rmdir_of_a_directory_never_listed_fail_fast_in_a_black_hole(
        mount_factory, s3, fault_proxy):
    """`ls` and `rmdir` need S3's listing of a directory this mount never listed (another
    writer may have filled it). They waited 30 s for it and failed with EIO; now EIO comes
    within a lookup's patience (S3 is asked again later), the directory and its objects
    stay, and once S3 answers both work."""
    s3.put("old/ckpt-0/model.pt", b"weights", {})
    s3.put("empty/", b"", {})
    m = mount_factory("--metadata-ttl", "1", endpoint_url=fault_proxy.endpoint_url)
    assert sorted(os.listdir(m.path)) == ["empty", "old"]  # the root; nothing below it
    fault_proxy.hang = True
    try:
        for attempt in range(2):  # the first finds S3 quiet, the second knows it is
            for call in (lambda: os.listdir(m.path / "old"),
                         lambda: os.rmdir(m.path / "empty")):
                started = time.monotonic()
                with pytest.raises(OSError) as err:
                    call()
                took = time.monotonic() - started
                assert err.value.errno == errno.EIO, err.value
                assert took < 5.0, (attempt, took, m.log_tail())
    finally:
        fault_proxy.hang = False
    assert "was never listed" in m.log_tail(200), m.log_tail()
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        try:
            listed = os.listdir(m.path / "old")
            break
        except OSError:
            time.sleep(0.5)
    assert listed == ["ckpt-0"]
    os.rmdir(m.path / "empty")
    assert m.flush().returncode == 0, m.log_tail()
    assert s3.head("empty/") is None and s3.head("old/ckpt-0/model.pt") is not None


def test_a_lookup_in_a_directory_never_listed_waits_for_a_slow_listing_while_s3_answers(
        mount_factory, s3, fault_proxy):
    """A huge directory may take S3 seconds to list: while S3 answers the rest (the HEAD
    that asks whether it answers at all), a lookup there waits for the listing instead
    of answering ENOENT from what the mount knows (which a create would take as a new
    name, replacing the object)."""
    s3.put("huge/shard-7.bin", b"seven", {})
    fault_proxy.parse_requests = True
    m = mount_factory(endpoint_url=fault_proxy.endpoint_url)
    assert "huge" in os.listdir(m.path)  # known by name, never listed
    fault_proxy.hold_requests(lambda method, target: "list-type=2" in target
                              and "prefix=huge%2F" in target)
    release = threading.Timer(4.0, fault_proxy.hold_requests, [None])
    release.start()
    try:
        started = time.monotonic()
        body = (m.path / "huge" / "shard-7.bin").read_bytes()
        took = time.monotonic() - started
    finally:
        release.join()
    assert body == b"seven"
    assert took >= 3.5, took  # it waited for the listing (held 4 s), not a moment


def test_renaming_a_file_whose_upload_is_open_waits_for_no_abort_and_leaves_no_old_name(
        mount_factory, s3, fault_proxy):
    """An atomic saver's rename of `.tmp` while its parts stream: the rename waited for
    the abort of the upload at the old name (in a black hole, until S3 answered), or,
    where S3 had seemed slow, kept the upload and completed it at the old name, which a
    crash then left in the bucket (docs/durability.md, D13). Now the upload leaves the
    file at once, the parts go again to the new name, and the abort follows in the
    background."""
    m = mount_factory("--part-size", "8M", "--commit-delay", "60",
                      endpoint_url=fault_proxy.endpoint_url)
    data = os.urandom(40 * MiB + 3)
    with open(m.path / "model.safetensors.tmp", "wb") as f:
        f.write(data)
        deadline = time.monotonic() + 30
        while not s3.list_multipart_uploads(""):  # full parts stream while it is open
            assert time.monotonic() < deadline, m.log_tail()
            time.sleep(0.1)
    fault_proxy.hang = True
    try:
        started = time.monotonic()
        os.rename(m.path / "model.safetensors.tmp", m.path / "model.safetensors")
        took = time.monotonic() - started
    finally:
        fault_proxy.hang = False
    assert took < 1.0, (took, m.log_tail())
    assert m.flush(timeout=120).returncode == 0, m.log_tail()
    assert s3.get("model.safetensors")[1] == data
    assert s3.head("model.safetensors.tmp") is None
    deadline = time.monotonic() + 30
    while s3.list_multipart_uploads(""):  # the abort, once S3 answers again
        assert time.monotonic() < deadline, m.log_tail()
        time.sleep(0.2)


def test_a_lookup_in_a_directory_never_listed_waits_for_s3_after_a_slow_listing(
        mount_factory, s3, fault_proxy):
    """DCP's `.metadata` was missing after a cold remount (issue 31): on a loaded machine
    one listing took longer than a lookup's patience, so S3 counted as slow for 10 s,
    and a lookup in a directory never listed then answered ENOENT at once from what the
    mount knew (nothing there), although S3 answered everything else. Now the listing
    gets a lookup's patience, and longer while S3 answers anything (an outage, where
    nothing answers, costs one patience per directory)."""
    s3.put("ckpt/.metadata", b"meta", {})
    fault_proxy.parse_requests = True
    m = mount_factory("--metadata-ttl", "1", endpoint_url=fault_proxy.endpoint_url)
    time.sleep(1.2)  # the root's listing at mount is past its TTL
    fault_proxy.hold_requests(lambda method, target: "list-type=2" in target
                              and "prefix=&" in target + "&")  # the root's listings only
    try:
        assert os.listdir(m.path) == ["ckpt"]  # from the last listing, after the patience
        assert "serving the last listing" in m.log_tail(), m.log_tail()  # S3 is "slow"
        assert (m.path / "ckpt" / ".metadata").read_bytes() == b"meta", m.log_tail()
    finally:
        fault_proxy.hold_requests(None)


def test_a_slow_listing_while_s3_answers_other_requests_does_not_count_s3_as_slow(
        mount_factory, s3, fault_proxy):
    """One listing past a lookup's patience counted S3 as slow for 10 s even while S3
    answered everything else (a loaded S3, issue 30): meanwhile an open after the TTL
    served the version last seen without asking S3. Now S3 counts as slow only if
    nothing answered while the listing kept the lookup waiting."""
    s3.put("d/a.txt", b"version 1", {})
    s3.put("e/x.bin", b"x", {})
    for i in range(40):
        s3.put(f"g/{i}.bin", bytes([i]) * 100, {})
    fault_proxy.parse_requests = True
    m = mount_factory("--metadata-ttl", "0.5", endpoint_url=fault_proxy.endpoint_url)
    assert (m.path / "d" / "a.txt").read_bytes() == b"version 1"
    assert os.listdir(m.path / "e") == ["x.bin"]
    assert len(os.listdir(m.path / "g")) == 40
    time.sleep(0.6)  # e's listing is past its TTL: `ls` lists it again
    fault_proxy.delay_requests(listing("e/", recursive=False), 3.0)  # > any patience
    looked_up = threading.Event()
    lookup = threading.Thread(
        target=lambda: (os.listdir(m.path / "e"), looked_up.set()))
    lookup.start()
    for i in range(40):  # S3 answers the mount's other requests meanwhile (GETs)
        if looked_up.is_set():
            break
        assert (m.path / "g" / f"{i}.bin").read_bytes() == bytes([i]) * 100
        time.sleep(0.05)
    lookup.join(30)
    assert looked_up.is_set()  # from the last listing, after the patience
    assert fault_proxy.requests_held >= 1
    s3.put("d/a.txt", b"version 2", {})
    time.sleep(0.6)  # past the TTL: the next open asks S3
    assert (m.path / "d" / "a.txt").read_bytes() == b"version 2", m.log_tail()

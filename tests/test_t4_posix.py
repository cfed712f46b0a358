"""POSIX semantics end to end: real FUSE mount, real SeaweedFS, checked through S3 too."""

from __future__ import annotations

import ctypes
import errno
import os
import random
import stat
import time
from pathlib import Path

import pytest

MiB = 1024 * 1024
RENAME_NOREPLACE = 1
AT_FDCWD = -100
_libc = ctypes.CDLL(None, use_errno=True)


def flushed(mount) -> None:
    proc = mount.flush()
    assert proc.returncode == 0, f"flush failed: {proc.stdout}\n{proc.stderr}"


def unmounted(mount) -> None:
    proc = mount.unmount()
    assert proc.returncode == 0, f"unmount failed: {proc.stdout}\n{proc.stderr}"


def renameat2(src: Path, dst: Path, flags: int) -> None:
    """`renameat2(2)`, which `os` does not expose; raises OSError like `os.rename`."""
    if _libc.renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(src))


def keys(s3, prefix: str = "") -> set[str]:
    return {o.key for o in s3.list_recursive(prefix)}


def body(s3, key: str) -> bytes:
    info = s3.head(key)
    assert info is not None, f"{key} is not in S3"
    return s3.get_range(key, 0, max(info.size, 1)) if info.size else b""


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


# -- names and attributes ---------------------------------------------------------------


def test_lookup_of_missing_name_is_enoent_and_getattr_of_new_file_is_regular(mount):
    with pytest.raises(FileNotFoundError):
        os.stat(mount.path / "missing")
    (mount.path / "f").write_bytes(b"abc")
    st = os.stat(mount.path / "f")
    assert stat.S_ISREG(st.st_mode)
    assert st.st_size == 3
    assert st.st_nlink == 1
    assert stat.S_ISDIR(os.stat(mount.path).st_mode)


def test_create_write_read_back_before_and_after_flush(mount, s3):
    data = os.urandom(100_000)
    (mount.path / "data.bin").write_bytes(data)
    assert (mount.path / "data.bin").read_bytes() == data
    flushed(mount)
    assert body(s3, "data.bin") == data
    assert (mount.path / "data.bin").read_bytes() == data


def test_truncate_shrinks_and_grows_with_zeros(mount, s3):
    path = mount.path / "t"
    path.write_bytes(b"0123456789")
    flushed(mount)
    os.truncate(path, 4)
    assert path.read_bytes() == b"0123"
    os.truncate(path, 3 * MiB)
    content = path.read_bytes()
    assert len(content) == 3 * MiB
    assert content[:4] == b"0123" and content[4:] == bytes(3 * MiB - 4)
    flushed(mount)
    assert s3.head("t").size == 3 * MiB
    assert body(s3, "t")[:8] == b"0123\0\0\0\0"


def test_ftruncate_on_open_file_then_write_past_end_leaves_hole(mount, s3):
    path = mount.path / "ft"
    with open(path, "wb") as f:
        f.write(b"x" * 1000)
        f.truncate(10)
        f.seek(20)
        f.write(b"y")
    assert path.read_bytes() == b"x" * 10 + bytes(10) + b"y"
    flushed(mount)
    assert body(s3, "ft") == b"x" * 10 + bytes(10) + b"y"


def test_chmod_chown_utime_persist_as_s3_metadata_and_after_remount(mount_factory, s3):
    first = mount_factory()
    path = first.path / "attrs"
    path.write_bytes(b"payload")
    os.chmod(path, 0o640)
    os.chown(path, 1234, 5678)
    mtime_ns = 1_600_000_000_123_456_789
    os.utime(path, ns=(mtime_ns, mtime_ns))
    st = os.stat(path)
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o640, 1234, 5678)
    assert st.st_mtime_ns == mtime_ns
    flushed(first)
    meta = s3.head("attrs").metadata
    assert int(meta["mode"]) == stat.S_IFREG | 0o640
    assert (int(meta["uid"]), int(meta["gid"])) == (1234, 5678)
    assert abs(float(meta["mtime"]) - mtime_ns / 1e9) < 1e-6
    unmounted(first)

    second = mount_factory(name="second")
    st = os.stat(second.path / "attrs")
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o640, 1234, 5678)
    assert stat.S_ISREG(st.st_mode)
    assert abs(st.st_mtime_ns - mtime_ns) < 1000  # float seconds in metadata: sub-µs loss
    assert (second.path / "attrs").read_bytes() == b"payload"


def test_chmod_of_committed_file_changes_metadata_but_not_content(mount, s3):
    path = mount.path / "c"
    path.write_bytes(b"content")
    flushed(mount)
    os.chmod(path, 0o600)
    flushed(mount)
    info = s3.head("c")
    assert int(info.metadata["mode"]) == stat.S_IFREG | 0o600
    assert body(s3, "c") == b"content"


def test_chmod_of_directory_persists_in_its_marker_and_after_remount(mount_factory, s3):
    first = mount_factory()
    os.mkdir(first.path / "d")
    os.chmod(first.path / "d", 0o700)
    os.chown(first.path / "d", 42, 43)
    assert int(s3.head("d/").metadata["mode"]) == stat.S_IFDIR | 0o700
    unmounted(first)
    second = mount_factory(name="second")
    st = os.stat(second.path / "d")
    assert stat.S_ISDIR(st.st_mode)
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o700, 42, 43)


# -- open flags -------------------------------------------------------------------------


def test_open_with_o_trunc_empties_committed_file(mount, s3):
    path = mount.path / "tr"
    path.write_bytes(b"long old content")
    flushed(mount)
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        assert os.fstat(fd).st_size == 0
        os.write(fd, b"new")
    finally:
        os.close(fd)
    assert path.read_bytes() == b"new"
    flushed(mount)
    assert body(s3, "tr") == b"new"


def test_o_append_writes_go_to_the_end(mount, s3):
    path = mount.path / "log"
    path.write_bytes(b"first\n")
    flushed(mount)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, b"second\n")
        os.write(fd, b"third\n")
    finally:
        os.close(fd)
    assert path.read_bytes() == b"first\nsecond\nthird\n"
    flushed(mount)
    assert body(s3, "log") == b"first\nsecond\nthird\n"


def test_create_exclusive_on_existing_name_is_eexist(mount):
    (mount.path / "x").write_bytes(b"1")
    with pytest.raises(FileExistsError):
        os.open(mount.path / "x", os.O_CREAT | os.O_EXCL | os.O_WRONLY)


# -- directories ------------------------------------------------------------------------


def test_mkdir_writes_marker_and_rmdir_removes_it(mount, s3):
    os.mkdir(mount.path / "empty")
    assert s3.head("empty/") is not None
    assert stat.S_ISDIR(os.stat(mount.path / "empty").st_mode)
    with pytest.raises(FileExistsError):
        os.mkdir(mount.path / "empty")
    os.rmdir(mount.path / "empty")
    assert s3.head("empty/") is None
    assert not (mount.path / "empty").exists()


def test_rmdir_of_non_empty_directory_is_enotempty(mount, s3):
    os.mkdir(mount.path / "full")
    (mount.path / "full" / "f").write_bytes(b"x")
    with pytest.raises(OSError) as exc:
        os.rmdir(mount.path / "full")
    assert exc.value.errno == errno.ENOTEMPTY
    flushed(mount)
    s3.put("remote/only", b"r", {})
    with pytest.raises(OSError) as exc:
        os.rmdir(mount.path / "remote")
    assert exc.value.errno == errno.ENOTEMPTY


def test_rmdir_of_file_is_enotdir_and_unlink_of_dir_is_eisdir(mount):
    (mount.path / "f").write_bytes(b"x")
    os.mkdir(mount.path / "d")
    with pytest.raises(NotADirectoryError):
        os.rmdir(mount.path / "f")
    with pytest.raises(OSError) as exc:
        os.unlink(mount.path / "d")
    assert exc.value.errno in (errno.EISDIR, errno.EPERM)


def test_readdir_merges_s3_objects_and_cache_only_files(mount_factory, s3):
    m = mount_factory("--metadata-ttl", "0.5")
    os.mkdir(m.path / "dir")
    (m.path / "dir" / "local").write_bytes(b"pending")  # not flushed: cache only
    assert sorted(os.listdir(m.path / "dir")) == ["local"]
    s3.put("dir/remote", b"from boto3", {})
    s3.put("dir/sub/deep", b"deep", {})
    assert wait_for(lambda: sorted(os.listdir(m.path / "dir")) == ["local", "remote", "sub"])
    assert (m.path / "dir" / "remote").read_bytes() == b"from boto3"
    assert (m.path / "dir" / "sub" / "deep").read_bytes() == b"deep"
    assert (m.path / "dir" / "local").read_bytes() == b"pending"


def test_object_deleted_in_s3_disappears_after_ttl(mount_factory, s3):
    m = mount_factory("--metadata-ttl", "0.5")
    s3.put("gone", b"x", {})
    assert wait_for(lambda: "gone" in os.listdir(m.path))
    s3.delete("gone")
    assert wait_for(lambda: "gone" not in os.listdir(m.path))


def test_object_written_by_other_tool_has_sensible_defaults(mount, s3):
    data = os.urandom(5000)
    s3.put("foreign/obj.bin", data, {})
    st = os.stat(mount.path / "foreign" / "obj.bin")
    assert stat.S_ISREG(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o644
    assert st.st_size == len(data)
    assert abs(st.st_mtime - time.time()) < 120
    assert stat.S_ISDIR(os.stat(mount.path / "foreign").st_mode)
    assert (mount.path / "foreign" / "obj.bin").read_bytes() == data
    entries = {e.name: e for e in os.scandir(mount.path / "foreign")}
    assert entries["obj.bin"].is_file() and not entries["obj.bin"].is_symlink()


# -- unlink -----------------------------------------------------------------------------


def test_unlink_removes_object_from_s3(mount, s3):
    (mount.path / "u").write_bytes(b"x")
    flushed(mount)
    os.unlink(mount.path / "u")
    assert s3.head("u") is None
    assert not (mount.path / "u").exists()
    with pytest.raises(FileNotFoundError):
        os.unlink(mount.path / "u")


def test_unlink_of_open_file_keeps_data_readable_until_close(mount, s3):
    data = os.urandom(3 * MiB)
    (mount.path / "open").write_bytes(data)
    flushed(mount)
    with open(mount.path / "open", "rb") as f:
        os.unlink(mount.path / "open")
        assert not (mount.path / "open").exists()
        assert f.read() == data
    flushed(mount)
    assert s3.head("open") is None
    assert "open" not in os.listdir(mount.path)


def test_unlink_of_open_uncached_s3_object_keeps_data_readable(mount, s3):
    data = os.urandom(2 * MiB)
    s3.put("remote-open", data, {})
    with open(mount.path / "remote-open", "rb") as f:
        os.unlink(mount.path / "remote-open")
        assert f.read() == data
    assert s3.head("remote-open") is None


def test_writes_to_unlinked_open_file_never_reach_s3(mount_factory, s3):
    m = mount_factory()
    f = open(m.path / "ghost", "wb")
    f.write(b"a" * 1000)
    f.flush()
    os.unlink(m.path / "ghost")
    f.write(b"b" * 1000)
    f.close()
    flushed(m)
    unmounted(m)
    again = mount_factory(name="again")  # a fresh cache: nothing recovered either
    assert "ghost" not in os.listdir(again.path)
    assert s3.head("ghost") is None


# -- rename -----------------------------------------------------------------------------


def test_rename_file_moves_object_and_keeps_inode(mount, s3):
    (mount.path / "a").write_bytes(b"A")
    flushed(mount)
    ino = os.stat(mount.path / "a").st_ino
    os.rename(mount.path / "a", mount.path / "b")
    assert os.stat(mount.path / "b").st_ino == ino
    assert not (mount.path / "a").exists()
    assert keys(s3) == {"b"}
    assert body(s3, "b") == b"A"


def test_rename_onto_existing_file_replaces_it(mount, s3):
    (mount.path / "src").write_bytes(b"new")
    (mount.path / "dst").write_bytes(b"old content")
    flushed(mount)
    os.rename(mount.path / "src", mount.path / "dst")
    assert (mount.path / "dst").read_bytes() == b"new"
    flushed(mount)
    assert keys(s3) == {"dst"}
    assert body(s3, "dst") == b"new"


def test_rename_of_pending_file_onto_committed_file_replaces_it(mount, s3):
    (mount.path / "dst").write_bytes(b"old content")
    flushed(mount)
    with open(mount.path / "tmp", "wb") as f:
        f.write(b"fresh")
    os.rename(mount.path / "tmp", mount.path / "dst")
    assert (mount.path / "dst").read_bytes() == b"fresh"
    flushed(mount)
    assert keys(s3) == {"dst"}
    assert body(s3, "dst") == b"fresh"


def test_rename_noreplace_onto_existing_name_is_eexist(mount):
    (mount.path / "a").write_bytes(b"A")
    (mount.path / "b").write_bytes(b"B")
    with pytest.raises(FileExistsError):
        renameat2(mount.path / "a", mount.path / "b", RENAME_NOREPLACE)
    assert (mount.path / "b").read_bytes() == b"B"
    renameat2(mount.path / "a", mount.path / "c", RENAME_NOREPLACE)
    assert (mount.path / "c").read_bytes() == b"A"


def test_rename_exchange_is_einval(mount):
    (mount.path / "a").write_bytes(b"A")
    (mount.path / "b").write_bytes(b"B")
    with pytest.raises(OSError) as exc:
        renameat2(mount.path / "a", mount.path / "b", 2)
    assert exc.value.errno == errno.EINVAL


def test_rename_directory_with_committed_files_moves_every_object(mount, s3):
    os.makedirs(mount.path / "old" / "sub")
    (mount.path / "old" / "f1").write_bytes(b"1")
    (mount.path / "old" / "sub" / "f2").write_bytes(b"2")
    flushed(mount)
    ino = os.stat(mount.path / "old").st_ino
    f2_ino = os.stat(mount.path / "old" / "sub" / "f2").st_ino
    os.rename(mount.path / "old", mount.path / "new")
    assert os.stat(mount.path / "new").st_ino == ino
    assert os.stat(mount.path / "new" / "sub" / "f2").st_ino == f2_ino
    assert (mount.path / "new" / "sub" / "f2").read_bytes() == b"2"
    flushed(mount)
    assert not keys(s3, "old")
    assert {"new/f1", "new/sub/f2"} <= keys(s3)
    assert body(s3, "new/sub/f2") == b"2"


def test_rename_of_file_not_yet_in_s3_commits_only_new_key(mount, s3):
    (mount.path / "tmp.part").write_bytes(os.urandom(1000))
    os.rename(mount.path / "tmp.part", mount.path / "final")
    flushed(mount)
    assert keys(s3) == {"final"}


def test_rename_of_directory_not_yet_in_s3_commits_only_new_keys(mount, s3):
    """The checkpoint pattern: write into a temporary directory, rename it at the end."""
    tmp = mount.path / "step_1.tmp"
    os.mkdir(tmp)
    shards = {f"shard_{i}": os.urandom(50_000 + i) for i in range(4)}
    for name, data in shards.items():
        (tmp / name).write_bytes(data)
    os.rename(tmp, mount.path / "step_1")
    flushed(mount)
    all_keys = keys(s3)
    assert not {k for k in all_keys if k.startswith("step_1.tmp")}
    for name, data in shards.items():
        assert body(s3, f"step_1/{name}") == data


def test_rename_directory_onto_non_empty_directory_is_enotempty(mount):
    os.mkdir(mount.path / "a")
    os.mkdir(mount.path / "b")
    (mount.path / "b" / "f").write_bytes(b"x")
    with pytest.raises(OSError) as exc:
        os.rename(mount.path / "a", mount.path / "b")
    assert exc.value.errno == errno.ENOTEMPTY


def test_rename_directory_onto_empty_directory_replaces_it(mount, s3):
    os.mkdir(mount.path / "a")
    (mount.path / "a" / "f").write_bytes(b"x")
    os.mkdir(mount.path / "b")
    os.rename(mount.path / "a", mount.path / "b")
    assert os.listdir(mount.path) == ["b"]
    flushed(mount)
    assert keys(s3) == {"b/f"} or keys(s3) == {"b/", "b/f"}


def test_rename_keeps_inode_of_pending_file(mount):
    (mount.path / "p").write_bytes(b"p")
    ino = os.stat(mount.path / "p").st_ino
    os.mkdir(mount.path / "d")
    os.rename(mount.path / "p", mount.path / "d" / "q")
    assert os.stat(mount.path / "d" / "q").st_ino == ino


# -- links ------------------------------------------------------------------------------


def test_hard_link_is_eperm(mount):
    (mount.path / "f").write_bytes(b"x")
    with pytest.raises(PermissionError) as exc:
        os.link(mount.path / "f", mount.path / "g")
    assert exc.value.errno == errno.EPERM


def test_mknod_fifo_is_eperm(mount):
    with pytest.raises(PermissionError):
        os.mkfifo(mount.path / "fifo")


def test_latest_symlink_is_an_object_with_target_body_and_survives_remount(mount_factory, s3):
    first = mount_factory()
    os.mkdir(first.path / "step_2")
    (first.path / "step_2" / "model").write_bytes(b"weights")
    os.symlink("step_2", first.path / "latest")
    assert os.readlink(first.path / "latest") == "step_2"
    assert (first.path / "latest" / "model").read_bytes() == b"weights"
    flushed(first)
    assert s3.head("latest").metadata.get("symlink") == "1"
    assert body(s3, "latest") == b"step_2"
    # replacing the link atomically: symlink to a temporary name, rename over `latest`
    os.symlink("step_3", first.path / "latest.tmp")
    os.rename(first.path / "latest.tmp", first.path / "latest")
    assert os.readlink(first.path / "latest") == "step_3"
    unmounted(first)
    assert body(s3, "latest") == b"step_3"

    second = mount_factory(name="second")
    assert sorted(os.listdir(second.path)) == ["latest", "step_2"]
    assert os.path.islink(second.path / "latest")
    assert os.readlink(second.path / "latest") == "step_3"


def test_symlink_listed_before_lookup_after_remount_is_still_a_symlink(mount_factory, s3):
    first = mount_factory()
    os.symlink("target", first.path / "ln")
    unmounted(first)
    second = mount_factory(name="second")
    entries = {e.name: e for e in os.scandir(second.path)}
    assert entries["ln"].is_symlink()
    assert os.readlink(second.path / "ln") == "target"


def test_readlink_of_regular_file_is_einval(mount):
    (mount.path / "f").write_bytes(b"x")
    with pytest.raises(OSError) as exc:
        os.readlink(mount.path / "f")
    assert exc.value.errno == errno.EINVAL


# -- filesystem -------------------------------------------------------------------------


def test_statvfs_reports_block_size_and_name_length(mount):
    st = os.statvfs(mount.path)
    assert st.f_bsize > 0 and st.f_blocks > 0 and st.f_bavail > 0
    assert st.f_namemax == 255


def test_name_longer_than_255_bytes_is_enametoolong(mount):
    with pytest.raises(OSError) as exc:
        (mount.path / ("n" * 256)).write_bytes(b"x")
    assert exc.value.errno == errno.ENAMETOOLONG


# -- large files and unmount ------------------------------------------------------------


def test_multipart_file_with_random_overwrites_is_byte_identical_in_s3(mount_factory, s3):
    m = mount_factory("--part-size", "8M")
    size = 40 * MiB + 12345  # six parts, the last one short
    rng = random.Random(7)
    expected = bytearray(rng.randbytes(size))
    with open(m.path / "big", "wb") as f:
        f.write(expected)
        for _ in range(40):
            off = rng.randrange(size)
            patch = rng.randbytes(rng.randrange(1, 300_000))
            f.seek(off)
            f.write(patch)
            end = off + len(patch)
            if end > len(expected):
                expected.extend(bytes(end - len(expected)))
            expected[off:end] = patch
    assert os.stat(m.path / "big").st_size == len(expected)
    flushed(m)
    assert s3.head("big").size == len(expected)
    assert s3.get_range("big", 0, len(expected)) == bytes(expected)


def test_overwrite_inside_committed_multipart_file_keeps_other_parts(mount_factory, s3):
    m = mount_factory("--part-size", "8M")
    data = bytearray(os.urandom(20 * MiB))
    (m.path / "big").write_bytes(data)
    flushed(m)
    with open(m.path / "big", "r+b") as f:
        f.seek(9 * MiB + 5)
        f.write(b"PATCH")
    data[9 * MiB + 5:9 * MiB + 10] = b"PATCH"
    flushed(m)
    assert s3.get_range("big", 0, len(data)) == bytes(data)


def test_unmount_flushes_pending_writes(mount, s3):
    data = os.urandom(300_000)
    (mount.path / "late").write_bytes(data)
    unmounted(mount)
    assert body(s3, "late") == data

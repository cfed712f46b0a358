"""POSIX semantics end to end: real FUSE mount, real SeaweedFS, checked through S3 too."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import random
import re
import socket
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from lakefs_mount.namespace.dirattrs import SIDECAR_OVERHEAD
from lakefs_mount.namespace.dirindex import RESERVED_NAME
from lakefs_mount.s3.layout import decode_attrs
from lakefs_mount.s3.objectstore import ObjectInfo, ObjectStoreError
from lakefs_mount.s3.store import S3ObjectStore
from tests.mounting import Mount

MiB = 1024 * 1024
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
AT_FDCWD = -100
_libc = ctypes.CDLL(None, use_errno=True)


@pytest.fixture(scope="module", params=[("native", "uring"), ("native", "threads"),
                                        ("pyfuse3", "uring")], ids="-".join)
def shared(s3_server, tmp_path_factory, request) -> Iterator[tuple[Mount, S3ObjectStore]]:
    """One mount per FUSE session and I/O engine for the whole module (a mount start costs
    seconds); tests use their own directories. Every test below runs once with each pair."""
    session, engine = request.param
    name = f"t4-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(name)
    m = Mount(tmp_path_factory.mktemp("t4shared"), name, s3_server.endpoint_url,
              options=("--metadata-ttl", "0.5", "--part-size", "8M",
                       "--io-engine", engine, "--fuse-session", session))
    try:
        m.start()
        yield m, S3ObjectStore(name, endpoint_url=s3_server.endpoint_url, region="us-east-1")
    finally:
        m.cleanup()
        with contextlib.suppress(ObjectStoreError):
            s3_server.store(name).delete_bucket()


class Work:
    """A test's own directory on the shared mount and the S3 prefix it maps to."""

    def __init__(self, mount: Mount, s3: S3ObjectStore, name: str) -> None:
        self.mount = mount
        self.s3 = s3
        self.prefix = name + "/"
        self.path = mount.path / name
        os.mkdir(self.path)

    def flush(self) -> None:
        flushed(self.mount)

    def key(self, rel: str) -> str:
        return self.prefix + rel

    def keys(self) -> set[str]:
        """Keys under the test's directory, relative to it, without its own marker."""
        return {k[len(self.prefix):] for k in keys(self.s3, self.prefix)} - {""}

    def body(self, rel: str) -> bytes:
        return body(self.s3, self.key(rel))

    def head(self, rel: str) -> ObjectInfo | None:
        return self.s3.head(self.key(rel))


@pytest.fixture
def work(shared, request) -> Work:
    mount, s3 = shared
    return Work(mount, s3, re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)[:120])


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
    """Keys under `prefix`; the mount's attribute indexes left out."""
    return {o.key for o in s3.list_recursive(prefix) if not o.key.startswith(RESERVED_NAME + "/")}


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


def test_lookup_of_missing_name_is_enoent_and_getattr_of_new_file_is_regular(work):
    with pytest.raises(FileNotFoundError):
        os.stat(work.path / "missing")
    (work.path / "f").write_bytes(b"abc")
    st = os.stat(work.path / "f")
    assert stat.S_ISREG(st.st_mode)
    assert (st.st_size, st.st_nlink) == (3, 1)
    assert stat.S_ISDIR(os.stat(work.path).st_mode)


def test_create_write_read_back_before_and_after_flush(work):
    data = os.urandom(100_000)
    (work.path / "data.bin").write_bytes(data)
    assert (work.path / "data.bin").read_bytes() == data
    work.flush()
    assert work.body("data.bin") == data
    assert (work.path / "data.bin").read_bytes() == data


def test_truncate_shrinks_and_grows_with_zeros(work):
    path = work.path / "t"
    path.write_bytes(b"0123456789")
    work.flush()
    os.truncate(path, 4)
    assert path.read_bytes() == b"0123"
    os.truncate(path, 3 * MiB)
    content = path.read_bytes()
    assert len(content) == 3 * MiB
    assert content[:4] == b"0123" and content[4:] == bytes(3 * MiB - 4)
    work.flush()
    assert work.head("t").size == 3 * MiB
    assert work.body("t")[:8] == b"0123\0\0\0\0"


@pytest.mark.parametrize("grow", ["truncate", "write past the end"])
def test_a_committed_file_cut_short_then_grown_holds_zeros_not_its_old_bytes(work, grow):
    """fsx found it: `truncate(2)` by path of a committed 24 MiB file to 1 MiB and back up
    (or a write past the new end) read the old object's bytes past the first part, and the
    next commit put them back in S3. Zeros, in the mount and in S3."""
    old = bytes(range(256)) * (24 * MiB // 256)
    work.s3.put(work.key("f"), old, {})
    path = work.path / "f"
    assert wait_for(path.exists)  # (past the metadata TTL of the directory's listing)
    assert path.stat().st_size == len(old)
    os.truncate(path, MiB)
    if grow == "truncate":
        os.truncate(path, len(old))
        want = old[:MiB] + bytes(len(old) - MiB)
    else:
        with open(path, "r+b") as f:
            f.seek(20 * MiB)
            f.write(b"tail")
        want = old[:MiB] + bytes(19 * MiB) + b"tail"
    assert path.read_bytes() == want
    work.flush()
    assert work.body("f") == want


def test_a_file_cannot_grow_past_s3s_largest_object(work):
    """Issue 29, defect 3: S3 keeps no object over 5 TiB, so neither may the mount: EFBIG,
    and the file stays as it was, flushable."""
    path = work.path / "big"
    path.write_bytes(b"0123456789")
    with pytest.raises(OSError) as refused:
        os.truncate(path, 6 * 1024**4)
    assert refused.value.errno == errno.EFBIG
    if not work.mount.status()["passthrough"]:  # else the kernel writes, not the daemon
        fd = os.open(path, os.O_WRONLY)
        try:
            with pytest.raises(OSError) as beyond:
                os.pwrite(fd, b"x", 6 * 1024**4)
            assert beyond.value.errno == errno.EFBIG
        finally:
            os.close(fd)
    assert path.stat().st_size == 10
    work.flush()
    assert work.body("big") == b"0123456789"


def test_ftruncate_on_open_file_then_write_past_end_leaves_hole(work):
    path = work.path / "ft"
    with open(path, "wb") as f:
        f.write(b"x" * 1000)
        f.flush()
        f.truncate(10)
        f.seek(20)
        f.write(b"y")
    assert path.read_bytes() == b"x" * 10 + bytes(10) + b"y"
    work.flush()
    assert work.body("ft") == b"x" * 10 + bytes(10) + b"y"


def test_chmod_chown_utime_are_s3_metadata_after_flush(work):
    path = work.path / "attrs"
    path.write_bytes(b"payload")
    os.chmod(path, 0o640)
    os.chown(path, 1234, 5678)
    mtime_ns = 1_600_000_000_123_456_789
    os.utime(path, ns=(mtime_ns, mtime_ns))
    st = os.stat(path)
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o640, 1234, 5678)
    assert st.st_mtime_ns == mtime_ns
    work.flush()
    meta = work.head("attrs").metadata
    assert int(meta["mode"]) == stat.S_IFREG | 0o640
    assert (int(meta["uid"]), int(meta["gid"])) == (1234, 5678)
    assert abs(float(meta["mtime"]) - mtime_ns / 1e9) < 1e-6
    assert work.body("attrs") == b"payload"


def test_chmod_of_committed_file_changes_metadata_but_not_content(work):
    path = work.path / "c"
    path.write_bytes(b"content")
    work.flush()
    os.chmod(path, 0o600)
    work.flush()
    assert int(work.head("c").metadata["mode"]) == stat.S_IFREG | 0o600
    assert work.body("c") == b"content"


def test_chmod_chown_of_directory_hold_for_the_mount_and_rewrite_its_marker(work):
    os.mkdir(work.path / "d")
    (work.path / "d" / "f").write_bytes(b"x")
    os.chmod(work.path / "d", 0o700)
    os.chown(work.path / "d", 42, 43)
    st = os.stat(work.path / "d")
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o700, 42, 43)
    work.flush()
    assert work.head("d/") is not None  # metadata on it is kept only by some stores
    assert (work.path / "d" / "f").read_bytes() == b"x"


def test_attributes_of_files_and_symlinks_survive_remount_with_empty_cache(
        mount_factory, s3):
    first = mount_factory()
    path = first.path / "attrs"
    path.write_bytes(b"payload")
    os.chmod(path, 0o640)
    os.chown(path, 1234, 5678)
    mtime_ns = 1_600_000_000_123_456_789
    os.utime(path, ns=(mtime_ns, mtime_ns))
    os.mkdir(first.path / "d")
    os.symlink("d", first.path / "latest")
    unmounted(first)

    second = mount_factory(name="second")
    entries = {e.name: e for e in os.scandir(second.path)}  # readdir before any lookup
    assert entries["latest"].is_symlink()
    assert entries["d"].is_dir() and entries["attrs"].is_file()
    st = os.stat(second.path / "attrs")
    assert (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode)) == (stat.S_IFREG, 0o640)
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    assert abs(st.st_mtime_ns - mtime_ns) < 1000  # float seconds in metadata: sub-µs loss
    assert (second.path / "attrs").read_bytes() == b"payload"
    assert stat.S_ISDIR(os.stat(second.path / "d").st_mode)
    assert os.readlink(second.path / "latest") == "d"
    assert os.path.islink(second.path / "latest")


# -- open flags -------------------------------------------------------------------------


def test_open_with_o_trunc_empties_committed_file(work):
    path = work.path / "tr"
    path.write_bytes(b"long old content")
    work.flush()
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        assert os.fstat(fd).st_size == 0
        os.write(fd, b"new")
    finally:
        os.close(fd)
    assert path.read_bytes() == b"new"
    work.flush()
    assert work.body("tr") == b"new"


def test_o_append_writes_go_to_the_end(work):
    path = work.path / "log"
    path.write_bytes(b"first\n")
    work.flush()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, b"second\n")
        os.write(fd, b"third\n")
    finally:
        os.close(fd)
    assert path.read_bytes() == b"first\nsecond\nthird\n"
    work.flush()
    assert work.body("log") == b"first\nsecond\nthird\n"


def test_an_open_reader_sees_what_another_handle_writes_aligned_or_not(work):
    """A reader with the file in the kernel's page cache, writers that write whole pages
    (O_DIRECT into the cache file) and unaligned bytes (through its page cache): every
    read and the object in S3 have the last bytes written."""
    path = work.path / "ckpt"
    old, new = os.urandom(2 * MiB), os.urandom(MiB + 100)
    path.write_bytes(old)
    expect = bytearray(old)
    reader = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(reader, len(old), 0) == old
        writer = os.open(path, os.O_WRONLY)
        try:
            assert os.pwrite(writer, new, 1000) == len(new)
            expect[1000:1000 + len(new)] = new
            assert os.pread(reader, len(old), 0) == expect
        finally:
            os.close(writer)
        with open(path, "r+b") as both:
            both.seek(5)
            both.write(b"both")
        expect[5:9] = b"both"
        assert os.pread(reader, len(old), 0) == expect
    finally:
        os.close(reader)
    assert path.read_bytes() == expect
    work.flush()
    assert work.body("ckpt") == expect


def test_create_exclusive_on_existing_name_is_eexist(work):
    (work.path / "x").write_bytes(b"1")
    with pytest.raises(FileExistsError):
        os.open(work.path / "x", os.O_CREAT | os.O_EXCL | os.O_WRONLY)


# -- directories ------------------------------------------------------------------------


def test_mkdir_writes_marker_and_rmdir_removes_it_by_the_next_flush(work):
    os.mkdir(work.path / "empty")
    work.flush()
    assert work.head("empty/") is not None
    assert stat.S_ISDIR(os.stat(work.path / "empty").st_mode)
    with pytest.raises(FileExistsError):
        os.mkdir(work.path / "empty")
    os.rmdir(work.path / "empty")
    work.flush()
    assert work.head("empty/") is None
    assert not (work.path / "empty").exists()


def test_rmdir_right_after_a_child_was_made_and_removed_twice_succeeds(work):
    """pjdfstest mkdir/05 and rename/09: `mkdir s; rmdir s` twice below `d`, then `rmdir d`
    failed ENOTEMPTY in about half the tries (the second pair still pending made the
    listing of `d` show `s` again)."""
    for i in range(20):
        d = work.path / f"d{i}"
        d.mkdir()
        for _ in range(2):
            (d / "s").mkdir()
            (d / "s").rmdir()
        d.rmdir()
    assert os.listdir(work.path) == []
    work.flush()
    assert work.keys() == set()


def test_rmdir_of_directory_with_pending_file_is_enotempty(work):
    os.mkdir(work.path / "full")
    (work.path / "full" / "f").write_bytes(b"x")
    with pytest.raises(OSError) as exc:
        os.rmdir(work.path / "full")
    assert exc.value.errno == errno.ENOTEMPTY


def test_rmdir_of_directory_holding_only_s3_objects_is_enotempty(work):
    work.s3.put(work.key("remote/only"), b"r", {})
    assert wait_for(lambda: "remote" in os.listdir(work.path))
    with pytest.raises(OSError) as exc:
        os.rmdir(work.path / "remote")
    assert exc.value.errno == errno.ENOTEMPTY
    assert work.head("remote/only") is not None


def test_rmdir_of_file_is_enotdir_and_unlink_of_dir_is_eisdir(work):
    (work.path / "f").write_bytes(b"x")
    os.mkdir(work.path / "d")
    with pytest.raises(NotADirectoryError):
        os.rmdir(work.path / "f")
    with pytest.raises(OSError) as exc:
        os.unlink(work.path / "d")
    assert exc.value.errno == errno.EISDIR


def test_readdir_merges_s3_objects_and_cache_only_files(work):
    os.mkdir(work.path / "dir")
    (work.path / "dir" / "local").write_bytes(b"pending")  # not flushed: cache only
    assert sorted(os.listdir(work.path / "dir")) == ["local"]
    work.s3.put(work.key("dir/remote"), b"from boto3", {})
    work.s3.put(work.key("dir/sub/deep"), b"deep", {})
    assert wait_for(lambda: sorted(os.listdir(work.path / "dir")) == ["local", "remote", "sub"])
    assert (work.path / "dir" / "remote").read_bytes() == b"from boto3"
    assert (work.path / "dir" / "sub" / "deep").read_bytes() == b"deep"
    assert (work.path / "dir" / "local").read_bytes() == b"pending"


def test_object_deleted_in_s3_disappears_after_ttl(work):
    work.s3.put(work.key("gone"), b"x", {})
    assert wait_for(lambda: "gone" in os.listdir(work.path))
    work.s3.delete(work.key("gone"))
    assert wait_for(lambda: "gone" not in os.listdir(work.path))
    assert wait_for(lambda: not (work.path / "gone").exists())


def test_object_written_by_other_tool_has_sensible_defaults(work):
    data = os.urandom(5000)
    work.s3.put(work.key("foreign/obj.bin"), data, {})
    assert wait_for(lambda: (work.path / "foreign" / "obj.bin").exists())
    st = os.stat(work.path / "foreign" / "obj.bin")
    assert stat.S_ISREG(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o644
    assert st.st_size == len(data)
    assert abs(st.st_mtime - time.time()) < 120
    assert stat.S_ISDIR(os.stat(work.path / "foreign").st_mode)
    assert (work.path / "foreign" / "obj.bin").read_bytes() == data
    entries = {e.name: e for e in os.scandir(work.path / "foreign")}
    assert entries["obj.bin"].is_file() and not entries["obj.bin"].is_symlink()


# -- unlink -----------------------------------------------------------------------------


def test_unlink_removes_object_from_s3_by_the_next_flush(work):
    (work.path / "u").write_bytes(b"x")
    work.flush()
    os.unlink(work.path / "u")
    work.flush()
    assert work.head("u") is None
    assert not (work.path / "u").exists()
    with pytest.raises(FileNotFoundError):
        os.unlink(work.path / "u")


def test_unlink_of_open_file_keeps_data_readable_until_close(work):
    data = os.urandom(3 * MiB)
    (work.path / "open").write_bytes(data)
    work.flush()
    with open(work.path / "open", "rb") as f:
        os.unlink(work.path / "open")
        assert not (work.path / "open").exists()
        assert f.read() == data
    work.flush()
    assert work.head("open") is None
    assert "open" not in os.listdir(work.path)


def test_a_file_unlinked_while_open_has_no_link_left(work):
    with open(work.path / "f", "wb") as f:
        assert os.fstat(f.fileno()).st_nlink == 1
        os.unlink(work.path / "f")
        assert os.fstat(f.fileno()).st_nlink == 0


def test_a_directory_links_itself_and_each_subdirectory(work):
    for rel in ("d", "d/a", "d/b", "e"):
        os.mkdir(work.path / rel)
    (work.path / "d" / "f").write_bytes(b"x")
    assert os.stat(work.path / "d").st_nlink == 4  # ".", its name, and a/.. and b/..
    os.rename(work.path / "d" / "a", work.path / "e" / "a")
    assert (os.stat(work.path / "d").st_nlink, os.stat(work.path / "e").st_nlink) == (3, 3)
    os.rmdir(work.path / "d" / "b")
    assert os.stat(work.path / "d").st_nlink == 2


def test_unlink_of_open_uncached_s3_object_keeps_data_readable(work):
    data = os.urandom(2 * MiB)
    work.s3.put(work.key("remote-open"), data, {})
    assert wait_for(lambda: (work.path / "remote-open").exists())
    with open(work.path / "remote-open", "rb") as f:
        os.unlink(work.path / "remote-open")
        assert f.read() == data
    work.flush()  # the DELETE is written back once the open file's bytes are cached
    assert work.head("remote-open") is None


def test_unlink_of_file_open_for_writing_before_flush_uploads_nothing(work):
    with open(work.path / "ghost", "wb") as f:
        f.write(b"a" * 1000)
        f.flush()
        os.unlink(work.path / "ghost")
        f.write(b"b" * 1000)
    work.flush()
    assert work.head("ghost") is None
    assert "ghost" not in os.listdir(work.path)


def test_writes_to_unlinked_open_file_are_not_recovered_at_next_mount(mount_factory, s3):
    m = mount_factory()
    with open(m.path / "ghost", "wb") as f:
        f.write(b"a" * 1000)
        f.flush()
        os.unlink(m.path / "ghost")
        f.write(b"b" * 1000)
    unmounted(m)
    m.start()  # same cache dir: recovery replays whatever the journal still holds
    flushed(m)
    assert "ghost" not in os.listdir(m.path)
    assert s3.head("ghost") is None


# -- rename -----------------------------------------------------------------------------


def test_rename_file_moves_object_and_keeps_inode(work):
    (work.path / "a").write_bytes(b"A")
    work.flush()
    ino = os.stat(work.path / "a").st_ino
    os.rename(work.path / "a", work.path / "b")
    assert os.stat(work.path / "b").st_ino == ino
    assert not (work.path / "a").exists()
    work.flush()
    assert work.keys() == {"b"}
    assert work.body("b") == b"A"


def test_rename_onto_existing_file_replaces_it(work):
    (work.path / "src").write_bytes(b"new")
    (work.path / "dst").write_bytes(b"old content")
    work.flush()
    os.rename(work.path / "src", work.path / "dst")
    assert (work.path / "dst").read_bytes() == b"new"
    work.flush()
    assert work.keys() == {"dst"}
    assert work.body("dst") == b"new"


def test_rename_of_pending_file_onto_committed_file_replaces_it(work):
    (work.path / "dst").write_bytes(b"old content")
    work.flush()
    (work.path / "tmp").write_bytes(b"fresh")
    os.rename(work.path / "tmp", work.path / "dst")
    assert (work.path / "dst").read_bytes() == b"fresh"
    work.flush()
    assert work.keys() == {"dst"}
    assert work.body("dst") == b"fresh"


def test_a_file_renamed_over_a_committed_one_then_removed_before_its_commit_leaves_none(work):
    """`mv new dst` over a committed `dst` while `new` is still open (not in S3), then
    `rm dst`: the replaced object must not stay in S3, where the next mount showed it."""
    (work.path / "dst").write_bytes(b"old content")
    work.flush()
    with open(work.path / "new", "wb") as f:
        f.write(b"fresh")
        f.flush()
        os.rename(work.path / "new", work.path / "dst")
        os.unlink(work.path / "dst")
    work.flush()
    assert work.keys() == set()
    assert not (work.path / "dst").exists()


def test_rename_noreplace_onto_existing_name_is_eexist(work):
    (work.path / "a").write_bytes(b"A")
    (work.path / "b").write_bytes(b"B")
    with pytest.raises(FileExistsError):
        renameat2(work.path / "a", work.path / "b", RENAME_NOREPLACE)
    assert (work.path / "b").read_bytes() == b"B"
    renameat2(work.path / "a", work.path / "c", RENAME_NOREPLACE)
    assert (work.path / "c").read_bytes() == b"A"


def test_rename_exchange_is_einval(work):
    (work.path / "a").write_bytes(b"A")
    (work.path / "b").write_bytes(b"B")
    with pytest.raises(OSError) as exc:
        renameat2(work.path / "a", work.path / "b", RENAME_EXCHANGE)
    assert exc.value.errno == errno.EINVAL
    assert (work.path / "a").read_bytes() == b"A"


def test_rename_directory_with_committed_files_moves_every_object(work):
    os.makedirs(work.path / "old" / "sub")
    (work.path / "old" / "f1").write_bytes(b"1")
    (work.path / "old" / "sub" / "f2").write_bytes(b"2")
    work.flush()
    ino = os.stat(work.path / "old").st_ino
    f2_ino = os.stat(work.path / "old" / "sub" / "f2").st_ino
    os.rename(work.path / "old", work.path / "new")
    assert os.stat(work.path / "new").st_ino == ino
    assert os.stat(work.path / "new" / "sub" / "f2").st_ino == f2_ino
    assert (work.path / "new" / "sub" / "f2").read_bytes() == b"2"
    work.flush()
    assert not {k for k in work.keys() if k.startswith("old")}
    assert {"new/f1", "new/sub/f2"} <= work.keys()
    assert work.body("new/sub/f2") == b"2"


def test_rename_of_file_not_yet_in_s3_commits_only_new_key(work):
    (work.path / "tmp.part").write_bytes(os.urandom(1000))
    os.rename(work.path / "tmp.part", work.path / "final")
    work.flush()
    assert work.keys() == {"final"}


def test_rename_of_directory_not_yet_in_s3_commits_only_new_keys(work):
    """The checkpoint pattern: write into a temporary directory, rename it at the end.

    The shards are still open at the rename, so none of them can have been committed:
    the rename is a journal update, not an S3 copy.
    """
    tmp = work.path / "step_1.tmp"
    os.mkdir(tmp)
    shards = {f"shard_{i}": os.urandom(50_000 + i) for i in range(4)}
    files = []
    for name, data in shards.items():
        f = open(tmp / name, "wb")  # noqa: SIM115 - closed after the rename
        f.write(data)
        f.flush()
        files.append(f)
    copies = work.mount.counters().get("server_side_copies", 0)
    os.rename(tmp, work.path / "step_1")
    for f in files:
        f.close()
    work.flush()
    assert not {k for k in work.keys() if k.startswith("step_1.tmp")}
    for name, data in shards.items():
        assert work.body(f"step_1/{name}") == data
    assert work.mount.counters().get("server_side_copies", 0) == copies


def test_rename_of_open_file_not_yet_in_s3_commits_only_new_key(work):
    with open(work.path / "model.safetensors.tmp", "wb") as f:
        f.write(b"tensor bytes")
        f.flush()
        os.rename(work.path / "model.safetensors.tmp", work.path / "model.safetensors")
        f.write(b" and more")
    work.flush()
    assert work.keys() == {"model.safetensors"}
    assert work.body("model.safetensors") == b"tensor bytes and more"


def test_rename_of_multipart_file_while_parts_are_uploading_lands_at_new_key(work):
    data = os.urandom(20 * MiB)  # three 8 MiB parts on the shared mount
    (work.path / "big.tmp").write_bytes(data)
    os.rename(work.path / "big.tmp", work.path / "big")
    work.flush()
    assert work.keys() == {"big"}
    assert work.s3.get_range(work.key("big"), 0, len(data)) == data


def test_a_flush_right_after_a_save_renamed_its_temporary_file_succeeds(
        mount_factory, fault_proxy, s3) -> None:
    """safetensors (and other atomic savers) write `.tmpXXXX` and rename it to the
    checkpoint's name. The rename aborts the multipart upload its parts were streaming
    into; those parts, still on the wire when the saver's `flush` starts, fail with
    NoSuchUpload. That is the rename's doing, not a failure of the file: the flush must
    not give up 'keeps failing' (it did, with 'None' as the reason, once 5 parts came
    back), and the object lands whole at the new name."""
    m = mount_factory("--part-size", "8M", "--upload-concurrency", "16",
                      endpoint_url=fault_proxy.endpoint_url)
    fault_proxy.bandwidth_bytes_per_s = 8 * MiB  # 16 parts on the wire for ~1 s each
    data = os.urandom(128 * MiB)
    (m.path / ".tmp3xw5oF").write_bytes(data)
    time.sleep(0.2)  # parts are streaming to the temporary name
    os.rename(m.path / ".tmp3xw5oF", m.path / "model.safetensors")
    done = m.flush(timeout=120)
    assert done.returncode == 0, done.stderr + m.log_tail()
    got = s3.get("model.safetensors")
    assert got is not None and got[1] == data
    assert s3.head(".tmp3xw5oF") is None


def test_rename_directory_onto_non_empty_directory_is_enotempty(work):
    os.mkdir(work.path / "a")
    os.mkdir(work.path / "b")
    (work.path / "b" / "f").write_bytes(b"x")
    with pytest.raises(OSError) as exc:
        os.rename(work.path / "a", work.path / "b")
    assert exc.value.errno == errno.ENOTEMPTY


def test_rename_directory_onto_empty_directory_replaces_it(work):
    os.mkdir(work.path / "a")
    (work.path / "a" / "f").write_bytes(b"x")
    os.mkdir(work.path / "b")
    os.rename(work.path / "a", work.path / "b")
    assert os.listdir(work.path) == ["b"]
    work.flush()
    assert work.keys() - {"b/"} == {"b/f"}


def test_rename_directory_into_itself_is_einval(work):
    os.makedirs(work.path / "a" / "b")
    with pytest.raises(OSError) as exc:
        os.rename(work.path / "a", work.path / "a" / "b" / "c")
    assert exc.value.errno == errno.EINVAL


def test_rename_keeps_inode_of_pending_file(work):
    (work.path / "p").write_bytes(b"p")
    ino = os.stat(work.path / "p").st_ino
    os.mkdir(work.path / "d")
    os.rename(work.path / "p", work.path / "d" / "q")
    assert os.stat(work.path / "d" / "q").st_ino == ino


# -- links ------------------------------------------------------------------------------


def test_hard_link_is_eperm(work):
    (work.path / "f").write_bytes(b"x")
    with pytest.raises(PermissionError) as exc:
        os.link(work.path / "f", work.path / "g")
    assert exc.value.errno == errno.EPERM


# name -> (file type, permission bits, rdev): one of each special file, as mknod makes them
SPECIAL_FILES = {
    "fifo": (stat.S_IFIFO, 0o640, 0),
    "char": (stat.S_IFCHR, 0o600, os.makedev(1, 3)),
    "block": (stat.S_IFBLK, 0o660, os.makedev(7, 200)),
    "sock": (stat.S_IFSOCK, 0o755, 0),
}


def make_special_files(directory: Path) -> None:
    """mkfifo, mknod of a character and a block device, bind() of a UNIX socket; then the
    modes of SPECIAL_FILES, whatever the umask."""
    os.mkfifo(directory / "fifo")
    for name in ("char", "block"):
        file_type, _, rdev = SPECIAL_FILES[name]
        os.mknod(directory / name, file_type | 0o600, rdev)
    with contextlib.chdir(directory), socket.socket(socket.AF_UNIX) as sock:
        sock.bind("sock")  # a relative name: sun_path holds 108 bytes
    for name, (_, perms, _) in SPECIAL_FILES.items():
        os.chmod(directory / name, perms)


def assert_special_files(directory: Path, uid: int = 0, gid: int = 0) -> None:
    for name, (file_type, perms, rdev) in SPECIAL_FILES.items():
        st = os.lstat(directory / name)
        assert (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode)) == (file_type, perms), name
        assert (st.st_rdev, st.st_size, st.st_uid, st.st_gid) == (rdev, 0, uid, gid), name


def test_mkfifo_mknod_and_socket_are_zero_byte_objects_with_type_and_rdev_in_metadata(work):
    make_special_files(work.path)
    assert_special_files(work.path)
    work.flush()
    for name, (file_type, perms, rdev) in SPECIAL_FILES.items():
        info = work.head(name)
        assert info is not None and info.size == 0, name
        assert int(info.metadata["mode"]) == file_type | perms, name
        assert int(info.metadata.get("rdev", "0")) == rdev, name


def test_mknod_of_a_regular_file_makes_an_empty_file(work):
    os.mknod(work.path / "node", stat.S_IFREG | 0o600)
    st = os.stat(work.path / "node")
    assert (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_size) == (
        stat.S_IFREG, 0o600, 0)
    work.flush()
    assert work.head("node").size == 0


def test_fifo_in_the_mount_carries_data_between_two_processes(work):
    os.mkfifo(work.path / "pipe")
    writer = subprocess.Popen(
        [sys.executable, "-c", "import sys; open(sys.argv[1], 'wb').write(b'through the fifo')",
         str(work.path / "pipe")])
    try:
        with open(work.path / "pipe", "rb") as reader:
            assert reader.read() == b"through the fifo"
        assert writer.wait(timeout=30) == 0
    finally:
        writer.kill()
    work.flush()
    assert work.head("pipe").size == 0  # the kernel piped the bytes; S3 holds none


def test_unix_socket_in_the_mount_binds_and_connects(work):
    with contextlib.chdir(work.path), contextlib.ExitStack() as stack:
        server = stack.enter_context(socket.socket(socket.AF_UNIX))
        server.bind("s")
        server.listen(1)
        client = stack.enter_context(socket.socket(socket.AF_UNIX))
        client.settimeout(10)
        client.connect("s")
        peer = stack.enter_context(server.accept()[0])
        client.sendall(b"ping")
        assert peer.recv(4) == b"ping"
    assert stat.S_ISSOCK(os.lstat(work.path / "s").st_mode)


def test_rename_unlink_chmod_chown_of_each_special_file(work):
    make_special_files(work.path)
    work.flush()
    for name, (file_type, _, rdev) in SPECIAL_FILES.items():
        os.chmod(work.path / name, 0o604)
        os.chown(work.path / name, 11, 12)
        os.rename(work.path / name, work.path / f"{name}.moved")
        st = os.lstat(work.path / f"{name}.moved")
        assert (st.st_mode, st.st_uid, st.st_gid, st.st_rdev) == (file_type | 0o604, 11, 12,
                                                                  rdev), name
    work.flush()
    assert work.keys() == {f"{name}.moved" for name in SPECIAL_FILES}
    for name, (file_type, _, rdev) in SPECIAL_FILES.items():
        meta = work.head(f"{name}.moved").metadata
        assert (int(meta["mode"]), meta["uid"], meta["gid"]) == (file_type | 0o604, "11", "12")
        assert int(meta.get("rdev", "0")) == rdev
        os.unlink(work.path / f"{name}.moved")
    assert os.listdir(work.path) == []
    work.flush()
    assert work.keys() == set()


def test_device_nodes_in_the_mount_never_open_a_device(work):
    os.mknod(work.path / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    with pytest.raises(PermissionError):  # the mount is nodev
        os.open(work.path / "null", os.O_RDONLY)


def test_special_files_survive_remount_with_same_and_with_empty_cache(mount_factory):
    first = mount_factory()
    make_special_files(first.path)
    for name in SPECIAL_FILES:
        os.chown(first.path / name, 1234, 5678)
    unmounted(first)
    first.start()  # the same cache directory
    assert_special_files(first.path, 1234, 5678)
    second = mount_factory(name="second")  # an empty one
    assert sorted(os.listdir(second.path)) == sorted(SPECIAL_FILES)  # readdir first
    assert_special_files(second.path, 1234, 5678)


def test_device_created_just_before_a_crash_keeps_its_rdev(mount_factory, s3):
    first = mount_factory("--commit-delay", "60")
    os.mknod(first.path / "dev", stat.S_IFBLK | 0o640, os.makedev(8, 17))
    first.kill9()  # before any commit: only the journal knows the device
    first.start()
    st = os.lstat(first.path / "dev")
    assert (st.st_mode, st.st_rdev) == (stat.S_IFBLK | 0o640, os.makedev(8, 17))
    flushed(first)
    assert int(s3.head("dev").metadata["rdev"]) == os.makedev(8, 17)


def test_latest_symlink_is_an_object_with_target_body_and_metadata(work):
    os.mkdir(work.path / "step_2")
    (work.path / "step_2" / "model").write_bytes(b"weights")
    os.symlink("step_2", work.path / "latest")
    assert os.readlink(work.path / "latest") == "step_2"
    assert (work.path / "latest" / "model").read_bytes() == b"weights"
    work.flush()
    assert work.head("latest").metadata.get("symlink") == "1"
    assert work.body("latest") == b"step_2"
    # moving the link atomically: a new link under a temporary name renamed over `latest`
    os.symlink("step_3", work.path / "latest.tmp")
    os.rename(work.path / "latest.tmp", work.path / "latest")
    assert os.readlink(work.path / "latest") == "step_3"
    work.flush()
    assert work.body("latest") == b"step_3"
    assert work.keys() == {"latest", "step_2/", "step_2/model"}


def test_symlink_updates_parent_mtime_and_ctime_like_create_mkdir_unlink(work):
    old_ns = 1_500_000_000 * 10**9
    makers = {
        "symlink": lambda p: os.symlink("target", p),
        "create": lambda p: p.write_bytes(b"x"),
        "mkdir": os.mkdir,
        "unlink": lambda p: (p.write_bytes(b"x"), os.utime(p.parent, ns=(old_ns, old_ns)),
                             os.unlink(p)),
    }
    for what, make in makers.items():
        parent = work.path / what
        os.mkdir(parent)
        os.utime(parent, ns=(old_ns, old_ns))
        started_ns = time.time_ns()
        make(parent / "entry")
        st = os.stat(parent)
        assert st.st_mtime_ns >= started_ns, f"{what} left the parent's mtime"
        assert st.st_ctime_ns >= started_ns, f"{what} left the parent's ctime"


def test_readlink_of_regular_file_is_einval(work):
    (work.path / "f").write_bytes(b"x")
    with pytest.raises(OSError) as exc:
        os.readlink(work.path / "f")
    assert exc.value.errno == errno.EINVAL


# -- filesystem -------------------------------------------------------------------------


def test_statvfs_reports_block_size_and_name_length(work):
    st = os.statvfs(work.path)
    assert st.f_bsize > 0 and st.f_blocks > 0 and st.f_bavail > 0
    assert st.f_namemax == 255


def test_name_longer_than_255_bytes_is_enametoolong(work):
    with pytest.raises(OSError) as exc:
        (work.path / ("n" * 256)).write_bytes(b"x")
    assert exc.value.errno == errno.ENAMETOOLONG


def test_name_whose_s3_key_would_pass_1024_bytes_is_enametoolong(work):
    """S3 keys hold at most 1024 bytes. A name that would need a longer key is refused when
    it is made, instead of taking data whose commit fails for ever (flush never returns 0).
    The limit is the same for a file and a directory: a directory's key ends with "/", and
    leaves room for the key of its attributes on a store that drops the metadata of
    markers, as SeaweedFS does (dirattrs: SIDECAR_OVERHEAD more bytes)."""
    limit = 1024 - 1 - SIDECAR_OVERHEAD  # of a path's key, on this store
    deep, key = work.path, work.prefix
    while limit - (len(key) + 201) >= 50:
        deep, key = deep / ("d" * 200), key + "d" * 200 + "/"
        deep.mkdir()
    room = limit - len(key)  # 50 <= room <= 250: the longest name that fits here
    (deep / ("f" * room)).write_bytes(b"fits")
    (deep / ("h" * room)).mkdir()

    def refused(call) -> None:
        with pytest.raises(OSError) as exc:
            call()
        assert exc.value.errno == errno.ENAMETOOLONG

    refused(lambda: (deep / ("g" * (room + 1))).write_bytes(b"x"))
    refused(lambda: (deep / ("k" * (room + 1))).mkdir())
    refused(lambda: os.symlink("t", deep / ("s" * (room + 1))))
    refused(lambda: os.rename(deep / ("f" * room), deep / ("g" * (room + 1))))
    # a directory whose name fits there, but whose files' keys would not
    (work.path / "mv").mkdir()
    (work.path / "mv" / ("c" * 250)).write_bytes(b"committed")
    work.flush()
    (work.path / "mv" / ("p" * 250)).write_bytes(b"pending")
    refused(lambda: os.rename(work.path / "mv", deep / "m"))
    assert not (deep / "m").exists()
    assert (work.path / "mv" / ("c" * 250)).read_bytes() == b"committed"
    assert (work.path / "mv" / ("p" * 250)).read_bytes() == b"pending"
    # a directory at the limit, made by another tool: it lists and reads, and a name made
    # in it is refused like any other past the limit
    too_deep = deep / ("i" * room)
    work.s3.put(work.key(str(too_deep.relative_to(work.path)) + "/" + "j" * 20), b"x", {})
    assert wait_for(too_deep.is_dir)
    assert (too_deep / ("j" * 20)).read_bytes() == b"x"
    refused(lambda: (too_deep / ("k" * 20)).write_bytes(b"refused"))
    work.flush()
    assert work.body(key[len(work.prefix):] + "f" * room) == b"fits"
    assert {k for k in work.keys() if k.startswith("mv/")} == {
        "mv/", "mv/" + "c" * 250, "mv/" + "p" * 250}
    assert not any(k.startswith(key[len(work.prefix):] + "m") for k in work.keys())
    log = work.mount.log_file.read_text(errors="replace").splitlines()
    assert not [line for line in log if "index" in line and "d" * 200 in line]


# -- large files and unmount ------------------------------------------------------------


def test_multipart_file_with_random_overwrites_is_byte_identical_in_s3(work):
    size = 40 * MiB + 12345  # six 8 MiB parts, the last one short
    rng = random.Random(7)
    expected = bytearray(rng.randbytes(size))
    with open(work.path / "big", "wb") as f:
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
    assert os.stat(work.path / "big").st_size == len(expected)
    work.flush()
    assert work.head("big").size == len(expected)
    assert work.s3.get_range(work.key("big"), 0, len(expected)) == bytes(expected)


def test_overwrite_inside_committed_multipart_file_keeps_other_parts(work):
    data = bytearray(os.urandom(20 * MiB))
    (work.path / "big").write_bytes(data)
    work.flush()
    with open(work.path / "big", "r+b") as f:
        f.seek(9 * MiB + 5)
        f.write(b"PATCH")
    data[9 * MiB + 5:9 * MiB + 10] = b"PATCH"
    work.flush()
    assert work.s3.get_range(work.key("big"), 0, len(data)) == bytes(data)


def test_unmount_flushes_pending_writes(mount, s3):
    data = os.urandom(300_000)
    (mount.path / "late").write_bytes(data)
    unmounted(mount)
    assert body(s3, "late") == data


def test_a_set_group_id_directory_passes_its_group_on(work):
    """As on ext4: files and directories made in a directory with S_ISGID get its group,
    new directories its S_ISGID too; S3 keeps both (issue 53)."""
    d = work.path / "d"
    d.mkdir()
    os.chown(d, 0, 2000)
    os.chmod(d, 0o2775)
    (d / "f").write_bytes(b"f")
    (d / "sub").mkdir(mode=0o755)
    st_f, st_sub = os.stat(d / "f"), os.stat(d / "sub")
    assert (st_f.st_gid, st_sub.st_gid) == (2000, 2000)
    assert stat.S_IMODE(st_sub.st_mode) == 0o2755
    work.flush()
    info = work.head("d/f")
    assert info is not None and decode_attrs(info.metadata).gid == 2000


def test_utimensat_keeps_atime_and_ctime_is_the_time_of_the_change(work):
    """`touch -a -d`, `os.utime(p, ns=(a, m))`: atime reads back as set (a read does not
    change it), ctime is the moment of the change, not the time given (issue 53)."""
    p = work.path / "f"
    p.write_bytes(b"x")
    atime, mtime = 1_900_000_000 * 10**9, 1_950_000_000 * 10**9
    before = time.time_ns()
    os.utime(p, ns=(atime, mtime))
    st = os.stat(p)
    assert (st.st_atime_ns, st.st_mtime_ns) == (atime, mtime)
    assert before - 10**9 <= st.st_ctime_ns <= time.time_ns()
    subprocess.run(["touch", "-a", "-d", "@1800000000", str(p)], check=True)
    assert p.read_bytes() == b"x"
    st = os.stat(p)
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_800_000_000 * 10**9, mtime)
    d = work.path / "d"
    d.mkdir()
    subprocess.run(["touch", "-d", "@1950000000", str(d)], check=True)
    st = os.stat(d)
    assert st.st_mtime_ns == mtime and st.st_ctime_ns <= time.time_ns() < mtime
    work.flush()
    attrs = decode_attrs(work.head("f").metadata)
    assert (attrs.atime_ns, attrs.mtime_ns) == (1_800_000_000 * 10**9, mtime)

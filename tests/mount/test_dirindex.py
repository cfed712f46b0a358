"""Attribute indexes of directories: a fresh mount shows the modes, owners, mtimes and
symlinks of files other mounts wrote (`ls -l`) without one HEAD per file, and an index
never stands for an object that changed since it was written."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from lakefs_mount.namespace.dirindex import (
    INDEX_FOLDER,
    RESERVED_NAME,
    index_folder,
)


def _tree(root) -> dict[str, tuple]:
    """What `ls -lR` shows of every entry below `root`: type+mode, owner, size, mtime, link."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            link = os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
            size = None if stat.S_ISDIR(st.st_mode) else st.st_size
            mtime = None if stat.S_ISDIR(st.st_mode) else st.st_mtime_ns
            out[os.path.relpath(path, root)] = (st.st_mode, st.st_uid, st.st_gid, size, mtime,
                                                link)
    return out


def _write_checkpoint(root) -> None:
    """Files with modes, owners, mtimes and a symlink that a listing alone cannot tell."""
    (root / "ckpt" / "shards").mkdir(parents=True)
    for i in range(12):
        path = root / "ckpt" / "shards" / f"rank{i:02d}.pt"
        path.write_bytes(os.urandom(1000 + i))
        os.chmod(path, 0o600 if i % 2 else 0o640)
    run = root / "ckpt" / "run.sh"
    run.write_text("#!/bin/sh\n")
    os.chmod(run, 0o755)
    os.chown(run, 1234, 5678)
    old = root / "ckpt" / "config.json"
    old.write_text("{}")
    os.utime(old, ns=(1_600_000_000_123_456_789, 1_600_000_000_123_456_789))
    os.symlink("shards/rank00.pt", root / "ckpt" / "latest")


def test_a_fresh_mount_lists_attributes_from_the_indexes_without_a_head_per_file(
        mount_factory, s3):
    writer = mount_factory(name="writer")
    _write_checkpoint(writer.path)
    assert writer.flush().returncode == 0
    want = _tree(writer.path)

    reader = mount_factory(name="reader")  # another node: its own, empty cache
    assert _tree(reader.path) == want
    counters = reader.counters()
    assert counters.get("heads", 0) == 0
    assert counters.get("index_reads", 0) >= 2  # ckpt/ and ckpt/shards/
    # the indexes live in the mount's reserved folder, which no mount shows
    keys = [o.key for o in s3.list_recursive(INDEX_FOLDER)]
    assert any(k.startswith(INDEX_FOLDER + "ckpt/shards/") for k in keys)
    assert RESERVED_NAME not in os.listdir(reader.path)
    assert writer.unmount().returncode == 0


def test_a_mount_of_a_prefix_keeps_its_indexes_under_that_prefix(mount_factory, s3):
    """Files at the root of a prefix mount and below it; the whole-bucket mount sees the
    prefix mount's files but not its reserved folder."""
    writer = mount_factory(prefix="team/run1", name="writer")
    (writer.path / "top.bin").write_bytes(b"t" * 10)
    os.chmod(writer.path / "top.bin", 0o600)
    (writer.path / "sub").mkdir()
    (writer.path / "sub" / "low.bin").write_bytes(b"l" * 20)
    os.chmod(writer.path / "sub" / "low.bin", 0o640)
    assert writer.flush().returncode == 0
    reserved = [o.key for o in s3.list_recursive("") if RESERVED_NAME in o.key]
    assert all(k.startswith(f"team/run1/{RESERVED_NAME}/") for k in reserved)
    folders = {k.rsplit("/", 1)[0] for k in reserved if INDEX_FOLDER in k}
    assert folders == {f"team/run1/{INDEX_FOLDER}".rstrip("/"),
                       f"team/run1/{INDEX_FOLDER}sub"}

    reader = mount_factory(prefix="team/run1", name="reader")
    assert _tree(reader.path) == _tree(writer.path)
    assert reader.counters().get("heads", 0) == 0
    whole = mount_factory(name="whole")
    assert sorted(os.listdir(whole.path / "team" / "run1")) == ["sub", "top.bin"]


def test_an_index_entry_counts_only_while_the_object_is_unchanged(mount_factory, s3):
    m = mount_factory(name="writer")
    (m.path / "d").mkdir()
    for i in range(4):
        (m.path / "d" / f"f{i}").write_bytes(b"x" * (10 + i))
        os.chmod(m.path / "d" / f"f{i}", 0o600)
    assert m.unmount().returncode == 0  # an unmount writes the indexes too
    # another tool overwrites f0 (a new ETag) with other metadata, and damages the index
    s3.put("d/f0", b"written elsewhere", {"mode": str(stat.S_IFREG | 0o604)})
    s3.put("d/f1", b"y" * 11, {})  # same size, new content: a new ETag

    reader = mount_factory(name="reader")
    modes = {n: stat.S_IMODE(os.lstat(reader.path / "d" / n).st_mode) for n in
             sorted(os.listdir(reader.path / "d"))}
    assert modes == {"f0": 0o604, "f1": 0o644, "f2": 0o600, "f3": 0o600}
    assert reader.counters().get("heads", 0) == 2  # only the two changed objects

    [index_key] = [o.key for o in s3.list_recursive(index_folder("", "d/"))]
    s3.put(index_key, b"{not json", {})
    fresh = mount_factory(name="fresh")
    assert {n: stat.S_IMODE(os.lstat(fresh.path / "d" / n).st_mode)
            for n in sorted(os.listdir(fresh.path / "d"))} == modes
    assert fresh.counters().get("heads", 0) == 4  # a damaged index costs HEADs, not errors


def test_mounts_writing_into_one_directory_keep_their_own_indexes(mount_factory, s3):
    """Ranks on several nodes write one checkpoint directory: neither node's index
    overwrites the other's, and a third mount needs no HEAD for either's files."""
    a, b = mount_factory(name="a"), mount_factory(name="b")
    (a.path / "step").mkdir()
    for i in range(5):
        (a.path / "step" / f"a{i}").write_bytes(b"a" * i)
        os.chmod(a.path / "step" / f"a{i}", 0o600)
    assert a.flush().returncode == 0
    for i in range(5):
        (b.path / "step" / f"b{i}").write_bytes(b"b" * i)
        os.chmod(b.path / "step" / f"b{i}", 0o640)
    assert b.flush().returncode == 0
    assert len(list(s3.list_recursive(index_folder("", "step/")))) == 2

    c = mount_factory(name="c")
    modes = {n: stat.S_IMODE(os.lstat(c.path / "step" / n).st_mode)
             for n in os.listdir(c.path / "step")}
    assert modes == {**{f"a{i}": 0o600 for i in range(5)}, **{f"b{i}": 0o640 for i in range(5)}}
    assert c.counters().get("heads", 0) == 0


def test_a_renamed_or_removed_directory_takes_its_indexes_along(mount, s3):
    (mount.path / "tmp-step" / "sub").mkdir(parents=True)
    (mount.path / "tmp-step" / "model.pt").write_bytes(b"m" * 100)
    (mount.path / "tmp-step" / "sub" / "opt.pt").write_bytes(b"o" * 100)
    assert mount.flush().returncode == 0
    os.rename(mount.path / "tmp-step", mount.path / "step")  # how checkpoint savers finish
    assert mount.flush().returncode == 0
    folders = {o.key.rsplit("/", 1)[0] for o in s3.list_recursive(INDEX_FOLDER)}
    assert folders == {INDEX_FOLDER + "step", INDEX_FOLDER + "step/sub"}

    os.unlink(mount.path / "step" / "sub" / "opt.pt")
    os.rmdir(mount.path / "step" / "sub")
    assert mount.flush().returncode == 0
    folders = {o.key.rsplit("/", 1)[0] for o in s3.list_recursive(INDEX_FOLDER)}
    assert folders == {INDEX_FOLDER + "step"}


def test_the_reserved_name_is_never_shown_nor_created(mount_factory, s3):
    """`.lakefs-mount` holds the indexes under the mount root; a mount of a deeper prefix
    keeps its own there too, which a mount of the whole bucket must not show either."""
    m = mount_factory()
    (m.path / "d").mkdir()
    for parent in (m.path, m.path / "d"):
        for make in (lambda p: p.mkdir(), lambda p: p.write_bytes(b""),
                     lambda p: os.symlink("x", p),
                     lambda p: os.rename(m.path / "f", p)):
            (m.path / "f").write_bytes(b"f")
            with pytest.raises(PermissionError) as exc:
                make(parent / RESERVED_NAME)
            assert exc.value.errno == errno.EPERM
    assert m.flush().returncode == 0
    s3.put(f"d/{RESERVED_NAME}", b"made by another tool", {})
    s3.put(f"d/{RESERVED_NAME}/attrs/x.json", b"{}", {})
    fresh = mount_factory(name="fresh")
    assert sorted(os.listdir(fresh.path)) == ["d", "f"]
    assert os.listdir(fresh.path / "d") == []
    assert not os.path.lexists(fresh.path / "d" / RESERVED_NAME)


# -- the index format ---------------------------------------------------------------------



def _put_many(s3, prefix: str, count: int, size: int, metadata: dict[str, str]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: s3.put(f"{prefix}f{i:04d}", b"d" * size, metadata),
                      range(count)))


def test_a_big_directory_another_tool_uploaded_lists_with_a_sample_of_heads(
        mount_factory, s3):
    """200 objects of 5,000 bytes without POSIX metadata (`aws s3 cp` of a dataset): a
    sample of 16 HEADs finds none, and the rest take what the listing says (a listing
    proves an object larger than PATH_MAX a regular file). Where the sample finds mode
    metadata, or the objects are small enough to be symlinks, each is HEADed."""
    _put_many(s3, "dataset/", 200, 5000, {})
    _put_many(s3, "modes/", 100, 5000, {"mode": str(stat.S_IFREG | 0o600)})
    _put_many(s3, "tiny/", 100, 100, {})
    m = mount_factory()

    def heads() -> int:
        return m.status()["s3_requests"].get("HeadObject", {}).get("count", 0)

    before = heads()
    listed = {e.name: e.stat(follow_symlinks=False) for e in os.scandir(m.path / "dataset")}
    assert len(listed) == 200
    assert all(stat.S_ISREG(st.st_mode) and st.st_size == 5000 for st in listed.values())
    assert heads() - before <= 16 + 2  # the sample (and the directory's own attributes)
    assert "answered from the listing" in m.log_tail(200)

    before = heads()
    modes = [e.stat(follow_symlinks=False).st_mode for e in os.scandir(m.path / "modes")]
    assert modes == [stat.S_IFREG | 0o600] * 100
    assert heads() - before >= 100

    before = heads()
    assert len(os.listdir(m.path / "tiny")) == 100
    assert all(os.lstat(m.path / "tiny" / f"f{i:04d}").st_size == 100 for i in range(100))
    assert heads() - before >= 100

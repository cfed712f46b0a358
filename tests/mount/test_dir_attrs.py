"""Directory attributes survive a remount on a store that drops the metadata of `dir/`
markers (SeaweedFS): chmod, chown and utime of a directory come back with the same and
with an empty cache, on a second mount, after a rename, and never looser than given."""

from __future__ import annotations

import os
import sqlite3
import stat
import time

from lakefs_mount.namespace.dirattrs import JOURNAL_META, SIDECAR_ROOT, entry_folder

OLD_NS = 1_577_836_800_123_456_789  # 2020-01-01


def _attrs(path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns


def _give_attributes(root) -> dict[str, tuple[int, int, int, int]]:
    """A private directory with a subdirectory, each with its own mode, owner and mtime."""
    os.makedirs(root / "d" / "sub")
    os.chmod(root / "d", 0o700)
    os.chown(root / "d", 65534, 65534)
    os.chmod(root / "d" / "sub", 0o750)
    os.chown(root / "d" / "sub", 1234, 5678)
    for rel in ("d/sub", "d"):
        os.utime(root / rel, ns=(OLD_NS, OLD_NS))
    return {"d": (0o700, 65534, 65534, OLD_NS), "d/sub": (0o750, 1234, 5678, OLD_NS)}


def test_directory_chmod_chown_utime_survive_remount_with_same_and_empty_cache(
        mount_factory):
    first = mount_factory()
    want = _give_attributes(first.path)
    assert first.unmount().returncode == 0
    first.start()  # the same cache directory
    assert {rel: _attrs(first.path / rel) for rel in want} == want
    second = mount_factory(name="second")  # an empty cache, while the first is mounted
    assert [e.name for e in os.scandir(second.path)] == ["d"]  # readdir before any lookup
    assert {rel: _attrs(second.path / rel) for rel in want} == want


def test_the_probe_finds_seaweedfs_drops_marker_metadata_and_the_journal_keeps_the_answer(
        mount_factory, s3):
    m = mount_factory()
    os.mkdir(m.path / "d")
    os.chmod(m.path / "d", 0o711)
    assert m.flush().returncode == 0  # (namespace changes are written back)
    assert s3.head("d/").metadata == {}  # what SeaweedFS does with metadata on "d/"
    assert [o.key for o in s3.list_recursive(SIDECAR_ROOT)] == [
        entry_folder("d/") + f"{stat.S_IFDIR | 0o711}.0.0.{os.stat(m.path / 'd').st_mtime_ns}"]
    with sqlite3.connect(m.cache_dir / "journal.db") as db:
        assert db.execute("SELECT value FROM meta WHERE name=?",
                          (JOURNAL_META,)).fetchone() == ("0",)
    assert "sidecar keys" in m.log_file.read_text()


def test_a_renamed_directory_keeps_its_attributes_and_those_below_it(mount_factory, s3):
    first = mount_factory()
    os.makedirs(first.path / "a" / "b" / "c")
    (first.path / "a" / "b" / "f").write_bytes(b"x")
    for rel, mode in (("a", 0o711), ("a/b", 0o700), ("a/b/c", 0o750)):
        os.chmod(first.path / rel, mode)
    os.rename(first.path / "a", first.path / "z")
    assert first.unmount().returncode == 0
    second = mount_factory(name="second")
    assert {rel: stat.S_IMODE(os.stat(second.path / rel).st_mode)
            for rel in ("z", "z/b", "z/b/c")} == {"z": 0o711, "z/b": 0o700, "z/b/c": 0o750}
    assert os.listdir(second.path) == ["z"]  # no folder of "a" left in SeaweedFS either
    assert not any(k.key.startswith((entry_folder("a/"), SIDECAR_ROOT + "a/"))
                   for k in s3.list_recursive(SIDECAR_ROOT))


def test_rmdir_takes_the_attributes_along(mount_factory, s3):
    first = mount_factory()
    os.mkdir(first.path / "d")
    os.chmod(first.path / "d", 0o700)
    os.rmdir(first.path / "d")
    assert first.flush().returncode == 0  # (namespace changes are written back)
    assert list(s3.list_recursive(SIDECAR_ROOT)) == []
    s3.put("d/", b"", {})  # the same name made again by another tool: defaults, 0755
    second = mount_factory(name="second")
    assert stat.S_IMODE(os.stat(second.path / "d").st_mode) == 0o755


def test_a_directory_whose_attributes_s3_cannot_tell_is_served_0700_until_it_can(
        mount_factory, s3, fault_proxy):
    s3.put("f", b"file", {})
    s3.put("open/", b"", {})
    m = mount_factory("--metadata-ttl", "60", endpoint_url=fault_proxy.endpoint_url)
    assert (m.path / "f").read_bytes() == b"file"  # the root is listed, "open" not yet asked
    fault_proxy.fail = True
    try:
        assert stat.S_IMODE(os.stat(m.path / "open").st_mode) == 0o700
    finally:
        fault_proxy.fail = False
    time.sleep(1.5)  # past the kernel's attribute timeout
    assert stat.S_IMODE(os.stat(m.path / "open").st_mode) == 0o755
    assert "served 0700" in m.log_file.read_text()


def test_a_prefix_mount_writes_its_sidecar_keys_under_its_prefix_and_moves_older_ones_there(
        mount_factory, s3):
    """Nothing outside s3://bucket/team/ (a policy scoped to the prefix allows that much);
    the keys an earlier version left at the bucket root are moved under the prefix."""
    s3.put("team/old/", b"", {})
    s3.put(entry_folder("team/old/") + f"{stat.S_IFDIR | 0o700}.0.0.{OLD_NS}", b"", {})
    m = mount_factory(prefix="team")
    assert _attrs(m.path / "old") == (0o700, 0, 0, OLD_NS)
    os.mkdir(m.path / "new")
    os.chmod(m.path / "new", 0o750)
    assert m.flush().returncode == 0  # (namespace changes are written back)
    assert [o.key for o in s3.list_recursive("") if not o.key.startswith("team/")] == []
    assert sorted(o.key.rpartition("/")[0] for o in s3.list_recursive("team/" + SIDECAR_ROOT)
                  ) == [entry_folder(f"team/{d}/", "team/").rstrip("/") for d in ("new", "old")]
    assert m.unmount().returncode == 0
    again = mount_factory(prefix="team", name="again")  # an empty cache
    assert {d: _attrs(again.path / d)[0] for d in ("new", "old")} == {"new": 0o750,
                                                                    "old": 0o700}

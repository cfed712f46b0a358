"""Mount point and cache directory checks against real kernel mounts (run as root)."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lakefs_mount.ops.mountpoint import (
    MountpointError,
    check_cache_dir,
    check_mountpoint,
    is_mounted,
    is_stale,
    read_mountinfo,
    resolve_above,
    unmount,
)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
needs_fuse = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")

# A FUSE filesystem that does nothing but exist: enough to leave a dead mount behind.
TINY_FS = textwrap.dedent("""
    import os, stat, sys, trio, pyfuse3

    class Ops(pyfuse3.Operations):
        async def getattr(self, inode, ctx=None):
            e = pyfuse3.EntryAttributes()
            e.st_ino = inode
            e.st_mode = stat.S_IFDIR | 0o755
            e.st_nlink = 2
            e.st_uid, e.st_gid = os.getuid(), os.getgid()
            return e

    opts = set(pyfuse3.default_options)
    opts.add("fsname=lmtest")
    pyfuse3.init(Ops(), sys.argv[1], opts)
    trio.run(pyfuse3.main)
""")


def _force_unmount(path: Path) -> None:
    for _ in range(5):
        if not is_mounted(path):
            return
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def tmpfs(tmp_path) -> Iterator[Path]:
    """A directory with a tmpfs mounted on it, always unmounted afterwards."""
    target = tmp_path / "mnt with space"
    target.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "lmtest", str(target)],
                   check=True)
    try:
        yield target
    finally:
        _force_unmount(target)


@pytest.fixture
def stale_fuse(tmp_path) -> Iterator[Path]:
    """A FUSE mount whose daemon was killed with SIGKILL: stat gives ENOTCONN."""
    target = tmp_path / "fuse"
    target.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", TINY_FS, str(target)])
    try:
        deadline = time.monotonic() + 20
        while not is_mounted(target):
            assert proc.poll() is None, "tiny FUSE filesystem exited early"
            assert time.monotonic() < deadline, "tiny FUSE filesystem never mounted"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        yield target
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        _force_unmount(target)


def test_missing(tmp_path):
    with pytest.raises(MountpointError, match=r"does not exist; create it with: mkdir -p "):
        check_mountpoint(tmp_path / "nope")


def test_not_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(MountpointError, match="is not a directory"):
        check_mountpoint(f)


def test_not_empty(tmp_path):
    (tmp_path / "something").write_text("x")
    with pytest.raises(MountpointError, match="is not empty; lakefs-mount mounts only on an "
                                              "empty directory"):
        check_mountpoint(tmp_path)


def test_empty_directory_passes(tmp_path):
    check_mountpoint(tmp_path)


@needs_root
def test_already_mounted(tmpfs):
    assert is_mounted(tmpfs)  # the space in the name is escaped as \040 in mountinfo
    assert any(e.mountpoint == str(tmpfs) and e.source == "lmtest" for e in read_mountinfo())
    with pytest.raises(MountpointError, match=r"already mounted \(tmpfs from lmtest\)"):
        check_mountpoint(tmpfs)


@needs_root
def test_unmount_and_not_mounted(tmpfs):
    unmount(tmpfs)
    assert not is_mounted(tmpfs)
    with pytest.raises(MountpointError, match="is not mounted"):
        unmount(tmpfs)


@needs_root
def test_unmount_busy_leaves_mount(tmpfs):
    holder = subprocess.Popen(["sleep", "60"], cwd=tmpfs)
    try:
        with pytest.raises(MountpointError, match=rf"is busy: .*fuser -vm {tmpfs}"):
            unmount(tmpfs)
        assert is_mounted(tmpfs)
    finally:
        holder.kill()
        holder.wait()


@needs_root
@needs_fuse
def test_stale_fuse_mount_is_cleaned(stale_fuse, caplog):
    with pytest.raises(OSError) as info:
        os.stat(stale_fuse)
    assert info.value.errno == errno.ENOTCONN
    assert is_stale(stale_fuse)
    check_mountpoint(stale_fuse)  # cleans up, then the empty directory passes
    assert not is_mounted(stale_fuse)
    assert "cleaned up stale FUSE mount" in caplog.text


def test_cache_dir_created_private(tmp_path):
    target = tmp_path / "a" / "b" / "cache"
    check_cache_dir(target)
    assert target.is_dir()
    assert stat.S_IMODE(target.stat().st_mode) == 0o700
    assert list(target.iterdir()) == []  # the write probe is gone


@needs_root
def test_a_full_cache_disk_is_accepted_and_left_without_a_write_probe(tmp_path, caplog):
    """Issue 29: a crash can leave the cache disk full with data still to upload; a
    remount refused for it stranded that data (defect 1), and the refused check left its
    probe file behind (defect 8). The daemon frees the space by uploading."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], check=True)
    try:
        target = disk / "cache"
        target.mkdir()
        filler = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        with contextlib.suppress(OSError):  # until every block is taken
            while os.write(filler, b"\0" * 4096):
                pass
        os.close(filler)
        check_cache_dir(target)
        assert "its disk is full" in caplog.text
        assert list(target.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_cache_dir_existing_is_tightened(tmp_path):
    target = tmp_path / "cache"
    target.mkdir(mode=0o755)
    os.chmod(target, 0o755)
    check_cache_dir(target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o700


def test_cache_dir_under_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(MountpointError, match="cannot create cache directory"):
        check_cache_dir(tmp_path / "file" / "cache")


@needs_root
def test_cache_dir_read_only(tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "lmtest", str(target)],
                   check=True)
    try:
        with pytest.raises(MountpointError, match=r"is not writable: Read-only file system"):
            check_cache_dir(target)
        with pytest.raises(MountpointError, match="cannot create cache directory"):
            check_cache_dir(target / "sub")
    finally:
        _force_unmount(target)


def test_symlinks_are_resolved_only_above_a_mount_point(tmp_path):
    """What the Python API does with a path: nothing at or below a mount point is looked
    at (a stat there waits for its daemon), the symlinks above it are followed."""
    real = tmp_path / "real"
    (real / "mnt").mkdir(parents=True)
    (tmp_path / "link").symlink_to(real)
    (tmp_path / "rel").symlink_to("real/mnt")
    (real / "mnt" / "x").symlink_to("/elsewhere")  # inside the mount: left as it is
    stops = {str(real / "mnt")}
    assert resolve_above(tmp_path / "link" / "mnt" / "x" / "y", stops) == real / "mnt/x/y"
    assert resolve_above(tmp_path / "link" / "mnt", stops) == real / "mnt"
    assert resolve_above(tmp_path / "rel" / "a", stops) == real / "mnt" / "a"
    assert resolve_above(tmp_path / "link" / ".." / "rel", stops) == real / "mnt"
    assert resolve_above(tmp_path / "link" / "mnt" / "x", set()) == Path("/elsewhere")
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(OSError) as raised:
        resolve_above(tmp_path / "a" / "f", stops)
    assert raised.value.errno == errno.ELOOP

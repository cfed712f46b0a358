"""docs/semantics.md cannot drift: every row of its errno table is checked on a real mount."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import re
import socket
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "semantics.md"
AT_FDCWD = -100
RENAME_NOREPLACE, RENAME_EXCHANGE, RENAME_WHITEOUT = 1, 2, 4
_libc = ctypes.CDLL(None, use_errno=True)

Probe = Callable[[Path], None]
PROBES: dict[str, Probe] = {}


def probe(fn: Probe) -> Probe:
    PROBES[fn.__name__] = fn
    return fn


def _check(ok: bool) -> None:
    if not ok:
        raise AssertionError("the call worked but did the wrong thing")


def _libc_call(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _renameat2(src: Path, dst: Path, flags: int) -> None:
    _libc_call(_libc.renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst),
                               flags), "renameat2")


def _file(d: Path, name: str = "f", data: bytes = b"hello") -> Path:
    (d / name).write_bytes(data)
    return d / name


@probe
def open_missing(d: Path) -> None:
    os.close(os.open(d / "missing", os.O_RDONLY))


@probe
def create_exclusive_existing(d: Path) -> None:
    os.close(os.open(_file(d), os.O_CREAT | os.O_EXCL | os.O_WRONLY))


@probe
def open_o_direct(d: Path) -> None:
    fd = os.open(d / "direct", os.O_CREAT | os.O_WRONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT wants
        buf.write(b"d" * 4096)
        os.write(fd, buf)
    finally:
        os.close(fd)
    _check((d / "direct").read_bytes() == b"d" * 4096)


@probe
def open_o_tmpfile(d: Path) -> None:
    os.close(os.open(d, os.O_TMPFILE | os.O_WRONLY))


@probe
def open_dir_for_writing(d: Path) -> None:
    os.close(os.open(d, os.O_WRONLY))


@probe
def append_after_lseek(d: Path) -> None:
    fd = os.open(_file(d), os.O_WRONLY | os.O_APPEND)
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, b"!")
    finally:
        os.close(fd)
    _check((d / "f").read_bytes() == b"hello!")


@probe
def open_o_trunc(d: Path) -> None:
    os.close(os.open(_file(d), os.O_WRONLY | os.O_TRUNC))
    _check((d / "f").read_bytes() == b"")


@probe
def truncate_grow(d: Path) -> None:
    os.truncate(_file(d), 8)
    _check((d / "f").read_bytes() == b"hello\0\0\0")


@probe
def fallocate(d: Path) -> None:
    fd = os.open(_file(d), os.O_RDWR)
    try:
        _libc_call(_libc.fallocate(fd, 0, ctypes.c_long(0), ctypes.c_long(100)), "fallocate")
    finally:
        os.close(fd)


@probe
def mmap_shared_write(d: Path) -> None:
    with open(_file(d), "r+b") as f, mmap.mmap(f.fileno(), 5) as m:
        m[0:1] = b"J"
        m.flush()
    _check((d / "f").read_bytes() == b"Jello")


@probe
def fsync(d: Path) -> None:
    with open(d / "s", "wb") as f:
        f.write(b"sync me")
        f.flush()
        os.fsync(f.fileno())


@probe
def chmod_chown_utime(d: Path) -> None:
    path = _file(d)
    os.chmod(path, 0o600)
    os.chown(path, 7, 8)
    os.utime(path, ns=(1_000_000_000_000_000_123, 1_000_000_000_000_000_123))
    st = os.stat(path)
    _check((st.st_mode & 0o777, st.st_uid, st.st_gid, st.st_mtime_ns)
           == (0o600, 7, 8, 1_000_000_000_000_000_123))


@probe
def dir_chmod_chown_utime(d: Path) -> None:
    os.mkdir(d / "sub")
    os.chmod(d / "sub", 0o700)
    os.chown(d / "sub", 7, 8)
    os.utime(d / "sub", ns=(1_000_000_000_000_000_123, 1_000_000_000_000_000_123))
    st = os.stat(d / "sub")
    _check((st.st_mode & 0o777, st.st_uid, st.st_gid, st.st_mtime_ns)
           == (0o700, 7, 8, 1_000_000_000_000_000_123))


@probe
def getxattr(d: Path) -> None:
    os.getxattr(_file(d), "user.x")


@probe
def setxattr(d: Path) -> None:
    os.setxattr(_file(d), "user.x", b"1")


@probe
def listxattr(d: Path) -> None:
    os.listxattr(_file(d))


@probe
def removexattr(d: Path) -> None:
    os.removexattr(_file(d), "user.x")


@probe
def hard_link(d: Path) -> None:
    os.link(_file(d), d / "g")


@probe
def mkfifo(d: Path) -> None:
    os.mkfifo(d / "fifo")
    _check(stat.S_ISFIFO(os.stat(d / "fifo").st_mode))


@probe
def fifo_read_write(d: Path) -> None:
    os.mkfifo(d / "fifo")
    fd = os.open(d / "fifo", os.O_RDWR)  # both ends at once: the open does not block
    try:
        os.write(fd, b"piped")
        _check(os.read(fd, 5) == b"piped")
    finally:
        os.close(fd)


@probe
def mknod_regular(d: Path) -> None:
    os.mknod(d / "node", 0o600 | stat.S_IFREG)
    _check(stat.S_ISREG(os.stat(d / "node").st_mode))


@probe
def mknod_char_device(d: Path) -> None:
    os.mknod(d / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    _check(os.stat(d / "null").st_rdev == os.makedev(1, 3))


@probe
def mknod_block_device(d: Path) -> None:
    os.mknod(d / "loop", 0o600 | stat.S_IFBLK, os.makedev(7, 0))
    _check(os.stat(d / "loop").st_rdev == os.makedev(7, 0))


@probe
def open_device(d: Path) -> None:
    os.mknod(d / "zero", 0o666 | stat.S_IFCHR, os.makedev(1, 5))
    os.close(os.open(d / "zero", os.O_RDONLY))


@probe
def unix_socket_bind_connect(d: Path) -> None:
    with contextlib.chdir(d), socket.socket(socket.AF_UNIX) as server, \
            socket.socket(socket.AF_UNIX) as client:
        server.bind("s")  # relative: sun_path holds 108 bytes
        server.listen(1)
        client.connect("s")
        _check(stat.S_ISSOCK(os.stat("s").st_mode))


@probe
def symlink_readlink(d: Path) -> None:
    os.symlink("target", d / "ln")
    _check(os.readlink(d / "ln") == "target" and os.path.islink(d / "ln"))


@probe
def readlink_regular_file(d: Path) -> None:
    os.readlink(_file(d))


@probe
def mkdir_existing(d: Path) -> None:
    os.mkdir(d / "sub")
    os.mkdir(d / "sub")


@probe
def rmdir_non_empty(d: Path) -> None:
    os.mkdir(d / "sub")
    _file(d / "sub")
    os.rmdir(d / "sub")


@probe
def rmdir_file(d: Path) -> None:
    os.rmdir(_file(d))


@probe
def unlink_dir(d: Path) -> None:
    os.mkdir(d / "sub")
    os.unlink(d / "sub")


@probe
def unlink_open_file_read(d: Path) -> None:
    with open(_file(d), "rb") as f:
        os.unlink(d / "f")
        _check(f.read() == b"hello" and not (d / "f").exists())


@probe
def rename_file_over_file(d: Path) -> None:
    _file(d, "a", b"A")
    _file(d, "b", b"B")
    os.rename(d / "a", d / "b")
    _check((d / "b").read_bytes() == b"A" and not (d / "a").exists())


@probe
def rename_dir_over_empty_dir(d: Path) -> None:
    os.mkdir(d / "a")
    _file(d / "a")
    os.mkdir(d / "b")
    os.rename(d / "a", d / "b")
    _check(os.listdir(d / "b") == ["f"] and not (d / "a").exists())


@probe
def rename_dir_over_non_empty_dir(d: Path) -> None:
    os.mkdir(d / "a")
    os.mkdir(d / "b")
    _file(d / "b")
    os.rename(d / "a", d / "b")


@probe
def rename_dir_into_itself(d: Path) -> None:
    os.makedirs(d / "a" / "b")
    os.rename(d / "a", d / "a" / "b" / "c")


@probe
def rename_dir_over_file(d: Path) -> None:
    os.mkdir(d / "a")
    os.rename(d / "a", _file(d))


@probe
def rename_file_over_dir(d: Path) -> None:
    os.mkdir(d / "a")
    os.rename(_file(d), d / "a")


@probe
def rename_noreplace_existing(d: Path) -> None:
    _file(d, "a")
    _renameat2(d / "a", _file(d, "b"), RENAME_NOREPLACE)


@probe
def rename_exchange(d: Path) -> None:
    _file(d, "a")
    _renameat2(d / "a", _file(d, "b"), RENAME_EXCHANGE)


@probe
def rename_whiteout(d: Path) -> None:
    _renameat2(_file(d, "a"), d / "b", RENAME_WHITEOUT)


@probe
def name_too_long(d: Path) -> None:
    _file(d, "n" * 256)


@probe
def key_too_long(d: Path) -> None:
    for _ in range(5):  # five names of 250 bytes: the S3 key passes 1024 bytes on the way
        d = d / ("k" * 250)
        d.mkdir()


@probe
def statvfs(d: Path) -> None:
    st = os.statvfs(d)
    _check(st.f_bsize > 0 and st.f_bavail > 0 and st.f_namemax == 255)


@probe
def flock(d: Path) -> None:
    with open(_file(d), "rb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def documented_rows() -> list[tuple[str, str]]:
    """(probe, result) of every row between the errno-table markers."""
    text = DOC.read_text()
    table = text.split("<!-- errno-table:start -->")[1].split("<!-- errno-table:end -->")[0]
    rows = re.findall(r"^\|.*\|\s*`(\w+)`\s*\|\s*`(\w+)`\s*\|\s*$", table, re.MULTILINE)
    return [(name, result) for name, result in rows if name != "Probe"]


def outcome(fn: Probe, d: Path) -> str:
    """`ok`, or the errno name (numbers compared: ENOTSUP and EOPNOTSUPP are one)."""
    try:
        fn(d)
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return "ok"


def same(documented: str, actual: str) -> bool:
    if documented == "ok" or actual == "ok":
        return documented == actual
    return getattr(errno, documented, None) == getattr(errno, actual, -1)


def test_every_probe_has_a_row_and_every_row_a_probe():
    rows = documented_rows()
    names = [name for name, _ in rows]
    assert len(names) == len(set(names)), "a probe is documented twice"
    assert set(names) == set(PROBES)
    for _, result in rows:
        assert result == "ok" or isinstance(getattr(errno, result, None), int), result


@pytest.mark.parametrize("fuse_session", ["native", "pyfuse3"], indirect=True)
def test_errno_table_of_semantics_doc_matches_the_mount(mount):
    wrong = []
    for name, documented in documented_rows():
        d = mount.path / name
        os.mkdir(d)
        actual = outcome(PROBES[name], d)
        if not same(documented, actual):
            wrong.append(f"{name}: docs/semantics.md says {documented}, the mount gives {actual}")
    assert wrong == []

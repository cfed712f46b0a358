"""/dev/fuse and the kernel calls around it: mount(2), umount2(2), backing-file ioctls;
fusermount3 (`fusermount.py`) where the process may not call mount(2) itself."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import stat
import struct
from pathlib import Path

from lakefs_mount.fuse.native import fusermount

DEVICE = "/dev/fuse"
MAX_PAGES_LIMIT = Path("/proc/sys/fs/fuse/max_pages_limit")
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MNT_DETACH = 2
CAP_SYS_ADMIN = 21  # bit in /proc/self/status CapEff
PROC_STATUS = Path("/proc/self/status")
# _IOC(dir, 229, nr, size) as in the kernel's fuse.h
BACKING_OPEN = 0x4010E501  # _IOW(229, 1, struct fuse_backing_map)
BACKING_CLOSE = 0x4004E502  # _IOW(229, 2, uint32_t)
BACKING_MAP = struct.Struct("<iIQ")  # fd flags padding

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


class DeviceError(Exception):
    """The native session cannot start here; `str()` says why."""


def privileged() -> bool:
    """True with CAP_SYS_ADMIN: mount(2) of FUSE, and FUSE passthrough's backing files,
    need it (the kernel's `fuse_backing_open` checks it on every registration)."""
    try:
        for line in PROC_STATUS.read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    except (OSError, ValueError, IndexError):
        pass
    return os.geteuid() == 0


def connect(mountpoint: Path, *, fsname: str, subtype: str, allow_other: bool,
            read_only: bool, user_max_read: int) -> int:
    """A new FUSE connection mounted at `mountpoint`: its non-blocking descriptor. With
    CAP_SYS_ADMIN by mount(2), else through the setuid fusermount3 (a user's mount, whose
    READ requests are at most `user_max_read` bytes). Blocking (a worker thread);
    DeviceError says why it cannot be mounted."""
    if not privileged():
        options = f"fsname={fsname},subtype={subtype},default_permissions," \
            f"max_read={user_max_read}" + (",allow_other" if allow_other else "") \
            + (",ro" if read_only else "")
        try:
            return fusermount.mount(mountpoint, options)
        except fusermount.FusermountError as exc:
            raise DeviceError(str(exc)) from None
    fd = open_device()
    try:
        mount(fd, mountpoint, fsname=fsname, subtype=subtype, allow_other=allow_other,
              read_only=read_only)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_device() -> int:
    """A non-blocking descriptor of a new FUSE connection, not yet mounted."""
    try:
        return os.open(DEVICE, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise DeviceError(f"cannot open {DEVICE}: {exc.strerror}") from None


def mount(fd: int, mountpoint: Path, *, fsname: str, subtype: str, allow_other: bool,
          read_only: bool) -> None:
    """Mount the connection `fd` at `mountpoint` with mount(2): root only (CAP_SYS_ADMIN).
    The kernel checks permissions itself (default_permissions), as the pyfuse3 session."""
    root_mode = stat.S_IFMT(os.stat(mountpoint).st_mode)
    options = (f"fd={fd},rootmode={root_mode:o},user_id={os.getuid()},"
               f"group_id={os.getgid()},default_permissions")
    if allow_other:
        options += ",allow_other"
    flags = MS_NOSUID | MS_NODEV | (MS_RDONLY if read_only else 0)
    if _libc.mount(fsname.encode(), os.fsencode(mountpoint), f"fuse.{subtype}".encode(), flags,
                   options.encode()) != 0:
        err = ctypes.get_errno()
        raise DeviceError(f"mount(2) of {mountpoint} failed: {os.strerror(err)}"
                          + (" (the native session mounts as root only)"
                             if err == errno.EPERM else ""))


def unmount(mountpoint: Path) -> None:
    """Detach the mount, as `fusermount3 -uz` does (and with it, without CAP_SYS_ADMIN);
    a mount already gone is no error."""
    if not privileged():
        fusermount.unmount(mountpoint)
        return
    if _libc.umount2(os.fsencode(mountpoint), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):
            raise OSError(err, f"umount2 {mountpoint}: {os.strerror(err)}")


def max_pages_limit(default: int = 256) -> int:
    """The largest request size in pages that the kernel allows (fs.fuse.max_pages_limit)."""
    try:
        return int(MAX_PAGES_LIMIT.read_text())
    except (OSError, ValueError):
        return default


def backing_open(devfd: int, fd: int) -> int:
    """Register `fd` as a backing file of this connection; returns its id (> 0)."""
    arg = bytearray(BACKING_MAP.pack(fd, 0, 0))
    return fcntl.ioctl(devfd, BACKING_OPEN, arg, True)


def backing_close(devfd: int, backing_id: int) -> None:
    fcntl.ioctl(devfd, BACKING_CLOSE, bytearray(struct.pack("<I", backing_id)), True)

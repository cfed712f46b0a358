"""FUSE's wire format: opcodes, flags and the structs of requests and replies.

The layouts are those of the kernel's `include/uapi/linux/fuse.h` (protocol 7.45),
little-endian as on every Linux target this runs on. Only this
package knows them; the rest of the daemon sees `FileSystem` calls.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

KERNEL_MAJOR = 7
KERNEL_MINOR = 40  # what we answer: passthrough came with 7.40


class Op(enum.IntEnum):
    LOOKUP = 1
    FORGET = 2
    GETATTR = 3
    SETATTR = 4
    READLINK = 5
    SYMLINK = 6
    MKNOD = 8
    MKDIR = 9
    UNLINK = 10
    RMDIR = 11
    RENAME = 12
    LINK = 13
    OPEN = 14
    READ = 15
    WRITE = 16
    STATFS = 17
    RELEASE = 18
    FSYNC = 20
    SETXATTR = 21
    GETXATTR = 22
    LISTXATTR = 23
    REMOVEXATTR = 24
    FLUSH = 25
    INIT = 26
    OPENDIR = 27
    READDIR = 28
    RELEASEDIR = 29
    FSYNCDIR = 30
    GETLK = 31
    SETLK = 32
    SETLKW = 33
    ACCESS = 34
    CREATE = 35
    INTERRUPT = 36
    BMAP = 37
    DESTROY = 38
    IOCTL = 39
    POLL = 40
    NOTIFY_REPLY = 41
    BATCH_FORGET = 42
    FALLOCATE = 43
    READDIRPLUS = 44
    RENAME2 = 45
    LSEEK = 46
    COPY_FILE_RANGE = 47
    SETUPMAPPING = 48
    REMOVEMAPPING = 49
    SYNCFS = 50
    TMPFILE = 51
    STATX = 52
    COPY_FILE_RANGE_64 = 53


class Notify(enum.IntEnum):
    INVAL_INODE = 2
    INVAL_ENTRY = 3
    STORE = 4


# INIT flags (bits 32..63 travel in flags2)
ASYNC_READ = 1 << 0
ATOMIC_O_TRUNC = 1 << 3
EXPORT_SUPPORT = 1 << 4
BIG_WRITES = 1 << 5
AUTO_INVAL_DATA = 1 << 12
DO_READDIRPLUS = 1 << 13
ASYNC_DIO = 1 << 15
# never WRITEBACK_CACHE (1 << 16): with it the kernel refuses every passthrough backing file
PARALLEL_DIROPS = 1 << 18
MAX_PAGES = 1 << 22
INIT_EXT = 1 << 30
PASSTHROUGH = 1 << 37

# SETATTR valid bits
FATTR_MODE = 1 << 0
FATTR_UID = 1 << 1
FATTR_GID = 1 << 2
FATTR_SIZE = 1 << 3
FATTR_ATIME = 1 << 4
FATTR_MTIME = 1 << 5
FATTR_ATIME_NOW = 1 << 7
FATTR_MTIME_NOW = 1 << 8

# OPEN reply flags
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_PASSTHROUGH = 1 << 7

FSYNC_FDATASYNC = 1 << 0

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid extlen pad
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
INIT_IN = struct.Struct("<IIIII")  # major minor max_readahead flags flags2 (then unused)
# major minor max_readahead flags max_background congestion_threshold max_write time_gran
# max_pages map_alignment flags2 max_stack_depth request_timeout, padded to 64 bytes
INIT_OUT = struct.Struct("<IIIIHHIIHHIIH22x")
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
ENTRY_OUT_HEAD = struct.Struct("<QQQQII")  # nodeid generation entry_valid attr_valid nsecs
ATTR_OUT_HEAD = struct.Struct("<QII")  # attr_valid attr_valid_nsec dummy
OPEN_OUT = struct.Struct("<QIi")  # fh open_flags backing_id
WRITE_OUT = struct.Struct("<II")
STATFS_OUT = struct.Struct("<QQQQQIIII24x")
DIRENT_HEAD = struct.Struct("<QQII")  # ino off namelen type
FORGET_ONE = struct.Struct("<QQ")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
MKNOD_IN = struct.Struct("<IIII")  # mode rdev umask padding
MKDIR_IN = struct.Struct("<II")  # mode umask
RENAME2_IN = struct.Struct("<QII")  # newdir flags padding
OPEN_IN = struct.Struct("<II")  # flags open_flags
CREATE_IN = struct.Struct("<IIII")  # flags mode umask open_flags
READ_IN = struct.Struct("<QQII")  # fh offset size read_flags (then lock_owner flags)
WRITE_IN = struct.Struct("<QQIIQII")  # fh offset size write_flags lock_owner flags pad
RELEASE_IN = struct.Struct("<QII")  # fh flags release_flags
FSYNC_IN = struct.Struct("<QII")  # fh fsync_flags padding
NOTIFY_STORE = struct.Struct("<QQII")  # nodeid offset size padding
NOTIFY_INVAL_INODE = struct.Struct("<Qqq")  # nodeid offset length (length < 0: to the end)
NOTIFY_INVAL_ENTRY = struct.Struct("<QII")  # parent namelen flags, then the name and a NUL
INTERRUPT_IN = struct.Struct("<Q")  # unique of the interrupted request
# An INTERRUPT's own unique is the interrupted request's with this bit set (the kernel's
# FUSE_INT_REQ_BIT): a reply to it, EAGAIN, asks the kernel to send it again later.
INT_REQ_BIT = 1

WRITE_DATA_OFFSET = IN_HEADER.size + WRITE_IN.size  # 80: where a WRITE's bytes start


def pack_attr(ino: int, size: int, blocks: int, atime_ns: int, mtime_ns: int, ctime_ns: int,
              mode: int, nlink: int, uid: int, gid: int, rdev: int, blksize: int) -> bytes:
    """A `fuse_attr`."""
    a_s, a_ns = divmod(atime_ns, 1_000_000_000)
    m_s, m_ns = divmod(mtime_ns, 1_000_000_000)
    c_s, c_ns = divmod(ctime_ns, 1_000_000_000)
    return ATTR.pack(ino, size, blocks, a_s, m_s, c_s, a_ns, m_ns, c_ns, mode, nlink, uid, gid,
                     rdev, blksize, 0)


def split_valid(seconds: float) -> tuple[int, int]:
    whole = int(seconds)
    return whole, int((seconds - whole) * 1e9)


def names(data: bytes | memoryview, count: int) -> list[bytes]:
    """The NUL-terminated names at the end of a request (one, or two for rename/symlink)."""
    parts = bytes(data).split(b"\0")
    if len(parts) < count + 1:
        raise ValueError("request carries fewer names than its opcode needs")
    return parts[:count]


def dirent_size(name: bytes, plus: bool) -> int:
    size = DIRENT_HEAD.size + len(name)
    size = (size + 7) & ~7
    if plus:
        size += ENTRY_OUT_HEAD.size + ATTR.size
    return size


@dataclass
class Request:
    """One request as the session read it from the device."""

    opcode: int
    unique: int
    nodeid: int
    uid: int
    gid: int
    pid: int
    arg: bytes | memoryview  # what follows the header (for WRITE: the fuse_write_in)
    data: memoryview | None = None  # the bytes of a WRITE, page-aligned in its buffer

"""How files map onto S3: keys, attribute metadata and the fixed offset-to-part mapping.

Every object is a plain S3 object at `prefix + relative path`, readable by any S3 tool.
The part mapping is a pure function of the offset so that a random write always knows
its part, and a file of up to 5 TiB fits in S3's 10,000 parts.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass

MiB = 1024 * 1024
MAX_PARTS = 10_000
PARTS_PER_TIER = 1_000  # tier k holds 1,000 parts of part_size * 2**k
MAX_OBJECT_SIZE = 5 * 1024 * 1024 * MiB
MIN_PART_SIZE = 8 * MiB
MAX_PART_SIZE = 512 * MiB

# User metadata names shared with s3fs and rclone, so other mounts show the same modes.
META_MODE = "mode"
META_UID = "uid"
META_GID = "gid"
META_MTIME = "mtime"
META_ATIME = "atime"  # where one was set (utimensat): else atime reads as mtime
META_CTIME = "ctime"  # when the file's content or attributes last changed
META_SYMLINK = "symlink"  # "1" marks an object whose body is a symlink target
META_RDEV = "rdev"  # device number of a character or block device (as s3fs writes it)
# Which file of which cache wrote an object (`writer_tag`): lakefs-mount's own, so that a
# mount can tell its killed predecessor's late commits from anyone else's (latewrites).
META_WRITER = "lakefs-mount-writer"
# The full key of the table of its parts' CRC-32C (s3/parttable), on the multipart objects
# the mount writes: a GET of one part is checked against it.
META_PARTS = "lakefs-mount-parts"
# The mount's own records under its prefix: never shown in the mount nor creatable there.
RESERVED_NAME = ".lakefs-mount"
# File types a zero-byte object may carry in its mode: FIFOs, devices, UNIX sockets.
SPECIAL_TYPES = frozenset({stat.S_IFIFO, stat.S_IFCHR, stat.S_IFBLK, stat.S_IFSOCK})
# File types an object may claim: anything else in its mode reads as a regular file.
OBJECT_TYPES = SPECIAL_TYPES | {stat.S_IFREG, stat.S_IFLNK}


@dataclass(frozen=True)
class PartMap:
    """Chunk i of a file is part i+1 of its multipart upload; chunks grow by tiers.

    With 16 MiB parts the first 15.6 GiB use 16 MiB chunks, the next 31 GiB 32 MiB, and
    so on; 5 TiB needs about 7,700 parts, and no part exceeds 4 GiB.
    """

    part_size: int

    def __post_init__(self) -> None:
        if not MIN_PART_SIZE <= self.part_size <= MAX_PART_SIZE or self.part_size % MiB:
            raise ValueError("part size must be a whole number of MiB between 8 MiB and 512 MiB")

    def _tier_bytes(self, tier: int) -> int:
        return PARTS_PER_TIER * (self.part_size << tier)

    def chunk_of(self, offset: int) -> int:
        """Index of the chunk holding byte `offset`."""
        base = 0
        for tier in range(MAX_PARTS // PARTS_PER_TIER):
            span = self._tier_bytes(tier)
            if offset < base + span:
                return tier * PARTS_PER_TIER + (offset - base) // (self.part_size << tier)
            base += span
        raise ValueError(f"offset {offset} is beyond the largest S3 object")

    def chunk_range(self, index: int) -> tuple[int, int]:
        """[start, end) of chunk `index`."""
        tier, within = divmod(index, PARTS_PER_TIER)
        if tier >= MAX_PARTS // PARTS_PER_TIER:
            raise ValueError(f"chunk {index} is beyond S3's {MAX_PARTS} parts")
        start = sum(self._tier_bytes(t) for t in range(tier))
        size = self.part_size << tier
        start += within * size
        return start, start + size

    def chunk_count(self, size: int) -> int:
        """How many chunks a file of `size` bytes spans (0 for an empty file)."""
        return 0 if size <= 0 else self.chunk_of(size - 1) + 1

    def held_bytes(self, index: int, size: int) -> int:
        """Bytes of chunk `index` inside a file of `size` bytes: what a cached chunk takes
        on disk and counts against the cache and dirty budgets (a 100 KiB file is not a
        whole chunk)."""
        start, end = self.chunk_range(index)
        return max(0, min(end, size) - start)

    def chunks_between(self, start: int, end: int) -> range:
        """Chunk indices touched by bytes [start, end)."""
        if end <= start:
            return range(0)
        return range(self.chunk_of(start), self.chunk_of(end - 1) + 1)


def key_for(prefix: str, path: str) -> str:
    """S3 key of the file at `path` (relative to the mount root, no leading slash)."""
    return prefix + path


def dir_marker_key(prefix: str, path: str) -> str:
    return prefix + path + "/" if path else prefix


def writer_tag(writer: str, fid: int) -> str:
    """The META_WRITER of the objects file `fid` of the cache `writer` commits: fids are
    never reused within a cache, so the tag names one file for good."""
    return f"{writer}/{fid}"


def encode_attrs(mode: int, uid: int, gid: int, mtime_ns: int, rdev: int = 0,
                 atime_ns: int | None = None, ctime_ns: int | None = None) -> dict[str, str]:
    meta = {
        META_MODE: str(mode),
        META_UID: str(uid),
        META_GID: str(gid),
        META_MTIME: _seconds(mtime_ns),
    }
    if rdev:
        meta[META_RDEV] = str(rdev)
    if atime_ns is not None:
        meta[META_ATIME] = _seconds(atime_ns)
    if ctime_ns:
        meta[META_CTIME] = _seconds(ctime_ns)
    return meta


def _seconds(ns: int) -> str:
    """Seconds, exact to the ns, as s3fs and rclone write times."""
    return f"{ns // 10**9}.{ns % 10**9:09d}"


@dataclass(frozen=True)
class DecodedAttrs:
    mode: int | None
    uid: int | None
    gid: int | None
    mtime_ns: int | None
    is_symlink: bool
    rdev: int = 0
    atime_ns: int | None = None
    ctime_ns: int | None = None


def _parse_mtime_ns(text: str | None) -> int | None:
    """'1700000000.123456789' (seconds, exact to the ns) -> ns; also plain integers."""
    if not text:
        return None
    whole, _, frac = text.strip().partition(".")
    try:
        return int(whole) * 10**9 + int((frac + "000000000")[:9] or "0")
    except ValueError:
        return None


POSIX_META = (META_MODE, META_UID, META_GID, META_MTIME, META_ATIME, META_CTIME, META_SYMLINK,
              META_RDEV)


def carries_posix_attrs(meta: dict[str, str]) -> bool:
    """The object's metadata holds attributes a listing cannot tell (this mount's, s3fs's)."""
    return any(name in meta for name in POSIX_META)


def decode_attrs(meta: dict[str, str]) -> DecodedAttrs:
    """Attributes from user metadata; absent or malformed values become None (defaults)."""

    def as_int(name: str) -> int | None:
        try:
            return int(meta[name])
        except (KeyError, ValueError):
            return None

    mtime_ns = _parse_mtime_ns(meta.get(META_MTIME))
    mode = as_int(META_MODE)
    if mode is not None and stat.S_IFMT(mode) not in OBJECT_TYPES:
        mode = stat.S_IFREG | stat.S_IMODE(mode)  # no object may pose as a directory
    is_link = meta.get(META_SYMLINK) == "1" or (mode is not None and stat.S_ISLNK(mode))
    special = mode is not None and stat.S_IFMT(mode) in (stat.S_IFCHR, stat.S_IFBLK)
    rdev = (as_int(META_RDEV) or 0) if special else 0
    return DecodedAttrs(mode, as_int(META_UID), as_int(META_GID), mtime_ns, is_link, rdev,
                        _parse_mtime_ns(meta.get(META_ATIME)),
                        _parse_mtime_ns(meta.get(META_CTIME)))

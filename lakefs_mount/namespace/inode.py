"""An inode of the mount: what kind of entry it is, its attributes, its children.

Plain data (Namespace keeps the table of them); a file's content and attributes live in
its CachedFile, a directory's here.
"""

from __future__ import annotations

import enum
import os
import stat
import time
from dataclasses import dataclass, field

from lakefs_mount.cache.cachefile import CachedFile
from lakefs_mount.namespace.dirindex import RESERVED_NAME
from lakefs_mount.s3.layout import SPECIAL_TYPES

ROOT_INO = 1
DEFAULT_FILE_MODE = stat.S_IFREG | 0o644
DEFAULT_DIR_MODE = stat.S_IFDIR | 0o755


class Kind(enum.Enum):
    FILE = "file"
    DIR = "dir"
    SYMLINK = "symlink"
    SPECIAL = "special"  # FIFO, device or UNIX socket: a zero-byte object the kernel serves


def kind_of(cf: CachedFile) -> Kind:
    """What a file's content and mode make it."""
    if cf.symlink is not None or stat.S_ISLNK(cf.mode):
        return Kind.SYMLINK
    return Kind.SPECIAL if stat.S_IFMT(cf.mode) in SPECIAL_TYPES else Kind.FILE


@dataclass(eq=False)
class Inode:
    ino: int
    kind: Kind
    parent: int
    name: str
    file: CachedFile | None = None  # content and attributes of files and symlinks
    dir_mode: int = DEFAULT_DIR_MODE
    dir_uid: int = 0
    dir_gid: int = 0
    dir_mtime_ns: int = 0
    children: dict[str, int] = field(default_factory=dict)
    subdirs: int = 0  # directories among the children: st_nlink is 2 + subdirs
    listed_at: float = 0.0  # monotonic time of the last S3 listing; 0 = never listed
    unlistable_at: float = 0.0  # when S3 last failed to list it (0: it answered since)
    headed: bool = True  # False: attributes are listing defaults until a HEAD
    indexed_at: float = 0.0  # listed_at when the attribute indexes were last applied
    lookups: int = 0
    ctime_ns: int = 0  # a directory's: when it last changed here (0: not known, its mtime)
    dir_atime_ns: int | None = None  # a directory's, set explicitly (this mount only)

    @property
    def is_dir(self) -> bool:
        return self.kind is Kind.DIR

    @property
    def mode(self) -> int:
        return self.file.mode if self.file is not None else self.dir_mode

    @property
    def uid(self) -> int:
        return self.file.uid if self.file is not None else self.dir_uid

    @property
    def gid(self) -> int:
        return self.file.gid if self.file is not None else self.dir_gid

    @property
    def mtime_ns(self) -> int:
        return self.file.mtime_ns if self.file is not None else self.dir_mtime_ns

    @property
    def atime_ns(self) -> int:
        """As set by utimensat, else the mtime: reads do not change it (noatime)."""
        atime = self.file.atime_ns if self.file is not None else self.dir_atime_ns
        return self.mtime_ns if atime is None else atime

    @property
    def changed_ns(self) -> int:
        """ctime: when the content or attributes last changed (else the mtime)."""
        ctime = self.file.ctime_ns if self.file is not None else self.ctime_ns
        return ctime or self.mtime_ns

    def entries_changed(self, at_ns: int) -> None:
        """A directory gained, lost or renamed an entry at `at_ns`."""
        self.dir_mtime_ns = self.ctime_ns = at_ns

    @property
    def size(self) -> int:
        if self.file is None:
            return 0
        if self.file.symlink is not None:
            return len(self.file.symlink.encode())
        return self.file.size

    def set_attrs(self, mode: int | None = None, uid: int | None = None,
                  gid: int | None = None, mtime_ns: int | None = None,
                  atime_ns: int | None = None) -> None:
        """Attributes set through the mount, now: its ctime."""
        now = time.time_ns()
        if self.file is not None:
            self.file.set_attrs(mode, uid, gid, mtime_ns, atime_ns, ctime_ns=now)
            return
        for name, value in (("dir_mode", mode), ("dir_uid", uid), ("dir_gid", gid),
                            ("dir_mtime_ns", mtime_ns), ("dir_atime_ns", atime_ns)):
            if value is not None:
                setattr(self, name, value)
        self.ctime_ns = now


def valid_name(name: str) -> bool:
    """A name POSIX can show, and not lakefs-mount's own folder (attribute indexes: under
    the mount root, and under the root of any mount of a deeper prefix)."""
    return bool(name) and name != RESERVED_NAME and "/" not in name \
        and name not in (".", "..") and "\0" not in name and len(os.fsencode(name)) <= 255

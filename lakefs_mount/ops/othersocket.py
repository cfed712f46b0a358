"""Where root finds the control socket of a mount another user made.

A daemon listens under its own user's runtime directory ($XDG_RUNTIME_DIR/lakefs-mount,
else /tmp/lakefs-mount-UID: config.control_socket_path), which root's environment does
not name. The kernel knows both halves: the mount's owner (`user_id=` in mountinfo) and
the paths of bound Unix sockets (/proc/net/unix). The socket taken is the one named after
the mount point whose file belongs to that owner, so no other user can pose as the
daemon of someone else's mount.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from lakefs_mount.config import FSTYPE_NAME, control_socket_path
from lakefs_mount.ops.mountpoint import find_mount

PROC_NET_UNIX = Path("/proc/net/unix")


def bound_unix_paths(table: Path = PROC_NET_UNIX) -> list[Path]:
    """The file paths Unix sockets are bound to (abstract names left out)."""
    paths = []
    try:
        lines = table.read_text(errors="replace").splitlines()[1:]
    except OSError:
        return []
    for line in lines:
        fields = line.split(None, 7)  # Num RefCount Protocol Flags Type St Inode Path
        if len(fields) == 8 and fields[7].startswith("/"):
            paths.append(Path(fields[7]))
    return paths


def socket_of_owner(mountpoint: Path) -> Path | None:
    """The control socket of the lakefs-mount at `mountpoint` if another user made it and
    its daemon listens; None otherwise (not ours to find, or nobody listening)."""
    entry = find_mount(mountpoint)
    if entry is None or entry.fstype != f"fuse.{FSTYPE_NAME}":
        return None
    owner = entry.fuse_owner
    if owner is None or owner == os.geteuid():
        return None
    name = control_socket_path(mountpoint).name
    for path in bound_unix_paths():
        if path.name != name or path.parent.name not in (FSTYPE_NAME,
                                                         f"{FSTYPE_NAME}-{owner}"):
            continue
        try:
            st = path.lstat()
        except OSError:
            continue
        if stat.S_ISSOCK(st.st_mode) and st.st_uid == owner:
            return path
    return None

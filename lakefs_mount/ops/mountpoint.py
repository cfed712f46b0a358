"""Checks and kernel operations on mount points and cache directories.

Why here and not in the daemon: the CLI runs these checks before it forks, so a bad mount
point fails in the user's terminal with a precise message instead of in a background log.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MOUNTINFO = Path("/proc/self/mountinfo")
FUSE_CONF = Path("/etc/fuse.conf")
FUSE_DEVICE = Path("/dev/fuse")
SYSFS_BDI = Path("/sys/class/bdi")
MAX_SYMLINK_HOPS = 40  # as the kernel's (ELOOP)
_STALE_ERRNOS = (errno.ENOTCONN, errno.ECONNABORTED)


class MountpointError(Exception):
    """The mount point or cache directory is unusable; `str()` tells the user what to do."""


@dataclass(frozen=True)
class MountEntry:
    mountpoint: str
    fstype: str
    source: str
    device: str = ""  # "major:minor", also the name of its backing device in sysfs
    options: str = ""  # the filesystem's own (FUSE: user_id=N,group_id=N,...)

    @property
    def fuse_owner(self) -> int | None:
        """The uid that made a FUSE mount (its `user_id=`, set by the kernel's caller:
        mount(2) as root, or fusermount3 as the user)."""
        for option in self.options.split(","):
            name, _, value = option.partition("=")
            if name == "user_id" and value.isdigit():
                return int(value)
        return None


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def read_mountinfo(path: Path = MOUNTINFO) -> list[MountEntry]:
    """All mounts visible to this process, in mount order."""
    entries = []
    for line in path.read_text().splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 2:
            continue
        entries.append(MountEntry(_unescape(fields[4]), _unescape(tail[0]), _unescape(tail[1]),
                                  fields[2], tail[2] if len(tail) > 2 else ""))
    return entries


def _canonical(path: Path) -> str:
    """Absolute path with symlinks resolved in the parent only.

    Resolving the last component would stat the mount root, which hangs or fails on a
    dead FUSE mount.
    """
    absolute = Path(os.path.abspath(path))
    if absolute == absolute.parent:
        return str(absolute)
    return os.path.join(os.path.realpath(absolute.parent), absolute.name)


def resolve_above(path: str | os.PathLike[str], stops: set[str]) -> Path:
    """`path` absolute, with the symlinks above the first of `stops` (mount points) on its
    way resolved, and nothing at or below that one looked at: a stat there waits for the
    daemon serving it (forever, while it is stopped)."""
    pending = list(Path(os.path.abspath(path)).parts[1:])
    current = Path("/")
    hops = 0
    while pending:
        part = pending.pop(0)
        candidate = current.parent if part == ".." else current / part
        if str(candidate) in stops:
            return candidate.joinpath(*pending)
        if part != ".." and os.path.islink(candidate):
            hops += 1
            if hops > MAX_SYMLINK_HOPS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path))
            target = os.readlink(candidate)
            base = Path("/") if os.path.isabs(target) else current
            pending = list(Path(os.path.normpath(base / target)).parts[1:]) + pending
            current = Path("/")
            continue
        current = candidate
    return current


def find_mount(path: Path) -> MountEntry | None:
    """The topmost mount whose mount point is exactly `path`, if any."""
    target = _canonical(path)
    found = None
    for entry in read_mountinfo():
        if entry.mountpoint == target:
            found = entry
    return found


def set_kernel_readahead(path: Path, kib: int) -> bool:
    """Let the kernel read ahead `kib` KiB on the FUSE mount at `path`.

    A FUSE mount starts with the kernel's default of 128 KiB, so a sequential reader
    sends 128 KiB READ requests and the daemon's per-request cost dominates; 1 MiB (the
    largest FUSE request) needs an eighth of the requests. Found via mountinfo, not
    stat(): the daemon must not call into its own mount before it serves requests.
    Needs root (sysfs); without it the kernel default stays.
    """
    entry = find_mount(path)
    if entry is None or not entry.device:
        return False
    try:
        (SYSFS_BDI / entry.device / "read_ahead_kb").write_text(f"{kib}\n")
    except OSError as exc:
        log.info("kernel read-ahead of %s left at its default: %s", path, exc)
        return False
    return True


def is_mounted(path: Path) -> bool:
    return find_mount(path) is not None


def is_stale(path: Path) -> bool:
    """True when `path` is a FUSE mount whose daemon is gone (stat: ENOTCONN)."""
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno in _STALE_ERRNOS
    return False


def _run(cmd: list[str]) -> tuple[int, str]:
    """Run a mount helper; (returncode, stderr+stdout text). Missing binary -> 127."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return 127, f"{cmd[0]}: command not found"
    except subprocess.TimeoutExpired:
        return 124, f"{' '.join(cmd)}: timed out after 60 s"
    return proc.returncode, (proc.stderr + proc.stdout).strip()


def cleanup_stale(path: Path) -> None:
    """Lazily detach a FUSE mount whose daemon died, so the path can be mounted again."""
    target = _canonical(path)
    rc, out = _run(["fusermount3", "-uz", target])
    if rc != 0 and os.geteuid() == 0:
        rc, out = _run(["umount", "-l", target])
    if rc != 0 or is_mounted(path):
        how = f"umount -l {target}" if os.geteuid() == 0 else f"fusermount3 -uz {target}"
        raise MountpointError(
            f"{target} is a stale FUSE mount (its daemon died: 'Transport endpoint is not "
            f"connected') and cleaning it up failed: {out or 'still mounted'}; run: {how}")
    log.warning("cleaned up stale FUSE mount at %s (its daemon had died)", target)


def check_mountpoint(path: Path, *, _retry: bool = True) -> None:
    """Raise MountpointError unless `path` is an existing, empty, unmounted directory.

    A stale FUSE mount (daemon killed) is detached automatically and the checks rerun.
    """
    target = _canonical(path)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        raise MountpointError(f"mount point {target} does not exist; create it with: "
                              f"mkdir -p {target}") from None
    except OSError as exc:
        if exc.errno in _STALE_ERRNOS and _retry:
            cleanup_stale(Path(target))
            return check_mountpoint(Path(target), _retry=False)
        raise MountpointError(f"cannot use mount point {target}: {exc.strerror}") from None
    entry = find_mount(Path(target))
    if entry is not None:
        raise MountpointError(
            f"mount point {target} is already mounted ({entry.fstype} from {entry.source}); "
            f"unmount it first (lakefs-mount unmount {target}, or umount {target})")
    if not stat.S_ISDIR(st.st_mode):
        raise MountpointError(f"mount point {target} is not a directory")
    try:
        with os.scandir(target) as it:
            nonempty = any(True for _ in it)
    except OSError as exc:
        raise MountpointError(f"cannot list mount point {target}: {exc.strerror}") from None
    if nonempty:
        raise MountpointError(f"mount point {target} is not empty; lakefs-mount mounts only "
                              f"on an empty directory")
    if os.geteuid() != 0 and not os.access(target, os.W_OK | os.X_OK):
        raise MountpointError(f"mount point {target}: no write permission (FUSE needs the "
                              f"mounting user to own it or be allowed to write to it)")


def check_user_mount(allow_other: bool, conf: Path = FUSE_CONF,
                     device: Path = FUSE_DEVICE, option: str = "--allow-other") -> None:
    """What a mount by a user other than root (through fusermount3) needs from root:
    /dev/fuse open to the user, and user_allow_other in /etc/fuse.conf for --allow-other
    (or --allow-root, named by `option`: both let others past the kernel).
    Said before the daemon starts, with the remedy, instead of in its log."""
    if os.geteuid() == 0:
        return
    if not device.exists():
        raise MountpointError(f"{device} does not exist: load the fuse kernel module (modprobe "
                              f"fuse), or start the container with --device {device}")
    if not os.access(device, os.R_OK | os.W_OK):
        raise MountpointError(f"{device} is not open to uid {os.geteuid()} (a mount by a user "
                              f"other than root needs it read-write, as udev's fuse rule "
                              f"makes it: mode 0666); ask root to run: chmod 0666 {device}")
    if not allow_other:
        return
    try:
        allowed = any(line.strip() == "user_allow_other"
                      for line in conf.read_text(errors="replace").splitlines())
    except OSError:
        allowed = False
    if not allowed:
        raise MountpointError(f"{option} for a mount by a user other than root needs "
                              f"the line user_allow_other in {conf}; ask root to add it, or "
                              f"mount without {option}")


def check_cache_dir(path: Path) -> None:
    """Create the cache directory 0700 (dirty data lives there) and prove it is writable."""
    target = Path(os.path.abspath(path))
    try:
        target.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = target.stat()
    except OSError as exc:
        raise MountpointError(f"cannot create cache directory {target}: "
                              f"{exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise MountpointError(f"cache directory {target} is not a directory")
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != 0o700:
        try:
            os.chmod(target, 0o700)
        except OSError as exc:
            if exc.errno == errno.EROFS:
                raise MountpointError(f"cache directory {target} is not writable: "
                                      f"{exc.strerror}; pick another one with "
                                      f"--cache-dir") from None
            raise MountpointError(f"cannot chmod cache directory {target} to 0700: "
                                  f"{exc.strerror}") from None
    probe = target / f".lakefs-mount-write-test-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"ok")
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)  # also when the disk refused the write
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # writable, but full: a crash may
            log.warning("cache directory %s: its disk is full; the daemon frees space by "
                        "uploading what is pending", target)  # have left it so
            return
        raise MountpointError(f"cache directory {target} is not writable: "
                              f"{exc.strerror or exc}; pick another one with --cache-dir") from None


def unmount(path: Path, lazy: bool = False) -> None:
    """Unmount `path` with fusermount3 (umount as root if that fails).

    Raises MountpointError when it is not mounted or busy; a busy mount stays usable.
    """
    target = _canonical(path)
    if not is_mounted(Path(target)):
        raise MountpointError(f"{target} is not mounted")
    rc, out = _run(["fusermount3", "-uz" if lazy else "-u", target])
    if rc != 0 and os.geteuid() == 0 and "busy" not in out.lower():
        rc, out = _run(["umount", "-l", target] if lazy else ["umount", target])
    if rc != 0:
        if "busy" in out.lower():
            raise MountpointError(f"{target} is busy: {out} (some process has a file open or "
                                  f"its working directory there; see: fuser -vm {target})")
        if not is_mounted(Path(target)):
            raise MountpointError(f"{target} is not mounted")
        raise MountpointError(f"unmounting {target} failed: {out}")

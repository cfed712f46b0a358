"""Mounting without CAP_SYS_ADMIN: the setuid-root `fusermount3` opens /dev/fuse, mounts
it, and hands the descriptor back over a Unix socket (SCM_RIGHTS) named by the
`_FUSE_COMMFD` environment variable, as libfuse and go-fuse do for a user's mount."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

FUSERMOUNT = "fusermount3"
COMMFD_ENV = "_FUSE_COMMFD"
TIMEOUT = 60.0
# what `fusermount3 -u` says of a path that is not (or no longer) a FUSE mount
_NOT_MOUNTED = ("not found in", "not mounted", "invalid argument", "no such file")


class FusermountError(Exception):
    """fusermount3 refused or failed; `str()` is its own last line, with its name."""


def _run(args: list[str], **kwargs: object) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([FUSERMOUNT, *args], capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=TIMEOUT, check=False,
                              **kwargs)  # type: ignore[call-overload]
    except FileNotFoundError:
        raise FusermountError(f"{FUSERMOUNT} not found: install fuse3 (it mounts FUSE file "
                              f"systems for users other than root)") from None
    except subprocess.TimeoutExpired:
        raise FusermountError(f"{FUSERMOUNT} did not finish in {TIMEOUT:.0f} s") from None


def _last_line(proc: subprocess.CompletedProcess) -> str:
    lines = (proc.stderr + proc.stdout).strip().splitlines()
    return lines[-1] if lines else f"{FUSERMOUNT} exited with status {proc.returncode}"


def mount(mountpoint: Path, options: str) -> int:
    """Mount a new FUSE connection at `mountpoint`; returns its /dev/fuse descriptor
    (close-on-exec, non-blocking). fusermount3 adds fd, rootmode, user_id, group_id,
    nosuid and nodev itself, and checks that the user may mount there."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        proc = _run(["-o", options, "--", str(mountpoint)], pass_fds=(theirs.fileno(),),
                    env={**os.environ, COMMFD_ENV: str(theirs.fileno())})
        theirs.close()  # so that a fusermount3 that sent nothing reads as end of stream
        if proc.returncode != 0:
            raise FusermountError(_last_line(proc))
        _, fds, _, _ = socket.recv_fds(ours, 1, 1, socket.MSG_CMSG_CLOEXEC)
    finally:
        ours.close()
        theirs.close()
    if not fds:  # mounted, but the descriptor never came: nothing would serve the mount
        unmount(mountpoint)
        raise FusermountError(f"{FUSERMOUNT} mounted {mountpoint} but sent no /dev/fuse "
                              f"descriptor back")
    os.set_blocking(fds[0], False)
    return fds[0]


def unmount(mountpoint: Path) -> None:
    """Detach the mount lazily (`fusermount3 -uz`); a mount already gone is no error."""
    proc = _run(["-uz", "--", str(mountpoint)])
    if proc.returncode != 0 and not any(s in _last_line(proc).lower() for s in _NOT_MOUNTED):
        raise OSError(f"{FUSERMOUNT} -uz {mountpoint}: {_last_line(proc)}")

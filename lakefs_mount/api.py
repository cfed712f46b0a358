"""The Python API: flush, commit and status of a lakefs-mount mount from training code,
through the daemon's control socket (no subprocess).

    import lakefs_mount
    lakefs_mount.flush("/mnt/ckpt/step_100")
    lakefs_mount.commit("/mnt/ckpt/step_100", expect_files=8, timeout=600)

A path is any path inside a mount; the mount is found in /proc/self/mountinfo.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from lakefs_mount.config import FSTYPE_NAME, control_socket_path
from lakefs_mount.ops import controlclient
from lakefs_mount.ops.mountpoint import read_mountinfo, resolve_above

FSTYPE = f"fuse.{FSTYPE_NAME}"  # what /proc/mounts shows a mount as


class LakefsMountError(Exception):
    """A call failed: no daemon, S3 failing, a timeout; `str()` says why."""


class NotALakefsMount(LakefsMountError):
    """The path is not inside a lakefs-mount mount."""


class VerifyFailed(LakefsMountError):
    """The checkpoint does not match its manifest, or has none; `report` is what
    `verify --json` prints, `str()` its first problems."""

    def __init__(self, message: str, report: dict[str, Any]) -> None:
        super().__init__(message)
        self.report = report


def locate(path: str | os.PathLike[str]) -> tuple[Path, str]:
    """(mount point, path relative to its root, "" for the root) of a path inside a
    lakefs-mount mount; NotALakefsMount otherwise."""
    mounts = read_mountinfo()
    # symlinks resolved only above a FUSE mount point: a stat in a mount waits for its
    # daemon, and would hold a call whose timeout must bound it (a stopped daemon)
    target = resolve_above(path, {e.mountpoint for e in mounts if e.fstype.startswith("fuse")})
    best: Path | None = None
    fstype = ""
    for entry in mounts:  # the deepest mount holding it; a later one covers
        mp = Path(entry.mountpoint)
        if (target == mp or mp in target.parents) and (
                best is None or len(mp.parts) >= len(best.parts)):
            best, fstype = mp, entry.fstype
    if best is None or not _is_ours(fstype, best):
        raise NotALakefsMount(f"{path} is not on a lakefs-mount mount (no such mount "
                              f"contains {target})")
    rel = target.relative_to(best).as_posix()
    return best, "" if rel == "." else rel


def _is_ours(fstype: str, mountpoint: Path) -> bool:
    """A FUSE mount whose daemon's control socket exists (the fstype alone does not
    tell: libfuse names it after the program)."""
    return fstype.startswith("fuse") and control_socket_path(mountpoint).exists()


def _call(mountpoint: Path, request: dict, timeout: float | None,
          on_progress: Callable[[dict], None] | None = None) -> dict[str, Any]:
    try:
        return controlclient.call(mountpoint, request, timeout=timeout, on_progress=on_progress)
    except controlclient.ControlError as exc:
        raise LakefsMountError(f"{request['op']} on {mountpoint}: {exc}") from None


def flush(path: str | os.PathLike[str], timeout: float | None = None,
          on_progress: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Block until everything written under `path` is in S3 (as `lakefs-mount flush`)."""
    mp, rel = locate(path)
    return _call(mp, {"op": "flush", "path": rel or None}, timeout, on_progress)


def commit(path: str | os.PathLike[str], expect_files: int | None = None,
           expect: Iterable[str] = (), timeout: float | None = None,
           on_progress: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Publish the checkpoint directory `path` with its manifest (as `lakefs-mount
    commit`); returns the manifest's key, the number of files and bytes."""
    mp, rel = locate(path)
    request = {"op": "commit", "path": rel, "expect_files": expect_files,
               "expect": list(expect), "timeout": timeout}
    return _call(mp, request, None if timeout is None else timeout + 60, on_progress)


def verify(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint at `path` against its manifest (as `lakefs-mount verify`): its
    report when everything matches; VerifyFailed (with the report) when not."""
    mp, rel = locate(path)
    report = _call(mp, {"op": "verify", "path": rel}, None)
    if report.get("ok"):
        return report
    where = f"s3://{report.get('bucket')}/{report.get('prefix')}"
    if report.get("manifest") == "missing":
        raise VerifyFailed(f"{where} has no manifest: never committed (or not yet)", report)
    problems = report.get("problems") or []
    shown = "; ".join(f"{p['kind']}: {p['key']}: {p['detail']}" for p in problems[:3])
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    raise VerifyFailed(f"{where} does not match its manifest: {shown}{more}", report)


def status(mountpoint: str | os.PathLike[str], timeout: float = 10.0) -> dict[str, Any]:
    """The status of the mount containing `mountpoint` (as `lakefs-mount status --json`)."""
    mp, _ = locate(mountpoint)
    return _call(mp, {"op": "status"}, timeout)

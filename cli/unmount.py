"""`lakefs-mount unmount`: flush, unmount, wait for the daemon to exit; a dead mount whose
daemon is gone is detached."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click

from lakefs_mount.cli.errors import PROG, CliError
from lakefs_mount.cli.params import MOUNT_POINT, abs_path
from lakefs_mount.cli.progress import ProgressPrinter, left_bytes
from lakefs_mount.config import human_bytes
from lakefs_mount.ops import controlclient
from lakefs_mount.ops.controlclient import (
    NO_ANSWER,
    ControlError,
    ControlTimeout,
    DaemonNotRunning,
)
from lakefs_mount.ops.mountpoint import MountpointError

EXIT_WAIT = 60.0  # seconds `unmount` waits for the daemon process to exit


def _pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone: its work is over). The main thread
    of a multi-threaded daemon turns zombie before its other threads have exited: the
    process is gone only when no other thread is left."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                return True
        return len(os.listdir(f"/proc/{pid}/task")) > 1
    except (OSError, IndexError):
        return False


def _unmount_without_daemon(mp: Path, error: ControlError) -> None:
    """No daemon answers: detach a dead FUSE mount, otherwise report why nothing happened."""
    from lakefs_mount.ops import mountpoint as mpt

    entry = mpt.find_mount(mp)
    if entry is None:
        raise CliError(str(error))
    if not mpt.is_stale(mp):
        raise CliError(f"{mp} is mounted ({entry.fstype} from {entry.source}) but no "
                       f"lakefs-mount daemon answers on its control socket; if it is not a "
                       f"lakefs-mount mount, use: umount {mp}")
    mpt.cleanup_stale(mp)
    click.echo(f"{PROG}: {mp} was a dead mount (its daemon had died); detached it. Data not "
               f"yet in S3 stays in the cache and is uploaded at the next mount with the "
               f"same cache directory.", err=True)


@click.command()
@click.argument("mountpoint", type=MOUNT_POINT)
@click.option("--no-flush", is_flag=True, help="Do not wait for dirty data to reach S3.")
@click.option("--timeout", type=click.FloatRange(min=0), metavar="SECONDS",
              help="Give up on the flush after this long (the mount stays).")
def unmount(mountpoint: Path, no_flush: bool, timeout: float | None) -> None:
    """Flush everything to S3, unmount, and wait until the daemon has exited."""
    from lakefs_mount.ops import mountpoint as mpt

    mp = abs_path(mountpoint)
    printer = ProgressPrinter("flushing before unmount")
    try:
        result = controlclient.call(mp, {"op": "unmount", "flush": not no_flush}, timeout=timeout,
                              on_progress=printer)
    except DaemonNotRunning as exc:
        printer.done()
        _unmount_without_daemon(mp, exc)
        return
    except ControlTimeout as exc:
        printer.done()
        left = left_bytes(exc.last_progress or printer.last)
        still = f"; {human_bytes(left)} still dirty" if left is not None else ""
        why = "" if exc.answered else f": the daemon {NO_ANSWER}"
        raise CliError(f"flush before unmount timed out after {timeout:g} s{why}{still}; "
                       f"{mp} stays mounted") from None
    except ControlError as exc:
        printer.done()
        raise CliError(f"cannot unmount {mp}: {exc}; it stays mounted") from None
    printer.done()
    pid = result.get("pid")
    try:
        mpt.unmount(mp)
    except MountpointError as exc:
        if mpt.is_mounted(mp):
            raise CliError(f"{exc}; {mp} stays mounted and usable") from None
    if isinstance(pid, int) and pid > 0:
        deadline = time.monotonic() + EXIT_WAIT
        while _pid_alive(pid):
            if time.monotonic() > deadline:
                raise CliError(f"{mp} is unmounted, but the daemon (pid {pid}) is still "
                               f"running after {EXIT_WAIT:g} s; see its log")
            time.sleep(0.1)


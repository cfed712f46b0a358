"""`mount.fuse.lakefs-mount`: the helper mount(8) runs for `-t fuse.lakefs-mount` and fstab
lines; it runs `lakefs-mount mount` with the options its `-o` items name (mount_options)
and exits as mount(8) does: 0 mounted, 1 bad usage or permissions, 2 system error, 4 a
bug, 8 interrupted, 32 the mount failed.

`lakefs-mount mount` runs as a process of its own, told to exit with mount(8)'s statuses
(it alone knows a bad argument from a busy mount point), with the variables of the `env.`
items added to its environment: the daemon it forks keeps that command line, never the
helper's, whose `-o` holds their values (which `ps` would show for the mount's life)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import click

from lakefs_mount.cli.errors import EXIT_STATUS_ENV, MOUNT8, PROG, MountStatus
from lakefs_mount.cli.mount_options import HELPER, HelperError, mount_arguments, shown_env


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of `mount.fuse.lakefs-mount`."""
    sys.exit(run(sys.argv[1:] if argv is None else argv))


def run(argv: Sequence[str]) -> int:
    """Mount as the helper command line `argv` says; mount(8)'s exit status."""
    try:
        args, ns = mount_arguments(argv)
    except HelperError as exc:
        click.echo(f"{HELPER}: {exc}", err=True)
        return MountStatus.USAGE
    except SystemExit as exc:  # argparse: --help (0), or a bad command line (2)
        return MountStatus.USAGE if exc.code else MountStatus.OK
    if ns.verbose or ns.fake:
        env = f"{shown_env(ns.env)} " if ns.env else ""
        click.echo(f"{HELPER}: {env}{PROG} {' '.join(args)}", err=True)
    if ns.fake:
        return MountStatus.OK
    return _run_mount(args, ns.env)


def _command() -> list[str]:
    """`lakefs-mount` of this installation: the script beside this Python, else the
    package run as a module."""
    script = Path(sys.executable).parent / PROG
    return [str(script)] if script.exists() else [sys.executable, "-m", "lakefs_mount.cli"]


def _run_mount(args: list[str], env: dict[str, str]) -> int:
    """`lakefs-mount ARGS` with `env` added; its status, which is mount(8)'s already.
    Ctrl-C reaches it too (the terminal's process group): it stops what it started and
    says so, and the helper only waits for that."""
    signal.signal(signal.SIGINT, lambda _signum, _frame: None)  # (default again in it)
    try:
        child = subprocess.Popen([*_command(), *args],
                                 env={**os.environ, **env, EXIT_STATUS_ENV: MOUNT8})
    except OSError as exc:
        click.echo(f"{HELPER}: cannot run {PROG}: {exc}", err=True)
        return MountStatus.SYSTEM
    while True:
        try:
            rc = child.wait()
            break
        except KeyboardInterrupt:  # (no handler yet while Popen ran: wait on)
            continue
    if rc < 0:  # killed by a signal, before it could say anything
        click.echo(f"{HELPER}: {PROG} was killed by signal {-rc}", err=True)
        return (MountStatus.INTERRUPTED if -rc in (signal.SIGINT, signal.SIGTERM,
                                                   signal.SIGHUP) else MountStatus.SOFTWARE)
    return MountStatus.INTERRUPTED if rc == 130 else rc


if __name__ == "__main__":
    main()

"""Running the mount daemon: in the foreground, or forked into the background with a pipe
on which the child reports once whether the mount is usable."""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import click

from lakefs_mount.cli.errors import PROG, CliError
from lakefs_mount.config import MountConfig, human_bytes, orphans_dir
from lakefs_mount.ops.mountpoint import cleanup_stale, is_mounted, is_stale

READY_TIMEOUT = 120.0  # seconds the parent waits for the daemon to report the mount
INTERRUPT_POLL = 0.05  # seconds between looks for a Ctrl-C while waiting for the daemon
CALL_OFF_WAIT = 5.0  # seconds an interrupted mount waits for its daemon to exit, per signal


def _import_run_mount() -> Callable[[MountConfig, Callable[[str | None], None]], int]:
    """The daemon entry point, imported late: it pulls in pyfuse3, trio and boto3."""
    try:
        from lakefs_mount.daemon.daemon import run_mount
    except ModuleNotFoundError as exc:
        if exc.name not in ("lakefs_mount.daemon", "lakefs_mount.daemon.daemon"):
            raise
        raise CliError("this installation has no mount daemon (lakefs_mount.daemon)") from None
    return run_mount


def run_foreground(config: MountConfig) -> int:
    """Run the daemon in this process with logs on stderr (and in the log file)."""
    from lakefs_mount.logsetup import setup_logging

    setup_logging(config.log_level, config.log_file, foreground=True,
                  log_format=config.log_format)
    run_mount = _import_run_mount()

    def report_ready(error: str | None) -> None:
        if error:
            click.echo(f"{PROG}: {error}", err=True)

    return run_mount(config, report_ready)


def daemonize(config: MountConfig) -> int:
    """Fork a session leader that runs the mount; return the parent's exit status."""
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    # Ctrl-C from here on is noted, never raised: raised between the fork and the wait,
    # or after the report, it ended the command as `interrupted` with a daemon that mounts
    # (or had mounted) behind it. The wait decides what a noted one means.
    interrupted: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: interrupted.append(signum))
    pid = os.fork()
    if pid == 0:  # child: never returns
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.close(read_fd)
        _daemon_child(config, write_fd)
    os.close(write_fd)
    try:
        return _wait_ready(config, pid, read_fd, interrupted)
    finally:
        # the command is decided: a late Ctrl-C must not kill it with a signal status
        # (Python restores SIGINT's default while it exits; an ignored one it leaves)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _daemon_child(config: MountConfig, write_fd: int) -> None:
    """Body of the forked daemon: detach, log to the file, run the mount, _exit."""
    rc = 1
    reported = False

    def report_ready(error: str | None) -> None:
        nonlocal reported
        if reported:
            return
        reported = True
        message = {"ok": True} if error is None else {"ok": False, "error": error}
        try:
            os.write(write_fd, json.dumps(message).encode() + b"\n")
            os.close(write_fd)
        except OSError:
            pass  # the parent gave up waiting; nothing to tell

    try:
        os.setsid()
        os.chdir("/")  # never keep the caller's working directory busy
        assert config.log_file is not None
        null = os.open(os.devnull, os.O_RDWR)
        log_fd = os.open(config.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(null, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(null)
        os.close(log_fd)
        from lakefs_mount.logsetup import setup_logging

        setup_logging(config.log_level, config.log_file, foreground=False, own_stdio=True,
                      log_format=config.log_format)
        rc = _import_run_mount()(config, report_ready)
        if not reported:
            report_ready(f"the daemon exited (status {rc}) without mounting; "
                         f"see {config.log_file}")
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
        report_ready(f"the daemon exited (status {rc}) without mounting; "
                     f"see {config.log_file}")
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        import logging
        import traceback

        logging.getLogger("lakefs_mount.cli").error("daemon failed: %s", exc, exc_info=True)
        traceback.print_exc()
        report_ready(f"the daemon failed: {exc}; see {config.log_file}")
        rc = rc or 1
    finally:
        try:
            import logging

            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)


def _wait_ready(config: MountConfig, pid: int, read_fd: int, interrupted: list[int]) -> int:
    """Parent side: wait for the child's one JSON line on the pipe. A Ctrl-C noted before
    the line arrived (`interrupted`) stops the daemon, mounted or not."""
    buf = b""
    deadline = time.monotonic() + READY_TIMEOUT
    try:
        while b"\n" not in buf:
            if interrupted:
                _call_off(config, pid)
                raise CliError("interrupted; nothing is mounted (the daemon was stopped)", 130)
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGTERM)
                click.echo(f"{PROG}: the daemon (pid {pid}) did not report the mount ready "
                           f"within {READY_TIMEOUT:g} s; stopped it. See {config.log_file}",
                           err=True)
                return 1
            ready, _, _ = select.select([read_fd], [], [], min(left, INTERRUPT_POLL))
            if ready:
                chunk = os.read(read_fd, 65536)
                if not chunk:
                    break
                buf += chunk
    finally:
        os.close(read_fd)
    if b"\n" not in buf:
        status = _reap(pid, 5.0)
        click.echo(f"{PROG}: the mount daemon died before the mount was ready"
                   f"{status}. Last lines of {config.log_file}:", err=True)
        click.echo(_tail(config.log_file), err=True)
        return 1
    try:
        message = json.loads(buf.split(b"\n", 1)[0])
    except ValueError:
        message = {"ok": False, "error": f"garbled report from the daemon: {buf[:200]!r}"}
    if message.get("ok"):
        _tell_of_orphans(config)
        return 0
    click.echo(f"{PROG}: {message.get('error') or 'mount failed'}", err=True)
    _reap(pid, 10.0)  # let it finish cleaning up so a retry finds the mount point free
    return 1


def _tell_of_orphans(config: MountConfig) -> None:
    """Cache files the mount kept aside because no journal names them (D20: a crash with a
    lost or damaged journal) may be the only copy of written bytes: the one who mounts
    hears of it, not only the log. Said at each mount until the folder is gone."""
    orphans = orphans_dir(config.resolved_cache_dir())
    try:
        sizes = [p.stat().st_size for p in orphans.iterdir() if p.is_file()]
    except OSError:
        return
    if sizes:
        click.echo(f"{PROG}: mounted; {len(sizes)} cache file(s) ({human_bytes(sum(sizes))}) "
                   f"that no journal names are kept in {orphans} (a crash with a lost or "
                   f"damaged journal): they may hold the only copy of written data; "
                   f"`{PROG} orphans list|upload {config.mountpoint}` shows or uploads them",
                   err=True)


def _call_off(config: MountConfig, pid: int) -> None:
    """Ctrl-C while the daemon starts: stop it, so that it never mounts after `mount`
    said it was interrupted. A daemon still starting dies of SIGTERM; one that has
    mounted unmounts, and a second SIGTERM stops its upload of what an earlier mount
    left (the journal keeps that); a stale mount of one killed in between is detached."""
    for sig, wait in ((signal.SIGTERM, CALL_OFF_WAIT), (signal.SIGTERM, CALL_OFF_WAIT),
                      (signal.SIGKILL, CALL_OFF_WAIT)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            break
        if _reap(pid, wait):
            break
    if is_mounted(config.mountpoint) and is_stale(config.mountpoint):
        cleanup_stale(config.mountpoint)


def _reap(pid: int, timeout: float) -> str:
    """Wait up to `timeout` for our child; describe how it ended."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if os.WIFSIGNALED(status):
                return f" (killed by signal {os.WTERMSIG(status)})"
            return f" (exit status {os.WEXITSTATUS(status)})"
        if time.monotonic() > deadline:
            return ""
        time.sleep(0.05)


def _tail(path: Path | None, lines: int = 20) -> str:
    if path is None:
        return "(no log file)"
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode(errors="replace")
    except OSError as exc:
        return f"(cannot read the log: {exc.strerror})"
    return "\n".join(text.splitlines()[-lines:]) or "(the log is empty)"

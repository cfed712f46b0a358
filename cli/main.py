"""`lakefs-mount` command line: mount, flush, unmount, status.

Every expected failure ends as one line `lakefs-mount: <message>` on stderr and a non-zero
exit status (2: bad arguments or unusable mount point / cache directory; 1: the operation
itself failed), never as a Python traceback.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from lakefs_mount import control
from lakefs_mount.cli.daemonize import daemonize, run_foreground
from lakefs_mount.cli.errors import PROG, CliError
from lakefs_mount.cli.progress import ProgressPrinter, count, left_bytes
from lakefs_mount.cli.publish import COMMANDS as PUBLISH_COMMANDS
from lakefs_mount.config import (
    MiB,
    MountConfig,
    default_log_file,
    human_bytes,
    parse_metrics_addr,
    parse_size,
    parse_source,
)
from lakefs_mount.control import ControlError, ControlTimeout, DaemonNotRunning
from lakefs_mount.logsetup import LOG_FORMATS
from lakefs_mount.mountpoint import (
    MountpointError,
    check_cache_dir,
    check_mountpoint,
    check_user_mount,
)
from lakefs_mount.s3.objectstore import ObjectStoreError
from lakefs_mount.s3.stats import WAITING_AFTER

EXIT_WAIT = 60.0  # seconds `unmount` waits for the daemon process to exit


def _fail(message: str, code: int) -> None:
    click.echo(f"{PROG}: {message}", err=True)
    sys.exit(code)


class _Group(click.Group):
    """Prints every error as `lakefs-mount: <message>` instead of click's format."""

    def main(self, args: Any = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        args = self._mount_fuse_form(args)
        try:
            rv = super().main(args, prog_name or PROG, complete_var, False, **extra)
        except click.UsageError as exc:
            hint = f" (see: {exc.ctx.command_path} --help)" if exc.ctx else ""
            _fail(exc.format_message() + hint, exc.exit_code)
        except click.ClickException as exc:
            _fail(exc.format_message(), exc.exit_code)
        except (ControlError, MountpointError, ObjectStoreError) as exc:
            _fail(str(exc), 1)
        except (click.Abort, KeyboardInterrupt):
            _fail("interrupted", 130)
        sys.exit(rv if isinstance(rv, int) else 0)

    def _mount_fuse_form(self, args: Any) -> Any:
        """fuse3's generic helper mount.fuse3, which mount(8) runs for `-t fuse.lakefs-mount`
        where /sbin has no mount.fuse.lakefs-mount, runs `lakefs-mount SOURCE MOUNTPOINT -o
        OPTIONS`: that command line means what it means to mount.fuse.lakefs-mount."""
        argv = list(sys.argv[1:] if args is None else args)
        if not argv or argv[0] in self.commands or argv[0].startswith("-") or "-o" not in argv:
            return args
        from lakefs_mount.cli.mount_helper import HelperError, mount_arguments

        try:
            return mount_arguments(argv)[0]
        except HelperError as exc:
            _fail(str(exc), 1)


# ---------------------------------------------------------------------------- helpers


class SizeType(click.ParamType):
    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(str(value))
        except ValueError:
            self.fail(f"not a size: {value!r} (use e.g. 512M, 64G)", param, ctx)


SIZE = SizeType()


def _abs(path: Path | str) -> Path:
    """Absolute path without resolving the last component (it may be a dead mount)."""
    return Path(os.path.abspath(path))


def _is_relative_to(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


# ---------------------------------------------------------------------------- cli


@click.group(PROG, cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="lakefs-mount", prog_name=PROG)
def cli() -> None:
    """Mount an S3 bucket with a crash-safe local write-back cache (built for checkpoints)."""


for _command in PUBLISH_COMMANDS:  # commit, verify (cli/publish.py)
    cli.add_command(_command)


MOUNT_EPILOG = """\b
Exit status: 0 mounted; 2 bad arguments, or a mount point / cache directory that cannot
be used (missing, not a directory, not empty, already mounted, not writable); 1 the mount
itself failed (S3 unreachable, wrong credentials, daemon died).
"""


@cli.command(epilog=MOUNT_EPILOG)
@click.argument("args", nargs=-1, required=True, metavar="[SOURCE] MOUNTPOINT")
@click.option("--cache-dir", type=click.Path(path_type=Path),
              help="Local cache directory (default: under the state directory).")
@click.option("--cache-size", type=SIZE, default="64G", show_default=True,
              help="Local cache size; clean chunks are evicted beyond it.")
@click.option("--max-dirty", type=SIZE, default="16G", show_default=True,
              help="Dirty bytes not yet in S3 before writers wait.")
@click.option("--endpoint-url", envvar="AWS_ENDPOINT_URL", metavar="URL",
              help="S3 endpoint (env AWS_ENDPOINT_URL).")
@click.option("--region", help="S3 region.")
@click.option("--profile", help="AWS profile for credentials.")
@click.option("--part-size", type=SIZE, default="16M", show_default=True,
              help="Multipart part size, 8M..512M, a multiple of 1 MiB.")
@click.option("--upload-concurrency", type=click.IntRange(1, 64), default=8,
              show_default=True, help="Parallel part uploads.")
@click.option("--foreground", "-f", is_flag=True, help="Stay in the foreground, log to stderr.")
@click.option("--allow-other", is_flag=True, help="Let other users access the mount.")
@click.option("--read-only", is_flag=True, help="Mount read-only.")
@click.option("--fsync", "fsync_mode", type=click.Choice(["local", "remote"]), default="local",
              show_default=True,
              help="fsync(): durable on local disk, or committed in S3.")
@click.option("--io-engine", type=click.Choice(["auto", "uring", "threads"]), default="auto",
              show_default=True, help="Cache-file I/O engine.")
@click.option("--fuse-session", type=click.Choice(["auto", "native", "pyfuse3"]), default="auto",
              show_default=True, help="FUSE session: native (/dev/fuse; kernel passthrough "
              "as root) or pyfuse3 (libfuse); auto takes native where it can start.")
@click.option("--metadata-ttl", type=click.FloatRange(min=0), default=5.0, show_default=True,
              metavar="SECONDS", help="How long listings and attributes are cached.")
@click.option("--commit-delay", type=click.FloatRange(min=0), default=1.0, show_default=True,
              metavar="SECONDS", help="How long a closed file waits before it is committed, "
              "so that a rename right after writing costs no copy (flush does not wait).")
@click.option("--read-ahead", type=click.IntRange(0, 256), default=4, show_default=True,
              metavar="CHUNKS", help="Chunks prefetched ahead of sequential readers.")
@click.option("--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"],
                                               case_sensitive=False),
              default="INFO", show_default=True, metavar="[DEBUG|INFO|WARNING|ERROR]")
@click.option("--log-format", type=click.Choice(LOG_FORMATS), default="text", show_default=True,
              help="Log lines as text, or as one JSON object per line for log shippers.")
@click.option("--log-file", type=click.Path(path_type=Path),
              help="Log file (default: <state dir>/logs/<mount id>.log).")
@click.option("--embedded-dir", type=click.Path(path_type=Path),
              help="Data directory of the embedded S3 server (only without SOURCE).")
@click.option("--commit-on-rename", metavar="GLOB", help="Commit a directory (see: commit) "
              "once it is renamed to a name matching GLOB, e.g. 'checkpoint-*'.")
@click.option("--metrics-addr", metavar="HOST:PORT",
              help="Serve Prometheus metrics at http://HOST:PORT/metrics (default: off; "
              "':PORT' listens on 127.0.0.1 only).")
@click.pass_context
def mount(ctx: click.Context, args: tuple[str, ...], **opts: Any) -> None:
    """Mount SOURCE (s3://bucket[/prefix]) at MOUNTPOINT.

    Without SOURCE a private embedded S3 server (SeaweedFS) is started. Returns once the
    mount is ready; the daemon keeps running in the background unless -f is given.
    """
    config = _build_config(ctx, args, opts)
    try:
        check_mountpoint(config.mountpoint)
        check_user_mount(config.allow_other)
        check_cache_dir(config.resolved_cache_dir())
    except MountpointError as exc:
        raise CliError(str(exc), 2) from None
    assert config.log_file is not None
    try:
        from lakefs_mount.logsetup import open_log_file

        open_log_file(config.log_file)
    except OSError as exc:
        raise CliError(f"cannot create log file {config.log_file}: {exc.strerror}", 2) from None
    if opts["foreground"]:
        sys.exit(run_foreground(config))
    sys.exit(daemonize(config))


def _build_config(ctx: click.Context, args: tuple[str, ...], opts: dict[str, Any]) -> MountConfig:
    """Turn the command line into a validated MountConfig (UsageError on bad input)."""
    if len(args) > 2:
        raise click.UsageError("expected [SOURCE] MOUNTPOINT, got "
                               f"{len(args)} arguments", ctx)
    source = args[0] if len(args) == 2 else None
    mountpoint = _abs(args[-1])
    bucket, prefix = None, ""
    if source is not None:
        try:
            bucket, prefix = parse_source(source)
        except ValueError as exc:
            raise click.UsageError(str(exc), ctx) from None
    else:
        for name in ("endpoint_url", "profile", "region"):
            if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
                raise click.UsageError(f"--{name.replace('_', '-')} needs a SOURCE "
                                       f"(s3://bucket[/prefix]); without one the embedded "
                                       f"server is used", ctx)
    if source is not None and opts["embedded_dir"] is not None:
        raise click.UsageError("--embedded-dir applies only without SOURCE", ctx)
    part_size = opts["part_size"]
    if not 8 * MiB <= part_size <= 512 * MiB or part_size % MiB:
        raise click.BadParameter(f"{human_bytes(part_size)} is not allowed: use 8M..512M in "
                                 f"whole MiB", ctx, param_hint="'--part-size'")
    if opts["max_dirty"] < part_size:
        raise click.BadParameter("must be at least one part (--part-size)", ctx,
                                 param_hint="'--max-dirty'")
    if opts["cache_size"] < opts["max_dirty"]:
        raise click.BadParameter("must be at least --max-dirty (dirty data is never "
                                 "evicted)", ctx, param_hint="'--cache-size'")
    cache_dir = _abs(opts["cache_dir"]) if opts["cache_dir"] else None
    if cache_dir is not None and _is_relative_to(cache_dir, mountpoint):
        raise click.BadParameter("must not be inside the mount point", ctx,
                                 param_hint="'--cache-dir'")
    if opts["metrics_addr"] is not None:
        try:
            parse_metrics_addr(opts["metrics_addr"])
        except ValueError as exc:
            raise click.BadParameter(str(exc), ctx, param_hint="'--metrics-addr'") from None
    log_file = _abs(opts["log_file"]) if opts["log_file"] else default_log_file(mountpoint)
    if _is_relative_to(log_file, mountpoint):
        raise click.BadParameter("must not be inside the mount point", ctx,
                                 param_hint="'--log-file'")
    return MountConfig(
        mountpoint=mountpoint, bucket=bucket, prefix=prefix,
        endpoint_url=opts["endpoint_url"] if source is not None else None,
        region=opts["region"], profile=opts["profile"], cache_dir=cache_dir,
        cache_size=opts["cache_size"], max_dirty=opts["max_dirty"], part_size=part_size,
        upload_concurrency=opts["upload_concurrency"], allow_other=opts["allow_other"],
        read_only=opts["read_only"], fsync_mode=opts["fsync_mode"],
        io_engine=opts["io_engine"], fuse_session=opts["fuse_session"],
        metadata_ttl=opts["metadata_ttl"],
        commit_delay=opts["commit_delay"],
        read_ahead=opts["read_ahead"], log_level=opts["log_level"].upper(),
        log_file=log_file, log_format=opts["log_format"],
        embedded_dir=_abs(opts["embedded_dir"]) if opts["embedded_dir"] else None,
        metrics_addr=opts["metrics_addr"], commit_on_rename=opts["commit_on_rename"],
    )


# ---------------------------------------------------------------------------- flush


def _relative_in_mount(mountpoint: Path, path: str | None,
                       param_hint: str = "PATH") -> str | None:
    """PATH (absolute inside the mount, or relative to its root) -> key-relative path."""
    if path is None:
        return None
    candidate = Path(os.path.normpath(mountpoint / path))  # absolute `path` wins in `/`
    if not _is_relative_to(candidate, mountpoint):
        real_mp = Path(os.path.realpath(mountpoint))
        candidate = Path(os.path.realpath(candidate))
        if not _is_relative_to(candidate, real_mp):
            raise click.BadParameter(f"{path} is outside the mount {mountpoint}",
                                     param_hint=param_hint)
        mountpoint = real_mp
    rel = candidate.relative_to(mountpoint).as_posix()
    return None if rel in ("", ".") else rel


def _path_op(op: str, mp: Path, rel: str | None, timeout: float | None, verb: str,
             left_is: str, as_json: bool) -> dict:
    """A daemon operation on PATH that reports progress (flush, warmup): its result (also
    as a JSON line on stdout with --json), or a CliError that says why it failed, or what
    was left when it timed out."""
    name = {"warmup": "warm-up"}.get(op, op)
    printer = ProgressPrinter(verb, as_json)
    try:
        result = control.call(mp, {"op": op, "path": rel}, timeout=timeout,
                              on_progress=printer)
        printer.done(finished=True)
        if as_json:
            click.echo(json.dumps({"result": result}, default=str))
        return result
    except ControlTimeout as exc:
        left = left_bytes(exc.last_progress or printer.last)
        still = f"; {left} bytes ({human_bytes(left)}) {left_is}" if left is not None else ""
        raise CliError(f"{name} timed out after {timeout:g} s{still}") from None
    except ControlError as exc:
        raise CliError(f"{name} of {mp / (rel or '')} failed: {exc}") from None
    finally:
        printer.done()


def _path_command(timeout_help: str) -> Callable[[Callable[..., None]], click.Command]:
    """A command over MOUNTPOINT [PATH] with --timeout and --json (flush, warmup)."""
    def make(fn: Callable[..., None]) -> click.Command:
        fn = click.option("--json", "as_json", is_flag=True,
                          help="Progress and result as JSON lines on stdout, for scripts.")(fn)
        fn = click.option("--timeout", type=click.FloatRange(min=0), metavar="SECONDS",
                          help=timeout_help)(fn)
        fn = click.argument("path", required=False)(fn)
        fn = click.argument("mountpoint", type=click.Path(path_type=Path))(fn)
        return cli.command()(fn)
    return make


@_path_command("Give up (exit 1) after this long; default: wait until done.")
def flush(mountpoint: Path, path: str | None, timeout: float | None, as_json: bool) -> None:
    """Block until everything written under PATH (default: the whole mount) is in S3.

    PATH is absolute inside the mount or relative to its root. Exit status 0 only when the
    data is committed in S3.
    """
    mp = _abs(mountpoint)
    rel = _relative_in_mount(mp, path)
    result = _path_op("flush", mp, rel, timeout, "flushing", "still dirty", as_json)
    if sys.stderr.isatty() and not as_json:
        flushed = result.get("flushed_bytes")
        extra = f" ({human_bytes(flushed)} uploaded)" if flushed else ""
        click.echo(f"{PROG}: {mp / (rel or '')} is in S3{extra}", err=True)


@_path_command("Give up (exit 1) after this long; what came stays cached.")
def warmup(mountpoint: Path, path: str | None, timeout: float | None, as_json: bool) -> None:
    """Fetch every file under PATH (default: the whole mount) from S3 into the cache.

    A restore that follows reads from the cache disk instead of S3: run it while the job
    still starts. Chunks are fetched with parallel ranged GETs straight into the cache
    files, within --cache-size (a PATH larger than the cache is refused). Files with
    changes not yet in S3 are skipped: their bytes are here already. Interrupting stops
    the warm-up; what was fetched stays cached.
    """
    mp = _abs(mountpoint)
    rel = _relative_in_mount(mp, path)
    result = _path_op("warmup", mp, rel, timeout, "warming", "not yet cached", as_json)
    if as_json:
        return
    files, local = result.get("files", 0), result.get("local_files", 0)
    skipped = (f"; {count(local, 'file')} with changes not yet in S3 skipped (their bytes"
               f" are here)" if local else "")
    click.echo(f"{PROG}: {mp / (rel or '')} is cached: {count(files, 'file')}, "
               f"{human_bytes(result.get('bytes'))} ({human_bytes(result.get('fetched_bytes'))}"
               f" fetched from S3) in {result.get('seconds', 0):.1f} s{skipped}", err=True)


# ---------------------------------------------------------------------------- unmount


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
    from lakefs_mount import mountpoint as mpt

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


@cli.command()
@click.argument("mountpoint", type=click.Path(path_type=Path))
@click.option("--no-flush", is_flag=True, help="Do not wait for dirty data to reach S3.")
@click.option("--timeout", type=click.FloatRange(min=0), metavar="SECONDS",
              help="Give up on the flush after this long (the mount stays).")
def unmount(mountpoint: Path, no_flush: bool, timeout: float | None) -> None:
    """Flush everything to S3, unmount, and wait until the daemon has exited."""
    from lakefs_mount import mountpoint as mpt

    mp = _abs(mountpoint)
    printer = ProgressPrinter("flushing before unmount")
    try:
        result = control.call(mp, {"op": "unmount", "flush": not no_flush}, timeout=timeout,
                              on_progress=printer)
    except DaemonNotRunning as exc:
        printer.done()
        _unmount_without_daemon(mp, exc)
        return
    except ControlTimeout as exc:
        printer.done()
        left = left_bytes(exc.last_progress or printer.last)
        still = f"; {human_bytes(left)} still dirty" if left is not None else ""
        raise CliError(f"flush before unmount timed out after {timeout:g} s{still}; "
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


# ---------------------------------------------------------------------------- orphans


@cli.group()
def orphans() -> None:
    """Cache files a mount kept aside (<cache dir>/orphans/) because its journal did not
    name them: after a crash with a lost or damaged journal they may hold the only copy of
    written bytes. List them, or upload them to S3 into a directory of the mount."""


def _orphans_call(mp: Path, request: dict, timeout: float | None,
                  on_progress: Callable[[dict], None] | None = None) -> dict:
    try:
        return control.call(mp, {"op": "orphans", **request}, timeout=timeout,
                            on_progress=on_progress)
    except ControlTimeout:
        raise CliError(f"the daemon of {mp} did not answer within {timeout:g} s; what was "
                       "not uploaded stays in the orphans directory, run it again") from None


@orphans.command("list", epilog="Exit status: 0 listed (also when there are none); 1 no "
                 "daemon serves MOUNTPOINT.")
@click.argument("mountpoint", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print them as JSON, for scripts.")
@click.option("--timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              metavar="SECONDS")
def orphans_list(mountpoint: Path, as_json: bool, timeout: float) -> None:
    """List the orphaned cache files of the mount at MOUNTPOINT: name (the file id it had),
    size, bytes on disk (evicted ranges are holes and read as zeros), last change."""
    result = _orphans_call(_abs(mountpoint), {"upload": False}, timeout)
    if as_json:
        click.echo(json.dumps(result, indent=2, sort_keys=True))
        return
    found = result.get("orphans", [])
    if not found:
        click.echo(f"no orphaned cache files (in {result.get('dir')})")
        return
    rows = [("NAME", "SIZE", "ON DISK", "MODIFIED (UTC)")] + [
        (o["name"], str(o["size"]), str(o["allocated"]),
         time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(o["mtime"]))) for o in found]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        click.echo("  ".join(f"{c:<{w}}" for c, w in zip(row, widths, strict=True)).rstrip())
    click.echo(f"{count(len(found), 'file')}, {human_bytes(sum(o['size'] for o in found))}, "
               f"in {result.get('dir')}")


ORPHANS_UPLOAD_EPILOG = """\b
Exit status: 0 every orphan is in S3 (and removed unless --keep); 1 one or more could
not be uploaded (they stay; the message says why), or no daemon serves MOUNTPOINT;
2 bad arguments (--to outside the mount).
"""


@orphans.command("upload", epilog=ORPHANS_UPLOAD_EPILOG)
@click.argument("mountpoint", type=click.Path(path_type=Path))
@click.option("--to", "to", default="lost+found", show_default=True, metavar="DIR",
              help="Directory of the mount (absolute inside it, or relative to its root) "
              "the orphans go to, as <host>-<name>.")
@click.option("--keep", is_flag=True, help="Keep each orphan after its upload.")
@click.option("--json", "as_json", is_flag=True,
              help="Progress and result as JSON lines on stdout, for scripts.")
@click.option("--timeout", type=click.FloatRange(min=0), metavar="SECONDS",
              help="Give up (exit 1) after this long; default: wait until done.")
def orphans_upload(mountpoint: Path, to: str, keep: bool, as_json: bool,
                   timeout: float | None) -> None:
    """Upload the orphaned cache files of the mount at MOUNTPOINT into the directory
    --to of the mount, never over an existing object, and remove each one once S3 shows
    it with its size and ETag (unless --keep)."""
    mp = _abs(mountpoint)
    rel = _relative_in_mount(mp, to, param_hint="'--to'") or ""
    if ".lakefs-mount" in rel.split("/"):
        raise click.BadParameter(".lakefs-mount is reserved for the mount's own "
                                 "records; choose another directory", param_hint="'--to'")
    printer = ProgressPrinter("uploading orphans", as_json)
    try:
        result = _orphans_call(mp, {"upload": True, "to": rel, "keep": keep}, timeout,
                               on_progress=printer)
    finally:
        printer.done()
    if as_json:
        click.echo(json.dumps({"result": result}))
    else:
        for done in result.get("uploaded", []):
            click.echo(f"{done['name']} -> {mp / done['path']} ({human_bytes(done['size'])}"
                       f"{'' if keep else '; removed from the cache'})")
    failed = result.get("failed", [])
    if failed:
        raise CliError(f"{count(len(failed), 'orphan')} not uploaded (orphan "
                       f"{failed[0]['name']}: {failed[0]['error']}); they stay in "
                       f"{result.get('dir')}: fix the cause and run it again")
    if not result.get("orphans") and not as_json:
        click.echo(f"no orphaned cache files to upload (in {result.get('dir')})")


# ---------------------------------------------------------------------------- status


_SECRET_WORDS = ("secret", "password", "token", "credential", "access_key")

STATUS_ROWS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("mountpoint", "mount point", str),
    ("source", "source", str),
    ("bucket", "bucket", str),
    ("prefix", "prefix", lambda v: v or "(whole bucket)"),
    ("endpoint", "endpoint", str),
    ("pid", "daemon pid", str),
    ("io_engine", "io engine", str),
    ("fuse_session", "FUSE session", str),
    ("passthrough", "passthrough", str),
    ("splice_writes", "spliced writes", lambda v: "yes" if v else "no (see the log)"),
    ("dirty_bytes", "dirty (not in S3)", human_bytes),
    ("oldest_dirty_s", "oldest dirty data", lambda v: f"{v:g} s old"),
    ("max_dirty", "max dirty", human_bytes),
    ("files_pending", "files pending", str),
    ("uploads_in_flight", "uploads in flight", str),
    ("bytes_uploaded", "bytes uploaded", human_bytes),
    ("upload_rate", "upload rate", str),  # these three: status --watch
    ("download_rate", "download rate", str),
    ("time_to_clean", "time to clean", str),
    ("retries", "retries", str),
    ("errors", "errors", str),
    ("last_error", "last error", str),
    ("s3_in_flight", "S3 requests under way", str),
    ("s3_waiting", "S3 requests waiting",
     lambda n: f"{n} (under way for over {WAITING_AFTER:g} s)" if n else "0"),
    ("s3_oldest_request", "oldest S3 request", lambda r: " ".join(
        filter(None, (r["operation"], r["key"], f"for {r['age_s']:g} s")))),
    ("s3_oldest_request_s", "", str),  # (its age again, as one number for /metrics)
    ("last_s3_error_at", "last S3 error at",
     lambda ts: time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))),
    ("s3_requests", "S3 requests", lambda ops: ", ".join(
        f"{op} {s['count']}" + (f" ({s['failures']} failed)" if s["failures"] else "")
        for op, s in ops.items()) or "none"),
    ("cache_used", "cache used", human_bytes),
    ("orphans", "orphaned cache files",
     lambda v: f"{human_bytes(v)} (see: lakefs-mount orphans list)"),
    ("cache_size", "cache size", human_bytes),
    ("cache_dir", "cache dir", str),
]


def format_status(status: dict) -> str:
    """A two-column table of the status dict; unknown keys follow, secrets never."""
    rows = []
    known = set()
    for key, label, fmt in STATUS_ROWS:
        known.add(key)
        if label and key in status and status[key] is not None:
            rows.append((label, fmt(status[key])))
    for key in sorted(status):
        if key in known or any(w in key.lower() for w in _SECRET_WORDS):
            continue
        value = status[key]
        text = json.dumps(value) if isinstance(value, dict | list) else str(value)
        rows.append((key.replace("_", " "), text))
    width = max((len(label) for label, _ in rows), default=0)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


@cli.command()
@click.argument("mountpoint", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the raw status as JSON.")
@click.option("--timeout", type=click.FloatRange(min=0), default=10.0, show_default=True,
              metavar="SECONDS")
@click.option("--watch", is_flag=True, help="Show it again every --interval, with upload "
              "and download rates and the time to clean, until interrupted.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              metavar="SECONDS", help="Seconds between samples of --watch.")
def status(mountpoint: Path, as_json: bool, timeout: float, watch: bool,
           interval: float) -> None:
    """Show dirty data, uploads, errors and cache use of a mount."""
    def fetch() -> dict:
        result = control.call(_abs(mountpoint), {"op": "status"}, timeout=timeout)
        return {k: v for k, v in result.items()
                if not any(w in k.lower() for w in _SECRET_WORDS)}

    if watch:
        from lakefs_mount.cli.watch import watch_status

        try:
            watch_status(fetch, interval, as_json, format_status)
        except KeyboardInterrupt:
            return
    result = fetch()
    if as_json:
        click.echo(json.dumps(result, indent=2, sort_keys=True, default=str))
    else:
        click.echo(format_status(result))


if __name__ == "__main__":
    cli()

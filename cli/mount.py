"""`lakefs-mount mount`: the command line turned into a checked MountConfig, then the daemon
started (in the background, or in the foreground with -f)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import click

from lakefs_mount.cli.daemonize import daemonize, run_foreground
from lakefs_mount.cli.errors import PROG, CliError, MountStatus
from lakefs_mount.cli.params import ENDPOINT, ID, MODE, SIZE, abs_path, is_relative_to
from lakefs_mount.config import (
    HooksForTests,
    MiB,
    MountConfig,
    default_cache_dir,
    default_log_file,
    human_bytes,
    parse_metrics_addr,
    parse_source,
)
from lakefs_mount.logsetup import LOG_FORMATS
from lakefs_mount.ops.mountpoint import (
    MountpointError,
    check_cache_dir,
    check_mountpoint,
    check_user_mount,
)

MOUNT_EPILOG = """\b
Exit status: 0 mounted; 2 bad arguments, or a mount point / cache directory that cannot
be used (missing, not a directory, not empty, already mounted, not writable); 1 the mount
itself failed (S3 unreachable, wrong credentials, daemon died); 130 interrupted.
The mount(8) helper (mount -t fuse.lakefs-mount) exits as mount(8) does instead.
"""


def _warn_past_the_disk(cache_size: int, cache_dir: Path) -> None:
    """A --cache-size larger than the cache's disk is a limit never reached: the disk fills
    first (then writers wait for uploads, and get ENOSPC after a minute of it). Said once,
    at mount; the mount goes on."""
    where = cache_dir
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        disk = shutil.disk_usage(where)
    except OSError:
        return
    if cache_size > disk.total:
        click.echo(f"{PROG}: warning: --cache-size {human_bytes(cache_size)} is more than "
                   f"the cache disk holds ({human_bytes(disk.total)} at {where}, "
                   f"{human_bytes(disk.free)} free): the disk fills first", err=True)


def _default_note(ctx: click.Context, name: str) -> str:
    """", the default" where the user did not give option `name`."""
    given = ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE
    return "" if given else ", the default"


@click.command(epilog=MOUNT_EPILOG)
@click.argument("args", nargs=-1, required=True, metavar="[SOURCE] MOUNTPOINT")
@click.option("--cache-dir", type=click.Path(path_type=Path),
              help="Local cache directory (default: under the state directory).")
@click.option("--cache-size", type=SIZE, default="64G", show_default=True,
              help="Local cache size; clean chunks are evicted beyond it.")
@click.option("--max-dirty", type=SIZE, default="16G", show_default=True,
              help="Dirty bytes not yet in S3 before writers wait.")
@click.option("--endpoint-url", envvar="AWS_ENDPOINT_URL", metavar="URL", type=ENDPOINT,
              help="S3 endpoint (env AWS_ENDPOINT_URL).")
@click.option("--region", help="S3 region.")
@click.option("--profile", help="AWS profile for credentials.")
@click.option("--part-size", type=SIZE, default="16M", show_default=True,
              help="Multipart part size, 8M..512M, a multiple of 1 MiB.")
@click.option("--upload-concurrency", type=click.IntRange(1, 64), default=8,
              show_default=True, help="Parallel part uploads.")
@click.option("--foreground", "-f", is_flag=True, help="Stay in the foreground, log to stderr.")
@click.option("--allow-other", is_flag=True, help="Let other users access the mount.")
@click.option("--allow-root", is_flag=True,
              help="Let root access the mount too (not with --allow-other).")
@click.option("--uid", type=ID, metavar="UID", help="Owner shown for objects that carry no "
              "owner of their own (written by other tools; default: the mounting user).")
@click.option("--gid", type=ID, metavar="GID", help="Group shown for objects that carry no "
              "group of their own (default: the mounting user's).")
@click.option("--file-mode", type=MODE, default="0644", show_default=True,
              help="Mode (octal) shown for files that carry none of their own.")
@click.option("--dir-mode", type=MODE, default="0755", show_default=True,
              help="Mode (octal) shown for directories that carry none of their own.")
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
@click.option("--hold-temporaries", type=click.FloatRange(min=0), default=5.0,
              show_default=True, metavar="SECONDS", help="How long a file created as mkstemp "
              "creates one (O_EXCL, mode 0600) keeps its parts back until it is renamed or "
              "closed, so that none goes twice (0: never).")
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
@click.option("--test-hook", "test_hooks", multiple=True, hidden=True, metavar="NAME=VALUE",
              help="For the project's own tests only (config.HooksForTests).")
@click.pass_context
def mount(ctx: click.Context, args: tuple[str, ...], **opts: Any) -> None:
    """Mount SOURCE (s3://bucket[/prefix]) at MOUNTPOINT.

    Without SOURCE a private embedded S3 server (SeaweedFS) is started. Returns once the
    mount is ready; the daemon keeps running in the background unless -f is given.
    """
    config = _build_config(ctx, args, opts)
    try:
        check_mountpoint(config.mountpoint)
    except MountpointError as exc:
        raise CliError(str(exc), 2) from None
    try:  # what root must allow first: mount(8) counts it as a matter of permissions
        check_user_mount(config.allow_other or config.allow_root,
                         option="--allow-root" if config.allow_root else "--allow-other")
    except MountpointError as exc:
        raise CliError(str(exc), 2, MountStatus.USAGE) from None
    try:
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
    mountpoint = abs_path(args[-1])
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
    if opts["allow_other"] and opts["allow_root"]:
        raise click.UsageError("--allow-other and --allow-root exclude each other "
                               "(--allow-other lets root in too)", ctx)
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
        raise click.BadParameter(
            f"{human_bytes(opts['cache_size'])} is less than --max-dirty "
            f"({human_bytes(opts['max_dirty'])}{_default_note(ctx, 'max_dirty')}): dirty data "
            f"is never evicted; raise --cache-size or lower --max-dirty", ctx,
            param_hint="'--cache-size'")
    cache_dir = abs_path(opts["cache_dir"]) if opts["cache_dir"] else None
    if cache_dir is not None and is_relative_to(cache_dir, mountpoint):
        raise click.BadParameter("must not be inside the mount point", ctx,
                                 param_hint="'--cache-dir'")
    if opts["metrics_addr"] is not None:
        try:
            parse_metrics_addr(opts["metrics_addr"])
        except ValueError as exc:
            raise click.BadParameter(str(exc), ctx, param_hint="'--metrics-addr'") from None
    try:
        hooks = HooksForTests.parse(opts["test_hooks"])
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param_hint="'--test-hook'") from None
    if ctx.get_parameter_source("cache_size") == click.core.ParameterSource.COMMANDLINE:
        _warn_past_the_disk(opts["cache_size"], cache_dir or default_cache_dir(mountpoint))
    log_file = abs_path(opts["log_file"]) if opts["log_file"] else default_log_file(mountpoint)
    if is_relative_to(log_file, mountpoint):
        raise click.BadParameter("must not be inside the mount point", ctx,
                                 param_hint="'--log-file'")
    return MountConfig(
        mountpoint=mountpoint, bucket=bucket, prefix=prefix,
        endpoint_url=opts["endpoint_url"] if source is not None else None,
        region=opts["region"], profile=opts["profile"], cache_dir=cache_dir,
        cache_size=opts["cache_size"], max_dirty=opts["max_dirty"], part_size=part_size,
        upload_concurrency=opts["upload_concurrency"], allow_other=opts["allow_other"],
        allow_root=opts["allow_root"], uid=opts["uid"], gid=opts["gid"],
        file_mode=opts["file_mode"], dir_mode=opts["dir_mode"],
        read_only=opts["read_only"], fsync_mode=opts["fsync_mode"],
        io_engine=opts["io_engine"], fuse_session=opts["fuse_session"],
        metadata_ttl=opts["metadata_ttl"],
        commit_delay=opts["commit_delay"], hold_temporaries=opts["hold_temporaries"],
        read_ahead=opts["read_ahead"], log_level=opts["log_level"].upper(),
        log_file=log_file, log_format=opts["log_format"],
        embedded_dir=abs_path(opts["embedded_dir"]) if opts["embedded_dir"] else None,
        metrics_addr=opts["metrics_addr"], commit_on_rename=opts["commit_on_rename"],
        test_hooks=hooks,
    )


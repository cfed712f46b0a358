"""`lakefs-mount flush` and `warmup`: a daemon operation on a PATH of the mount (bytes up to
S3, or down into the cache) that reports its progress while it runs."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import click

from lakefs_mount.cli.errors import PROG, CliError
from lakefs_mount.cli.params import MOUNT_POINT, abs_path, relative_in_mount
from lakefs_mount.cli.progress import ProgressPrinter, count, left_bytes
from lakefs_mount.config import human_bytes
from lakefs_mount.ops import controlclient
from lakefs_mount.ops.controlclient import NO_ANSWER, ControlError, ControlTimeout


def _path_op(op: str, mp: Path, rel: str | None, timeout: float | None, left_is: str,
             printer: ProgressPrinter) -> dict:
    """A daemon operation on PATH that reports progress (flush, warmup) to `printer`: its
    result (also as a JSON line on stdout with --json), or a CliError that says why it
    failed, or what was left when it timed out."""
    name = {"warmup": "warm-up"}.get(op, op)
    as_json = printer.as_json
    try:
        result = controlclient.call(mp, {"op": op, "path": rel}, timeout=timeout,
                              on_progress=printer)
        printer.done(finished=True)
        if as_json:
            click.echo(json.dumps({"result": result}, default=str))
        return result
    except ControlTimeout as exc:
        left = left_bytes(exc.last_progress or printer.last)
        still = f"; {left} bytes ({human_bytes(left)}) {left_is}" if left is not None else ""
        why = "" if exc.answered else f": the daemon serving {mp} {NO_ANSWER}"
        raise CliError(f"{name} timed out after {timeout:g} s{why}{still}") from None
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
        fn = click.argument("mountpoint", type=MOUNT_POINT)(fn)
        return click.command()(fn)
    return make


@_path_command("Give up (exit 1) after this long; default: wait until done.")
def flush(mountpoint: Path, path: str | None, timeout: float | None, as_json: bool) -> None:
    """Block until everything written under PATH (default: the whole mount) is in S3.

    PATH is absolute inside the mount or relative to its root. Exit status 0 only when the
    data is committed in S3.
    """
    mp = abs_path(mountpoint)
    rel = relative_in_mount(mp, path)
    started = time.monotonic()
    printer = ProgressPrinter("flushing", as_json)
    result = _path_op("flush", mp, rel, timeout, "still dirty", printer)
    if not as_json:  # on a terminal or not: a log or a pipe gets the outcome too
        click.echo(f"{PROG}: {mp / (rel or '')} is in S3: "
                   f"{flush_summary(result, printer.total, time.monotonic() - started)}",
                   err=True)


def flush_summary(result: dict, covered_bytes: int, elapsed: float) -> str:
    """`2 files, 24 MiB flushed in 3.1 s`: the daemon's count and time; the bytes the
    progress reports covered (none when it ended before its first report)."""
    files = result.get("files")
    what = [count(files, "file")] if isinstance(files, int) else []
    if covered_bytes:
        what.append(human_bytes(covered_bytes))
    seconds = result.get("seconds")
    took = seconds if isinstance(seconds, int | float) else elapsed
    return f"{', '.join(what) or 'everything'} flushed in {took:.1f} s"


@_path_command("Give up (exit 1) after this long; what came stays cached.")
def warmup(mountpoint: Path, path: str | None, timeout: float | None, as_json: bool) -> None:
    """Fetch every file under PATH (default: the whole mount) from S3 into the cache.

    A restore that follows reads from the cache disk instead of S3: run it while the job
    still starts. Chunks are fetched with parallel ranged GETs straight into the cache
    files, within --cache-size (a PATH larger than the cache is refused). Files with
    changes not yet in S3 are skipped: their bytes are here already. Interrupting stops
    the warm-up; what was fetched stays cached.
    """
    mp = abs_path(mountpoint)
    rel = relative_in_mount(mp, path)
    result = _path_op("warmup", mp, rel, timeout, "not yet cached",
                      ProgressPrinter("warming", as_json))
    if as_json:
        return
    files, local = result.get("files", 0), result.get("local_files", 0)
    skipped = (f"; {count(local, 'file')} with changes not yet in S3 skipped (their bytes"
               f" are here)" if local else "")
    click.echo(f"{PROG}: {mp / (rel or '')} is cached: {count(files, 'file')}, "
               f"{human_bytes(result.get('bytes'))} ({human_bytes(result.get('fetched_bytes'))}"
               f" fetched from S3) in {result.get('seconds', 0):.1f} s{skipped}", err=True)


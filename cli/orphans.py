"""`lakefs-mount orphans list|upload`: the cache files a mount kept aside, listed or uploaded
to S3."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import click

from lakefs_mount.cli.errors import CliError
from lakefs_mount.cli.params import MOUNT_POINT, abs_path, relative_in_mount
from lakefs_mount.cli.progress import ProgressPrinter, count
from lakefs_mount.config import human_bytes
from lakefs_mount.ops import controlclient
from lakefs_mount.ops.controlclient import ControlTimeout


@click.group()
def orphans() -> None:
    """Cache files a mount kept aside (<cache dir>/orphans/) because its journal did not
    name them: after a crash with a lost or damaged journal they may hold the only copy of
    written bytes. List them, or upload them to S3 into a directory of the mount."""


def _orphans_call(mp: Path, request: dict, timeout: float | None,
                  on_progress: Callable[[dict], None] | None = None) -> dict:
    try:
        return controlclient.call(mp, {"op": "orphans", **request}, timeout=timeout,
                            on_progress=on_progress)
    except ControlTimeout:
        raise CliError(f"the daemon of {mp} did not answer within {timeout:g} s; what was "
                       "not uploaded stays in the orphans directory, run it again") from None


@orphans.command("list", epilog="Exit status: 0 listed (also when there are none); 1 no "
                 "daemon serves MOUNTPOINT.")
@click.argument("mountpoint", type=MOUNT_POINT)
@click.option("--json", "as_json", is_flag=True, help="Print them as JSON, for scripts.")
@click.option("--timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              metavar="SECONDS")
def orphans_list(mountpoint: Path, as_json: bool, timeout: float) -> None:
    """List the orphaned cache files of the mount at MOUNTPOINT: name (the file id it had),
    size, bytes on disk (evicted ranges are holes and read as zeros), last change."""
    result = _orphans_call(abs_path(mountpoint), {"upload": False}, timeout)
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
@click.argument("mountpoint", type=MOUNT_POINT)
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
    mp = abs_path(mountpoint)
    rel = relative_in_mount(mp, to, param_hint="'--to'") or ""
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


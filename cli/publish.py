"""`lakefs-mount commit` and `lakefs-mount verify`: publish a checkpoint directory with
its manifest, and check a checkpoint in S3 against it (lakefs_mount/publish/manifest.py).

`commit` and `verify MOUNTPOINT PATH` run in the daemon (control socket): it has the
credentials, the cache and the retries. `verify s3://...` needs no mount: it talks to
S3 from this process, with the same options as `mount`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from lakefs_mount.cli.directs3 import direct_store, s3_options
from lakefs_mount.cli.errors import PROG, CliError
from lakefs_mount.cli.params import MOUNT_POINT, abs_path, relative_in_mount
from lakefs_mount.cli.progress import ProgressPrinter, count
from lakefs_mount.config import human_bytes
from lakefs_mount.ops import controlclient
from lakefs_mount.ops.controlclient import NO_ANSWER, ControlError, ControlTimeout

NO_MANIFEST_EXIT = 3
CONTROL_MARGIN = 60.0  # seconds the CLI waits beyond --timeout for the daemon's answer
ANSWER_GRACE = 2.0  # seconds beyond --timeout within which the daemon says something

COMMIT_EPILOG = """\b
Exit status: 0 the manifest is in S3; 1 the commit failed or timed out (no manifest
written; the message says what was missing or failing); 2 bad arguments.
"""

VERIFY_EPILOG = """\b
Exit status: 0 every object matches the manifest; 1 one or more problems (one line
each), or S3 failed; 2 bad arguments; 3 no manifest (never committed, or not yet).
"""


def _in_mount(mountpoint: Path, path: str) -> tuple[Path, str]:
    """The mount point (absolute) and PATH relative to its root ("" for the root)."""
    mp = abs_path(mountpoint)
    return mp, relative_in_mount(mp, path) or ""


@click.command(epilog=COMMIT_EPILOG)
@click.argument("mountpoint", type=MOUNT_POINT)
@click.argument("path")
@click.option("--expect-files", type=click.IntRange(min=0), metavar="N",
              help="Wait until PATH holds at least N files in S3 (other nodes' too).")
@click.option("--expect", multiple=True, metavar="FILE",
              help="Wait until FILE (relative to PATH) is in S3; may be repeated.")
@click.option("--timeout", type=click.FloatRange(min=0), metavar="SECONDS",
              help="Give up (exit 1, no manifest) after this long; default: wait.")
@click.option("--json", "as_json", is_flag=True,
              help="Progress and result as JSON lines on stdout, for scripts.")
def commit(mountpoint: Path, path: str, expect_files: int | None, expect: tuple[str, ...],
           timeout: float | None, as_json: bool) -> None:
    """Publish the checkpoint directory PATH: flush it, then write PATH/.lakefs-commit.json
    (every object under PATH in S3 with size, ETag, CRC32C, mtime) as the last object.

    The manifest lists S3's listing of PATH, so files other mounts (other nodes) wrote
    there count too: --expect-files and --expect wait for them.
    """
    mp, rel = _in_mount(mountpoint, path)
    printer = ProgressPrinter("committing", as_json)
    request = {"op": "commit", "path": rel, "expect_files": expect_files,
               "expect": list(expect), "timeout": timeout}
    try:
        # the daemon answers by --timeout (its result or the timeout); its manifest's
        # PUT may take the margin beyond
        result = controlclient.call(
            mp, request, on_progress=printer,
            timeout=None if timeout is None else timeout + CONTROL_MARGIN,
            answer_within=None if timeout is None else timeout + ANSWER_GRACE)
        printer.done(finished=True)
    except ControlTimeout as exc:
        why = NO_ANSWER if not exc.answered else "did not finish in time"
        raise CliError(f"commit of {mp / rel} timed out: the daemon {why}; no manifest was "
                       f"written") from None
    except ControlError as exc:
        raise CliError(f"commit of {mp / rel} failed: {exc}") from None
    finally:
        printer.done()
    if as_json:
        click.echo(json.dumps({"result": result}, default=str))
        return
    click.echo(f"{PROG}: committed {mp / rel}: {count(result['files'], 'file')}, "
               f"{human_bytes(result['bytes'])}; manifest {result['manifest']}", err=True)


@click.command(epilog=VERIFY_EPILOG)
@click.argument("target", metavar="MOUNTPOINT|s3://BUCKET/PREFIX")
@click.argument("path", required=False)
@s3_options(", for s3://...")
@click.option("--parallel", type=click.IntRange(1, 64), default=8, show_default=True,
              help="Ranged GETs under way at once, for s3://....")
@click.option("--json", "as_json", is_flag=True, help="The report as JSON on stdout.")
@click.pass_context
def verify(ctx: click.Context, target: str, path: str | None, endpoint_url: str | None,
           region: str | None, profile: str | None, parallel: int, as_json: bool) -> None:
    """Check a committed checkpoint against its manifest: every object present with its
    size, ETag and CRC32C (S3's own stored CRC32C where it keeps the whole object's,
    otherwise read back from S3), and no extra object.

    Either MOUNTPOINT PATH (through the mount's daemon) or s3://BUCKET/PREFIX (no mount
    needed; credentials as for `mount`).
    """
    if target.startswith("s3://"):
        if path is not None:
            raise click.UsageError("with s3://BUCKET/PREFIX give no PATH: it is the PREFIX",
                                   ctx)
        report = _verify_s3(ctx, target, endpoint_url, region, profile, parallel)
    else:
        if path is None:
            raise click.UsageError("missing PATH: verify MOUNTPOINT PATH", ctx)
        for name in ("endpoint_url", "profile", "region", "parallel"):
            if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
                raise click.UsageError(f"--{name.replace('_', '-')} applies to "
                                       f"s3://BUCKET/PREFIX only", ctx)
        mp, rel = _in_mount(Path(target), path)
        try:
            report = controlclient.call(mp, {"op": "verify", "path": rel}, timeout=None)
        except ControlError as exc:
            raise CliError(f"verify of {mp / rel} failed: {exc}") from None
    _report(report, as_json)


def _verify_s3(ctx: click.Context, source: str, endpoint_url: str | None,
               region: str | None, profile: str | None, parallel: int) -> dict[str, Any]:
    import trio

    from lakefs_mount.publish.verify import verify_checkpoint

    aio, prefix = direct_store(ctx, source, endpoint_url, region, profile, parallel)
    return trio.run(verify_checkpoint, aio, prefix, parallel).to_json()


def _report(report: dict[str, Any], as_json: bool) -> None:
    where = f"s3://{report['bucket']}/{report['prefix']}"
    if as_json:
        click.echo(json.dumps(report, indent=1, sort_keys=True, default=str))
    if report["manifest"] == "missing":
        raise CliError(f"no manifest {where}.lakefs-commit.json: {where} was never "
                       f"committed (or not yet); see: {PROG} commit --help", NO_MANIFEST_EXIT)
    problems = report["problems"]
    if not as_json:
        for p in problems:
            click.echo(f"{p['kind']}: {p['key']}: {p['detail']}")
    if problems:
        raise CliError(f"{where} does not match its manifest: "
                       f"{count(len(problems), 'problem')}")
    if not as_json:
        by = report.get("committed_by") or {}
        at = report.get("committed_at")
        when = time.strftime(" at %Y-%m-%d %H:%M:%S UTC", time.gmtime(at)) if at else ""
        click.echo(f"OK {where}: {count(report['files'], 'file')}, "
                   f"{human_bytes(report['bytes'])} match the manifest (committed{when} by "
                   f"{by.get('user', '?')}@{by.get('host', '?')}; "
                   f"{report.get('checked_by_s3', 0)} checked by S3's stored CRC32C, "
                   f"{human_bytes(report.get('bytes_read', 0))} read back)")


COMMANDS = [commit, verify]

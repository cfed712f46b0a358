"""`lakefs-mount sweep-tables s3://BUCKET/PREFIX`: delete the tables of part CRCs that no
object under the prefix names (lakefs_mount/ops/tablesweep.py). It needs no mount: it
talks to S3 from this process, with the same options as `mount` (as `verify s3://` does).
"""

from __future__ import annotations

import json

import click

from lakefs_mount.cli.directs3 import direct_store, s3_options
from lakefs_mount.cli.errors import PROG
from lakefs_mount.cli.progress import count
from lakefs_mount.ops.tablesweep import DEFAULT_GRACE

SWEEP_EPILOG = """\b
Exit status: 0 swept (also when there was nothing to delete); 1 S3 failed (then nothing
was deleted if a listing or HEAD of objects failed); 2 bad arguments.
"""


@click.command("sweep-tables", epilog=SWEEP_EPILOG)
@click.argument("source", metavar="s3://BUCKET/PREFIX")
@click.option("--grace", type=click.FloatRange(min=0), default=DEFAULT_GRACE,
              show_default=True, metavar="SECONDS",
              help="Keep tables younger than this (a table is written before the object "
                   "that names it is complete).")
@click.option("--dry-run", is_flag=True, help="Report what would be deleted; delete nothing.")
@s3_options()
@click.option("--parallel", type=click.IntRange(1, 64), default=16, show_default=True,
              help="HEADs of objects under way at once.")
@click.option("--json", "as_json", is_flag=True, help="The report as JSON on stdout.")
@click.pass_context
def sweep_tables(ctx: click.Context, source: str, grace: float, dry_run: bool,
                 endpoint_url: str | None, region: str | None, profile: str | None,
                 parallel: int, as_json: bool) -> None:
    """Delete the tables of part CRCs under s3://BUCKET/PREFIX/.lakefs-mount/parts/ that no
    object under PREFIX names and that are older than --grace: tables that older versions,
    or a daemon killed between a commit and its journal, left behind. Mounts delete
    the table of an object they replace or remove themselves. Every object larger than
    8 MiB under PREFIX is HEADed for the table it names; use the PREFIX the mounts were
    given (s3://BUCKET/PREFIX)."""
    import trio

    from lakefs_mount.ops.tablesweep import sweep_tables as sweep

    aio, prefix = direct_store(ctx, source, endpoint_url, region, profile, parallel)
    report = trio.run(sweep, aio, prefix, grace, parallel, dry_run)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=1, sort_keys=True))
        return
    verb = "would delete" if dry_run else "deleted"
    click.echo(f"{PROG}: {source}: {count(report.tables, 'table')} of part "
               f"CRCs, {report.named} named by an object ({report.objects_headed} HEADed), "
               f"{report.young} younger than {grace:g} s kept; {verb} "
               f"{len(report.deleted)}")

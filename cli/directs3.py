"""Commands that talk to S3 from their own process, without a mount (`verify s3://...`,
`sweep-tables`): the options that say where and as whom, as `mount` takes them, and the
store they make."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import click

from lakefs_mount.cli.params import ENDPOINT
from lakefs_mount.config import parse_source

if TYPE_CHECKING:
    from lakefs_mount.s3.aiostore import AsyncStore

F = TypeVar("F", bound=Callable[..., object])


def s3_options(suffix: str = "") -> Callable[[F], F]:
    """--endpoint-url, --region and --profile; `suffix` ends each help text."""
    def add(fn: F) -> F:
        for option in reversed((
                click.option("--endpoint-url", envvar="AWS_ENDPOINT_URL", metavar="URL",
                             type=ENDPOINT,
                             help=f"S3 endpoint{suffix} (env AWS_ENDPOINT_URL)."),
                click.option("--region", help=f"S3 region{suffix}."),
                click.option("--profile", help=f"AWS profile for credentials{suffix}."))):
            fn = option(fn)
        return fn
    return add


def direct_store(ctx: click.Context, source: str, endpoint_url: str | None,
                 region: str | None, profile: str | None, parallel: int
                 ) -> tuple[AsyncStore, str]:
    """The store of s3://BUCKET/PREFIX for `parallel` requests at once, and the prefix
    (boto3 imported only here: the other commands start without it)."""
    from lakefs_mount.metrics import Metrics
    from lakefs_mount.s3.aiostore import AsyncStore
    from lakefs_mount.s3.store import S3ObjectStore

    try:
        bucket, prefix = parse_source(source)
    except ValueError as exc:
        raise click.UsageError(str(exc), ctx) from None
    store = S3ObjectStore(bucket, endpoint_url=endpoint_url, region=region, profile=profile,
                          max_pool=parallel + 4, max_attempts=1)  # AsyncStore retries
    return AsyncStore(store, Metrics(), max_threads=parallel + 2), prefix

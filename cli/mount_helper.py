"""`mount.fuse.lakefs-mount`: the helper mount(8) runs for `-t fuse.lakefs-mount` and fstab
lines; it runs `lakefs-mount mount` with the options its `-o` items name (mount_options)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click

from lakefs_mount.cli.errors import PROG
from lakefs_mount.cli.main import cli
from lakefs_mount.cli.mount_options import HELPER, HelperError, mount_arguments


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of `mount.fuse.lakefs-mount`; exits with `lakefs-mount mount`'s status."""
    try:
        args, ns = mount_arguments(sys.argv[1:] if argv is None else argv)
    except HelperError as exc:
        click.echo(f"{HELPER}: {exc}", err=True)
        sys.exit(1)
    if ns.verbose or ns.fake:
        click.echo(f"{HELPER}: {PROG} {' '.join(args)}", err=True)
    if ns.fake:
        sys.exit(0)
    cli.main(args=args, prog_name=PROG)


if __name__ == "__main__":
    main()

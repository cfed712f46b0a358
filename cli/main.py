"""`lakefs-mount` command line: the click group, its error format, and the commands it holds
(each in a module of its own: mount, flush_warmup, unmount, orphans, status, publish,
sweep).

Every expected failure ends as one line `lakefs-mount: <message>` on stderr and a non-zero
exit status (2: bad arguments or unusable mount point / cache directory; 1: the operation
itself failed), never as a Python traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import click

from lakefs_mount.cli.errors import (
    EXIT_STATUS_ENV,
    MOUNT8,
    PROG,
    CliError,
    MountStatus,
    mount8_status,
)
from lakefs_mount.cli.flush_warmup import flush, warmup
from lakefs_mount.cli.mount import mount
from lakefs_mount.cli.orphans import orphans
from lakefs_mount.cli.publish import COMMANDS as PUBLISH_COMMANDS
from lakefs_mount.cli.status import status
from lakefs_mount.cli.sweep import sweep_tables
from lakefs_mount.cli.unmount import unmount
from lakefs_mount.ops.controlclient import ControlError
from lakefs_mount.ops.mountpoint import MountpointError
from lakefs_mount.s3.objectstore import ObjectStoreError


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
        # the mount(8) helper's `mount`: mount(8)'s statuses (not handed on to the daemon)
        mount8 = os.environ.pop(EXIT_STATUS_ENV, None) == MOUNT8
        try:
            rv = super().main(args, prog_name or PROG, complete_var, False, **extra)
        except click.UsageError as exc:
            hint = f" (see: {exc.ctx.command_path} --help)" if exc.ctx else ""
            _fail(exc.format_message() + hint,
                  MountStatus.USAGE if mount8 else exc.exit_code)
        except CliError as exc:
            _fail(exc.format_message(), exc.mount_status if mount8 else exc.exit_code)
        except click.ClickException as exc:
            _fail(exc.format_message(), mount8_status(exc.exit_code) if mount8
                  else exc.exit_code)
        except (ControlError, MountpointError, ObjectStoreError) as exc:
            _fail(str(exc), MountStatus.FAILURE if mount8 else 1)
        except (click.Abort, KeyboardInterrupt):
            _fail("interrupted", MountStatus.INTERRUPTED if mount8 else 130)
        except SystemExit as exc:  # `mount`'s own status, from the daemon's report
            if not mount8 or not isinstance(exc.code, int):
                raise
            sys.exit(mount8_status(exc.code))
        except (MemoryError, OSError) as exc:
            if not mount8:
                raise
            _fail(f"system error: {exc}", MountStatus.SYSTEM)
        except Exception:
            if not mount8:
                raise
            traceback.print_exc()
            _fail("internal error (a bug: please report the traceback above)",
                  MountStatus.SOFTWARE)
        sys.exit(rv if isinstance(rv, int) else 0)

    def _mount_fuse_form(self, args: Any) -> Any:
        """fuse3's generic helper mount.fuse3, which mount(8) runs for `-t fuse.lakefs-mount`
        where /sbin has no mount.fuse.lakefs-mount, runs `lakefs-mount SOURCE MOUNTPOINT -o
        OPTIONS`: that command line is a helper call, and exits as mount.fuse.lakefs-mount
        does."""
        argv = list(sys.argv[1:] if args is None else args)
        if not argv or argv[0] in self.commands or argv[0].startswith("-") or "-o" not in argv:
            return args
        from lakefs_mount.cli.mount_helper import run

        sys.exit(run(argv))


@click.group(PROG, cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="lakefs-mount", prog_name=PROG)
def cli() -> None:
    """Mount an S3 bucket with a crash-safe local write-back cache (built for checkpoints)."""


# A new command: define it with @click.command() in a module of cli/, import it above and
# add it here.
for _command in (mount, flush, warmup, unmount, orphans, status, sweep_tables,
                 *PUBLISH_COMMANDS):  # commit, verify (cli/publish.py)
    cli.add_command(_command)


if __name__ == "__main__":
    cli()

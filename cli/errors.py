"""The one exception the CLI turns into `lakefs-mount: <message>` and an exit status, and
the exit statuses of mount(8), which the helper follows."""

from __future__ import annotations

import enum

import click

PROG = "lakefs-mount"
# Set by the mount(8) helper for the `lakefs-mount mount` it runs: exit as mount(8) does
EXIT_STATUS_ENV = "LAKEFS_MOUNT_EXIT_STATUS"
MOUNT8 = "mount8"


class MountStatus(enum.IntEnum):
    """mount(8)'s exit status (its man page, "RETURN CODES")."""

    OK = 0
    USAGE = 1  # incorrect invocation or permissions
    SYSTEM = 2  # out of memory, cannot fork, ...
    SOFTWARE = 4  # internal bug
    INTERRUPTED = 8  # user interrupt
    MTAB = 16  # problems writing or locking /etc/mtab (never: there is no mtab to write)
    FAILURE = 32  # mount failure


class CliError(click.ClickException):
    """An expected failure with its exit status (1 runtime, 2 bad input) and, for the
    mount(8) helper, mount(8)'s (by default what `mount8_status` makes of the first)."""

    def __init__(self, message: str, exit_code: int = 1,
                 mount_status: MountStatus | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # click's is per class; ours varies
        self.mount_status = mount_status if mount_status is not None else mount8_status(
            exit_code)


def mount8_status(exit_code: int) -> MountStatus:
    """`lakefs-mount mount`'s exit status as mount(8)'s: every failure that is not bad
    usage (which click reports apart) is a mount failure; 130 is an interrupt."""
    if exit_code == 0:
        return MountStatus.OK
    return MountStatus.INTERRUPTED if exit_code == 130 else MountStatus.FAILURE

"""The one exception the CLI turns into `lakefs-mount: <message>` and an exit status."""

from __future__ import annotations

import click

PROG = "lakefs-mount"


class CliError(click.ClickException):
    """An expected failure with its exit status (1 runtime, 2 bad input)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # click's is per class; ours varies

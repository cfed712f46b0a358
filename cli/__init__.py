"""The `lakefs-mount` command (main.py). Its entry point imports the command only once
running, so that an interrupt while Python loads it ends in one line, not a traceback."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from lakefs_mount.cli.main import cli
    except KeyboardInterrupt:
        sys.stderr.write("lakefs-mount: interrupted\n")
        sys.exit(130)
    cli()

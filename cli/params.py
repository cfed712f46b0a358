"""What the commands' arguments mean: sizes (512M, 64G) and paths, absolute or inside a
mount."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from lakefs_mount.config import parse_size


class SizeType(click.ParamType):
    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(str(value))
        except ValueError:
            self.fail(f"not a size: {value!r} (use e.g. 512M, 64G)", param, ctx)


SIZE = SizeType()


class EndpointType(click.ParamType):
    """An S3 endpoint URL: http:// or https:// and a host ("127.0.0.1:9000" alone is
    what people type, and botocore only says "Invalid endpoint")."""

    name = "URL"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> str:
        url = str(value)
        scheme, sep, rest = url.partition("://")
        if not sep:
            self.fail(f"{url!r} has no scheme: use http://{url} or https://{url}", param, ctx)
        if scheme not in ("http", "https") or not rest.strip("/"):
            self.fail(f"{url!r} is not an http:// or https:// URL with a host", param, ctx)
        return url


ENDPOINT = EndpointType()


class ModeType(click.ParamType):
    """Permission bits in octal, as chmod takes them (0640, 640, 2775): a decimal reading
    of `644` would be a nonsense mode no one meant."""

    name = "MODE"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip()
        try:
            mode = int(text.removeprefix("0o"), 8)
        except ValueError:
            self.fail(f"not an octal mode: {text!r} (use e.g. 0644, 0755)", param, ctx)
        if not 0 <= mode <= 0o7777:
            self.fail(f"{text!r} is not a mode: use 0 to 07777 in octal", param, ctx)
        return mode


MODE = ModeType()

# A uid or gid: 32 bits, less (uid_t)-1, which means "unchanged" to chown(2)
ID = click.IntRange(0, 2**32 - 2)


class MountPointType(click.ParamType):
    """A mount point as given, made absolute without a look at it: a stat of a mount
    whose daemon is stopped waits in the kernel for an answer that does not come, and
    the command's --timeout must hold then too (click.Path stats every path)."""

    name = "MOUNTPOINT"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Path:
        return abs_path(value)


MOUNT_POINT = MountPointType()


def abs_path(path: Path | str) -> Path:
    """Absolute path without resolving the last component (it may be a dead mount)."""
    return Path(os.path.abspath(path))


def is_relative_to(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def relative_in_mount(mountpoint: Path, path: str | None,
                      param_hint: str = "PATH") -> str | None:
    """PATH (absolute inside the mount, or relative to its root) -> key-relative path."""
    if path is None:
        return None
    candidate = Path(os.path.normpath(mountpoint / path))  # absolute `path` wins in `/`
    if not is_relative_to(candidate, mountpoint):
        real_mp = Path(os.path.realpath(mountpoint))
        candidate = Path(os.path.realpath(candidate))
        if not is_relative_to(candidate, real_mp):
            raise click.BadParameter(f"{path} is outside the mount {mountpoint}",
                                     param_hint=param_hint)
        mountpoint = real_mp
    rel = candidate.relative_to(mountpoint).as_posix()
    return None if rel in ("", ".") else rel

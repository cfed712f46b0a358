"""The command line of `mount.fuse.lakefs-mount` (the helper mount(8) runs for
`-t fuse.lakefs-mount` and fstab) as the arguments of `lakefs-mount mount`.

util-linux turns `mount -t fuse.lakefs-mount SOURCE DIR -o cache_dir=/nvme/c,_netdev` (and
the same line in /etc/fstab) into `mount.fuse.lakefs-mount SOURCE DIR -o ...`. Each `-o`
item is the long option of `lakefs-mount mount` of the same name (dashes or underscores),
read from the click command itself, so an option is declared once and spelled both ways.
The helper then runs that `mount` command: it returns once the mount is usable and leaves
the daemon running, as mount(8) expects of a helper.

`env.NAME=VALUE` items (as rclone's) set environment variables of that command and so of
the daemon: AWS_PROFILE, AWS_SHARED_CREDENTIALS_FILE, AWS_CA_BUNDLE, HTTPS_PROXY.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

import click

from lakefs_mount.cli.mount import mount

HELPER = "mount.fuse.lakefs-mount"
# Options of `mount` that make no sense for a helper, which must return once mounted.
NOT_FOR_HELPER = frozenset({"foreground", "help"})
# Items that belong to mount(8), fstab or systemd, not to the filesystem: passed over.
PASSED_OVER = frozenset({"defaults", "auto", "noauto", "nofail", "_netdev", "rw", "user",
                         "users", "nouser", "owner", "group", "comment",
                         # mount flags the daemon sets itself (always nodev); mount.fuse3
                         # adds `dev,suid` to what it passes on
                         "dev", "nodev", "suid", "nosuid", "exec", "noexec"})
PASSED_OVER_PREFIXES = ("x-",)  # x-systemd.*, x-gvfs-* and other userspace-only items
# fstab spellings of `mount` flags.
ALIASES = {"ro": "read-only"}


ENV_PREFIX = "env."
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Names whose values are never shown (the helper's -v line, errors): keys, tokens, passwords
SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSW|KEY|CREDENTIAL(?!S_FILE)", re.IGNORECASE)
MASK = "***"


class HelperError(Exception):
    """An `-o` item that cannot be turned into an option of `lakefs-mount mount`."""


def option_table(command: click.Command) -> dict[str, click.Option]:
    """`-o` name (both `cache-dir` and `cache_dir`) -> the click option it sets."""
    table: dict[str, click.Option] = {}
    for param in command.params:
        if not isinstance(param, click.Option):
            continue
        for opt in param.opts:
            name = opt.removeprefix("--")
            if opt.startswith("--") and name not in NOT_FOR_HELPER:
                table[name] = param
                table[name.replace("-", "_")] = param
    for alias, name in ALIASES.items():
        table[alias] = table[name]
    return table


def is_passed_over(name: str) -> bool:
    return name in PASSED_OVER or name.startswith(PASSED_OVER_PREFIXES)


def translate(items: Sequence[str], command: click.Command,
              sloppy: bool = False) -> list[str]:
    """`-o` items -> arguments of `mount`; HelperError on an unknown item unless `sloppy`
    (mount -s), which passes over what it does not know, as mount(8) promises."""
    table = option_table(command)
    args: list[str] = []
    for item in items:
        name, has_value, value = item.partition("=")
        if not name or is_passed_over(name):
            continue
        option = table.get(name)
        if option is None:
            if sloppy:
                continue
            raise HelperError(f"unknown mount option {name!r} (known: "
                              f"{', '.join(sorted(n for n in table if '-' not in n))})")
        flag = option.opts[0]
        if option.is_flag:
            if has_value:
                raise HelperError(f"mount option {name!r} takes no value")
            args.append(flag)
        elif not has_value:
            raise HelperError(f"mount option {name!r} needs a value: {name}=...")
        else:
            args += [flag, value]
    return args


def split_env(items: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """`-o` items -> (the other items, the variables `env.NAME=VALUE` items set)."""
    rest: list[str] = []
    env: dict[str, str] = {}
    for item in items:
        if not item.startswith(ENV_PREFIX):
            rest.append(item)
            continue
        name, has_value, value = item[len(ENV_PREFIX):].partition("=")
        if not ENV_NAME.fullmatch(name):
            raise HelperError(f"mount option {item.partition('=')[0]!r}: not an environment "
                              f"variable name (env.NAME=VALUE)")
        if not has_value:
            raise HelperError(f"mount option 'env.{name}' needs a value: env.{name}=...")
        env[name] = value
    return rest, env


def shown_env(env: dict[str, str]) -> str:
    """`NAME=VALUE ...` as a shell would set them, secret-looking values masked."""
    return " ".join(f"{name}={MASK if SECRET_NAME.search(name) else value}"
                    for name, value in env.items())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=HELPER, description="mount(8) helper of lakefs-mount: "
        "mount -t fuse.lakefs-mount s3://bucket[/prefix] DIR -o name=value,...")
    parser.add_argument("source")
    parser.add_argument("mountpoint")
    parser.add_argument("-o", dest="options", action="append", default=[],
                        help="comma-separated mount options")
    parser.add_argument("-s", dest="sloppy", action="store_true",
                        help="pass over unknown options")
    parser.add_argument("-f", dest="fake", action="store_true",
                        help="print what would run, mount nothing")
    parser.add_argument("-v", dest="verbose", action="store_true")
    parser.add_argument("-n", dest="no_mtab", action="store_true",
                        help="accepted for mount(8); there is no mtab to write")
    parser.add_argument("-t", dest="fstype", help="accepted for mount(8)")
    return parser


def mount_arguments(argv: Sequence[str]) -> tuple[list[str], argparse.Namespace]:
    """The `lakefs-mount` arguments for a helper command line; `ns.env` holds the
    variables its env. items set."""
    ns = _parser().parse_args(argv)
    items, ns.env = split_env([item for group in ns.options for item in group.split(",")
                               if item])
    return ["mount", *translate(items, mount, ns.sloppy), ns.source,
            ns.mountpoint], ns

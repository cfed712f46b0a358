"""What one mount was asked to do: the options of `lakefs-mount mount`, validated."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

MiB = 1024 * 1024
GiB = 1024 * MiB


def _runtime_root() -> Path:
    if os.geteuid() == 0:
        return Path("/run/lakefs-mount")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "lakefs-mount" if xdg else Path(f"/tmp/lakefs-mount-{os.geteuid()}")


def _state_root() -> Path:
    if os.geteuid() == 0:
        return Path("/var/lib/lakefs-mount")
    return Path.home() / ".local" / "share" / "lakefs-mount"


def mount_id(mountpoint: Path) -> str:
    """A short stable name for a mount point, used for its socket and default cache."""
    # Resolve only the parent: a stat of the mount root itself would hang on a mount
    # whose daemon is not serving yet (or any more).
    absolute = Path(os.path.abspath(mountpoint))
    canonical = absolute.parent.resolve() / absolute.name
    return hashlib.sha256(str(canonical).encode()).hexdigest()[:16]


def control_socket_path(mountpoint: Path) -> Path:
    """Where the daemon serving `mountpoint` listens; the CLI finds it from the path alone."""
    return _runtime_root() / f"{mount_id(mountpoint)}.sock"


def default_cache_dir(mountpoint: Path) -> Path:
    return _state_root() / "cache" / mount_id(mountpoint)


def default_embedded_dir() -> Path:
    return _state_root() / "embedded"


@dataclass
class HooksForTests:
    """Slow-downs and pretences that let the project's own end-to-end tests reach a race
    or a machine they cannot make otherwise (`mount --test-hook NAME=VALUE`, a hidden
    option). All off by default; nothing else sets them."""

    cores: int = 0  # the cores the passthrough watcher counts on (0: its CPU affinity)
    slow_take_over: float = 0.0  # seconds a last close's take-over waits before it starts
    hold_move_after_copy: bool = False  # a replayed directory MOVE stops after its copy

    @classmethod
    def parse(cls, items: tuple[str, ...] | list[str]) -> HooksForTests:
        """`("cores=1", "slow_take_over=2")` -> HooksForTests; ValueError names a bad item."""
        hooks = cls()
        for item in items:
            name, _, value = item.partition("=")
            if name not in {f.name for f in fields(cls)}:
                raise ValueError(f"unknown test hook {name!r}")
            kind = type(getattr(hooks, name))
            setattr(hooks, name, value == "1" if kind is bool else kind(value))
        return hooks


@dataclass
class MountConfig:
    mountpoint: Path
    bucket: str | None = None  # None: start the embedded SeaweedFS
    prefix: str = ""  # "" or ends with "/"
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    cache_dir: Path | None = None
    cache_size: int = 64 * GiB
    max_dirty: int = 16 * GiB
    part_size: int = 16 * MiB
    upload_concurrency: int = 8
    allow_other: bool = False
    allow_root: bool = False  # root and the mounter only (libfuse's allow_root)
    read_only: bool = False
    # What objects without POSIX attributes of their own show (objects other tools wrote,
    # directories that only a key implies): None is the mounter's uid / gid.
    uid: int | None = None
    gid: int | None = None
    file_mode: int = 0o644
    dir_mode: int = 0o755
    fsync_mode: str = "local"  # "local" | "remote"
    io_engine: str = "auto"  # "auto" | "uring" | "threads"
    fuse_session: str = "auto"  # "auto" | "native" | "pyfuse3"
    metadata_ttl: float = 5.0
    commit_delay: float = 1.0  # seconds a closed file waits before its commit starts
    hold_temporaries: float = 5.0  # seconds a temporary's parts wait for its final name
    read_ahead: int = 4  # chunks
    log_level: str = "INFO"
    log_file: Path | None = None
    log_format: str = "text"  # "text" | "json" (one JSON object per line)
    embedded_dir: Path | None = None  # state of the embedded SeaweedFS
    metrics_addr: str | None = None  # HOST:PORT of Prometheus /metrics; None: off
    commit_on_rename: str | None = None  # a glob: `commit` a directory renamed to a match
    test_hooks: HooksForTests = field(default_factory=HooksForTests)

    @property
    def owner(self) -> tuple[int, int]:
        """The uid and gid shown where an object or directory names none."""
        return (os.getuid() if self.uid is None else self.uid,
                os.getgid() if self.gid is None else self.gid)

    def resolved_cache_dir(self) -> Path:
        return self.cache_dir if self.cache_dir is not None else default_cache_dir(self.mountpoint)

    @property
    def mount_source(self) -> str:
        """What mount(8), findmnt and /proc/mounts show as the source: the mounted
        `s3://bucket/prefix`, else FSTYPE_NAME (the embedded server; a name FUSE's option
        syntax could not carry, with a comma, a backslash or white space)."""
        if self.bucket is None:
            return FSTYPE_NAME
        source = f"s3://{self.bucket}/{self.prefix.rstrip('/')}".rstrip("/")
        return FSTYPE_NAME if re.search(r"[,\\\s]", source) else source


# The mount's type is fuse.FSTYPE_NAME, as the mount(8) helper mount.fuse.FSTYPE_NAME
FSTYPE_NAME = "lakefs-mount"

# What botocore accepts as a bucket name (S3-compatible servers take more than AWS does).
BUCKET_NAME = re.compile(r"[a-zA-Z0-9._-]{1,255}")


def parse_source(source: str) -> tuple[str, str]:
    """`s3://bucket[/prefix]` -> (bucket, prefix with a trailing slash or "")."""
    if not source.startswith("s3://"):
        raise ValueError(f"SOURCE must look like s3://bucket[/prefix], got {source!r}")
    rest = source[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"SOURCE {source!r} names no bucket")
    if not BUCKET_NAME.fullmatch(bucket):  # else botocore refuses it, once the daemon runs
        raise ValueError(f"SOURCE {source!r}: {bucket!r} is not a bucket name (letters, "
                         f"digits, '.', '-' and '_'; AWS S3 itself takes 3 to 63 lowercase "
                         f"letters, digits, '.' and '-')")
    prefix = prefix.strip("/")
    return bucket, (prefix + "/") if prefix else ""


def parse_size(text: str) -> int:
    """'16M', '64GiB', '1024' -> bytes."""
    units = {"": 1, "K": 1024, "M": MiB, "G": GiB, "T": 1024 * GiB}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    num = t.rstrip("KMGT")
    unit = t[len(num):]
    if unit not in units or not num:
        raise ValueError(f"not a size: {text!r} (use e.g. 512M, 64G)")
    value = float(num) * units[unit]
    if value < 0:
        raise ValueError(f"size must not be negative: {text!r}")
    return int(value)


def parse_metrics_addr(text: str) -> tuple[str, int]:
    """`HOST:PORT`, `[v6]:PORT` or `:PORT` (loopback) -> (host, port); ValueError else."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"not HOST:PORT: {text!r} (e.g. 127.0.0.1:9567)")
    host = host.removeprefix("[").removesuffix("]") or "127.0.0.1"
    return host, int(port)


def human_bytes(n: float | None) -> str:
    """1536 -> '1.5 KiB' (the inverse of `parse_size`, for people)."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            text = f"{value:.0f}" if unit == "B" else f"{value:.1f}".removesuffix(".0")
            return f"{text} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def orphans_dir(cache_dir: Path) -> Path:
    """Where a mount keeps the cache files its journal does not name (D20), beside data/."""
    return cache_dir / "orphans"


def default_log_file(mountpoint: Path) -> Path:
    """Where a daemonized mount logs unless --log-file says otherwise."""
    return _state_root() / "logs" / f"{mount_id(mountpoint)}.log"

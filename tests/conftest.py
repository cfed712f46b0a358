"""Shared fixtures: an embedded SeaweedFS per session, a fresh bucket per test, a fault proxy.

Fixtures:
  s3_server       (session) started EmbeddedS3 without auth; `.endpoint_url`, `.port`.
  s3_auth_server  (session) EmbeddedS3 requiring its `.access_key` / `.secret_key`.
  bucket          (function) name of a new, empty bucket on s3_server; deleted afterwards.
  s3              (function) S3ObjectStore for `bucket`.
  fault_proxy     (function) FaultProxy in front of s3_server (`.endpoint_url`,
                  `.delay_seconds`, `.fail`, `.bandwidth_bytes_per_s`).
  served          (session) another SeaweedFS reached as a network profile of
                  benchmarks/profiles.py (indirect parameter: its name; "region" by
                  default): https with a CA of its own, a round trip and a bandwidth.
  mount_factory   (function) makes started `mounting.Mount`s of `bucket`; cleans them up.
  mount           (function) one started Mount of `bucket`.
  machine         (function) held by a test that changes what the machine shares.
  reliability     (function) records a fault scenario's measured row; docs/reliability.md
                  is rewritten from them at the end of the session (tests/reliability.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import tempfile
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.profiles import PROFILES, Served
from benchmarks.profiles import start as start_served
from lakefs_mount.s3.embedded import EmbeddedS3, generated_keys
from lakefs_mount.s3.objectstore import ObjectStoreError
from lakefs_mount.s3.store import S3ObjectStore
from tests.faultproxy import FaultProxy  # tests/ is on sys.path (rootdir conftest)
from tests.mounting import Mount, mount_maker
from tests.reliability import DEFAULT_DOC, Row, stamp, update

AUTH_ACCESS_KEY = "lmtestaccesskey"
AUTH_SECRET_KEY = "lmtestsecretkey0123456789"
STOP_GRACE_SECONDS = 3.0  # weed's filer hangs ~15 s on SIGTERM; nothing to save in tests


@pytest.fixture(scope="session", autouse=True)
def _isolated_aws_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep the developer's AWS config/credentials out; give boto3 dummy keys to sign with."""
    empty = tmp_path_factory.mktemp("aws") / "none"
    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.startswith("AWS_"):
                mp.delenv(name)
        mp.setenv("AWS_ACCESS_KEY_ID", "lmdummyaccesskey")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "lmdummysecretkey")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_CONFIG_FILE", str(empty))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        yield


_last_test: list[str] = []  # the test this worker ran last (see _ctrl_c_as_it_was)


@pytest.fixture(autouse=True)
def _ctrl_c_as_it_was(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that runs the CLI in this process (CliRunner) may leave SIGINT ignored:
    `mount` ignores it once its outcome is decided, as the command ends right after. The
    workers' later children then inherit that through exec, and Python installs no
    KeyboardInterrupt in them: `status --watch` ran on past its Ctrl-C in CI (stop 56).
    Every test starts and ends with Python's own handler; one that finds another says
    which test ran before it. (A suite started as a background job of a non-interactive
    shell starts with SIGINT ignored in every worker: two Ctrl-C tests failed so.)"""
    found = signal.getsignal(signal.SIGINT)
    if found is not signal.default_int_handler:
        warnings.warn(f"SIGINT was {found!r} at the start of {request.node.nodeid}, after "
                      f"{_last_test[-1] if _last_test else 'no test'}: reset", stacklevel=1)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _last_test[:] = [request.node.nodeid]
    yield
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _start(state_dir: Path, access_key: str | None = None,
           secret_key: str | None = None) -> EmbeddedS3:
    server = EmbeddedS3(state_dir, access_key=access_key, secret_key=secret_key)
    server.start(timeout=60)  # stops weed itself when start fails
    return server


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory,
              _isolated_aws_env: None) -> Iterator[EmbeddedS3]:
    server = _start(tmp_path_factory.mktemp("seaweedfs"))
    _servers.append(server)
    try:
        yield server
    finally:
        server.stop(timeout=STOP_GRACE_SECONDS)


@pytest.fixture(scope="session")
def s3_auth_server(tmp_path_factory: pytest.TempPathFactory,
                   _isolated_aws_env: None) -> Iterator[EmbeddedS3]:
    server = _start(tmp_path_factory.mktemp("seaweedfs-auth"),
                    access_key=AUTH_ACCESS_KEY, secret_key=AUTH_SECRET_KEY)
    try:
        yield server
    finally:
        server.stop(timeout=STOP_GRACE_SECONDS)


@pytest.fixture(scope="session")
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           _isolated_aws_env: None) -> Iterator[Served]:
    profile = PROFILES[getattr(request, "param", "region")]
    served = start_served(profile, tmp_path_factory.mktemp(f"served-{profile.name}"),
                          **generated_keys(), timeout=60)
    try:
        yield served
    finally:
        served.stop(timeout=STOP_GRACE_SECONDS)


@pytest.fixture
def bucket(s3_server: EmbeddedS3) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:16]}"
    try:
        s3_server.create_bucket(name)
    except ObjectStoreError as exc:
        pytest.fail(f"creating bucket {name} failed: {exc}\nweed running: {s3_server.running};"
                    f" log {s3_server.log_path}:\n{s3_server.log_tail()}")
    try:
        yield name
    finally:
        # frees the bucket's SeaweedFS volume; best effort, the server dies at the end anyway
        with contextlib.suppress(ObjectStoreError):
            s3_server.store(name).delete_bucket()


@pytest.fixture
def s3(s3_server: EmbeddedS3, bucket: str) -> S3ObjectStore:
    return S3ObjectStore(bucket, endpoint_url=s3_server.endpoint_url, region="us-east-1")


@pytest.fixture
def fault_proxy(s3_server: EmbeddedS3) -> Iterator[FaultProxy]:
    proxy = FaultProxy("127.0.0.1", s3_server.port)
    try:
        yield proxy
    finally:
        proxy.close()


MACHINE_LOCK = Path(tempfile.gettempdir()) / "lakefs-mount-tests-machine.lock"


@pytest.fixture
def machine() -> Iterator[None]:
    """Held for the whole test, by the tests that change what the machine shares
    (/etc/fstab, /dev/fuse's ACL and users, fs.pipe-max-size): one of them at a time, also
    with the suite in several xdist workers. A module of them says
    `pytestmark = pytest.mark.usefixtures("machine")` (taken before its own fixtures)."""
    with MACHINE_LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture
def io_engine(request: pytest.FixtureRequest) -> str:
    """The daemon's --io-engine; a module runs under both engines with
    `pytestmark = pytest.mark.parametrize("io_engine", ["uring", "threads"], indirect=True)`."""
    return getattr(request, "param", "auto")


@pytest.fixture
def fuse_session(request: pytest.FixtureRequest) -> str:
    """The daemon's --fuse-session; a module runs under both sessions with
    `pytestmark = pytest.mark.parametrize("fuse_session", SESSIONS, indirect=True)`."""
    return getattr(request, "param", "auto")


@pytest.fixture
def mount_factory(s3_server: EmbeddedS3, bucket: str, tmp_path: Path,
                  io_engine: str, fuse_session: str) -> Iterator:
    """Make (and always clean up) mounts of this test's bucket: `mount_factory(options...)`."""
    chosen = (*(("--io-engine", io_engine) if io_engine != "auto" else ()),
              *(("--fuse-session", fuse_session) if fuse_session != "auto" else ()))
    with mount_maker(tmp_path, bucket, s3_server.endpoint_url, chosen) as make:
        yield make


@pytest.fixture
def mount(mount_factory) -> Mount:
    """A started mount of this test's bucket (whole bucket, default options)."""
    return mount_factory()


_recorded: list[Row] = []  # this session's rows, merged into the document at its end
_measuring: set[str] = set()  # node ids of the tests that asked for `reliability`


@pytest.fixture
def reliability(request: pytest.FixtureRequest) -> Callable[[Row], None]:
    """`reliability(Row(...))` records a scenario's measured result; the session's rows
    are merged into docs/reliability.md at its end when the run was asked to
    (`--write-reliability`)."""
    _measuring.add(request.node.nodeid)

    def record(row: Row) -> None:
        row.test = row.test or request.node.nodeid
        _recorded.append(stamp(row))

    return record


_servers: list[EmbeddedS3] = []  # the session's SeaweedFS, for the failure summary


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int) -> None:
    """On failure, say what the disk and SeaweedFS looked like: a full disk makes every
    later PUT an InternalError, which reads like a defect of the mount."""
    if exitstatus == 0:
        return
    base = Path(tempfile.gettempdir())
    free = shutil.disk_usage(base).free / 2**30
    terminalreporter.write_line(f"free disk under {base}: {free:.1f} GiB")
    for server in _servers:
        terminalreporter.write_line(f"SeaweedFS log {server.log_path}, last lines:")
        terminalreporter.write_line(server.log_tail(15))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--write-reliability", nargs="?", const=str(DEFAULT_DOC), default=None,
                     metavar="PATH", help="merge the fault tests' measured rows into "
                     "docs/reliability.md (or PATH) at the end of the run")


def pytest_sessionfinish(session: pytest.Session) -> None:
    target = session.config.getoption("--write-reliability")
    if not _measuring or target is None:
        return
    try:
        update(Path(target), _recorded, _measuring)
    except OSError as exc:  # a read-only checkout: the run itself is not at fault
        print(f"\nreliability: could not write {target}: {exc}")

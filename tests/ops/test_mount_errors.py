"""Bad input to `lakefs-mount mount`, end to end: real CLI, real daemon, SeaweedFS, FUSE.

Every case must end within seconds with a non-zero exit, a message that says what is
wrong, no mount and no daemon left behind, and no data lost.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import tests.tlsproxy as tlsproxy
from lakefs_mount.ops.mountpoint import is_mounted
from lakefs_mount.s3 import embedded
from lakefs_mount.s3.embedded import EmbeddedS3, EmbeddedS3Error, free_port
from tests.faultproxy import FaultProxy
from tests.mounting import CLI, Mount, _wait_gone, cli
from tests.reliability import Row
from tests.tlsproxy import TlsProxy

WRONG_SECRET = "WrongSecretMustNeverBeLogged0123456789"


# ---------------------------------------------------------------------------- helpers


def run_cli(*args: str, env: dict[str, str | None] | None = None,
            timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    """Run the real console script (`env`: variables to set, or with None to unset);
    (result, seconds it took)."""
    started = time.monotonic()
    environ = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    proc = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env=environ)
    return proc, time.monotonic() - started


def _cmdlines() -> Iterator[tuple[int, list[str]]]:
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(entry.path, "cmdline").read_bytes()
        except OSError:
            continue
        if raw:
            yield int(entry.name), raw.decode(errors="replace").rstrip("\0").split("\0")


def daemons_for(path: Path) -> list[int]:
    """Live lakefs-mount processes whose command line names `path` (zombies excluded)."""
    pids = []
    for pid, argv in _cmdlines():
        if str(path) in argv and any(a.endswith("lakefs-mount") for a in argv[:2]):
            with contextlib.suppress(OSError):
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    pids.append(pid)
    return pids


def kill_weeds(state_dir: Path) -> None:
    """Whatever a test did: no weed of this state dir outlives it."""
    for pid in weeds_for(state_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def weeds_for(state_dir: Path) -> list[int]:
    """Live weed processes serving data under `state_dir`."""
    return [pid for pid, argv in _cmdlines()
            if argv and os.path.basename(argv[0]) == "weed"
            and any(a.startswith(f"-dir={state_dir}") for a in argv)]


def assert_clean_failure(proc: subprocess.CompletedProcess, mnt: Path, *needles: str) -> None:
    """Non-zero, one of `needles` in stderr, no traceback, nothing mounted, no daemon."""
    err = proc.stderr.lower()
    assert proc.returncode != 0, proc.stderr
    assert any(n.lower() in err for n in needles), proc.stderr
    assert "traceback" not in err, proc.stderr
    assert not is_mounted(mnt)
    deadline = time.monotonic() + 5
    while daemons_for(mnt) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert daemons_for(mnt) == []


def mount_args(root: Path, source: str, *extra: str, mnt: Path | None = None) -> list[str]:
    mnt = mnt or root / "mnt"
    mnt.mkdir(parents=True, exist_ok=True)
    return ["mount", source, str(mnt), "--cache-dir", str(root / "cache"),
            "--log-file", str(root / "daemon.log"), *extra]


@pytest.fixture
def cleanup_paths() -> Iterator[list[Path]]:
    """Mount points to force-clean after the test: kill their daemons, detach them."""
    paths: list[Path] = []
    yield paths
    for path in paths:
        for pid in daemons_for(path):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_gone(pid)
        if is_mounted(path):
            subprocess.run(["fusermount3", "-uz", str(path)], capture_output=True)


# ---------------------------------------------------------------------------- S3 side


def test_missing_bucket(s3_server: EmbeddedS3, tmp_path: Path) -> None:
    args = mount_args(tmp_path, "s3://no-such-bucket-xyz", "--endpoint-url",
                      s3_server.endpoint_url)
    proc, took = run_cli(*args)
    assert_clean_failure(proc, tmp_path / "mnt", "no-such-bucket-xyz' does not exist")
    assert "; check the name and the endpoint" in proc.stderr, proc.stderr
    assert took < 10


def test_wrong_credentials_then_right_ones(s3_auth_server: EmbeddedS3, tmp_path: Path,
                                           cleanup_paths: list[Path]) -> None:
    bucket = f"auth-{uuid.uuid4().hex[:12]}"
    s3_auth_server.create_bucket(bucket)
    mnt = tmp_path / "mnt"
    cleanup_paths.append(mnt)
    args = mount_args(tmp_path, f"s3://{bucket}", "--endpoint-url",
                      s3_auth_server.endpoint_url, "--log-level", "DEBUG", "--part-size", "8M")
    wrong = {"AWS_ACCESS_KEY_ID": "wrongaccesskey", "AWS_SECRET_ACCESS_KEY": WRONG_SECRET}
    proc, took = run_cli(*args, env=wrong)
    assert_clean_failure(proc, mnt, "access denied")
    assert "check the credentials" in proc.stderr, proc.stderr
    assert took < 10
    assert WRONG_SECRET not in proc.stderr + proc.stdout
    assert WRONG_SECRET not in (tmp_path / "daemon.log").read_text()

    assert s3_auth_server.access_key and s3_auth_server.secret_key
    right = {"AWS_ACCESS_KEY_ID": s3_auth_server.access_key,
             "AWS_SECRET_ACCESS_KEY": s3_auth_server.secret_key}
    proc, _ = run_cli(*args, env=right)
    assert proc.returncode == 0, proc.stderr
    (mnt / "ok.txt").write_bytes(b"authorized")
    big = os.urandom(17 * 1024 * 1024 + 3)  # multipart: signed headers, unsigned bodies
    (mnt / "big.bin").write_bytes(big)
    proc, _ = run_cli("unmount", str(mnt))
    assert proc.returncode == 0, proc.stderr
    assert not is_mounted(mnt)
    assert s3_auth_server.store(bucket).get_range("ok.txt", 0, 100) == b"authorized"
    assert s3_auth_server.store(bucket).get_range("big.bin", 0, len(big) + 1) == big
    assert s3_auth_server.secret_key not in (tmp_path / "daemon.log").read_text()


def test_a_mount_over_seaweedfs_blames_no_credentials_for_a_checksum_form_it_refuses(
        mount: Mount) -> None:
    """SeaweedFS without identities answers an unsigned aws-chunked trailer 403
    InvalidAccessKeyId, having just taken the same keys with the CRC in a header: the log
    says the trailer form is not taken, never that access was denied (issue 52)."""
    assert "verified by S3" in mount.probed()["checksums"]
    log = mount.log_file.read_text()
    blamed = [line for line in log.splitlines()
              if "access denied" in line.lower() or "credentials" in line.lower()]
    assert not blamed, blamed
    assert "does not take a CRC-32C in an aws-chunked trailer (it answers HTTP 403" in log, \
        mount.log_tail()


def test_endpoint_unreachable(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    args = mount_args(tmp_path, "s3://b", "--endpoint-url", f"http://127.0.0.1:{port}")
    proc, took = run_cli(*args)
    assert_clean_failure(proc, tmp_path / "mnt", "unreachable", "could not connect")
    assert f"127.0.0.1:{port}" in proc.stderr
    assert took < 10, f"took {took:.1f} s"


def test_https_endpoint_signed_by_a_private_ca(s3_server: EmbeddedS3, bucket: str,
                                               tmp_path: Path,
                                               cleanup_paths: list[Path]) -> None:
    """An https endpoint whose certificate the system does not trust fails the mount
    with a message naming AWS_CA_BUNDLE; with it set, small files and multipart uploads
    both travel over TLS (the daemon's own requests and botocore's)."""
    tls = TlsProxy(s3_server.port)
    mnt = tmp_path / "mnt"
    cleanup_paths.append(mnt)
    try:
        args = mount_args(tmp_path, f"s3://{bucket}", "--endpoint-url", tls.endpoint_url,
                          "--part-size", "8M")
        proc, took = run_cli(*args, env={"AWS_CA_BUNDLE": None})
        assert_clean_failure(proc, mnt, "TLS certificate was not accepted")
        assert "AWS_CA_BUNDLE" in proc.stderr
        assert took < 10

        proc, _ = run_cli(*args, env={"AWS_CA_BUNDLE": str(tlsproxy.CERT)})
        assert proc.returncode == 0, proc.stderr
        (mnt / "small.txt").write_bytes(b"over tls")
        big = os.urandom(17 * 1024 * 1024 + 5)
        (mnt / "big.bin").write_bytes(big)
        proc, _ = run_cli("unmount", str(mnt))
        assert proc.returncode == 0, proc.stderr
    finally:
        tls.close()
    store = s3_server.store(bucket)
    assert store.get_range("small.txt", 0, 100) == b"over tls"
    assert store.get_range("big.bin", 0, len(big) + 1) == big


# ---------------------------------------------------------------------------- mount point


@pytest.mark.parametrize("kind, needle", [
    ("missing", "does not exist"),
    ("file", "is not a directory"),
    ("nonempty", "is not empty"),
])
def test_bad_mountpoint(s3_server: EmbeddedS3, bucket: str, tmp_path: Path, kind: str,
                        needle: str) -> None:
    target = tmp_path / "target"
    if kind == "file":
        target.write_text("x")
    elif kind == "nonempty":
        target.mkdir()
        (target / "keep.txt").write_text("mine")
    proc, took = run_cli("mount", f"s3://{bucket}", str(target), "--endpoint-url",
                         s3_server.endpoint_url, "--cache-dir", str(tmp_path / "cache"),
                         "--log-file", str(tmp_path / "log"))
    assert_clean_failure(proc, target, needle)
    assert proc.returncode == 2 and took < 10
    if kind == "nonempty":
        assert (target / "keep.txt").read_text() == "mine"


def test_already_mounted(mount_factory, s3_server: EmbeddedS3, bucket: str,
                         tmp_path: Path) -> None:
    first = mount_factory()
    (first.path / "a.txt").write_bytes(b"first")
    proc, took = run_cli("mount", f"s3://{bucket}", str(first.path), "--endpoint-url",
                         s3_server.endpoint_url, "--cache-dir", str(tmp_path / "cache2"),
                         "--log-file", str(tmp_path / "log2"))
    assert proc.returncode == 2 and took < 10
    assert "already mounted" in proc.stderr, proc.stderr
    # the first mount is untouched and still serves
    assert first.status()["pid"] == first.pid
    assert (first.path / "a.txt").read_bytes() == b"first"
    (first.path / "b.txt").write_bytes(b"second")
    assert first.flush().returncode == 0


def test_an_interrupted_mount_mounts_nothing_behind_the_users_back(
        s3_server: EmbeddedS3, bucket: str, fault_proxy, tmp_path: Path,
        cleanup_paths: list[Path]) -> None:
    """Issue 29 defect 6: Ctrl-C while `mount` waits for its daemon (first for an S3 in a
    black hole, then at moments around the mount being made) ends in one line with
    status 130 and no daemon left to mount later, or, if the mount was ready first, in
    status 0 and a mount: never `interrupted` with a mount behind it."""
    mnt = tmp_path / "mnt"
    cleanup_paths.append(mnt)
    args = mount_args(tmp_path, f"s3://{bucket}", "--endpoint-url", fault_proxy.endpoint_url,
                      mnt=mnt)
    fault_proxy.hang = True  # the start-up bucket check waits (15 s a try)
    outcomes = []
    for delay in (1.0, 0.2, 0.4, 0.6, 0.8):
        proc = subprocess.Popen([CLI, *args], stdin=subprocess.DEVNULL, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        fault_proxy.hang = False
        outcomes.append(proc.returncode)
        if proc.returncode == -signal.SIGINT:  # before Python took SIGINT: nothing started
            assert daemons_for(mnt) == [] and not is_mounted(mnt), delay
            continue
        if proc.returncode == 0:
            assert is_mounted(mnt)
            assert cli("unmount", str(mnt)).returncode == 0
            continue
        assert proc.returncode == 130, (delay, proc.returncode, err)
        lines = err.strip().splitlines()  # (click ends the ^C line first)
        assert len(lines) == 1 and lines[0].startswith("lakefs-mount: interrupted"), err
        assert daemons_for(mnt) == [], delay
        time.sleep(1.0)
        assert not is_mounted(mnt), delay
    assert 130 in outcomes, outcomes


def test_ctrl_c_to_a_foreground_mount_while_it_starts_ends_in_one_line(
        s3_server: EmbeddedS3, bucket: str, fault_proxy, tmp_path: Path,
        cleanup_paths: list[Path]) -> None:
    """Issue 29 defect 6: Ctrl-C to `mount --foreground` while the daemon starts up in its
    event loop (here while it retries the first directory-attribute probe after 503s)
    printed 'daemon failed' with a traceback and `mount failed: ` with no cause; now one
    line, status 130, nothing mounted."""
    mnt = tmp_path / "mnt"
    cleanup_paths.append(mnt)
    fault_proxy.parse_requests = True
    fault_proxy.answer_with(503, "SlowDown", 2, frozenset({"PUT"}))  # 0.2 + 0.4 s of retries
    log_file = tmp_path / "daemon.log"
    proc = subprocess.Popen(
        [CLI, *mount_args(tmp_path, f"s3://{bucket}", "--endpoint-url",
                          fault_proxy.endpoint_url, "--foreground", mnt=mnt)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while fault_proxy.answered == 0:  # the event loop runs: the probe got its first 503
        assert time.monotonic() < deadline and proc.poll() is None, log_file.read_text()
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert fault_proxy.answered == 1, "the interrupt came too late to test anything"
    lines = err.strip().splitlines()
    assert proc.returncode == 130, (proc.returncode, err)
    assert lines[-1].startswith("lakefs-mount: interrupted"), err
    assert "Traceback" not in err and "Traceback" not in log_file.read_text(), err
    assert not is_mounted(mnt) and daemons_for(mnt) == []


def test_stale_mount_after_kill9_is_cleaned_and_data_kept(mount_factory, s3) -> None:
    m: Mount = mount_factory()
    payload = os.urandom(3 * 1024 * 1024 + 17)
    with open(m.path / "before-crash.bin", "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    assert m.pid is not None
    os.kill(m.pid, signal.SIGKILL)
    _wait_gone(m.pid)
    m.pid = None
    with pytest.raises(OSError) as info:
        os.stat(m.path)
    assert info.value.errno == errno.ENOTCONN
    assert is_mounted(m.path)

    started = time.monotonic()
    m.start()  # same cache dir: detaches the dead mount, recovers the journal
    assert time.monotonic() - started < 15
    assert m.flush().returncode == 0
    assert s3.get_range("before-crash.bin", 0, len(payload) + 1) == payload
    assert (m.path / "before-crash.bin").read_bytes() == payload


# ---------------------------------------------------------------------------- cache dir


def test_cache_dir_below_a_file(s3_server: EmbeddedS3, bucket: str, tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("x")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc, took = run_cli("mount", f"s3://{bucket}", str(mnt), "--endpoint-url",
                         s3_server.endpoint_url, "--cache-dir", str(tmp_path / "plain" / "c"),
                         "--log-file", str(tmp_path / "log"))
    assert_clean_failure(proc, mnt, "cannot create cache directory")
    assert str(tmp_path / "plain" / "c") in proc.stderr and took < 10


def test_a_cache_dir_whose_journal_is_not_a_file_is_refused_in_one_line(
        s3_server: EmbeddedS3, bucket: str, tmp_path: Path) -> None:
    """Issue 29 defect 6: the daemon's start-up OSErrors came out raw (`lakefs-mount:
    [Errno 21] Is a directory: '.../journal.db'`); now they name the path, the cause
    and what to do."""
    (tmp_path / "cache" / "journal.db").mkdir(parents=True)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc, took = run_cli(*mount_args(tmp_path, f"s3://{bucket}", "--endpoint-url",
                                     s3_server.endpoint_url, mnt=mnt))
    assert_clean_failure(proc, mnt, "is a directory")
    assert proc.returncode == 1 and took < 10
    assert proc.stderr.count("\n") == 1 and "[Errno" not in proc.stderr, proc.stderr
    assert str(tmp_path / "cache" / "journal.db") in proc.stderr, proc.stderr
    assert "; " in proc.stderr and "--cache-dir" in proc.stderr, proc.stderr


@pytest.fixture
def readonly_dir(tmp_path: Path) -> Iterator[Path]:
    """A read-only tmpfs (root only: root ignores permission bits, not a ro mount)."""
    assert os.geteuid() == 0, "the end-to-end suite runs as root (FUSE mounts, tmpfs)"
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(ro)], check=True)
    try:
        (ro / "cache").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        yield ro
    finally:
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)


def test_cache_dir_read_only(s3_server: EmbeddedS3, bucket: str, tmp_path: Path,
                             readonly_dir: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    for cache in (readonly_dir / "cache", readonly_dir / "new"):  # existing, to be created
        proc, took = run_cli("mount", f"s3://{bucket}", str(mnt), "--endpoint-url",
                             s3_server.endpoint_url, "--cache-dir", str(cache),
                             "--log-file", str(tmp_path / "log"))
        assert_clean_failure(proc, mnt, "not writable", "cannot create cache directory")
        assert "read-only file system" in proc.stderr.lower() and took < 10


def test_cache_dir_locked_by_live_daemon(mount_factory, s3_server: EmbeddedS3, bucket: str,
                                         tmp_path: Path) -> None:
    first = mount_factory()
    (first.path / "x.txt").write_bytes(b"x")
    mnt2 = tmp_path / "mnt2"
    mnt2.mkdir()
    proc, took = run_cli("mount", f"s3://{bucket}", str(mnt2), "--endpoint-url",
                         s3_server.endpoint_url, "--cache-dir", str(first.cache_dir),
                         "--log-file", str(tmp_path / "log2"))
    assert_clean_failure(proc, mnt2, "in use by another lakefs-mount daemon")
    assert proc.returncode == 1 and took < 10  # as the README lists it
    assert first.flush().returncode == 0
    assert (first.path / "x.txt").read_bytes() == b"x"


def test_a_cache_dir_of_another_bucket_is_refused_in_one_line_with_status_1(
        mount_factory, s3_server: EmbeddedS3, bucket: str) -> None:
    """Issue 29 defect 6: the README's status (1: what the daemon finds as it starts),
    one line with what to do, and the cache directory's pending data untouched."""
    first = mount_factory()
    assert first.unmount().returncode == 0
    other = f"{bucket}-other"
    s3_server.create_bucket(other)
    proc, took = run_cli(*mount_args(first.root, f"s3://{other}", "--endpoint-url",
                                     s3_server.endpoint_url, mnt=first.path))
    assert_clean_failure(proc, first.path, f"belongs to s3://{bucket}/")
    assert proc.returncode == 1 and took < 10 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("lakefs-mount: ") and "use another --cache-dir" in proc.stderr
    s3_server.store(other).delete_bucket()


# ---------------------------------------------------------------------------- runtime


def _outage_during_flush(m: Mount, fault_proxy, s3) -> bytes:
    """Write a multipart file, take S3 away, flush: a prompt non-zero exit with a reason."""
    payload = os.urandom(20 * 1024 * 1024 + 5)  # more than one 16 MiB part
    (m.path / "ckpt.bin").write_bytes(payload)
    fault_proxy.fail = True
    started = time.monotonic()
    proc = m.flush("--timeout", "20", timeout=60)
    err = proc.stderr.lower()
    assert proc.returncode != 0
    assert "keeps failing" in err or "timed out" in err, proc.stderr
    assert "unreachable" in err and "traceback" not in err, proc.stderr  # the reason
    assert time.monotonic() - started < 25
    assert s3.head("ckpt.bin") is None
    fault_proxy.fail = False
    return payload


def test_s3_down_during_flush_loses_nothing(mount_factory, fault_proxy, s3) -> None:
    m: Mount = mount_factory(endpoint_url=fault_proxy.endpoint_url)
    payload = _outage_during_flush(m, fault_proxy, s3)
    deadline = time.monotonic() + 60  # the daemon's backoff decides when it notices
    while (proc := m.flush(timeout=120)).returncode != 0 and time.monotonic() < deadline:
        time.sleep(1)
    assert proc.returncode == 0, proc.stderr + m.log_tail()
    assert s3.get_range("ckpt.bin", 0, len(payload) + 1) == payload
    assert m.status()["files_pending"] == 0


def test_throttling_by_s3_is_retried_and_shows_in_status_and_the_log(
        mount_factory, fault_proxy, s3) -> None:
    """Issue 29, defect 5: 503 SlowDown answers were retried invisibly inside the S3
    client. Now each one is an error and a retry in `status`, and a log line."""
    fault_proxy.parse_requests = True  # before the mount: every connection is parsed
    m: Mount = mount_factory(endpoint_url=fault_proxy.endpoint_url)
    deadline = time.monotonic() + 20  # the checksum probe's PUTs (not counted) come first
    while "whether" in m.status()["checksums"] and time.monotonic() < deadline:
        time.sleep(0.1)
    fault_proxy.answer_with(503, "SlowDown", 4, frozenset({"PUT", "POST"}))
    payload = os.urandom(24 * 1024 * 1024)  # parts, then CompleteMultipartUpload
    (m.path / "ckpt.bin").write_bytes(payload)
    proc = m.flush(timeout=120)
    assert proc.returncode == 0, proc.stderr + m.log_tail()
    assert s3.get_range("ckpt.bin", 0, len(payload) + 1) == payload
    status = m.status()
    assert fault_proxy.answered == 4
    assert status["retries"] >= 4 and status["errors"] >= 4, status
    assert m.log_tail(400).count("SlowDown") >= 4


def test_a_mount_point_still_served_by_a_flushing_daemon_is_refused_in_one_line(
        mount_factory, fault_proxy) -> None:
    """Issue 29 defect 6: after a lazy unmount the old daemon may still be flushing into
    an unreachable S3; a new mount there says so plainly (not 'Exceptions from Trio
    nursery'), and the old daemon finishes once S3 is back."""
    old: Mount = mount_factory(endpoint_url=fault_proxy.endpoint_url)
    (old.path / "d").mkdir()
    fault_proxy.fail = True
    (old.path / "d" / "pending.bin").write_bytes(b"x" * 100_000)
    subprocess.run(["umount", "-l", str(old.path)], check=True)
    new: Mount = mount_factory(name="second", start=False)
    proc = cli("mount", new.source, str(old.path), "--endpoint-url", new.endpoint_url,
               "--cache-dir", str(new.cache_dir), "--log-file", str(new.log_file))
    assert proc.returncode != 0
    assert "already serves" in proc.stderr and "sub-exception" not in proc.stderr, proc.stderr
    assert "Traceback" not in new.log_file.read_text()
    fault_proxy.fail = False
    assert old.pid is not None
    _wait_gone(old.pid, timeout=120)


def test_unmount_busy(mount_factory) -> None:
    m: Mount = mount_factory()
    (m.path / "d").mkdir()
    sleeper = subprocess.Popen(["sleep", "60"], cwd=m.path / "d")
    try:
        proc = m.unmount()
        assert proc.returncode == 1, proc.stderr
        assert "busy" in proc.stderr, proc.stderr
        assert is_mounted(m.path)
        (m.path / "still.txt").write_bytes(b"works")
        assert (m.path / "still.txt").read_bytes() == b"works"
    finally:
        sleeper.kill()
        sleeper.wait()
    proc = m.unmount()
    assert proc.returncode == 0, proc.stderr
    assert not is_mounted(m.path)


def test_status_still_answers_after_the_cache_directory_was_removed(mount_factory) -> None:
    """An operator removed the cache directory under a live mount: `status` must still
    answer (cache use unknown) instead of failing, and unmount still works."""
    m: Mount = mount_factory()
    (m.path / "f").write_bytes(b"x" * 1000)
    assert m.flush().returncode == 0
    assert m.status()["cache_used"] > 0
    shutil.rmtree(m.cache_dir / "data")
    status = m.status()
    assert status["cache_used"] is None and status["files_pending"] == 0
    assert "cache used" not in cli("status", str(m.path), check=True).stdout
    assert m.unmount().returncode == 0


# ---------------------------------------------------------------------------- embedded


def test_embedded_mount_survives_daemon_kill9(tmp_path: Path,
                                              cleanup_paths: list[Path]) -> None:
    state = tmp_path / "embedded"
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cleanup_paths.append(mnt)
    args = ["mount", str(mnt), "--embedded-dir", str(state), "--cache-dir",
            str(tmp_path / "cache"), "--log-file", str(tmp_path / "daemon.log")]
    try:
        proc, _ = run_cli(*args)
        assert proc.returncode == 0, proc.stderr
        (mnt / "kept.txt").write_bytes(b"embedded data")
        assert cli("flush", str(mnt)).returncode == 0
        pid = int(json.loads(cli("status", str(mnt), "--json", check=True).stdout)["pid"])
        assert weeds_for(state)
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid)
        deadline = time.monotonic() + 5  # weed dies with its daemon (parent-death signal)
        while weeds_for(state) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert weeds_for(state) == []
        subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)

        proc, took = run_cli(*args)
        assert proc.returncode == 0, proc.stderr
        assert (mnt / "kept.txt").read_bytes() == b"embedded data"
        assert len(weeds_for(state)) == 1
        proc, _ = run_cli("unmount", str(mnt))
        assert proc.returncode == 0, proc.stderr
        deadline = time.monotonic() + 20
        while weeds_for(state) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert weeds_for(state) == []
    finally:
        kill_weeds(state)


def test_embedded_leftover_weed_is_replaced(tmp_path: Path) -> None:
    """A weed whose owner died without taking it along (no parent-death signal) is stopped."""
    state = tmp_path / "embedded"
    old = EmbeddedS3(state).start()
    try:
        old.create_bucket("keep")
        old.store("keep").put("k", b"v", {})
        leftover = old.pid
        old._forget()  # the owner "dies": lock released, weed keeps running
        new = EmbeddedS3(state).start()
        try:
            assert new.pid != leftover and weeds_for(state) == [new.pid]
            assert new.store("keep").get_range("k", 0, 10) == b"v"
        finally:
            new.stop(timeout=2)
    finally:
        kill_weeds(state)


def test_embedded_weed_log_rotates_at_start(tmp_path: Path, monkeypatch) -> None:
    """weed appends to weed.log for as long as it runs; a start finding it over
    LOG_MAX_BYTES moves it to weed.log.1 first, so restarts never grow it without bound."""
    monkeypatch.setattr(embedded, "LOG_MAX_BYTES", 1000)
    state = tmp_path / "embedded"
    state.mkdir(mode=0o700)
    (state / "weed.log").write_text("old run\n" * 200)
    server = EmbeddedS3(state).start()
    try:
        assert (state / "weed.log.1").read_text() == "old run\n" * 200
        assert "==== lakefs-mount: starting" in (state / "weed.log").read_text()
        assert "old run" not in (state / "weed.log").read_text()
    finally:
        server.stop(timeout=2)
        kill_weeds(state)


def test_embedded_dir_in_use(tmp_path: Path) -> None:
    """A live owner's state dir is refused at once (its weed must never be killed)."""
    state = tmp_path / "embedded"
    state.mkdir()
    owner = EmbeddedS3(state)
    owner._lock_state_dir()  # what a running server holds; no need to start weed
    try:
        started = time.monotonic()
        with pytest.raises(EmbeddedS3Error, match="is in use by another lakefs-mount"):
            EmbeddedS3(state).start()
        assert time.monotonic() - started < 2
    finally:
        owner._unlock_state_dir()


@pytest.mark.parametrize("case", ["black-holed endpoint", "no credentials"])
def test_a_mount_s3_cannot_answer_fails_in_bounded_time_in_one_line(
        s3_auth_server: EmbeddedS3, tmp_path: Path, reliability, case: str) -> None:
    """Issue 29's bad input: an endpoint that takes requests and never answers (a stuck
    load balancer), and no credentials at all (none in the environment or in files).
    Either mount fails within the start-up probe's bound, with one line that says why,
    exit 1, and no mount or daemon left."""
    bucket = f"auth-{uuid.uuid4().hex[:12]}"
    s3_auth_server.create_bucket(bucket)
    with FaultProxy("127.0.0.1", s3_auth_server.port) as proxy:
        env: dict[str, str | None] = {"AWS_ACCESS_KEY_ID": s3_auth_server.access_key,
                                      "AWS_SECRET_ACCESS_KEY": s3_auth_server.secret_key}
        if case == "no credentials":
            env = dict.fromkeys(env)
        else:
            proxy.hang = True
        args = mount_args(tmp_path, f"s3://{bucket}", "--endpoint-url", proxy.endpoint_url)
        proc, took = run_cli(*args, env=env, timeout=180)
    lines = proc.stderr.strip().splitlines()
    reliability(Row(
        scenario=f"bad input: mount with {case}",
        injects="requests taken and never answered" if case != "no credentials"
                else "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY unset, no config files",
        acknowledged=0, lost=0, corrupt=0, seconds=round(took, 1),
        notes=f"exit {proc.returncode}: '{proc.stderr.strip()}'"))
    assert_clean_failure(proc, tmp_path / "mnt", "credentials" if case == "no credentials"
                         else "answer")
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("lakefs-mount: ")
    assert took < 60, took

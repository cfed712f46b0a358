"""Other users see the mount only with --allow-other, and then modes are enforced
(default_permissions); chmod/chown persist as object metadata."""

from __future__ import annotations

import os
import stat
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from lakefs_mount.config import control_socket_path
from tests.mounting import Mount, cli
from tests.reliability import Row

NOBODY = 65534


def _as_nobody(script: str) -> subprocess.CompletedProcess:
    """A shell command run as user nobody (system binaries: root's Python is private)."""
    def drop() -> None:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)

    return subprocess.run(["/bin/sh", "-c", script], preexec_fn=drop, capture_output=True,
                          text=True, timeout=30, cwd="/")


@pytest.fixture
def public_root() -> Iterator[Path]:
    """A directory other users can traverse (pytest's tmp dirs are private to root)."""
    root = Path(tempfile.mkdtemp(prefix="lm-perm-"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)


def _mount(public_root: Path, bucket: str, endpoint: str, *options: str) -> Mount:
    m = Mount(public_root / ("m" + str(len(list(public_root.iterdir())))), bucket, endpoint,
              options=options)
    m.root.chmod(0o755)
    m.start()
    m.path.chmod(0o755)
    return m


def test_other_users_are_refused_without_allow_other(public_root, bucket, s3_server):
    m = _mount(public_root, bucket, s3_server.endpoint_url)
    try:
        (m.path / "f").write_bytes(b"x")
        os.chmod(m.path / "f", 0o644)
        proc = _as_nobody(f"cat '{m.path / 'f'}'")
        assert proc.returncode != 0 and "Permission denied" in proc.stderr
    finally:
        m.cleanup()


def test_with_allow_other_modes_are_enforced_for_other_users(public_root, bucket, s3_server):
    m = _mount(public_root, bucket, s3_server.endpoint_url, "--allow-other")
    try:
        secret, shared = m.path / "secret", m.path / "shared"
        secret.write_bytes(b"root only")
        shared.write_bytes(b"for everyone")
        os.chmod(secret, 0o600)
        os.chmod(shared, 0o644)
        denied = _as_nobody(f"cat '{secret}'")
        assert denied.returncode != 0 and "Permission denied" in denied.stderr
        allowed = _as_nobody(f"cat '{shared}'")
        assert allowed.returncode == 0 and allowed.stdout == "for everyone"
        write = _as_nobody(f"printf x >> '{shared}'")
        assert write.returncode != 0 and "Permission denied" in write.stderr
        os.chown(shared, NOBODY, NOBODY)
        assert _as_nobody(f"printf '!' >> '{shared}'").returncode == 0
        assert m.flush().returncode == 0
        assert shared.read_bytes() == b"for everyone!"
    finally:
        m.cleanup()


def test_a_private_directory_stays_private_to_other_users_after_a_remount(
        public_root, bucket, s3_server):
    """SeaweedFS keeps no metadata on the `private/` marker: the mount keeps it elsewhere."""
    first = _mount(public_root, bucket, s3_server.endpoint_url, "--allow-other")
    try:
        for name, mode in (("private", 0o700), ("shared", 0o755)):
            (first.path / name).mkdir()
            (first.path / name / "f").write_bytes(b"secret")
            os.chmod(first.path / name, mode)
        assert first.unmount().returncode == 0
    finally:
        first.cleanup()
    second = _mount(public_root, bucket, s3_server.endpoint_url, "--allow-other")  # new cache
    try:
        denied = _as_nobody(f"ls '{second.path / 'private'}'")
        assert denied.returncode != 0 and "Permission denied" in denied.stderr
        allowed = _as_nobody(f"cat '{second.path / 'shared' / 'f'}'")
        assert allowed.returncode == 0 and allowed.stdout == "secret"
    finally:
        second.cleanup()


def test_a_mount_keeps_its_secret_and_its_files_from_other_users(
        public_root, s3_auth_server, monkeypatch, reliability):
    """Issue 29's security checks on a real mount with real credentials: the cache
    directory and everything in it (journal, data), the log and the control socket carry
    no group or other permission; the secret key is in neither the log, `status`,
    `status --json`, the cache directory nor the daemon's command line; and user nobody
    (no --allow-other) can read neither the mount, the cache directory nor the socket."""
    bucket = f"sec-{uuid.uuid4().hex[:12]}"
    s3_auth_server.create_bucket(bucket)
    secret = s3_auth_server.secret_key
    assert secret
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_auth_server.access_key or "")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    began = time.monotonic()
    m = _mount(public_root, bucket, s3_auth_server.endpoint_url)
    try:
        (m.path / "f").write_bytes(b"x" * 100_000)
        os.chmod(m.path / "f", 0o644)
        assert m.flush().returncode == 0
        sock = control_socket_path(m.path)
        private = [m.cache_dir, *m.cache_dir.rglob("*"), m.log_file, sock, sock.parent]
        open_to_others = {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in private
                          if p.exists() and stat.S_IMODE(p.stat().st_mode) & 0o077}
        said = [cli("status", str(m.path)).stdout, cli("status", str(m.path), "--json").stdout,
                m.log_file.read_text(errors="replace"),
                Path(f"/proc/{m.pid}/cmdline").read_bytes().decode(errors="replace"),
                *(p.read_bytes().decode(errors="replace") for p in m.cache_dir.rglob("*")
                  if p.is_file())]
        leaks = sum(secret in text for text in said)
        # m.root is 0755 (_mount): only the cache directory's own mode stands in the way
        nobody = {
            "mount": _as_nobody(f"ls '{m.path}'"),
            "cache": _as_nobody(f"ls '{m.cache_dir}'"),
            "socket": _as_nobody(f"/usr/bin/python3 -c \"import socket; socket.socket("
                                 f"socket.AF_UNIX).connect('{sock}')\""),
        }
        reached = sorted(what for what, proc in nobody.items() if proc.returncode == 0)
        reliability(Row(
            scenario="security: modes, secrets, another user",
            injects="a mount with real credentials; user nobody tries the mount, the cache "
                    "directory and the control socket",
            acknowledged=1, lost=0, corrupt=0, seconds=round(time.monotonic() - began, 1),
            notes=f"{len(private)} cache/log/socket paths checked, {len(open_to_others)} "
                  f"open to group or others; the secret found in {leaks} of {len(said)} "
                  f"outputs and files; of {', '.join(nobody)}, user nobody reached "
                  f"{', '.join(reached) or 'none'}"))
        assert not open_to_others, open_to_others
        assert not leaks
        assert not reached, {what: proc.stdout + proc.stderr for what, proc in nobody.items()}
        assert all("ermission denied" in proc.stderr for proc in nobody.values()), nobody
    finally:
        m.cleanup()


@pytest.mark.parametrize("session", ["native", "pyfuse3"])
def test_allow_root_lets_the_kernel_pass_others_and_the_daemon_refuse_them(
        public_root, bucket, s3_server, session):
    """--allow-root: the kernel lets everyone past (allow_other), and requests of users
    other than root and the mounter are refused (EACCES), as libfuse's allow_root does;
    with --allow-other, the same file is open to them (above)."""
    m = _mount(public_root, bucket, s3_server.endpoint_url, "--allow-root",
               "--fuse-session", session)
    try:
        (m.path / "f").write_bytes(b"x")
        os.chmod(m.path / "f", 0o644)
        options = subprocess.run(["findmnt", "-n", "-o", "OPTIONS", "--mountpoint",
                                  str(m.path)], capture_output=True, text=True).stdout
        assert "allow_other" in options.strip().split(","), options
        proc = _as_nobody(f"cat '{m.path / 'f'}'")
        assert proc.returncode != 0 and "Permission denied" in proc.stderr, proc
        assert (m.path / "f").read_bytes() == b"x"  # the mounter (root) still reads it
    finally:
        m.cleanup()

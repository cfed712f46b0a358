"""Other users see the mount only with --allow-other, and then modes are enforced
(default_permissions); chmod/chown persist as object metadata."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from mounting import Mount

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

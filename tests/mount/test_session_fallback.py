"""`--fuse-session auto` where the native session cannot start: the daemon mounts with
pyfuse3, says why in one log line, and `status` names the session (real mount, real
SeaweedFS). The native session is kept from /dev/fuse by a seccomp filter
(tests/refuse_native.py); `--fuse-session native` then fails with the same reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.mounting import CLI

REFUSE_NATIVE = str(Path(__file__).parents[1] / "refuse_native.py")
WHY = "cannot open /dev/fuse: Permission denied"


def _mount_refusing_native(m, session: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, REFUSE_NATIVE, CLI, "mount", m.source, str(m.path),
         "--endpoint-url", m.endpoint_url, "--cache-dir", str(m.cache_dir),
         "--log-file", str(m.log_file), "--fuse-session", session],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_auto_mounts_with_pyfuse3_where_the_native_session_cannot_start_and_says_why(
        mount_factory, s3):
    m = mount_factory(start=False)
    proc = _mount_refusing_native(m, "auto")
    assert proc.returncode == 0, proc.stderr + m.log_tail()
    status = m.status()
    m.pid = status["pid"]
    assert status["fuse_session"] == "pyfuse3"
    assert status["passthrough"] is False and status["passthrough_reason"]
    (m.path / "f.txt").write_bytes(b"through pyfuse3")
    assert (m.path / "f.txt").read_bytes() == b"through pyfuse3"
    assert m.flush().returncode == 0
    assert s3.get("f.txt")[1] == b"through pyfuse3"
    why = [line for line in m.log_file.read_text().splitlines()
           if "native session cannot start" in line]
    assert len(why) == 1 and why[0].endswith(
        f"FUSE session: pyfuse3, as the native session cannot start: {WHY}")
    assert m.unmount().returncode == 0


def test_native_asked_for_where_it_cannot_start_fails_the_mount_with_the_reason(
        mount_factory):
    m = mount_factory(start=False)
    proc = _mount_refusing_native(m, "native")
    assert proc.returncode == 1
    assert f"native FUSE session: {WHY}" in proc.stderr
    assert "Traceback" not in proc.stderr

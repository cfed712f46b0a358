"""Every command's --timeout bounds it whatever the daemon does: a stopped daemon (SIGSTOP)
answers neither the control socket nor the kernel, and the command still returns in time
with a message that says the daemon does not answer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.mounting import cli
from tests.reliability import Row

GRACE = 3.0  # seconds a command may take beyond its --timeout (start-up, the message)


@pytest.fixture
def stopped(mount) -> Iterator:
    (mount.path / "f").write_bytes(b"x")
    os.kill(mount.pid, signal.SIGSTOP)
    try:
        yield mount
    finally:
        os.kill(mount.pid, signal.SIGCONT)


@pytest.mark.parametrize("command", [
    ("status", "--timeout", "3", "{mp}"),
    ("flush", "--timeout", "3", "{mp}"),
    ("flush", "--timeout", "3", "{mp}", "f"),
    ("warmup", "--timeout", "3", "{mp}"),
    ("commit", "--timeout", "3", "{mp}", "sub"),
    ("unmount", "--timeout", "3", "{mp}"),
])
def test_a_timeout_holds_while_the_daemon_is_stopped(stopped, command, reliability):
    args = [a.format(mp=stopped.path) for a in command]
    began = time.monotonic()
    proc = cli(*args, timeout=60)
    elapsed = time.monotonic() - began
    shown = " ".join(a if a != str(stopped.path) else "MOUNT" for a in args)
    reliability(Row(
        scenario=f"stopped daemon: `{shown}`", injects="SIGSTOP of the daemon",
        acknowledged=1, lost=0, corrupt=0, seconds=round(elapsed, 1),
        notes=f"exit {proc.returncode}: "
              f"'{proc.stderr.strip().replace(str(stopped.path), 'MOUNT')}'"))
    assert elapsed < 3 + GRACE, (elapsed, proc.stderr)
    assert proc.returncode != 0
    assert "does not answer" in proc.stderr, proc.stderr


def test_the_python_api_timeout_holds_while_the_daemon_is_stopped(stopped):
    """lakefs_mount.status / flush find the mount from mountinfo: no stat in the mount,
    which would wait in the kernel for the stopped daemon before the timeout starts."""
    script = ("import sys, lakefs_mount\n"
              "try:\n"
              "    getattr(lakefs_mount, sys.argv[1])(sys.argv[2], timeout=3)\n"
              "except lakefs_mount.LakefsMountError as exc:\n"
              "    sys.exit(f'error: {exc}')\n")
    for call, path in (("status", stopped.path), ("flush", stopped.path / "sub" / "f")):
        began = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", script, call, str(path)],
                              capture_output=True, text=True, timeout=60)
        assert time.monotonic() - began < 3 + GRACE, (call, proc.stderr)
        assert proc.returncode != 0 and "does not answer" in proc.stderr, proc.stderr

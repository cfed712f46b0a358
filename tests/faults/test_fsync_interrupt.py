"""`--fsync remote` in the native session: an fsync waiting for its commit while S3 holds
every request (fault proxy `hang`) returns EINTR when the process gets a signal, and a
killed process dies at once instead of waiting in the kernel (D state) for S3. The commit
goes on without the caller: once S3 answers again the bytes land in S3 whole."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import pytest

from tests.faults.test_interrupt import ALARM, PROMPTLY, dies_at_once_when_killed

MiB = 1024 * 1024
pytestmark = pytest.mark.parametrize("fuse_session", ["native"], indirect=True)

# Writes its file while S3 answers, then (told to) fsyncs it with an alarm set to ring
# after 1 s (or, with "kill", waits in fsync to be killed).
WRITER = ALARM + """
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.write(fd, sys.stdin.buffer.read(int(sys.argv[2])))
print("written", flush=True)
sys.stdin.readline()
if sys.argv[3] == "alarm":
    signal.setitimer(signal.ITIMER_REAL, 1.0)
started = time.monotonic()
print("fsyncing", flush=True)
try:
    os.fsync(fd)
    print("synced", flush=True)
except Alarm:
    print(f"interrupted after {time.monotonic() - started:.2f}", flush=True)
"""


def _writer(path: str, data: bytes, how: str) -> subprocess.Popen:
    """A writer that has written `data` and waits to be told to fsync."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, path, str(len(data)), how],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(data)
    proc.stdin.flush()
    assert proc.stdout.readline() == b"written\n"
    return proc


def _fsync_now(proc: subprocess.Popen) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == b"fsyncing\n"


def test_a_remote_fsync_held_by_s3_returns_eintr_on_a_signal_and_the_commit_goes_on(
        mount_factory, s3, fault_proxy):
    m = mount_factory("--fsync", "remote", endpoint_url=fault_proxy.endpoint_url)
    alarmed, killed = random.randbytes(3 * MiB + 7), random.randbytes(MiB)
    first = _writer(str(m.path / "alarmed.bin"), alarmed, "alarm")
    second = _writer(str(m.path / "killed.bin"), killed, "kill")
    fault_proxy.hang = True
    try:
        _fsync_now(first)
        out, _ = first.communicate(timeout=1.0 + PROMPTLY)
        assert out.decode().startswith("interrupted after "), out  # EINTR, not "synced"

        _fsync_now(second)
        time.sleep(1.0)  # its fsync waits on the held commit
        dies_at_once_when_killed(second)
        assert s3.head("alarmed.bin") is None and s3.head("killed.bin") is None
    finally:
        fault_proxy.hang = False
        for proc in (first, second):
            proc.kill()
            proc.wait(timeout=120)
    assert "interrupt of request" in m.log_tail(400)
    # nobody waits for the commits any more; they still land, and the daemon serves on
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and s3.head("killed.bin") is None:
        time.sleep(0.2)
    assert m.flush().returncode == 0
    assert s3.get("alarmed.bin")[1] == alarmed and s3.get("killed.bin")[1] == killed
    assert (m.path / "alarmed.bin").read_bytes() == alarmed
    assert m.status()["files_pending"] == 0
    assert os.stat(m.path / "killed.bin").st_size == len(killed)

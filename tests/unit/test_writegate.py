"""The write gate on a plain file: fanotify pre-content events hold another process's
writes while the gate admits nothing, a quiet mark costs no event at all (also after the
file changed), and closing the gate lets every held write go. Needs root (fanotify's
pre-content class wants CAP_SYS_ADMIN), as passthrough itself does."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lakefs_mount.cache.writegate import WriteGate

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="fanotify pre-content needs root")

MiB = 1024 * 1024


def _writer(path: Path, writes: int) -> subprocess.Popen:
    """Another process (the gate answers its own at once) writing `writes` MiB."""
    code = (f"import os\nfd = os.open({str(path)!r}, os.O_WRONLY)\n"
            f"for i in range({writes}):\n    os.pwrite(fd, b'x' * {MiB}, i * {MiB})\n")
    return subprocess.Popen([sys.executable, "-c", code])


@pytest.fixture
def gate():
    g = WriteGate()
    g.open()
    try:
        yield g
    finally:
        g.close()


def test_a_quiet_mark_reports_no_write_also_after_the_file_changed(gate, tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"")
    gate.watch(path, loud=False)
    gate.admit(0)  # would hold every reported access
    assert _writer(path, 16).wait(10) == 0
    assert gate.reported == 0 and gate.holds == 0
    gate.speak(path, loud=True)  # the same file, opened again: reported now
    gate.admit(None)
    assert _writer(path, 4).wait(10) == 0
    assert gate.reported == 4


def test_writes_past_what_was_admitted_wait_until_more_is(gate, tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"")
    gate.watch(path, loud=True)
    gate.admit(2 * MiB)
    proc = _writer(path, 8)
    time.sleep(1.0)
    assert proc.poll() is None and gate.holds == 1 and os.path.getsize(path) == 2 * MiB
    gate.admit(None)
    assert proc.wait(10) == 0 and os.path.getsize(path) == 8 * MiB


def test_closing_the_gate_lets_a_held_write_go(tmp_path):
    gate = WriteGate()
    gate.open()
    path = tmp_path / "f"
    path.write_bytes(b"")
    gate.watch(path, loud=True)
    gate.admit(0)
    proc = _writer(path, 2)
    time.sleep(0.5)
    assert proc.poll() is None
    gate.close()
    assert proc.wait(10) == 0 and os.path.getsize(path) == 2 * MiB

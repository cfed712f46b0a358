"""The systemd unit: `systemd-analyze verify` accepts it, and its ExecStart / ExecStop
commands behave as `Type=notify` promises: READY=1 on $NOTIFY_SOCKET only once the mount
is usable, STOPPING=1 at unmount, every byte in S3 when the main process has exited."""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from lakefs_mount.ops import sdnotify
from lakefs_mount.ops.mountpoint import is_mounted
from tests.mounting import CLI
from tests.ops.test_mountpoint import needs_fuse, needs_root

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "packaging" / "lakefs-mount@.service"
INSTALLED_CLI = "/usr/local/bin/lakefs-mount"
READY_TIMEOUT = 120.0


def unit_settings(text: str) -> dict[str, str]:
    """Key -> value of the unit's active lines (comments and sections dropped)."""
    lines = [line for line in text.splitlines() if "=" in line and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


@pytest.fixture
def notify_socket(tmp_path) -> Iterator[socket.socket]:
    """The datagram socket systemd would listen on for this service's notifications."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(READY_TIMEOUT)
    try:
        yield sock
    finally:
        sock.close()


def receive(sock: socket.socket) -> dict[str, str]:
    return dict(line.split("=", 1) for line in sock.recv(4096).decode().splitlines())


def test_notify_sends_key_value_lines_to_a_path_socket(notify_socket, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", notify_socket.getsockname())
    assert sdnotify.notify(READY=1, STATUS="mounted at /mnt/x")
    assert notify_socket.recv(4096) == b"READY=1\nSTATUS=mounted at /mnt/x\n"


def test_notify_speaks_to_an_abstract_socket(monkeypatch):
    name = f"lakefs-mount-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.notify(STOPPING=1)
        assert sock.recv(4096) == b"STOPPING=1\n"


def test_notify_outside_systemd_or_to_nobody_does_nothing_and_never_raises(tmp_path,
                                                                         monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not sdnotify.notify(READY=1)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert not sdnotify.notify(READY=1)
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")
    assert not sdnotify.notify(READY=1)


def test_unit_is_type_notify_and_stops_through_a_flushing_unmount():
    settings = unit_settings(UNIT.read_text())
    assert settings["Type"] == "notify" and settings["NotifyAccess"] == "main"
    assert " mount --foreground " in settings["ExecStart"]
    assert settings["ExecStop"].startswith(f"{INSTALLED_CLI} unmount --timeout ")
    assert "--no-flush" not in settings["ExecStop"]
    assert settings["Restart"] == "on-failure"


@pytest.mark.parametrize("credential", [False, True], ids=["env-file", "load-credential"])
@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze missing (apt-get install systemd)")
def test_systemd_analyze_verify_accepts_the_unit(tmp_path, credential):
    """Verified as an instance, with this environment's command in place of the installed
    one (verify checks that the command exists); with LoadCredential= uncommented too."""
    text = UNIT.read_text().replace(INSTALLED_CLI, CLI)
    if credential:
        text = text.replace("#LoadCredential=", "LoadCredential=").replace(
            "#Environment=AWS_SHARED", "Environment=AWS_SHARED")
        assert "\nLoadCredential=aws:" in text
    unit = tmp_path / "lakefs-mount@mnt-ckpt.service"
    unit.write_text(text)
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout + proc.stderr == "", proc.stdout + proc.stderr


def _unit_command(key: str, m) -> list[str]:
    """The unit's ExecStart / ExecStop as systemd would run it for mount `m`."""
    line = unit_settings(UNIT.read_text())[key]
    options = (f"--endpoint-url {m.endpoint_url} --cache-dir {m.cache_dir} "
               f"--log-file {m.log_file}")
    line = (line.replace(INSTALLED_CLI, CLI).replace("%f", str(m.path))
            .replace("$LAKEFS_MOUNT_SOURCE", m.source)
            .replace("$LAKEFS_MOUNT_OPTIONS", options))
    return shlex.split(line)


@needs_root
@needs_fuse
def test_exec_start_notifies_ready_once_mounted_and_exec_stop_leaves_all_in_s3(
        mount_factory, notify_socket, s3):
    m = mount_factory(start=False)
    env = {**os.environ, "NOTIFY_SOCKET": notify_socket.getsockname()}
    main = subprocess.Popen(_unit_command("ExecStart", m), env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    m.pid = main.pid
    try:
        ready = receive(notify_socket)
        assert ready["READY"] == "1", f"{ready}\n{m.log_tail()}"
        assert is_mounted(m.path)  # usable when READY=1 arrives, not later
        assert ready["STATUS"] == f"mounted {m.source}/ at {m.path}"
        assert m.status()["pid"] == main.pid  # the main process is the daemon
        data = os.urandom(20 * 1024 * 1024)
        (m.path / "model.bin").write_bytes(data)
        stop = subprocess.run(_unit_command("ExecStop", m), capture_output=True, text=True,
                              timeout=300)
        assert stop.returncode == 0, stop.stderr
        assert receive(notify_socket)["STOPPING"] == "1"
        assert main.wait(timeout=60) == 0, m.log_tail()
        m.pid = None
        assert not is_mounted(m.path)
        assert s3.get("model.bin")[1] == data
    finally:
        if main.poll() is None:
            main.kill()
        main.wait()
        m.pid = None

"""Control socket: the trio server with a fake handler, driven by the synchronous client."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from lakefs_mount.ops import controlclient
from lakefs_mount.ops.control import FlushFailed, serve_control
from lakefs_mount.ops.controlclient import (
    ControlError,
    ControlTimeout,
    DaemonNotRunning,
    call_socket,
)


class FakeHandler:
    def __init__(self) -> None:
        self.flushed: list[str | None] = []
        self.unmount_calls: list[bool] = []

    async def status(self) -> dict:
        return {"dirty_bytes": 123, "bucket": "b", "io_engine": "threads"}

    async def flush(self, path, progress) -> dict:
        if path == "fail":
            raise FlushFailed("upload of fail/x failed: AccessDenied")
        if path == "crash":
            raise RuntimeError("handler blew up")
        if path == "slow":
            await progress({"dirty_bytes": 999, "files": 1})
            await trio.sleep(30)
        self.flushed.append(path)
        for left in (300, 200, 100):
            await progress({"dirty_bytes": left, "files": 3})
        return {"flushed_bytes": 600}

    async def prepare_unmount(self, flush: bool, progress) -> dict:
        self.unmount_calls.append(flush)
        if flush:
            await progress({"dirty_bytes": 7, "files": 1, "waiting_on": "PutObject k"})
        return {"pid": os.getpid()}


class ServerThread:
    """Runs serve_control in its own trio loop on a thread; stop() cancels it."""

    def __init__(self, path: Path, handler: FakeHandler) -> None:
        self.path, self.handler = path, handler
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self.token = trio.lowlevel.current_trio_token()
            with trio.CancelScope() as scope:
                self.scope = scope
                async with trio.open_nursery() as nursery:
                    await nursery.start(serve_control, self.path, self.handler)
                    self._ready.set()
        try:
            trio.run(main)
        except BaseException as exc:  # reported to the test
            self.error = exc
        finally:
            self._ready.set()

    def start(self) -> ServerThread:
        self._thread.start()
        assert self._ready.wait(10)
        if self.error:
            raise self.error
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            trio.from_thread.run_sync(self.scope.cancel, trio_token=self.token)
            self._thread.join(10)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="lm-ctl-"))
    try:
        yield d / "run"
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def server(sock_dir) -> Iterator[ServerThread]:
    srv = ServerThread(sock_dir / "m.sock", FakeHandler()).start()
    try:
        yield srv
    finally:
        srv.stop()


def test_status_roundtrip(server):
    result = call_socket(server.path, {"op": "status"}, timeout=5)
    assert result == {"dirty_bytes": 123, "bucket": "b", "io_engine": "threads"}


def test_flush_streams_progress(server):
    seen: list[dict] = []
    result = call_socket(server.path, {"op": "flush", "path": "step_1"}, timeout=5,
                         on_progress=seen.append)
    assert result == {"flushed_bytes": 600}
    assert [p["dirty_bytes"] for p in seen] == [300, 200, 100]
    assert server.handler.flushed == ["step_1"]


def test_flush_whole_mount_and_unmount(server):
    call_socket(server.path, {"op": "flush", "path": None}, timeout=5)
    assert server.handler.flushed == [None]
    assert call_socket(server.path, {"op": "unmount", "flush": False}, timeout=5) == {
        "pid": os.getpid()}
    seen: list[dict] = []  # an unmount's flush says what it waits for, as a flush does
    assert call_socket(server.path, {"op": "unmount", "flush": True}, timeout=5,
                       on_progress=seen.append) == {"pid": os.getpid()}
    assert seen == [{"dirty_bytes": 7, "files": 1, "waiting_on": "PutObject k"}]
    assert server.handler.unmount_calls == [False, True]


def test_handler_errors_become_control_errors(server):
    with pytest.raises(ControlError, match="upload of fail/x failed: AccessDenied"):
        call_socket(server.path, {"op": "flush", "path": "fail"}, timeout=5)
    with pytest.raises(ControlError, match="handler blew up"):
        call_socket(server.path, {"op": "flush", "path": "crash"}, timeout=5)
    with pytest.raises(ControlError, match="unknown op"):
        call_socket(server.path, {"op": "frobnicate"}, timeout=5)
    # the server survived all of that
    assert call_socket(server.path, {"op": "status"}, timeout=5)["bucket"] == "b"


def test_garbage_request_does_not_kill_server(server):
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(server.path))
        s.sendall(b"this is not json\n")
        assert b"bad request" in s.recv(4096)
    with socket.socket(socket.AF_UNIX) as s:  # connect and hang up at once
        s.connect(str(server.path))
    assert call_socket(server.path, {"op": "status"}, timeout=5)["dirty_bytes"] == 123


def test_running_out_of_descriptors_does_not_kill_the_server(server, caplog):
    """accept() failing with EMFILE is waited out: the daemon must keep serving its mount
    (it crashed, leaving a dead mount, when a huge training set used up its descriptors)."""
    caplog.set_level(logging.WARNING, logger="lakefs_mount.ops.control")
    client = socket.socket(socket.AF_UNIX)  # made while descriptors are still free
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    hogs: list[int] = []
    try:
        highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 8, limits[1]))
        with contextlib.suppress(OSError):
            while True:
                hogs.append(os.open(os.devnull, os.O_RDONLY))
        client.connect(str(server.path))  # queued in the backlog; accept() gets EMFILE
        deadline = time.monotonic() + 5
        while "accept failed" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for fd in hogs:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
    assert "Too many open files" in caplog.text
    with client:
        client.settimeout(5)
        client.sendall(b'{"op": "status"}\n')
        assert b"dirty_bytes" in client.recv(4096)
    assert server.error is None
    assert call_socket(server.path, {"op": "status"}, timeout=5)["bucket"] == "b"


def test_timeout_keeps_last_progress(server):
    with pytest.raises(ControlTimeout, match=r"timed out after 0.5 s") as info:
        call_socket(server.path, {"op": "flush", "path": "slow"}, timeout=0.5)
    assert info.value.last_progress == {"dirty_bytes": 999, "files": 1}
    assert call_socket(server.path, {"op": "status"}, timeout=5)["dirty_bytes"] == 123


def test_a_daemon_that_sends_nothing_is_reported_as_not_answering_within_its_bound(tmp_path):
    """A stopped daemon's socket still takes connections (the kernel's backlog) and reads
    nothing: the call ends at `answer_within`, not at its whole timeout, and says so."""
    path = tmp_path / "silent.sock"
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(str(path))
    silent.listen(4)
    try:
        began = time.monotonic()
        with pytest.raises(ControlTimeout, match="does not answer") as info:
            call_socket(path, {"op": "commit"}, timeout=30, answer_within=0.5)
        assert time.monotonic() - began < 5
        assert info.value.answered is False
    finally:
        silent.close()


def test_socket_and_dir_modes(server):
    assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(server.path.parent).st_mode) == 0o700


def test_socket_removed_on_cancel(sock_dir):
    srv = ServerThread(sock_dir / "m.sock", FakeHandler()).start()
    assert srv.path.exists()
    srv.stop()
    assert not srv.path.exists()


def test_missing_socket_is_a_clear_error(sock_dir, tmp_path, monkeypatch):
    with pytest.raises(DaemonNotRunning, match=r"no lakefs-mount daemon serves"):
        call_socket(sock_dir / "nothing.sock", {"op": "status"}, timeout=5)
    monkeypatch.setattr(controlclient, "control_socket_path", lambda mp: sock_dir / "none.sock")
    with pytest.raises(ControlError,
                       match=rf"no lakefs-mount daemon serves {tmp_path} \(is it mounted\?\)"):
        controlclient.call(tmp_path, {"op": "status"}, timeout=5)


def test_stale_socket_is_replaced(sock_dir):
    sock_dir.mkdir(mode=0o700)
    path = sock_dir / "m.sock"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(path))
    dead.close()  # the file stays, nobody listens: a crashed daemon's leftover
    srv = ServerThread(path, FakeHandler()).start()
    try:
        assert call_socket(path, {"op": "status"}, timeout=5)["bucket"] == "b"
    finally:
        srv.stop()


def test_second_server_refuses_live_socket(server):
    async def second() -> None:
        await serve_control(server.path, FakeHandler())

    with pytest.raises(ControlError, match=r"another lakefs-mount daemon \(pid \d+\)"):
        trio.run(second)
    # the first server's socket was left alone
    assert call_socket(server.path, {"op": "status"}, timeout=5)["bucket"] == "b"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_other_uid_is_rejected(server):
    # Open up the modes so that only the SO_PEERCRED check stands in the way.
    os.chmod(server.path.parent.parent, 0o755)
    os.chmod(server.path.parent, 0o755)
    os.chmod(server.path, 0o777)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: become nobody, ask for status, report the raw answer
        try:
            os.setgid(65534)
            os.setuid(65534)
            call_socket(server.path, {"op": "status"}, timeout=5)
            os.write(write_fd, b"no error")
        except BaseException as exc:
            os.write(write_fd, repr(exc).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    answer = b""
    while chunk := os.read(read_fd, 4096):
        answer += chunk
    os.close(read_fd)
    os.waitpid(pid, 0)
    assert b"ControlError('permission denied: this mount belongs to uid 0')" == answer

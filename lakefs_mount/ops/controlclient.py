"""The client side of the control socket (protocol: control.py): what the CLI and the
Python API need to talk to a mount daemon. It imports nothing of the daemon (trio, the
cache, SQLite), so that `lakefs-mount flush` or `status` starts in a fraction of the time
and adds no second of its own to a checkpoint's time to durable."""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from lakefs_mount.config import control_socket_path

MAX_LINE = 1024 * 1024  # a request or response line longer than this is a protocol error


class ControlError(Exception):
    """A control call failed; `str()` is a message fit for the user."""


class DaemonNotRunning(ControlError):
    """Nobody listens on the control socket of that mount point."""


NO_ANSWER = "does not answer (stopped, or too busy to read its control socket)"


class ControlTimeout(ControlError):
    """The call did not finish in time; `last_progress` is the last progress seen, and
    `answered` whether the daemon sent anything at all."""

    def __init__(self, message: str, last_progress: dict | None = None,
                 answered: bool = True) -> None:
        super().__init__(message)
        self.last_progress = last_progress
        self.answered = answered


def call(mountpoint: Path, request: dict, *, timeout: float | None,
         on_progress: Callable[[dict], None] | None = None,
         answer_within: float | None = None) -> dict:
    """Send one request to the daemon serving `mountpoint`; return its `result`.

    Blocks until the final line (or `timeout` seconds in total, None = forever; a daemon
    that sent nothing within `answer_within` seconds counts as not answering). Raises
    DaemonNotRunning, ControlTimeout or ControlError with a message for the user.
    """
    socket_path = control_socket_path(Path(mountpoint))
    if os.geteuid() == 0 and not socket_path.exists():  # root, at another user's mount?
        from lakefs_mount.ops.othersocket import socket_of_owner

        socket_path = socket_of_owner(Path(mountpoint)) or socket_path
    return call_socket(socket_path, request, timeout=timeout, on_progress=on_progress,
                       target=str(mountpoint), answer_within=answer_within)


def call_socket(socket_path: Path, request: dict, *, timeout: float | None,
                on_progress: Callable[[dict], None] | None = None,
                target: str | None = None, answer_within: float | None = None) -> dict:
    """`call` on an explicit socket path (what tests and tools use)."""
    target = target or str(socket_path)
    started = time.monotonic()
    deadline = None if timeout is None else started + timeout
    if answer_within is not None and (deadline is None or started + answer_within < deadline):
        first_deadline: float | None = started + answer_within
    else:
        first_deadline = None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    last_progress: dict | None = None
    heard = False  # any byte from the daemon: it reads its socket and answers

    def remaining() -> float | None:
        until = first_deadline if first_deadline is not None and not heard else deadline
        if until is None:
            return None
        left = until - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return left

    try:
        try:
            sock.settimeout(remaining())
            sock.connect(str(socket_path))
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError) as exc:
            raise DaemonNotRunning(f"no lakefs-mount daemon serves {target} "
                                   f"(is it mounted?)") from exc
        except PermissionError as exc:
            raise ControlError(f"permission denied on the control socket {socket_path} of "
                               f"{target}: the mount belongs to another user") from exc
        try:
            sock.sendall(json.dumps(request).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon refused before reading (e.g. wrong uid): its answer is queued
        buf = bytearray()
        while True:
            while b"\n" not in buf:
                sock.settimeout(remaining())
                chunk = sock.recv(65536)
                if not chunk:
                    raise ControlError(f"the lakefs-mount daemon serving {target} closed the "
                                       f"connection without an answer (did it crash? "
                                       f"see its log)")
                buf += chunk
                heard = True
                if len(buf) > MAX_LINE:
                    raise ControlError("the daemon sent an over-long reply line")
            line, _, rest = bytes(buf).partition(b"\n")
            buf = bytearray(rest)
            try:
                message = json.loads(line)
            except ValueError as exc:
                raise ControlError(f"garbled reply from the daemon: {line[:200]!r}") from exc
            if "progress" in message:
                last_progress = message["progress"]
                if on_progress is not None:
                    on_progress(last_progress)
                continue
            if message.get("ok"):
                return message.get("result") or {}
            raise ControlError(str(message.get("error") or "the daemon reported an error"))
    except TimeoutError as exc:
        waited = time.monotonic() - started
        if not heard:  # (not even the connection, where the daemon's backlog is full)
            raise ControlTimeout(f"timed out after {waited:.0f} s: the lakefs-mount daemon "
                                 f"serving {target} {NO_ANSWER}", last_progress,
                                 answered=False) from exc
        raise ControlTimeout(f"timed out after {timeout or 0:g} s", last_progress) from exc
    except OSError as exc:
        if exc.errno in (errno.ECONNRESET, errno.EPIPE):
            raise ControlError(f"the lakefs-mount daemon serving {target} dropped the "
                               f"connection (did it crash? see its log)") from exc
        raise ControlError(f"control socket {socket_path}: {exc.strerror or exc}") from exc
    finally:
        sock.close()

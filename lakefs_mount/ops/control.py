"""The control socket between the `lakefs-mount` CLI and a running mount daemon.

Why a socket and not signals: `flush` and `unmount` must block until the data is in S3 and
report progress and errors; a signal can do neither.

Wire protocol (newline-delimited JSON over a Unix stream socket, one request per
connection):

    request   {"op": "status"}
              {"op": "flush", "path": "step_100" | null}     # relative to the mount root
              {"op": "unmount", "flush": true | false}
              {"op": "commit", "path": "ckpt/step_100", "expect_files": 8 | null,
               "expect": ["rank0.pt", ...], "timeout": 60.0 | null}
              {"op": "verify", "path": "ckpt/step_100"}
              {"op": "orphans", "upload": false}                # list them
              {"op": "orphans", "upload": true, "to": "lost+found" | null, "keep": false}
    response  zero or more {"progress": {...}} lines, then exactly one of
              {"ok": true, "result": {...}}    or    {"ok": false, "error": "message"}

This module is the server (in the daemon); the client is controlclient.py.

The socket lives in a 0700 directory and is itself 0600; the server also checks the
peer's uid (SO_PEERCRED) and answers other users with an error.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import trio

from lakefs_mount.cache.flusher import FlushFailed  # a handler's flush raises it
from lakefs_mount.concurrency import first_cause
from lakefs_mount.ops.controlclient import MAX_LINE, ControlError

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = 30.0  # seconds a client may take to send its request line
# accept() failures that pass (out of descriptors or memory, a client gone): the daemon
# keeps serving its mount and tries again shortly instead of dying with it mounted.
TRANSIENT_ACCEPT_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM,
                           errno.ECONNABORTED}
ACCEPT_RETRY = 0.1  # seconds


class ControlHandler(Protocol):
    """What the daemon implements; each method's dict result is sent back as `result`."""

    async def status(self) -> dict: ...

    async def flush(self, path: str | None,
                    progress: Callable[[dict], Awaitable[None]]) -> dict: ...

    async def warmup(self, path: str | None,
                     progress: Callable[[dict], Awaitable[None]]) -> dict: ...

    async def prepare_unmount(self, flush: bool,
                              progress: Callable[[dict], Awaitable[None]]) -> dict: ...

    async def commit(self, request: dict,
                     progress: Callable[[dict], Awaitable[None]]) -> dict: ...

    async def verify(self, path: str) -> dict: ...

    async def orphans(self, upload: bool, to: str | None, keep: bool,
                      progress: Callable[[dict], Awaitable[None]]) -> dict: ...


# ---------------------------------------------------------------------------- server


def _peer_cred(sock: Any) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def _prepare_dir(directory: Path) -> None:
    """Create the socket's directory 0700; refuse one owned by somebody else."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = directory.stat()
    if st.st_uid != os.geteuid():
        raise ControlError(f"control socket directory {directory} belongs to uid "
                           f"{st.st_uid}, not to us (uid {os.geteuid()}); refusing to use it")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(directory, 0o700)


async def _remove_stale(socket_path: Path) -> None:
    """Unlink a leftover socket of a dead daemon; fail if a live daemon answers on it."""
    try:
        st = socket_path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ControlError(f"{socket_path} exists and is not a socket; remove it by hand")
    probe = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        pid: int | str = "?"  # a connect that hangs (full backlog) also means alive
        with trio.move_on_after(5):
            await probe.connect(str(socket_path))
            pid = _peer_cred(probe)[0]
        raise ControlError(f"another lakefs-mount daemon (pid {pid}) already serves "
                           f"this mount point (control socket {socket_path})")
    except (ConnectionRefusedError, FileNotFoundError):
        pass  # nobody listens: the file is a leftover of a dead daemon
    finally:
        probe.close()
    log.info("removing stale control socket %s", socket_path)
    socket_path.unlink(missing_ok=True)


async def serve_control(socket_path: Path, handler: ControlHandler, *,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve control requests until cancelled; the socket file is removed on the way out.

    `task_status.started()` is called once the socket accepts connections, so
    `await nursery.start(serve_control, ...)` returns only when the CLI can connect.
    """
    socket_path = Path(socket_path)
    _prepare_dir(socket_path.parent)
    await _remove_stale(socket_path)
    listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        await listener.bind(str(socket_path))
        bound = os.stat(socket_path)
        try:
            os.chmod(socket_path, 0o600)
            listener.listen(64)
            log.info("control socket listening at %s", socket_path)
            task_status.started()
            async with trio.open_nursery() as nursery:
                while True:
                    try:
                        conn, _ = await listener.accept()
                    except OSError as exc:
                        if exc.errno not in TRANSIENT_ACCEPT_ERRORS:
                            raise
                        log.warning("control socket: accept failed (%s); retrying", exc)
                        await trio.sleep(ACCEPT_RETRY)
                        continue
                    nursery.start_soon(_serve_connection, conn, handler)
        finally:
            _unlink_if_ours(socket_path, bound)
    finally:
        listener.close()


def _unlink_if_ours(socket_path: Path, bound: os.stat_result) -> None:
    """Unlink the socket unless another daemon has replaced it in the meantime."""
    try:
        st = os.stat(socket_path)
        if (st.st_dev, st.st_ino) == (bound.st_dev, bound.st_ino):
            os.unlink(socket_path)
    except FileNotFoundError:
        pass


async def _send(stream: trio.SocketStream, message: dict) -> None:
    await stream.send_all(json.dumps(message, default=str).encode() + b"\n")


async def _read_line(stream: trio.SocketStream) -> bytes:
    buf = bytearray()
    while b"\n" not in buf:
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        buf += chunk
        if len(buf) > MAX_LINE:
            raise ValueError("request line too long")
    return bytes(buf.split(b"\n", 1)[0])


async def _serve_connection(conn: trio.socket.SocketType, handler: ControlHandler) -> None:
    """Answer one request; any failure stays inside this connection."""
    stream = trio.SocketStream(conn)
    try:
        async with stream:
            pid, uid, _ = _peer_cred(conn)
            if uid not in (os.geteuid(), 0):
                log.warning("control socket: rejected pid %d of uid %d", pid, uid)
                await _send(stream, {"ok": False, "error":
                                     f"permission denied: this mount belongs to uid "
                                     f"{os.geteuid()}"})
                return
            with trio.fail_after(REQUEST_TIMEOUT):
                line = await _read_line(stream)
            try:
                request = json.loads(line)
                if not isinstance(request, dict):
                    raise ValueError("request is not a JSON object")
            except ValueError as exc:
                await _send(stream, {"ok": False, "error": f"bad request: {exc}"})
                return
            await _send(stream, await _dispatch(stream, request, handler))
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError,
            ConnectionError) as exc:
        log.debug("control connection ended early: %r", exc)
    except Exception:
        log.exception("control connection failed")


async def _while_client_waits(stream: trio.SocketStream, op: str,
                              work: Awaitable[dict]) -> dict:
    """Run `work` only while the client is there: an interrupted `warmup` stops fetching
    (what was fetched stays cached), an interrupted `flush` stops waiting (the uploads
    go on, as always). The client sends nothing after its request: EOF means it left."""
    result: dict | None = None

    async def run() -> None:
        nonlocal result
        result = await work
        nursery.cancel_scope.cancel()

    async def watch() -> None:
        while await stream.receive_some(4096):
            pass
        log.info("%s: the client went away; stopped", op)
        nursery.cancel_scope.cancel()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            nursery.start_soon(watch)
    except BaseExceptionGroup as group:  # the handler's own error, as if called directly
        raise first_cause(group) from group
    if result is None:
        raise trio.ClosedResourceError(f"{op}: the client went away")
    return result


async def _dispatch(stream: trio.SocketStream, request: dict, handler: ControlHandler) -> dict:
    """Run the handler method for `request` and turn its outcome into the final line."""
    op = request.get("op")

    async def progress(info: dict) -> None:
        await _send(stream, {"progress": info})

    try:
        if op == "status":
            result = await handler.status()
        elif op in ("flush", "warmup"):
            path = request.get("path")
            if path is not None and not isinstance(path, str):
                raise ValueError(f"{op}: path must be a string or null")
            run = handler.flush if op == "flush" else handler.warmup
            result = await _while_client_waits(stream, op, run(path or None, progress))
        elif op == "orphans":
            to = request.get("to")
            if to is not None and not isinstance(to, str):
                raise ValueError("orphans: to must be a string or null")
            result = await _while_client_waits(stream, op, handler.orphans(
                bool(request.get("upload")), to, bool(request.get("keep")), progress))
        elif op == "unmount":
            result = await _while_client_waits(stream, op, handler.prepare_unmount(
                bool(request.get("flush", True)), progress))
        elif op == "commit":  # (publish/publisher.py checks the request's fields)
            result = await _while_client_waits(stream, op, handler.commit(request, progress))
        elif op == "verify":
            result = await _while_client_waits(stream, op,
                                               handler.verify(str(request.get("path") or "")))
        else:
            raise ValueError(f"unknown op {op!r}")
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        raise  # the client went away while we sent progress
    except FlushFailed as exc:
        return {"ok": False, "error": str(exc) or "flush failed"}
    except Exception as exc:
        if not isinstance(exc, ValueError):
            log.exception("control op %r failed", op)
        return {"ok": False, "error": str(exc) or type(exc).__name__}
    return {"ok": True, "result": result if result is not None else {}}

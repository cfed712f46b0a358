"""A network link between the mount and its S3 server, on loopback: every request pays a
round trip, every direction a bandwidth.

This kernel has no netem, and tbf would change the machine's loopback. So the link is a
TCP forwarder on 127.0.0.1: it holds back the first byte of each request (the first bytes
a client sends after the server spoke, and a connection's first bytes twice: TCP's own
handshake) for one round trip, and paces each direction through a token bucket that all
connections share. Bytes move by splice(2) through a pipe, never through Python buffers,
so the link itself carries more than 1 GiB/s (`python -m benchmarks.netlink` measures it)
and is not what a profile's numbers measure. TLS passes through untouched: the link sees
only bytes.

A request that follows its answer a round trip later is what a real link shows too; the
link does not reorder or lose anything (no netem either).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import socket
import threading
import time
from collections.abc import Iterator

_F_SETPIPE_SZ = 1031  # fcntl.h
_PIPE_BYTES = 1 << 20
_PACED_PIECE = 256 << 10  # bytes per token-bucket step when a bandwidth is set


class Pace:
    """One direction's bandwidth, shared by every connection: bytes leave no faster than
    `bytes_per_s` (None: unpaced)."""

    def __init__(self, bytes_per_s: float | None) -> None:
        self.bytes_per_s = bytes_per_s
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the bytes sent so far have left the link

    def take(self, size: int) -> None:
        if self.bytes_per_s is None:
            return
        with self._lock:
            self._free_at = max(self._free_at, time.monotonic()) + size / self.bytes_per_s
            until = self._free_at
        wait = until - time.monotonic()
        if wait > 0:
            time.sleep(wait)


class _Turn:
    """Whose turn it is on one connection: a client's bytes after the server spoke start
    a new request, and wait one round trip."""

    def __init__(self) -> None:
        self.server_spoke = True
        self.first = True


class Link:
    """Listens on 127.0.0.1:`port` and forwards to 127.0.0.1:`target_port` with `rtt_s` per
    request and `bytes_per_s` per direction. `close()` ends it and every connection."""

    def __init__(self, target_port: int, *, rtt_s: float = 0.0,
                 bytes_per_s: float | None = None) -> None:
        self.target = ("127.0.0.1", target_port)
        self.rtt_s = rtt_s
        self.up = Pace(bytes_per_s)  # client to server
        self.down = Pace(bytes_per_s)
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.port: int = self._listener.getsockname()[1]
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="netlink-accept", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.target, timeout=10)
        except OSError:
            client.close()
            return
        server.settimeout(None)
        for sock in (client, server):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            if self._closed:
                client.close()
                server.close()
                return
            self._sockets |= {client, server}
        turn = _Turn()
        ends = threading.Barrier(2, action=lambda: self._forget(client, server))
        threading.Thread(target=self._pump, args=(client, server, self.up, turn, True, ends),
                         daemon=True).start()
        self._pump(server, client, self.down, turn, False, ends)

    def _forget(self, *sockets: socket.socket) -> None:
        with self._lock:
            self._sockets.difference_update(sockets)
        for sock in sockets:
            sock.close()

    def _pump(self, src: socket.socket, dst: socket.socket, pace: Pace, turn: _Turn,
              upstream: bool, ends: threading.Barrier) -> None:
        """Move `src`'s bytes to `dst` until `src` ends; then end `dst`'s direction."""
        read_end, write_end = os.pipe()
        with contextlib.suppress(OSError):
            fcntl.fcntl(write_end, _F_SETPIPE_SZ, _PIPE_BYTES)
        piece = _PACED_PIECE if pace.bytes_per_s is not None else _PIPE_BYTES
        try:
            while True:
                size = os.splice(src.fileno(), write_end, piece)
                if size == 0:
                    break
                if upstream:
                    if turn.server_spoke and self.rtt_s:
                        time.sleep(self.rtt_s * (2 if turn.first else 1))
                    turn.server_spoke = turn.first = False
                else:
                    turn.server_spoke = True
                pace.take(size)
                while size:
                    size -= os.splice(read_end, dst.fileno(), size)
        except OSError:
            pass
        finally:
            os.close(read_end)
            os.close(write_end)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
            with contextlib.suppress(threading.BrokenBarrierError):
                ends.wait(timeout=60)


@contextlib.contextmanager
def _sink() -> Iterator[int]:
    """A server on 127.0.0.1 that reads and drops everything (for the measurement)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def drain() -> None:
        conn, _ = listener.accept()
        with conn:
            while conn.recv_into(buffer):
                pass

    buffer = bytearray(1 << 20)
    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


def _send(port: int, total: int) -> float:
    """Bytes per second one connection to `port` takes until its peer ends it."""
    block = memoryview(bytearray(1 << 20))
    with socket.create_connection(("127.0.0.1", port)) as client:
        start = time.perf_counter()
        for _ in range(total // len(block)):
            client.sendall(block)
        client.shutdown(socket.SHUT_WR)
        client.recv(1)  # ended once the sink has it all
        return total / (time.perf_counter() - start)


def measure(total: int = 4 << 30) -> tuple[float, float]:
    """Bytes per second from one client to a sink: through the unpaced link, and direct."""
    with _sink() as port, Link(port) as link:
        linked = _send(link.port, total)
    with _sink() as port:
        return linked, _send(port, total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0, help="how much to send")
    args = parser.parse_args()
    linked, direct = measure(int(args.gib * 2**30))
    print(f"one connection on loopback: {linked / 2**30:.2f} GiB/s through the unpaced link, "
          f"{direct / 2**30:.2f} GiB/s direct")


if __name__ == "__main__":
    main()

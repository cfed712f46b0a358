"""A TLS front for the test S3 server: the fault proxy, serving https://127.0.0.1:<port>
with the certificate in tests/tls (self-signed for IP 127.0.0.1).

Each connection is served by one thread that moves bytes both ways (an SSL socket must
not be read and written from two threads at once), so the faults that act in the
fault proxy's pumps (delay, bandwidth, truncation) do not apply here; `fail` does.
"""

from __future__ import annotations

import selectors
import socket
import ssl
from pathlib import Path

from tests.faultproxy import FaultProxy

CERT = Path(__file__).parent / "tls" / "cert.pem"
KEY = Path(__file__).parent / "tls" / "key.pem"


class TlsProxy(FaultProxy):
    def __init__(self, target_port: int) -> None:
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(CERT, KEY)
        super().__init__("127.0.0.1", target_port)

    @property
    def endpoint_url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def _forward(self, client: socket.socket) -> None:
        self._start(self._serve, client)

    def _serve(self, raw: socket.socket) -> None:
        try:
            raw.settimeout(5)
            client = self._context.wrap_socket(raw, server_side=True)
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:  # the client refused our certificate, or went away
            raw.close()
            return
        with self._lock:
            self._socks.update((client, upstream))
        try:
            with client, upstream, selectors.DefaultSelector() as sel:
                client.setblocking(False)
                upstream.setblocking(False)
                sel.register(client, selectors.EVENT_READ, upstream)
                sel.register(upstream, selectors.EVENT_READ, client)
                while not (self._closed or self.fail):
                    for key, _ in sel.select(timeout=0.2):
                        src: socket.socket = key.fileobj  # type: ignore[assignment]
                        try:
                            data = src.recv(65536)
                        except (ssl.SSLWantReadError, BlockingIOError):
                            continue
                        except OSError:
                            return
                        if not data:
                            return
                        while isinstance(src, ssl.SSLSocket) and src.pending():
                            data += src.recv(src.pending())  # decrypted, not yet handed out
                        dst: socket.socket = key.data
                        dst.setblocking(True)
                        try:
                            dst.sendall(data)
                        except OSError:
                            return
                        dst.setblocking(False)
        finally:
            with self._lock:
                self._socks.difference_update((client, upstream))

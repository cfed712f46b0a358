"""S3 requests on the wire: SigV4 signatures and a pool of kept-alive HTTP/1.1 connections.

Why not botocore's HTTP session: the same request costs much less CPU signed
here and sent on an `http.client` connection, and the daemon runs its GETs, HEADs, small
PUTs and listing pages under one GIL, so the difference is paid by every small file read
or written. Multipart part bodies go out in the pieces the cache reads them in
(`PiecewiseBody`) instead of botocore's 16 KiB slices of a copy. This module
knows HTTP and SigV4, nothing of botocore: `store` hands it the endpoint, the
credentials and the TLS settings it resolved.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import os
import select
import ssl
import threading
import time
from dataclasses import dataclass
from email.message import Message
from urllib.parse import quote, urlsplit

from lakefs_mount.filespan import FileSpan
from lakefs_mount.s3.objectstore import PiecewiseBody

__all__ = ["Keys", "WireError", "ConnectFailed", "CertificateRefused", "ConnectTimedOut",
           "ReadTimedOut", "ConnectionLost", "WireResponse", "WirePool", "sign",
           "canonical_query"]

UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"  # bodies are not hashed into the signature
_ALGORITHM = "AWS4-HMAC-SHA256"


@dataclass(frozen=True)
class Keys:
    """One set of credentials, as of the request being signed (they may be refreshed)."""
    access_key: str
    secret_key: str
    token: str | None = None


def canonical_query(query: dict[str, str]) -> str:
    """The query string as SigV4 signs it, and as it must then be sent."""
    return "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}"
                    for k, v in sorted(query.items()))


_signing_keys: dict[tuple[str, str, str], bytes] = {}


def _signing_key(secret: str, day: str, region: str) -> bytes:
    """The day's derived key (four HMACs); kept, as it changes once a day."""
    cached = _signing_keys.get((secret, day, region))
    if cached is None:
        cached = hmac.digest(("AWS4" + secret).encode(), day.encode(), "sha256")
        for part in (region, "s3", "aws4_request"):
            cached = hmac.digest(cached, part.encode(), "sha256")
        if len(_signing_keys) > 64:
            _signing_keys.clear()
        _signing_keys[(secret, day, region)] = cached
    return cached


def sign(method: str, host: str, path: str, query: str, headers: dict[str, str],
         keys: Keys, region: str, amz_date: str | None = None) -> dict[str, str]:
    """`headers` plus Host, the date, the payload marker (UNSIGNED-PAYLOAD unless
    `headers` give one), the token and Authorization.

    `path` is sent as given (S3 signs it without normalising or encoding it again);
    every header given is signed, names lower-cased, values with their runs of white
    space collapsed, as the SigV4 specification (and botocore) do.
    """
    amz_date = amz_date or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    signed = {name.lower(): value for name, value in headers.items()}
    signed["host"] = host
    signed["x-amz-date"] = amz_date
    payload = signed.setdefault("x-amz-content-sha256", UNSIGNED_PAYLOAD)  # (or a trailer)
    if keys.token:
        signed["x-amz-security-token"] = keys.token
    names = sorted(signed)
    canonical = "\n".join((
        method, path, query,
        "".join(f"{n}:{' '.join(signed[n].split())}\n" for n in names),
        ";".join(names), payload))
    day = amz_date[:8]
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join((_ALGORITHM, amz_date, scope,
                         hashlib.sha256(canonical.encode()).hexdigest()))
    signature = hmac.new(_signing_key(keys.secret_key, day, region), to_sign.encode(),
                         "sha256").hexdigest()
    signed["authorization"] = (f"{_ALGORITHM} Credential={keys.access_key}/{scope}, "
                               f"SignedHeaders={';'.join(names)}, Signature={signature}")
    return signed


class WireError(OSError):
    """A request that got no usable answer; the subclass says at which step."""


class ConnectFailed(WireError):
    """The TCP (or TLS) connection could not be made."""


class CertificateRefused(ConnectFailed):
    """The server's TLS certificate did not verify (unknown CA, wrong name, expired)."""


class ConnectTimedOut(WireError):
    """The connection was not made within the connect timeout."""


class ReadTimedOut(WireError):
    """The server stopped answering for longer than the read timeout."""


class ConnectionLost(WireError):
    """The connection broke, or closed, before the whole answer arrived."""


def _within(conn: http.client.HTTPConnection, deadline: float) -> None:
    """Let the connection's next socket operations wait only until `deadline`."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    if conn.sock is not None:
        conn.sock.settimeout(left)


_ZEROS = bytes(1024 * 1024)


def _send_span(conn: http.client.HTTPConnection, span: FileSpan, deadline: float) -> None:
    """The span's bytes from its file by sendfile: the kernel hands the page cache's
    pages to the socket, so the daemon neither reads nor copies them. Past the file's
    end (truncated since its CRC was taken), zeros, as `read_pieces` gives them: the
    request keeps its length and S3 refuses the CRC."""
    assert conn.sock is not None
    fileno = conn.sock.fileno()
    offset, left = span.offset, span.length
    while left:
        try:
            sent = os.sendfile(fileno, span.fd, offset, left)
        except BlockingIOError:  # (a socket with a timeout is non-blocking underneath)
            wait = deadline - time.monotonic()
            writable = select.poll()
            writable.register(fileno, select.POLLOUT)
            if wait <= 0 or not writable.poll(wait * 1000):
                raise TimeoutError from None
            continue
        if not sent:
            break  # the end of the file
        offset += sent
        left -= sent
    while left:
        _within(conn, deadline)
        n = min(left, len(_ZEROS))
        conn.send(memoryview(_ZEROS)[:n])
        left -= n


class WireResponse:
    """Status, headers and a body read in pieces; `release_conn` gives the connection
    back to the pool once the body was read to its end, `close` drops it. Reading the
    body ends at the request's deadline, extended by `per_byte` for each byte of a body
    whose length the headers give."""

    def __init__(self, pool: WirePool, conn: http.client.HTTPConnection,
                 response: http.client.HTTPResponse, url: str, deadline: float,
                 seconds: float, per_byte: float = 0.0) -> None:
        self._pool = pool
        self._conn: http.client.HTTPConnection | None = conn
        self._response = response
        self.status_code = response.status
        self.headers: Message = response.headers
        self.url = url
        length = response.length or 0
        self._deadline = deadline + length * per_byte
        self._seconds = seconds + length * per_byte

    @property
    def raw(self) -> WireResponse:
        """The body stream (botocore's responses keep it there; so do these)."""
        return self

    def read(self, amount: int | None = None) -> bytes:
        try:
            if self._conn is not None:
                _within(self._conn, self._deadline)
            return self._response.read(amount)
        except TimeoutError as exc:
            self.close()
            raise ReadTimedOut(f"no complete answer from {self.url} within "
                               f"{self._seconds:.3g} s") from exc
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise ConnectionLost(f"connection to {self.url} broke while reading the "
                                 f"answer ({type(exc).__name__}: {exc})") from exc

    def release_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._response.isclosed() or self._response.length == 0:
            self._response.read()  # (nothing left: marks the response done)
            self._pool.give_back(conn)
        else:
            conn.close()  # body not read to its end: the connection cannot be reused

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class WirePool:
    """Kept-alive connections to one endpoint, shared by threads (one request each at a
    time). `verify` is False (no TLS checks), True (the system's CAs) or a CA bundle."""

    def __init__(self, endpoint: str, *, max_idle: int, connect_timeout: float,
                 read_timeout: float, verify: bool | str = True) -> None:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) endpoint: {endpoint!r}")
        self.host = parts.netloc  # as signed and sent in Host (port only if given)
        self._address = (parts.hostname, parts.port or (443 if parts.scheme == "https"
                                                         else 80))
        self._tls = _tls_context(verify) if parts.scheme == "https" else None
        self._max_idle = max_idle
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    @property
    def plain(self) -> bool:
        """Plain TCP (http), where the kernel can send a file's bytes (sendfile)."""
        return self._tls is None

    def request(self, method: str, target: str, headers: dict[str, str],
                body: bytes | PiecewiseBody = b"", *, timeout: float | None = None,
                per_byte: float = 0.0, span: FileSpan | None = None) -> WireResponse:
        """Send one request (`target`: path and query, as signed) and read the status
        line and headers. A kept-alive connection that the server closed meanwhile is
        dropped and the request goes out on the next (at last a new one); every other
        failure raises a WireError. A
        PiecewiseBody goes out piece by piece as it yields them (sent again whole if the
        request is). The whole request, its body sent and the answer's body read, must
        be done within `timeout` seconds (the pool's read timeout if None), and
        `per_byte` more for each byte of an answer's body of known length
        (`timeouts`): otherwise ReadTimedOut (ConnectTimedOut while connecting).
        `span`: the body's bytes in a file, which the kernel sends (sendfile) on a plain
        TCP connection (TLS needs the bytes in the daemon: the body's pieces go then)."""
        seconds = self._read_timeout if timeout is None else timeout
        deadline = time.monotonic() + seconds
        while True:
            conn, reused = self._take(deadline)
            try:
                _within(conn, deadline)
                try:
                    self._send(conn, method, target, headers, body, deadline, span)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the server may have answered before it closed: read that (as
                    # urllib3 does), e.g. a refusal while a body was still on its way
                response = conn.getresponse()
            except (ConnectionResetError, BrokenPipeError, ConnectionAbortedError,
                    http.client.RemoteDisconnected) as exc:
                conn.close()
                if reused:
                    continue  # the server dropped an idle connection: not an error
                raise ConnectionLost(f"connection to {self.host} closed before an answer"
                                     f" ({type(exc).__name__})") from exc
            except TimeoutError as exc:
                conn.close()
                raise ReadTimedOut(f"no answer from {self.host} within {seconds:.3g} s"
                                   ) from exc
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                raise ConnectionLost(f"request to {self.host} failed ({type(exc).__name__}:"
                                     f" {exc})") from exc
            return WireResponse(self, conn, response, target, deadline, seconds, per_byte)

    @staticmethod
    def _send(conn: http.client.HTTPConnection, method: str, target: str,
              headers: dict[str, str], body: bytes | PiecewiseBody, deadline: float,
              span: FileSpan | None = None) -> None:
        if isinstance(body, bytes):  # (sendall: the socket's timeout bounds all of it)
            conn.request(method, target, body if body or method in ("PUT", "POST") else None,
                         headers)
            return
        conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders()
        if span is not None and conn.sock is not None \
                and not isinstance(conn.sock, ssl.SSLSocket):
            _send_span(conn, span, deadline)
            return
        for piece in body.pieces():
            _within(conn, deadline)
            conn.send(piece)

    def _take(self, deadline: float) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self._connect(deadline), False

    def _connect(self, deadline: float) -> http.client.HTTPConnection:
        host, port = self._address
        conn: http.client.HTTPConnection
        wait = max(0.001, min(self._connect_timeout, deadline - time.monotonic()))
        if self._tls is not None:
            conn = http.client.HTTPSConnection(host, port, timeout=wait, context=self._tls)
        else:
            conn = http.client.HTTPConnection(host, port, timeout=wait)
        try:
            conn.connect()
        except TimeoutError as exc:
            conn.close()
            raise ConnectTimedOut(f"could not connect to {self.host} within "
                                  f"{wait:.3g} s") from exc
        except ssl.SSLCertVerificationError as exc:
            conn.close()
            raise CertificateRefused(exc.verify_message or str(exc)) from exc
        except OSError as exc:  # refused, unreachable, name unknown, TLS failed
            conn.close()
            raise ConnectFailed(f"could not connect to {self.host} ({exc})") from exc
        return conn  # (http.client set TCP_NODELAY; `request` sets the timeouts)

    def give_back(self, conn: http.client.HTTPConnection) -> None:
        if conn.sock is None:  # the server asked to close it (Connection: close)
            return
        with self._lock:
            if len(self._idle) < self._max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _tls_context(verify: bool | str) -> ssl.SSLContext:
    if verify is False:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    return ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)


"""A small threaded TCP proxy that injects latency, throttling and outages.

Placed between a client and the S3 server, it lets tests simulate a slow or dead
network without touching the server: `delay_seconds` adds latency to every chunk,
`bandwidth_bytes_per_s` throttles, `fail = True` kills live connections and
resets new ones (an outage; the client's pooled keep-alive connections die too), and
`truncate_responses_at = n` ends every new connection cleanly after n bytes from the
server (a body cut short with a clean EOF, which only a length check can notice).
`answer_with(status, code, count, methods)` answers the next `count` requests of those
methods itself with that S3 error (e.g. 503 SlowDown), on connections made after
`parse_requests = True` (which reads requests one by one instead of pumping bytes);
`answer_share(status, code, share, methods, seed)` answers that share of them (a storm),
drawn from a seeded RNG, until `answer_share(..., 0.0, ...)`.
`requests_log` lists (method, target) of every request read on parsed connections, in the
order they were forwarded (which request came after which); `requests_headers` the names
of each one's headers, lower case, in the same order.
`corrupt_body(contains, nth)` flips one byte in the middle of the body of the nth next
parsed PUT whose target contains `contains` (an UploadPart: "partNumber="; a PutObject:
its key) and forwards it otherwise unchanged, as a bad NIC or middlebox would;
`corrupted` lists the targets so changed.
On connections made with `parse_requests` and `parse_responses` both True, answers are read
one by one too: `corrupt_responses(match)` flips one bit in the middle of the body of every
200/206 answer to a GET that `match(method, target)` chooses (a bad NIC on the way back;
`responses_corrupted` lists the targets so changed), and `hold_responses(match, seconds)`
delivers the answers to the requests it chooses that much later than S3 gave them.
`hold_requests(match)` is a black hole for some requests only (those for which
`match(method, target)` is true, on parsed connections: a listing that never ends while
S3 answers everything else); `hold_requests(None)` resets the connections it held.
`hang = True` is a black hole: connections are accepted and requests read, but nothing is
forwarded or answered, as behind a stuck load balancer; turning it off resets the
connections it held, so their clients see an error, and new ones are served again.
`delay_keys(prefix, seconds)` holds each request on a key starting with `prefix` (on parsed
connections) for `seconds` before it is forwarded, or until `release_keys()`: one
directory's uploads wait while the others' go through; `requests_held` counts the
requests that have waited so far; `delay_requests(match, seconds)` does the same for the
requests (method, target) that `match` chooses (a listing of one prefix, a GET but not a
DELETE of one key); with `whole=True` it holds them once their whole body is in.
"""

from __future__ import annotations

import contextlib
import math
import random
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from urllib.parse import unquote

_CHUNK = 64 * 1024


def key_of(target: str) -> str:
    """The object key of a path-style request target (/bucket/key?query)."""
    return unquote(target.split("?", 1)[0]).lstrip("/").partition("/")[2]


def listing(prefix: str, recursive: bool) -> Callable[[str, str], bool]:
    """A request matcher (`delay_requests`, `hold_requests`) for a ListObjectsV2 of
    `prefix`: recursive (all keys below it) or by directory (with a delimiter)."""
    def match(method: str, target: str) -> bool:
        query = unquote(target) + "&"
        return (method == "GET" and "list-type=2" in query and f"prefix={prefix}&" in query
                and ("delimiter=" in query) is not recursive)
    return match


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0) so the peer sees a hard failure, not a clean EOF."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv() on it
    with contextlib.suppress(OSError):
        sock.close()


class FaultProxy:
    """Forward 127.0.0.1:<port> to (target_host, target_port) with injectable faults."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.delay_seconds = 0.0
        self.bandwidth_bytes_per_s: float | None = None
        self.truncate_responses_at: int | None = None
        self.connections_total = 0
        self.parse_requests = False
        self.answered = 0  # requests answered with an injected error so far
        self._answers: list[tuple[int, str, frozenset[str]]] = []
        self._storm: tuple[int, str, float, frozenset[str]] | None = None
        self._storm_rng = random.Random(0)
        self.requests_seen = 0  # requests read on parsed connections
        self.requests_log: list[tuple[str, str]] = []  # (method, target) of each of them
        self.requests_headers: list[frozenset[str]] = []  # their header names, lower case
        self._corruptions: list[list] = []  # [method, substring of the target, nth]
        self.corrupted: list[str] = []  # targets whose body had a byte flipped
        self.parse_responses = False  # answers read one by one (corrupt_, hold_responses)
        self._corrupt_answers: Callable[[str, str], bool] | None = None
        self._answers_held: tuple[Callable[[str, str], bool], float] | None = None
        self.answers_held = 0  # answers hold_responses delayed so far
        self.responses_corrupted: list[str] = []  # targets whose answer had a bit flipped
        self._fail = False
        self._hang = False
        self._hold: Callable[[str, str], bool] | None = None
        self._held: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._delayed: list[tuple[Callable[[str, str], bool], float, threading.Event,
                                  bool]] = []
        self.requests_held = 0
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._listener.settimeout(0.2)  # so the accept loop notices close()
        self.port: int = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, name="faultproxy-accept",
                                          daemon=True)
        self._acceptor.start()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def fail(self) -> bool:
        return self._fail

    @fail.setter
    def fail(self, value: bool) -> None:
        """Turning failure on also kills open connections, like a real outage."""
        self._fail = value
        if value:
            self._kill_connections()

    @property
    def hang(self) -> bool:
        return self._hang

    @hang.setter
    def hang(self, value: bool) -> None:
        """Turning the black hole off resets what it held, like a load balancer restart."""
        was, self._hang = self._hang, value
        if was and not value:
            self._kill_connections()

    def hold_requests(self, match: Callable[[str, str], bool] | None) -> None:
        """Swallow the requests (method, target) that `match`es from now on, on
        connections made with `parse_requests`; None resets those it held."""
        self._hold = match
        if match is None:
            with self._lock:
                held, self._held = list(self._held), set()
            for sock in held:
                _reset(sock)

    def _kill_connections(self) -> None:
        with self._lock:
            socks, self._socks = list(self._socks), set()
        for sock in socks:
            _reset(sock)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            self.connections_total += 1
            if self._fail or self._closed:
                _reset(client)
                continue
            if self._hang:
                with self._lock:
                    self._socks.add(client)
                self._start(self._swallow, client)
                continue
            self._forward(client)

    def _swallow(self, client: socket.socket) -> None:
        """A black-holed connection: read everything, answer nothing, until reset."""
        with contextlib.suppress(OSError):
            while client.recv(_CHUNK):
                pass
        with self._lock:
            self._socks.discard(client)
        _reset(client)

    def _forward(self, client: socket.socket) -> None:
        """Connect upstream and pump both ways, one thread per direction."""
        try:
            upstream = socket.create_connection(self.target, timeout=5)
            upstream.settimeout(None)
        except OSError:
            _reset(client)
            return
        with self._lock:
            self._socks.update((client, upstream))
        pending = [2]  # pumps still running; the last one closes both sockets
        asked: deque[tuple[str, str]] = deque()  # requests forwarded, not yet answered
        if self.parse_requests:
            self._start(self._pump_requests, client, upstream, pending, asked)
        else:
            self._start(self._pump, client, upstream, pending, None)
        if self.parse_requests and self.parse_responses:
            self._start(self._pump_responses, upstream, client, pending, asked)
        else:
            self._start(self._pump, upstream, client, pending, self.truncate_responses_at)

    def corrupt_responses(self, match: Callable[[str, str], bool] | None) -> None:
        """Flip a bit in the body of every answer to a GET (method, target) `match`es."""
        self._corrupt_answers = match

    def hold_responses(self, match: Callable[[str, str], bool] | None,
                       seconds: float = 0.0) -> None:
        """Deliver S3's answer to each request (method, target) `match`es `seconds`
        after S3 gave it (a listing answered before a change, received after it)."""
        self._answers_held = None if match is None else (match, seconds)

    def answer_with(self, status: int, code: str, count: int,
                    methods: frozenset[str] = frozenset({"PUT", "POST"})) -> None:
        """Answer the next `count` requests of `methods` with an S3 error, not forwarded."""
        with self._lock:
            self._answers.extend([(status, code, methods)] * count)

    def answer_share(self, status: int, code: str, share: float,
                     methods: frozenset[str] = frozenset({"PUT"}), seed: int = 0) -> None:
        """From now on answer `share` (0..1) of the requests of `methods` with an S3 error,
        each drawn from a Random(seed); 0 ends the storm."""
        with self._lock:
            self._storm = (status, code, share, methods) if share > 0 else None
            self._storm_rng = random.Random(seed)

    def corrupt_body(self, contains: str, nth: int = 1, method: str = "PUT") -> None:
        """Flip a byte in the body of the `nth` next request of `method` whose target
        contains `contains`."""
        with self._lock:
            self._corruptions.append([method, contains, nth])

    def _flip_at(self, method: str, target: str, length: int) -> int | None:
        """Where to flip a byte of this request's body (the middle, counted from the
        end: how many bytes are left from it on), if anywhere."""
        with self._lock:
            for i, wanted in enumerate(self._corruptions):
                if wanted[0] == method and wanted[1] in target and length:
                    wanted[2] -= 1
                    if wanted[2]:
                        return None
                    del self._corruptions[i]
                    self.corrupted.append(target)
                    return length - length // 2
        return None

    def _injected(self, method: str) -> tuple[int, str] | None:
        with self._lock:
            self.requests_seen += 1
            for i, (status, code, methods) in enumerate(self._answers):
                if method in methods:
                    del self._answers[i]
                    self.answered += 1
                    return status, code
            if self._storm is not None and method in self._storm[3]:
                status, code, share, _ = self._storm
                if self._storm_rng.random() < share:
                    self.answered += 1
                    return status, code
        return None

    def delay_keys(self, prefix: str, seconds: float = math.inf) -> None:
        """Hold requests on keys under `prefix` (path-style: /bucket/key) for `seconds`
        each before forwarding them, or until `release_keys()`."""
        self.delay_requests(lambda method, target: key_of(target).startswith(prefix), seconds)

    def delay_requests(self, match: Callable[[str, str], bool],
                       seconds: float = math.inf, whole: bool = False) -> threading.Event:
        """Hold the requests (method, target) that `match`es for `seconds` each before
        forwarding them, or until `release_keys()` or until the returned event is set.
        `whole`: held once the proxy has the whole body (it answers `Expect: 100-continue`
        itself), so the request lands even if its sender dies while it is held."""
        released = threading.Event()
        with self._lock:
            self._delayed.append((match, seconds, released, whole))
        return released

    def release_keys(self) -> None:
        """Forward the held requests now, and hold no more."""
        with self._lock:
            held, self._delayed = self._delayed, []
        for _, _, released, _ in held:
            released.set()

    def _delay_if_held(self, method: str, target: str, client: socket.socket,
                       buffered: bytes, length: int, waits: bool) -> bytes:
        """Hold the request if it is to be held; returns what was read of its body."""
        with self._lock:
            hold = next(((seconds, released, whole)
                         for match, seconds, released, whole in self._delayed
                         if match(method, target)), None)
        if hold is None:
            return buffered
        seconds, released, whole = hold
        if whole:
            if waits:
                client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            while len(buffered) < length:
                data = client.recv(_CHUNK)
                if not data:
                    raise OSError("closed")
                buffered += data
        with self._lock:
            self.requests_held += 1
        released.wait(None if seconds == math.inf else seconds)
        return buffered

    @staticmethod
    def _answer(client: socket.socket, status: int, code: str, close: bool) -> None:
        xml = (f"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code>"
               f"<Message>injected by the fault proxy</Message></Error>").encode()
        connection = "Connection: close\r\n" if close else ""
        client.sendall(f"HTTP/1.1 {status} {code}\r\nContent-Type: application/xml\r\n"
                       f"{connection}Content-Length: {len(xml)}\r\n\r\n".encode() + xml)

    def _read_head(self, src: socket.socket, buffered: bytes
                   ) -> tuple[bytes, list[str], dict[str, str], bytes]:
        """The next request's or answer's head from `src`: its bytes, its lines, its
        fields (lower-case names), and what was read past it."""
        while b"\r\n\r\n" not in buffered:
            data = src.recv(_CHUNK)
            if not data or self._fail:
                raise OSError("closed")
            buffered += data
        head, _, buffered = buffered.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        fields = {k.strip().lower(): v.strip()
                  for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)}
        return head, lines, fields, buffered

    def _pump_requests(self, client: socket.socket, upstream: socket.socket,
                       pending: list[int], asked: deque[tuple[str, str]]) -> None:
        """Client to server, request by request (HTTP/1.1 without pipelining, bodies with
        Content-Length, as S3 clients send them); injected answers go straight back."""
        buffered = b""
        try:
            while True:
                head, lines, fields, buffered = self._read_head(client, buffered)
                length = int(fields.get("content-length", "0"))
                waits = fields.get("expect", "").lower() == "100-continue"  # body not yet sent
                answer = self._injected(lines[0].split(" ", 1)[0])
                method, target = (lines[0].split(" ") + ["", ""])[:2]
                with self._lock:
                    self.requests_log.append((method, target))
                    self.requests_headers.append(frozenset(fields))
                flip = None if answer is not None else self._flip_at(method, target, length)
                hold = self._hold
                if hold is not None and hold(method, target):
                    with self._lock:
                        self._held.add(client)
                if self._hang or client in self._held:  # swallowed: never answered
                    while client.recv(_CHUNK):
                        pass
                    raise OSError("closed")
                if answer is None:
                    buffered = self._delay_if_held(method, target, client, buffered, length,
                                                   waits)
                    asked.append((method, target))
                    upstream.sendall(head + b"\r\n\r\n")
                elif waits:
                    self._answer(client, *answer, close=True)  # instead of 100 Continue
                    raise OSError("answered")
                while length:  # the body: relayed, or read and dropped
                    if not buffered:
                        buffered = client.recv(_CHUNK)
                        if not buffered:
                            raise OSError("closed")
                    piece, buffered = buffered[:length], buffered[length:]
                    length -= len(piece)
                    at = -1 if flip is None else length + len(piece) - flip
                    if 0 <= at < len(piece):
                        piece = piece[:at] + bytes([piece[at] ^ 0xFF]) + piece[at + 1:]
                    if answer is None:
                        upstream.sendall(piece)
                if answer is not None:
                    self._answer(client, *answer, close=False)
        except OSError:
            pass
        finally:
            self._pump_done(client, upstream, pending)

    def _pump_responses(self, upstream: socket.socket, client: socket.socket,
                        pending: list[int], asked: deque[tuple[str, str]]) -> None:
        """Server to client, answer by answer (in the order of `asked`): held back
        (`hold_responses`), or a bit flipped in the middle of the body of each answer to a
        GET that `corrupt_responses` chooses. An answer without a Content-Length ends the
        parsing: the rest is relayed as it comes."""
        buffered = b""
        try:
            while True:
                head, lines, fields, buffered = self._read_head(upstream, buffered)
                status = int(lines[0].split(" ")[1])
                if status < 200:  # 100 Continue: the answer itself follows
                    client.sendall(head + b"\r\n\r\n")
                    continue
                method, target = asked.popleft() if asked else ("", "")
                hold = self._answers_held
                if hold is not None and hold[0](method, target):
                    with self._lock:
                        self.answers_held += 1
                    time.sleep(hold[1])  # S3 answered; the answer arrives this much later
                client.sendall(head + b"\r\n\r\n")
                if method == "HEAD" or status in (204, 304):
                    continue
                if "content-length" not in fields:
                    client.sendall(buffered)
                    while data := upstream.recv(_CHUNK):
                        client.sendall(data)
                    raise OSError("closed")
                length = int(fields["content-length"])
                corrupt = self._corrupt_answers
                flip = (length // 2 if method == "GET" and status in (200, 206) and length
                        and corrupt is not None and corrupt(method, target) else -1)
                if flip >= 0:
                    with self._lock:
                        self.responses_corrupted.append(target)
                sent = 0
                while sent < length:
                    if not buffered:
                        buffered = upstream.recv(_CHUNK)
                        if not buffered:
                            raise OSError("closed")
                    piece, buffered = buffered[:length - sent], buffered[length - sent:]
                    at = flip - sent
                    if 0 <= at < len(piece):
                        piece = piece[:at] + bytes([piece[at] ^ 0x01]) + piece[at + 1:]
                    client.sendall(piece)
                    sent += len(piece)
        except OSError:
            pass
        finally:
            self._pump_done(upstream, client, pending)

    def _start(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name="faultproxy-pump",
                                  daemon=True)
        thread.start()
        self._threads.append(thread)
        self._threads = [t for t in self._threads if t.is_alive()]

    def _pump(self, src: socket.socket, dst: socket.socket, pending: list[int],
              limit: int | None) -> None:
        try:
            while True:
                data = src.recv(_CHUNK)
                if not data or self._fail:
                    break
                if limit is not None:
                    data = data[:limit]
                    limit -= len(data)
                if self.delay_seconds:
                    time.sleep(self.delay_seconds)
                if self.bandwidth_bytes_per_s:
                    time.sleep(len(data) / self.bandwidth_bytes_per_s)
                if self._fail:
                    break
                if self._hang:
                    continue  # swallowed: the peer waits for ever
                dst.sendall(data)
                if limit == 0:
                    src.shutdown(socket.SHUT_RDWR)
                    break
        except OSError:
            pass
        finally:
            self._pump_done(src, dst, pending)

    def _pump_done(self, src: socket.socket, dst: socket.socket, pending: list[int]) -> None:
        """One direction ended: half-close (the other may still finish its response), or
        reset both in an outage; the last of the two pumps closes both sockets."""
        if self._fail:
            _reset(src)
            _reset(dst)
        else:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
        with self._lock:
            pending[0] -= 1
            last = pending[0] == 0
            if last:
                self._socks.discard(src)
                self._socks.discard(dst)
        if last:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.close()

    def close(self) -> None:
        """Stop accepting, reset every connection and join the threads."""
        self._closed = True
        self.release_keys()
        with contextlib.suppress(OSError):
            self._listener.close()
        self._kill_connections()
        self._acceptor.join(timeout=5)
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

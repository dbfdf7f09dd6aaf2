"""A counting HTTP/1.1 proxy for bench/peers/s3_harness.py: it sits between every S3 client of
the benchmark and moto's server and counts what crosses it.

Each client connection gets a thread and its own persistent connection to the server. Requests
are forwarded verbatim, one at a time per connection, in both directions: the request head as
the client wrote it (the Host header included: SigV4 signs it, so the client must sign the
proxy's host:port, which is what it connects to), then the body framed as the client framed it
(Content-Length, or chunked with its chunk lines and trailers; no body otherwise); then the
response head and body as the server framed them (Content-Length, chunked, none for HEAD, 1xx,
204 and 304, or until the server closes). "Expect: 100-continue" is honoured: the head goes
first, and the body only after the server's 100 Continue is passed on (a final reply instead
ends the exchange and the connection). A connection stays open while both sides keep it alive.
TCP_NODELAY is set on both sides (a head and a body written separately would otherwise meet
Nagle's algorithm and delayed ACKs).

Counted (class Counters), for all connections together: requests by method, responses by
status class, request body bytes (what the server received after each head, chunk framing
included), response body bytes (what the server sent after each head), client connections
accepted, and exchanges the client abandoned (it closed its connection mid-exchange, as a
client that cancels a stream does). Bytes are counted as they are read, before they are
forwarded, so a client that has its reply has been counted. The harness takes a snapshot
before and after each phase (snapshot(), or GET /counters on the control port from another
process) and reports the difference.

A failure on the server's side (refused connection, a reply cut short, an unparsable head) is
recorded in `errors`; the harness fails the run if there are any.

Throttling (the tests of issue 34): throttle() adds a rule under which a matching request (its
method, and a substring of its target: path and query as the client sent them) is answered
503 SlowDown, as S3 answers a client over its request rate, instead of being forwarded, with a
given probability (a seeded generator: the same sequence of decisions every run). The reply
closes the connection (a request body the client sends anyway is read and dropped first).
Counted in `throttled`. Run as a program it serves until SIGTERM (see main()).

With S3_PROXY_TRACE=FILE in its environment, the proxy appends each forwarded request's method,
target and Range header (if any) to FILE, one line each: which requests a phase's counts are
made of.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, BinaryIO, Optional

CHUNK = 1 << 20
MAX_HEAD_LINES = 200
TIMEOUT_S = 900.0


class ClientGone(Exception):
    """The client closed its connection (or reset it) in the middle of an exchange."""


class UpstreamError(Exception):
    """The server side failed: connection, a reply cut short, a malformed head."""


@dataclass
class Counters:
    """What crossed the proxy since it started (all connections)."""

    requests: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    request_body_bytes: int = 0
    response_body_bytes: int = 0
    connections: int = 0
    client_aborts: int = 0
    throttled: int = 0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return {"requests": dict(self.requests), "statuses": dict(self.statuses),
                "request_body_bytes": self.request_body_bytes,
                "response_body_bytes": self.response_body_bytes,
                "connections": self.connections, "client_aborts": self.client_aborts,
                "throttled": self.throttled}


@dataclass(frozen=True)
class ThrottleRule:
    """Requests of `method` ("" for any) whose target contains `target_contains` are answered
    503 SlowDown with probability `probability`."""

    method: str
    target_contains: str
    probability: float

    @staticmethod
    def parse(text: str) -> "ThrottleRule":
        """METHOD:SUBSTRING:PROBABILITY, e.g. "GET:list-type=2:0.25" (METHOD may be empty)."""
        method, sep, rest = text.partition(":")
        substring, sep2, probability = rest.rpartition(":")
        if not sep or not sep2:
            raise ValueError(f"--throttle {text!r}: expected METHOD:SUBSTRING:PROBABILITY")
        p = float(probability)
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"--throttle {text!r}: probability {p} is outside [0, 1]")
        return ThrottleRule(method.upper(), substring, p)


SLOW_DOWN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
             b"<Message>Please reduce your request rate.</Message></Error>")


def difference(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """after - before of two Counters.as_dict() snapshots."""
    out: dict[str, Any] = {}
    for key, value in after.items():
        if isinstance(value, dict):
            out[key] = {k: v - before[key].get(k, 0) for k, v in value.items()
                        if v - before[key].get(k, 0)}
        else:
            out[key] = value - before[key]
    return out


def _headers(lines: list[bytes]) -> dict[str, str]:
    """Header fields of a head's lines (after the start line), names lower-cased; repeated
    fields joined with ", "."""
    out: dict[str, str] = {}
    for raw in lines[1:]:
        line = raw.decode("latin-1").rstrip("\r\n")
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"malformed header line {line!r}")
        name = name.strip().lower()
        out[name] = f"{out[name]}, {value.strip()}" if name in out else value.strip()
    return out


def _is_chunked(headers: dict[str, str]) -> bool:
    codings = [c.strip().lower() for c in headers.get("transfer-encoding", "").split(",")]
    return bool(codings) and codings[-1] == "chunked"


def _content_length(headers: dict[str, str]) -> Optional[int]:
    value = headers.get("content-length")
    if value is None:
        return None
    values = {v.strip() for v in value.split(",")}
    if len(values) != 1 or not next(iter(values)).isdigit():
        raise ValueError(f"bad Content-Length {value!r}")
    return int(next(iter(values)))


class _Exchange:
    """One client connection: its socket and reader, the server connection and reader."""

    def __init__(self, proxy: "CountingProxy", client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.client_in: BinaryIO = client.makefile("rb", buffering=CHUNK)  # type: ignore
        self.upstream: Optional[socket.socket] = None
        self.upstream_in: Optional[BinaryIO] = None

    # ---- plumbing ----

    def _to_client(self, data: bytes | memoryview) -> None:
        try:
            self.client.sendall(data)
        except OSError as e:
            raise ClientGone(str(e)) from e

    def _to_upstream(self, data: bytes | memoryview) -> None:
        assert self.upstream is not None
        try:
            self.upstream.sendall(data)
        except OSError as e:
            raise UpstreamError(f"sending to the server: {e}") from e

    def _read_line(self, source: BinaryIO, from_client: bool) -> bytes:
        try:
            line = source.readline(65537)
        except OSError as e:
            if from_client:
                raise ClientGone(str(e)) from e
            raise UpstreamError(f"reading from the server: {e}") from e
        if not line.endswith(b"\n"):
            if from_client:
                raise ClientGone("the client closed the connection mid-exchange")
            raise UpstreamError("the server closed the connection mid-reply" if not line
                                else "a line of the server's reply is too long")
        return line

    def _read_some(self, source: BinaryIO, limit: int, from_client: bool) -> bytes:
        try:
            data = source.read1(limit)  # type: ignore[attr-defined]
        except OSError as e:
            if from_client:
                raise ClientGone(str(e)) from e
            raise UpstreamError(f"reading from the server: {e}") from e
        return data

    def _head(self, source: BinaryIO, from_client: bool) -> Optional[list[bytes]]:
        """The lines of a head (start line, fields, the empty line); None when a client closes
        its connection cleanly before a new request."""
        lines: list[bytes] = []
        while True:
            try:
                line = source.readline(65537)
            except OSError as e:
                if from_client and not lines:
                    return None
                if from_client:
                    raise ClientGone(str(e)) from e
                raise UpstreamError(f"reading the server's reply: {e}") from e
            if not line:
                if from_client and not lines:
                    return None
                if from_client:
                    raise ClientGone("the client closed the connection mid-head")
                raise UpstreamError("the server closed the connection before a whole reply head")
            if not line.endswith(b"\n"):
                raise (ClientGone if from_client else UpstreamError)("a head line too long")
            if not lines and line in (b"\r\n", b"\n"):
                continue  # RFC 9112 2.2: empty lines before a request line are ignored
            lines.append(line)
            if line in (b"\r\n", b"\n"):
                return lines
            if len(lines) > MAX_HEAD_LINES:
                raise (ClientGone if from_client else UpstreamError)("a head of too many lines")

    def _copy_exact(self, source: BinaryIO, n: int, from_client: bool) -> int:
        """Forwards exactly n body bytes from source to the other side; returns n."""
        left = n
        while left:
            data = self._read_some(source, min(left, CHUNK), from_client)
            if not data:
                if from_client:
                    raise ClientGone("the client closed the connection mid-body")
                raise UpstreamError(f"the server's body ended {left} bytes early")
            self._count_body(len(data), from_client)
            (self._to_upstream if from_client else self._to_client)(data)
            left -= len(data)
        return n

    def _copy_chunked(self, source: BinaryIO, from_client: bool) -> None:
        """Forwards a chunked body verbatim: chunk lines, data, the last chunk and trailers."""
        send = self._to_upstream if from_client else self._to_client
        while True:
            line = self._read_line(source, from_client)
            self._count_body(len(line), from_client)
            send(line)
            size_text = line.split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise (ClientGone if from_client else UpstreamError)(
                    f"bad chunk size line {line[:80]!r}") from None
            if size == 0:
                while True:  # trailer fields, then the empty line
                    trailer = self._read_line(source, from_client)
                    self._count_body(len(trailer), from_client)
                    send(trailer)
                    if trailer in (b"\r\n", b"\n"):
                        return
            self._copy_exact(source, size, from_client)
            end = self._read_line(source, from_client)
            self._count_body(len(end), from_client)
            send(end)

    def _copy_until_close(self, source: BinaryIO) -> None:
        """Forwards a response body that ends when the server closes its connection."""
        while True:
            data = self._read_some(source, CHUNK, from_client=False)
            if not data:
                return
            self._count_body(len(data), False)
            self._to_client(data)

    def _count_body(self, n: int, from_client: bool) -> None:
        with self.proxy.lock:
            if from_client:
                self.proxy.counters.request_body_bytes += n
            else:
                self.proxy.counters.response_body_bytes += n

    def _connect_upstream(self) -> None:
        """A (new) connection to the server, if there is none or the server closed it."""
        if self.upstream is not None:
            readable, _, _ = select.select([self.upstream], [], [], 0)
            if readable:  # an idle connection is readable only when the server closed it
                try:
                    alive = self.upstream.recv(1, socket.MSG_PEEK) != b""
                except OSError:
                    alive = False
                if alive:
                    raise UpstreamError("the server sent bytes outside any reply")
                self._close_upstream()
        if self.upstream is None:
            try:
                self.upstream = socket.create_connection(self.proxy.upstream, timeout=TIMEOUT_S)
            except OSError as e:
                raise UpstreamError(f"connecting to the server {self.proxy.upstream}: {e}") from e
            self.upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.upstream_in = self.upstream.makefile("rb", buffering=CHUNK)  # type: ignore

    def _close_upstream(self) -> None:
        if self.upstream is not None:
            try:
                self.upstream.close()
            except OSError:
                pass
        self.upstream, self.upstream_in = None, None

    # ---- one exchange ----

    def _response(self, method: str) -> tuple[int, dict[str, str], list[bytes]]:
        """Reads one response head from the server (1xx interim heads included)."""
        assert self.upstream_in is not None
        head = self._head(self.upstream_in, from_client=False)
        assert head is not None
        parts = head[0].decode("latin-1").split(None, 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
            raise UpstreamError(f"a malformed status line {head[0][:80]!r} (after {method})")
        try:
            headers = _headers(head)
        except ValueError as e:
            raise UpstreamError(str(e)) from e
        return int(parts[1]), headers, head

    def _forward_response_body(self, method: str, status: int,
                               headers: dict[str, str]) -> bool:
        """Forwards the body of a final response; returns False when it ended with the
        server's close (the connection cannot be reused)."""
        assert self.upstream_in is not None
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            return True
        if _is_chunked(headers):
            self._copy_chunked(self.upstream_in, from_client=False)
            return True
        try:
            length = _content_length(headers)
        except ValueError as e:
            raise UpstreamError(str(e)) from e
        if length is not None:
            self._copy_exact(self.upstream_in, length, from_client=False)
            return True
        self._copy_until_close(self.upstream_in)
        return False

    def one(self) -> bool:
        """Relays one request and its response; returns whether the connection stays open."""
        head = self._head(self.client_in, from_client=True)
        if head is None:
            return False
        parts = head[0].decode("latin-1").split()
        if len(parts) != 3:
            raise ClientGone(f"a malformed request line {head[0][:80]!r}")
        method, version = parts[0].upper(), parts[2].upper()
        try:
            headers = _headers(head)
            request_length = _content_length(headers)
        except ValueError as e:
            raise ClientGone(str(e)) from e
        if self.proxy.throttles(method, parts[1]):
            self._slow_down(method, headers, request_length)
            return False
        self._connect_upstream()
        assert self.upstream_in is not None
        with self.proxy.lock:
            c = self.proxy.counters
            c.requests[method] = c.requests.get(method, 0) + 1
            trace_path = os.environ.get("S3_PROXY_TRACE")
            if trace_path:
                with open(trace_path, "a", encoding="latin-1") as trace:
                    trace.write(f"{method} {parts[1]} {headers.get('range', '')}\n")
        self._to_upstream(b"".join(head))
        has_body = _is_chunked(headers) or bool(request_length)
        expect = headers.get("expect", "").lower() == "100-continue" and has_body
        body_sent = not has_body
        if has_body and not expect:
            self._send_request_body(headers, request_length)
            body_sent = True
        while True:
            status, response_headers, response_head = self._response(method)
            if status == 100 and not body_sent:
                self._to_client(b"".join(response_head))
                self._send_request_body(headers, request_length)
                body_sent = True
                continue
            if 100 <= status < 200:  # other interim replies pass through
                self._to_client(b"".join(response_head))
                continue
            break
        with self.proxy.lock:
            c = self.proxy.counters
            key = f"{status // 100}xx"
            c.statuses[key] = c.statuses.get(key, 0) + 1
        self._to_client(b"".join(response_head))
        reusable = self._forward_response_body(method, status, response_headers)
        connection = {t.strip().lower() for t in
                      (headers.get("connection", "") + "," +
                       response_headers.get("connection", "")).split(",")}
        response_version = response_head[0][:8].upper()
        keep = (reusable and body_sent and "close" not in connection
                and version == "HTTP/1.1"
                and (response_version == b"HTTP/1.1" or "keep-alive" in connection))
        if not keep:
            self._close_upstream()
        return keep

    def _slow_down(self, method: str, headers: dict[str, str], length: Optional[int]) -> None:
        """Answers 503 SlowDown in place of the server; the connection then closes."""
        expect = headers.get("expect", "").lower() == "100-continue"
        if length and not expect:  # the body comes anyway: read and drop it
            left = length
            while left > 0:
                data = self._read_some(self.client_in, min(left, CHUNK), from_client=True)
                left -= len(data)
        with self.proxy.lock:
            c = self.proxy.counters
            c.requests[method] = c.requests.get(method, 0) + 1
            c.statuses["5xx"] = c.statuses.get("5xx", 0) + 1
            c.throttled += 1
        self._to_client(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                        b"Content-Length: " + str(len(SLOW_DOWN)).encode() +
                        b"\r\nConnection: close\r\n\r\n" + SLOW_DOWN)

    def _send_request_body(self, headers: dict[str, str], length: Optional[int]) -> None:
        if _is_chunked(headers):
            self._copy_chunked(self.client_in, from_client=True)
        elif length:
            self._copy_exact(self.client_in, length, from_client=True)

    def serve(self) -> None:
        """Relays exchanges until either side closes."""
        try:
            while self.one():
                pass
        except ClientGone:
            with self.proxy.lock:
                self.proxy.counters.client_aborts += 1
        except UpstreamError as e:
            self.proxy.record_error(str(e))
        except Exception as e:  # a bug of the proxy: the run must not pass
            self.proxy.record_error(f"{type(e).__name__}: {e}")
        finally:
            self._close_upstream()
            try:
                self.client.close()
            except OSError:
                pass


class CountingProxy:
    """The proxy: start() listens on 127.0.0.1 (a free port) and forwards to `upstream`;
    url is what clients use as their endpoint; snapshot() the counters; close() stops it."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.counters = Counters()
        self.lock = threading.Lock()
        self.errors: list[str] = []
        self.rules: list[ThrottleRule] = []
        self._random = random.Random(0)
        self._listener: Optional[socket.socket] = None
        self._control: Optional[ThreadingHTTPServer] = None
        self._closed = threading.Event()

    def throttle(self, rule: ThrottleRule, seed: int = 0) -> None:
        """Adds `rule` (and reseeds the generator that decides)."""
        with self.lock:
            self.rules.append(rule)
            self._random.seed(seed)

    def throttles(self, method: str, target: str) -> bool:
        """Whether this request is answered 503 SlowDown (one decision per matching rule)."""
        with self.lock:
            for rule in self.rules:
                if rule.method in ("", method) and rule.target_contains in target and \
                        self._random.random() < rule.probability:
                    return True
        return False

    def record_error(self, message: str) -> None:
        """Keeps a server-side failure (the run fails when there is any)."""
        with self.lock:
            if len(self.errors) < 100:
                self.errors.append(message)

    def snapshot(self) -> dict[str, Any]:
        """A copy of the counters now."""
        with self.lock:
            return self.counters.as_dict()

    @property
    def port(self) -> int:
        assert self._listener is not None
        return int(self._listener.getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def control_url(self) -> str:
        """GET <control_url>/counters returns snapshot() as JSON (for other processes)."""
        assert self._control is not None
        return f"http://127.0.0.1:{self._control.server_address[1]}"

    def start(self) -> "CountingProxy":
        """Listens and serves in daemon threads; returns self."""
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(256)
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()
        proxy = self

        class Control(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path != "/counters":
                    self.send_error(404)
                    return
                body = json.dumps(proxy.snapshot()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self._control = ThreadingHTTPServer(("127.0.0.1", 0), Control)
        self._control.daemon_threads = True
        threading.Thread(target=self._control.serve_forever, name="proxy-control",
                         daemon=True).start()
        return self

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                if self._closed.is_set():
                    return
                continue
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client.settimeout(TIMEOUT_S)
            with self.lock:
                self.counters.connections += 1
            threading.Thread(target=_Exchange(self, client).serve, name="proxy-conn",
                             daemon=True).start()

    def close(self) -> None:
        """Stops listening (connections in progress end with the process)."""
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
        if self._control is not None:
            self._control.shutdown()
            self._control.server_close()


def fetch_counters(control_url: str) -> dict[str, Any]:
    """The proxy's counters, from another process (GET <control_url>/counters)."""
    import urllib.request
    with urllib.request.urlopen(control_url + "/counters", timeout=60) as reply:
        return json.loads(reply.read())


def main(argv: list[str]) -> int:
    """Runs the proxy until SIGTERM or SIGINT: writes "PROXY_URL=...", "PROXY_CONTROL_URL=..."
    to --ready-file (written beside, then renamed) once it listens."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--upstream", required=True, help="the server, http://HOST:PORT")
    parser.add_argument("--ready-file", required=True)
    parser.add_argument("--throttle", action="append", default=[],
                        help="METHOD:SUBSTRING:PROBABILITY, e.g. GET:list-type=2:0.25")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    host_port = args.upstream.split("://", 1)[-1].rstrip("/")
    host, _, port = host_port.rpartition(":")
    proxy = CountingProxy(host, int(port)).start()
    for text in args.throttle:
        proxy.throttle(ThrottleRule.parse(text), args.seed)
    with open(args.ready_file + ".tmp", "w") as f:
        f.write(f"PROXY_URL={proxy.url}\nPROXY_CONTROL_URL={proxy.control_url}\n")
    os.replace(args.ready_file + ".tmp", args.ready_file)
    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())
    stop.wait()
    proxy.close()
    if proxy.errors:
        print("\n".join(proxy.errors), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The HTTP server clients reach. Triton listens behind it on Unix sockets in the launcher's private work
directory, so Triton's JSON parser, shared-memory, repository, logging, trace and statistics APIs are out of
every client's reach, and of every other local user's.

What it serves (docs/serving.md, "Security and limits"):
- POST /v2/models/MODEL/generate and /generate_stream: the body read within the size and nesting limits and
  checked against the served tensors (serve/triton/tensors.py read_json), then sent on to Triton over gRPC
  (serve/triton/upstream.py), so that a client that disconnects cancels its request, streaming or not.
  Errors get the HTTP status of their kind (serve/frontend.py Status).
- GET /v2/health/live, /v2/health/ready, /v2/models/MODEL/ready: the truth (the stub alive, not draining);
  no key needed, for load balancers.
- GET /v2 and /v2/models/MODEL: Triton's metadata. On the metrics port, GET /metrics.
Everything else is 404. With an API key, every request but health needs `Authorization: Bearer KEY`.

Connections: a request's line and headers must arrive within `header_timeout_s` of the connection opening or of
the previous answer, and its body within `body_timeout_s` of its headers (a deadline for the whole, not for each
read: a byte at a time does not hold one open); at most `max_connections` are open, and one more closes the one
that has waited longest on its client (a request not yet whole, or idle between requests), so that idle
connections cannot shut out /v2/health/ready and clients that send their requests.
"""

from __future__ import annotations

import http.client
import io
import json
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refusion.runtime.core.errors import RefusionError
from refusion.serve.frontend import Status, decode
from refusion.serve.security import authorized, connections_allowed, read_json_object
from refusion.serve.triton.fd_wait import readable
from refusion.serve.triton.tensors import read_json

if TYPE_CHECKING:
    from refusion.serve.triton.upstream import TritonCalls

HEADER_TIMEOUT_S = 30.0  # for a request's line and headers, from the connection opening or the previous answer
BODY_TIMEOUT_S = 30.0  # for its body, from its headers (408 past it)
WRITE_TIMEOUT_S = 30.0  # a client that reads nothing of its answer this long is disconnected
MAX_CONNECTIONS = 1024  # open at once (each holds a thread); one more closes the one that has waited longest
DISCARD_LIMIT = 64 << 20  # a body over the limit but under this is read and dropped, so its client sees the 413
_MODEL_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/[^/]+)?(/.*)?")


@dataclass
class Health:
    """What readiness reports, shared by the gateways and the launcher."""

    started: bool = False
    draining: bool = False
    failure: str | None = None  # why the model can no longer serve

    @property
    def ready(self) -> bool:
        return self.started and not self.draining and self.failure is None

    @property
    def reason(self) -> str:
        if self.failure is not None:
            return self.failure
        return "the server is shutting down" if self.draining else "the model is loading"


_SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path (sun_path, less its terminating NUL)


@dataclass(frozen=True)
class Upstream:
    """Triton's HTTP, gRPC and metrics endpoints: Unix sockets in `directory`, the launcher's work directory,
    which mkdtemp makes mode 0700: no other user can enter it, so none can reach Triton (its command line, which
    any local user can read, holds no secret)."""

    directory: Path

    def __post_init__(self) -> None:
        longest = str(self.metrics)
        if len(longest.encode()) > _SOCKET_PATH_MAX:
            raise RefusionError(f"Triton's socket {longest} is a path longer than a Unix socket's "
                                f"{_SOCKET_PATH_MAX} bytes; point TMPDIR at a directory with a shorter path.")

    @property
    def http(self) -> Path:
        return self.directory / "http.sock"

    @property
    def metrics(self) -> Path:
        return self.directory / "metrics.sock"

    @property
    def grpc_address(self) -> str:
        """What tritonserver's --grpc-address is given; it joins address and --grpc-port with ':', so with port
        0 the socket is named grpc.sock:0 (`grpc_target`)."""
        return f"unix:{self.directory / 'grpc.sock'}"

    @property
    def grpc_target(self) -> str:
        return f"{self.grpc_address}:0"

    def get(self, endpoint: Path, path: str, timeout_s: float | None = None) -> tuple[int, str | None, bytes]:
        """GET `path` from Triton's HTTP or metrics socket: (status, content type, body); OSError if nothing
        answers there."""
        conn = UnixHTTPConnection(endpoint, timeout_s)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.getheader("Content-Type"), response.read()
        finally:
            conn.close()


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP to a Unix socket."""

    def __init__(self, endpoint: Path, timeout_s: float | None):
        super().__init__("localhost", timeout=timeout_s)
        self.endpoint = endpoint

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(str(self.endpoint))


@dataclass
class Gateway:
    """What a handler needs to know: the upstream, the model's name, the limits, the key, the health."""

    upstream: Upstream
    model: str
    health: Health
    api_key: str | None
    max_body: int
    metrics: bool = False  # the metrics port: GET /metrics only
    max_connections: int = MAX_CONNECTIONS
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    calls: TritonCalls | None = None  # set once Triton is ready
    in_flight: int = 0  # generate / generate_stream requests being answered
    # Open connections: since when (time.monotonic) each has waited on its client, None while it is answered.
    waiting: dict[socket.socket, float | None] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class HttpGateway:
    """One listening port (the API or the metrics), bound at construction so a taken port fails early."""

    def __init__(self, address: str, port: int, gateway: Gateway, flag: str = "--http-port"):
        _Server.address_family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            self.server = _Server((address, port), _Handler)
        except OSError as e:
            raise RefusionError(_bind_error(flag, address, port, e)) from None
        gateway.max_connections = connections_allowed(gateway.max_connections)
        self.server.gateway = gateway
        self.gateway = gateway
        self._thread: threading.Thread | None = None

    def start(self, calls: TritonCalls) -> None:
        self.gateway.calls = calls
        self._thread = threading.Thread(target=self.server.serve_forever, name="refusion-http-gateway", daemon=True)
        self._thread.start()

    def drain(self, began: float) -> None:
        """Close the connections that have waited on their clients since before the drain `began` (its
        time.monotonic(), taken before the health turned draining; those answered close after their response),
        so that no keep-alive connection holds the shutdown. One accepted since is left to its handler, which
        answers its request with the draining 503: cut, a client that saw readiness fail and sent a request
        on a new connection got no answer at all."""
        with self.gateway.lock:  # held while cutting: a handler cannot turn busy between the check and the cut
            for conn, since in self.gateway.waiting.items():
                if since is not None and since < began:
                    _shut(conn)

    def close(self) -> None:
        if self._thread is not None:
            self.server.shutdown()
        self.server.server_close()
        with self.gateway.lock:
            conns = list(self.gateway.waiting)
        for conn in conns:
            _shut(conn)


def _bind_error(flag: str, address: str, port: int, e: OSError) -> str:
    if e.errno == 98:  # EADDRINUSE
        return (f"{flag} {port} on {address} is in use: another server answers there; stop it, or choose another "
                "port.")
    if e.errno == 99:  # EADDRNOTAVAIL
        return f"--address {address} is not an address of this host; give one of its own (or 0.0.0.0 for all)."
    return f"cannot listen on {address}:{port} for {flag} ({e.strerror})."


def _shut_longest_waiting(waiting: dict[socket.socket, float | None]) -> None:
    """Close the connection that has waited longest on its client, if one waits (the caller holds the lock)."""
    since = {conn: t for conn, t in waiting.items() if t is not None}
    if since:
        oldest = min(since, key=since.__getitem__)
        del waiting[oldest]  # counted out now: its thread ends as its read fails
        _shut(oldest)


def _shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Server(ThreadingHTTPServer):
    """One thread per connection, up to the gateway's max_connections."""

    daemon_threads = True
    request_queue_size = socket.SOMAXCONN  # connections not yet accepted (the default 5 resets bursts of clients)
    gateway: Gateway

    def process_request(self, request: Any, client_address: Any) -> None:
        g = self.gateway
        with g.lock:
            if len(g.waiting) >= g.max_connections:
                _shut_longest_waiting(g.waiting)
            full = len(g.waiting) >= g.max_connections
            if not full:
                g.waiting[request] = time.monotonic()
        if full:  # every connection is being answered
            body = b'{"error":"the server holds its limit of open connections; retry later."}'
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self.gateway.lock:
            self.gateway.waiting.pop(request, None)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client gone mid-answer (the only error a handler lets out): its request was cancelled


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    # TCP_NODELAY: an answer is two writes (its headers, then its body), and with Nagle on the second waited for the
    # client's delayed ACK of the first, ~40 ms on every request of a kept-open connection after its first
    disable_nagle_algorithm = True
    server_version = "refusion"
    timeout = WRITE_TIMEOUT_S  # reads take what is left of the request's deadline (_DeadlineReader)
    server: _Server
    deadline = 0.0  # time.monotonic() by which what is being read (headers, then body) must have arrived

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # Triton's log and the metrics say what happened; no line per request

    @property
    def gateway(self) -> Gateway:
        return self.server.gateway

    def setup(self) -> None:
        super().setup()
        self.rfile = io.BufferedReader(_DeadlineReader(self))

    def handle_one_request(self) -> None:
        self.deadline = time.monotonic() + self.gateway.header_timeout_s
        super().handle_one_request()

    def _waiting(self, waiting: bool) -> None:
        """Mark the connection waiting on its client (the drain and a full server may close it) or being
        answered (neither closes it then)."""
        with self.gateway.lock:
            if self.connection in self.gateway.waiting:
                self.gateway.waiting[self.connection] = time.monotonic() if waiting else None

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._route("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._route("POST")

    def _route(self, method: str) -> None:
        self._waiting(False)  # under the lock: a drain cuts the connection before this or not at all
        try:
            self._serve(method, self.path.split("?", 1)[0])
        except OSError:  # the client went away (or stopped reading) mid-answer
            self.close_connection = True
        finally:
            if self.gateway.health.draining:
                self.close_connection = True
            self._waiting(True)  # for its next request

    def _serve(self, method: str, path: str) -> None:
        g = self.gateway
        if g.metrics:
            if (method, path) != ("GET", "/metrics"):
                return self._error(404, f"{path} is not served here: the metrics port serves GET /metrics.")
            if self._authorized():
                self._forward_get(g.upstream.metrics, "/metrics")
            return None
        match = _MODEL_PATH.fullmatch(path)
        model, rest = (match.group(1), match.group(2) or "") if match else (None, "")
        if method == "GET" and (path in ("/v2/health/ready", "/v2/health/live") or (model == g.model and rest == "/ready")):
            live = path == "/v2/health/live" and g.health.failure is None
            if g.health.ready or live:
                return self._reply(200, b"")
            return self._error(503, f"not ready: {g.health.reason}.")
        if model is not None and model != g.model:
            return self._error(404, f"no model {model!r} here; this server serves {g.model!r}.")
        if method == "POST" and rest in ("/generate", "/generate_stream"):
            if self._authorized():
                self._generate(streaming=rest == "/generate_stream")
            return None
        if method == "GET" and (path == "/v2" or (model is not None and rest == "")):
            if self._authorized():
                self._forward_get(g.upstream.http, path)
            return None
        return self._error(404, f"{method} {path} is not served here: this server answers generate, generate_stream, "
                                "health, readiness and metadata (docs/serving.md).")

    # -- the pieces of an answer ------------------------------------------------------------
    def _authorized(self) -> bool:
        if authorized(self.headers.get("Authorization"), self.gateway.api_key):
            return True
        self._error(401, "this server needs its API key: send the header Authorization: Bearer KEY.",
                    {"WWW-Authenticate": "Bearer"})
        return False

    def _reply(self, status: int, body: bytes, content_type: str = "application/json",
               headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection or self.gateway.health.draining:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        self._reply(status, _json({"error": message}), headers=headers)

    def handle_expect_100(self) -> bool:
        """A client that asks before sending its body (curl does) learns of a refusal before it sends it."""
        if self._body_refusal() is not None:
            return True  # no 100 Continue: _body answers the refusal
        return super().handle_expect_100()

    def _body_refusal(self) -> tuple[int, str] | None:
        if "Transfer-Encoding" in self.headers:
            return 411, "send the body with a Content-Length (chunked bodies are not taken)."
        length = self._length()
        if length is None:
            return 411, "send the body with a Content-Length."
        if length > self.gateway.max_body:
            return 413, (f"the body is {length} bytes, over this server's limit of {self.gateway.max_body} "
                         "(no prompt that long fits the model's positions).")
        return None

    def _length(self) -> int | None:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            return None
        return length if length >= 0 else None

    def _body(self) -> bytes | None:
        """The request's body within the limit and its deadline, or None once an error has been answered."""
        refusal = self._body_refusal()
        if refusal is not None:
            self._refuse(*refusal)
            return None
        self.deadline = time.monotonic() + self.gateway.body_timeout_s
        length = self._length() or 0
        self._waiting(True)  # on the client again: a full server or the drain may close the connection meanwhile
        try:
            body = self.rfile.read(length)
        except TimeoutError:
            body = None
        finally:
            self._waiting(False)
        if body is None or len(body) < length:  # the deadline passed, or the client stopped sending
            self.close_connection = True
            self._error(408, f"the body did not arrive within {self.gateway.body_timeout_s:g} s of its headers; "
                             "send it whole.")
            return None
        return body

    def _refuse(self, status: int, message: str) -> None:
        """An error answered before the body is read. A body up to DISCARD_LIMIT is read and dropped first: a
        connection closed with bytes unread is reset, and the reset can reach the client before it reads the
        answer. A larger one, or one the client waits to send (Expect: 100-continue), closes the connection."""
        length = self._length()
        if length is not None and length <= DISCARD_LIMIT and self.headers.get("Expect", "").lower() != "100-continue":
            self.deadline = time.monotonic() + self.gateway.body_timeout_s
            while length > 0:
                length -= len(self.rfile.read(min(1 << 16, length)) or b"\0" * length)
        else:
            self.close_connection = True
        self._error(status, message)

    def _forward_get(self, endpoint: Path, path: str) -> None:
        try:
            status, content_type, body = self.gateway.upstream.get(endpoint, path)
        except OSError as e:
            return self._error(503, f"the model server does not answer ({e}); it is stopping or has stopped.")
        self._reply(status, body, content_type or "text/plain")

    # -- generate and generate_stream ---------------------------------------------------------
    def _generate(self, streaming: bool) -> None:
        g = self.gateway
        if g.health.draining or g.health.failure is not None or g.calls is None:
            return self._refuse(503, f"{g.health.reason}; send the request to another instance.")
        raw = self._body()
        if raw is None:
            return None
        try:
            body = read_json(read_json_object(raw), streaming)
        except RefusionError as e:
            return self._error(400, str(e))
        with g.lock:
            g.in_flight += 1
        try:
            generation = g.calls.generation(g.model, body)
            try:
                with _Hangup(self.connection, generation.cancel) as hangup:
                    self._relay(generation, streaming, hangup)
            finally:
                generation.close()
        finally:
            with g.lock:
                g.in_flight -= 1

    def _relay(self, events: Any, streaming: bool, hangup: _Hangup) -> None:
        """The request's events to the client: as they come (streaming) or the final one as the answer."""
        started = False
        for event in events:
            if "error" in event:
                status, message = _status(event["error"])
                if not started:
                    return self._error(status, message)
                return self._chunk(b"data: " + _json({"error": message}) + b"\n\n", last=True)
            if not streaming:
                if "finish_reason" in event:
                    return self._reply(200, _json(event))
                continue
            if not started:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                started = True
            final = "finish_reason" in event
            self._chunk(b"data: " + _json(event) + b"\n\n", last=final)
            if final:
                return None
        if hangup.gone:
            self.close_connection = True
            return None
        message = "the model server ended the request without a final response; it is stopping or has stopped."
        if not started:
            return self._error(503, message)
        return self._chunk(b"data: " + _json({"error": message}) + b"\n\n", last=True)

    def _chunk(self, data: bytes, last: bool = False) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) + (b"0\r\n\r\n" if last else b""))


def _json(value: dict[str, Any]) -> bytes:
    """JSON as Triton's HTTP endpoints write it (compact, keys sorted, UTF-8), so clients see no difference."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _status(message: str) -> tuple[int, str]:
    """An upstream error's HTTP status and its message: ours carry their kind (frontend.Final.coded); Triton's
    own (a stub that is not healthy, say) are the server's failure."""
    status, text = decode(message)
    return (status or Status.UNAVAILABLE).value, text


class _DeadlineReader(io.RawIOBase):
    """A handler's connection as a file whose reads wait no longer than what is left of the handler's deadline:
    the deadline bounds the whole request, however its bytes trickle in."""

    def __init__(self, handler: _Handler):
        self.handler = handler

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        conn = self.handler.connection
        left = self.handler.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        conn.settimeout(left)
        try:
            return conn.recv_into(buffer)
        finally:
            conn.settimeout(self.handler.timeout)  # writes keep their own timeout


class _Hangup:
    """While a request is answered: watch its client's socket, and when the client closes it, cancel the
    request (the model frees its KV region within a forward)."""

    def __init__(self, client: socket.socket, cancel: Callable[[], None]):
        self.client, self.cancel = client, cancel
        self.gone = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._watch, name="refusion-hangup", daemon=True)

    def __enter__(self) -> _Hangup:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._wake_w.send(b"x")
        self._thread.join()
        self._wake_r.close()
        self._wake_w.close()

    def _watch(self) -> None:
        if self._wake_r.fileno() in readable([self.client.fileno(), self._wake_r.fileno()]):
            return
        try:
            closed = self.client.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            closed = True
        if closed:  # (data instead: the client sent its next request early; it is still there)
            self.gone = True
            self.cancel()

"""The HTTP gateway without Triton: routes, the API key, the body limits, the statuses of errors, readiness,
hang-ups and the drain, over a fake of Triton's gRPC calls and a small stand-in for its HTTP metadata and
metrics. Whatever a test needs in flight is held by an event, never by time."""

from __future__ import annotations

import http.client
import json
import os
import resource
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from refusion.serve.triton import gateway as gateway_module
from refusion.serve.triton.gateway import Gateway, Health, HttpGateway, Upstream
from refusion.serve.triton.launcher import free_ports
from tests.serve.sockets import closed_by_server, trickled_until_cut

KEY = "k" * 24
MODEL = "refusion"
FINAL = {"model_name": MODEL, "model_version": "1", "text_output": "", "token_ids": [1, 2], "finish_reason": "length"}


class FakeGeneration:
    """Events from a script; with `hold`, it waits (for a cancel) before its first event."""

    def __init__(self, events: list[dict], hold: bool = False):
        self.events, self.hold = events, hold
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def close(self) -> None:
        pass

    def __iter__(self) -> Iterator[dict]:
        if self.hold:
            self.cancelled.wait(60)
            return
        yield from self.events


class FakeCalls:
    def __init__(self) -> None:
        self.next: FakeGeneration = FakeGeneration([FINAL])
        self.bodies: list[dict] = []

    def generation(self, model: str, body: dict) -> FakeGeneration:
        self.bodies.append(body)
        return self.next


class _Triton(BaseHTTPRequestHandler):
    """Triton's HTTP and metrics sockets as the gateway uses them: metadata and metrics."""

    def do_GET(self) -> None:  # noqa: N802
        body = b"refusion_requests_in_flight{model=\"refusion\"} 0\n" if self.path == "/metrics" else \
            json.dumps({"name": MODEL, "path": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


@pytest.fixture(scope="module")
def triton_http(tmp_path_factory) -> Iterator[Path]:
    """A directory with a stand-in for Triton's HTTP and metrics sockets, as an Upstream names them."""
    directory = tmp_path_factory.mktemp("triton")
    upstream = Upstream(directory)
    servers = [_UnixHTTPServer(str(path), _Triton) for path in (upstream.http, upstream.metrics)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield directory
    for server in servers:
        server.shutdown()
        server.server_close()


def _start(triton_http: Path, api_key: str | None = None, metrics: bool = False, max_body: int = 4096, **limits):
    health = Health(started=True)
    upstream = Upstream(triton_http)
    g = Gateway(upstream, MODEL, health, api_key, max_body, metrics=metrics, **limits)
    port = free_ports(1)[0]
    front = HttpGateway("127.0.0.1", port, g)
    calls = FakeCalls()
    front.start(calls)  # type: ignore[arg-type]
    return front, port, calls


@pytest.fixture
def gateway(triton_http):
    front, port, calls = _start(triton_http)
    yield front, port, calls
    front.close()


def request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body, headers or {})
        response = conn.getresponse()
        return response.status, response.read(), dict(response.getheaders())
    finally:
        conn.close()


def generate(port: int, body: dict | bytes, path: str = f"/v2/models/{MODEL}/generate", headers: dict | None = None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, answer, _ = request(port, "POST", path, data, headers)
    return status, answer


def test_generate_answers_with_the_final_event_and_streams_send_every_event(gateway):
    _, port, calls = gateway
    status, answer = generate(port, {"text_input": "hi", "max_tokens": 2})
    assert status == 200 and json.loads(answer) == FINAL
    assert calls.bodies[-1] == {"text_input": "hi", "max_tokens": 2}
    piece = {"model_name": MODEL, "model_version": "1", "text_output": "a"}
    calls.next = FakeGeneration([piece, FINAL])
    status, answer = generate(port, {"text_input": "hi", "stream": True}, f"/v2/models/{MODEL}/generate_stream")
    events = [json.loads(line[len(b"data: "):]) for line in answer.splitlines() if line.startswith(b"data: ")]
    assert status == 200 and events == [piece, FINAL]


@pytest.mark.parametrize("error, status, message", [
    ("RESOURCE_EXHAUSTED: the server holds 9 requests", 429, "the server holds 9 requests"),
    ("UNAVAILABLE: the server is shutting down", 503, "the server is shutting down"),
    ("INVALID_ARGUMENT: max_tokens=0 must be positive", 400, "max_tokens=0 must be positive"),
    ("INTERNAL: internal error: KeyError", 500, "internal error: KeyError"),
    ("Stub process 'refusion_0_0' is not healthy.", 503, "Stub process 'refusion_0_0' is not healthy."),
])
def test_errors_get_the_http_status_of_their_kind(gateway, error, status, message):
    _, port, calls = gateway
    calls.next = FakeGeneration([{"error": error}])
    got, answer = generate(port, {"text_input": "hi"})
    assert (got, json.loads(answer)) == (status, {"error": message})
    calls.next = FakeGeneration([{"error": error}])
    got, answer = generate(port, {"text_input": "hi", "stream": True}, f"/v2/models/{MODEL}/generate_stream")
    assert (got, json.loads(answer)) == (status, {"error": message})


def test_an_error_after_the_first_event_ends_the_stream_with_an_error_event(gateway):
    _, port, calls = gateway
    calls.next = FakeGeneration([{"text_output": "a"}, {"error": "INTERNAL: boom"}])
    status, answer = generate(port, {"text_input": "hi", "stream": True}, f"/v2/models/{MODEL}/generate_stream")
    assert status == 200 and answer.splitlines()[-2:] == [b'data: {"error":"boom"}', b""]


@pytest.mark.parametrize("body, status, message", [
    (b'{"text_input": ' + b"[" * 60000 + b"]" * 60000 + b"}", 413, "over this server's limit"),
    (b'{"text_input": ' + b"[" * 100 + b"]" * 100 + b"}", 400, "the body nests 101 deep, over the limit of 32"),
    (b"{", 400, "the body is not JSON"),
    (b"", 400, "the body is not JSON"),
    (b"[]", 400, "the body is a JSON list, not an object"),
    (b'"x"', 400, "the body is a JSON str, not an object"),
    (b'{"text_input": "a", "text_input": "b"}', 400, "the body gives 'text_input' twice"),
    (b'{"text_input": "a", "temperature": NaN}', 400, "the body holds NaN, which is not JSON"),
    (b'{"text_input": "\\udcff"}', 400, "text_input holds a lone surrogate"),
    (b'{"text_input": "\xff"}', 400, "the body is not UTF-8"),
    (b'{"text_input": "hi", "max_token": 5}', 400, "did you mean 'max_tokens'?"),
    (b'{"text_input": "hi", "max_tokens": 2147483648}', 400, "max_tokens=2147483648 does not fit TYPE_INT32"),
    (b'{"text_input": "hi", "stream": true}', 400, '"stream": true needs generate_stream'),
])
def test_bad_bodies_are_refused_before_triton_sees_them(triton_http, body, status, message):
    front, port, calls = _start(triton_http, max_body=100_000)
    try:
        got, answer = generate(port, body)
        assert got == status and message in json.loads(answer)["error"]
        assert calls.bodies == []
    finally:
        front.close()


def test_a_body_over_the_limit_is_refused_and_chunked_bodies_are_not_taken(gateway):
    _, port, _ = gateway
    big = json.dumps({"text_input": "x" * 10_000}).encode()
    assert generate(port, big)[0] == 413  # read and dropped: the client that sent it all sees the answer
    for headers in ({"Transfer-Encoding": "chunked"}, {}):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.putrequest("POST", f"/v2/models/{MODEL}/generate")
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders()
        if headers:
            conn.send(b"2\r\n{}\r\n0\r\n\r\n")
        response = conn.getresponse()
        assert response.status == 411 and "Content-Length" in json.loads(response.read())["error"]
        conn.close()


def test_expect_100_continue_learns_of_the_refusal_before_sending_its_body(gateway):
    _, port, _ = gateway
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(60)
    sock.sendall(f"POST /v2/models/{MODEL}/generate HTTP/1.1\r\nHost: x\r\nContent-Length: {10**9}\r\n"
                 "Expect: 100-continue\r\n\r\n".encode())
    head = sock.recv(4096)
    assert head.split(b"\r\n")[0].endswith(b"413 Request Entity Too Large") and b"100 Continue" not in head
    sock.close()


def test_only_generation_health_readiness_and_metadata_are_served(gateway):
    _, port, _ = gateway
    for method, path in [("POST", "/v2/systemsharedmemory/region/x/register"), ("GET", "/v2/systemsharedmemory/status"),
                         ("POST", "/v2/cudasharedmemory/region/x/register"), ("POST", "/v2/logging"), ("GET", "/v2/logging"),
                         ("GET", f"/v2/models/{MODEL}/config"), ("POST", "/v2/repository/models/refusion/load"),
                         ("POST", "/v2/repository/index"), ("GET", "/v2/models/stats"), ("GET", "/v2/trace/setting"),
                         ("POST", f"/v2/models/{MODEL}/infer"), ("GET", "/metrics")]:
        status, answer, _ = request(port, method, path, b"{}" if method == "POST" else None)
        assert status == 404 and " here" in json.loads(answer)["error"], (method, path)
    status, answer, _ = request(port, "POST", "/v2/models/other/generate", b"{}")
    assert status == 404 and "no model 'other' here" in json.loads(answer)["error"]
    assert request(port, "DELETE", "/v2")[0] == 501
    status, answer, _ = request(port, "GET", f"/v2/models/{MODEL}")
    assert status == 200 and json.loads(answer) == {"name": MODEL, "path": f"/v2/models/{MODEL}"}  # Triton's own


def test_with_a_key_everything_but_health_needs_it(triton_http):
    front, port, _ = _start(triton_http, api_key=KEY)
    try:
        for headers in ({}, {"Authorization": "Bearer " + "x" * 24}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
            status, answer, sent = request(port, "POST", f"/v2/models/{MODEL}/generate", b'{"text_input": "hi"}', headers)
            assert status == 401 and "API key" in json.loads(answer)["error"] and sent["WWW-Authenticate"] == "Bearer"
            assert request(port, "GET", f"/v2/models/{MODEL}", headers=headers)[0] == 401
        ok = {"Authorization": f"Bearer {KEY}"}
        assert generate(port, {"text_input": "hi"}, headers=ok)[0] == 200
        assert request(port, "GET", f"/v2/models/{MODEL}", headers=ok)[0] == 200
        for path in ("/v2/health/ready", "/v2/health/live", f"/v2/models/{MODEL}/ready"):
            assert request(port, "GET", path)[0] == 200
    finally:
        front.close()


def test_the_metrics_port_serves_metrics_alone_with_the_key_when_there_is_one(triton_http):
    front, port, _ = _start(triton_http, api_key=KEY, metrics=True)
    try:
        assert request(port, "GET", "/metrics")[0] == 401
        status, answer, _ = request(port, "GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert status == 200 and answer.startswith(b"refusion_requests_in_flight")
        assert request(port, "GET", "/v2/health/ready")[0] == 404
    finally:
        front.close()


def test_readiness_tells_the_truth(gateway):
    front, port, _ = gateway
    health = front.gateway.health
    ready = f"/v2/models/{MODEL}/ready"
    assert [request(port, "GET", p)[0] for p in ("/v2/health/ready", ready, "/v2/health/live")] == [200, 200, 200]
    health.failure = "the model's Python-backend stub (pid 1) died"
    assert [request(port, "GET", p)[0] for p in ("/v2/health/ready", ready, "/v2/health/live")] == [503, 503, 503]
    status, answer = generate(port, {"text_input": "hi"})
    assert status == 503 and "stub (pid 1) died" in json.loads(answer)["error"]
    health.failure, health.draining = None, True
    status, answer, _ = request(port, "GET", "/v2/health/ready")
    assert status == 503 and json.loads(answer) == {"error": "not ready: the server is shutting down."}
    assert request(port, "GET", "/v2/health/live")[0] == 200
    status, answer = generate(port, {"text_input": "hi"})
    assert status == 503 and "shutting down" in json.loads(answer)["error"]


@pytest.mark.parametrize("path", ["generate", "generate_stream"])
def test_a_client_that_hangs_up_cancels_its_request(gateway, path):
    _, port, calls = gateway
    calls.next = held = FakeGeneration([], hold=True)
    sock = socket.create_connection(("127.0.0.1", port))
    data = b'{"text_input": "hi"}'
    sock.sendall(f"POST /v2/models/{MODEL}/{path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    while not calls.bodies:
        threading.Event().wait(0.01)
    sock.close()
    assert held.cancelled.wait(60)


def test_each_connection_sends_without_waiting_for_acks(gateway):
    """TCP_NODELAY on every connection the gateway takes: an answer is two writes (headers, then body), and with
    Nagle on the second waited for the client's delayed ACK of the first, ~40 ms on each request of a kept-open
    connection after its first (httpx's keep-alive: 56 ms a request against 12-15 ms with it)."""
    front, port, _ = gateway
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    for _ in range(2):  # the same connection kept open
        conn.request("POST", f"/v2/models/{MODEL}/generate", json.dumps({"text_input": "hi"}).encode())
        assert conn.getresponse().read()
    with front.gateway.lock:
        (taken,) = front.gateway.waiting
    assert taken.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    conn.close()


def test_the_drain_closes_idle_keep_alive_connections(gateway):
    front, port, _ = gateway
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/v2/health/live")
    assert conn.getresponse().read() == b""
    front.gateway.health.draining = True
    front.drain(time.monotonic())
    assert conn.sock.recv(1) == b""  # closed by the server
    conn.close()


def test_the_drain_leaves_a_connection_accepted_since_to_answer_503(gateway):
    """A client that saw readiness fail and opened a new connection gets the draining 503, not a cut
    (test_sigterm_drains... lost one so: the launcher's drain came after the health turned)."""
    front, port, _ = gateway
    began = time.monotonic()
    front.gateway.health.draining = True
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.connect()
    deadline = time.monotonic() + 30
    while not front.gateway.waiting:  # accepted, its request not yet sent
        assert time.monotonic() < deadline, "the connection was never accepted"
        time.sleep(0.001)
    front.drain(began)
    conn.request("GET", "/v2/health/ready")
    response = conn.getresponse()
    assert response.status == 503 and b"shutting down" in response.read()
    conn.close()


def _wait_until_idle(front: HttpGateway) -> None:
    deadline = time.monotonic() + 30
    while True:
        with front.gateway.lock:
            if None not in front.gateway.waiting.values():
                return
        assert time.monotonic() < deadline, "a handler never marked its connection idle"
        time.sleep(0.001)


def test_the_drain_cuts_a_connection_only_while_no_handler_can_turn_it_busy(gateway, monkeypatch):
    """A connection idle when the drain looked may have taken a request since: cut outside the lock, a
    readiness answer lost its body after its headers (seen under load). The cut happens under the lock
    a handler takes to turn busy, so a handler is either done before it or starts after it."""
    front, port, _ = gateway
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/v2/health/live")
    assert conn.getresponse().read() == b""
    _wait_until_idle(front)  # the answer reaches the client before its handler marks the connection idle
    held_while_cutting = []
    cut = gateway_module._shut

    def checked_cut(sock):
        free = front.gateway.lock.acquire(blocking=False)
        if free:
            front.gateway.lock.release()
        held_while_cutting.append(not free)
        cut(sock)

    monkeypatch.setattr(gateway_module, "_shut", checked_cut)
    front.gateway.health.draining = True
    front.drain(time.monotonic())
    assert held_while_cutting == [True]
    assert conn.sock.recv(1) == b""
    conn.close()


def test_a_draining_refusal_reads_the_body_first_so_the_client_gets_the_answer(triton_http):
    """Refused unread, a body left in the socket resets the connection as it closes, and the reset can reach
    the client before it reads the 503 (test_sigterm_drains... lost one: "closed without response")."""
    front, port, _ = _start(triton_http, max_body=16 << 20)
    try:
        front.gateway.health.draining = True
        body = b'{"text_input": "' + b"x" * (8 << 20) + b'"}'  # more than the sockets buffer
        status, answer, _ = request(port, "POST", f"/v2/models/{MODEL}/generate", body)
        assert status == 503 and "shutting down" in json.loads(answer)["error"]
    finally:
        front.close()


def test_past_the_limit_with_every_connection_answered_a_new_one_gets_503(triton_http):
    front, port, calls = _start(triton_http, max_connections=1)
    calls.next = held = FakeGeneration([], hold=True)
    try:
        busy = socket.create_connection(("127.0.0.1", port))
        data = b'{"text_input": "hi"}'
        busy.sendall(f"POST /v2/models/{MODEL}/generate HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n"
                     .encode() + data)
        _wait_until(lambda: calls.bodies, "the request is being answered")
        status, answer, _ = request(port, "GET", "/v2/health/live")
        assert status == 503 and "open connections" in json.loads(answer)["error"]
        held.cancel()
        busy.close()
    finally:
        front.close()


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + 60  # a hang guard: each wait ends on an event of the server's
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_idle_connections_make_room_for_new_ones_longest_waiting_first(triton_http):
    """The probe's S15: connections that never finish a request cannot shut out readiness and generate."""
    front, port, _ = _start(triton_http, max_connections=3)
    waiting = front.gateway.waiting

    def open_waiting(data: bytes = b"") -> socket.socket:
        count = len(waiting)
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(data)
        _wait_until(lambda: len(waiting) == count + 1, "the connection is accepted")
        return sock

    try:
        silent = open_waiting()
        partial = open_waiting(b"GET /v2/health/re")
        kept = http.client.HTTPConnection("127.0.0.1", port, timeout=60)  # keep-alive, idle after its answer
        kept.request("GET", "/v2/health/live")
        assert kept.getresponse().read() == b""
        _wait_until(lambda: len(waiting) == 3 and None not in waiting.values(), "all three wait on their clients")
        spares = []
        for gone in (silent, partial):
            assert request(port, "GET", "/v2/health/ready")[0] == 200  # one more: the longest waiting made room
            assert closed_by_server(gone)
            _wait_until(lambda: len(waiting) == 2, "the answered connection is closed")
            spares.append(open_waiting())  # back at the limit, the next oldest is the next to go
        assert generate(port, {"text_input": "hi"})[0] == 200
        assert closed_by_server(kept.sock)
        for sock in (silent, partial, *spares):
            sock.close()
    finally:
        front.close()


def test_a_request_trickled_a_byte_at_a_time_is_cut_at_its_deadline(triton_http):
    """The probe's S15: the deadline is for the request line and headers together, not for each read."""
    front, port, _ = _start(triton_http, header_timeout_s=0.5)
    try:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            assert trickled_until_cut(sock, b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 60_000)
    finally:
        front.close()


def test_a_body_that_does_not_arrive_in_time_gets_408(triton_http):
    front, port, calls = _start(triton_http, body_timeout_s=0.5)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.sendall(f"POST /v2/models/{MODEL}/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{{"
                         .encode())  # the rest never comes: the outcome does not depend on speed
            answer = sock.makefile("rb").read()
        assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.5 s" in answer
        assert not calls.bodies
    finally:
        front.close()


def test_a_hang_up_is_seen_on_a_descriptor_past_1024(gateway):
    """The probe's S32: with a thousand connections open, select() failed on the client's descriptor and the
    request went on for a client that had gone."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the open-file limit ({hard}) leaves no descriptor past 1024")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # the next descriptors are past 1024
    try:
        test_a_client_that_hangs_up_cancels_its_request(gateway, "generate")
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_probes_quadratic_body_is_refused_at_once(triton_http):
    """The probe's S31: an unterminated run of escaped quotes took the nesting check time quadratic in its
    length (124 KB: 49 s, every gateway thread stalled). At 4 MB that is hours; linear, a fraction of a second."""
    front, port, _ = _start(triton_http, max_body=8 << 20)
    try:
        status, answer = generate(port, b'"' + b'\\"' * 2_000_000)
        assert status == 400 and "the body is not JSON" in json.loads(answer)["error"]
    finally:
        front.close()


def test_a_taken_port_or_a_foreign_address_is_refused_in_one_line(triton_http):
    front, port, _ = _start(triton_http)
    try:
        with pytest.raises(gateway_module.RefusionError, match=rf"--http-port {port} on 127.0.0.1 is in use"):
            HttpGateway("127.0.0.1", port, front.gateway)
        with pytest.raises(gateway_module.RefusionError, match="--address 192.0.2.1 is not an address of this host"):
            HttpGateway("192.0.2.1", free_ports(1)[0], front.gateway)
    finally:
        front.close()

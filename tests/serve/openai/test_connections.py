"""The OpenAI server's connections (serve/openai/connections.py) and its event loop under the reliability probe's
attacks (issue 32: O6, O7, O39): deadlines for a request's headers and body, idle connections that make room
for new ones, and a body parsed off the event loop. Each attack is held open while /health is asked: the
assertion is that health answers meanwhile, never how fast. Deadlines are set small through the server's
parameters; nothing waits on a sleep."""

from __future__ import annotations

import json
import resource
import socket
import threading

import pytest

from refusion.serve.openai import app as app_module
from tests.gate import ForwardGate
from tests.serve.openai.helpers import HANG_GUARD_S, connect, live, post, read_response, request_bytes, wait_until
from tests.serve.sockets import closed_by_server, cut, trickled_until_cut

CHAT_PATH = "/v1/chat/completions"
HI = {"model": "refusion", "messages": [{"role": "user", "content": "sort: 3 1 2"}], "max_tokens": 8}


def _open(server) -> int:
    return len(server._server.server_state.connections)


def _health(server) -> int:
    with connect(server) as sock:
        sock.sendall(request_bytes("/health", b"", method="GET"))
        return read_response(sock)[0]


def _held_open(server, data: bytes = b"") -> socket.socket:
    """A connection that sends `data` and no more, once the server has taken it."""
    count = _open(server)
    sock = connect(server)
    sock.sendall(data)
    wait_until(lambda: _open(server) == count + 1, "the server takes the connection")
    return sock


def test_a_connection_that_sends_no_request_is_closed_at_the_header_deadline(serve):
    server = serve(header_timeout_s=0.3)
    for data in (b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le"):
        with _held_open(server, data) as sock:  # the rest never comes: the outcome does not depend on speed
            assert closed_by_server(sock)
    assert _health(server) == 200


def test_a_request_trickled_a_byte_at_a_time_is_cut_at_its_deadline(serve):
    """The probe's O7 with partial headers: the deadline is for the line and headers together."""
    server = serve(header_timeout_s=0.5)
    with connect(server) as sock:
        assert trickled_until_cut(sock, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 60_000)


def test_a_body_no_route_reads_is_cut_at_its_deadline(serve):
    server = serve(header_timeout_s=0.3, body_timeout_s=0.3)
    with connect(server) as sock:  # /health answers without reading the 100 bytes announced, which never come
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n")
        assert read_response(sock)[0] == 200
        assert closed_by_server(sock)


def test_idle_connections_make_room_for_new_ones_longest_waiting_first(serve):
    """The probe's O7: past the limit, a new connection closes the one that has waited longest on its client,
    so that silent, half-sent and idle keep-alive connections cannot shut out /health or a request."""
    server = serve(max_connections=3)
    silent = _held_open(server)
    partial = _held_open(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    kept = _held_open(server, request_bytes("/health", b"", method="GET"))  # keep-alive, idle after its answer
    assert read_response(kept)[0] == 200
    spares = []
    for gone in (silent, partial):
        assert _health(server) == 200  # one more than the limit: the longest waiting made room
        assert closed_by_server(gone)
        wait_until(lambda: _open(server) == 2, "the connections closed are gone")
        spares.append(_held_open(server))  # back at the limit, the next oldest is the next to go
    assert post(server, CHAT_PATH, HI)[0] == 200
    assert closed_by_server(kept)
    for sock in (silent, partial, kept, *spares):
        sock.close()


def test_past_the_limit_with_every_connection_answered_a_new_one_gets_503(serve, gen):
    server = serve(max_connections=2)
    with ForwardGate(gen.runner):
        held = [_held_open(server, request_bytes(CHAT_PATH, json.dumps(HI).encode())) for _ in range(2)]
        wait_until(lambda: len(live(server)) == 2, "both requests are being answered")
        with connect(server) as sock:
            status, _, body = read_response(sock)
        assert status == 503 and "each being answered" in json.loads(body)["error"]["message"]
    for sock in held:
        assert read_response(sock)[0] == 200
        sock.close()


@pytest.mark.slow
def test_1100_silent_and_half_sent_connections_leave_health_and_requests_served(serve):
    """The probe's O7 as it ran: 1,030 connections that sent nothing or part of their headers got every request
    503 for as long as they were held. Here 1,100, held open while /health and a request are answered."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2600:
        pytest.skip(f"the open-file limit ({hard}) cannot hold 1,100 connections at both ends")
    server = serve()  # raises this process's soft limit to the hard one: the client ends live here too
    attack = []
    try:
        for i in range(1100):
            attack.append(socket.create_connection(("127.0.0.1", server.port), timeout=HANG_GUARD_S))
            if i % 2:
                attack[-1].sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
        wait_until(lambda: _open(server) >= 1024, "the server holds its limit of connections")
        assert _health(server) == 200
        assert post(server, CHAT_PATH, HI)[0] == 200
        assert sum(not cut(sock, b"") for sock in attack) > 1000  # the attack still holds its connections
    finally:
        for sock in attack:
            sock.close()


def test_a_body_is_parsed_off_the_event_loop_so_health_answers_meanwhile(serve, monkeypatch):
    """The probe's O6: the nesting check of a 124 KB body of escaped quotes ran 57 s on the event loop, and every
    request, /health too, waited. Parsing runs in a worker thread now: held there, it holds up nothing."""
    parsing, release = threading.Event(), threading.Event()
    parse = app_module.parse_json

    def held_parse(body: bytes):
        parsing.set()
        assert release.wait(HANG_GUARD_S)
        return parse(body)

    monkeypatch.setattr(app_module, "parse_json", held_parse)
    server = serve()
    answer: list = []
    attack = threading.Thread(target=lambda: answer.append(post(server, CHAT_PATH, b'"' + b'\\"' * 62_000)))
    attack.start()
    try:
        assert parsing.wait(HANG_GUARD_S)
        assert _health(server) == 200
    finally:
        release.set()
        attack.join(HANG_GUARD_S)
    status, _, body = answer[0]
    assert status == 400 and "the body is not JSON" in body["error"]["message"]


def test_verbose_logs_one_access_line_per_request(serve, capfd):
    """The probe's O39: --verbose printed no access line (uvicorn's loggers had no handler)."""
    server = serve(verbose=True)
    assert _health(server) == 200
    assert post(server, CHAT_PATH, HI)[0] == 200
    lines = [line for line in capfd.readouterr().err.splitlines() if "HTTP/1.1" in line]
    assert len(lines) == 2 and '"GET /health HTTP/1.1" 200' in lines[0]
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in lines[1]


def test_the_servers_side_of_each_connection_sends_without_waiting_for_acks(serve):
    """TCP_NODELAY on every connection the server takes. Without it (asyncio sets it only on sockets made with
    proto IPPROTO_TCP, and the server's listening socket, like those it accepts, is proto 0) an answer written in
    two parts waited for the client's ACK of the first, which a client delays up to 40 ms on a connection it keeps
    open: the openai client's second request took ~48 ms where its first took ~8."""
    server = serve()
    assert server.socket.proto == 0  # what asyncio's own setting skips
    with connect(server) as sock:
        for _ in range(2):  # the same connection kept open, as the clients keep it
            sock.sendall(request_bytes(CHAT_PATH, json.dumps(HI).encode()))
            assert read_response(sock)[0] == 200
        (taken,) = server._server.server_state.connections
        peer = taken.transport.get_extra_info("socket")
        assert peer.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0

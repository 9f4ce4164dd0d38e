"""Talking to a test OpenAI server below any client library: raw HTTP on a socket, and its state."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from refusion.runtime.generator import Generator
from refusion.serve.openai.server import OpenAIServer

HANG_GUARD_S = 60.0  # only guards against a hang: every wait below ends on an event of the server's


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {HANG_GUARD_S} s"
        time.sleep(0.005)


def live(server: OpenAIServer) -> list:
    """The runtime requests the server holds now."""
    with server.frontend._lock:
        return list(server.frontend._live)


def wait_idle(server: OpenAIServer) -> None:
    """Until no request is in flight and no KV region is held: nothing leaked."""
    wait_until(lambda: (server.frontend.metrics().requests_in_flight, server.frontend.metrics().kv_regions_in_use)
               == (0, 0) and not server.frontend._releasing, "requests or KV regions still held")


@contextmanager
def served(export: Path, **options: Any) -> Iterator[tuple[Generator, OpenAIServer]]:
    """A Generator over `export` (onnxruntime CPU, one thread; `options`: Generator.from_dir's) and a server over it,
    stopped idle, nothing held, when the block ends."""
    with Generator.from_dir(export, backend="ort-cpu", threads=1, **options) as gen:
        server = OpenAIServer(gen, port=0).start()
        try:
            yield gen, server
        finally:
            wait_idle(server)
            server.stop()


def hang_up(server: OpenAIServer, gen: Any, gate: Any, sock: socket.socket) -> Any:
    """With the request's first forward held at `gate`: close the client's socket, see the disconnect cancel the
    request, release the forward, and see it end with its KV region free. Returns the request."""
    (request,) = live(server)
    sock.close()
    wait_until(lambda: request.cancelled, "the disconnect cancels the request")
    gate.allow(1)  # the forward held when it went: the request ends at its next step, without another
    wait_until(lambda: request.done, "the cancelled request ends")
    assert gen.scheduler.regions_in_use == 0
    return request


def connect(server: OpenAIServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=HANG_GUARD_S)


def request_bytes(path: str, body: bytes, headers: dict[str, str] | None = None, method: str = "POST") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}",
             "Content-Type: application/json", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One whole response (Content-Length or chunked), as (status, headers, body)."""
    reader = sock.makefile("rb")
    status = int(reader.readline().split()[1])
    headers = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while (size := int(reader.readline().strip(), 16)):
            body += reader.read(size)
            reader.readline()
        reader.readline()
    else:
        body = reader.read(int(headers.get("content-length", 0)))
    return status, headers, body


def post(server: OpenAIServer, path: str, body: bytes | dict[str, Any],
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    """POST and read the answer; a JSON body comes back parsed."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    with connect(server) as sock:
        sock.sendall(request_bytes(path, data, headers))
        status, head, raw = read_response(sock)
    return status, head, json.loads(raw) if head.get("content-type", "").startswith("application/json") else raw


def read_event(reader) -> str:
    """The next server-sent event's data (a chunked response's framing skipped)."""
    while True:
        line = reader.readline()
        assert line, "the stream ended"
        if line.startswith(b"data: "):
            return line[len(b"data: "):].decode().strip()

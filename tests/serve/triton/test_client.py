"""`refusion-run client --api triton` against servers that misbehave: answers that are not JSON, a port out of
range, a server that never answers, and the API key it sends. No Triton: small stand-ins on loopback."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner

from refusion.tools.run_cli import cli


def _serve(answer: bytes, content_type: str = "application/json", seen: list | None = None):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            if seen is not None:
                seen.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _client(*args: str):
    return CliRunner().invoke(cli, ["client", "hi", "--api", "triton", *args])


@pytest.mark.parametrize("answer, streaming", [
    (b"<html>not json</html>", False), (b'{"text_output": "trunc', False),
    (b"data: <html>\n\n", True), (b"data: [1, 2]\n\n", True),
])
def test_an_answer_that_is_not_json_is_one_error_line(answer, streaming):
    server = _serve(answer, "text/event-stream" if streaming else "application/json")
    try:
        result = _client("--url", f"http://127.0.0.1:{server.server_address[1]}", *(["--stream"] if streaming else []))
        assert result.exit_code == 1 and result.output.startswith("error: the server at 127.0.0.1:")
        assert "is it a refusion-run serve server?" in result.output and "Traceback" not in result.output
    finally:
        server.shutdown()


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://127.0.0.1:-1", "http://127.0.0.1:abc"])
def test_a_port_out_of_range_is_one_error_line(url):
    result = _client("--url", url)
    assert result.exit_code == 1 and result.output.startswith(f"error: --url {url!r} has no valid port")


def test_a_server_that_never_answers_is_given_up_on_after_the_client_timeout():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()  # accepts (in the kernel), never answers
    try:
        port = listener.getsockname()[1]
        result = _client("--url", f"http://127.0.0.1:{port}", "--client-timeout", "0.2")
        assert result.exit_code == 1 and "sent nothing for 0.2 s" in result.output and "--client-timeout" in result.output
        assert _client("--client-timeout", "0").output.startswith("error: --client-timeout 0.0 must be a positive")
    finally:
        listener.close()


def test_the_api_key_is_sent_as_a_bearer_token(monkeypatch):
    seen: list = []
    server = _serve(json.dumps({"text_output": "x", "token_ids": [1], "finish_reason": "eos"}).encode(), seen=seen)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        key = "k" * 20
        assert _client("--url", url, "--api-key", key).exit_code == 0
        monkeypatch.setenv("REFUSION_API_KEY", "e" * 20)
        assert _client("--url", url).exit_code == 0
        assert seen == [f"Bearer {key}", f"Bearer {'e' * 20}"]
        assert _client("--url", url, "--api-key", "short").output.startswith("error: --api-key must be at least 16")
    finally:
        server.shutdown()

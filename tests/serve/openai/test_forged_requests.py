"""What a web page could make a browser send to the keyless default server (the reliability probe's O11, issue 32):
a form or text/plain POST, which needs no CORS preflight, and any request under the page's own name rebound to
this address (DNS rebinding), whose answer the page can then read. Both are refused; no CORS header is sent."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from refusion.tools.run_cli import cli
from tests.serve.openai.helpers import connect, post, read_response

CHAT_PATH = "/v1/chat/completions"
HI = {"model": "refusion", "messages": [{"role": "user", "content": "sort: 3 1 2"}], "max_tokens": 8}


def _send(server, path: str, body: bytes, headers: dict[str, str], method: str = "POST") -> tuple[int, dict, bytes]:
    """A request with exactly these headers (and Content-Length)."""
    lines = [f"{method} {path} HTTP/1.1", f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in headers.items())]
    with connect(server) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        return read_response(sock)


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
def test_a_body_not_declared_json_is_refused_with_415(serve, content_type):
    server = serve()
    headers = {"Host": "127.0.0.1"} | ({"Content-Type": content_type} if content_type else {})
    status, _, raw = _send(server, CHAT_PATH, json.dumps(HI).encode(), headers)
    error = json.loads(raw)["error"]
    assert status == 415 and "Content-Type: application/json" in error["message"], raw
    assert error["code"] == "unsupported_media_type" and error["type"] == "invalid_request_error"


def test_json_with_parameters_or_another_case_is_taken(serve):
    server = serve()
    for content_type in ("application/json; charset=utf-8", "Application/JSON"):
        status, _, raw = _send(server, CHAT_PATH, json.dumps(HI).encode(), {"Host": "127.0.0.1",
                                                                            "Content-Type": content_type})
        assert status == 200, raw


@pytest.mark.parametrize("path, method", [(CHAT_PATH, "POST"), ("/health", "GET"), ("/v1/models", "GET")])
def test_a_host_header_naming_another_site_is_refused(serve, path, method):
    server = serve()
    body = json.dumps(HI).encode() if method == "POST" else b""
    status, headers, raw = _send(server, path, body, {"Host": "evil.example", "Content-Type": "application/json",
                                                      "Origin": "http://evil.example"}, method)
    error = json.loads(raw)["error"]
    assert status == 400 and error["code"] == "invalid_host" and "'evil.example'" in error["message"]
    assert not [name for name in headers if name.startswith("access-control-")]


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:8000", "localhost:8000", "LOCALHOST", "robot.localhost",
                                  "[::1]:8000", "10.1.2.3:8000", "robot.lan:8000", "robot.lan."])
def test_ip_addresses_loopback_names_and_allowed_hosts_are_taken(serve, host):
    server = serve(allowed_hosts=("robot.lan",))
    status, _, raw = _send(server, "/health", b"", {"Host": host}, "GET")
    assert status == 200, raw


def test_any_host_is_taken_with_a_star(serve):
    server = serve(allowed_hosts=("*",))
    assert _send(server, "/health", b"", {"Host": "evil.example"}, "GET")[0] == 200


def test_no_cors_header_and_no_preflight(serve):
    server = serve()
    status, headers, _ = _send(server, CHAT_PATH, b"", {"Host": "127.0.0.1", "Origin": "http://evil.example",
                                                        "Access-Control-Request-Method": "POST",
                                                        "Access-Control-Request-Headers": "content-type"}, "OPTIONS")
    assert status == 405 and not [name for name in headers if name.startswith("access-control-")]
    status, headers, _ = post(server, CHAT_PATH, HI, {"Origin": "http://evil.example"})
    assert status == 200 and not [name for name in headers if name.startswith("access-control-")]


def test_allowed_host_is_the_openai_servers_option(tiny_export):
    result = CliRunner().invoke(cli, ["serve", str(tiny_export), "--api", "triton", "--allowed-host", "robot.lan"])
    assert result.exit_code != 0 and "--allowed-host is the OpenAI server's" in result.output

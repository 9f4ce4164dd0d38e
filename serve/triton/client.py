"""A small HTTP client of the served model (standard library only): Triton's generate extension,
`generate` (one response) and `generate_stream` (server-sent events). `refusion-run client`, the
serving bench and the tests use it.

    for event in stream_events("http://127.0.0.1:8000", "refusion", {"text_input": "hi", "stream": True}):
        print(event.get("text_output", ""), end="")
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from refusion.runtime.core.errors import RefusionError
from refusion.serve.triton.tensors import INPUTS

# Generator.submit's keywords by their tensor names on the wire.
TENSOR_OF_SETTING = {spec.setting: spec.name for spec in INPUTS if spec.setting}


def request_body(prompt: str, settings: Mapping[str, Any], **flags: Any) -> dict[str, Any]:
    """A request's JSON: the prompt, the decode settings given (None: the server's defaults) under their
    tensor names, and flags such as stream=True, chat=True, timeout_s=5."""
    body = {"text_input": prompt, **{k: v for k, v in flags.items() if v is not None}}
    body |= {TENSOR_OF_SETTING[name]: value for name, value in settings.items() if value is not None}
    return body


def generate(url: str, model: str, body: Mapping[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
    """The one response of POST /v2/models/MODEL/generate; the server's error as a RefusionError."""
    with _connection(url, timeout_s) as conn:
        response = _post(conn, f"/v2/models/{model}/generate", body)
        answer = json.loads(response.read() or b"{}")
        if response.status != 200 or "error" in answer:
            raise RefusionError(f"the server refused the request ({response.status}): {answer.get('error', answer)}")
        return answer


def stream_events(url: str, model: str, body: Mapping[str, Any], timeout_s: float = 600.0) -> Iterator[dict[str, Any]]:
    """Each event of POST /v2/models/MODEL/generate_stream as it arrives, through the final one (the one
    with finish_reason); an error event, a refusal, or a stream cut before the final event raises."""
    with _connection(url, timeout_s) as conn:
        response = _post(conn, f"/v2/models/{model}/generate_stream", body)
        if response.status != 200:
            raise RefusionError(f"the server refused the request ({response.status}): "
                                f"{response.read().decode(errors='replace')[:300]}")
        for line in response:
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[len(b"data: "):])
            if "error" in event:
                raise RefusionError(f"the server failed the request: {event['error']}")
            yield event
            if "finish_reason" in event:
                return
    raise RefusionError("the server closed the stream before its final response (was it stopped?)")


class _connection:
    """An HTTP connection to the server at `url`, closed on leaving."""

    def __init__(self, url: str, timeout_s: float):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname:
            raise RefusionError(f"--url {url!r} is not an http://HOST:PORT address of the server.")
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port or 8000, timeout=timeout_s)

    def __enter__(self) -> http.client.HTTPConnection:
        return self.conn

    def __exit__(self, *exc: object) -> None:
        self.conn.close()


def _post(conn: http.client.HTTPConnection, path: str, body: Mapping[str, Any]) -> http.client.HTTPResponse:
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        return conn.getresponse()
    except OSError as e:
        raise RefusionError(f"no server answered at {conn.host}:{conn.port} ({e}); start one with "
                            "refusion-run serve, or give its address with --url.") from e

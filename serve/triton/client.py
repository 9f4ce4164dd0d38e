"""A small HTTP client of the served model (standard library only): Triton's generate extension,
`generate` (one response) and `generate_stream` (server-sent events). `refusion-run client`, the
serving bench and the tests use it.

    for event in stream_events("http://127.0.0.1:8000", "refusion", {"text_input": "hi", "stream": True}):
        print(event.get("text_output", ""), end="")
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar
from urllib.parse import urlsplit

from refusion.runtime.core.errors import RefusionError
from refusion.serve.triton.tensors import INPUTS

# Generator.submit's keywords by their tensor names on the wire.
TENSOR_OF_SETTING = {spec.setting: spec.name for spec in INPUTS if spec.setting}
T = TypeVar("T")
CLIENT_TIMEOUT_S = 120.0  # how long a silent server is waited for (per event, when streaming)


def request_body(prompt: str, settings: Mapping[str, Any], **flags: Any) -> dict[str, Any]:
    """A request's JSON: the prompt, the decode settings given (None: the server's defaults) under their
    tensor names, and flags such as stream=True, chat=True, timeout_s=5."""
    body = {"text_input": prompt, **{k: v for k, v in flags.items() if v is not None}}
    body |= {TENSOR_OF_SETTING[name]: value for name, value in settings.items() if value is not None}
    return body


def generate(url: str, model: str, body: Mapping[str, Any], timeout_s: float = CLIENT_TIMEOUT_S,
             api_key: str | None = None) -> dict[str, Any]:
    """The one response of POST /v2/models/MODEL/generate; the server's error as a RefusionError."""
    with _connection(url, timeout_s) as conn:
        response = _post(conn, f"/v2/models/{model}/generate", body, api_key)
        answer = _json(conn, _read(conn, response.read))
        if response.status != 200 or not isinstance(answer, dict) or "error" in answer:
            error = answer.get("error", answer) if isinstance(answer, dict) else answer
            raise RefusionError(f"the server refused the request ({response.status}): {error}")
        return answer


def stream_events(url: str, model: str, body: Mapping[str, Any], timeout_s: float = CLIENT_TIMEOUT_S,
                  api_key: str | None = None) -> Iterator[dict[str, Any]]:
    """Each event of POST /v2/models/MODEL/generate_stream as it arrives, through the final one (the one
    with finish_reason); an error event, a refusal, or a stream cut before the final event raises."""
    with _connection(url, timeout_s) as conn:
        response = _post(conn, f"/v2/models/{model}/generate_stream", body, api_key)
        if response.status != 200:
            answer = _read(conn, response.read).decode(errors="replace")
            try:
                answer = json.loads(answer).get("error", answer)
            except (ValueError, AttributeError):
                pass
            raise RefusionError(f"the server refused the request ({response.status}): {answer[:300]}")
        while line := _read(conn, response.readline):
            if not line.startswith(b"data: "):
                continue
            event = _json(conn, line[len(b"data: "):])
            if not isinstance(event, dict):
                raise RefusionError(f"the server at {conn.host}:{conn.port} sent an event that is not a JSON object: "
                                    f"{line[:100]!r}; is it a refusion-run serve server?")
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
        try:
            port = parts.port
        except ValueError:
            raise RefusionError(f"--url {url!r} has no valid port; give http://HOST:PORT with a port in 1-65535.") \
                from None
        if parts.scheme != "http" or not parts.hostname:
            raise RefusionError(f"--url {url!r} is not an http://HOST:PORT address of the server.")
        self.timeout_s = timeout_s
        self.conn = http.client.HTTPConnection(parts.hostname, port or 8000, timeout=timeout_s)

    def __enter__(self) -> http.client.HTTPConnection:
        return self.conn

    def __exit__(self, *exc: object) -> None:
        self.conn.close()


def _post(conn: http.client.HTTPConnection, path: str, body: Mapping[str, Any],
          api_key: str | None) -> http.client.HTTPResponse:
    headers = {"Content-Type": "application/json"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        conn.request("POST", path, json.dumps(body), headers)
        return _read(conn, conn.getresponse)
    except RefusionError:
        raise
    except OSError as e:
        raise RefusionError(f"no server answered at {conn.host}:{conn.port} ({e}); start one with "
                            "refusion-run serve, or give its address with --url.") from e


def _read(conn: http.client.HTTPConnection, read: Callable[[], T]) -> T:
    """What `read` gets from the server; a silent server past the timeout, or a broken answer, as a RefusionError."""
    try:
        return read()
    except TimeoutError:
        raise RefusionError(f"the server at {conn.host}:{conn.port} sent nothing for {conn.timeout} s; it is stuck "
                            "or the request is long: raise --client-timeout.") from None
    except (OSError, http.client.HTTPException) as e:
        raise RefusionError(f"the connection to {conn.host}:{conn.port} broke ({type(e).__name__}: {e}).") from None


def _json(conn: http.client.HTTPConnection, data: bytes) -> Any:
    try:
        return json.loads(data or b"{}")
    except ValueError:
        raise RefusionError(f"the server at {conn.host}:{conn.port} answered something that is not JSON "
                            f"({data[:100]!r}); is it a refusion-run serve server?") from None

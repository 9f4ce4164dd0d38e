"""What the small HTTP clients of our servers share (standard library only; serve/triton/client.py speaks Triton's
generate extension, serve/openai/client.py the OpenAI API): a connection to --url, a JSON POST with the API key,
and reads that turn a silent, absent or broken server into one RefusionError naming it."""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar
from urllib.parse import urlsplit

from refusion.runtime.core.errors import RefusionError

T = TypeVar("T")
CLIENT_TIMEOUT_S = 120.0  # how long a silent server is waited for (per event, when streaming)


class Connection:
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
        self.conn = http.client.HTTPConnection(parts.hostname, port or 8000, timeout=timeout_s)

    def __enter__(self) -> http.client.HTTPConnection:
        return self.conn

    def __exit__(self, *exc: object) -> None:
        self.conn.close()


def post(conn: http.client.HTTPConnection, path: str, body: Mapping[str, Any],
         api_key: str | None) -> http.client.HTTPResponse:
    headers = {"Content-Type": "application/json"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        conn.request("POST", path, json.dumps(body), headers)
        return read(conn, conn.getresponse)
    except RefusionError:
        raise
    except OSError as e:
        raise RefusionError(f"no server answered at {conn.host}:{conn.port} ({e}); start one with "
                            "refusion-run serve, or give its address with --url.") from e


def read(conn: http.client.HTTPConnection, reader: Callable[[], T]) -> T:
    """What `reader` gets from the server; a silent server past the timeout, or a broken answer, as a RefusionError."""
    try:
        return reader()
    except TimeoutError:
        raise RefusionError(f"the server at {conn.host}:{conn.port} sent nothing for {conn.timeout} s; it is stuck "
                            "or the request is long: raise --client-timeout.") from None
    except (OSError, http.client.HTTPException) as e:
        raise RefusionError(f"the connection to {conn.host}:{conn.port} broke ({type(e).__name__}: {e}).") from None


def parse(conn: http.client.HTTPConnection, data: bytes) -> Any:
    try:
        return json.loads(data or b"{}")
    except ValueError:
        raise RefusionError(f"the server at {conn.host}:{conn.port} answered something that is not JSON "
                            f"({data[:100]!r}); is it a refusion-run serve server?") from None


def refusal(conn: http.client.HTTPConnection, response: http.client.HTTPResponse, other_api: str) -> RefusionError:
    """A refused request's error: the message of the server's answer (Triton's {"error": text} or OpenAI's
    {"error": {"message": text}}); a path the server does not route is taken for the other API (`other_api`
    names the flag that speaks it)."""
    raw = read(conn, response.read).decode(errors="replace")
    try:
        error = json.loads(raw).get("error", raw)
    except (ValueError, AttributeError):
        error = raw
    message = error.get("message", error) if isinstance(error, dict) else error
    hint = (f" (the server at {conn.host}:{conn.port} serves the other API: {other_api})"
            if response.status == 404 and ("no route " in str(message) or "is not served here" in str(message))
            else "")
    return RefusionError(f"the server refused the request ({response.status}): {str(message)[:300]}{hint}")


def events(conn: http.client.HTTPConnection, response: http.client.HTTPResponse) -> Iterator[Any]:
    """The JSON of each server-sent event (`data: ...` line) as it arrives, "[DONE]" as that string."""
    while line := read(conn, response.readline):
        if line.startswith(b"data: "):
            data = line[len(b"data: "):].strip()
            yield "[DONE]" if data == b"[DONE]" else parse(conn, data)

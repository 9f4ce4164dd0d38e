"""A small HTTP client of the served model (standard library only): Triton's generate extension,
`generate` (one response) and `generate_stream` (server-sent events). `refusion-run client`, the
serving bench and the tests use it.

    for event in stream_events("http://127.0.0.1:8000", "refusion", {"text_input": "hi", "stream": True}):
        print(event.get("text_output", ""), end="")
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from refusion.runtime.core.errors import RefusionError
from refusion.serve.http_client import CLIENT_TIMEOUT_S, Connection, events, parse, post, read, refusal
from refusion.serve.triton.tensors import INPUTS

# Generator.submit's keywords by their tensor names on the wire.
TENSOR_OF_SETTING = {spec.setting: spec.name for spec in INPUTS if spec.setting}
OTHER_API = "drop --api triton"  # what a path our OpenAI server does not route means


def request_body(prompt: str, settings: Mapping[str, Any], **flags: Any) -> dict[str, Any]:
    """A request's JSON: the prompt, the decode settings given (None: the server's defaults) under their
    tensor names, and flags such as stream=True, chat=True, timeout_s=5."""
    body = {"text_input": prompt, **{k: v for k, v in flags.items() if v is not None}}
    body |= {TENSOR_OF_SETTING[name]: value for name, value in settings.items() if value is not None}
    return body


def generate(url: str, model: str, body: Mapping[str, Any], timeout_s: float = CLIENT_TIMEOUT_S,
             api_key: str | None = None) -> dict[str, Any]:
    """The one response of POST /v2/models/MODEL/generate; the server's error as a RefusionError."""
    with Connection(url, timeout_s) as conn:
        response = post(conn, f"/v2/models/{model}/generate", body, api_key)
        if response.status != 200:
            raise refusal(conn, response, OTHER_API)
        answer = parse(conn, read(conn, response.read))
        if not isinstance(answer, dict) or "error" in answer:
            error = answer.get("error", answer) if isinstance(answer, dict) else answer
            raise RefusionError(f"the server refused the request ({response.status}): {error}")
        return answer


def stream_events(url: str, model: str, body: Mapping[str, Any], timeout_s: float = CLIENT_TIMEOUT_S,
                  api_key: str | None = None) -> Iterator[dict[str, Any]]:
    """Each event of POST /v2/models/MODEL/generate_stream as it arrives, through the final one (the one
    with finish_reason); an error event, a refusal, or a stream cut before the final event raises."""
    with Connection(url, timeout_s) as conn:
        response = post(conn, f"/v2/models/{model}/generate_stream", body, api_key)
        if response.status != 200:
            raise refusal(conn, response, OTHER_API)
        for event in events(conn, response):
            if not isinstance(event, dict):
                raise RefusionError(f"the server at {conn.host}:{conn.port} sent an event that is not a JSON object: "
                                    f"{event!r:.100}; is it a refusion-run serve server?")
            if "error" in event:
                raise RefusionError(f"the server failed the request: {event['error']}")
            yield event
            if "finish_reason" in event:
                return
    raise RefusionError("the server closed the stream before its final response (was it stopped?)")

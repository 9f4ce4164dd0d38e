"""A small HTTP client of the OpenAI server (standard library only) for `refusion-run client`: one prompt to
/v1/completions, or as a user message (`chat`) to /v1/chat/completions, whole or streamed. It answers as
serve/triton/client.py does, Triton's names for the same things (text_output, token_ids, finish_reason,
cached_prompt_tokens, output_log_probs), so that the command prints either alike; finish_reason is OpenAI's
(stop, length).

    for event in stream_events("http://127.0.0.1:8000", "refusion", request_body("hi", {}, stream=True)):
        print(event.get("text_output", ""), end="")
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.settings import SETTINGS
from refusion.serve.http_client import CLIENT_TIMEOUT_S, Connection, events, parse, post, read, refusal

OTHER_API = "add --api triton"  # what a path Triton's gateway does not serve means
# Each setting's OpenAI field: OpenAI's own name first (max_tokens, not max_completion_tokens).
_FIELD_OF_SETTING = {setting.name: setting.openai[0] for setting in SETTINGS if setting.openai}


def request_body(prompt: str, settings: Mapping[str, Any], *, chat: bool = False, stream: bool = False,
                 timeout_s: float | None = None) -> dict[str, Any]:
    """A request's JSON (the model is added by the call): the prompt, or it as a user message, and the settings
    given (None: the server's defaults) under their field names, with the answer's token ids asked for."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    body |= {"stream": stream, "return_token_ids": True}
    for name, value in settings.items():
        if name == "logprobs":
            if value:
                body["logprobs"] = True if chat else 0  # completions: 0 alternatives
        elif value is not None:
            body[_FIELD_OF_SETTING[name]] = value
    if timeout_s is not None:
        body["timeout_s"] = timeout_s
    return body


def generate(url: str, model: str, body: Mapping[str, Any], timeout_s: float = CLIENT_TIMEOUT_S,
             api_key: str | None = None) -> dict[str, Any]:
    """The answer, whole; the server's error as a RefusionError."""
    with Connection(url, timeout_s) as conn:
        response = post(conn, _path(body), {**body, "model": model}, api_key)
        if response.status != 200:
            raise refusal(conn, response, OTHER_API)
        answer = parse(conn, read(conn, response.read))
        try:
            choice = answer["choices"][0]
            final = {"text_output": choice["message"]["content"] if "message" in choice else choice["text"],
                     "token_ids": choice["token_ids"], "finish_reason": choice["finish_reason"],
                     "cached_prompt_tokens": answer["usage"]["prompt_tokens_details"]["cached_tokens"]}
            logprobs = choice["logprobs"]
        except (KeyError, IndexError, TypeError):
            raise RefusionError(f"the server at {conn.host}:{conn.port} answered JSON that is not a completion "
                                f"({str(answer)[:100]}); is it a refusion-run serve server?") from None
        if logprobs is not None:
            final["output_log_probs"] = [t["logprob"] for t in logprobs["content"]] if "message" in choice \
                else logprobs["token_logprobs"]
        return final


def stream_events(url: str, model: str, body: Mapping[str, Any], timeout_s: float = CLIENT_TIMEOUT_S,
                  api_key: str | None = None) -> Iterator[dict[str, Any]]:
    """Each piece of settled text as it arrives ({"text_output": piece}), then the final event (with token_ids
    and finish_reason); an error event, a refusal, or a stream cut before its end raises."""
    with Connection(url, timeout_s) as conn:
        response = post(conn, _path(body), {**body, "model": model}, api_key)
        if response.status != 200:
            raise refusal(conn, response, OTHER_API)
        for event in events(conn, response):
            if event == "[DONE]":
                return
            if not isinstance(event, dict):
                raise RefusionError(f"the server at {conn.host}:{conn.port} sent an event that is not a JSON object: "
                                    f"{event!r:.100}; is it a refusion-run serve server?")
            if "error" in event:
                error = event["error"]
                raise RefusionError(f"the server failed the request: {error.get('message', error)}")
            for choice in event.get("choices") or ():  # none in a usage chunk
                piece = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
                if choice.get("finish_reason"):
                    yield {"text_output": piece or "", "token_ids": choice.get("token_ids", []),
                           "finish_reason": choice["finish_reason"]}
                elif piece:
                    yield {"text_output": piece}
    raise RefusionError("the server closed the stream before its end (was it stopped?)")


def _path(body: Mapping[str, Any]) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"

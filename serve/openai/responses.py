"""What the OpenAI-compatible server sends: errors, completions, stream chunks and usage, in OpenAI's shapes.

Pure functions of a GenerationResult (or a piece of text) and the request's identity, so the tests and the
docs read the same shapes the server writes.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.request import GenerationResult

# Our finish reasons as OpenAI's: an answer that ended by itself "stop", one cut before its end "length"
# (its max_tokens, its timeout_s, or the drain's deadline).
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "timeout": "length", "cancelled": "length"}

# OpenAI's error types by HTTP status (the openai client raises BadRequestError, AuthenticationError, ... by status).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class ApiError(RefusionError):
    """A request refused with an HTTP status; `param` names the field at fault, `code` OpenAI's error code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


@dataclass(frozen=True)
class Reply:
    """The identity every object of one answer carries."""

    endpoint: str  # "chat" or "completions"
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def chat(self) -> bool:
        return self.endpoint == "chat"

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": f"{'chatcmpl' if self.chat else 'cmpl'}-{self.id}", "object": kind, "created": self.created,
                "model": self.model}

    def completion(self, result: GenerationResult, logprobs: list[dict[str, Any]] | dict[str, Any] | None,
                   token_ids: bool = False) -> dict[str, Any]:
        """The whole answer (not streamed); `token_ids`: with the generated ids (return_token_ids)."""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
            choice["logprobs"] = {"content": logprobs} if logprobs is not None else None
        else:
            choice["text"] = result.text
            choice["logprobs"] = logprobs
        choice["finish_reason"] = FINISH_REASONS[result.finish_reason]
        if token_ids:
            choice["token_ids"] = result.token_ids
        return {**self._head(False), "choices": [choice], "usage": usage(result)}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, first: bool = False,
              include_usage: bool = False, token_ids: list[int] | None = None) -> dict[str, Any]:
        """A streamed piece of text (`first`: the chat's opening chunk with the role), or the closing chunk
        (with `token_ids`, when asked for)."""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = ({"role": "assistant", "content": ""} if first
                               else {"content": text} if text is not None else {})
        else:
            choice["text"] = text or ""
        choice["logprobs"] = None
        choice["finish_reason"] = FINISH_REASONS[finish_reason] if finish_reason else None
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return {**self._head(True), "choices": [choice], **({"usage": None} if include_usage else {})}

    def usage_chunk(self, result: GenerationResult) -> dict[str, Any]:
        """stream_options.include_usage: the last chunk before [DONE], with no choices."""
        return {**self._head(True), "choices": [], "usage": usage(result)}


def usage(result: GenerationResult) -> dict[str, Any]:
    """Prompt tokens (those whose KV the prefix cache gave among them), generated tokens through the first EOS."""
    s = result.stats
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.tokens, "total_tokens": s.prompt_tokens + s.tokens,
            "prompt_tokens_details": {"cached_tokens": s.cached_prompt_tokens}}


def answer_logprobs(result: GenerationResult, eos_id: int, token_text: Any, chat: bool
                    ) -> list[dict[str, Any]] | dict[str, Any] | None:
    """The returned tokens' log-probabilities (the EOS and what follows it left out): chat's `content` list, or
    the completions endpoint's tokens / token_logprobs (no alternatives: `top_logprobs` is refused)."""
    if result.logprobs is None:
        return None
    ids = result.token_ids[: len(result.logprobs)]
    if eos_id in ids:
        ids = ids[: ids.index(eos_id)]
    texts = [token_text(t) for t in ids]
    # -9999.0: OpenAI's stand-in for an impossible token, where the float is not finite (JSON has no -inf)
    values = [float(v) if math.isfinite(v) else -9999.0 for v in result.logprobs[: len(ids)]]
    if chat:
        return [{"token": text, "logprob": value, "bytes": list(text.encode()), "top_logprobs": []}
                for text, value in zip(texts, values, strict=True)]
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    return {"tokens": texts, "token_logprobs": values, "top_logprobs": None, "text_offset": offsets}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: {...}` (or `data: [DONE]`) and the blank line that ends it."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()

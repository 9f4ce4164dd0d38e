"""What the OpenAI-compatible server sends: errors, completions, stream chunks and usage, in OpenAI's shapes.

Pure functions of a GenerationResult (or a piece of text) and the request's identity, so the tests and the
docs read the same shapes the server writes.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.request import GenerationResult

if TYPE_CHECKING:
    from refusion.runtime.tokenizer import Tokenizer

# Our finish reasons as OpenAI's: an answer that ended by itself "stop", one cut before its end "length"
# (its max_tokens, its timeout_s, or the drain's deadline), one that called a function "tool_calls"; a guide that
# allowed no token ended the answer where it stood: "dead_end", ours.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "timeout": "length", "cancelled": "length",
                  "tool_calls": "tool_calls", "dead_end": "dead_end"}

# OpenAI's error types by HTTP status (the openai client raises BadRequestError, AuthenticationError, ... by status;
# OpenAI's own API sends these types: a bad key and an unknown model are invalid requests too).
ERROR_TYPES = {429: "requests", 500: "server_error", 503: "server_error"}  # every other status: invalid_request_error


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
    fingerprint: str  # system_fingerprint: the served export's (its files' digest)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def chat(self) -> bool:
        return self.endpoint == "chat"

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": f"{'chatcmpl' if self.chat else 'cmpl'}-{self.id}", "object": kind, "created": self.created,
                "model": self.model, "system_fingerprint": self.fingerprint}

    def completion(self, results: list[GenerationResult], logprobs: list[Any] | None, n: int = 1,
                   token_ids: bool = False) -> dict[str, Any]:
        """The whole answer (not streamed): a choice per result, result i of prompt i // n; `logprobs`: each
        choice's (answer_logprobs), when asked for; `token_ids`: with the generated ids (return_token_ids)."""
        choices = []
        for index, result in enumerate(results):
            choice: dict[str, Any] = {"index": index}
            shown = logprobs[index] if logprobs is not None else None
            if self.chat:  # refusal: OpenAI's, always null here (the model has no refusals of its own)
                choice["message"] = {"role": "assistant", "content": result.text, "refusal": None}
                if result.tool_calls:
                    choice["message"] = {"role": "assistant", "content": result.text or None, "refusal": None,
                                         "tool_calls": result.tool_calls}
                choice["logprobs"] = {"content": shown, "refusal": None} if shown is not None else None
            else:
                choice["text"] = result.text
                choice["logprobs"] = shown
            choice["finish_reason"] = FINISH_REASONS[result.finish_reason]
            if token_ids:
                choice["token_ids"] = result.token_ids
            choices.append(choice)
        return {**self._head(False), "choices": choices, "usage": usage(results, n)}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, first: bool = False,
              include_usage: bool = False, token_ids: list[int] | None = None, index: int = 0,
              logprobs: Any = None, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """A streamed piece of choice `index`'s text (`first`: the chat's opening chunk with the role), with the
        log-probabilities of the tokens it completes (`logprobs`, when asked for), or the calls it made (each
        whole, with its index), or its closing chunk (with `token_ids`, when asked for)."""
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = ({"role": "assistant", "content": "", "refusal": None} if first
                               else {"content": text} if text is not None else {})
            if tool_calls:
                choice["delta"]["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
            choice["logprobs"] = {"content": logprobs, "refusal": None} if logprobs is not None else None
        else:
            choice["text"] = text or ""
            choice["logprobs"] = logprobs
        choice["finish_reason"] = FINISH_REASONS[finish_reason] if finish_reason else None
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return {**self._head(True), "choices": [choice], **({"usage": None} if include_usage else {})}

    def usage_chunk(self, results: list[GenerationResult], n: int = 1) -> dict[str, Any]:
        """stream_options.include_usage: the last chunk before [DONE], with no choices."""
        return {**self._head(True), "choices": [], "usage": usage(results, n)}


def usage(results: list[GenerationResult], n: int = 1) -> dict[str, Any]:
    """Tokens of the answers (each result i of prompt i // n): each prompt counted once (and those of its tokens
    the prefix cache gave), the tokens every choice returned (OpenAI's details of them: none is reasoning, audio
    or a prediction's)."""
    prompts = results[::n]
    prompt = sum(r.stats.prompt_tokens for r in prompts)
    completion = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.stats.cached_prompt_tokens for r in prompts)},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0, "accepted_prediction_tokens": 0,
                                          "rejected_prediction_tokens": 0}}


class TokenText:
    """Each token id's text, as logprobs name the token (the id decoded alone: a piece of a character reads U+FFFD),
    and its true bytes (`bytes_of`: the piece's own, so that a character spread over tokens is whole again in their
    bytes), from the tokenizer's vocabulary, read on first use. Without a tokenizer an id is its number."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self._vocabulary: tuple[list[bytes], frozenset[int]] | None = None

    def __call__(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def bytes_of(self, token_id: int) -> bytes:
        """The id's bytes; a special token's (or an id outside the vocabulary's) are those of its text, which
        the answer's text holds (nothing, where decoding skips it)."""
        if self.tokenizer is None:
            return self(token_id).encode()
        if self._vocabulary is None:
            pieces, specials = self.tokenizer.token_bytes()
            self._vocabulary = pieces, frozenset(specials)
        vocabulary, special = self._vocabulary
        if token_id in special or not 0 <= token_id < len(vocabulary):
            return self(token_id).encode()
        return vocabulary[token_id]


def _token_bytes(token_text: Callable[[int], str], token_id: int) -> list[int]:
    """`bytes` of a token in chat logprobs: its true bytes where `token_text` knows them (a TokenText), else its
    text's UTF-8."""
    return list(token_text.bytes_of(token_id) if isinstance(token_text, TokenText) else token_text(token_id).encode())


def answer_logprobs(result: GenerationResult, token_text: Callable[[int], str], chat: bool,
                    start: int = 0) -> list[dict[str, Any]] | dict[str, Any] | None:
    """The log-probabilities of the returned tokens from `start` on (a stream's closing chunk: those its pieces
    did not carry), with their alternatives when asked for; None when the request asked for none."""
    if result.logprobs is None:
        return None
    ids = result.token_ids[start:]
    others = result.top_logprobs[start:] if result.top_logprobs is not None else None
    offset = sum(len(token_text(t)) for t in result.token_ids[:start])
    return token_logprobs(ids, result.logprobs[start:], others, token_text, chat, offset)


def token_logprobs(ids: list[int], logprobs: list[float], alternatives: list[tuple[tuple[int, float], ...]] | None,
                   token_text: Callable[[int], str], chat: bool, offset: int = 0) -> list[dict[str, Any]] | dict[str, Any]:
    """Tokens' log-probabilities (and `alternatives`, (id, log-probability) each, the most likely first; None: not
    asked for) as OpenAI shows them: chat's `content` list (each token's text, and its true bytes where
    `token_text` is a TokenText), or the completions endpoint's tokens / token_logprobs / top_logprobs /
    text_offset (the text before the first token: `offset` characters)."""
    texts = [token_text(t) for t in ids]
    values = [_finite(v) for v in logprobs]
    others = alternatives if alternatives is not None else [()] * len(ids)
    if chat:
        return [{"token": text, "logprob": value, "bytes": _token_bytes(token_text, t),
                 "top_logprobs": [{"token": token_text(a), "logprob": _finite(lp),
                                   "bytes": _token_bytes(token_text, a)} for a, lp in alts]}
                for t, text, value, alts in zip(ids, texts, values, others, strict=True)]
    offsets = [offset + sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    top = [{token_text(t): _finite(lp) for t, lp in alts} for alts in others] if alternatives is not None else None
    return {"tokens": texts, "token_logprobs": values, "top_logprobs": top, "text_offset": offsets}


def _finite(value: float) -> float:
    """-9999.0: OpenAI's stand-in for an impossible token, where the float is not finite (JSON has no -inf)."""
    return float(value) if math.isfinite(value) else -9999.0


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: {...}` (or `data: [DONE]`) and the blank line that ends it."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()

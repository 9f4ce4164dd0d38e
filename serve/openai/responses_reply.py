"""What /v1/responses sends: the Response object, and its stream's events, in the shapes of OpenAI's Responses API
(the openai SDK's types/responses: Response, ResponseOutputMessage, ResponseFunctionToolCall, ResponseStreamEvent).

Pure functions of a GenerationResult (or a piece of text) and the request's identity (responses.py's Reply), so
the tests read the shapes the server writes. An answer is at most one message (its text, the text outside any
call) and then a function_call item per call; a streamed one is the same items, opened, filled and closed in that
order, between response.created / response.in_progress and response.completed (response.incomplete: cut by
max_output_tokens, its deadline or the drain; response.failed: it failed after it began).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from refusion.runtime.request import GenerationResult
from refusion.serve.openai.responses import ERROR_TYPES, FINISH_REASONS, Reply, usage

# A finish reason OpenAI's chat calls "length" (max_output_tokens, timeout_s or the drain's deadline cut the answer)
# makes the response incomplete; dead_end (the guide allowed no token) too, with our own reason.
INCOMPLETE = {"length": "max_output_tokens", "dead_end": "dead_end"}
# OpenAI's ResponseError codes by HTTP status (the rest: the request's fault, its prompt or settings).
ERROR_CODES = {429: "rate_limit_exceeded", 500: "server_error", 503: "server_error"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(result: GenerationResult) -> dict[str, Any]:
    """The chat's usage (responses.py) under the Responses API's names."""
    chat = usage([result])
    return {"input_tokens": chat["prompt_tokens"], "output_tokens": chat["completion_tokens"],
            "total_tokens": chat["total_tokens"],
            "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def incomplete_reason(result: GenerationResult) -> str | None:
    """Why the response is incomplete (None: it is complete)."""
    return INCOMPLETE.get(FINISH_REASONS[result.finish_reason])


@dataclass
class ResponseReply:
    """One response's identity and what it repeats of its request (`echo`: responses_request.py), and its items as
    they are made: `message_id` is the id of its message item, made on first use."""

    reply: Reply
    echo: dict[str, Any]
    message_id: str = field(default_factory=lambda: _id("msg"))

    def response(self, status: str, output: list[dict[str, Any]], result: GenerationResult | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The Response object: `status` in_progress, completed, incomplete or failed; `result`: the usage and the
        reason it is incomplete."""
        reason = incomplete_reason(result) if result is not None else None
        return {"id": f"resp_{self.reply.id}", "object": "response", "created_at": self.reply.created,
                "model": self.reply.model, "status": status, "error": error,
                "incomplete_details": {"reason": reason} if reason is not None else None,
                "output": output, **self.echo,
                "usage": response_usage(result) if result is not None else None}

    def message(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" \
            else []
        return {"type": "message", "id": self.message_id, "role": "assistant", "status": status, "content": content}

    def items(self, result: GenerationResult, text: str | None = None) -> list[dict[str, Any]]:
        """The answer's output items: its message (`text`, or the result's), unless it only called; then its calls."""
        text = result.text if text is None else text
        status = "incomplete" if incomplete_reason(result) else "completed"
        message = [self.message(text, status)] if text or not result.tool_calls else []
        return message + [call_item(call, "completed") for call in result.tool_calls or ()]

    def complete(self, result: GenerationResult) -> dict[str, Any]:
        """The whole response (not streamed)."""
        return self.response("incomplete" if incomplete_reason(result) else "completed", self.items(result), result)


def call_item(call: dict[str, Any], status: str, item_id: str | None = None) -> dict[str, Any]:
    """A chat tool call ({"id": "call_...", "function": {"name", "arguments"}}) as a function_call item."""
    return {"type": "function_call", "id": item_id or _id("fc"), "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if status != "in_progress" else "", "status": status}


def error_object(status: int, message: str, param: str | None) -> dict[str, Any]:
    """A failed response's `error` (the SDK's ResponseError)."""
    return {"code": ERROR_CODES.get(status, "invalid_prompt"), "message": message, "param": param,
            "type": ERROR_TYPES.get(status, "invalid_request_error")}


class ResponseEvents:
    """A streamed response's events, each numbered in order (`sequence_number`): `opening()`, then `text()` for each
    piece of the message's text as it settles, then `closing()` with the result (its calls, the text held back
    while a call could be open) or `failed()`."""

    def __init__(self, reply: ResponseReply):
        self.reply = reply
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # the items closed so far
        self.text_so_far: str | None = None  # the message's text once its item is open

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def opening(self) -> list[dict[str, Any]]:
        start = self.reply.response("in_progress", [])
        return [self.event("response.created", response=start), self.event("response.in_progress", response=start)]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.reply.message_id, "output_index": 0, "content_index": 0}

    def text(self, delta: str) -> list[dict[str, Any]]:
        """A piece of the message's text (the message is opened before its first)."""
        events = []
        if self.text_so_far is None:
            self.text_so_far = ""
            events += [self.event("response.output_item.added", output_index=0,
                                  item=self.reply.message("", "in_progress")),
                       self.event("response.content_part.added", **self._where(),
                                  part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]
        if delta:
            self.text_so_far += delta
            events.append(self.event("response.output_text.delta", **self._where(), delta=delta, logprobs=[]))
        return events

    def closing(self, result: GenerationResult, rest: str = "") -> list[dict[str, Any]]:
        """The end: `rest` of the message's text (held back while a call could be open), the message closed (opened
        first where the answer has no call and no text yet), each call whole, then response.completed or
        response.incomplete."""
        events = self.text(rest) if rest or (self.text_so_far is None and not result.tool_calls) else []
        status = "incomplete" if incomplete_reason(result) else "completed"
        if self.text_so_far is not None:
            item = self.reply.message(self.text_so_far, status)
            part = item["content"][0]
            events += [self.event("response.output_text.done", **self._where(), text=self.text_so_far, logprobs=[]),
                       self.event("response.content_part.done", **self._where(), part=part),
                       self.event("response.output_item.done", output_index=0, item=item)]
            self.output.append(item)
        for call in result.tool_calls or ():
            index, item_id = len(self.output), _id("fc")
            done = call_item(call, "completed", item_id)
            events += [self.event("response.output_item.added", output_index=index,
                                  item=call_item(call, "in_progress", item_id)),
                       self.event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                                  delta=done["arguments"]),
                       self.event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                                  name=done["name"], arguments=done["arguments"]),
                       self.event("response.output_item.done", output_index=index, item=done)]
            self.output.append(done)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return events + [self.event(kind, response=self.reply.response(status, self.output, result))]

    def failed(self, status: int, message: str, param: str | None) -> list[dict[str, Any]]:
        """A failure after the stream began: an error event, then response.failed with the items closed so far."""
        error = error_object(status, message, param)
        return [self.event("error", code=error["code"], message=message, param=param),
                self.event("response.failed", response=self.reply.response("failed", self.output, error=error))]


def sse_event(event: dict[str, Any]) -> bytes:
    """One server-sent event of a Responses stream: `event: TYPE`, its JSON, the blank line that ends it."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()

"""The OpenAI request fields the server takes, declared once as data (docs/serving.md's table is checked
against FIELDS), and a request body read against them.

Every field is OpenAI's, or one of ReFusion's own settings taken as an extra body field (`refusion=True`;
the openai client sends them with `extra_body={...}`); the fields that are request settings are made from their
rows in runtime/core/settings.py. Each feeds one keyword of Generator.submit, or asks
for what the server does anyway (`only`: n=1, presence_penalty=0). A field that is unknown, unsupported, of
the wrong JSON type or outside `only` is an ApiError 400 that names it; null counts as left out. Nothing
from a request is evaluated: messages fill the export's own chat template as plain strings.

`read_request` is pure (a parsed body in, a ServeRequest and what the reply needs out): the app calls it,
the tests call it directly.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.settings import SETTINGS
from refusion.serve.frontend import ServeRequest
from refusion.serve.openai.responses import ApiError
from refusion.serve.security import read_json_object

Kind = Literal["string", "bool", "int", "number", "strings", "ints", "object", "text", "json"]
CHAT, COMPLETIONS = "chat", "completions"
BOTH = (CHAT, COMPLETIONS)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}  # OpenAI's -> template's


@dataclass(frozen=True)
class ApiField:
    name: str
    kind: Kind
    help: str
    keyword: str | None = None  # the Generator.submit keyword it feeds
    endpoints: tuple[str, ...] = BOTH
    only: tuple[Any, ...] | None = None  # the only values taken: what the server does anyway
    refusion: bool = False  # ReFusion's own, an extra body field beside OpenAI's


def _setting_fields() -> tuple[ApiField, ...]:
    """The fields that are request settings, from their rows in runtime/core/settings.py: each of a setting's
    OpenAI names (OpenAI's own first; an alias after it), with its kind and help."""
    fields = []
    for setting in SETTINGS:
        for i, name in enumerate(setting.openai):
            help = setting.help if not i else f"the same as {setting.openai[0]} (give one of the two)"
            fields.append(ApiField(name, setting.kind, help, setting.name, _ENDPOINTS.get(name, BOTH),
                                   refusion=setting.openai_extra))
    return tuple(fields)


_ENDPOINTS = {"max_completion_tokens": (CHAT,), "logprobs": (CHAT,), "top_logprobs": (CHAT,)}  # the rest: both
FIELDS = (
    ApiField("model", "string", "the served model's name, as GET /v1/models lists it (required)"),
    ApiField("messages", "object", "the conversation: system / developer / user / assistant messages with text "
             "content, through the export's chat template (required)", endpoints=(CHAT,)),
    ApiField("prompt", "object", "the prompt: a string or token ids, or a list of prompts (a choice each; required)",
             endpoints=(COMPLETIONS,)),
    ApiField("stream", "bool", "send the answer as server-sent events as it settles, then `data: [DONE]`"),
    ApiField("stream_options", "object", "with stream: {\"include_usage\": true} adds a last chunk with the usage"),
    *_setting_fields(),
    ApiField("logprobs", "int", "each returned token's log-probability, and this many alternatives to it (at most "
             "the export's candidates)", "logprobs", endpoints=(COMPLETIONS,)),
    ApiField("n", "int", "choices per prompt: n requests that share the prompt's KV (through the prefix cache)"),
    ApiField("user", "string", "the end user's id: taken and not used"),
    ApiField("tools", "object", "functions the model may call, offered through its chat template (one whose template "
             "has a tool format)", "tools", endpoints=(CHAT,)),
    ApiField("tool_choice", "json", "auto (the default with tools), none, required, or {\"type\": \"function\", "
             "\"function\": {\"name\": ...}}: required and named calls follow the functions' parameter schemas",
             "tool_choice", endpoints=(CHAT,)),
    ApiField("parallel_tool_calls", "bool", "taken: a required or named call is one call", endpoints=(CHAT,)),
    ApiField("presence_penalty", "number", "no penalties: 0 only", only=(0,)),
    ApiField("frequency_penalty", "number", "no penalties: 0 only", only=(0,)),
    ApiField("echo", "bool", "the prompt is not repeated: false only", endpoints=(COMPLETIONS,), only=(False,)),
    ApiField("best_of", "int", "1 only", endpoints=(COMPLETIONS,), only=(1,)),
    ApiField("return_token_ids", "bool", "the answer's token ids in choices[i].token_ids (the last chunk's, "
             "streaming)", refusion=True),
)

# OpenAI's fields this server does not do, with why: refused by name rather than as unknown.
UNSUPPORTED = {
    "functions": "function calling (tools replace it)", "function_call": "function calling", "logit_bias": "logit biases",
    "audio": "audio", "modalities": "audio", "prediction": "predicted output",
    "reasoning_effort": "reasoning settings", "service_tier": "service tiers", "store": "stored completions",
    "metadata": "stored completions", "web_search_options": "web search",
    "suffix": "insertion", "prompt_cache_key": "cache keys (prompt prefixes are reused automatically)",
    "safety_identifier": "per-user tracking",
}


@dataclass(frozen=True)
class ApiRequest:
    """A request body as the server runs it: its jobs for the frontend (one per prompt), and what its reply
    needs. Its choices are each job n times: choice i is job i // n."""

    endpoint: str  # CHAT or COMPLETIONS
    jobs: tuple[ServeRequest, ...]
    n: int = 1
    include_usage: bool = False
    logprobs: bool = False
    token_ids: bool = False  # return_token_ids
    tool_calls: bool = False  # answers are read for tool calls (tools given, tool_choice not none)

    @property
    def stream(self) -> bool:
        return self.jobs[0].stream

    @property
    def choices(self) -> int:
        return len(self.jobs) * self.n


def parse_json(body: bytes) -> dict[str, Any]:
    """A request body as a JSON object (serve/security.py's reader: nesting, duplicate keys and NaN refused);
    anything else is a 400 that says what it is."""
    try:
        value = read_json_object(body)
    except RefusionError as e:
        raise ApiError(400, str(e).replace('{"text_input": "...", ...}', '{"model": ..., "messages": [...]}')) from None
    try:  # JSON's \ud800 escapes can name half a character, which no text holds
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"the body holds a lone surrogate ({e.object[e.start:e.end]!r}, a \\u escape of half a "
                            "character); send UTF-8 text.") from None
    return value


def read_request(endpoint: str, body: Mapping[str, Any], model: str) -> ApiRequest:
    """`body` of POST /v1/chat/completions (CHAT) or /v1/completions (COMPLETIONS) for the model named `model`."""
    fields = {f.name: f for f in FIELDS if endpoint in f.endpoints}
    for name in body:
        if name not in fields:
            raise _unknown(endpoint, name, fields)
    values = {name: _checked(fields[name], value) for name, value in body.items() if value is not None}
    if "model" not in values:
        raise ApiError(400, f"model is missing; send \"model\": \"{model}\" (GET /v1/models lists it).", "model")
    if values["model"] != model:
        raise ApiError(404, f"the model {values['model']!r} does not exist here; this server serves {model!r}.",
                       "model", "model_not_found")
    if "max_tokens" in values and "max_completion_tokens" in values:
        raise ApiError(400, "max_tokens and max_completion_tokens mean the same here; give one of them.",
                       "max_completion_tokens")
    n = values.get("n", 1)
    if n < 1:
        raise ApiError(400, f"n={n} must be at least 1 (choices per prompt).", "n")
    stream = values.get("stream", False)
    include_usage = _stream_options(values.get("stream_options"), stream)
    settings = {f.keyword: values[f.name] for f in fields.values() if f.keyword and f.name in values}
    if endpoint == COMPLETIONS and "logprobs" in settings:  # logprobs N: the tokens' own, and N alternatives
        settings["top_logprobs"], settings["logprobs"] = settings["logprobs"], True
    if settings.get("top_logprobs") and not settings.get("logprobs"):
        raise ApiError(400, "top_logprobs needs logprobs=true (the alternatives are reported beside each token's "
                            "log-probability).", "top_logprobs")
    timeout_s = settings.pop("timeout_s", None)
    if endpoint == CHAT:
        if "messages" not in values:
            raise ApiError(400, 'messages is missing; send "messages": [{"role": "user", "content": "..."}].',
                           "messages")
        jobs = [ServeRequest(None, messages=_messages(values["messages"]))]
    else:
        if "prompt" not in values:
            raise ApiError(400, 'prompt is missing; send "prompt": "..." (or token ids).', "prompt")
        jobs = [ServeRequest(text, prompt_ids=ids) for text, ids in _prompts(values["prompt"])]
    jobs = [replace(job, stream=stream, timeout_s=timeout_s, settings=settings) for job in jobs]
    calls = "tools" in settings and settings.get("tool_choice") != "none"
    return ApiRequest(endpoint, tuple(jobs), n, include_usage, bool(settings.get("logprobs", False)),
                      values.get("return_token_ids", False), calls)


def _unknown(endpoint: str, name: str, fields: Mapping[str, ApiField]) -> ApiError:
    if name in UNSUPPORTED:
        return ApiError(400, f"{name} is not supported by this server ({UNSUPPORTED[name]}); leave it out.", name)
    other = [f for f in FIELDS if f.name == name]
    if other:
        where = "/v1/chat/completions" if other[0].endpoints == (CHAT,) else "/v1/completions"
        return ApiError(400, f"{name} is a field of {where}, not of this endpoint; leave it out.", name)
    return ApiError(400, f"unknown field {name!r}; the fields taken here are {', '.join(dict.fromkeys(fields))} "
                         "(docs/serving.md).", name)


_EXPECTED = {"string": "a string", "bool": "true or false", "int": "an integer", "number": "a number",
             "strings": "a string or a list of strings", "ints": "a list of integers", "object": "an object",
             "text": "a string", "json": "an object (or its JSON text)"}


def _checked(spec: ApiField, value: Any) -> Any:
    """`value` if it is of the field's JSON type (and among `only`), else a 400 naming the field."""
    if spec.kind != "object" and not _is(spec.kind, value):
        raise ApiError(400, f"{spec.name} is {json.dumps(value)[:80]}; it must be {_EXPECTED[spec.kind]}: {spec.help}.",
                       spec.name)
    if spec.only is not None and value not in spec.only:
        raise ApiError(400, f"{spec.name}={json.dumps(value)[:80]} is not supported: {spec.help}.", spec.name)
    return value


def _is(kind: Kind, value: Any) -> bool:
    if kind in ("string", "text"):
        return isinstance(value, str)
    if kind == "json":
        return isinstance(value, (dict, str))
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind == "strings":
        return isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value))
    assert kind == "ints", kind
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _stream_options(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise ApiError(400, "stream_options is only taken with stream=true.", "stream_options")
    if not isinstance(options, dict):
        raise ApiError(400, 'stream_options must be an object, e.g. {"include_usage": true}.', "stream_options")
    unknown = [k for k in options if k != "include_usage"]
    if unknown:
        raise ApiError(400, f"stream_options.{unknown[0]} is not supported; the one option is include_usage.",
                       f"stream_options.{unknown[0]}")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise ApiError(400, f"stream_options.include_usage is {json.dumps(include)[:80]}; it must be true or false.",
                       "stream_options.include_usage")
    return include


_MESSAGE_KEYS = {"tool": ("role", "content", "name", "tool_call_id"), "assistant": ("role", "content", "name", "tool_calls")}


def _messages(value: Any) -> list[dict[str, Any]]:
    """OpenAI's messages as the chat template's: a role and text content each; an assistant's tool calls and a tool
    message's call id as they are (the template renders them)."""
    if not isinstance(value, list) or not value:
        raise ApiError(400, 'messages must be a non-empty list, e.g. [{"role": "user", "content": "hi"}].', "messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where} is not an object with a role and content.", where)
        role = message.get("role")
        if role not in ROLES:
            why = " (functions: send tools, and their results as role tool)" if role == "function" else ""
            raise ApiError(400, f"{where}.role is {json.dumps(role)[:40]}{why}; it must be one of "
                                f"{', '.join(ROLES)}.", f"{where}.role")
        keys = _MESSAGE_KEYS.get(role, ("role", "content", "name"))
        extra = [k for k in message if k not in keys]
        if extra:
            raise ApiError(400, f"{where}.{extra[0]} is not supported; a {role} message has {', '.join(keys)}.",
                           f"{where}.{extra[0]}")
        calls = message.get("tool_calls")
        content = message.get("content")
        if calls is not None:
            _check_calls(calls, f"{where}.tool_calls")
        out.append({"role": ROLES[role],
                    "content": "" if content is None and calls else _content(content, f"{where}.content")})
        if calls:
            out[-1]["tool_calls"] = calls
        if role == "tool" and message.get("tool_call_id") is not None:
            if not isinstance(message["tool_call_id"], str):
                raise ApiError(400, f"{where}.tool_call_id must be a string.", f"{where}.tool_call_id")
            out[-1]["tool_call_id"] = message["tool_call_id"]
        if message.get("name") is not None:  # the chat template reads it where it has a use for it
            if not isinstance(message["name"], str):
                raise ApiError(400, f"{where}.name must be a string.", f"{where}.name")
            out[-1]["name"] = message["name"]
    return out


def _check_calls(calls: Any, where: str) -> None:
    """An assistant's earlier calls: [{"id", "type": "function", "function": {"name", "arguments" (JSON text)}}]."""
    good = isinstance(calls, list) and all(
        isinstance(c, dict) and c.get("type", "function") == "function" and isinstance(c.get("function"), dict)
        and isinstance(c["function"].get("name"), str) and isinstance(c["function"].get("arguments", ""), str)
        for c in calls)
    if not good:
        raise ApiError(400, f'{where} must be a list of {{"id": ..., "type": "function", "function": {{"name": ..., '
                            '"arguments": "{...}"}}}}.', where)


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and set(part) == {"type", "text"} and part["type"] == "text"
                    and isinstance(part["text"], str)):
                kind = part.get("type") if isinstance(part, dict) else None
                raise ApiError(400, f"{where}[{j}] is not a text part ({{\"type\": \"text\", \"text\": \"...\"}})"
                                    + (f"; {kind} content is not supported" if kind and kind != "text" else "") + ".",
                               f"{where}[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{where} must be a string, or a list of text parts.", where)


def _prompts(value: Any) -> list[tuple[str | None, list[int] | None]]:
    """A completions prompt: text or token ids, or a list of them (a choice each), each as (text, ids)."""
    if isinstance(value, str):
        return [(value, None)]
    if _is_ids(value):
        return [(None, list(value))]
    if isinstance(value, list) and value and all(isinstance(p, str) or _is_ids(p) for p in value):
        return [(p, None) if isinstance(p, str) else (None, list(p)) for p in value]
    raise ApiError(400, "prompt must be a string or a list of token ids, or a list of those.", "prompt")


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)

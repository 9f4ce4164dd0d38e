"""A request of OpenAI's Responses API (POST /v1/responses) read into the chat endpoint's own request.

`read_responses` is pure (a parsed body in, the ApiRequest that /v1/chat/completions would run and what the
Response object repeats out): `instructions` becomes a system message first, `input` the conversation (its
`function_call` items an assistant's tool_calls, its `function_call_output` items role tool messages), `tools`
and `tool_choice` the chat's function shapes, `text.format` the chat's response_format, `max_output_tokens` its
max_tokens; then schema.read_request checks and reads it as it does a chat body, so both endpoints take the same
values. A field that is unknown, unsupported or of the wrong shape is an ApiError 400 that names it by its
Responses name (a chat name in an error from the chat reader or the runtime is turned back: `responses_name`).
Nothing is stored: `previous_response_id` and the other fields that need a stored response are refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from refusion.runtime.core.settings import DEFAULTS
from refusion.serve.openai.responses import ApiError
from refusion.serve.openai.schema import CHAT, FIELDS, ApiRequest, read_request

RESPONSES = "responses"  # the endpoint's name in the metrics

# The Responses fields taken, with what each does here (docs/serving.md's table is checked against it).
TAKEN = {
    "model": "the served model's name (required)",
    "input": "a string (one user message), or a list of items: messages (role user, system, developer or "
             "assistant; content a string or input_text / output_text parts), function_call and "
             "function_call_output items (required)",
    "instructions": "a system message before the input",
    "max_output_tokens": "at most this many new tokens (>= 1)",
    "temperature": "0 is greedy (the default here)",
    "top_p": "with temperature > 0: the nucleus cut",
    "stream": "server-sent events, `event: TYPE` and `data: {...}` each",
    "tools": "function tools, {\"type\": \"function\", \"name\", \"description\", \"parameters\", \"strict\"}",
    "tool_choice": "auto, none, required, or {\"type\": \"function\", \"name\": ...}",
    "text": "{\"format\": {\"type\": \"text\"}}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"name\", "
            "\"schema\", \"strict\"}",
    "parallel_tool_calls": "taken: a required or named call is one call",
    "store": "taken; nothing is stored (the response says \"store\": false)",
    "metadata": "taken and repeated in the response",
    "user": "the end user's id: taken and not used",
    "include": "[] only: nothing extra is included",
    "truncation": "\"disabled\" only: a prompt over the model's positions is refused",
    "stream_options": "taken: {\"include_obfuscation\": ...} (no obfuscation is sent)",
}
# Beside them, as on the chat endpoint: ReFusion's own settings (mode, gen_length, guided_json, ...) and seed.
EXTRAS = tuple(f.name for f in FIELDS if f.refusion and f.name != "return_token_ids") + ("seed",)

# Responses fields this server does not do, with why: refused by name rather than as unknown.
UNSUPPORTED = {
    "conversation": "conversations are stored objects, and nothing is stored here; send the conversation's items "
                    "in input",
    "background": "background responses (nothing is stored here)",
    "background_options": "background responses (nothing is stored here)",
    "prompt": "stored prompts (nothing is stored here); send instructions and input",
    "reasoning": "reasoning settings (the model has no reasoning mode)",
    "top_logprobs": "log-probabilities on this endpoint (/v1/chat/completions has them)",
    "max_tool_calls": "a cap on built-in tool calls (there are none here)",
    "service_tier": "service tiers", "safety_identifier": "per-user tracking",
    "prompt_cache_key": "cache keys (prompt prefixes are reused automatically)",
    "prompt_cache_retention": "cache settings (prompt prefixes are reused automatically)",
    "prompt_cache_options": "cache settings (prompt prefixes are reused automatically)",
    "context_management": "context management", "moderation": "moderation", "image": "image settings",
    "access_programs": "access programs",
}
PREVIOUS = "previous_response_id is not supported: send the conversation's items in input (nothing is stored here)."

_ROLES = ("user", "system", "developer", "assistant")
# The keys of each input item that the SDK's types have (what a client sends back as it got it); the rest: a 400.
_ITEM_KEYS = {
    "message": {"type", "role", "content", "id", "status", "phase"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status", "caller", "namespace"},
    "function_call_output": {"type", "call_id", "output", "id", "status", "caller", "name", "namespace"},
}
_PART_TEXT = {"input_text": "text", "output_text": "text", "refusal": "refusal"}  # a text part's type -> its text key
_PART_KEYS = {"input_text": {"type", "text", "prompt_cache_breakpoint"},
              "output_text": {"type", "text", "annotations", "logprobs"}, "refusal": {"type", "refusal"}}
_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
_FORMAT_KEYS = {"text": {"type"}, "json_object": {"type"},
                "json_schema": {"type", "name", "schema", "strict", "description"}}


@dataclass(frozen=True)
class ResponsesRequest:
    """A Responses body as the server runs it: the chat request it is (one job), what the Response object repeats
    of it, and where each chat message came from (`instructions`, `input`, `input[3]`: errors name that)."""

    api: ApiRequest
    echo: dict[str, Any]
    sources: tuple[str, ...]

    @property
    def stream(self) -> bool:
        return self.api.stream


def read_responses(body: Mapping[str, Any], model: str) -> ResponsesRequest:
    """`body` of POST /v1/responses for the model named `model`."""
    for name, value in body.items():
        if name == "previous_response_id" and value is not None:
            raise ApiError(400, PREVIOUS, name)
        left_out = value is None and (name in UNSUPPORTED or name == "previous_response_id")  # null: left out
        if name not in TAKEN and name not in EXTRAS and not left_out:
            raise _unknown(name)
    values = {name: value for name, value in body.items() if value is not None}
    chat: dict[str, Any] = {name: values[name] for name in ("model", "temperature", "top_p", "stream",
                                                            "parallel_tool_calls", "user", *EXTRAS) if name in values}
    if "max_output_tokens" in values:
        chat["max_tokens"] = _max_output_tokens(values["max_output_tokens"])
    for name, only, why in (("include", [], "nothing extra is included here"),
                            ("truncation", "disabled", "a prompt over the model's positions is refused")):
        if name in values and values[name] != only:
            raise ApiError(400, f"{name}={json.dumps(values[name])[:80]} is not supported: {json.dumps(only)} only "
                                f"({why}).", name)
    _check_stream_options(values.get("stream_options"))
    for name in ("store", "metadata"):
        _check_type(name, values.get(name), bool if name == "store" else dict)
    if "input" not in values:
        raise ApiError(400, 'input is missing; send "input": "..." or a list of items, e.g. '
                            '[{"role": "user", "content": "..."}].', "input")
    messages, sources = _conversation(values.get("instructions"), values["input"])
    chat["messages"] = messages
    tools = _tools(values.get("tools"))
    if tools is not None:
        chat["tools"] = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools]
    if "tool_choice" in values and (tools is not None or values["tool_choice"] not in ("auto", "none")):
        chat["tool_choice"] = _tool_choice(values["tool_choice"], tools)  # auto or none without tools: nothing to do
    text = _text(values.get("text"))
    if text["format"]["type"] != "text":
        chat["response_format"] = _response_format(text["format"])
    try:
        api = read_request(CHAT, chat, model)
    except ApiError as e:
        raise renamed(e, tuple(sources)) from None
    echo = {"instructions": values.get("instructions"), "max_output_tokens": values.get("max_output_tokens"),
            "metadata": values.get("metadata", {}), "parallel_tool_calls": values.get("parallel_tool_calls", True),
            "temperature": values.get("temperature", DEFAULTS["temperature"]),
            "top_p": values.get("top_p", DEFAULTS["top_p"]), "tool_choice": values.get("tool_choice", "auto"),
            "tools": tools or [], "text": text, "user": values.get("user"), "store": False,
            "truncation": "disabled", "previous_response_id": None, "background": False, "reasoning": None}
    return ResponsesRequest(api, echo, tuple(sources))


def _unknown(name: str) -> ApiError:
    if name in UNSUPPORTED:
        return ApiError(400, f"{name} is not supported by this server ({UNSUPPORTED[name]}); leave it out.", name)
    if any(f.name == name for f in FIELDS):
        return ApiError(400, f"{name} is a field of /v1/chat/completions, not of /v1/responses; leave it out "
                             "(docs/serving.md has the fields of each).", name)
    return ApiError(400, f"unknown field {name!r}; the fields taken here are {', '.join(TAKEN)}, and ReFusion's "
                         "own settings (docs/serving.md).", name)


def _check_type(name: str, value: Any, kind: type) -> None:
    if value is not None and not isinstance(value, kind):
        expected = {bool: "true or false", dict: "an object", str: "a string", list: "a list"}[kind]
        raise ApiError(400, f"{name} is {json.dumps(value)[:80]}; it must be {expected}.", name)


def _max_output_tokens(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ApiError(400, f"max_output_tokens={json.dumps(value)[:80]} must be an integer of at least 1 (the most "
                            "new tokens the answer may have).", "max_output_tokens")
    return value


def _check_stream_options(options: Any) -> None:
    if options is None:
        return
    _check_type("stream_options", options, dict)
    for key, value in options.items():
        if key != "include_obfuscation":
            raise ApiError(400, f"stream_options.{key} is not supported; the one option is include_obfuscation.",
                           f"stream_options.{key}")
        _check_type(f"stream_options.{key}", value, bool)


def _conversation(instructions: Any, given: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """The chat messages of `instructions` and `input`, and the Responses path each came from."""
    messages: list[dict[str, Any]] = []
    sources: list[str] = []
    if instructions is not None:
        _check_type("instructions", instructions, str)
        messages.append({"role": "system", "content": instructions})
        sources.append("instructions")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
        sources.append("input")
        return messages, sources
    if not isinstance(given, list) or not given:
        raise ApiError(400, 'input must be a string or a non-empty list of items, e.g. [{"role": "user", '
                            '"content": "..."}].', "input")
    calls: set[str] = set()
    for j, item in enumerate(given):
        where = f"input[{j}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where} is not an object: an input item is a message, a function_call or a "
                                "function_call_output.", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in _ITEM_KEYS:
            why = ("an item reference names a stored item, and nothing is stored here; send the item itself"
                   if kind == "item_reference" else
                   "input items here are messages, function_call and function_call_output items")
            raise ApiError(400, f"{where}.type is {json.dumps(kind)[:60]}: {why}.", f"{where}.type")
        extra = [k for k in item if k not in _ITEM_KEYS[kind]]
        if extra:
            raise ApiError(400, f"{where}.{extra[0]} is not supported; a {kind} item has "
                                f"{', '.join(sorted(_ITEM_KEYS[kind]))}.", f"{where}.{extra[0]}")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise ApiError(400, f"{where}.role is {json.dumps(role)[:40]}; it must be one of {', '.join(_ROLES)}.",
                               f"{where}.role")
            messages.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call_id, name, arguments = (_string(item, key, where) for key in ("call_id", "name", "arguments"))
            calls.add(call_id)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)  # the same turn: its text, then its calls
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            call_id = _string(item, "call_id", where)
            if call_id not in calls:
                raise ApiError(400, f"{where}.call_id={call_id!r} matches no function_call item before it in input; "
                                    "send the call's item, then its output.", f"{where}.call_id")
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        sources.append(where)
    return messages, sources


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{key} must be a string" + (" (the arguments' JSON text)" if key == "arguments"
                                                               else "") + ".", f"{where}.{key}")
    return value


def _text_of(content: Any, where: str) -> str:
    """A message's text: a string, or text parts (input_text, output_text, refusal) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise ApiError(400, f"{where} must be a string, or a list of input_text parts.", where)
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _PART_TEXT:
            shown = f"; {kind} content is not supported (text only)" if isinstance(kind, str) else ""
            raise ApiError(400, f"{where}[{k}] is not a text part ({{\"type\": \"input_text\", \"text\": \"...\"}})"
                                f"{shown}.", f"{where}[{k}]")
        assert isinstance(part, dict)
        extra = [key for key in part if key not in _PART_KEYS[kind]]
        if extra:
            raise ApiError(400, f"{where}[{k}].{extra[0]} is not supported in a {kind} part.", f"{where}[{k}].{extra[0]}")
        text = part.get(_PART_TEXT[kind])
        if not isinstance(text, str):
            raise ApiError(400, f"{where}[{k}].{_PART_TEXT[kind]} must be a string.", f"{where}[{k}].{_PART_TEXT[kind]}")
        texts.append(text)
    return "".join(texts)


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """Function tools in the Responses shape, checked (the runtime checks names and parameters after)."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise ApiError(400, 'tools must be a list of {"type": "function", "name": ..., "parameters": {...}}.', "tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ApiError(400, f"{where}.type is {json.dumps(kind)[:60]}: only function tools are supported here "
                                '({"type": "function", "name": ..., "parameters": {...}}).', f"{where}.type")
        assert isinstance(tool, dict)
        extra = [k for k in tool if k not in _TOOL_KEYS and tool[k] is not None]
        if extra:
            raise ApiError(400, f"{where}.{extra[0]} is not supported; a function tool has "
                                f"{', '.join(sorted(_TOOL_KEYS))}.", f"{where}.{extra[0]}")
        if not isinstance(tool.get("name"), str):
            raise ApiError(400, f"{where}.name must be a string.", f"{where}.name")
        for key, kind_of in (("description", str), ("parameters", dict), ("strict", bool)):
            _check_type(f"{where}.{key}", tool.get(key), kind_of)
        out.append({k: v for k, v in tool.items() if k in _TOOL_KEYS and v is not None})
    return out


def _tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> Any:
    """The Responses tool_choice as the chat's: the same strings, {"type": "function", "name"} nested."""
    if isinstance(choice, str):
        return choice  # the runtime names a string it does not take
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) <= {"type", "name"}:
        name = choice.get("name")
        names = [t["name"] for t in tools or []]
        if name not in names:
            raise ApiError(400, f"tool_choice names the function {name!r}, which is not one of the tools "
                                f"({', '.join(names) or 'none given'}).", "tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    raise ApiError(400, f"tool_choice is {json.dumps(choice)[:80]}; it must be auto, none, required or "
                        '{"type": "function", "name": ...} (function tools only).', "tool_choice")


def _text(text: Any) -> dict[str, Any]:
    """`text` checked: {"format": ...}, the format {"type": "text"} where left out."""
    if text is None:
        return {"format": {"type": "text"}}
    _check_type("text", text, dict)
    for key, value in text.items():
        if key != "format" and value is not None:
            raise ApiError(400, f"text.{key} is not supported; text takes format.", f"text.{key}")
    form = text.get("format")
    if form is None:
        return {"format": {"type": "text"}}
    kind = form.get("type") if isinstance(form, dict) else None
    if kind not in _FORMAT_KEYS:
        raise ApiError(400, f"text.format.type is {json.dumps(kind)[:60]}; it must be text, json_object or "
                            "json_schema.", "text.format.type")
    assert isinstance(form, dict)
    extra = [k for k in form if k not in _FORMAT_KEYS[kind] and form[k] is not None]
    if extra:
        raise ApiError(400, f"text.format.{extra[0]} is not a field of a {kind} format; it has "
                            f"{', '.join(sorted(_FORMAT_KEYS[kind]))}.", f"text.format.{extra[0]}")
    if kind == "json_schema":
        if not isinstance(form.get("schema"), dict):
            raise ApiError(400, "text.format.schema must be the JSON schema, an object.", "text.format.schema")
        if not isinstance(form.get("name"), str):
            raise ApiError(400, "text.format.name must be a string (the schema's name).", "text.format.name")
    return {"format": {k: v for k, v in form.items() if v is not None}}


def _response_format(form: dict[str, Any]) -> dict[str, Any]:
    if form["type"] == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {k: v for k, v in form.items() if k != "type"}}


# A chat name, as the chat reader or the runtime says it, and the Responses name for it.
_CHAT_NAMES = ((re.compile(r"\bresponse_format\.json_schema\b"), "text.format"),
               (re.compile(r"\bresponse_format\b"), "text.format"),
               (re.compile(r"\bmax_tokens\b"), "max_output_tokens"),
               (re.compile(r"\b(tools\[\d+\])\.function\b"), r"\1"),
               (re.compile(re.escape('{"type": "function", "function": {"name": ...}}')), '{"type": "function", "name": ...}'))
_MESSAGE = re.compile(r"\bmessages\[(\d+)\]")
_LEADING = re.compile(r"([a-z_]+)((?:\[\d+\])?(?:\.[a-z_]+)*)(?=[ =:])")  # a message's first words: `tools[0].name=...`


def responses_name(text: str, sources: tuple[str, ...] = ()) -> str:
    """An error's message or param with the chat's names for the request's fields turned into the Responses names
    (`messages[i]`: the input item it came from)."""
    for pattern, name in _CHAT_NAMES:
        text = pattern.sub(name, text)
    return _MESSAGE.sub(lambda m: sources[int(m[1])] if int(m[1]) < len(sources) else m[0], text)


def renamed(error: ApiError, sources: tuple[str, ...] = ()) -> ApiError:
    """`error` (the chat reader's, or the runtime's turned into one) with the Responses names."""
    message = responses_name(error.message, sources)
    param = responses_name(error.param, sources) if error.param is not None else None
    leading = _LEADING.match(message)
    if param is None and leading is not None and (leading[1] in TAKEN or leading[1] in EXTRAS):
        param = leading[0]  # the field the message names first (`tools[1].name='x' is given twice`)
    return ApiError(error.status, message, param, error.code, error.headers)

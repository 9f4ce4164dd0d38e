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
from refusion.runtime.core.nesting import MAX_JSON_DEPTH, json_depth
from refusion.runtime.core.settings import BY_NAME, GUIDES, SETTINGS
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
    ApiField("response_format", "json", "OpenAI's response_format: {\"type\": \"json_object\"}, or {\"type\": "
             "\"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}} (text: no guide), a json_schema guide"),
    ApiField("logprobs", "int", "each returned token's log-probability, and this many alternatives to it (at most "
             "the export's candidates)", "logprobs", endpoints=(COMPLETIONS,)),
    ApiField("n", "int", "choices per prompt: n requests that share the prompt's KV (through the prefix cache)"),
    ApiField("user", "string", "the end user's id: taken and not used"),
    ApiField("tools", "object", "functions the model may call, offered through its chat template (one whose template "
             "has a tool format)", "tools", endpoints=(CHAT,)),
    ApiField("tool_choice", "json", "auto (the default with tools), none, required, {\"type\": \"function\", "
             "\"function\": {\"name\": ...}}, or {\"type\": \"allowed_tools\", \"allowed_tools\": {\"mode\": "
             "\"auto\" or \"required\", \"tools\": [...]}} (only the functions listed offered): required and named "
             "calls follow the functions' parameter schemas", "tool_choice", endpoints=(CHAT,)),
    ApiField("parallel_tool_calls", "bool", "taken: a required or named call is one call", endpoints=(CHAT,)),
    ApiField("presence_penalty", "number", "no penalties: 0 only", only=(0,)),
    ApiField("frequency_penalty", "number", "no penalties: 0 only", only=(0,)),
    ApiField("echo", "bool", "the prompt is not repeated: false only", endpoints=(COMPLETIONS,), only=(False,)),
    ApiField("best_of", "int", "1 only", endpoints=(COMPLETIONS,), only=(1,)),
    ApiField("structured_outputs", "object", "vLLM's guide field: {\"json\": schema} or regex, choice, grammar, "
             "json_object (true: any JSON object), the same guides as the guided_* fields; one guide a request",
             refusion=True),
    ApiField("return_token_ids", "bool", "the answer's token ids in choices[i].token_ids (the last chunk's, "
             "streaming)", refusion=True),
)

ANY_OBJECT = '{"type":"object"}'  # json_object (response_format's, structured_outputs'): any JSON object
# vLLM's structured_outputs keys: each the guide setting it gives (json_object: true gives any JSON object).
STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                      "json_object": "json_schema"}

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
    # (setting, the field it was sent as) where a field of the client's became a setting of another name (a
    # response_format: json_schema), so that a refusal names what the client sent
    sent_as: tuple[tuple[str, str], ...] = ()

    def as_client(self, message: str, field: str | None) -> tuple[str, str | None]:
        """A runtime refusal's message and field with a translated setting named as the client sent it."""
        for setting, sent in self.sent_as:
            if field is not None and (field == setting or field.startswith(setting + ".")):
                return (sent + message[len(setting):] if message.startswith(setting) else message,
                        sent + field[len(setting):])
        return message, field

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
    guides, named = _structured_outputs(values)
    schema, sent = _response_format(values.get("response_format"))
    # one guide a request: the OpenAI-only fields' beside each other and the guided_* fields (those alone the
    # runtime refuses two of)
    given = [*named, *(["response_format"] if schema is not None else []),
             *(name for setting in GUIDES for name in setting.openai if values.get(name) is not None)]
    if ("structured_outputs" in values or schema is not None) and len(given) > 1:
        raise ApiError(400, f"{given[0]} and {given[1]} both ask for structured output; a request follows one guide: "
                            "give one of them.", given[0])
    settings.update(guides)
    sent_as = dict(zip(guides, named))
    if schema is not None:
        settings["json_schema"], sent_as = schema, {"json_schema": sent}
    if isinstance(settings.get("tool_choice"), dict) and settings["tool_choice"].get("type") == "allowed_tools":
        settings["tools"], settings["tool_choice"] = _allowed_tools(settings["tool_choice"], settings.get("tools"))
    if endpoint == COMPLETIONS and "logprobs" in settings:  # logprobs N: the tokens' own, and N alternatives
        settings["top_logprobs"], settings["logprobs"] = settings["logprobs"], True
    if settings.get("top_logprobs") and not settings.get("logprobs"):
        raise ApiError(400, "top_logprobs needs logprobs=true (the alternatives are reported beside each token's "
                            "log-probability).", "top_logprobs")
    if endpoint == CHAT:
        if "messages" not in values:
            raise ApiError(400, 'messages is missing; send "messages": [{"role": "user", "content": "..."}].',
                           "messages")
        jobs = [ServeRequest(None, messages=_messages(values["messages"]))]
    else:
        if "prompt" not in values:
            raise ApiError(400, 'prompt is missing; send "prompt": "..." (or token ids).', "prompt")
        jobs = [ServeRequest(text, prompt_ids=ids) for text, ids in _prompts(values["prompt"])]
    jobs = [replace(job, stream=stream, settings=settings) for job in jobs]
    calls = "tools" in settings and settings.get("tool_choice") != "none"
    return ApiRequest(endpoint, tuple(jobs), n, include_usage, bool(settings.get("logprobs", False)),
                      values.get("return_token_ids", False), calls, tuple(sent_as.items()))


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


def _structured_outputs(values: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """vLLM's structured_outputs as the guide settings it gives ({"json": schema}: json_schema, as guided_json
    gives it), and the names they were sent as, in order (read_request refuses a second guide); a key unknown or
    of the wrong type is a 400 naming it."""
    given = values.get("structured_outputs")
    if given is None:
        return {}, []
    if not isinstance(given, dict):
        raise ApiError(400, 'structured_outputs must be an object, e.g. {"json": {...}} or {"regex": "..."}.',
                       "structured_outputs")
    settings: dict[str, Any] = {}
    sent: list[str] = []  # the guides given, by the names they were sent as
    for key, value in given.items():
        name = f"structured_outputs.{key}"
        if key not in STRUCTURED_OUTPUTS:
            raise ApiError(400, f"{name} is not supported; structured_outputs takes {', '.join(STRUCTURED_OUTPUTS)} "
                                "(one of them).", name)
        if value is None or (key == "json_object" and value is False):  # left out
            continue
        setting = BY_NAME[STRUCTURED_OUTPUTS[key]]
        if key == "json_object":
            _checked(ApiField(name, "bool", "true asks for any JSON object"), value)
            value = ANY_OBJECT
        else:
            value = _checked(ApiField(name, setting.kind, setting.help, setting.name), value)
        settings[setting.name] = value
        sent.append(name)
    return settings, sent


def _response_format(value: Any) -> tuple[str | dict[str, Any] | None, str]:
    """OpenAI's response_format as the json_schema guide it asks for (None: text, no guide), and the field that
    guide is named by in a refusal: json_object any JSON object, json_schema its schema."""
    if value is None:
        return None, "response_format"
    if isinstance(value, str):  # its JSON text, as a json field may be sent: measured before json.loads recurses
        depth = json_depth(value.encode("utf-8", "surrogatepass"))
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"response_format nests {depth} deep, over the limit of {MAX_JSON_DEPTH} (a guide is "
                                "bounded); give a flatter one.", "response_format")
        try:
            value = json.loads(value)
        except ValueError:
            raise ApiError(400, "response_format is not valid JSON text; send an object.", "response_format") from None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and set(value) == {"type"}:
        return None, "response_format"
    if kind == "json_object" and set(value) == {"type"}:
        return ANY_OBJECT, "response_format"
    if kind == "json_schema":
        spec = value.get("json_schema")
        extra = [k for k in value if k not in ("type", "json_schema")]
        if extra:
            raise ApiError(400, f"response_format.{extra[0]} is not a field of a json_schema response_format; it "
                                "takes type and json_schema.", f"response_format.{extra[0]}")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ApiError(400, 'response_format.json_schema must be an object with the schema in "schema": '
                                '{"type": "json_schema", "json_schema": {"name": "answer", "schema": {...}}}.',
                           "response_format.json_schema")
        unknown = [k for k in spec if k not in ("name", "schema", "strict", "description")]
        if unknown:
            raise ApiError(400, f"response_format.json_schema.{unknown[0]} is not one of name, description, schema, "
                                "strict.", f"response_format.json_schema.{unknown[0]}")
        return spec["schema"], "response_format.json_schema.schema"
    shown = json.dumps(kind)[:40] if kind is not None else "missing"
    raise ApiError(400, f"response_format.type is {shown}; it must be \"text\", \"json_object\" or \"json_schema\" "
                        "(with json_schema.schema), and nothing else beside type.", "response_format.type")


def _allowed_tools(choice: dict[str, Any], tools: Any) -> tuple[Any, str]:
    """OpenAI's tool_choice {"type": "allowed_tools", "allowed_tools": {"mode", "tools"}} as the runtime takes it:
    the tools cut to the functions listed (in the order given), and the mode (auto or required) as tool_choice. A
    function listed that the tools do not give is a 400 naming it; tools that are not functions are left to the
    runtime, which refuses them by their index."""
    where = "tool_choice.allowed_tools"
    shape = ('{"type": "allowed_tools", "allowed_tools": {"mode": "auto" or "required", "tools": [{"type": "function", '
             '"function": {"name": ...}}]}}')
    allowed = choice.get("allowed_tools")
    extra = [f"tool_choice.{k}" for k in choice if k not in ("type", "allowed_tools")]
    extra += [f"{where}.{k}" for k in (allowed if isinstance(allowed, dict) else ()) if k not in ("mode", "tools")]
    if extra:
        raise ApiError(400, f"{extra[0]} is not a field of an allowed_tools tool_choice: {shape}.", extra[0])
    if not isinstance(allowed, dict):
        raise ApiError(400, f"{where} must be an object: {shape}.", where)
    choice_mode = allowed.get("mode")
    if choice_mode not in ("auto", "required"):
        raise ApiError(400, f"{where}.mode is {json.dumps(choice_mode)[:40]}; it must be \"auto\" or \"required\".",
                       f"{where}.mode")
    listed = allowed.get("tools")
    if not isinstance(listed, list) or not listed:
        raise ApiError(400, f"{where}.tools must be a non-empty list of the functions offered: {shape}.",
                       f"{where}.tools")
    offered = _function_names(tools)
    if tools is not None and offered is None:
        return tools, choice_mode  # not a list of functions: the runtime's refusal names the entry at fault
    offered = offered or []
    names = []
    for j, entry in enumerate(listed):
        name = _function_name(entry)
        if name is None:
            raise ApiError(400, f'{where}.tools[{j}] is not {{"type": "function", "function": {{"name": ...}}}}.',
                           f"{where}.tools[{j}]")
        if name not in offered:
            raise ApiError(400, f"{where}.tools[{j}] names the function {name!r}, which is not one of the tools "
                                f"({', '.join(offered) or 'none given'}).", f"{where}.tools[{j}]")
        names.append(name)
    return [tool for tool in tools if _function_name(tool) in names], choice_mode


def _function_name(tool: Any) -> str | None:
    """The name of a {"type": "function", "function": {"name": ...}} entry; None if it is not one."""
    fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    return name if isinstance(name, str) else None


def _function_names(tools: Any) -> list[str] | None:
    """The functions' names of a tools list; None if it is not a list of function entries."""
    if not isinstance(tools, list):
        return None
    names = [_function_name(tool) for tool in tools]
    return None if None in names else [name for name in names if name is not None]


# Each role's fields, OpenAI's (openai/types/chat/*_message_param.py); any other is refused. One given as null, or
# as an empty list, counts as left out: the openai client's message.model_dump() sends an answer's refusal, audio,
# function_call and annotations back as null. An assistant's refusal (text) is its content.
_MESSAGE_KEYS = {"tool": ("role", "content", "name", "tool_call_id"),
                 "assistant": ("role", "content", "name", "tool_calls", "refusal", "audio", "function_call",
                               "annotations")}
_NOT_IN_MESSAGES = {"audio": "audio", "function_call": "function calling: send tool_calls",
                    "annotations": "URL citations"}  # an assistant's fields this server takes only as null or empty


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
        message = {k: v for k, v in message.items() if v is not None and v != []}  # null or empty: left out
        taken = [k for k in _NOT_IN_MESSAGES if k in message]
        if taken:
            raise ApiError(400, f"{where}.{taken[0]} is not supported ({_NOT_IN_MESSAGES[taken[0]]}); leave it out, or "
                                "send null.", f"{where}.{taken[0]}")
        calls = message.get("tool_calls")
        content = message.get("content")
        refusal = message.get("refusal")  # an assistant's refusal: what it said
        if refusal is not None and not isinstance(refusal, str):
            raise ApiError(400, f"{where}.refusal must be a string.", f"{where}.refusal")
        if refusal:
            if content not in (None, ""):
                raise ApiError(400, f"{where} has both content and refusal; an assistant message that refused has "
                                    "its refusal alone.", f"{where}.refusal")
            content = refusal
        if calls is not None:
            _check_calls(calls, f"{where}.tool_calls")
        out.append({"role": ROLES[role], "content": "" if content is None and calls
                    else _content(content, f"{where}.content", refusals=role == "assistant")})
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


def _content(content: Any, where: str, refusals: bool = False) -> str:
    """A message's text: a string, or text parts joined (`refusals`: an assistant's, whose refusal parts are
    text too)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if refusals and _is_part(part, "refusal"):
                texts.append(part["refusal"])
                continue
            if not _is_part(part, "text"):
                kind = part.get("type") if isinstance(part, dict) else None
                raise ApiError(400, f"{where}[{j}] is not a text part ({{\"type\": \"text\", \"text\": \"...\"}})"
                                    + (f"; {kind} content is not supported" if kind and kind != "text" else "") + ".",
                               f"{where}[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{where} must be a string, or a list of text parts.", where)


def _is_part(part: Any, kind: str) -> bool:
    """A content part of this kind: {"type": "text", "text": "..."}, or an assistant's {"type": "refusal",
    "refusal": "..."}."""
    return isinstance(part, dict) and set(part) == {"type", kind} and part["type"] == kind and isinstance(part[kind], str)


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

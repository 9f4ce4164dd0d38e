"""Tool calls: the functions a chat request offers (OpenAI's `tools`), how its model's chat template asks for a
call, the guide that makes a call certain (`tool_choice` "required" or a named function), and the calls read back
out of an answer.

A template asks for calls in its own format; the one read here is the Hermes / Qwen format, a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>` (Qwen2.5 and Qwen3 templates): a
template that renders `tools` in another format, or never reads them, is refused with a message saying so.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.settings import GUIDE_BYTES
from refusion.runtime.structured.guide import Guide, ToolCallGuide, closed

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CHOICES = ("auto", "none", "required")  # and {"type": "function", "function": {"name": ...}}
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
_OPENED = re.compile(re.escape(OPEN) + r"\s*")  # a call's opening tag, up to its JSON
_CLOSED = re.compile(r"\s*" + re.escape(CLOSE))  # from its JSON's end, its closing tag
_JSON = json.JSONDecoder()
_CUT_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)')  # a cut call's name, as far as it got
_CUT_ARGUMENTS = re.compile(r'"arguments"\s*:\s*(.*)', re.DOTALL)  # its arguments' text, as far as they got
_READS_TOOLS = re.compile(r"{[{%][^}]*\btools\b")  # `tools` inside a jinja expression or statement


@dataclass(frozen=True)
class Tools:
    """A request's functions and its tool_choice, checked: what its prompt renders and its answer is read for."""

    functions: tuple[dict[str, Any], ...]  # OpenAI's tools entries, as given (the template renders them)
    choice: str  # auto, none, required, or the name of the function it must call
    named: bool = False  # choice names a function

    @property
    def parameters(self) -> dict[str, dict[str, Any]]:
        """Each function's parameter schema, by name (an object without properties where it gives none)."""
        return {f["function"]["name"]: f["function"].get("parameters") or {"type": "object", "properties": {}}
                for f in self.functions}

    @property
    def rendered(self) -> list[dict[str, Any]] | None:
        """What the chat template gets as `tools`: none with tool_choice "none" (the model is not offered them)."""
        return None if self.choice == "none" else list(self.functions)

    def enforced(self) -> list[Guide]:
        """Each offered function's parameters as the guide its call's arguments follow, its field naming it: what an
        engine must be able to enforce before the function is offered (with "none" nothing is)."""
        if self.choice == "none":
            return []
        return [Guide("json_schema", json.dumps(closed(self.parameters[f["function"]["name"]]), ensure_ascii=False,
                                                separators=(",", ":")), f"tools[{i}].function.parameters")
                for i, f in enumerate(self.functions) if not self.named or f["function"]["name"] == self.choice]

    def guide(self, answer: Guide | None = None) -> Guide | None:
        """The guide of a request with these tools and `answer`, the guide its text answer follows (a json_schema, a
        regex...: OpenAI's response_format or a guided_* field; None: none), as OpenAI reads the two together: with
        "required" or a named function, a call, certain (its arguments valid under the function's parameters; `answer` shapes no text: a call has
        none); with "auto" and a JSON schema answer, a call or that answer, one guide; with "auto" and no answer, a
        call or text with no call in it, so that a call the model begins is a valid one (ReFusion's out-of-order
        drafts, unguided, garble a call's JSON); with "none", or "auto" and an answer of another kind (a regex, a
        choice, a grammar: it shapes the whole answer, calls read out of it, as vLLM's guided fields do), `answer`.
        A tool_call guide: data each grammar engine compiles its way."""
        if self.choice == "none" or (self.choice == "auto" and answer is not None and answer.kind != "json_schema"):
            return answer
        names = [self.choice] if self.named else list(self.parameters)
        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": closed(self.parameters[name])},
                  "required": ["name", "arguments"], "additionalProperties": False} for name in names]
        call = calls[0] if len(calls) == 1 else {"anyOf": calls}
        auto = self.choice == "auto"
        shaped = answer if auto else None  # with a call certain, the answer has no text to shape
        guide = ToolCallGuide(OPEN + "\n", call, "\n" + CLOSE, json.loads(shaped.source) if shaped else None,
                              text=auto and shaped is None)
        return Guide("tool_call", json.dumps(guide.source()), shaped.field if shaped else "tool_choice")


def read_tools(tools: Any, tool_choice: Any) -> Tools | None:
    """OpenAI's `tools` and `tool_choice` checked (None: no tools); a RefusionError names the bad field."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise RefusionError(f"tool_choice={tool_choice!r} needs tools: give the functions in tools=[...].", "tool_choice")
        return None
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)) or not tools:
        raise RefusionError("tools must be a non-empty list of {\"type\": \"function\", \"function\": {\"name\": ..., "
                            "\"parameters\": {...}}}.", "tools")
    names: list[str] = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(fn, Mapping):
            raise RefusionError(f"tools[{i}] is not {{\"type\": \"function\", \"function\": {{...}}}}.", f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise RefusionError(f"tools[{i}].function.name={name!r} must be 1-64 letters, digits, _ or -.", f"tools[{i}].function.name")
        if name in names:
            raise RefusionError(f"tools[{i}].function.name={name!r} is given twice; names must be unique.", f"tools[{i}].function.name")
        names.append(name)
        parameters = fn.get("parameters")
        if parameters is not None and (not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object"):
            raise RefusionError(f"tools[{i}].function.parameters must be a JSON schema of an object.", f"tools[{i}].function.parameters")
    try:
        size = len(json.dumps(list(tools), ensure_ascii=False).encode("utf-8", "surrogatepass"))
    except (TypeError, ValueError) as e:
        raise RefusionError(f"tools is not JSON ({e}).", "tools") from None
    if size > GUIDE_BYTES:
        raise RefusionError(f"tools holds {size} bytes as JSON, over the {GUIDE_BYTES} a request may send.", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        name = fn.get("name") if choice.get("type") == "function" and isinstance(fn, Mapping) else None
        if name not in names:
            raise RefusionError(f"tool_choice names the function {name!r}, which is not one of the tools "
                                f"({', '.join(names)}); send {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}.", "tool_choice")
        return Tools(tuple(dict(t) for t in tools), name, named=True)
    if choice not in CHOICES:
        raise RefusionError(f"tool_choice={choice!r} is not one of {', '.join(map(repr, CHOICES))} or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}.", "tool_choice")
    return Tools(tuple(dict(t) for t in tools), choice)


def check_template(source: str, where: str) -> None:
    """Refuse a chat template that cannot offer tools: one that never reads `tools`, or asks for calls in a format
    other than the one read here."""
    if not _READS_TOOLS.search(source):
        raise RefusionError(f"the chat template of {where} has no tool format (it never reads `tools`), so this "
                            "model cannot be offered functions; call a model whose template renders tools, or leave "
                            "tools out.")
    if OPEN not in source:
        raise RefusionError(f"the chat template of {where} renders tools but asks for calls in a format other than "
                            f"{OPEN}{{\"name\": ..., \"arguments\": ...}}{CLOSE}, the one this runtime reads.")


def tool_calls(text: str, cut: bool = False) -> tuple[str, list[dict[str, Any]]]:
    """An answer read for calls: (the text outside them, stripped; each call OpenAI's way, {"id", "type":
    "function", "function": {"name", "arguments" (JSON text)}}). A block that is not a call (not JSON, no name, no
    `</tool_call>` right after its object) stays in the text. An answer `cut` short (max_tokens, a deadline) that
    ends inside a call gives that call as far as it got, its arguments cut as OpenAI cuts them, not its markup."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for opened in _OPENED.finditer(text):
        read = _call_at(text, opened.end()) if opened.start() >= last else None  # not one inside a call read
        if read is None:
            continue
        call, end = read
        kept.append(text[last:opened.start()])
        last = end
        calls.append(_openai(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False)))
    rest = text[last:]
    if cut and OPEN in rest:
        calls.append(cut_call(rest[rest.find(OPEN):]))
        rest = rest[: rest.find(OPEN)]
    kept.append(rest)
    return "".join(kept).strip(), calls


def cut_call(markup: str) -> dict[str, Any]:
    """A call cut short, from its markup as far as it got (`<tool_call>` or part of it, then part of its JSON): its
    name and its arguments' text as far as they got ("" where they had not begun)."""
    name = _CUT_NAME.search(markup)
    arguments = _CUT_ARGUMENTS.search(markup)
    return _openai(name[1].replace('\\"', '"') if name else "", arguments[1] if arguments else "")


def _openai(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _call_at(text: str, at: int) -> tuple[dict[str, Any], int] | None:
    """The call whose JSON begins at `at`, and where its `</tool_call>` ends; None if it is not one. The JSON is
    decoded, not cut at the first `</tool_call>`: a string argument may hold that tag."""
    try:
        call, end = _JSON.raw_decode(text, at)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the decoder reads
        return None
    closed = _CLOSED.match(text, end)
    if closed is None or not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return call, closed.end()


def before_calls(text: str) -> str:
    """The part of growing answer text that is surely not inside a call: before the first `<tool_call>`, less an
    end that could still begin one (what a stream may show while the answer settles)."""
    at = text.find(OPEN)
    if at >= 0:
        return text[:at]
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return text[:-n]
    return text

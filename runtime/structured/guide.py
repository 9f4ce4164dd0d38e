"""A request's guide: the one structure its answer must follow, read from its options (the `guide` rows of
runtime/core/settings.py): a JSON schema, a regular expression, a choice of strings, or a grammar (a frontend
translates its own forms into these: OpenAI's response_format, in serve/openai/). Pure: a grammar engine
(engine.py) compiles what this names, and every refusal names the field the guide came from.

A JSON schema's objects that list their `properties` are closed: one that does not say `additionalProperties`
takes no other key (`closed`), as OpenAI's strict mode and xgrammar read it, where JSON Schema would take any. Every
Pydantic model's schema leaves it out, and a model that may add keys rarely stops adding them (the answer is then
cut by max_tokens). An object that wants other keys says so: `"additionalProperties": true` (or a schema for them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.settings import GUIDE_BYTES, GUIDES

if TYPE_CHECKING:
    from refusion.runtime.options import RequestOptions

GuideKind = Literal["json_schema", "regex", "choice", "grammar", "tool_call"]


@dataclass(frozen=True)
class Guide:
    kind: GuideKind
    source: str  # the JSON schema's JSON text, the regular expression, the choices as a JSON list, the grammar
    field: str  # where the request gave it: every refusal of the guide names it

    @property
    def key(self) -> tuple[str, str]:
        """What a compiled grammar is cached by."""
        return self.kind, self.source


@dataclass(frozen=True)
class ToolCallGuide:
    """A tool_call guide's source, as data every grammar engine reads (runtime/structured/tools.py writes it): one
    call, its JSON valid under `call` between the `opening` and `closing` tags, or, where `answer` is given, that
    JSON schema's answer instead, or, where `text`, any text without the opening tag instead."""

    opening: str
    call: dict[str, Any]  # a JSON schema of the call's object ({"name": ..., "arguments": ...})
    closing: str
    answer: dict[str, Any] | None = None
    text: bool = False

    def source(self) -> dict[str, Any]:
        return {"opening": self.opening, "call": self.call, "closing": self.closing, "answer": self.answer,
                "text": self.text}

    @staticmethod
    def read(source: str) -> ToolCallGuide:
        return ToolCallGuide(**json.loads(source))


def guide_of(options: RequestOptions) -> Guide | None:
    """The guide `options` ask for, or None; a RefusionError naming the field when they ask for two, or for one
    that is not what its field takes."""
    given: list[Guide] = []
    for setting in GUIDES:
        value = getattr(options, setting.name)
        if value is None:  # left out (a choice given is never empty)
            continue
        if setting.name == "choice":
            given.append(_choice(value))
        elif setting.name == "json_schema":
            given.append(Guide("json_schema", _closed_text(value), "json_schema"))
        else:
            given.append(Guide(setting.name, value, setting.name))  # type: ignore[arg-type]  # the rows' names
    if len(given) > 1:
        raise RefusionError(f"{given[0].field} and {given[1].field} both ask for structured output; a request "
                            "follows one guide: give one of them.", given[0].field)
    return given[0] if given else None


def _choice(values: tuple[str, ...]) -> Guide:
    source = json.dumps(list(values), ensure_ascii=False)
    if len(source.encode("utf-8", "surrogatepass")) > GUIDE_BYTES:
        raise RefusionError(f"choice holds {len(source.encode('utf-8', 'surrogatepass'))} bytes as JSON, over the "
                            f"{GUIDE_BYTES} a request may send (a guide is bounded).", "choice")
    return Guide("choice", source, "choice")


# The keywords whose values are schemas (SCHEMA_IN) or hold schemas by name or in a list: where `closed` looks
# (not under `not` or `if`, where a closed object would let more through, not less).
_SCHEMA_IN = ("additionalProperties", "items", "then", "else", "contains", "unevaluatedProperties",
              "unevaluatedItems", "additionalItems")
_SCHEMAS_BY_NAME = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems", "items")


def closed(schema: Any) -> Any:
    """`schema` (parsed JSON) with `"additionalProperties": false` on every object schema that lists `properties`
    and says nothing of other keys (module doc); a copy, the input unchanged. Walked without recursion."""
    root = json.loads(json.dumps(schema))
    todo = [root]
    while todo:
        node = todo.pop()
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("properties"), dict) and not any(
                k in node for k in ("additionalProperties", "patternProperties", "unevaluatedProperties")):
            node["additionalProperties"] = False
        todo += [node[k] for k in _SCHEMA_IN if isinstance(node.get(k), dict)]
        todo += [v for k in _SCHEMAS_BY_NAME if isinstance(node.get(k), dict) for v in node[k].values()]
        todo += [v for k in _SCHEMA_LISTS if isinstance(node.get(k), list) for v in node[k]]
    return root


def _closed_text(source: str) -> str:
    return json.dumps(closed(json.loads(source)), ensure_ascii=False, separators=(",", ":"))

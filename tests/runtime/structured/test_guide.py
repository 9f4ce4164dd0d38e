"""A request's guide is read from its options: one at most, each form as its field takes it, every refusal naming
the field (runtime/structured/guide.py; pure, no grammar engine). OpenAI's response_format is the OpenAI server's
to translate (tests/serve/openai/test_structured.py)."""

from __future__ import annotations

import json

import pytest

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.options import RequestOptions
from refusion.runtime.structured.guide import Guide, guide_of

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
CLOSED = {**SCHEMA, "additionalProperties": False}  # what a guide follows: an object with properties takes no other


@pytest.mark.parametrize("options, guide", [
    (dict(), None),
    (dict(json_schema=SCHEMA), Guide("json_schema", json.dumps(CLOSED, separators=(",", ":")), "json_schema")),
    (dict(json_schema=json.dumps(SCHEMA, indent=2)), Guide("json_schema", json.dumps(CLOSED, separators=(",", ":")),
                                                           "json_schema")),
    (dict(regex=r"\d+"), Guide("regex", r"\d+", "regex")),
    (dict(choice=["yes", "no"]), Guide("choice", '["yes", "no"]', "choice")),
    (dict(grammar='start: "a"'), Guide("grammar", 'start: "a"', "grammar")),
])
def test_each_field_gives_its_guide(options, guide):
    assert guide_of(RequestOptions(**options)) == guide


@pytest.mark.parametrize("options, message", [
    (dict(regex="a", choice=["b"]), "regex and choice both ask for structured output"),
    (dict(json_schema="[1, 2]"), "json_schema='[1, 2]' must be a JSON object"),
    (dict(json_schema="{"), "json_schema='{' is not JSON text"),
    (dict(regex=""), "regex='' must be a non-empty string"),
    (dict(choice=["a", ""]), "choice=['a', ''] holds ''"),
    (dict(choice=["x" * 40000, "y" * 40000]), "choice holds 80008 bytes as JSON, over the 65536"),
    (dict(grammar="x" * 70000), "grammar holds 70000 bytes, over the 65536"),
])
def test_a_guide_that_is_not_one_is_refused_naming_its_field(options, message):
    with pytest.raises(RefusionError, match=message.replace("[", r"\[").replace("(", r"\(")):
        guide_of(RequestOptions(**options))


def test_objects_with_properties_are_closed_unless_they_say_otherwise():
    nested = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},  # closed
        "b": {"type": "object", "properties": {"y": {}}, "additionalProperties": True},  # as it says
        "c": {"type": "array", "items": {"$ref": "#/$defs/item"}},
        "d": {"type": "object"},  # any object: it lists no properties
        "e": {"not": {"type": "object", "properties": {"z": {}}}},  # negated: closing it would let more through
        "f": {"type": "object", "properties": {}, "patternProperties": {"^p": {}}}},
        "$defs": {"item": {"anyOf": [{"properties": {"v": {}}}, {"type": "string"}]}}}
    got = json.loads(guide_of(RequestOptions(json_schema=nested)).source)
    assert got["additionalProperties"] is False
    props = got["properties"]
    assert props["a"]["additionalProperties"] is False and props["b"]["additionalProperties"] is True
    assert "additionalProperties" not in props["d"] and "additionalProperties" not in props["e"]["not"]
    assert "additionalProperties" not in props["f"]
    assert got["$defs"]["item"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in nested  # the request's own value is left as it was

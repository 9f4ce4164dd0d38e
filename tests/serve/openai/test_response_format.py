"""OpenAI's response_format is the OpenAI server's to translate (issue 43, item 2): into the runtime's json_schema
guide, every refusal naming the field as the client sent it; the runtime takes no response_format. Pure: no model."""

from __future__ import annotations

import json

import pytest

from refusion.runtime.core.settings import BY_NAME
from refusion.runtime.options import RequestOptions
from refusion.runtime.structured.guide import guide_of
from refusion.serve.openai.responses import ApiError
from refusion.serve.openai.schema import ANY_OBJECT, CHAT, read_request

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
CLOSED = json.dumps({**SCHEMA, "additionalProperties": False}, separators=(",", ":"))


def _read(**fields):
    return read_request(CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}, "m")


@pytest.mark.parametrize("form, schema, sent", [
    ({"type": "json_object"}, ANY_OBJECT, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}, SCHEMA,
     "response_format.json_schema.schema"),
    (json.dumps({"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}), SCHEMA,
     "response_format.json_schema.schema"),  # its JSON text, as a json field may come
])
def test_each_form_is_the_json_schema_guide_it_asks_for(form, schema, sent):
    api = _read(response_format=form)
    assert api.jobs[0].settings["json_schema"] == schema and "response_format" not in api.jobs[0].settings
    assert api.sent_as == (("json_schema", sent),)
    if schema is SCHEMA:  # the guide the runtime follows: the schema closed, as it was when the runtime read it
        assert guide_of(RequestOptions(json_schema=schema)).source == CLOSED


def test_text_asks_for_no_guide_and_the_runtime_takes_no_response_format():
    api = _read(response_format={"type": "text"}, guided_regex="a")
    assert api.jobs[0].settings["regex"] == "a" and "json_schema" not in api.jobs[0].settings
    assert "response_format" not in BY_NAME and "response_format" not in RequestOptions.names()


@pytest.mark.parametrize("fields, message, param", [
    (dict(response_format={"type": "xml"}), 'response_format.type is "xml"', "response_format.type"),
    (dict(response_format={"type": "json_object", "schema": {}}), 'response_format.type is "json_object"',
     "response_format.type"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema must be an object",
     "response_format.json_schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA, "x": 1}}),
     "response_format.json_schema.x is not one of", "response_format.json_schema.x"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}, "strict": True}),
     "response_format.strict is not a field", "response_format.strict"),
    (dict(response_format="{"), "response_format is not valid JSON text", "response_format"),
    (dict(response_format='{"a":' * 40 + "1" + "}" * 40), "response_format nests 40 deep, over the limit of 32",
     "response_format"),  # measured before json.loads recurses into it
    (dict(response_format={"type": "json_object"}, guided_json=SCHEMA), "response_format and guided_json both",
     "response_format"),
    (dict(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
     "structured_outputs.regex and response_format both", "structured_outputs.regex"),
])
def test_a_response_format_that_is_not_one_is_a_400_naming_it(fields, message, param):
    with pytest.raises(ApiError, match=message.replace("(", r"\(")) as refused:
        _read(**fields)
    assert refused.value.status == 400 and refused.value.body()["error"]["param"] == param


def test_a_refusal_of_the_translated_guide_names_what_the_client_sent():
    api = _read(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    assert api.as_client("json_schema is not a guide the engine can enforce", "json_schema") == (
        "response_format.json_schema.schema is not a guide the engine can enforce", "response_format.json_schema.schema")
    assert api.as_client("regex='' must be ...", "regex") == ("regex='' must be ...", "regex")  # others as they are
    assert _read(structured_outputs={"json": SCHEMA}).as_client("json_schema nests 40 deep", "json_schema") == (
        "structured_outputs.json nests 40 deep", "structured_outputs.json")

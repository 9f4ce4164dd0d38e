"""Calls read out of an answer (runtime/structured/tools.py's tool_calls): each call's JSON is decoded, so a string
argument may hold `</tool_call>` or `<tool_call>`; a block that is not a call stays in the text. Through the
Generator, a required call whose argument is `</tool_call>` comes back as that call."""

from __future__ import annotations

import json

import pytest

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.structured.tools import tool_calls


def _call(name: str, arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _read(text: str) -> tuple[str, list[tuple[str, object]]]:
    """tool_calls' text and its calls as (name, arguments decoded), each call's form checked."""
    rest, calls = tool_calls(text)
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_") and set(call) == {"id", "type", "function"}
    assert len({call["id"] for call in calls}) == len(calls)
    return rest, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("value", ["</tool_call>", "<tool_call>", "a </tool_call> b <tool_call> c",
                                   '</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'])
def test_a_tag_inside_a_string_argument_is_part_of_the_call(value):
    assert _read(_call("f", {"x": value})) == ("", [("f", {"x": value})])
    assert _read(_call("f", {"x": [value, {"y": value}]})) == ("", [("f", {"x": [value, {"y": value}]})])


def test_calls_in_a_row_and_the_text_around_them():
    text = f"Let me look.\n{_call('f', {'x': '</tool_call>'})}{_call('g', {})}\n  \n{_call('f', {'x': 1})}\nDone."
    assert _read(text) == ("Let me look.\n\n  \n\nDone.", [("f", {"x": "</tool_call>"}), ("g", {}), ("f", {"x": 1})])
    assert _read("  plain text  ") == ("plain text", [])
    assert _read('<tool_call>{"name":"f","arguments":{"x":"</tool_call>"}}</tool_call>') == \
        ("", [("f", {"x": "</tool_call>"})])  # no whitespace around the JSON
    assert _read('<tool_call>{"name": "f"}</tool_call>') == ("", [("f", {})])  # no arguments: none


@pytest.mark.parametrize("block", [
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
    '<tool_call>\n["f", {}]\n</tool_call>',  # not an object
    '<tool_call>\n{"name": "f", "arguments": {}} trailing\n</tool_call>',  # no closing tag right after the object
    '<tool_call>\n{"name": "f", "arguments": {}}\n',  # never closed
    '<tool_call>\n{"name": "f", "arguments": {"x": "</tool_call>"\n</tool_call>',  # cut: its tag is inside a string
    "<tool_call>\n" + '{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}\n</tool_call>",  # too deep
])
def test_a_block_that_is_not_a_call_stays_in_the_text(block):
    assert _read(f"before {block} after") == (f"before {block} after", [])
    # a call after it is still read; the broken block's text stays where it was
    assert _read(f"{block}{_call('g', {'y': '</tool_call>'})} after") == (f"{block} after".strip(),
                                                                         [("g", {"y": "</tool_call>"})])


def test_a_tag_inside_a_call_read_is_not_read_again():
    inner = _call("g", {})
    assert _read(_call("f", {"x": inner})) == ("", [("f", {"x": inner})])


TAG_TOOL = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"const": "</tool_call>"}}, "required": ["x"]}}}]


@pytest.mark.parametrize("mode", ["refusion", "ar"])
def test_a_required_call_whose_argument_is_the_closing_tag_comes_back_as_the_call(random_model, mode):
    pytest.importorskip("llguidance")
    from refusion.tools.bench.guides import RANDOM_SETTINGS

    result = random_model.generate(messages=[{"role": "user", "content": "call f"}], tools=TAG_TOOL,
                                   tool_choice="required", mode=mode, **RANDOM_SETTINGS)
    assert result.finish_reason == "tool_calls" and result.text == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in result.tool_calls] == \
        [("f", {"x": "</tool_call>"})]


UNENFORCEABLE = {"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "g"}}])
def test_a_function_whose_parameters_the_engine_cannot_enforce_is_refused_by_its_place(random_model, choice):
    pytest.importorskip("llguidance")
    tools = [*TAG_TOOL, {"type": "function", "function": {"name": "g", "parameters": UNENFORCEABLE}}]
    with pytest.raises(RefusionError, match=r"^tools\[1\]\.function\.parameters is not a guide .*uniqueItems") as e:
        random_model.generate(messages=[{"role": "user", "content": "call g"}], tools=tools, tool_choice=choice,
                              max_tokens=4)
    assert e.value.field == "tools[1].function.parameters"
    # offered with "none", or named away from it, the function's schema is never enforced: no refusal
    for other in ("none", {"type": "function", "function": {"name": "f"}}):
        random_model.generate(messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice=other, max_tokens=4)

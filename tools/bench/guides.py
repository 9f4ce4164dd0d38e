"""The fixed set of guides structured output is tested and measured on (tests/runtime/decode/test_guided.py,
results/structured): each case's guide, the held-out task whose answer it frames (for accuracy), and its validator
(jsonschema, re.fullmatch, membership, a call's arguments against its parameters). Every guide is bounded, so a
valid answer fits the canvas of every model measured: a constrained answer that ends runs to its EOS."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from refusion.runtime.request import GenerationResult

ROBOT = {"type": "object", "properties": {
    "action": {"enum": ["left", "right", "forward", "stop"]},
    "speed": {"type": "number", "minimum": 0, "maximum": 2, "multipleOf": 0.1}},
    "required": ["action", "speed"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "move", "description": "drive the robot", "parameters": {
        "type": "object", "properties": {"direction": {"enum": ["left", "right"]},
                                         "speed": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["direction", "speed"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "stop", "description": "stop the robot", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}},
]


@dataclass(frozen=True)
class GuideCase:
    name: str
    settings: dict[str, Any]  # Generator.submit's keywords that ask for it
    task: str | None = None  # the held-out task whose answer it frames (accuracy), None: no answer to match
    tools: bool = False  # a tool call: needs a chat template with a tool format

    def valid(self, result: GenerationResult) -> bool:
        """The answer is what the guide asks (and ended by itself: EOS, or the call)."""
        import jsonschema

        if result.finish_reason not in ("eos", "tool_calls"):
            return False
        if self.tools:
            calls = result.tool_calls or []
            if len(calls) != 1:
                return False
            params = {t["function"]["name"]: t["function"]["parameters"] for t in self.settings["tools"]}
            name, arguments = calls[0]["function"]["name"], calls[0]["function"]["arguments"]
            return name in params and _validates(jsonschema, json.loads(arguments, parse_float=Decimal), params[name])
        if "regex" in self.settings:
            return re.fullmatch(self.settings["regex"], result.text) is not None
        if "choice" in self.settings:
            return result.text in self.settings["choice"]
        try:
            return _validates(jsonschema, json.loads(result.text, parse_float=Decimal), self.settings["json_schema"])
        except ValueError:
            return False

    def answer(self, result: GenerationResult) -> str | None:
        """The task's answer as this guide frames it (None when it frames none)."""
        if self.name == "answer":
            return str(json.loads(result.text)["answer"])
        if self.name == "integers":
            return "[" + ", ".join(map(str, json.loads(result.text))) + "]"
        return result.text if self.task else None


def _validates(jsonschema: Any, value: Any, schema: dict[str, Any]) -> bool:
    """jsonschema's verdict in decimal arithmetic, as JSON means its numbers (in binary floats 0.6 is no multiple of
    0.1: jsonschema would refuse what the guide rightly allowed)."""
    schema = json.loads(json.dumps(schema), parse_float=Decimal)  # the value's numbers are read so by the caller
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


CASES = (
    GuideCase("answer", {"json_schema": {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40}},
                                         "required": ["answer"], "additionalProperties": False}}, task="*"),
    GuideCase("robot", {"json_schema": ROBOT}),
    GuideCase("integers", {"json_schema": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "maxItems": 9}}, task="list"),
    GuideCase("regex", {"regex": r"[0-9]{2,4}\+[0-9]{2,4}=[0-9]{2,5}"}, task="add"),  # \d: any Unicode digit
    GuideCase("choice", {"choice": ["left", "right", "forward", "stop"]}),
    GuideCase("tool", {"tools": TOOLS, "tool_choice": "required"}, tools=True),
)
BY_NAME = {case.name: case for case in CASES}
# how a random-weight model is decoded: slots of 4 in blocks of 24, thresholds it can pass (its canvas holds every
# guide's longest answer)
RANDOM_SETTINGS = dict(gen_length=96, slot_size=4, serial_num_blocks=4, slot_threshold=0.5, token_threshold=0.1)

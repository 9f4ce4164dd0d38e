"""The fixed set of guides structured output is tested and measured on (tests/runtime/decode/test_guided.py,
results/structured), in two parts:

    CASES          schemas outside the model's families, one guide for every prompt: each case's guide, the held-out
                   base task whose answer it frames (for accuracy), and its validator (jsonschema, re.fullmatch,
                   membership, a call's arguments against its parameters); any model runs them, a random-weight one too
    FAMILY_CASES   the structured families the embedded model is trained on (tools/families.py), a request per
                   held-out example built from it (its conversation, its tools, its schema): accuracy is the
                   example's own answer read back (a JSON value, a call's name and arguments, a final text)

Every guide of CASES is bounded, so a valid answer fits the canvas of every model measured: a constrained answer that
ends runs to its EOS; a family case's canvas holds every one of its examples' answers."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.request import GenerationResult
from refusion.tools import families
from refusion.tools.tasks import Example

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
        return follows(self.settings, result, self.tools)

    def answer(self, result: GenerationResult) -> str | None:
        """The task's answer as this guide frames it (None when it frames none)."""
        if self.name == "answer":
            return str(json.loads(result.text)["answer"])
        if self.name == "integers":
            return "[" + ", ".join(map(str, json.loads(result.text))) + "]"
        return result.text if self.task else None


def follows(settings: dict[str, Any], result: GenerationResult, call: bool) -> bool:
    """The answer is what the request's `settings` ask, and ended by itself (EOS, or the call): one call (`call`) whose
    arguments the called function's parameters take; else text without a call, under the guide (none: any text)."""
    import jsonschema

    if result.finish_reason not in ("eos", "tool_calls"):
        return False
    if call:
        calls = result.tool_calls or []
        if len(calls) != 1:
            return False
        params = {t["function"]["name"]: t["function"]["parameters"] for t in settings["tools"]}
        name, arguments = calls[0]["function"]["name"], calls[0]["function"]["arguments"]
        return name in params and _validates(jsonschema, json.loads(arguments, parse_float=Decimal), params[name])
    if result.tool_calls:
        return False
    if "regex" in settings:
        return re.fullmatch(settings["regex"], result.text) is not None
    if "choice" in settings:
        return result.text in settings["choice"]
    if "json_schema" not in settings:
        return True
    try:
        return _validates(jsonschema, json.loads(result.text, parse_float=Decimal), settings["json_schema"])
    except ValueError:
        return False


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


@dataclass(frozen=True)
class FamilyCase:
    """The held-out examples of a structured family that `picks` takes, each asked as it is: its conversation, the
    tools or schema `guide` gives it, and a canvas of `max_tokens`."""

    name: str
    family: str
    about: str  # what it measures, as the report says it
    picks: Callable[[Example], bool]
    guide: Callable[[Example], dict[str, Any]]  # the keywords that offer an example's tools or ask for its schema
    max_tokens: int = families.ANSWER_MAX_TOKENS

    def examples(self, n: int) -> list[Example]:
        """The first n held-out examples of the family that this case takes."""
        taken = [ex for ex in families.held_out(self.family, families.HELD_OUT_RESERVED) if self.picks(ex)]
        if not 0 <= n <= len(taken):
            raise RefusionError(f"{self.name} has {len(taken)} held-out examples; got n={n}: ask for 0 to {len(taken)}.")
        return taken[:n]

    def asks(self, example: Example) -> dict[str, Any]:
        """Generator.submit's keywords for an example, as a client asks: max_tokens and no gen_length, so the canvas
        is blocks of the export's length that cover max_tokens (a gen_length of 128 would make the block, and a
        guided forward's lookahead, twice the export's)."""
        return {"messages": example.messages(), **self.guide(example), "max_tokens": self.max_tokens}

    def valid(self, example: Example, result: GenerationResult) -> bool:
        """Ended by itself and of the example's kind: its one call, valid under the called function's parameters,
        where the example's answer is a call; else text, under the schema where one is asked."""
        return follows(self.guide(example), result, example.call is not None)

    def accurate(self, example: Example, result: GenerationResult) -> bool:
        """Valid, and the answer read back is the example's (families.correct): the same call (name and arguments),
        the same JSON value, or the same text."""
        return self.valid(example, result) and families.correct(example, result)


def _schema(example: Example) -> dict[str, Any]:
    return {"json_schema": example.schema}


def _offered(example: Example) -> dict[str, Any]:
    return {"tools": list(example.tools), "tool_choice": "auto"}


def _required(example: Example) -> dict[str, Any]:
    return {"tools": list(example.tools), "tool_choice": "required"}


def _forced(example: Example) -> dict[str, Any]:
    """Its one function, named in tool_choice: how clients ask for a typed answer as a call."""
    name = example.tools[0]["function"]["name"]
    return {"tools": list(example.tools), "tool_choice": {"type": "function", "function": {"name": name}}}


FAMILY_CASES = (
    FamilyCase("json-answer", "json", "a base task's answer in its JSON frame, answer_schema(task) as json_schema",
               lambda ex: True, _schema),
    FamilyCase("robot-command", "robot", "an instruction's command, ROBOT_SCHEMA as json_schema", lambda ex: True, _schema),
    FamilyCase("tool-call", "tool", "the call a request names, among the 2-4 functions offered, tool_choice required "
               "(the call's form guided, the function and its arguments the model's)",
               lambda ex: ex.call is not None, _required),
    # a base answer or a command as a call's arguments runs to about 100 tokens: max_tokens 128
    FamilyCase("typed-call", "typed", "a typed answer (a JSON frame, a command) as the arguments of the one function "
               "offered, the call forced by name", lambda ex: True, _forced, max_tokens=128),
    FamilyCase("tool-choice", "tool", "tool_choice auto (a call or text without one, one guide): the call a request "
               "names among the functions offered, or the plain answer of a request that needs none",
               lambda ex: not ex.after, _offered),
    FamilyCase("tool-answer", "tool", "the final answer after a call and its result, the functions still offered "
               "(tool_choice auto)", lambda ex: bool(ex.after), _offered),
)
FAMILY_BY_NAME = {case.name: case for case in FAMILY_CASES}

"""The structured task families: answers as JSON, robot commands under a published schema, tool calls.

Each family makes `tasks.Example`s whose answer is a deterministic function of the conversation, so accuracy is
exact, and publishes the guide its answers follow, so the training recipe, the bench, the demo and the tests
pass the same schema as `response_format` (or the same functions as `tools`):

    json    every base task's answer in a frame {"answer": ...}: a string, the list task's an array of integers,
            add's sum an integer (`answer_schema(task)`, `answer_value`); 3 in 4 with a system message asking for
            JSON, the rest without one (the model must continue a frame a guide forces)
    robot   an instruction ("move to 12 -5 at speed 40") and one JSON object under ROBOT_SCHEMA
    tool    2-4 of FUNCTIONS offered (OpenAI's `tools`); the request names which to call and with what (the answer:
            a Hermes/Qwen call), or, after the call and its result, a short final answer using the result; a
            quarter of them ask a base task, answered plainly with the tools still offered
    typed   one function offered whose arguments are a typed answer (a json frame, a robot command), as clients
            ask for structured output through a forced call (LangChain's with_structured_output(method=
            "function_calling")): the call runs past 64 tokens

Every answer is written as the guides lay JSON out (Python's json.dumps: ", " and ": "), so a guided decode and
an unguided one can read the same text. Held-out examples come from their own seeded stream per family (the json
and typed families frame the base tasks' held-out prompts); training skips every prompt any held-out set holds,
but the closed set of STOP_COMMANDS.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from refusion.tools import tasks as T

if TYPE_CHECKING:
    from refusion.runtime.request import GenerationResult

FAMILIES = ("json", "robot", "tool", "typed")
HELD_OUT_SEED = 2_000_003
HELD_OUT_RESERVED = 1000
ANSWER_MAX_TOKENS = 64  # every family's answer fits a request's max_tokens 64 (tool tags are one token each)

# ----------------------------------------------------------------------------- json


_VALUE_SCHEMAS: dict[str, dict[str, Any]] = {"list": {"type": "array", "items": {"type": "integer"}},
                                             "add": {"type": "integer"}}  # every other task's answer: a string


def answer_schema(task: str) -> dict[str, Any]:
    """The response_format schema a base task's JSON answer follows."""
    value = _VALUE_SCHEMAS.get(task, {"type": "string"})
    return {"type": "object", "properties": {"answer": value}, "required": ["answer"], "additionalProperties": False}


def answer_value(example: T.Example) -> Any:
    """A base example's answer as its natural JSON value: the list task's array of integers, add's sum as an
    integer (`a+b=c` -> c), every other task's text."""
    if example.task == "list":
        return json.loads(example.answer)
    if example.task == "add":
        return int(example.answer.rsplit("=", 1)[1])
    return example.answer


def framed(example: T.Example) -> str:
    """The base example's answer in its JSON frame."""
    return json.dumps({"answer": answer_value(example)})


_JSON_REQUESTS = ("Reply in JSON.", "Answer as a JSON object.", 'Respond with JSON: {"answer": ...}.',
                  "Give the answer as JSON.", "Output JSON only.")


def json_request(rng: random.Random) -> str:
    """A system message asking for JSON, sometimes after other sentences."""
    ask = rng.choice(_JSON_REQUESTS)
    return ask if rng.random() < 0.5 else f"{T.system_prompt(rng, 80)} {ask}"


def _json(rng: random.Random, base: T.Example) -> T.Example:
    before = ({"role": "system", "content": json_request(rng)},) if rng.random() < 0.75 else ()
    return T.Example("json", base.prompt, framed(base), before=before, schema=answer_schema(base.task))


# ----------------------------------------------------------------------------- robot

ACTIONS = ("move", "turn", "grip", "stop", "say")
# The stop commands are a closed set of five: none can be held out and still be learned, so they are trained and
# measured alike (training_example); every other family prompt a held-out set holds is unseen in training.
STOP_COMMANDS = ("stop", "halt", "stop now", "freeze", "stop moving")
ROBOT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "action": {"type": "string", "enum": list(ACTIONS)},
        "speed": {"type": "integer", "minimum": 1, "maximum": 100},
        "hand": {"type": "string", "enum": ["left", "right"]},
        "to": {"type": "array", "items": {"type": "integer", "minimum": -180, "maximum": 180}, "maxItems": 3},
        "text": {"type": "string", "maxLength": 16},
    },
    "required": ["action"],
    "additionalProperties": False,
}


def _speed(rng: random.Random, command: dict[str, Any]) -> str:
    """An optional ' at speed N' (the command gets speed N)."""
    if rng.random() < 0.5:
        return ""
    command["speed"] = rng.randint(1, 100)
    return f" at speed {command['speed']}"


def _robot(rng: random.Random) -> tuple[str, dict[str, Any]]:
    action = rng.choice(ACTIONS)
    command: dict[str, Any] = {"action": action}
    if action == "move":
        to = [rng.randint(-99, 99) for _ in range(2)]
        verb = rng.choice(("move to", "go to", "drive to"))
        speed = _speed(rng, command)
        command["to"] = to
        return f"{verb} {to[0]} {to[1]}{speed}", command
    if action == "turn":
        to = [rng.randint(-180, 180)]
        verb = rng.choice(("turn to", "rotate to", "face"))
        speed = _speed(rng, command)
        command["to"] = to
        return f"{verb} {to[0]}{speed}", command
    if action == "grip":
        to = [rng.randint(-99, 99) for _ in range(rng.choice((2, 3)))]
        verb = rng.choice(("grip at", "pick up at", "grab at"))
        hand = ""
        if rng.random() < 0.6:
            command["hand"] = rng.choice(("left", "right"))
            hand = f" with the {command['hand']} hand"
        command["to"] = to
        return f"{verb} {' '.join(map(str, to))}{hand}", command
    if action == "stop":
        return rng.choice(STOP_COMMANDS), command
    words = []
    while not words or len(" ".join(words)) > 16:
        words = [T.letters(rng, rng.randint(2, 6)) for _ in range(rng.randint(1, 3))]
    command["text"] = " ".join(words)
    return f"{rng.choice(('say', 'speak', 'tell them'))} {command['text']}", command


def robot_example(rng: random.Random) -> T.Example:
    prompt, command = _robot(rng)
    before = ({"role": "system", "content": "You control a robot. Reply with one JSON command."},) \
        if rng.random() < 0.3 else ()
    return T.Example("robot", prompt, json.dumps(command), before=before, schema=ROBOT_SCHEMA)


# ----------------------------------------------------------------------------- tool


def _function(fname: str, **params: str) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": fname, "parameters": {"type": "object", "properties": {p: {"type": t} for p, t in params.items()},
                                     "required": list(params), "additionalProperties": False}}}


FUNCTIONS: dict[str, dict[str, Any]] = {f["function"]["name"]: f for f in (
    _function("get_weather", city="string"),
    _function("set_timer", minutes="integer"),
    _function("lights_on", room="string"),
    _function("lights_off", room="string"),
    _function("add", a="integer", b="integer"),
    _function("find_user", name="string"),
)}
# A typed answer asked as a call (LangChain's with_structured_output(method="function_calling") and the like): one
# function whose arguments are the answer, under one of the names such clients give it.
ANSWER_NAMES = ("Answer", "answer", "final_answer", "Response")
COMMAND_NAMES = ("robot_command", "RobotCommand", "command", "send_command")


def call_text(name: str, arguments: dict[str, Any]) -> str:
    """A call as the chat template writes it and the tool guide forces it."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


_ASKS: dict[str, tuple[str, ...]] = {  # the user's requests for each function, formatted with its arguments
    "get_weather": ("what is the weather in {city}", "weather in {city}?", "how warm is it in {city}"),
    "set_timer": ("set a timer for {minutes} minutes", "timer {minutes} min", "remind me in {minutes} minutes"),
    "lights_on": ("turn on the light in the {room}", "switch on the {room} light", "lights on in the {room}"),
    "lights_off": ("turn off the light in the {room}", "switch off the {room} light", "lights off in the {room}"),
    "add": ("what is {a} plus {b}", "use the tool to add {a} and {b}", "sum of {a} and {b}?"),
    "find_user": ("look up the user {name}", "what is the id of {name}", "find user {name}"),
}


def _arguments(rng: random.Random, name: str) -> dict[str, Any]:
    if name == "get_weather":
        return {"city": T.letters(rng, rng.randint(3, 8))}
    if name == "set_timer":
        return {"minutes": rng.randint(1, 120)}
    if name in ("lights_on", "lights_off"):
        return {"room": T.letters(rng, rng.randint(3, 8))}  # a room named as a city is: any name, read from the request
    if name == "add":
        return {"a": rng.randint(0, 999), "b": rng.randint(0, 999)}
    return {"name": T.letters(rng, rng.randint(3, 8))}


def tool_result(name: str, arguments: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """What the family's function `name` returns for a call with `arguments` (a weather's temperature and a user's
    id drawn from `rng`; the others follow from the arguments)."""
    if name == "get_weather":
        return {"temp": rng.randint(-20, 40)}
    if name in ("set_timer", "lights_on", "lights_off"):
        return {"ok": True}
    if name == "add":
        return {"sum": arguments["a"] + arguments["b"]}
    if name == "find_user":
        return {"id": rng.randint(1, 9999)}
    raise ValueError(f"unknown function {name!r}; expected one of {', '.join(FUNCTIONS)}")


def final_answer(name: str, arguments: dict[str, Any], result: dict[str, Any]) -> str:
    """The short answer the family writes after the call `name(arguments)` returned `result`."""
    if name == "get_weather":
        return f"It is {result['temp']} degrees in {arguments['city']}."
    if name == "set_timer":
        return f"Timer set for {arguments['minutes']} minutes."
    if name in ("lights_on", "lights_off"):
        return f"The {arguments['room']} light is {name.removeprefix('lights_')}."
    if name == "add":
        return f"{arguments['a']} plus {arguments['b']} is {result['sum']}."
    if name == "find_user":
        return f"{arguments['name']} has id {result['id']}."
    raise ValueError(f"unknown function {name!r}; expected one of {', '.join(FUNCTIONS)}")


def _request(rng: random.Random, name: str) -> tuple[str, dict[str, Any], dict[str, Any], str]:
    """(the user's request, the call's arguments, the tool's result, the final answer that uses it)."""
    arguments = _arguments(rng, name)
    result = tool_result(name, arguments, rng)
    ask = rng.choice(_ASKS[name]).format(**arguments)
    return ask, arguments, result, final_answer(name, arguments, result)


def typed_call(rng: random.Random, base: Callable[[random.Random], T.Example]) -> T.Example:
    """One function whose arguments are the answer, offered alone: a base task's answer or a robot command."""
    if rng.random() < 0.5:
        plain = base(rng)
        name = rng.choice(ANSWER_NAMES)
        arguments = json.loads(framed(plain))
        function = {"name": name, "parameters": answer_schema(plain.task)}
        prompt = plain.prompt
    else:
        prompt, arguments = _robot(rng)
        name = rng.choice(COMMAND_NAMES)
        function = {"name": name, "parameters": ROBOT_SCHEMA}
    return T.Example("typed", prompt, call_text(name, arguments), tools=({"type": "function", "function": function},),
                     call=(name, arguments))


def tool_example(rng: random.Random, base: Callable[[random.Random], T.Example]) -> T.Example:
    """Tools offered; a call, a final answer after the call's result, or (a quarter) a base task answered
    plainly."""
    offered = rng.sample(list(FUNCTIONS), rng.randint(2, 4))
    tools = tuple(FUNCTIONS[n] for n in offered)
    if rng.random() < 0.25:
        plain = base(rng)
        return T.Example("tool", plain.prompt, plain.answer, tools=tools)
    name = rng.choice(offered)
    ask, arguments, result, final = _request(rng, name)
    if rng.random() < 0.5:
        return T.Example("tool", ask, call_text(name, arguments), tools=tools, call=(name, arguments))
    after = ({"role": "assistant", "content": "", "tool_calls": [
                 {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]},
             {"role": "tool", "tool_call_id": "call_0", "content": json.dumps(result)})
    return T.Example("tool", ask, final, tools=tools, after=after)


# ----------------------------------------------------------------------------- examples and held-out sets


def family_example(rng: random.Random, family: str, base: Callable[[random.Random], T.Example]) -> T.Example:
    """One example of `family`; `base` draws the base task example a json or plain tool example is made from."""
    if family == "json":
        return _json(rng, base(rng))
    if family == "robot":
        return robot_example(rng)
    if family == "tool":
        return tool_example(rng, base)
    if family == "typed":
        return typed_call(rng, base)
    raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")


@lru_cache(maxsize=None)
def _held_out_stream(family: str) -> tuple[T.Example, ...]:
    rng = random.Random(HELD_OUT_SEED + FAMILIES.index(family))
    bases = iter(T.held_out(T.HELD_OUT_RESERVED))  # the base held-out examples, in order, framed or called
    out: list[T.Example] = []
    seen: set[str] = set()
    while len(out) < HELD_OUT_RESERVED:
        ex = family_example(rng, family, lambda _: next(bases))
        key = held_out_key(ex)
        if key not in seen:
            seen.add(key)
            out.append(ex)
    return tuple(out)


def held_out_key(example: T.Example) -> str:
    """What makes two examples of a held-out set different: the prompt, and for a tool example the turn it answers
    too."""
    return example.prompt + ("\x00final" if example.after else "")


def held_out(family: str, n: int = 60) -> list[T.Example]:
    """The first n held-out examples of `family` (json: the base held-out prompts, in order, framed)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    if not 0 <= n <= HELD_OUT_RESERVED:
        raise ValueError(f"held_out(family, n) needs 0 <= n <= {HELD_OUT_RESERVED}; got {n}")
    return list(_held_out_stream(family)[:n])


@lru_cache(maxsize=None)
def held_out_prompts() -> frozenset[str]:
    """Every prompt a held-out set holds, the base tasks' and every family's: a robot command asked as a typed call
    is a robot command, and a final answer's turn carries the call another held-out example answers with."""
    return T.held_out_prompts() | {ex.prompt for family in FAMILIES for ex in _held_out_stream(family)}


# add's sum alone, without the operands the plain answer copies first, is the hardest answer to frame: the families
# that frame a base answer draw add three times as often as each other task in training
_FRAMED_BASES = (T.TASKS, tuple(3.0 if task == "add" else 1.0 for task in T.TASKS))


def training_example(rng: random.Random, family: str) -> T.Example:
    """A training example of `family` whose prompt no held-out set holds (held_out_prompts), but for the closed set
    of STOP_COMMANDS."""
    bases = _FRAMED_BASES if family in ("json", "typed") else (T.TASKS, None)
    while True:
        ex = family_example(rng, family, lambda r: T.training_example(r, *bases))
        if ex.prompt in STOP_COMMANDS or ex.prompt not in held_out_prompts():
            return ex


def correct(example: T.Example, result: GenerationResult) -> bool:
    """The answer is the example's: its one call (name and arguments, as JSON values), its JSON value, or its text
    (tasks.score)."""
    if example.call is not None:
        calls = [(c["function"]["name"], _value(c["function"]["arguments"])) for c in result.tool_calls or []]
        return not result.text and calls == [example.call]
    if example.schema is not None:
        return _value(result.text) == json.loads(example.answer)
    return T.score(example, result.text)


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return _NOT_JSON


_NOT_JSON = object()  # equal to no answer's value

"""The structured task families (tools/families.py) end to end through real clients, against the server on the
embedded model, greedy: the openai client's response_format (json_schema, strict) and its full tool loop (tools ->
tool_calls -> a role "tool" message -> the final answer), streamed and not; LangChain's with_structured_output
(json_schema and function_calling) and a bind_tools loop. Every answer is checked against the held-out example's own:
the right command, the right call, the final answer the family writes for the tool's result.

The examples are picked by index below; REFUSION_FAMILIES_MODEL=<checkpoint dir> runs the file on another model
(exported into a temporary folder) in place of models/refusion-tiny."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

pytest.importorskip("llguidance", reason="response_format and tool calls need the guide engine (serve extra)")

from refusion.serve.openai.server import OpenAIServer
from refusion.tools import families as F
from tests.serve.openai.helpers import served

MODEL = os.environ.get("REFUSION_FAMILIES_MODEL")  # a checkpoint dir to test in place of the embedded model
MAX_TOKENS = F.ANSWER_MAX_TOKENS
TYPED_MAX_TOKENS = 128  # a typed answer asked as a call runs past 64 tokens (about 100 at most)

ROBOT = F.held_out("robot", 8)
TOOL = F.held_out("tool", 40)
TYPED = F.held_out("typed", 8)
# Held-out examples by index (adjust here when the families change):
ROBOT_INDICES = (1, 2, 5, 6)  # robot commands (turn, grip, move, say; the first two with a system message)
CALL_INDICES = (2, 12, 27)  # calls among 2-4 functions: get_weather, find_user (results drawn), lights_off
LANGCHAIN_CALL_INDICES = (13, 21)  # lights_on among 4 functions, add among 3
PLAIN_INDICES = (3, 5)  # base tasks with tools offered (add, sort)
TYPED_INDICES = (0, 1, 3)  # typed answers asked as a call (an add frame, two robot commands)


@pytest.fixture(scope="module")
def family_export(request, tmp_path_factory) -> Path:
    if not MODEL:
        return request.getfixturevalue("tiny_export")
    from refusion.export.exporter import export_onnx

    return export_onnx(Path(MODEL), tmp_path_factory.mktemp("families") / "onnx", validate=False)


@pytest.fixture(scope="module")
def server(family_export) -> Iterator[OpenAIServer]:
    with served(family_export, max_requests=2, max_batch=2) as (_, server):
        yield server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _chat(server, max_tokens: int = MAX_TOKENS):
    pytest.importorskip("langchain_openai", reason="the LangChain tests need the dev extra (langchain-openai)")
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model="refusion", max_tokens=max_tokens,
                      temperature=0, max_retries=0)


def _ask(client: openai.OpenAI, messages: list[dict[str, Any]], stream: bool, **options) -> tuple[Any, str]:
    """(the answer's message: content and tool_calls, the finish reason), from one request or its stream."""
    asked = dict(model="refusion", messages=messages, max_tokens=MAX_TOKENS, temperature=0, **options)
    if not stream:
        choice = client.chat.completions.create(**asked).choices[0]
        return choice.message.model_dump(exclude_none=True), choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**asked, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            call["id"] += d.id or ""
            if d.function:
                call["function"]["name"] += d.function.name or ""
                call["function"]["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    message: dict[str, Any] = {"role": "assistant"}
    if content:
        message["content"] = content
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish


def _result(index: int, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """The tool's result for the example at `index` (drawn from its own seed, so each run gives the same)."""
    return F.tool_result(name, arguments, random.Random(index))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("mode", ["refusion", "ar"])
def test_response_format_gives_the_robot_command(client, mode, stream):
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "robot_command", "schema": F.ROBOT_SCHEMA, "strict": True}}
    for i in ROBOT_INDICES:
        ex = ROBOT[i]
        message, finish = _ask(client, ex.messages(), stream, response_format=response_format,
                               extra_body={"mode": mode})
        assert finish == "stop" and "tool_calls" not in message, (i, ex.prompt, message, finish)
        assert json.loads(message["content"]) == json.loads(ex.answer), (i, ex.prompt, message["content"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_tool_loop_calls_the_right_function_then_answers_with_its_result(client, stream):
    for i in CALL_INDICES:
        ex = TOOL[i]
        assert ex.call is not None and len(ex.tools) > 1, f"held-out tool example {i} is not a call among functions"
        name, arguments = ex.call
        messages = ex.messages()
        message, finish = _ask(client, messages, stream, tools=list(ex.tools), tool_choice="auto")
        assert finish == "tool_calls" and not message.get("content"), (i, ex.prompt, message, finish)
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == name, (i, ex.prompt, call)
        assert json.loads(call["function"]["arguments"]) == arguments, (i, ex.prompt, call)
        result = _result(i, name, arguments)
        messages += [message, {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)}]
        final, finish = _ask(client, messages, stream, tools=list(ex.tools))
        assert finish == "stop" and "tool_calls" not in final, (i, ex.prompt, final, finish)
        assert final["content"] == F.final_answer(name, arguments, result), (i, ex.prompt, result)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_request_needing_no_tool_is_answered_plainly_with_tools_offered(client, stream):
    for i in PLAIN_INDICES:
        ex = TOOL[i]
        assert ex.call is None and not ex.after and ex.tools, f"held-out tool example {i} is not a plain task"
        message, finish = _ask(client, ex.messages(), stream, tools=list(ex.tools), tool_choice="auto")
        assert finish == "stop" and "tool_calls" not in message, (i, ex.prompt, message, finish)
        assert message["content"] == ex.answer, (i, ex.prompt)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output_gives_the_typed_answer(server, method):
    """A dict schema with a title (a Pydantic model's would add what the family never saw): json_schema sends it as
    response_format, function_calling as the one function, forced, under that name, as the family's typed calls."""
    chat = _chat(server, TYPED_MAX_TOKENS)
    if method == "json_schema":  # the robot family's requests, under the schema as response_format
        cases = [(ROBOT[i], "robot_command", F.ROBOT_SCHEMA, json.loads(ROBOT[i].answer)) for i in ROBOT_INDICES[:2]]
    else:  # the tool family's typed calls: one function named as such clients name it, the schema its parameters
        cases = [(TYPED[i], TYPED[i].call[0], TYPED[i].tools[0]["function"]["parameters"], TYPED[i].call[1])
                 for i in TYPED_INDICES]
    for ex, name, schema, expected in cases:
        assert name in F.COMMAND_NAMES + F.ANSWER_NAMES, f"{ex.prompt!r}: {name} is no typed call's name"
        typed = chat.with_structured_output({"title": name, **schema}, method=method)
        assert typed.invoke(ex.messages()) == expected, (ex.prompt, method)


def test_langchain_bind_tools_loop(server):
    from langchain_core.messages import ToolMessage

    chat = _chat(server)
    for i in LANGCHAIN_CALL_INDICES:
        ex = TOOL[i]
        assert ex.call is not None and len(ex.tools) > 1, f"held-out tool example {i} is not a call among functions"
        name, arguments = ex.call
        with_tools = chat.bind_tools(list(ex.tools))
        messages: list[Any] = ex.messages()
        called = with_tools.invoke(messages)
        assert [(c["name"], c["args"]) for c in called.tool_calls] == [(name, arguments)], (i, ex.prompt, called)
        result = _result(i, name, arguments)
        messages += [called, ToolMessage(json.dumps(result), tool_call_id=called.tool_calls[0]["id"])]
        final = with_tools.invoke(messages)
        assert not final.tool_calls and final.content == F.final_answer(name, arguments, result), (i, ex.prompt)

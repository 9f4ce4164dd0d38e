"""OpenAI's Responses API (/v1/responses) against the server, through the openai client: text is what
/v1/chat/completions answers for the same conversation (greedy), streamed as the SDK's events (its stream helper
checks their order), text.format and function tools as on the chat endpoint, a tool loop through function_call
and function_call_output items, what is refused named by its Responses name; the request as the chat request it
becomes; an openai-agents Agent on its default (Responses) model."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from refusion.serve.openai.responses_request import TAKEN, read_responses
from refusion.serve.openai.schema import CHAT, read_request
from refusion.tools.bench.guides import RANDOM_SETTINGS as RANDOM
from refusion.tools.bench.guides import ROBOT, TOOLS
from tests.gate import ForwardGate
from tests.helpers import REPO
from tests.serve.openai.helpers import connect, hang_up, post, read_event, request_bytes, wait_idle

ASK = [{"role": "user", "content": "sort: 5 2 8 2"}]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the chat's functions, in this shape
STREAM_EVENT: TypeAdapter = TypeAdapter(ResponseStreamEvent)
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _chat(client, messages, **keywords):
    return client.chat.completions.create(model="refusion", messages=messages, **keywords)


@pytest.mark.parametrize("max_tokens", [32, 3])
def test_the_text_is_what_the_chat_endpoint_answers(serve, max_tokens):
    client = _client(serve())
    chat = _chat(client, [{"role": "system", "content": "Answer in one line."}, *ASK], max_tokens=max_tokens)
    response = client.responses.create(model="refusion", instructions="Answer in one line.", input="sort: 5 2 8 2",
                                       max_output_tokens=max_tokens)
    assert response.output_text == chat.choices[0].message.content
    cut = chat.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if cut else "completed")
    assert (response.incomplete_details.reason if cut else response.incomplete_details) == \
        ("max_output_tokens" if cut else None)
    [message] = response.output
    assert (message.type, message.role, message.status) == ("message", "assistant", response.status)
    assert message.id.startswith("msg_") and response.id.startswith("resp_") and response.object == "response"
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0 and response.error is None
    assert (response.model, response.max_output_tokens, response.temperature, response.tool_choice) == \
        ("refusion", max_tokens, 0.0, "auto")
    assert response.model_extra["store"] is False  # nothing is stored, and the response says so

    items = [{"role": "developer", "content": "Answer in one line."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "sort: "},
                                                             {"type": "input_text", "text": "5 2 8 2"}]}]
    assert client.responses.create(model="refusion", input=items, max_output_tokens=max_tokens,
                                   store=False, metadata={"run": "1"}).output_text == response.output_text


def test_a_stream_is_the_sdks_events_in_order_and_its_deltas_join_to_the_text(serve):
    client = _client(serve())
    whole = client.responses.create(model="refusion", input="reverse: robotics", max_output_tokens=32)
    events = list(client.responses.create(model="refusion", input="reverse: robotics", max_output_tokens=32,
                                          stream=True))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *[d.type for d in deltas], "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert deltas and "".join(d.delta for d in deltas) == whole.output_text == events[-4].text
    item_id = events[2].item.id
    assert all((d.item_id, d.output_index, d.content_index) == (item_id, 0, 0) for d in deltas)
    assert events[-1].response.output_text == whole.output_text and events[-1].response.status == "completed"
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    with client.responses.stream(model="refusion", input="reverse: robotics", max_output_tokens=32) as stream:
        assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") == whole.output_text
        assert stream.get_final_response().output_text == whole.output_text

    cut = list(client.responses.create(model="refusion", input="reverse: robotics", max_output_tokens=2, stream=True))
    assert cut[-1].type == "response.incomplete" and cut[-1].response.incomplete_details.reason == "max_output_tokens"


def _events(server, body: dict) -> list[dict]:
    """A stream's events, each checked: named by its type, and valid under the SDK's types (validated, where the
    client only constructs)."""
    status, head, raw = post(server, "/v1/responses", {"model": "refusion", "stream": True, **body})
    assert status == 200 and head["content-type"].startswith("text/event-stream")
    events = []
    for block in raw.decode().strip().split("\n\n"):
        name, data = block.split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {events[-1]['type']}"
        STREAM_EVENT.validate_python(events[-1])
    return events


def test_the_stream_is_named_server_sent_events_valid_under_the_sdks_types(serve):
    server = serve()
    events = _events(server, {"input": "sort: 3 1", "max_output_tokens": 8})
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    status, _, body = post(server, "/v1/responses", {"model": "refusion", "input": "sort: 3 1", "max_output_tokens": 8})
    assert Response.model_validate(body).output_text == events[-1]["response"]["output"][0]["content"][0]["text"]


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_cancels_its_request(serve, gen, stream):
    """As on the chat endpoint (test_abuse.py): the disconnect cancels the request, which frees its KV."""
    server = serve()
    body = json.dumps({"model": "refusion", "input": "reverse: robotics", "stream": stream, "mode": "ar"}).encode()
    with ForwardGate(gen.runner) as gate:
        sock = connect(server)
        sock.sendall(request_bytes("/v1/responses", body))
        if stream:
            reader = sock.makefile("rb")
            assert reader.readline().startswith(b"HTTP/1.1 200")
            assert json.loads(read_event(reader))["type"] == "response.created"
            reader.close()
        gate.wait_held()  # its first forward waits at the gate
        hang_up(server, gen, gate, sock)
    wait_idle(server)
    ended = server.metrics.registry.get_sample_value
    assert ended("refusion_requests_total", {"endpoint": "responses", "finish_reason": "cancelled"}) == 1


@pytest.mark.parametrize("form", [{"type": "json_schema", "name": "robot", "schema": ROBOT, "strict": True},
                                  {"type": "json_object"}])
def test_text_format_gives_json_as_response_format_does(serve, form):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    client = _client(serve())
    response = client.responses.create(model="refusion", input=ASK, text={"format": form})
    chat_format = ({"type": "json_object"} if form["type"] == "json_object" else
                   {"type": "json_schema", "json_schema": {k: v for k, v in form.items() if k != "type"}})
    assert response.output_text == _chat(client, ASK, response_format=chat_format).choices[0].message.content
    jsonschema.validate(json.loads(response.output_text), form.get("schema", {"type": "object"}))
    assert response.text.format.type == form["type"]
    streamed = list(client.responses.create(model="refusion", input=ASK, text={"format": form}, stream=True))
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == response.output_text


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "move"}])
def test_a_function_call_then_its_output_then_the_answer(tool_server, choice):
    jsonschema = pytest.importorskip("jsonschema")
    gen, server = tool_server
    client = _client(server)
    response = client.responses.create(model="refusion", input=ASK, tools=RESPONSES_TOOLS, tool_choice=choice,
                                       extra_body=RANDOM)
    [call] = response.output
    assert call.type == "function_call" and call.status == "completed" and response.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
    chat_choice = choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice["name"]}}
    chat_call = _chat(client, ASK, tools=TOOLS, tool_choice=chat_choice, extra_body=RANDOM).choices[0].message
    assert (call.name, call.arguments) == (chat_call.tool_calls[0].function.name,
                                          chat_call.tool_calls[0].function.arguments)
    events = list(client.responses.create(model="refusion", input=ASK, tools=RESPONSES_TOOLS, tool_choice=choice,
                                          extra_body=RANDOM, stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                        "response.function_call_arguments.delta",
                                        "response.function_call_arguments.done", "response.output_item.done",
                                        "response.completed"]
    assert (events[2].item.type, events[2].item.status, events[3].delta, events[5].item.name) == \
        ("function_call", "in_progress", call.arguments, call.name)

    conversation = [*ASK, *response.output,  # the SDK's items, sent back as they are
                    {"type": "function_call_output", "call_id": call.call_id, "output": '{"done": true}'}]
    answer = client.responses.create(model="refusion", input=conversation, tools=RESPONSES_TOOLS,
                                     max_output_tokens=8, extra_body=RANDOM)
    chat_conversation = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"done": true}'}]
    chat = _chat(client, chat_conversation, tools=TOOLS, max_tokens=8, extra_body=RANDOM).choices[0]
    assert answer.status in ("completed", "incomplete")
    assert answer.output_text == (chat.message.content or "")
    assert [item.type for item in answer.output] == ["message"] * bool(chat.message.content or not chat.message.tool_calls) \
        + ["function_call"] * len(chat.message.tool_calls or [])


def test_a_failure_after_the_stream_began_is_an_error_event_then_response_failed(tool_server):
    """A guide over its budget (reliability probe 5's ambiguous grammar) fails after the stream began: the
    error event and response.failed name its field."""
    events = _events(tool_server[1], {"input": "hi", "max_output_tokens": 512,
                                      "guided_grammar": 'start: s\ns: s s s | s s | "a" | "b"\n'})
    error, failed = events[-2:]
    assert (error["type"], error["param"], failed["type"]) == ("error", "guided_grammar", "response.failed")
    assert "budget" in error["message"] and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["message"] == error["message"]
    Response.model_validate(failed["response"])


def _refused(server, body: dict) -> dict:
    status, _, answer = post(server, "/v1/responses", {"model": "refusion", "input": "hi", **body})
    assert status == 400, answer
    return answer["error"]


@pytest.mark.parametrize("body, param, says", [
    ({"frobnicate": 1}, "frobnicate", "unknown field 'frobnicate'"),
    ({"messages": ASK}, "messages", "a field of /v1/chat/completions"),
    ({"previous_response_id": "resp_1"}, "previous_response_id",
     "previous_response_id is not supported: send the conversation's items in input"),
    ({"conversation": "conv_1"}, "conversation", "nothing is stored"),
    ({"max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[0].call_id",
     "matches no function_call item"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     "input_image content is not supported"),
    ({"input": [{"role": "user", "content": "hi", "colour": "red"}]}, "input[0].colour", "not supported"),
    ({"input": []}, "input", "non-empty list"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "JSON schema"),
    ({"include": ["message.output_text.logprobs"]}, "include", "[] only"),
    ({"temperature": "hot"}, "temperature", "must be a number"),
])
def test_what_is_refused_is_a_400_naming_the_field(serve, body, param, says):
    error = _refused(serve(), body)
    assert error["param"] == param and says in error["message"], error


def test_the_chats_and_the_runtimes_names_become_the_responses_names(serve, tool_server):
    pytest.importorskip("llguidance")
    server = serve()
    error = _refused(server, {"text": {"format": {"type": "json_schema", "name": "a",
                                                  "schema": {"type": "object", "not": {"type": "null"}}}}})
    assert error["param"] == "text.format.schema" and error["message"].startswith("text.format.schema is not a guide")
    with pytest.raises(openai.BadRequestError, match=r"ask for at most \d+ tokens \(max_output_tokens\)") as e:
        _client(server).responses.create(model="refusion", input="hi", max_output_tokens=10**6)
    assert "max_tokens" not in e.value.message
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "input")  # what clients classify it by
    twice = [RESPONSES_TOOLS[0], RESPONSES_TOOLS[0]]  # the runtime's check, named as sent
    error = _refused(tool_server[1], {"tools": twice})
    assert error["param"] == "tools[1].name" and error["message"].startswith("tools[1].name='move' is given twice")
    error = _refused(tool_server[1], {"tools": RESPONSES_TOOLS, "tool_choice": "sometimes"})
    assert error["param"] == "tool_choice" and '{"type": "function", "name": ...}' in error["message"]


def test_a_conversation_becomes_the_chat_request_it_is():
    body = {"model": "m", "instructions": "Be brief.", "max_output_tokens": 5, "tool_choice": "required",
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
            "text": {"format": {"type": "json_object"}}, "store": True, "metadata": {"k": "v"}, "user": "u",
            "include": [], "truncation": "disabled", "reasoning": None, "mode": "ar",
            "input": [{"role": "user", "content": "hi"},
                      {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                       "content": [{"type": "output_text", "text": "Calling.", "annotations": [], "logprobs": []}]},
                      {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": "{}",
                       "status": "completed"},
                      {"type": "function_call", "call_id": "call_2", "name": "f", "arguments": "{\"a\": 1}"},
                      {"type": "function_call_output", "call_id": "call_1", "output": "one"},
                      {"type": "function_call_output", "call_id": "call_2",
                       "output": [{"type": "input_text", "text": "two"}]}]}
    wanted = read_responses(body, "m")
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
             {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]
    chat = {"model": "m", "max_tokens": 5, "tool_choice": "required", "user": "u", "mode": "ar",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}],
            "response_format": {"type": "json_object"},
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "Calling.", "tool_calls": calls},
                         {"role": "tool", "tool_call_id": "call_1", "content": "one"},
                         {"role": "tool", "tool_call_id": "call_2", "content": "two"}]}
    assert wanted.api == read_request(CHAT, chat, "m")
    assert wanted.sources == ("instructions", "input[0]", "input[1]", "input[4]", "input[5]")
    assert wanted.echo["tools"] == body["tools"] and wanted.echo["store"] is False
    assert wanted.echo["text"] == body["text"] and wanted.echo["metadata"] == {"k": "v"}


def test_requests_are_counted_under_their_endpoint(serve):
    server = serve()
    _client(server).responses.create(model="refusion", input="sort: 2 1", max_output_tokens=2)
    assert post(server, "/v1/responses", {"model": "refusion"})[0] == 400  # input missing: refused
    sample = server.metrics.registry.get_sample_value
    assert sample("refusion_requests_total", {"endpoint": "responses", "finish_reason": "length"}) == 1
    assert sample("refusion_requests_refused_total", {"status": "400"}) == 1


def test_the_docs_table_names_every_field_taken():
    doc = (REPO / "docs" / "serving.md").read_text()
    table = doc[doc.index("| Responses field |"):].split("\n\n", 1)[0]
    named = {name for row in table.splitlines()[2:] for name in re.findall(r"`([^`]+)`", row.split("|")[1])}
    assert named == set(TAKEN)


@pytest.mark.parametrize("streamed", [False, True])
def test_an_agent_on_its_default_responses_model_calls_its_tool_then_answers_in_its_type(tool_server, streamed):
    """openai-agents' default model speaks the Responses API: a forced call of a tool (usable once), its output
    back as a function_call_output item, then the answer in the agent's output_type (a json_schema text.format),
    streamed or not; bounded schemas, so that the random-weight model's answers are valid by the guides alone."""
    agents = pytest.importorskip("agents", reason="openai-agents (dev extra)")
    from pydantic import BaseModel

    class Verdict(BaseModel):
        direction: Literal["left", "right"]
        done: Literal["yes", "no"]

    moves: list[str] = []

    @agents.function_tool(is_enabled=lambda context, agent: not moves)
    def move(direction: Literal["left", "right"]) -> str:
        """Drive the robot."""
        moves.append(direction)
        return "moved"

    server = tool_server[1]
    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0),
                                     use_for_tracing=False)
    agents.set_default_openai_api("responses")
    agents.set_tracing_disabled(True)
    agent = agents.Agent(name="driver", instructions="Drive.", model="refusion", tools=[move], output_type=Verdict,
                         model_settings=agents.ModelSettings(tool_choice="required", extra_body=RANDOM))
    if streamed:
        async def run():
            result = agents.Runner.run_streamed(agent, "go left", max_turns=3)
            kinds = [event.type async for event in result.stream_events()]
            assert "raw_response_event" in kinds
            return result
        result = asyncio.run(run())
    else:
        result = agents.Runner.run_sync(agent, "go left", max_turns=3)
    assert len(moves) == 1 and isinstance(result.final_output, Verdict)
    assert [item.type for item in result.new_items] == ["tool_call_item", "tool_call_output_item",
                                                        "message_output_item"]

"""Structured output over the OpenAI server: the openai client's response_format and vLLM's guided fields return
valid content, streamed and not, what the Generator answers; tools with a required or named call return valid
tool_calls, in the message and in the stream; LangChain's with_structured_output and bind_tools work against it."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from refusion.tools.bench.guides import RANDOM_SETTINGS as RANDOM
from refusion.tools.bench.guides import ROBOT, TOOLS

ANSWER = {"title": "Answer", "type": "object", "properties": {"answer": {"type": "string", "maxLength": 40}},
          "required": ["answer"], "additionalProperties": False}
ASK = [{"role": "user", "content": "sort: 5 2 8 2"}]


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("mode", ["refusion", "ar"])
def test_response_format_and_the_guided_fields_give_valid_content(serve, gen, mode):
    client = _client(serve())
    formats = [({"type": "json_schema", "json_schema": {"name": "robot", "schema": ROBOT, "strict": True}},
                dict(json_schema=ROBOT)),
               ({"type": "json_object"}, dict(json_schema={"type": "object"}))]
    for response_format, same in formats:
        answer = client.chat.completions.create(model="refusion", messages=ASK, response_format=response_format,
                                                extra_body={"mode": mode})
        assert answer.choices[0].message.content == gen.generate(messages=ASK, mode=mode, **same).text
        assert isinstance(json.loads(answer.choices[0].message.content), dict)
        streamed = client.chat.completions.create(model="refusion", messages=ASK, response_format=response_format,
                                                  extra_body={"mode": mode}, stream=True)
        chunks = list(streamed)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.choices[0].message.content
        assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), {"type": "object"})
    regex = client.completions.create(model="refusion", prompt="add: 12+34\n", extra_body={"guided_regex": r"\d+\+\d+"})
    assert regex.choices[0].text == gen.generate("add: 12+34\n", regex=r"\d+\+\d+").text
    choice = client.chat.completions.create(model="refusion", messages=ASK,
                                            extra_body={"guided_choice": ["2 2 5 8", "8 5 2 2"], "mode": mode})
    assert choice.choices[0].message.content in ("2 2 5 8", "8 5 2 2")


def test_a_guide_the_engine_cannot_enforce_is_a_400_naming_the_field(serve):
    client = _client(serve())
    with pytest.raises(openai.BadRequestError, match="response_format.json_schema.schema is not a guide") as e:
        client.chat.completions.create(model="refusion", messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object", "not": {"type": "null"}}}})
    assert e.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError, match="guided_grammar is not a guide") as e:
        client.chat.completions.create(model="refusion", messages=ASK, extra_body={"guided_grammar": "start: x"})
    assert e.value.body["param"] == "guided_grammar"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "move"}}])
def test_required_and_named_calls_come_back_as_tool_calls(tool_server, choice):
    gen, server = tool_server
    client = _client(server)
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    answer = client.chat.completions.create(model="refusion", messages=ASK, tools=TOOLS, tool_choice=choice,
                                            extra_body=RANDOM)
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls" and message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    expected = gen.generate(messages=ASK, tools=TOOLS, tool_choice=choice, **RANDOM).tool_calls[0]["function"]
    assert (call.function.name, call.function.arguments) == (expected["name"], expected["arguments"])
    chunks = list(client.chat.completions.create(model="refusion", messages=ASK, tools=TOOLS, tool_choice=choice,
                                                 extra_body=RANDOM, stream=True))
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [(0, *expected.values())]
    assert not any(c.choices[0].delta.content for c in chunks) and chunks[-1].choices[0].finish_reason == "tool_calls"
    follow_up = [*ASK, message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"done": true}'}]
    assert client.chat.completions.create(model="refusion", messages=follow_up, tools=TOOLS, max_tokens=8,
                                          extra_body=RANDOM).choices[0].finish_reason in ("stop", "length")


TAG_TOOL = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"const": "</tool_call>"}}, "required": ["x"]}}}]
_TAG_CALL = '<tool_call>\n{"name": "f", "arguments": {"x": "</tool_call>"}}\n</tool_call>'


@pytest.mark.parametrize("choice, extra, content, calls", [
    ("required", {}, None, [("f", '{"x": "</tool_call>"}')]),  # the guide writes the call; its argument is the tag
    ("auto", {"guided_choice": [f"  Calling.\n{_TAG_CALL}\nDone."]}, "Calling.\n\nDone.",
     [("f", '{"x": "</tool_call>"}')]),
    ("auto", {"guided_choice": ["<tool_call>\nnot a call\n</tool_call> then text"]},
     "<tool_call>\nnot a call\n</tool_call> then text", []),
])
def test_streamed_calls_and_text_are_the_answers_own(tool_server, choice, extra, content, calls):
    """A call whose argument holds `</tool_call>` is read whole, streamed or not; text around calls, and a block
    that is not a call, reach the stream too (held back while a call may be open, then sent)."""
    client = _client(tool_server[1])
    ask = dict(model="refusion", messages=ASK, tools=TAG_TOOL, tool_choice=choice, extra_body={**RANDOM, **extra})
    message = client.chat.completions.create(**ask).choices[0].message
    assert message.content == content
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] == calls
    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed.strip() == (content or "")  # the stream has already sent the spaces the answer begins with
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [(i, *c) for i, c in enumerate(calls)]
    assert chunks[-1].choices[0].finish_reason == ("tool_calls" if calls else "stop")


def test_langchain_with_structured_output_and_bind_tools(serve, tool_server):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=f"{serve().url}/v1", api_key="unused", model="refusion", max_retries=0)
    answer = chat.with_structured_output(ANSWER, method="json_schema").invoke("sort: 5 2 8 2")
    jsonschema.validate(answer, ANSWER)
    tools = ChatOpenAI(base_url=f"{tool_server[1].url}/v1", api_key="unused", model="refusion", max_retries=0,
                       extra_body=RANDOM)
    move = tools.bind_tools([TOOLS[0]], tool_choice="move").invoke("robot, go left")
    assert move.tool_calls[0]["name"] == "move"
    jsonschema.validate(move.tool_calls[0]["args"], TOOLS[0]["function"]["parameters"])
    robot = tools.with_structured_output({"title": "Robot", **ROBOT}, method="function_calling").invoke("go")
    jsonschema.validate(robot, ROBOT)


@pytest.mark.parametrize("mode", ["refusion", "ar"])
def test_a_dead_end_reaches_the_client_as_dead_end_with_the_text_so_far_streamed_or_not(serve, mode):
    client = _client(serve())
    dead = {"guided_grammar": 'start: "a" d | "b" d\nd: d "x"\n', "mode": mode}  # either letter leads nowhere
    answer = client.chat.completions.create(model="refusion", messages=ASK, extra_body=dead)
    assert answer.choices[0].finish_reason == "dead_end" and answer.choices[0].message.content in ("a", "b")
    chunks = list(client.chat.completions.create(model="refusion", messages=ASK, extra_body=dead, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "dead_end"


@pytest.mark.parametrize("extra, param, why", [
    ({"guided_grammar": 'start: a\na: a "x"\n'}, "guided_grammar", "its language holds no answer"),
    ({"guided_choice": ["é", "ü"]}, "guided_choice", "this model's vocabulary cannot write 'é', 'ü'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": {
        "type": "object", "properties": {"k": {"$ref": "#/$defs/a"}}, "required": ["k"],
        "$defs": {"a": {"$ref": "#/$defs/a"}}}}}}, "response_format.json_schema.schema", "its language holds no"),
])
def test_a_guide_that_can_never_be_followed_is_a_one_line_400_naming_its_field(serve, extra, param, why):
    client = _client(serve())
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="refusion", messages=ASK, extra_body=extra)
    error = e.value.body
    assert error["param"] == param and why in error["message"] and "\n" not in error["message"]


def test_the_ambiguous_grammar_ends_by_its_budget_while_health_and_neighbours_are_answered(tool_server):
    """Reliability probe 5's worst: 36 bytes of grammar held the server 165 s. It now ends by the guide budget with
    a 400 naming guided_grammar, and /health and a neighbour's requests are answered while it runs."""
    import threading

    import httpx

    _, server = tool_server
    client, outcome = _client(server), {}

    def ambiguous() -> None:
        try:
            client.completions.create(model="refusion", prompt="hi", max_tokens=512,
                                      extra_body={"guided_grammar": 'start: s\ns: s s s | s s | "a" | "b"\n'})
        except openai.BadRequestError as e:
            outcome["error"] = e.body

    worker = threading.Thread(target=ambiguous)
    worker.start()
    neighbours = 0
    while worker.is_alive():
        assert httpx.get(f"{server.url}/health").status_code == 200
        answer = client.completions.create(model="refusion", prompt="hello", max_tokens=4, extra_body={"mode": "ar"})
        neighbours += answer.choices[0].finish_reason == "length"
    worker.join()
    assert outcome["error"]["param"] == "guided_grammar" and "budget" in outcome["error"]["message"]
    assert neighbours >= 1


def test_tools_with_a_typed_answer_through_the_openai_client_and_langchain(tool_server):
    """The agent pattern (openai-agents, pydantic-ai's NativeOutput, LangChain's with_structured_output(tools=...)):
    tools and a response_format in one request. A Pydantic model's schema carries no additionalProperties: the guide
    reads it as false, so the typed answer closes (was: keys added until max_tokens)."""
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=8)
        age: int = pydantic.Field(ge=0, le=99)

    client = _client(tool_server[1])
    typed = {"type": "json_schema", "json_schema": {"name": "person", "schema": Person.model_json_schema()}}
    asked = dict(model="refusion", messages=[{"role": "user", "content": "go"}], tools=TOOLS[:1], max_tokens=96,
                 response_format=typed)
    forms = set()
    for seed in range(8):
        choice = client.chat.completions.create(**asked, temperature=1.0, seed=seed).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "move"
            forms.add("call")
        else:
            assert choice.finish_reason == "stop"
            Person.model_validate_json(choice.message.content)
            forms.add("answer")
    assert forms == {"call", "answer"}
    required = client.chat.completions.create(**asked, tool_choice="required").choices[0]
    assert required.finish_reason == "tool_calls" and required.message.tool_calls[0].function.name == "move"
    parsed = client.chat.completions.parse(model="refusion", messages=[{"role": "user", "content": "who"}],
                                           response_format=Person, max_tokens=96).choices[0]
    assert parsed.finish_reason == "stop" and isinstance(parsed.message.parsed, Person)

    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=f"{tool_server[1].url}/v1", api_key="unused", model="refusion", max_retries=0,
                      max_tokens=96)
    strict_move = {**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}  # the SDK parses strict tools only
    raw = chat.with_structured_output(Person, method="json_schema", tools=[strict_move], include_raw=True, strict=True,
                                      tool_choice="required").invoke("go")
    assert raw["raw"].tool_calls[0]["name"] == "move"


def test_a_required_call_cut_by_max_tokens_comes_as_a_cut_call_streamed_or_not(tool_server):
    client = _client(tool_server[1])
    asked = dict(model="refusion", messages=[{"role": "user", "content": "go"}], tools=TOOLS[:1],
                 tool_choice="required", max_tokens=24)
    choice = client.chat.completions.create(**asked).choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    call = choice.message.tool_calls[0].function
    assert "move".startswith(call.name) and "<tool_call>" not in call.arguments
    chunks = list(client.chat.completions.create(**asked, stream=True))
    streamed = [d.function for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert [(f.name, f.arguments) for f in streamed] == [(call.name, call.arguments)]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_pydantic_ai_with_a_tool_and_native_output_completes(tool_server):
    """pydantic-ai's agent with a tool and NativeOutput sends tools and a response_format on every request: the
    model calls the tool or answers in the form, and the run ends with a typed output (was: no call ever made, the
    answer forced into the JSON). Sampled over a few seeds: the random model may keep calling until its
    conversation outgrows the 1,024 positions, which is the model's failure, not the server's (a 400 naming it)."""
    pydantic = pytest.importorskip("pydantic")
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.exceptions import ModelHTTPError
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=8)
        age: int = pydantic.Field(ge=0, le=99)

    model = OpenAIChatModel("refusion", provider=OpenAIProvider(base_url=f"{tool_server[1].url}/v1", api_key="unused"))
    outputs, calls = [], []
    for seed in range(4):
        agent = Agent(model, output_type=NativeOutput(Person),
                      model_settings={"temperature": 1.0, "seed": seed, "max_tokens": 96})

        @agent.tool_plain
        def move(direction: Literal["left", "right"]) -> str:
            """Drive the robot."""
            calls.append(direction)
            return "moved"

        try:
            outputs.append(agent.run_sync("go", usage_limits=UsageLimits(request_limit=12)).output)
        except ModelHTTPError as e:
            assert e.status_code == 400 and "positions" in str(e.body)  # the conversation outgrew the model
    assert outputs and all(isinstance(o, Person) for o in outputs) and calls

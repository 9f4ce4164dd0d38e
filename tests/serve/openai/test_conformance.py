"""What OpenAI's clients send and expect, as the server takes and answers it (the fifth clients review, failures
2, 7, 8, 9 and 10): the openai client's dumps of its answers go back as messages; answers carry the fields OpenAI
always sends; logprobs' bytes are the tokens' own; vLLM's structured_outputs and OpenAI's allowed_tools are taken;
an error names no path of the server's."""

from __future__ import annotations

import json

import openai
import pytest

from refusion.runtime.structured.tools import read_tools
from refusion.serve.openai.responses import ApiError
from refusion.serve.openai.schema import CHAT, read_request
from refusion.tools.bench.guides import RANDOM_SETTINGS as RANDOM
from refusion.tools.bench.guides import TOOLS
from tests.serve.openai.helpers import post

ASK = [{"role": "user", "content": "sort: 5 2 8 2"}]
NO_DETAILS = {"reasoning_tokens": 0, "audio_tokens": 0, "accepted_prediction_tokens": 0,
              "rejected_prediction_tokens": 0}


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def tools(tool_server):
    """conftest's tool_server (a random-weight model whose chat template has a tool format and whose vocabulary is
    byte-level BPE), for tests whose calls or choices need the grammar engine."""
    pytest.importorskip("llguidance")
    return tool_server


# -- failure 2: the openai client's message.model_dump() / to_dict() goes back as it is ------------------------------

@pytest.mark.parametrize("dump", ["model_dump", "to_dict"])
def test_the_clients_dump_of_each_answer_goes_back_in_a_tool_loop(tools, dump):
    """`messages.append(message.model_dump())` sends refusal, audio, function_call and annotations as null;
    to_dict() sends what the answer held (refusal: null). Both shapes of answer, a text and a call, go back."""
    client = _client(tools[1])
    ask = dict(model="refusion", tools=TOOLS, extra_body=RANDOM)
    plain = client.chat.completions.create(messages=ASK, tool_choice="none", max_tokens=8, **ask).choices[0].message
    assert plain.tool_calls is None
    messages = [*ASK, getattr(plain, dump)(), {"role": "user", "content": "now stop the robot"}]
    called = client.chat.completions.create(messages=messages, tool_choice="required", **ask).choices[0].message
    assert called.tool_calls
    messages += [getattr(called, dump)(), {"role": "tool", "tool_call_id": called.tool_calls[0].id, "content": "ok"}]
    answer = client.chat.completions.create(messages=messages, tool_choice="required", **ask)
    assert answer.choices[0].finish_reason == "tool_calls"
    assert all(m["refusal"] is None for m in messages[1::2])  # what to_dict() sends once answers carry it


def _messages(*messages):
    return read_request(CHAT, {"model": "m", "messages": [*ASK, *messages]}, "m").jobs[0].messages[1:]


def test_an_assistants_null_and_empty_fields_are_left_out_and_its_refusal_is_its_content():
    call = {"id": "call_1", "type": "function", "function": {"name": "stop", "arguments": "{}"}}
    nulls = {"refusal": None, "audio": None, "function_call": None, "annotations": None, "name": None}
    assert _messages({"role": "assistant", "content": "hi", **nulls, "annotations": []}) == [
        {"role": "assistant", "content": "hi"}]
    assert _messages({"role": "assistant", "content": None, **nulls, "tool_calls": [call]}) == [
        {"role": "assistant", "content": "", "tool_calls": [call]}]
    assert _messages({"role": "assistant", "content": None, "refusal": "I can't."}) == [
        {"role": "assistant", "content": "I can't."}]
    assert _messages({"role": "assistant", "content": [{"type": "refusal", "refusal": "No"},
                                                       {"type": "text", "text": "."}]}) == [
        {"role": "assistant", "content": "No."}]
    for message, param in [({"content": "a", "refusal": "b"}, "refusal"), ({"content": "a", "audio": {"id": "x"}}, "audio"),
                           ({"content": "a", "function_call": {"name": "f", "arguments": "{}"}}, "function_call"),
                           ({"content": "a", "annotations": [{"type": "url_citation"}]}, "annotations"),
                           ({"content": "a", "refusal": 3}, "refusal")]:
        with pytest.raises(ApiError) as e:
            _messages({"role": "assistant", **message})
        assert e.value.param == f"messages[1].{param}"
    with pytest.raises(ApiError, match="a user message has role, content, name"):
        _messages({"role": "user", "content": "a", "refusal": None})  # not a field of a user message


# -- failure 9: the fields OpenAI always sends ------------------------------------------------------------------------

def test_answers_carry_refusal_and_completion_tokens_details_as_openai_sends_them(serve):
    server = serve()
    client = _client(server)
    ask = dict(model="refusion", messages=ASK, max_tokens=8, logprobs=True, top_logprobs=2)
    answer = client.chat.completions.create(**ask).to_dict()
    choice = answer["choices"][0]
    assert choice["message"]["refusal"] is None and "refusal" in choice["message"]
    assert choice["logprobs"]["refusal"] is None and "refusal" in choice["logprobs"] and choice["logprobs"]["content"]
    assert answer["usage"]["completion_tokens_details"] == NO_DETAILS
    assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": answer["usage"]["prompt_tokens_details"][
        "cached_tokens"]}
    chunks = [c.to_dict() for c in client.chat.completions.create(**ask, stream=True,
                                                                  stream_options={"include_usage": True})]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    with_logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert with_logprobs and all(lp["refusal"] is None and "refusal" in lp for lp in with_logprobs)
    assert chunks[-1]["usage"]["completion_tokens_details"] == NO_DETAILS
    completion = client.completions.create(model="refusion", prompt="sort: 3 1 2\n", max_tokens=4)
    assert completion.usage.completion_tokens_details.reasoning_tokens == 0
    status, _, raw = post(server, "/v1/chat/completions", {"model": "refusion", "messages": ASK, "max_tokens": 4})
    assert status == 200 and raw["choices"][0]["message"]["refusal"] is None and raw["choices"][0]["logprobs"] is None


# -- failure 7: logprobs' bytes are each token's own ------------------------------------------------------------------

def test_the_tokens_bytes_rebuild_the_answer_where_a_token_holds_part_of_a_character(tools):
    """A byte-level vocabulary writes a character of several bytes in several tokens; each token's text is then
    U+FFFD, its bytes its own part of the character (they were the replacement character's 239, 191, 189)."""
    gen, server = tools
    client = _client(server)
    text = "añ ÷ 勒 ȴ!"
    vocabulary = set(gen.tokenizer.token_bytes()[0])
    ask = dict(model="refusion", messages=ASK, logprobs=True, top_logprobs=3,
               extra_body={**RANDOM, "guided_choice": [text]})
    answer = client.chat.completions.create(**ask).choices[0]
    tokens = answer.logprobs.content
    assert answer.message.content == text and any(t.token == "\ufffd" for t in tokens)
    assert b"".join(bytes(t.bytes) for t in tokens) == text.encode()
    assert all(bytes(other.bytes) in vocabulary for token in tokens for other in token.top_logprobs)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert b"".join(bytes(t.bytes) for t in streamed) == text.encode()


# -- failure 8: vLLM's structured_outputs and OpenAI's allowed_tools --------------------------------------------------

ROBOT = {"type": "object", "properties": {"action": {"enum": ["left", "right"]}}, "required": ["action"],
         "additionalProperties": False}


@pytest.mark.parametrize("structured, same", [
    ({"json": ROBOT}, {"json_schema": ROBOT}),
    ({"regex": r"\d \d"}, {"regex": r"\d \d"}),
    ({"choice": ["2 2 5 8", "8 5 2 2"]}, {"choice": ["2 2 5 8", "8 5 2 2"]}),
    ({"grammar": 'start: "a" | "b"\n'}, {"grammar": 'start: "a" | "b"\n'}),
    ({"json_object": True, "regex": None}, {"json_schema": {"type": "object"}}),
])
def test_structured_outputs_give_the_guided_fields_guides(serve, gen, structured, same):
    pytest.importorskip("llguidance")
    client = _client(serve())
    answer = client.chat.completions.create(model="refusion", messages=ASK, max_tokens=32,
                                            extra_body={"structured_outputs": structured})
    assert answer.choices[0].message.content == gen.generate(messages=ASK, max_tokens=32, **same).text
    if "json" in structured:
        assert json.loads(answer.choices[0].message.content)["action"] in ("left", "right")


@pytest.mark.parametrize("extra, param, words", [
    ({"structured_outputs": {"json": ROBOT, "regex": "a"}}, "structured_outputs.json",
     "structured_outputs.json and structured_outputs.regex both ask"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "structured_outputs.regex",
     "structured_outputs.regex and guided_choice both ask"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "structured_outputs takes json, regex, choice, grammar, json_object"),
    ({"structured_outputs": {"choice": 3}}, "structured_outputs.choice", "it must be a string or a list of strings"),
    ({"structured_outputs": "json"}, "structured_outputs", "must be an object"),
])
def test_structured_outputs_refusals_name_the_key(serve, extra, param, words):
    client = _client(serve())
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="refusion", messages=ASK, extra_body=extra)
    assert e.value.body["param"] == param and words in e.value.body["message"]


def _allowed(mode: str, *names: str) -> dict:
    return {"type": "allowed_tools", "allowed_tools": {
        "mode": mode, "tools": [{"type": "function", "function": {"name": name}} for name in names]}}


def test_allowed_tools_offer_only_the_functions_listed_with_its_mode(tools):
    gen, server = tools
    client = _client(server)
    ask = dict(model="refusion", messages=ASK, tools=TOOLS, extra_body=RANDOM)
    for name in ("stop", "move"):
        message = client.chat.completions.create(tool_choice=_allowed("required", name), **ask).choices[0].message
        assert [c.function.name for c in message.tool_calls] == [name]
    prompt = client.chat.completions.create(tool_choice=_allowed("auto", "stop"), max_tokens=1, **ask).usage.prompt_tokens
    only_stop = read_tools([TOOLS[1]], "auto")
    assert prompt == len(gen.prompt_ids(messages=ASK, tools=only_stop)) < len(gen.prompt_ids(
        messages=ASK, tools=read_tools(TOOLS, "auto")))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(tool_choice=_allowed("required", "stop", "fly"), **ask)
    assert e.value.body["param"] == "tool_choice.allowed_tools.tools[1]" and "'fly'" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(tool_choice=_allowed("any", "stop"), **ask)
    assert e.value.body["param"] == "tool_choice.allowed_tools.mode"


# -- failure 10: no path of the server's in an error ------------------------------------------------------------------

def test_the_tool_format_refusal_names_no_path(untooled_server, untooled_export):
    client = _client(untooled_server)
    with pytest.raises(openai.BadRequestError, match="has no tool format") as e:
        client.chat.completions.create(model="refusion", messages=ASK, tools=TOOLS)
    message = e.value.body["message"]
    assert message.startswith("the chat template of this model has no tool format (it never reads `tools`)")
    assert str(untooled_export) not in message and "/" not in message and e.value.body["param"] is None

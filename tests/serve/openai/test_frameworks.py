"""LangChain's OpenAI classes (and litellm) against the server, as agent builders use them (requests-review-4, F4, F5):
ChatOpenAI's invoke, stream, batch, named messages and stream_usage, and the completions class's batch, each
answering what the Generator answers (greedy)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("langchain_openai", reason="the LangChain tests need the dev extra (langchain-openai)")

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI, OpenAI

from refusion.tools.bench.guides import TOOLS

QUESTIONS = ["sort: 5 2 8 2", "reverse: robotics", "list: 4,8,15,16,23,42"]


def _chat(server, **options) -> ChatOpenAI:
    return ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model="refusion", max_tokens=24, max_retries=0,
                      **options)


def _answer(gen, question: str) -> str:
    return gen.generate(messages=[{"role": "user", "content": question}], max_tokens=24).text


def test_chat_invoke_batch_and_stream(serve, gen):
    chat = _chat(serve())
    assert chat.invoke(QUESTIONS[0]).content == _answer(gen, QUESTIONS[0])
    assert [m.content for m in chat.batch(QUESTIONS)] == [_answer(gen, q) for q in QUESTIONS]
    assert "".join(chunk.content for chunk in chat.stream(QUESTIONS[1])) == _answer(gen, QUESTIONS[1])


def test_named_messages_as_langgraph_agents_send_them(serve, gen):
    chat = _chat(serve())
    conversation = [SystemMessage("Keep answers short."), HumanMessage("sort: 5 2 8 2", name="alice"),
                    AIMessage("2 2 5 8", name="agent"), HumanMessage("reverse: robotics", name="alice")]
    expected = gen.generate(messages=[{"role": "system", "content": "Keep answers short."},
                                      {"role": "user", "content": "sort: 5 2 8 2", "name": "alice"},
                                      {"role": "assistant", "content": "2 2 5 8", "name": "agent"},
                                      {"role": "user", "content": "reverse: robotics", "name": "alice"}], max_tokens=24)
    assert chat.invoke(conversation).content == expected.text


def test_stream_usage_counts_the_tokens_returned(serve, gen):
    chat = _chat(serve(), stream_usage=True)
    chunks = list(chat.stream(QUESTIONS[2]))
    usage = [c.usage_metadata for c in chunks if c.usage_metadata]
    expected = gen.generate(messages=[{"role": "user", "content": QUESTIONS[2]}], max_tokens=24)
    assert len(usage) == 1 and usage[0]["output_tokens"] == len(expected.token_ids)
    assert usage[0]["input_tokens"] == len(expected.prompt_ids)


def test_the_completions_class_batches_its_prompts_in_one_request(serve, gen):
    llm = OpenAI(base_url=f"{serve().url}/v1", api_key="unused", model="refusion", max_tokens=16, max_retries=0,
                 temperature=0)  # its default samples (0.7)
    prompts = ["sort: 9 1 4\n", "reverse: robotics\n", "list: 1,2,3\n"]
    assert llm.batch(prompts) == [gen.generate(p, max_tokens=16).text for p in prompts]
    assert llm.invoke(prompts[0]) == gen.generate(prompts[0], max_tokens=16).text


def test_litellm_completion_and_stream(serve, gen, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its price table from the package, not the network
    litellm = pytest.importorskip("litellm")
    base = f"{serve().url}/v1"
    messages = [{"role": "user", "content": QUESTIONS[0], "name": "alice"}]
    answer = litellm.completion(model="openai/refusion", api_base=base, api_key="unused", messages=messages,
                                max_tokens=24, num_retries=0)
    assert answer.choices[0].message.content == _answer(gen, QUESTIONS[0])
    streamed = litellm.completion(model="openai/refusion", api_base=base, api_key="unused", messages=messages,
                                  max_tokens=24, stream=True, num_retries=0)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed) == _answer(gen, QUESTIONS[0])


def test_litellm_tools_with_a_typed_answer(tool_server, monkeypatch):
    """litellm's completion with tools, tool_choice required and a response_format in one request (the review's
    failure 1 through litellm: a 400 before): the call comes back, its arguments valid."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    jsonschema = pytest.importorskip("jsonschema")
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
    answer = litellm.completion(model="openai/refusion", api_base=f"{tool_server[1].url}/v1", api_key="unused",
                                messages=[{"role": "user", "content": "go"}], tools=TOOLS[:1], tool_choice="required",
                                response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": person}},
                                max_tokens=96, num_retries=0)
    call = answer.choices[0].message.tool_calls[0]
    assert answer.choices[0].finish_reason == "tool_calls" and call.function.name == "move"
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])

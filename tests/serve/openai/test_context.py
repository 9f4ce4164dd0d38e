"""A prompt near or over the model's positions through the server (clients-5, failures 4 and 5), on the
random-weight export of 1024 positions: over them, OpenAI's error (code context_length_exceeded, param messages or
prompt, "maximum context length is N tokens"), which the openai client, LangChain and litellm each classify as
such; near them, max_tokens left out takes what the context leaves and any max_tokens that fits is answered,
the one an error says remains included."""

from __future__ import annotations

import json
import re

import openai
import pytest

from refusion.runtime.generator import Generator
from refusion.serve.openai.server import OpenAIServer
from tests.runtime.test_context import NAMED, TOOLS, WEATHER
from tests.serve.openai.helpers import post

LONG = "word " * 100  # 400-odd tokens of text: with max_tokens 700, over the 1024 positions


@pytest.fixture(scope="module")
def server(tool_server) -> tuple[Generator, OpenAIServer]:
    """The random-weight model's server (1,024 positions, a template with a tool format): conftest's."""
    return tool_server


def _client(server: OpenAIServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, param", [("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")])
def test_over_the_context_is_openais_error(server, path, param, stream):
    gen, srv = server
    ask = {"messages": [{"role": "user", "content": LONG}]} if param == "messages" else {"prompt": LONG}
    prompt = (gen.prompt_ids(messages=ask["messages"]) if param == "messages" else gen.prompt_ids(LONG))
    room = 1024 - len(prompt)
    for max_tokens in (700, room + 1):
        status, _, body = post(srv, path, {"model": "refusion", "max_tokens": max_tokens, "stream": stream, **ask})
        assert status == 400, body
        error = body["error"]
        assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "context_length_exceeded",
                                                                  param)
        assert error["message"].startswith(f"This model's maximum context length is 1024 tokens. However, you requested "
                                           f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, "
                                           f"{max_tokens} in the completion).")
        assert f"ask for at most {room} tokens (max_tokens)" in error["message"]
    status, _, body = post(srv, path, {"model": "refusion", "stream": stream, **(
        {"messages": [{"role": "user", "content": "word " * 1100}]} if param == "messages" else {"prompt": "w" * 1100})})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded" and body["error"]["param"] == param
    assert "maximum context length is 1024 tokens" in body["error"]["message"]


def test_the_openai_client_reads_its_code_and_param(server):
    _, srv = server
    with pytest.raises(openai.BadRequestError) as refused:
        _client(srv).chat.completions.create(model="refusion", messages=[{"role": "user", "content": LONG}],
                                             max_tokens=700)
    assert (refused.value.code, refused.value.param) == ("context_length_exceeded", "messages")
    with pytest.raises(openai.BadRequestError) as refused:
        _client(srv).completions.create(model="refusion", prompt=LONG, max_tokens=700, stream=True)
    assert (refused.value.code, refused.value.param) == ("context_length_exceeded", "prompt")


def test_langchain_raises_its_context_overflow(server):
    pytest.importorskip("langchain_openai", reason="the LangChain tests need the dev extra (langchain-openai)")
    from langchain_core.exceptions import ContextOverflowError
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=f"{server[1].url}/v1", api_key="unused", model="refusion", max_tokens=700,
                      max_retries=0)
    with pytest.raises(ContextOverflowError):
        chat.invoke(LONG)
    with pytest.raises(ContextOverflowError):
        list(chat.stream(LONG))


def test_litellm_raises_its_context_window_exceeded(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its price table from the package, not the network
    litellm = pytest.importorskip("litellm")
    for stream in (False, True):
        with pytest.raises(litellm.ContextWindowExceededError):
            litellm.completion(model="openai/refusion", api_base=f"{server[1].url}/v1", api_key="unused",
                               messages=[{"role": "user", "content": LONG}], max_tokens=700, stream=stream,
                               num_retries=0)


def test_max_tokens_left_out_takes_what_the_context_leaves(server):
    """Repro 4a: 616 prompt tokens and no max_tokens was a 400 ("616 tokens + 512 positions")."""
    gen, srv = server
    messages = [{"role": "user", "content": "word " * 150}]
    answer = _client(srv).chat.completions.create(model="refusion", messages=messages)
    assert answer.usage.prompt_tokens == 616 and answer.usage.completion_tokens <= 408
    assert answer.choices[0].message.content == gen.generate(messages=messages).text
    chunks = list(_client(srv).chat.completions.create(model="refusion", messages=messages, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.choices[0].message.content


def test_max_tokens_that_fits_is_answered_and_the_errors_advice_is_taken(server):
    """Repro 4b: max_tokens=284 after a 740-token prompt (tools) was refused as 384 positions; the room an error
    names is then asked for and answered."""
    gen, srv = server
    client = _client(srv)
    answer = client.chat.completions.create(model="refusion", messages=WEATHER, tools=TOOLS, tool_choice=NAMED,
                                            max_tokens=284)
    assert answer.usage.prompt_tokens == 740 and answer.choices[0].finish_reason == "tool_calls"
    assert json.loads(answer.choices[0].message.tool_calls[0].function.arguments)["unit"] in ("c", "f")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="refusion", messages=WEATHER, tools=TOOLS, max_tokens=300)
    said = re.search(r"ask for at most (\d+) tokens", refused.value.message)
    assert said is not None and said[1] == "284"
    answer = client.chat.completions.create(model="refusion", messages=WEATHER, tools=TOOLS, max_tokens=int(said[1]))
    assert answer.usage.completion_tokens <= 284
    expected = gen.generate(messages=WEATHER, tools=TOOLS, max_tokens=284)
    assert answer.choices[0].finish_reason == ("tool_calls" if expected.tool_calls else expected.finish_reason)


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_max_tokens_below_one_stays_a_400_naming_it(server, max_tokens):
    status, _, body = post(server[1], "/v1/chat/completions", {"model": "refusion", "max_tokens": max_tokens,
                                                               "messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and body["error"]["param"] == "max_tokens" and body["error"]["code"] is None
    assert "must be a positive integer" in body["error"]["message"]

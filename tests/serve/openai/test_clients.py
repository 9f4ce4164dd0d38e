"""The openai client against the server: chat and completions, streaming and not, get the tokens
Generator.generate gives at the same settings (greedy), with OpenAI's usage, finish reasons and shapes."""

from __future__ import annotations

import openai
import pytest

from refusion.serve.openai.responses import FINISH_REASONS

MESSAGES = [
    [{"role": "user", "content": "sort: 5 2 8 2"}],
    [{"role": "system", "content": "You are a careful assistant that answers in one line."},
     {"role": "user", "content": "reverse: robotics"}],
    [{"role": "user", "content": "add: 482+395"}, {"role": "assistant", "content": "482+395=877"},
     {"role": "user", "content": [{"type": "text", "text": "sort: "}, {"type": "text", "text": "9 1 4"}]}],
]
SETTINGS = [{"max_tokens": 32}, {"max_tokens": 12, "extra_body": {"mode": "ar"}}, {"max_tokens": 5}]


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _template(messages):
    """The conversation as the chat template takes it (text parts joined)."""
    return [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
             else "".join(p["text"] for p in m["content"])} for m in messages]


def _keywords(settings):
    return {"max_tokens": settings["max_tokens"], **settings.get("extra_body", {})}


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("messages", MESSAGES)
def test_chat_completions_give_the_generators_tokens(serve, gen, messages, settings):
    client = _client(serve())
    expected = gen.generate(messages=_template(messages), **_keywords(settings))
    extra = {"return_token_ids": True, **settings.get("extra_body", {})}
    answer = client.chat.completions.create(model="refusion", messages=messages, max_tokens=settings["max_tokens"],
                                            extra_body=extra)
    choice = answer.choices[0]
    assert choice.model_extra["token_ids"] == expected.token_ids
    assert choice.message.content == expected.text and choice.message.role == "assistant"
    assert choice.finish_reason == FINISH_REASONS[expected.finish_reason]
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-") and answer.model == "refusion"
    usage = answer.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(expected.prompt_ids), expected.stats.tokens)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    chunks = list(client.chat.completions.create(model="refusion", messages=messages, max_tokens=settings["max_tokens"],
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=extra))
    assert chunks[0].choices[0].delta.role == "assistant"
    *pieces, closing, last = chunks
    assert "".join(c.choices[0].delta.content or "" for c in pieces) == expected.text
    assert closing.choices[0].finish_reason == FINISH_REASONS[expected.finish_reason]
    assert closing.choices[0].model_extra["token_ids"] == expected.token_ids
    assert last.choices == [] and last.usage.completion_tokens == expected.stats.tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_take_text_or_token_ids_and_give_the_generators_tokens(serve, gen):
    client = _client(serve())
    prompt = "reverse: robotics\n"
    expected = gen.generate(prompt, max_tokens=10, mode="ar")
    answer = client.completions.create(model="refusion", prompt=prompt, max_tokens=10, logprobs=0,
                                       extra_body={"mode": "ar", "return_token_ids": True})
    choice = answer.choices[0]
    assert answer.object == "text_completion" and choice.text == expected.text
    assert choice.model_extra["token_ids"] == expected.token_ids
    assert choice.finish_reason == FINISH_REASONS[expected.finish_reason]
    with_logprobs = gen.generate(prompt, max_tokens=10, mode="ar", logprobs=True)
    shown = len(choice.logprobs.tokens)
    assert choice.logprobs.token_logprobs == pytest.approx(with_logprobs.logprobs[:shown])
    assert "".join(choice.logprobs.tokens) == expected.text[: sum(map(len, choice.logprobs.tokens))]

    ids = gen.prompt_ids(prompt)
    by_ids = client.completions.create(model="refusion", prompt=ids, max_tokens=10, extra_body={"mode": "ar"})
    assert by_ids.choices[0].text == expected.text and by_ids.usage.prompt_tokens == len(ids)
    streamed = client.completions.create(model="refusion", prompt=prompt, max_tokens=10, stream=True,
                                         extra_body={"mode": "ar"})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == FINISH_REASONS[expected.finish_reason]


def test_a_repeated_system_prompt_is_reported_as_cached_tokens(serve, gen):
    client = _client(serve())
    system = {"role": "system", "content": "Answer the task exactly; " * 4}
    first, second = (client.chat.completions.create(model="refusion", max_tokens=8,
                                                    messages=[system, {"role": "user", "content": task}])
                     for task in ("sort: 3 1 2", "sort: 9 8 7"))
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens_details.cached_tokens
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_stop_and_sampling_reach_the_generator(serve, gen):
    client = _client(serve())
    messages = [{"role": "user", "content": "list: 512,495,820,1,478"}]
    full = gen.generate(messages=messages, max_tokens=32).text
    assert len(full) >= 4, f"the model's answer {full!r} is too short to stop inside"
    stop = full[len(full) // 2:][:2]
    answer = client.chat.completions.create(model="refusion", messages=messages, max_tokens=32, stop=[stop])
    assert answer.choices[0].message.content == gen.generate(messages=messages, max_tokens=32, stop=[stop]).text
    assert answer.choices[0].finish_reason == "stop"
    sampled = dict(temperature=0.9, top_p=0.8, seed=7)
    expected = gen.generate(messages=messages, max_tokens=16, top_k=5, **sampled)
    answer = client.chat.completions.create(model="refusion", messages=messages, max_tokens=16,
                                            extra_body={"top_k": 5, "return_token_ids": True}, **sampled)
    assert answer.choices[0].model_extra["token_ids"] == expected.token_ids


def test_models_lists_the_served_model(serve):
    server = serve(model_name="tiny")
    client = _client(server)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="does not exist here"):
        client.models.retrieve("refusion")
    with pytest.raises(openai.NotFoundError, match="serves 'tiny'"):
        client.chat.completions.create(model="refusion", messages=[{"role": "user", "content": "hi"}])


def test_the_clients_errors_name_the_field(serve):
    client = _client(serve())
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="n=2 is not supported") as e:
        client.chat.completions.create(model="refusion", messages=messages, n=2)
    assert e.value.body["param"] == "n" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="tools is not supported"):
        client.chat.completions.create(model="refusion", messages=messages,
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    with pytest.raises(openai.BadRequestError, match="slot_threshold=2.0 is outside"):
        client.chat.completions.create(model="refusion", messages=messages, extra_body={"slot_threshold": 2.0})

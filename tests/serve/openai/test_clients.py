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
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(expected.prompt_ids), len(expected.token_ids))
    assert answer.system_fingerprint == gen.manifest.fingerprint
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    chunks = list(client.chat.completions.create(model="refusion", messages=messages, max_tokens=settings["max_tokens"],
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=extra))
    assert chunks[0].choices[0].delta.role == "assistant"
    *pieces, closing, last = chunks
    assert "".join(c.choices[0].delta.content or "" for c in pieces) == expected.text
    assert closing.choices[0].finish_reason == FINISH_REASONS[expected.finish_reason]
    assert closing.choices[0].model_extra["token_ids"] == expected.token_ids
    assert last.choices == [] and last.usage.completion_tokens == len(expected.token_ids)
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


def test_the_clients_errors_name_the_field(serve, untooled_server):
    client = _client(serve())
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="n=0 must be at least 1") as e:
        client.chat.completions.create(model="refusion", messages=messages, n=0)
    assert e.value.body["param"] == "n" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="has no tool format"):
        _client(untooled_server).chat.completions.create(model="refusion", messages=messages,
                                                         tools=[{"type": "function", "function": {"name": "f"}}])
    with pytest.raises(openai.BadRequestError, match="slot_threshold=2.0 is outside"):
        client.chat.completions.create(model="refusion", messages=messages, extra_body={"slot_threshold": 2.0})


def test_what_real_clients_send_is_taken(serve, gen):
    """requests-review-4's F4-F6: a message's name, user, response_format text, a negative int64 seed, top_p 0."""
    client = _client(serve())
    messages = [{"role": "system", "content": "Keep answers short."},
                {"role": "user", "content": "sort: 5 2 8 2", "name": "alice"},
                {"role": "assistant", "content": "2 2 5 8", "name": "agent"},
                {"role": "user", "content": "reverse: robotics", "name": "alice"}]
    expected = gen.generate(messages=messages)  # the template is given each name (this one reads none)
    answer = client.chat.completions.create(model="refusion", messages=messages, user="u1",
                                            response_format={"type": "text"}, seed=-1, top_p=0)
    assert answer.choices[0].message.content == expected.text  # greedy: the seed and top_p change nothing
    sampled = dict(temperature=0.8, top_p=0.0)  # top_p 0 keeps the most likely candidate alone: greedy's token
    assert client.chat.completions.create(model="refusion", messages=messages, seed=-5, **sampled
                                          ).choices[0].message.content == expected.text
    card = client.models.retrieve("refusion")
    assert card.created == int((gen.manifest.path / "refusion.json").stat().st_mtime) > 0


def test_n_choices_and_a_list_of_prompts(serve, gen):
    client = _client(serve())
    messages = [{"role": "user", "content": "list: 512,495,820,1,478"}]
    greedy = gen.generate(messages=messages)
    answer = client.chat.completions.create(model="refusion", messages=messages, n=3)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert all(c.message.content == greedy.text for c in answer.choices)
    assert answer.usage.prompt_tokens == len(greedy.prompt_ids)  # the prompt counted once
    assert answer.usage.completion_tokens == 3 * len(greedy.token_ids)
    # sampled with a seed: choice i draws with seed + i, so they differ and repeat
    sampled = dict(temperature=1.0, seed=11, max_tokens=16)
    choices = [c.message.content for c in client.chat.completions.create(model="refusion", messages=messages, n=3,
                                                                          **sampled).choices]
    assert choices == [gen.generate(messages=messages, temperature=1.0, seed=11 + i, max_tokens=16).text
                       for i in range(3)]
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(model="refusion", messages=messages, n=2, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert streamed == {0: greedy.text, 1: greedy.text}

    prompts = ["sort: 9 1 4", "reverse: robotics"]
    batch = client.completions.create(model="refusion", prompt=prompts, max_tokens=16)
    assert [(c.index, c.text) for c in batch.choices] == [(i, gen.generate(p, max_tokens=16).text)
                                                          for i, p in enumerate(prompts)]
    assert gen.scheduler.regions_in_use == 0


def test_top_logprobs_and_logprobs_in_a_stream(serve, gen):
    client = _client(serve())
    messages = [{"role": "user", "content": "reverse: robotics"}]
    expected = gen.generate(messages=messages, logprobs=True, top_logprobs=3)
    answer = client.chat.completions.create(model="refusion", messages=messages, logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == len(expected.token_ids)  # F7: they agree
    assert "".join(t.token for t in content) == answer.choices[0].message.content
    for token, value, alternatives in zip(content, expected.logprobs, expected.top_logprobs, strict=True):
        assert token.logprob == pytest.approx(value) and len(token.top_logprobs) == 3
        assert [t.logprob for t in token.top_logprobs] == pytest.approx([lp for _, lp in alternatives])
        assert token.top_logprobs[0].logprob >= token.top_logprobs[-1].logprob
    chunks = list(client.chat.completions.create(model="refusion", messages=messages, logprobs=True, stream=True,
                                                 stop=["ot"]))
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == gen.generate(messages=messages, stop=["ot"]).text
    assert "".join(t.token for t in tokens) == text  # nothing of the stop: F7
    completion = client.completions.create(model="refusion", prompt="sort: 3 1 2\n", max_tokens=8, logprobs=2)
    assert all(len(top) == 2 for top in completion.choices[0].logprobs.top_logprobs)

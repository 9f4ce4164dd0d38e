"""What a request asks beyond its prompt: max_tokens as a cap, stop sequences, logprobs; on the embedded model."""

from __future__ import annotations

import numpy as np
import pytest

from refusion.runtime.core.errors import ContextLengthError
from refusion.runtime.decode import masks
from refusion.runtime.generator import Generator
from refusion.runtime.runners.onnxruntime import OrtRunner

pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

EOS = 102  # the embedded model's
SETTINGS = dict(gen_length=32, slot_size=4, serial_num_blocks=2, slot_threshold=0.5, token_threshold=0.1)


@pytest.fixture(scope="module")
def gen(tiny_export):
    with Generator.from_dir(tiny_export, backend="ort-cpu", threads=1) as g:
        yield g


@pytest.fixture(scope="module")
def prompt(gen) -> list[int]:
    return gen.prompt_ids("count: 1 2 3 4 5 6 7 8 9", chat=True)


@pytest.mark.parametrize("mode", ["refusion", "ar"])
def test_max_tokens_is_a_cap_for_every_n(gen, prompt, mode):
    room = gen.manifest.max_positions - len(prompt)
    for n in [*range(1, 20), 31, 32, 33, 50, room - room % 16]:
        res = gen.generate(prompt_ids=prompt, max_tokens=n, mode=mode, **SETTINGS)
        assert len(res.token_ids) <= n, (n, res.token_ids)
        assert res.finish_reason == "eos" or (res.finish_reason == "length" and len(res.token_ids) == n)


@pytest.mark.parametrize("mode", ["refusion", "ar"])
def test_max_tokens_only_cuts_the_uncapped_answer(gen, mode):
    """F3 of requests-review-4: greedy max_tokens=N is the uncapped answer's first N tokens, for every N, on
    held-out prompts at the export's settings (the cap never changes the blocks the plan chooses among)."""
    from refusion.tools.tasks import held_out

    prompts = ["add: 41009 + 17389", "add: 11070 + 71872", *(example.prompt for example in held_out(24))]  # the review's first
    for text in prompts:
        ids = gen.prompt_ids(text, chat=True)
        whole = gen.generate(prompt_ids=ids, mode=mode)
        assert whole.finish_reason == "eos", text
        for n in range(1, len(whole.token_ids) + 2):  # the last N holds the EOS too
            capped = gen.generate(prompt_ids=ids, mode=mode, max_tokens=n)
            assert capped.token_ids == whole.token_ids[:n], (text, n)
            assert capped.finish_reason == ("length" if n <= len(whole.token_ids) else "eos"), (text, n)


def test_ar_with_max_tokens_is_the_prefix_of_a_longer_answer(gen, prompt):
    whole = gen.generate(prompt_ids=prompt, mode="ar", gen_length=64, slot_threshold=0.9).token_ids
    for n in (1, 5, 17):
        assert gen.generate(prompt_ids=prompt, mode="ar", max_tokens=n).token_ids == whole[:n]


def test_max_tokens_of_whole_blocks_is_upstreams_layout(gen, prompt):
    """max_tokens 32 with blocks of 16 is gen_length 32 in 2 blocks, token for token."""
    canvas = gen.generate(prompt_ids=prompt, **SETTINGS)
    capped = gen.generate(prompt_ids=prompt, max_tokens=32, **SETTINGS)
    assert capped.token_ids == canvas.token_ids and capped.finish_reason == canvas.finish_reason
    # gen_length alone keeps upstream's padding: 10 -> 12 positions, returned whole
    padded = gen.generate(prompt_ids=prompt, gen_length=10, slot_size=4, serial_num_blocks=1, slot_threshold=0.0,
                          token_threshold=1.0)
    assert len(padded.token_ids) == 12 or gen.manifest.eos_token_id in padded.token_ids


@pytest.mark.parametrize("mode", ["refusion", "ar"])
def test_max_tokens_past_the_positions_is_refused_naming_the_room(gen, prompt, mode):
    """clients-5, failure 4: OpenAI's words and the numbers on the error; its advice, followed, is answered."""
    context = gen.manifest.max_positions
    room = context - len(prompt)
    with pytest.raises(ContextLengthError, match=rf"^This model's maximum context length is {context} tokens\. However, "
                                                 rf"you requested {context + 1} tokens \({len(prompt)} in the prompt, {room + 1} in "
                                                 rf"the completion\)\. .*ask for at most {room} tokens") as refused:
        gen.generate(prompt_ids=prompt, max_tokens=room + 1, mode=mode)
    e = refused.value
    assert (e.context, e.prompt, e.completion, e.room) == (context, len(prompt), room + 1, room)
    res = gen.generate(prompt_ids=prompt, max_tokens=e.room, mode=mode)  # the advice, followed
    assert len(res.token_ids) <= room and res.finish_reason in ("eos", "length")


@pytest.mark.parametrize("mode", ["refusion", "ar"])
def test_a_stop_string_ends_the_answer_before_it(gen, prompt, mode):
    whole = gen.generate(prompt_ids=prompt, mode=mode, **SETTINGS)
    assert len(whole.text) >= 6, whole.text
    for stop in (whole.text[2:4], whole.text[-2:], [whole.text[3:5], whole.text[1:3]], "not in the answer"):
        res = gen.generate(prompt_ids=prompt, mode=mode, stop=stop, **SETTINGS)
        stops = [stop] if isinstance(stop, str) else stop
        found = [whole.text.find(s) for s in stops if s in whole.text]
        if not found:
            assert (res.text, res.finish_reason) == (whole.text, whole.finish_reason)
            continue
        assert res.finish_reason == "stop" and res.text == whole.text[: min(found)]
        assert res.token_ids == whole.token_ids[: len(res.token_ids)]  # the fewest tokens that hold its text
        assert gen.tokenizer.decode(res.token_ids).startswith(res.text)
        assert not res.token_ids or not gen.tokenizer.decode(res.token_ids[:-1]).startswith(res.text)
        assert "".join(gen.stream(prompt_ids=prompt, mode=mode, stop=stop, **SETTINGS)) == res.text


@pytest.mark.parametrize("mode", ["refusion", "ar"])
def test_a_stop_token_ends_the_answer_there(gen, prompt, mode):
    whole = gen.generate(prompt_ids=prompt, mode=mode, **SETTINGS)
    token = whole.token_ids[3]
    at = whole.token_ids.index(token)
    res = gen.generate(prompt_ids=prompt, mode=mode, stop_token_ids=[token], **SETTINGS)
    assert res.finish_reason == "stop" and res.token_ids == whole.token_ids[:at]  # the stop token is not returned
    assert res.text == gen.tokenizer.decode(whole.token_ids[:at]) and res.stats.tokens == at + 1
    assert "".join(gen.stream(prompt_ids=prompt, mode=mode, stop_token_ids=[token], **SETTINGS)) == res.text


def test_a_stop_frees_the_request_at_once(gen, prompt):
    """It ends at the commit that reaches the stop: no forward after it, its KV region back."""
    whole = gen.generate(prompt_ids=prompt, mode="ar", max_tokens=30)
    res = gen.generate(prompt_ids=prompt, mode="ar", max_tokens=30, stop_token_ids=[whole.token_ids[1]])
    assert res.stats.forward_count == 2 and gen.scheduler.regions_in_use == 0


@pytest.mark.parametrize("mode", ["refusion", "ar"])
def test_logprobs_are_each_tokens_drafted_probability(gen, prompt, mode):
    res = gen.generate(prompt_ids=prompt, mode=mode, logprobs=True, **SETTINGS)
    assert gen.generate(prompt_ids=prompt, mode=mode, **SETTINGS).logprobs is None  # only when asked
    assert len(res.logprobs) == len(res.token_ids) and all(lp <= 0 for lp in res.logprobs)
    if mode == "ar":  # a causal prefill over prompt + answer reads the same probabilities, token by token
        ids = prompt + res.token_ids[:-1]
        with OrtRunner(gen.manifest, threads=1) as runner:
            runner.allocate_kv(len(ids))
            out = runner.run("infiller", np.array([ids]), np.arange(len(ids))[None], masks.causal_after(0, len(ids)),
                             0, 0)
        assert out["argmax_ids"][0, len(prompt) - 1:].tolist() == res.token_ids
        np.testing.assert_allclose(res.logprobs, np.log(out["argmax_probs"][0, len(prompt) - 1:]), atol=1e-4)


def _holes(result) -> list[int]:
    """Answer positions (offsets from the prompt's end) before its first EOS (or its last committed position)
    that were never decoded."""
    eos, p0 = EOS, len(result.prompt_ids)
    committed = {p - p0: t for c in result.commits for p, t in zip(c.positions, c.token_ids)}
    end = min((p for p, t in committed.items() if t == eos), default=max(committed, default=-1) + 1)
    return [p for p in range(end) if p not in committed]


def test_the_reviews_gap_case_has_no_hole_and_its_stops_apply_with_upstreams_drop_too(gen):
    """F1 of requests-review-4: upstream's EOS drop skips answer positions 4-7 of this prompt (the review's second
    on the model it probed; its first on today's); by default every position is decoded. Either way a stop string or
    stop token applies to the final text, streamed or not."""
    prompt = gen.prompt_ids("add: 41009 + 17389", chat=True)
    upstream = gen.generate(prompt_ids=prompt, upstream_eos_drop=True)
    ours = gen.generate(prompt_ids=prompt)
    assert _holes(upstream) == [4, 5, 6, 7] and _holes(ours) == []
    for drop in (True, False):
        whole = upstream if drop else ours
        at = whole.text.index("91")
        for stop in ({"stop": "91"}, {"stop_token_ids": gen.tokenizer.encode("9")}):
            cut = whole.text[:at] if "stop" in stop else whole.text[: whole.text.index("9")]
            res = gen.generate(prompt_ids=prompt, upstream_eos_drop=drop, **stop)
            assert (res.text, res.finish_reason) == (cut, "stop"), (drop, stop)
            assert "".join(gen.stream(prompt_ids=prompt, upstream_eos_drop=drop, **stop)) == cut
            assert gen.tokenizer.decode(res.token_ids) == cut


def test_a_fuzz_of_prompts_and_seeds_finds_no_hole_and_no_stop_text(gen):
    from refusion.tools.tasks import held_out

    prompts = [example.prompt for example in held_out(30)] + ["", "add: 9", "sort:", "zzzz " * 8, "list: 1,", "?"]
    rng = np.random.default_rng(0)
    for i, text in enumerate(prompts):
        sampling = dict(temperature=0.8, seed=int(rng.integers(2**63))) if i % 2 else {}
        whole = gen.generate(text, chat=True, **sampling)
        assert _holes(whole) == [], text
        if len(whole.text) < 3:
            continue
        start = int(rng.integers(len(whole.text) - 2))
        stop = whole.text[start: start + 2]
        res = gen.generate(text, chat=True, stop=stop, **sampling)
        assert (res.text, res.finish_reason) == (whole.text[: whole.text.index(stop)], "stop"), (text, stop)
        assert stop not in res.text and "".join(gen.stream(text, chat=True, stop=stop, **sampling)) == res.text

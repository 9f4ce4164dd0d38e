"""Chunked prefill on onnxruntime (issue 34): a prompt longer than prefill_chunk is prefilled in chunks, other
requests' forwards between them, and the greedy tokens are those of the unchunked prefill, ReFusion and AR, alone,
batched and over the prefix cache; no call feeds more than the bound; a request is cancelled between chunks."""

from __future__ import annotations

import numpy as np
import pytest

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.profiles import DEFAULT_PREFILL_CHUNK
from refusion.runtime.generator import Generator, resolve_prefill_chunk
from refusion.runtime.runners.stats import ForwardShape
from tests.gate import ForwardGate

pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

BOUND = 16
SETTINGS = [dict(gen_length=32, slot_size=4, serial_num_blocks=2, slot_threshold=0.5, token_threshold=0.1),
            dict(gen_length=24, mode="ar")]
LENGTHS = (9, 17, 50, 130, 300)  # a prompt within one chunk, then several


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 300, n).tolist()  # clear of the mask (383) and the fixture's EOS


@pytest.fixture(scope="module")
def plain(peaky_export):
    with Generator.from_dir(peaky_export, backend="ort-cpu", threads=1, prefix_cache_mb=0, prefill_chunk=0) as g:
        yield g


@pytest.fixture
def chunked(peaky_export):
    with Generator.from_dir(peaky_export, backend="ort-cpu", threads=1, prefix_cache_mb=0, prefill_chunk=BOUND,
                            max_requests=4, max_batch=4) as g:
        g.runner.stats.record = []
        yield g


def _same(a, b) -> None:
    """The same tokens; log-probabilities as close as fp32 over other matmul shapes reads them."""
    assert (a.committed_ids, a.finish_reason) == (b.committed_ids, b.finish_reason)
    if a.logprobs is not None:
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def _calls(gen) -> list:
    """The runner's recorded forwards (its KV moves left out)."""
    return [call for call in gen.runner.stats.record if isinstance(call, ForwardShape)]


@pytest.mark.parametrize("settings", SETTINGS, ids=["refusion", "ar"])
def test_chunks_give_the_unchunked_tokens_alone_and_batched(plain, chunked, settings):
    prompts = [_prompt(n, seed) for seed, n in enumerate(LENGTHS)]
    alone = [plain.generate(prompt_ids=p, logprobs=True, **settings) for p in prompts]
    for p, expected in zip(prompts, alone):
        _same(chunked.generate(prompt_ids=p, logprobs=True, **settings), expected)
    together = [chunked.submit(prompt_ids=p, logprobs=True, **settings) for p in prompts]  # packed and interleaved
    for request, expected in zip(together, alone):
        _same(request.result(timeout=120), expected)
    calls = _calls(chunked)
    assert any(len(call.rows) > 1 for call in calls)  # forwards were packed
    assert all(max(row.fed for row in call.rows) * len(call.rows) <= BOUND for call in calls)  # the bound held


def test_a_long_prefill_is_interleaved_with_a_short_requests_steps(chunked):
    long = chunked.submit(prompt_ids=_prompt(300, 7), **SETTINGS[0])
    short = chunked.submit(prompt_ids=_prompt(5, 8), max_tokens=6, mode="ar")
    long.result(timeout=120), short.result(timeout=120)
    calls = _calls(chunked)
    chunks = [i for i, call in enumerate(calls) if any(row.fed >= BOUND - 1 and row.past > 0 for row in call.rows)]
    steps = [i for i, call in enumerate(calls) if any(row.fed == 1 for row in call.rows)]
    assert len(chunks) >= 10 and steps and steps[0] < chunks[-1]  # the short one stepped before the prefill ended


def test_the_prefix_cache_then_chunks_of_the_rest(peaky_export, plain):
    system = _prompt(100, 11)
    with Generator.from_dir(peaky_export, backend="ort-cpu", threads=1, prefill_chunk=BOUND) as cached:
        cached.generate(prompt_ids=system + _prompt(3, 12), **SETTINGS[0])  # stores the shared prefix
        for seed in (13, 14):
            prompt = system + _prompt(60, seed)
            result = cached.generate(prompt_ids=prompt, **SETTINGS[0])
            assert result.stats.cached_prompt_tokens >= 96
            _same(result, plain.generate(prompt_ids=prompt, **SETTINGS[0]))


def test_a_request_is_cancelled_between_its_chunks(chunked):
    with ForwardGate(chunked.runner) as gate:
        victim = chunked.submit(prompt_ids=_prompt(300, 21), **SETTINGS[0])
        gate.hold_when(lambda: gate.passed >= 2)  # two of its 19 chunks run, the third waits
        gate.wait_held()
        victim.cancel()
        gate.open()
        result = victim.result(timeout=60)
    assert result.finish_reason == "cancelled" and result.token_ids == []
    assert len(_calls(chunked)) == 3 and chunked.status().regions_in_use == 0


def test_a_block_longer_than_the_bound_is_refused_and_bad_bounds_too(chunked):
    with pytest.raises(RefusionError, match="a block of 32 tokens exceeds prefill_chunk=16"):
        chunked.submit(prompt_ids=_prompt(20, 1), gen_length=32, slot_size=4, serial_num_blocks=1)
    assert resolve_prefill_chunk(0, None) is None and resolve_prefill_chunk(None, 64) == 64
    assert resolve_prefill_chunk(None, None) == DEFAULT_PREFILL_CHUNK and resolve_prefill_chunk(32, 64) == 32
    assert resolve_prefill_chunk(None, None, default=None) is None and resolve_prefill_chunk(64, None, default=None) == 64
    for asked in (128, 0):
        with pytest.raises(RefusionError, match=f"prefill_chunk={asked} asks for .* engines feed at most 64 tokens"):
            resolve_prefill_chunk(asked, 64)
    with pytest.raises(RefusionError, match=r"prefill_chunk=-1 \(--prefill-chunk\) must be a number of tokens"):
        resolve_prefill_chunk(-1, None)

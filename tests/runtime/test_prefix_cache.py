"""The prefix cache: its bookkeeping on tests/fakes.py's FakeRunner, whose KV reads back as the tokens it was
computed for (what is shared, what is evicted, what is copied), and exactness on the embedded model: greedy tokens with the cache equal tokens
without it, for ReFusion and AR, over prompts that share a system prompt, share part of one, or share nothing,
from many threads while a small cache evicts; and on the GPU runners' code over the CPU fakes."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from refusion.models import EMBEDDED_MODEL
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.decode.steps import Tokens
from refusion.runtime.generator import Generator
from refusion.runtime.params import DecodeParams
from refusion.runtime.prefix_cache import PrefixCache
from refusion.runtime.request import Request
from refusion.runtime.runners.base import Runner
from refusion.runtime.scheduler import Scheduler
from tests.fakes import FakeRunner, fake_manifest
from tests.helpers import decode_alone


def _cache(blocks: int, block_tokens: int = 4) -> tuple[FakeRunner, PrefixCache]:
    runner = FakeRunner(fake_manifest(EMBEDDED_MODEL), max_requests=2, max_batch=1)
    runner.activate()
    return runner, PrefixCache(runner, blocks * block_tokens * runner.kv_bytes_per_token, block_tokens)


def _load(runner: FakeRunner, cache: PrefixCache, ids: list[int]) -> list[int]:
    """The prefix of `ids` the cache gives, read back from the region it was copied into."""
    runner.allocate_kv(len(ids), 1)
    n = cache.load(ids, 1)
    return runner.tokens(1, n)


def _store(runner: FakeRunner, cache: PrefixCache, ids: list[int]) -> None:
    runner.prefill(0, ids)
    cache.store(tuple(ids), 0)
    cache.check()


def test_a_prompt_gets_the_whole_blocks_it_shares_with_what_was_stored():
    runner, cache = _cache(blocks=16)
    system = list(range(100, 111))  # 11 tokens: two whole blocks of 4 and a part
    _store(runner, cache, system + [1, 2, 3])
    assert cache.blocks == 3  # 14 tokens: 3 whole blocks
    assert _load(runner, cache, system + [7, 8, 9]) == system[:8]  # the third block differs at token 11
    assert _load(runner, cache, system + [1, 2, 3, 4]) == system + [1]
    assert _load(runner, cache, system + [1]) == system[:8]  # at most len - 1 tokens: the last is always fed
    assert _load(runner, cache, [5] + system) == []  # the same tokens at other positions are another prefix
    assert cache.stats.hit_tokens == 8 + 12 + 8


def test_a_prefix_is_copied_in_one_copy_per_run_of_adjacent_blocks():
    runner, cache = _cache(blocks=16)
    _store(runner, cache, list(range(21)))
    stored = runner.stats.copies
    assert stored == 1  # 5 blocks, adjacent in the cache's region
    assert _load(runner, cache, list(range(22))) == list(range(20)) and runner.stats.copies == stored + 1


def test_the_least_recently_used_prefix_goes_first_and_never_a_block_others_extend():
    runner, cache = _cache(blocks=6)
    a, b, c = [1] * 8 + [2] * 4, [3] * 8, [4] * 12  # 3, 2 and 3 blocks
    _store(runner, cache, a + [0])
    _store(runner, cache, b + [0])
    assert _load(runner, cache, a + [9]) == a  # a is used again: b is now the oldest
    _store(runner, cache, c + [0])  # needs 3 blocks, 1 free: b's 2 blocks go, deepest first
    assert _load(runner, cache, b + [9]) == []
    assert _load(runner, cache, a + [9]) == a and _load(runner, cache, c + [9]) == c
    assert cache.stats.evicted_blocks == 2 and cache.reserved_bytes == 6 * 4 * runner.kv_bytes_per_token
    parents = {block.id for block in cache._blocks.values()} | {0}
    assert all(key[0] in parents for key in cache._blocks)  # every cached block is reachable


def test_a_prefix_longer_than_the_budget_keeps_its_first_blocks():
    runner, cache = _cache(blocks=3)
    _store(runner, cache, list(range(40)))
    assert cache.blocks == 3 and _load(runner, cache, list(range(41))) == list(range(12))


def test_a_budget_under_one_block_caches_nothing():
    runner, cache = _cache(blocks=0)
    _store(runner, cache, list(range(40)))
    assert cache.blocks == 0 and _load(runner, cache, list(range(41))) == [] and len(runner.kv_capacities) == 2


# -- exactness on the embedded model ---------------------------------------------------------------------------
SYSTEMS = ["You sort lists of numbers and reverse words, and you answer in one short line. " * 2,
           "You sort lists of numbers and reverse words, but you think twice before answering. " * 2,  # shares half
           "Count the letters of every word you are given, then stop. " * 2]
QUESTIONS = ["sort: 3 1 2", "reverse: a b c", "sort: 9 8 7 1", "count: 1 2 3"]
SETTINGS = [dict(max_tokens=24, slot_size=4, serial_num_blocks=2, gen_length=32, slot_threshold=0.5,
                 token_threshold=0.1), dict(max_tokens=24, mode="ar")]


@pytest.fixture(scope="module")
def jobs(tiny_export) -> list[tuple[list[int], dict]]:
    """System prompts shared whole, in part, and not at all (no system prompt), each question in both modes."""
    with Generator.from_dir(tiny_export, backend="ort-cpu", threads=1) as gen:
        prompts = [gen.prompt_ids(messages=([{"role": "system", "content": s}] if s else [])
                                  + [{"role": "user", "content": q}]) for s in [*SYSTEMS, None] for q in QUESTIONS]
    return [(ids, settings) for ids in prompts for settings in SETTINGS]


@pytest.fixture(scope="module")
def alone(tiny_export, jobs) -> list[list[int]]:
    return decode_alone(tiny_export, jobs)  # no prefix cache


def test_greedy_tokens_with_the_cache_are_the_tokens_without(tiny_export, jobs, alone):
    with Generator.from_dir(tiny_export, backend="ort-cpu", threads=1, max_requests=1) as gen:
        results = [gen.generate(prompt_ids=ids, **settings) for ids, settings in jobs]
        gen.prefix_cache.check()
    assert [r.token_ids for r in results] == alone
    cached = [r.stats.cached_prompt_tokens for r in results]
    assert cached[0] == 0 and max(cached) >= 160  # the first prompt prefills all; a repeated system prompt is copied
    assert all(c < r.stats.prompt_tokens and c % 16 == 0 for c, r in zip(cached, results))


def test_under_concurrency_with_evictions_every_request_gets_its_tokens(tiny_export, jobs, alone):
    """8 threads, a cache of 24 blocks (fewer than two system prompts), every job twice: tokens as alone."""
    with Generator.from_dir(tiny_export, backend="ort-cpu", threads=1, max_requests=6, max_batch=3,
                            prefix_cache_mb=24 * 16 * 3072 / 2**20) as gen:
        order = list(range(len(jobs))) * 2
        np.random.default_rng(0).shuffle(order)
        got: dict[int, list[list[int]]] = {}
        errors: list[BaseException] = []

        def worker(mine: list[int]) -> None:
            try:
                for j in mine:
                    ids, settings = jobs[j]
                    got.setdefault(j, []).append(gen.generate(prompt_ids=ids, **settings).token_ids)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(order[t::8],)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not errors and gen.scheduler.in_flight == 0 and gen.scheduler.regions_in_use == 0
        cache = gen.prefix_cache
        cache.check()
        assert cache.stats.evicted_blocks > 0 and cache.stats.hit_tokens > 0
        request_bytes = sum(gen.runner.kv_capacities[: gen.runner.max_requests]) * gen.runner.kv_bytes_per_token
        assert gen.runner.kv_bytes == request_bytes + cache.reserved_bytes  # every byte: a request region or the cache
        assert cache.reserved_bytes <= 24 * 16 * 3072
    assert all(got[j] == [alone[j]] * 2 for j in range(len(jobs)))


# Answers of 8-16 tokens, so an AR answer fills a cache block past its prompt; three turns fit the 512 positions.
CONVERSATION = ["reverse: robotics", "sort: 9 8 7 6 5 4 3 2 1", "list: 3,1,12"]


def test_an_ar_conversation_reuses_its_earlier_answers(tiny_export):
    """AR's answers are fed causally, so the next turn copies them; ReFusion's are not and are re-prefilled."""
    def common(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    for mode, answers_reused in (("ar", True), ("refusion", False)):
        reached = 0
        with (Generator.from_dir(tiny_export, backend="ort-cpu", threads=1) as gen,
              Generator.from_dir(tiny_export, backend="ort-cpu", threads=1, prefix_cache_mb=0) as off):
            messages = [{"role": "system", "content": SYSTEMS[2][:60]}]
            for question in CONVERSATION:
                messages.append({"role": "user", "content": question})
                before = gen.prompt_ids(messages=messages)
                res = gen.generate(messages=messages, mode=mode, max_tokens=16)
                assert res.token_ids == off.generate(messages=messages, mode=mode, max_tokens=16).token_ids
                messages.append({"role": "assistant", "content": res.text})
                after = gen.prompt_ids(messages=messages + [{"role": "user", "content": "next"}])
                kept = before + res.token_ids[:-1] if answers_reused else before  # what the cache holds of it
                nxt = gen.generate(prompt_ids=after, mode=mode, max_tokens=1)
                assert nxt.stats.cached_prompt_tokens == min(common(after, kept), len(after) - 1) // 16 * 16
                reached += nxt.stats.cached_prompt_tokens > len(before)
        assert (reached > 0) == answers_reused, mode


# -- the GPU runners' code over the CPU fakes ------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["trt", "ort-cuda"])
def test_the_gpu_runners_copy_prefixes_on_the_device(tiny_export, jobs, alone, fakes, tmp_path, backend):
    """Device copies through the KV pool; on TensorRT a prefill over a cached prefix, which no profile holds
    whole, runs as chunks of the decode profile's length."""
    from refusion.runtime.core.profiles import DecodeLimits
    from refusion.runtime.runners.tensorrt import TensorRTRunner
    from tests.fakes import CpuBoundCudaRunner
    from tests.helpers import fake_engines

    chosen = [j for j in range(len(jobs)) if j // len(SETTINGS) % len(QUESTIONS) < 2][:8]  # 2 systems, 2 questions
    if backend == "trt":
        limits = DecodeLimits(max_prompt=224, gen_length=32, slot_size=4, serial_blocks=2, max_batch=2)
        runner: Runner = TensorRTRunner.from_dir(fake_engines(tiny_export, tmp_path / "engines", limits))
    else:
        runner = CpuBoundCudaRunner(ExportManifest.load(tiny_export), threads=1, max_requests=2, max_batch=2)
    executions: list[tuple[str, int, int]] = []  # (graph, seq, past) of what the backend ran
    if backend == "trt":
        real = runner._execute  # type: ignore[attr-defined]
        runner._execute = lambda context, graph, batch, seq, past: (  # type: ignore[attr-defined]
            executions.append((graph, seq, past)) or real(context, graph, batch, seq, past))
    runner.activate()
    cache = PrefixCache(runner, 1 << 20)
    scheduler = Scheduler(runner, cache)
    m = runner.manifest
    try:
        for j in chosen * 2:
            ids, settings = jobs[j]
            request = Request(Tokens(ids, m.mask_token_id, m.eos_token_id),
                              DecodeParams.with_defaults(m.defaults, **settings))
            assert scheduler.submit(request).result(timeout=120).token_ids == alone[j], j
        cache.check()
    finally:
        scheduler.close()
        runner.deactivate()
    assert cache.stats.hit_tokens >= 4 * 160 and runner.stats.copies > 0
    if backend == "trt":  # block 16: the decode profile takes 16 tokens over any past
        assert all(seq <= 16 for graph, seq, past in executions if past > 0)
        assert any(graph == "infiller" and seq == 16 and past > 0 for graph, seq, past in executions)

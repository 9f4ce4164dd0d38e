"""The GPU check's chunked prefill: a prefill over a cached prefix that no TensorRT profile holds whole, which the
scheduler cuts into the chunks a profile holds (chunks.cut over TensorRTRunner.chunk_bound), on real TensorRT. Its heads and present KV
against onnxruntime's unchunked forward (the comparator), ReFusion and AR generation with the prefix cache (whose
hits make such prefills) against the cache off, on TensorRT and on onnxruntime, and its time against one prefill
of the same tokens: the measurement that decides whether a hit should rather prefill from token 0 (review 4, S2;
docs/tensorrt.md)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from refusion.export.compare import Case, every_token
from refusion.tools.checks.verdict import line

PREFIX, REMAINDER = 128, 320  # a cached prefix and what follows it: with a block of masks, several decode chunks


def chunked_prefill(export: Path, engines: Path, repeats: int = 20) -> bool:
    """The three parts, each against the engines' block (the decode profile's longest forward)."""
    ok = chunks_as_onnxruntime(export, engines)
    ok &= cache_on_as_off(export, engines)
    chunk_latency(engines, repeats)
    return ok


def _case(export: Path, block: int) -> Case:
    """REMAINDER tokens over a random PREFIX-token past, the heads at its last block (a ReFusion prefill's masks)."""
    from refusion.runtime.core.contract import past_key_name, past_value_name
    from refusion.runtime.core.dtypes import dtype
    from refusion.runtime.core.export_manifest import ExportManifest
    from refusion.runtime.decode.masks import causal_after

    m = ExportManifest.load(export)
    rng = np.random.default_rng(0)
    feed = {"input_ids": rng.integers(0, m.vocab_size, (1, REMAINDER)).astype(np.int64),
            "position_ids": np.arange(PREFIX, PREFIX + REMAINDER, dtype=np.int64)[None],
            "attention_mask": causal_after(PREFIX, REMAINDER),
            "head_positions": np.arange(REMAINDER - block, REMAINDER, dtype=np.int64)[None], **every_token(m)}
    for i in range(m.num_layers):
        for name in (past_key_name(i), past_value_name(i)):
            feed[name] = rng.standard_normal((1, PREFIX, m.kv_heads, m.head_dim)).astype(dtype(m.dtype).numpy)
    return Case(f"{REMAINDER} tokens over a {PREFIX}-token past", ("infiller",), feed)


def chunks_as_onnxruntime(export: Path, engines: Path) -> bool:
    """The chunked forward's heads and present KV against onnxruntime's one forward (its reference providers)."""
    from refusion.engines.check import TOLERANCE, TensorRTCases, reference_providers
    from refusion.export.compare import OrtSessions, compare_runners
    from refusion.runtime.core.export_manifest import ExportManifest
    from refusion.runtime.runners.tensorrt import TensorRTRunner

    runner = TensorRTRunner.from_dir(engines)
    block = runner.limits.block_length
    m = ExportManifest.load(export)
    result = compare_runners(TensorRTCases(runner), OrtSessions(m, reference_providers(m.dtype)), [_case(export, block)],
                             TOLERANCE[m.dtype], m.dtype)
    print(result.text())
    counted = runner.stats.graph("infiller")
    return line(result.ok and not result.left_out and counted.forwards > 1,
                f"chunked prefill ({REMAINDER} tokens over {PREFIX}, {counted.forwards} forwards of at most {block}) "
                "vs onnxruntime's one forward")


def cache_on_as_off(export: Path, engines: Path) -> bool:
    """Requests whose prompts share a PREFIX-token start, then go on for REMAINDER tokens: after the first, each
    prefills over a prefix cache hit in chunks. Their tokens with the cache on equal those with it off, on TensorRT
    (cache off: one prefill) and on onnxruntime."""
    from refusion.runtime.core.export_manifest import ExportManifest
    from refusion.runtime.generator import Generator
    from refusion.runtime.runners.onnxruntime import OrtRunner
    from refusion.runtime.runners.tensorrt import TensorRTRunner

    rng = np.random.default_rng(1)
    m = ExportManifest.read(engines)
    shared = rng.integers(0, m.vocab_size, PREFIX).tolist()
    prompts = [shared + rng.integers(0, m.vocab_size, REMAINDER).tolist() for _ in range(3)]
    runs: list[dict[str, Any]] = [dict(gen_length=64, slot_size=8, serial_num_blocks=2), dict(gen_length=16, mode="ar")]
    tokens = {}
    for name, make in (("TensorRT", lambda: TensorRTRunner.from_dir(engines)),
                       ("onnxruntime", lambda: OrtRunner(ExportManifest.load(export)))):
        for cache_mb in (64.0, 0.0):
            runner = make()
            runner.activate()
            with Generator(m, runner, None, prefix_cache_mb=cache_mb) as gen:
                tokens[name, cache_mb] = [gen.generate(prompt_ids=p, **params).token_ids for params in runs
                                          for p in prompts]
                hits = gen.prefix_cache.stats.hit_tokens if gen.prefix_cache else 0
            if cache_mb:
                print(f"INFO: {name}, prefix cache on: {hits} prompt tokens read from the cache", flush=True)
    ok = True
    for name in ("TensorRT", "onnxruntime"):
        differ = [i for i, (a, b) in enumerate(zip(tokens[name, 64.0], tokens[name, 0.0])) if a != b]
        ok &= line(not differ, f"{name}: {len(prompts) * len(runs)} generations over a shared {PREFIX}-token prefix, "
                               f"the prefix cache on as off{f'; request(s) {differ} differ' if differ else ''}")
    return ok


def chunk_latency(engines: Path, repeats: int) -> None:
    """Median time of the chunked forward (REMAINDER tokens and a block over the PREFIX) against one prefill of all
    PREFIX + REMAINDER + block tokens, each computing the block's heads: what a prefix cache hit saves or costs."""
    from refusion.runtime.decode.chunks import cut
    from refusion.runtime.decode.masks import causal_after
    from refusion.runtime.decode.steps import Forward
    from refusion.runtime.runners.rows import RowFeed
    from refusion.runtime.runners.tensorrt import TensorRTRunner

    runner = TensorRTRunner.from_dir(engines)
    with runner:
        block = runner.limits.block_length
        total = PREFIX + REMAINDER + block
        runner.allocate_kv(total)
        ids = np.zeros((1, total), np.int64)
        pos = np.arange(total, dtype=np.int64)[None]
        heads = np.arange(total - block, total, dtype=np.int64)[None]

        def median_ms(past: int) -> float:
            seq = total - past
            times = []
            for _ in range(repeats + 3):
                forward = Forward(ids[:, past:], pos[:, past:], causal_after(past, seq), past, past, heads - past,
                                  kind="prefill", graph="infiller")
                t0 = time.perf_counter()
                for chunk in cut(forward, None, runner):  # as the scheduler runs it
                    runner.run_batch("infiller", [RowFeed.of(chunk, 0)])
                times.append(time.perf_counter() - t0)
            return statistics.median(times[3:]) * 1e3

        one = median_ms(0)
        chunked = median_ms(PREFIX)
    chunks = -(-(total - PREFIX) // block)
    print(f"latency: prefill of {total} tokens in one forward {one:.3f} ms; after a {PREFIX}-token cache hit, "
          f"{total - PREFIX} tokens in {chunks} chunks of at most {block}: {chunked:.3f} ms "
          f"({chunked / one:.2f}x)", flush=True)

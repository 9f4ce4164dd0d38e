"""tools/bench/measure/chunked_prefill.py's parts on the tiny peaky model: the time between a streamed request's
tokens, alone and with long prompts arriving, and a prefill's peak memory read in a child of its own."""

from __future__ import annotations

import pytest

from refusion.runtime.generator import Generator
from refusion.tools.bench.measure.chunked_prefill import gaps, peak_rss, render

pytest.importorskip("onnxruntime")
pytest.importorskip("torch")


def test_gaps_are_each_requests_own_between_its_tokens(peaky_export):
    with Generator.from_dir(peaky_export, backend="ort-cpu", threads=1, prefix_cache_mb=0, prefill_chunk=16) as gen:
        alone = gaps(gen, short=2, tokens=5, long=0, seed=0)
        busy = gaps(gen, short=2, tokens=5, long=300, seed=0)
        assert gen.status().in_flight == 0  # the long prompts stopped with the short ones
    assert len(alone) == len(busy) == 2 * (5 - 1) and min(alone + busy) >= 0


def test_peak_memory_is_the_childs_own(peaky_export):
    """A child forked from this process would report this process's memory as its ru_maxrss; VmHWM is its own."""
    held = b"\x01" * (300 << 20)  # 300 MiB resident in this process, more than the child ever holds
    assert len(held) and 0 < peak_rss(peaky_export, 16, 300, 1) < 280


def test_the_report_reads_as_a_table():
    report = {"model": {"num_layers": 8, "hidden_size": 1024}, "short_requests": 4, "short_tokens": 24, "threads": 2,
              "cpu": "x", "long_prompt_tokens": 2000, "memory": [{"prefill_chunk": None, "peak_rss_mib": 1000.0}],
              "conditions": [{"condition": "alone", "time_between_tokens_ms": {"p50": 1.0, "p99": 2.0}, "samples": 3}]}
    text = render(report)
    assert "| alone | 1.0 | 2.0 | 3 |" in text and "| off | 1000 |" in text

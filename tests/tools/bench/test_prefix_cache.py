"""The prefix-cache measurement (tools/bench/measure/prefix_cache.py) on the embedded model, at its smallest:
its conditions reuse what they should, and its report reads its data."""

from __future__ import annotations

import pytest

from refusion.tools.bench.measure import prefix_cache as bench

pytest.importorskip("onnxruntime")


def test_ttft_conditions_reuse_what_they_should(tiny_export):
    data = bench.measure_ttft(tiny_export, repeats=1, blocks=(16,), threads=1)
    rows = {(r["block_tokens"], r["mode"], r["condition"]): r for r in data["rows"]}
    for mode in bench.MODES:
        assert rows[(0, mode, "repeated")]["cached_tokens"] == 0  # the cache off
        assert rows[(16, mode, "first")]["cached_tokens"] == rows[(16, mode, "different")]["cached_tokens"] == 0
        assert rows[(16, mode, "repeated")]["cached_tokens"] >= 160 and rows[(16, mode, "first")]["prompt_tokens"] >= 200
    assert data["forward_floor"]["repeated_past"] >= 160


def test_chat_runs_past_the_first_drop_and_the_report_reads_it(tiny_export):
    chat = bench.measure_chat(tiny_export, "ar", max_tokens=32, extra_turns=1, threads=1)
    turns = chat["turns"]
    assert turns[-1]["turn"] == chat["first_drop_turn"] + 1 and turns[chat["first_drop_turn"] - 1]["on_dropped"] > 0
    assert all(t["off_cached_tokens"] == 0 for t in turns) and turns[1]["on_cached_tokens"] > 0
    ttft = {"rows": [], "forward_floor": {"repeated_seq": 1, "repeated_past": 2, "repeated_ms": 1.0, "none_seq": 3,
                                          "none_ms": 1.0, "ratio": 1.0}}
    text = bench.markdown({"cpu": "x", "threads": 1, "ttft": {"embedded": ttft}, "chat": {"embedded ar": chat}})
    assert "## Chat turns, embedded ar" in text and f"| {len(turns)} |" in text

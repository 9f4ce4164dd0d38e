"""tools/estimates/roofline.py's arithmetic: the byte and parameter counts of ReFusion-8B and the max(memory, compute) rule."""

from __future__ import annotations

import pytest

from refusion.tools.estimates import roofline
from refusion.tools.estimates.jetson_memory import REFUSION_8B

ORIN = roofline.DEVICES[1]

# layers' linears: q, o 4096 x 4096, k, v 4096 x 1024, gate, up, down 4096 x 12288; lm_head 151671 x 4096
LINEARS = 36 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288)
HEAD = 151671 * 4096
NORMS = 36 * (2 * 4096 + 2 * 128) + 4096


def test_bytes_and_params_of_refusion_8b():
    assert roofline.matmul_params(REFUSION_8B) == LINEARS + HEAD
    assert roofline.streamed_bytes(REFUSION_8B, None) == 2 * (LINEARS + HEAD + NORMS)  # no embedding table
    scales = LINEARS // 128  # one fp16 scale per 128 input rows per output column
    assert roofline.streamed_bytes(REFUSION_8B, ORIN.quantization) == LINEARS // 2 + 2 * (scales + HEAD + NORMS)


def test_time_per_forward_is_the_larger_bound():
    memory = roofline.streamed_bytes(REFUSION_8B, ORIN.quantization) / ORIN.bandwidth
    per_token = 2 * (LINEARS + HEAD) / ORIN.fp16_flops
    ridge = memory / per_token  # fed tokens where Orin turns compute-bound
    assert roofline.forward_seconds(ORIN, REFUSION_8B, 1) == memory
    assert roofline.forward_seconds(ORIN, REFUSION_8B, 2 * ridge) == pytest.approx(2 * memory)
    bench = {"methods": [
        {"id": "ar", "family": "ar", "tokens": 100, "forwards": 100, "fed_tokens_per_forward": 1.0},
        {"id": "refusion:x", "family": "refusion", "tokens": 100, "forwards": 25, "fed_tokens_per_forward": 2 * ridge},
        {"id": "diffusion:y", "family": "diffusion", "tokens": 100, "forwards": 50, "fed_tokens_per_forward": 1.0}]}
    ar, refusion = roofline.shapes(bench)
    assert roofline.tokens_per_second(ORIN, REFUSION_8B, ar) == pytest.approx(1 / memory)
    assert roofline.tokens_per_second(ORIN, REFUSION_8B, refusion) == pytest.approx(4 / (2 * memory))  # 4 a forward
    assert "| refusion:x | 0.250 |" in roofline.table(bench) and "(compute)" in roofline.table(bench)


def test_each_recorded_forward_is_projected_at_its_own_shape():
    """A recorded forward pays its own past's KV bytes, its linears at every fed token, the head at the heads read
    alone and attention over past + fed: a decode is projected forward by forward, not from a mean."""
    from refusion.runtime.runners.stats import ForwardShape, RowShape
    from refusion.tools.bench.replay import Recording

    memory = roofline.streamed_bytes(REFUSION_8B, ORIN.quantization) / ORIN.bandwidth
    kv = 2 * 36 * 8 * 128 * 2  # fp16 K and V of one token, every layer
    step = ForwardShape("infiller", (RowShape(1, 100, 100, (0,)),))
    assert roofline.recorded_forward_seconds(ORIN, REFUSION_8B, step) == pytest.approx(memory + 100 * kv / ORIN.bandwidth)
    fed, past = 1000, 24
    prefill = ForwardShape("infiller", (RowShape(fed, past, past, (fed - 1,)),))
    flops = 2 * LINEARS * fed + 2 * HEAD + 4 * 36 * 4096 * fed * (past + fed)
    assert roofline.recorded_forward_seconds(ORIN, REFUSION_8B, prefill) == pytest.approx(flops / ORIN.fp16_flops)
    recs = [Recording((prefill, step, step), 4)]
    seconds = roofline.recorded_forward_seconds(ORIN, REFUSION_8B, prefill) + 2 * roofline.recorded_forward_seconds(
        ORIN, REFUSION_8B, step)
    assert roofline.recorded_tokens_per_second(ORIN, REFUSION_8B, recs) == pytest.approx(4 / seconds)
    text = roofline.recorded_table({"recordings": {"refusion": [rec.to_json() for rec in recs]}})
    assert "| refusion | 1 | 0.750 | 334.00 | 74.7 | 1.00 |" in text


def test_the_docs_quote_the_projections_of_the_committed_shapes():
    """docs/quantization.md's tables are what the roofline prints for results/ar-genai/ar-genai.json (recorded
    forwards) and results/bench/bench.json (the sweep's means)."""
    import json

    from tests.helpers import REPO

    doc = (REPO / "docs" / "quantization.md").read_text()
    assert roofline.recorded_table(json.loads((REPO / roofline.SHAPES).read_text())) in doc
    assert roofline.table(json.loads((REPO / "results" / "bench" / "bench.json").read_text())) in doc

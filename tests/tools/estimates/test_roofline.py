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

"""Projected tokens/s of AR and ReFusion decoding for ReFusion-8B: a roofline projection, not a measurement.

    python -m refusion.tools.estimates.roofline [results/ar-genai/ar-genai.json | results/bench/bench.json]

By default it reads the forward shapes the scale bench recorded (tools/bench/measure/ar_genai.py: every forward of
our AR's and ReFusion's decodes of the embedded model's held-out prompts, with its tokens fed, past and heads) and
projects each forward onto ReFusion-8B on a device with published memory bandwidth B and dense fp16 tensor
throughput F:

    time of a forward = max((W + past x K) / B, (2 x L x fed + 2 x H x heads + A) / F)
    tokens/s = recorded tokens / the sum of its forwards' times

W: the weight bytes one forward streams (every weight but the embedding table, of which a forward gathers only
the rows it needs; int4 linears with their fp16 scales at int4), K: the fp16 KV bytes of one token of past,
L: the layers' linear parameters, H: lm_head's (it runs at the heads the step reads alone), A: attention's
FLOPs (4 x layers x q_size x fed x (past + fed)). Launch overhead is left out, so the projection is an upper bound.
The shapes are the tiny model's (its tokenizer, gen_length 64): that ReFusion-8B decodes with the same forwards
is an assumption.

Given a bench.json (`refusion-run bench`: per method, generated tokens, forwards and mean tokens fed per forward),
it projects every setting of the sweep from those means instead (time per forward = max(W / B, 2 x P x fed / F),
P: the linears' and lm_head's parameters at every fed position, no KV or attention term): coarser, but it
covers the settings the scale bench does not record.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from refusion.runtime.core.dims import ModelDims, expected_weights
from refusion.runtime.core.quantization import Quantization, is_quantized_weight
from refusion.runtime.runners.stats import ForwardShape
from refusion.tools.bench.replay import Recording
from refusion.tools.estimates.jetson_memory import HALF, REFUSION_8B, weight_bytes

SHAPES = Path("results/ar-genai/ar-genai.json")  # the scale bench's recorded shapes, from the checkout's root
EMBEDDING = "model.embed_tokens.weight"


@dataclass(frozen=True)
class Device:
    name: str
    bandwidth: float  # bytes/s, published
    fp16_flops: float  # dense fp16 tensor FLOP/s, published
    quantization: Quantization | None  # what the weights are on it
    published: str  # a measured AR figure to stand beside the projection


DEVICES = (
    # H200 SXM datasheet: 4.8 TB/s; FP16 tensor 1,979 TFLOPS with sparsity, so 989.5 dense
    Device("H200, fp16", 4.8e12, 989.5e12, None,
           "no Edge-LLM figure; Qwen3-8B on one H100 at concurrency 1: ~146 tok/s bf16 (shared anchors)"),
    # Jetson AGX Orin 64GB technical brief: 204.8 GB/s; 170 sparse INT8 TOPS from 64 tensor cores, so 85 dense
    # INT8 and 42.5 dense fp16 (Ampere's fp16 rate is half its INT8 rate); int4 weight-only computes in fp16
    Device("AGX Orin 64GB, int4 block 128", 204.8e9, 42.5e12, Quantization("int4-awq", 128),
           "Edge-LLM Qwen3-8B INT4-AWQ decode: 32.2 tok/s (v0.10, bs 1)"),
)


@dataclass(frozen=True)
class Shape:
    """One bench method's forward shape."""

    method: str
    forwards_per_token: float
    fed_per_forward: float


def streamed_bytes(dims: ModelDims, quantization: Quantization | None) -> int:
    """W: the weights a forward reads, all but the embedding table."""
    v, h = expected_weights(dims)[EMBEDDING]
    return weight_bytes(dims, quantization) - (0 if dims.tie_word_embeddings else v * h * HALF)


def linear_params(dims: ModelDims) -> tuple[int, int]:
    """(L, H): the parameters of the layers' linears and of lm_head (tied: the embedding read as the head)."""
    shapes = expected_weights(dims)
    linears = sum(math.prod(shape) for name, shape in shapes.items() if is_quantized_weight(name))
    return linears, math.prod(shapes.get("lm_head.weight", shapes[EMBEDDING]))


def matmul_params(dims: ModelDims) -> int:
    """P: the parameters of the layers' linears and lm_head."""
    return sum(linear_params(dims))


def recorded_forward_seconds(device: Device, dims: ModelDims, forward: ForwardShape) -> float:
    """One recorded forward at its own shape: weights and each row's past KV streamed, against the linears at
    every token fed, the head at the heads read and attention over past + fed."""
    linears, head = linear_params(dims)
    kv_per_token = 2 * dims.num_layers * dims.kv_size * HALF
    memory = (streamed_bytes(dims, device.quantization) + kv_per_token * sum(r.past for r in forward.rows))
    flops = sum(2 * linears * r.fed + 2 * head * len(r.heads) + 4 * dims.num_layers * dims.q_size * r.fed * (r.past + r.fed)
                for r in forward.rows)
    return max(memory / device.bandwidth, flops / device.fp16_flops)


def recorded_tokens_per_second(device: Device, dims: ModelDims, recs: list[Recording]) -> float:
    seconds = sum(recorded_forward_seconds(device, dims, f) for rec in recs for f in rec.forwards)
    return sum(rec.tokens for rec in recs) / seconds


def recorded_table(data: dict, dims: ModelDims = REFUSION_8B) -> str:
    """The scale bench's recorded decodes (ar-genai.json's recordings), each forward projected at its own shape."""
    lines = ["| decoder | prompts | forwards / token | fed tokens / forward | past / forward | heads / forward | "
             + " | ".join(f"{d.name}: projected tok/s" for d in DEVICES) + " |",
             "|---" * (6 + len(DEVICES)) + "|"]
    for decoder, raw in data["recordings"].items():
        recs = [Recording.from_json(r) for r in raw]
        rows = [r for rec in recs for f in rec.forwards for r in f.rows]
        forwards = sum(len(rec.forwards) for rec in recs)
        cells = [f"{recorded_tokens_per_second(d, dims, recs):.0f}" for d in DEVICES]
        lines.append(f"| {decoder} | {len(recs)} | {forwards / sum(rec.tokens for rec in recs):.3f} | "
                     f"{sum(r.fed for r in rows) / len(rows):.2f} | {sum(r.past for r in rows) / len(rows):.1f} | "
                     f"{sum(len(r.heads) for r in rows) / len(rows):.2f} | " + " | ".join(cells) + " |")
    lines.append("| published AR | | | | | | " + " | ".join(d.published for d in DEVICES) + " |")
    return "\n".join(lines)


def shapes(bench: dict) -> list[Shape]:
    """The AR method and the ReFusion settings of a bench.json."""
    return [Shape(m["id"], m["forwards"] / m["tokens"], m["fed_tokens_per_forward"])
            for m in bench["methods"] if m["family"] in ("ar", "refusion")]


def forward_seconds(device: Device, dims: ModelDims, fed: float) -> float:
    memory = streamed_bytes(dims, device.quantization) / device.bandwidth
    compute = 2 * matmul_params(dims) * fed / device.fp16_flops
    return max(memory, compute)


def tokens_per_second(device: Device, dims: ModelDims, shape: Shape) -> float:
    return 1 / (shape.forwards_per_token * forward_seconds(device, dims, shape.fed_per_forward))


def table(bench: dict, dims: ModelDims = REFUSION_8B) -> str:
    rows = shapes(bench)
    lines = ["| method | forwards / token | fed tokens / forward | "
             + " | ".join(f"{d.name}: projected tok/s (bound)" for d in DEVICES) + " |",
             "|---" * (3 + len(DEVICES)) + "|"]
    for s in rows:
        cells = []
        for d in DEVICES:
            memory = streamed_bytes(dims, d.quantization) / d.bandwidth
            bound = "memory" if forward_seconds(d, dims, s.fed_per_forward) == memory else "compute"
            cells.append(f"{tokens_per_second(d, dims, s):.0f} ({bound})")
        lines.append(f"| {s.method} | {s.forwards_per_token:.3f} | {s.fed_per_forward:.2f} | "
                     + " | ".join(cells) + " |")
    lines.append("| published AR | | | " + " | ".join(d.published for d in DEVICES) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else SHAPES
    data = json.loads(path.read_text())
    for d in DEVICES:
        print(f"{d.name}: W {streamed_bytes(REFUSION_8B, d.quantization) / 1e9:.2f} GB a forward at "
              f"{d.bandwidth / 1e9:g} GB/s, P {matmul_params(REFUSION_8B) / 1e9:.2f} G at "
              f"{d.fp16_flops / 1e12:g} TFLOPS")
    if "recordings" in data:
        print(f"PROJECTION (roofline upper bound) for ReFusion-8B from the forward shapes recorded in {path} "
              f"(the embedded model's decodes, each forward at its own fed tokens, past and heads):")
        print(recorded_table(data))
    else:
        print(f"PROJECTION (roofline upper bound) for ReFusion-8B from the mean forward shapes of {path} "
              f"({data['meta']['model']}, gen_length {data['meta']['gen_length']}):")
        print(table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())

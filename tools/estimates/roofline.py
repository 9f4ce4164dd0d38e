"""Projected tokens/s of AR and ReFusion decoding for ReFusion-8B: a roofline projection, not a measurement.

    python -m refusion.tools.estimates.roofline [results/bench/bench.json]

Takes the forward shapes `refusion-run bench` measured (bench.json: per method, generated tokens,
forwards, and tokens fed per forward, prompt included) and projects them onto ReFusion-8B on a
device with published memory bandwidth B and dense fp16 tensor throughput F:

    time per forward = max(W / B, 2 x P x fed / F)
    tokens/s = tokens / (forwards x time per forward)

W: the weight bytes one forward streams (every weight but the embedding table, of which a forward
gathers only the rows it needs; int4 linears with their fp16 scales at int4), P: the parameters
of the matmuls (layers' linears and lm_head; attention's own FLOPs left out), fed: the mean tokens
fed per forward. Left out: KV bytes read (at most ~0.4 GB a forward at the default limits, 2-9%
of W) and launch overhead, and the mean `fed` stands in for each forward's own (prefill is
compute-bound where decode is not), so the projection is an upper bound. The forward shapes come
from the bench's model (tiny, gen_length 64): that ReFusion-8B decodes with the same tokens per
forward is an assumption.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from refusion.runtime.core.dims import ModelDims, expected_weights
from refusion.runtime.core.quantization import Quantization, is_quantized_weight
from refusion.tools.estimates.jetson_memory import HALF, REFUSION_8B, weight_bytes

BENCH = Path("results/bench/bench.json")  # `refusion-run bench`'s default output, from the checkout's root
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


def matmul_params(dims: ModelDims) -> int:
    """P: the parameters of the layers' linears and lm_head (tied: the embedding read as the head)."""
    shapes = expected_weights(dims)
    linears = sum(math.prod(shape) for name, shape in shapes.items() if is_quantized_weight(name))
    head = shapes.get("lm_head.weight", shapes[EMBEDDING])
    return linears + math.prod(head)


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
    path = Path(args[0]) if args else BENCH
    bench = json.loads(path.read_text())
    for d in DEVICES:
        print(f"{d.name}: W {streamed_bytes(REFUSION_8B, d.quantization) / 1e9:.2f} GB a forward at "
              f"{d.bandwidth / 1e9:g} GB/s, P {matmul_params(REFUSION_8B) / 1e9:.2f} G at "
              f"{d.fp16_flops / 1e12:g} TFLOPS")
    print(f"PROJECTION (roofline upper bound) for ReFusion-8B from the forward shapes of {path} "
          f"({bench['meta']['model']}, gen_length {bench['meta']['gen_length']}):")
    print(table(bench))
    return 0


if __name__ == "__main__":
    sys.exit(main())

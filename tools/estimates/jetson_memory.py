"""What ReFusion holds in a Jetson Orin's memory, per precision and device: an estimate from the dims.

    python -m refusion.tools.estimates.jetson_memory [EXPORT_DIR] [--block-size 128] [--headroom-gib 3]
        [--head float|int4|both] [--embeddings engine|host|both] [--out DIR] [limits flags] [--prefill-chunk N]

The limits are DecodeLimits' defaults and the prefill bound is the one `refusion-export build` takes by default
(256 tokens; `--prefill-chunk 0`: engines built for whole prefills), so the default run is the engine a default
build makes.

Dims come from EXPORT_DIR's refusion.json, or are ReFusion-8B's (Qwen3-8B: hidden 4096, 32/8
heads of 128, intermediate 12288, 36 layers, vocabulary 151671, untied lm_head). One row per
combination of precision (fp16; int4 as `--quantize int4-awq`: the layers' linears int4 plus fp16
scales per block), head (int4: float lm_head, or `--quantize-head`'s int4 one) and embedding
table (in the engine, or out of it on the host), in bytes:

- weights: every tensor of weights.bin (runtime/core/quantization.py's weight index) the engine
  holds, resident once (one engine serves both roles); with the embeddings on the host, all but
  the embedding table (a tied head is the table: it stays in the engine);
- embeddings on the host (issue 22's `inputs_embeds`): the fp16 table memory-mapped from disk and
  gathered by the runner. ASSUMPTION: only the pages of rows looked up are resident, and at most
  one distinct row per token the KV cache holds (kv_capacity rows, each rounded up to whole 4 KiB
  pages), plus the engine's `inputs_embeds` buffer at the largest profile's tokens. Those pages are
  clean file pages the kernel may drop and read again; the rest of the table is never read;
- KV: DecodeLimits.kv_capacity tokens x layers x 2 (K, V) x kv_heads x head_dim x 2 (fp16);
- activations: the largest over the engine's profiles, at each profile's largest (seq s, past)
  with context c = past + s, of max(layer + attention, heads), where
  layer = s (2 hidden + q + 2 kv + 3 intermediate) x 2 (one layer's fp16 intermediates: TensorRT
  reuses activation memory across layers), attention = heads x s x c x (4 + 4 + 2) (fp32 scores,
  fp32 softmax, fp16 probabilities), heads = h x vocab x (2 + 4 + 4) (fp16 logits, fp32 logits,
  fp32 exp) at the profile's largest count h of head positions: the graphs compute the vocabulary
  heads only where the step reads them, at most a block (a prefill: its masks; AR: one token);
- fits: weights + KV + activations + headroom <= the device's memory, the headroom (OS,
  CUDA context, TensorRT runtime; Jetson memory is shared with the CPU) an assumption, 3 GiB
  by default.
An estimate, not a measurement: TensorRT's fused kernels may need less activation memory
(no materialized scores) and its workspace more. `--out DIR` writes the table as jetson.md and
jetson.json (results/memory/ holds ReFusion-8B's at `--max-prompt 512 --gen-length 256 --prefill-chunk 0`,
results/memory/prefill-chunk-256/ the default run's).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from refusion.runtime.core.dims import ModelDims
from refusion.runtime.core.profiles import DEFAULT_PREFILL_CHUNK, DecodeLimits, engine_profiles
from refusion.runtime.core.quantization import Quantization, weight_index

REFUSION_8B = ModelDims(num_layers=36, hidden_size=4096, num_heads=32, kv_heads=8, head_dim=128,
                        intermediate_size=12288, vocab_size=151671, rms_norm_eps=1e-6, rope_theta=1e6,
                        tie_word_embeddings=False, max_position_embeddings=40960)
# Jetson Orin modules by DRAM size (GiB; shared by CPU and GPU)
DEVICES = {"AGX Orin 64GB": 64, "AGX Orin 32GB": 32, "Orin NX 16GB": 16, "Orin Nano 8GB": 8}
HEADROOM_GIB = 3.0  # assumption: OS, CUDA context, TensorRT runtime
HALF = 2  # bytes of an fp16 value
GIB = 2**30
PAGE = 4096  # bytes of a host page (Jetson Linux's default)
HEADS = {"float": (False,), "int4": (True,), "both": (False, True)}  # --head: int4 rows' lm_head
EMBEDDINGS = {"engine": (False,), "host": (True,), "both": (False, True)}  # --embeddings: the table on the host


@dataclass(frozen=True)
class Memory:
    precision: str
    weights: int  # what the engine holds
    kv: int
    activations: int
    activations_profile: str
    embeddings: int = 0  # the host table's resident pages and the inputs_embeds buffer (embeddings on the host)
    host_embeddings: bool = False

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.activations + self.embeddings


def weight_bytes(dims: ModelDims, quantization: Quantization | None) -> int:
    """weights.bin's tensors at fp16 (int4: two values a byte)."""
    total = 0
    for kind, shape in weight_index(dims, "float16", quantization).values():
        count = 1
        for n in shape:
            count *= n
        total += (count + 1) // 2 if kind == "int4" else count * HALF
    return total


def kv_bytes(dims: ModelDims, limits: DecodeLimits) -> int:
    return limits.kv_capacity * dims.num_layers * 2 * dims.kv_size * HALF


def forward_activations(dims: ModelDims, seq: int, past: int, head_positions: int) -> int:
    context = past + seq
    layer = seq * (2 * dims.hidden_size + dims.q_size + 2 * dims.kv_size + 3 * dims.intermediate_size) * HALF
    attention = dims.num_heads * seq * context * (4 + 4 + HALF)
    heads = head_positions * dims.vocab_size * (HALF + 4 + 4)
    return max(layer + attention, heads)


def activation_bytes(dims: ModelDims, limits: DecodeLimits) -> tuple[int, str]:
    """The largest profile's activations, and that profile's name (the first, on a tie)."""
    return max(((forward_activations(dims, p.seq[2], p.past[2], p.head_range[2]), p.name)
                for p in engine_profiles(limits)), key=lambda found: found[0])


def host_embedding_bytes(dims: ModelDims, limits: DecodeLimits) -> int:
    """Resident bytes of a memory-mapped fp16 table (the assumption above: kv_capacity rows looked up, each in
    whole pages) plus the engine's inputs_embeds buffer at the largest profile's tokens x rows."""
    row = dims.hidden_size * HALF
    rows = min(limits.kv_capacity, dims.vocab_size)
    table = min(rows * math.ceil(row / PAGE) * PAGE, dims.vocab_size * row)
    fed = max(p.seq[2] * p.batch[2] for p in engine_profiles(limits))
    return table + fed * row


def memory(dims: ModelDims, limits: DecodeLimits, block_size: int, heads: tuple[bool, ...] = (False,),
           host: tuple[bool, ...] = (False,)) -> list[Memory]:
    """A row per precision (fp16, then int4 per head in `heads`: int4 lm_head or not) per embedding place in
    `host` (on the host or not)."""
    acts, profile = activation_bytes(dims, limits)
    kv = kv_bytes(dims, limits)
    v, h = dims.vocab_size, dims.hidden_size
    # a tied head reads the table: it stays in the engine (and an int4 head is refused)
    table = 0 if dims.tie_word_embeddings else v * h * HALF
    kinds = [("fp16", None)] + [(f"int4-awq block {block_size}{', int4 lm_head' if head else ''}",
                                 Quantization("int4-awq", block_size, head=head))
                                for head in heads if not (head and dims.tie_word_embeddings)]
    rows = []
    for name, quantization in kinds:
        for out in host:
            weights = weight_bytes(dims, quantization) - (table if out else 0)
            extra = host_embedding_bytes(dims, limits) if out and table else 0
            rows.append(Memory(name, weights, kv, acts, profile, extra, out and bool(table)))
    return rows


def table(rows: list[Memory], headroom_gib: float = HEADROOM_GIB) -> str:
    lines = ["| precision | engine weights | host embeddings (resident) | KV | activations (profile) | total + headroom | "
             + " | ".join(DEVICES) + " |", "|---" * (6 + len(DEVICES)) + "|"]
    for m in rows:
        need = m.total / GIB + headroom_gib
        fits = [f"{'fits' if need <= size else 'no'} ({size - need:+.1f})" for size in DEVICES.values()]
        host = f"{m.embeddings / 2**20:.1f} MiB" if m.host_embeddings else "in the engine"
        lines.append(f"| {m.precision} | {m.weights / GIB:.2f} GiB ({m.weights / 1e9:.2f} GB) | {host} | "
                     f"{m.kv / GIB:.2f} GiB | {m.activations / GIB:.2f} GiB ({m.activations_profile}) | {need:.2f} GiB | "
                     + " | ".join(fits) + " |")
    return "\n".join(lines)


def report(rows: list[Memory], title: str, headroom_gib: float) -> dict:
    """The table as data: every row's bytes and, per device, GiB to spare (negative: it does not fit)."""
    return {"title": title, "headroom_gib": headroom_gib, "page_bytes": PAGE,
            "rows": [asdict(m) | {"total_plus_headroom_gib": m.total / GIB + headroom_gib,
                                  "spare_gib": {d: size - m.total / GIB - headroom_gib for d, size in DEVICES.items()}}
                     for m in rows]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export", nargs="?", type=Path, help="an export directory [default: ReFusion-8B's dims]")
    parser.add_argument("--block-size", type=int, default=128, help="int4 block size [128]")
    parser.add_argument("--headroom-gib", type=float, default=HEADROOM_GIB, help="OS + CUDA context (assumed) [3]")
    parser.add_argument("--head", choices=list(HEADS), default="both",
                        help="int4 rows: lm_head float, int4 (--quantize-head), or a row of each [both]")
    parser.add_argument("--embeddings", choices=list(EMBEDDINGS), default="both",
                        help="the embedding table in the engine, on the host (memory-mapped, only looked-up rows "
                             "resident: an assumption), or a row of each [both]")
    parser.add_argument("--out", type=Path, help="also write jetson.md and jetson.json here")
    defaults = DecodeLimits()
    for name in ("max_prompt", "gen_length", "slot_size"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--serial-num-blocks", "--serial-blocks", dest="serial_blocks", type=int,
                        default=defaults.serial_blocks)
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="engines built with this bound on a forward's tokens, 0 for none, as `refusion-export "
                             f"build --prefill-chunk` takes it [its default: {DEFAULT_PREFILL_CHUNK}, or the block "
                             "where that is longer]")
    args = parser.parse_args(argv)
    from refusion.runtime.core.export_manifest import ExportManifest

    dims = ExportManifest.read(args.export).dims if args.export else REFUSION_8B
    limits = DecodeLimits(args.max_prompt, args.gen_length, args.slot_size,
                          args.serial_blocks).with_prefill_chunk(args.prefill_chunk)
    rows = memory(dims, limits, args.block_size, HEADS[args.head], EMBEDDINGS[args.embeddings])
    title = (f"{args.export or 'ReFusion-8B'}; limits {' '.join(limits.flags())}; KV capacity {limits.kv_capacity} "
             f"tokens; headroom {args.headroom_gib:g} GiB (assumed); device column: fits (GiB to spare); host "
             f"embeddings: memory-mapped fp16 table, resident only the rows looked up (assumed: at most "
             f"{min(limits.kv_capacity, dims.vocab_size)}, in {PAGE}-byte pages) plus the inputs_embeds buffer")
    text = f"{title}\n\n{table(rows, args.headroom_gib)}"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "jetson.md").write_text(text + "\n")
        (args.out / "jetson.json").write_text(json.dumps(report(rows, title, args.headroom_gib), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

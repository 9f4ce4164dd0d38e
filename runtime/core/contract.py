"""The graph contract, declared once as data.

Both graphs take the same inputs; the exporter, the export validation, the TensorRT
profiles and the runtime's buffers all read these declarations, and the exporter writes
them into `refusion.json` so the runtime never needs the Hugging Face config.

KV tensors are sequence-major, `[batch, seq, kv_heads, head_dim]`: with batch 1 the
committed prefix of a preallocated cache is then one contiguous block, so feeding it as
past is a view, and a forward's present KV can be written straight into its slot.

`head_positions[b, j]` is the index (into seq) of the j-th position whose vocabulary heads the
forward computes: only the positions the decode step reads (a prefill reads none of its prompt's),
so the vocabulary head's vocab x hidden MatMul runs on those rows alone.

`inputs_embeds` [batch, seq, hidden] (an export with `--embeddings host` only) are the fed tokens' embedding
rows, gathered by the runtime from the table beside the graphs; `input_ids` stays an input of every graph,
since the verification head reads the next fed token's id.

`vocab_mask` [batch, mask_heads, mask_bytes] (exports of format 7 on) is the set of tokens each head may pick, one
bit a token (token t: bit t % 8 of byte t // 8, the little-endian bytes of the int32 words grammar engines write):
the graphs set the logits of every other token to -inf before the heads read them, so a structured-output request
gets its masked argmax, top-K and probabilities where the logits are. mask_heads is 1 (one mask for every head: a
request without a guide feeds it all ones, and the logits are unchanged bit for bit) or the heads.

`attention_mask[b, i, t]` is True when new token i may attend to token t of
`concat(past, new)`. One boolean input expresses every mask the decode loop needs:
causal plan and verify passes over the committed prefix, and n independent slot rows
over one shared prefix (each row sees the prefix, its own private tokens, and itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Axis = str | int
GraphName = Literal["planner", "infiller"]
GRAPH_NAMES: tuple[GraphName, ...] = ("planner", "infiller")

# Symbolic axes. `total_seq` is past_seq + seq; the name carries no arithmetic. `heads`: positions whose
# vocabulary heads are computed (head_positions), at most seq.
BATCH, SEQ, PAST_SEQ, TOTAL_SEQ, HEADS = "batch", "seq", "past_seq", "total_seq", "heads"
MASK_HEADS = "mask_heads"  # rows of vocab_mask: 1 (every head the same) or heads
INPUTS_EMBEDS = "inputs_embeds"  # the graphs' input of embedding rows, with the table on the host
VOCAB_MASK = "vocab_mask"  # the graphs' input of the tokens each head may pick (structured output)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: "int64", "bool", "float32", "float16", "bfloat16"
    axes: tuple[Axis, ...]

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "axes": list(self.axes)}

    @staticmethod
    def from_json(d: dict) -> TensorSpec:
        return TensorSpec(d["name"], d["dtype"], tuple(d["axes"]))


@dataclass(frozen=True)
class GraphSpec:
    name: GraphName
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def input(self, name: str) -> TensorSpec:
        return next(t for t in self.inputs if t.name == name)

    def output(self, name: str) -> TensorSpec:
        return next(t for t in self.outputs if t.name == name)

    def to_json(self) -> dict:
        return {
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
        }

    @staticmethod
    def from_json(name: GraphName, d: dict) -> GraphSpec:
        return GraphSpec(
            name,
            tuple(TensorSpec.from_json(t) for t in d["inputs"]),
            tuple(TensorSpec.from_json(t) for t in d["outputs"]),
        )


def past_key_name(layer: int) -> str:
    return f"past_key_values.{layer}.key"


def past_value_name(layer: int) -> str:
    return f"past_key_values.{layer}.value"


def present_key_name(layer: int) -> str:
    return f"present.{layer}.key"


def present_value_name(layer: int) -> str:
    return f"present.{layer}.value"


def kv_names(num_layers: int, past: bool) -> list[str]:
    """Every layer's K name, then every layer's V name: the order the device runners keep a slot's caches in."""
    key, value = (past_key_name, past_value_name) if past else (present_key_name, present_value_name)
    return [key(i) for i in range(num_layers)] + [value(i) for i in range(num_layers)]


DEFAULT_CANDIDATES = 64  # top-K candidates the graphs emit for sampling (refusion-export onnx --candidates)

# The ops a graph is written with (refusion-export onnx --ops), its contract the same either way. "standard": opset
# 17 (21 with int4 weights), what every backend builds; "onnxruntime": opset 23's Attention, RMSNormalization and
# RotaryEmbedding and onnxruntime's SkipSimplifiedLayerNormalization (export/ort_graph.py), onnxruntime only.
GRAPH_OPS = ("standard", "onnxruntime")
ORT_OPSET = 23


def mask_bytes(vocab_size: int) -> int:
    """Bytes of one head's vocab_mask: a bit a token, in whole int32 words (the grammar engines' bitmask)."""
    return 4 * -(-vocab_size // 32)


def candidates_for(vocab_size: int, asked: int = DEFAULT_CANDIDATES) -> int:
    """The K an export of this vocabulary emits: as asked, at most the vocabulary."""
    return min(asked, vocab_size)


def graph_specs(
    num_layers: int, kv_heads: int, head_dim: int, vocab_size: int, kv_dtype: str, logits: bool,
    candidates: int = DEFAULT_CANDIDATES, embeds_hidden: int | None = None, vocab_mask: bool = True,
) -> dict[GraphName, GraphSpec]:
    """The planner and infiller contracts for a model of these dimensions; `candidates`: K of the top-K outputs;
    `embeds_hidden`: the hidden size of `inputs_embeds`, which the graphs take when the embedding table is kept
    on the host (None: the graphs gather it themselves); `vocab_mask`: the graphs take the tokens each head may
    pick (every export of format 7; format 6 ones do not, and serve no structured output)."""
    embeds = [TensorSpec(INPUTS_EMBEDS, kv_dtype, (BATCH, SEQ, embeds_hidden))] if embeds_hidden else []
    masks = [TensorSpec(VOCAB_MASK, "uint8", (BATCH, MASK_HEADS, mask_bytes(vocab_size)))] if vocab_mask else []
    inputs: list[TensorSpec] = [
        TensorSpec("input_ids", "int64", (BATCH, SEQ)),
        *embeds,
        TensorSpec("position_ids", "int64", (BATCH, SEQ)),
        TensorSpec("attention_mask", "bool", (BATCH, SEQ, TOTAL_SEQ)),
        TensorSpec("head_positions", "int64", (BATCH, HEADS)),
        *masks,
    ]
    presents: list[TensorSpec] = []
    for i in range(num_layers):
        for past, present in ((past_key_name(i), present_key_name(i)), (past_value_name(i), present_value_name(i))):
            inputs.append(TensorSpec(past, kv_dtype, (BATCH, PAST_SEQ, kv_heads, head_dim)))
            presents.append(TensorSpec(present, kv_dtype, (BATCH, SEQ, kv_heads, head_dim)))
    # Heads fused into the graphs, computed at the head positions only: nothing of vocabulary size leaves by
    # default, and no vocabulary head runs where nothing reads it. With vocab_mask, every head reads the logits
    # masked by it (the tokens it leaves out at -inf).
    heads = [
        # argmax over the vocabulary at each head position and its softmax probability; at a
        # mask token this is the planner's draft, at a real token the greedy next token.
        TensorSpec("argmax_ids", "int64", (BATCH, HEADS)),
        TensorSpec("argmax_probs", "float32", (BATCH, HEADS)),
        # what sampling needs, without the vocabulary: the K most likely tokens at each position, most likely
        # first, and their log-probabilities under the whole vocabulary's softmax (untempered)
        TensorSpec("top_ids", "int64", (BATCH, HEADS, candidates)),
        TensorSpec("top_logprobs", "float32", (BATCH, HEADS, candidates)),
    ]
    # Verification: at head position h, the probability of the next fed token, input_ids[h + 1], under h's
    # logits (at the last position, h + 1 clamped to it: its own token). The verification of token j reads
    # the head at j - 1 (runtime/decode/forwards.py).
    verify = [TensorSpec("input_probs", "float32", (BATCH, HEADS))]
    debug = [TensorSpec("logits", "float32", (BATCH, HEADS, vocab_size))] if logits else []
    return {
        "planner": GraphSpec("planner", tuple(inputs), tuple(heads + debug)),
        "infiller": GraphSpec("infiller", tuple(inputs), tuple(heads + verify + presents + debug)),
    }

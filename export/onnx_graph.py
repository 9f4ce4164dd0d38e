"""Build the planner and infiller ONNX graphs from the contract and the weight initializers.

The graphs are written op by op (as onnxruntime-genai's model builder does) rather than
traced: the structure is exactly what we declare, only standard ONNX ops appear, fp16/bf16
graphs keep RMSNorm variance and softmax in fp32, and no torch tracing memory is needed.
Layout and math mirror `refusion.export.model`, the torch definition the export is
validated against, but for where attention applies its scale: on the queries (folded into their rotary tables)
rather than on the scores, the shape TensorRT fuses into one attention kernel (`_attention`).

Every projection goes through one hook, `_Builder.linear`, which dispatches on how the weight
is stored: a float weight is a plain MatMul; an int4 weight (export/quantize.py) is read as
DequantizeLinear(W, W_scale, axis 0, block_size) -> MatMul, the pattern onnxruntime fuses into
MatMulNBits and TensorRT into its int4 weight-only GEMM. Such graphs are opset 21 (INT4 and
blocked DequantizeLinear), IR version 10; float graphs stay opset 17.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from refusion.runtime.core.contract import INPUTS_EMBEDS, VOCAB_MASK, GraphSpec
from refusion.runtime.core.dims import ModelDims
from refusion.runtime.core.dtypes import dtype as core_dtype
from refusion.runtime.core.quantization import INT4_OPSET, scale_name

OPSET = 17  # float graphs; int4 ones INT4_OPSET
IR_VERSION = {OPSET: 8, INT4_OPSET: 10}  # 8: readable by TensorRT 10's parser and onnxruntime >= 1.14; INT4 needs 10


def graph_opset(initializers: dict[str, TensorProto]) -> int:
    """The opset a graph over these weights needs: 21 when any is int4."""
    return INT4_OPSET if any(i.data_type == TensorProto.INT4 for i in initializers.values()) else OPSET


class _Builder:
    """Appends nodes with fresh output names; keeps the graph code short and readable."""

    def __init__(self, initializers: dict[str, TensorProto]) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.constants: list[TensorProto] = []
        self.initializers = initializers
        self.opset = graph_opset(initializers)
        self._count = 0

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs: object) -> str:
        self._count += 1
        name = out or f"{op_type.lower()}_{self._count}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [name], name=f"n{self._count}_{op_type}", **attrs))
        return name

    def ops(self, op_type: str, *inputs: str, outs: tuple[str | None, ...], **attrs: object) -> list[str]:
        """A node of several outputs, each named as given, fresh (None) or left out ("": an optional output)."""
        self._count += 1
        names = [f"{op_type.lower()}_{self._count}_{i}" if out is None else out for i, out in enumerate(outs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=f"n{self._count}_{op_type}", **attrs))
        return names

    def const(self, value: np.ndarray, name: str | None = None) -> str:
        self._count += 1
        tensor = numpy_helper.from_array(value, name or f"const_{self._count}")
        self.constants.append(tensor)
        return tensor.name

    def ints(self, *values: int) -> str:
        return self.const(np.array(values, dtype=np.int64))

    def linear(self, x: str, weight: str) -> str:
        """x @ weight [in, out]: the one hook every projection goes through, float or int4."""
        stored = self.initializers.get(weight)
        if stored is not None and stored.data_type == TensorProto.INT4:
            scale = self.initializers[scale_name(weight)]
            block = stored.dims[0] // scale.dims[0]
            weight = self.op("DequantizeLinear", weight, scale.name, axis=0, block_size=block)
        return self.op("MatMul", x, weight)

    def reduce(self, op_type: str, x: str, axis: int) -> str:
        """ReduceMean / ReduceMax over one axis, keepdims: axes an attribute up to opset 17, an input from 18."""
        if self.opset < 18:
            return self.op(op_type, x, axes=[axis], keepdims=1)
        return self.op(op_type, x, self.ints(axis), keepdims=1)


def build_graph(
    spec: GraphSpec, dims: ModelDims, dtype: str, initializers: dict[str, TensorProto]
) -> onnx.ModelProto:
    """One graph of the contract: embed (or take the rows fed), decoder layers with explicit KV, heads at the head
    positions."""
    g = _Builder(initializers)
    onnx_dtype = core_dtype(dtype).onnx
    wants = {t.name for t in spec.outputs}
    n_rep = dims.num_heads // dims.kv_heads
    d = dims.head_dim

    # [b, s, hidden]: fed, where the contract takes the rows (a host table), else gathered from the initializer
    fed = any(t.name == INPUTS_EMBEDS for t in spec.inputs)
    x = INPUTS_EMBEDS if fed else g.op("Gather", "model.embed_tokens.weight", "input_ids")
    rope = _Rotary(g, dims, onnx_dtype)
    bias = _attention_bias(g, n_rep)

    for i in range(dims.num_layers):
        p = f"model.layers.{i}."
        h = _rms_norm(g, x, p + "input_layernorm.weight", dims.rms_norm_eps, onnx_dtype)
        # The infiller's new keys and values are its present outputs, named where they are made.
        infill = f"present.{i}.key" in wants
        present_k, present_v = (f"present.{i}.key", f"present.{i}.value") if infill else (None, None)
        # q straight to its grouped shape [b, s, kv, rep, d]: q_norm and RoPE (which scales it) act on the last axis
        q = g.op("Reshape", g.linear(h, p + "self_attn.q_proj.weight"), g.ints(0, 0, dims.kv_heads, n_rep, d))
        k = g.op("Reshape", g.linear(h, p + "self_attn.k_proj.weight"), g.ints(0, 0, dims.kv_heads, d))
        v = g.op("Reshape", g.linear(h, p + "self_attn.v_proj.weight"), g.ints(0, 0, dims.kv_heads, d),
                 out=present_v)
        q = rope.apply(_rms_norm(g, q, p + "self_attn.q_norm.weight", dims.rms_norm_eps, onnx_dtype), grouped=True)
        k = rope.apply(_rms_norm(g, k, p + "self_attn.k_norm.weight", dims.rms_norm_eps, onnx_dtype), grouped=False,
                       out=present_k)
        keys = g.op("Concat", f"past_key_values.{i}.key", k, axis=1)  # [b, total, kv, d]
        values = g.op("Concat", f"past_key_values.{i}.value", v, axis=1)
        attn = _attention(g, q, keys, values, bias, dims, onnx_dtype)
        x = g.op("Add", x, g.linear(attn, p + "self_attn.o_proj.weight"))
        h = _rms_norm(g, x, p + "post_attention_layernorm.weight", dims.rms_norm_eps, onnx_dtype)
        gate = g.linear(h, p + "mlp.gate_proj.weight")
        up = g.linear(h, p + "mlp.up_proj.weight")
        act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)  # SiLU as Mul+Sigmoid: portable
        x = g.op("Add", x, g.linear(act, p + "mlp.down_proj.weight"))

    final_heads(g, spec, dims, x, lambda v, w: _rms_norm(g, v, w, dims.rms_norm_eps, onnx_dtype), onnx_dtype)
    return assemble(g, spec, f"refusion_{spec.name}", [helper.make_opsetid("", g.opset)], IR_VERSION[g.opset])


def _attention_bias(g: _Builder, n_rep: int) -> str:
    """The boolean mask as the additive fp32 bias of `_attention`'s scores, once a forward: [b, 1, rep x s, total],
    the mask's rows repeated for each of a key head's query heads (their rows in the scores)."""
    zero, neg = g.const(np.array(0.0, np.float32)), g.const(np.array(np.finfo(np.float32).min, np.float32))
    bias = g.op("Where", g.op("Unsqueeze", "attention_mask", g.ints(1)), zero, neg)  # [b, 1, s, total]
    return bias if n_rep == 1 else g.op("Tile", bias, g.ints(1, 1, n_rep, 1))


def _attention(g: _Builder, q: str, keys: str, values: str, bias: str, dims: ModelDims, dtype: int) -> str:
    """Grouped-query attention of q [b, s, kv, rep, d], already scaled, over keys and values [b, total, kv, d]:
    [b, s, heads x d]. In the shape TensorRT fuses into one attention kernel ("Fused Attention": Q scaled before
    the first MatMul, 4-D [B, N, S, H] operands, an additive mask, the softmax, the second MatMul): a key head's
    query heads are folded into the query's sequence axis, [b, kv, rep x s, d] against [b, kv, total, d], which
    is multi-head attention over the key heads with no KV repeated. Scores, bias and softmax in fp32."""
    rep, d = dims.num_heads // dims.kv_heads, dims.head_dim
    q4 = g.op("Reshape", g.op("Transpose", q, perm=[0, 2, 3, 1, 4]), g.ints(0, 0, -1, d))  # [b, kv, rep x s, d]
    keys_t = g.op("Transpose", keys, perm=[0, 2, 3, 1])  # [b, kv, d, total]
    values4 = g.op("Transpose", values, perm=[0, 2, 1, 3])  # [b, kv, total, d]
    scores = g.op("Add", _to_f32(g, g.op("MatMul", q4, keys_t), dtype), bias)  # [b, kv, rep x s, total]
    attn = g.op("MatMul", _cast(g, g.op("Softmax", scores, axis=-1), dtype), values4)  # [b, kv, rep x s, d]
    attn = g.op("Transpose", g.op("Reshape", attn, g.ints(0, 0, rep, -1, d)), perm=[0, 3, 1, 2, 4])  # [b, s, kv, rep, d]
    return g.op("Reshape", attn, g.ints(0, 0, dims.q_size))


def final_heads(g: _Builder, spec: GraphSpec, dims: ModelDims, x: str, norm: Callable[[str, str], str],
                dtype: int) -> None:
    """The outputs from the last hidden states `x`: only the head positions' rows go on to the final norm (`norm`,
    the graph's RMSNorm) and the vocabulary head, [b, heads, hidden] -> the heads of `_heads` (and logits)."""
    wants = {t.name for t in spec.outputs}
    at = g.op("Expand", g.op("Unsqueeze", "head_positions", g.ints(-1)), g.ints(1, 1, dims.hidden_size))
    h = norm(g.op("GatherElements", x, at, axis=1), "model.norm.weight")
    head = _tied_head(g, h, dims) if dims.tie_word_embeddings else g.linear(h, "lm_head.weight")
    logits = _to_f32(g, head, dtype)  # [b, heads, vocab] fp32
    if any(t.name == VOCAB_MASK for t in spec.inputs):
        logits = _masked(g, logits, dims.vocab_size)
    if "logits" in wants:
        logits = g.op("Identity", logits, out="logits")
    _heads(g, logits, "input_probs" in wants, spec.output("top_ids").axes[-1])


def _masked(g: _Builder, logits: str, vocab: int) -> str:
    """logits [b, heads, vocab] with the tokens vocab_mask leaves out at -inf; an all-ones mask leaves them as they
    are, bit for bit. Each mask byte indexes a [256, 8] table of its bits (little-endian: token 8i + j is bit j of
    byte i); TensorRT casts uint8 to floats only, so the bytes reach the Gather through fp32. The bits are expanded
    to every head once unpacked: one row (no guide) is unpacked once, not once a head."""
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool)
    index = g.op("Cast", g.op("Cast", VOCAB_MASK, to=TensorProto.FLOAT), to=TensorProto.INT32)  # [b, m, bytes]
    allowed = g.op("Reshape", g.op("Gather", g.const(bits), index), g.ints(0, 0, -1))  # [b, m, bytes x 8]
    allowed = g.op("Slice", allowed, g.ints(0), g.ints(vocab), g.ints(2))  # [b, m, vocab]
    every_head = g.op("Concat", g.op("Shape", "head_positions"), g.ints(vocab), axis=0)  # [b, heads, vocab]
    return g.op("Where", g.op("Expand", allowed, every_head), logits, g.const(np.array(-np.inf, np.float32)))


def assemble(g: _Builder, spec: GraphSpec, name: str, opsets: list[onnx.OperatorSetIdProto],
             ir_version: int) -> onnx.ModelProto:
    """The model of `g`'s nodes: the contract's inputs and outputs, the weights its nodes read and its constants."""
    graph = helper.make_graph(
        g.nodes,
        name,
        [helper.make_tensor_value_info(t.name, core_dtype(t.dtype).onnx, list(t.axes)) for t in spec.inputs],
        [helper.make_tensor_value_info(t.name, core_dtype(t.dtype).onnx, list(t.axes)) for t in spec.outputs],
        initializer=[g.initializers[n] for n in _used_initializers(g)] + g.constants,
    )
    model = helper.make_model(graph, opset_imports=opsets, producer_name="refusion-trt")
    model.ir_version = ir_version
    return model


def _tied_head(g: _Builder, h: str, dims: ModelDims) -> str:
    """h [b, heads, hidden] times the embedding [vocab, hidden] transposed, as one Gemm(transB=1) over the rows
    [b x heads, hidden]: TensorRT reads the transposed operand in place, so the engine holds the embedding the
    Gather reads once. A Transpose of it into a MatMul would be folded into a second vocab x hidden constant."""
    rows = g.op("Reshape", h, g.ints(-1, dims.hidden_size))
    logits = g.op("Gemm", rows, "model.embed_tokens.weight", transB=1)  # [b x heads, vocab]
    return g.op("Reshape", logits, g.op("Concat", g.op("Shape", "head_positions"), g.ints(dims.vocab_size), axis=0))


def _heads(g: _Builder, logits: str, verify: bool, candidates: int | str) -> None:
    """argmax id and its probability; the `candidates` most likely ids and their log-probabilities (sampling);
    with `verify`, the probability of the next fed token. `logits` [b, heads, vocab] are the head positions'."""
    g.op("ArgMax", logits, axis=-1, keepdims=0, out="argmax_ids")
    top = g.reduce("ReduceMax", logits, -1)  # [b, heads, 1]
    denom = g.op("ReduceSum", g.op("Exp", g.op("Sub", logits, top)), g.ints(-1), keepdims=1)
    g.op("Squeeze", g.op("Reciprocal", denom), g.ints(-1), out="argmax_probs")
    # TopK, largest first; log softmax of the picked logits: logit - max - log(sum exp(logits - max))
    values, _ = g.ops("TopK", logits, g.ints(int(candidates)), outs=(None, "top_ids"), axis=-1, largest=1, sorted=1)
    g.op("Sub", g.op("Sub", values, top), g.op("Log", denom), out="top_logprobs")
    if not verify:
        return
    # p(input_ids[h + 1] | h) at each head position h; the last position reads its own token (h + 1 clamped).
    next_ids = g.op("Concat", g.op("Slice", "input_ids", g.ints(1), g.ints(2**62), g.ints(1)),
                    g.op("Slice", "input_ids", g.ints(-1), g.ints(2**62), g.ints(1)), axis=1)  # [b, s]
    wanted = g.op("Unsqueeze", g.op("GatherElements", next_ids, "head_positions", axis=1), g.ints(-1))
    picked = g.op("GatherElements", logits, wanted, axis=-1)  # [b, heads, 1]
    g.op("Squeeze", g.op("Div", g.op("Exp", g.op("Sub", picked, top)), denom), g.ints(-1), out="input_probs")


def rope_freqs(g: _Builder, dims: ModelDims) -> str:
    """RoPE's angles at the fed positions, [b, s, head_dim / 2], in fp32 as HF computes them."""
    d = dims.head_dim
    inv_freq = 1.0 / (dims.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    pos = g.op("Unsqueeze", g.op("Cast", "position_ids", to=TensorProto.FLOAT), g.ints(-1))  # [b, s, 1]
    return g.op("Mul", pos, g.const(inv_freq.astype(np.float32).reshape(1, 1, d // 2)))


class _Rotary:
    """RoPE with its tables computed once per forward, in fp32 as HF does: cos and a sign-folded sin, so each
    use is x * cos + x[..., half-swapped] * sin_signed (rotate-half as one Gather of the two halves, not
    Slice/Slice/Neg/Concat), over [..., 2, d / 2]: onnxruntime's CPU Gather copies one row per index, so over the
    last axis it copied d single elements, 10% of a ReFusion token's instructions on the embedded model.
    The queries' tables carry attention's 1 / sqrt(head_dim), so the queries leave RoPE scaled (TensorRT's fused
    attention takes the scale on Q, before the first MatMul), at no node a layer and rounded once, in fp32."""

    def __init__(self, g: _Builder, dims: ModelDims, dtype: int):
        d, half = dims.head_dim, dims.head_dim // 2
        freqs = rope_freqs(g, dims)
        emb = g.op("Concat", freqs, freqs, axis=-1)  # [b, s, d]
        cos, sin = g.op("Cos", emb), g.op("Mul", g.op("Sin", emb), g.const(np.repeat(np.float32([-1, 1]), half)))
        scale = g.const(np.array(1.0 / np.sqrt(d), np.float32))
        self.g = g
        self.swap = g.ints(1, 0)
        # reshapes to [..., 2, half] and back, keys (3 leading axes) and grouped queries (4); 0 keeps an axis
        self.split = {False: g.ints(0, 0, 0, 2, half), True: g.ints(0, 0, 0, 0, 2, half)}
        self.join = {False: g.ints(0, 0, 0, d), True: g.ints(0, 0, 0, 0, d)}
        # keys [b, s, kv, d]: tables [b, s, 1, d]; grouped queries [b, s, kv, rep, d]: [b, s, 1, 1, d], scaled
        self.heads = tuple(_cast(g, g.op("Unsqueeze", t, g.ints(2)), dtype) for t in (cos, sin))
        self.grouped = tuple(_cast(g, g.op("Unsqueeze", g.op("Mul", t, scale), g.ints(2, 3)), dtype) for t in (cos, sin))

    def apply(self, x: str, grouped: bool, out: str | None = None) -> str:
        """RoPE of keys [b, s, kv, d], or of grouped queries [b, s, kv, rep, d] (scaled for attention)."""
        g = self.g
        cos, sin = self.grouped if grouped else self.heads
        halves = g.op("Gather", g.op("Reshape", x, self.split[grouped]), self.swap, axis=-2)
        swapped = g.op("Reshape", halves, self.join[grouped])
        return g.op("Add", g.op("Mul", x, cos), g.op("Mul", swapped, sin), out=out)


def _rms_norm(g: _Builder, x: str, weight: str, eps: float, dtype: int) -> str:
    """Qwen3RMSNorm: variance in fp32, normalised value cast back, then scaled.

    Written as Pow -> ReduceMean -> Add -> Sqrt -> Div, the pattern onnxruntime fuses into one
    SimplifiedLayerNormalization kernel (seven nodes per norm otherwise; ~1/3 of all nodes)."""
    xf = _to_f32(g, x, dtype)
    var = g.reduce("ReduceMean", g.op("Pow", xf, g.const(np.array(2.0, np.float32))), -1)
    std = g.op("Sqrt", g.op("Add", var, g.const(np.array(eps, np.float32))))
    return g.op("Mul", weight, _cast(g, g.op("Div", xf, std), dtype))


def _to_f32(g: _Builder, x: str, dtype: int) -> str:
    return x if dtype == TensorProto.FLOAT else g.op("Cast", x, to=TensorProto.FLOAT)


def _cast(g: _Builder, x: str, dtype: int) -> str:
    return x if dtype == TensorProto.FLOAT else g.op("Cast", x, to=dtype)


def _used_initializers(g: _Builder) -> list[str]:
    used = {i for node in g.nodes for i in node.input}
    return [name for name in g.initializers if name in used]

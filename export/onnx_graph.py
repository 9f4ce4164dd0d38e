"""Build the planner and infiller ONNX graphs from the contract and the weight initializers.

The graphs are written op by op (as onnxruntime-genai's model builder does) rather than
traced: the structure is exactly what we declare, only standard ONNX ops appear, fp16/bf16
graphs keep RMSNorm variance and softmax in fp32, and no torch tracing memory is needed.
Layout and math mirror `refusion.export.model`, the torch definition the export is
validated against.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from refusion.runtime.core.contract import GraphSpec
from refusion.runtime.core.dims import ModelDims
from refusion.runtime.core.dtypes import dtype as core_dtype

OPSET = 17


class _Builder:
    """Appends nodes with fresh output names; keeps the graph code short and readable."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.constants: list[TensorProto] = []
        self._count = 0

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs: object) -> str:
        self._count += 1
        name = out or f"{op_type.lower()}_{self._count}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [name], name=f"n{self._count}_{op_type}", **attrs))
        return name

    def const(self, value: np.ndarray, name: str | None = None) -> str:
        self._count += 1
        tensor = numpy_helper.from_array(value, name or f"const_{self._count}")
        self.constants.append(tensor)
        return tensor.name

    def ints(self, *values: int) -> str:
        return self.const(np.array(values, dtype=np.int64))


def build_graph(
    spec: GraphSpec, dims: ModelDims, dtype: str, initializers: dict[str, TensorProto]
) -> onnx.ModelProto:
    """One graph of the contract: embed, decoder layers with explicit KV, fused heads."""
    g = _Builder()
    onnx_dtype = core_dtype(dtype).onnx
    wants = {t.name for t in spec.outputs}
    n_rep = dims.num_heads // dims.kv_heads
    d = dims.head_dim

    x = g.op("Gather", "model.embed_tokens.weight", "input_ids")  # [b, s, hidden]
    cos, sin = _rotary(g, dims, onnx_dtype)
    # Additive attention bias from the boolean mask: [b, 1, 1, s, total]
    mask5 = g.op("Unsqueeze", "attention_mask", g.ints(1, 2))
    zero, neg = g.const(np.array(0.0, np.float32)), g.const(np.array(np.finfo(np.float32).min, np.float32))
    bias = g.op("Where", mask5, zero, neg)
    scale = g.const(np.array(1.0 / np.sqrt(d), np.float32))

    for i in range(dims.num_layers):
        p = f"model.layers.{i}."
        h = _rms_norm(g, x, p + "input_layernorm.weight", dims.rms_norm_eps, onnx_dtype)
        # The infiller's new keys and values are its present outputs, named where they are made.
        infill = f"present.{i}.key" in wants
        present_k, present_v = (f"present.{i}.key", f"present.{i}.value") if infill else (None, None)
        q = g.op("Reshape", g.op("MatMul", h, p + "self_attn.q_proj.weight"), g.ints(0, 0, dims.num_heads, d))
        k = g.op("Reshape", g.op("MatMul", h, p + "self_attn.k_proj.weight"), g.ints(0, 0, dims.kv_heads, d))
        v = g.op("Reshape", g.op("MatMul", h, p + "self_attn.v_proj.weight"), g.ints(0, 0, dims.kv_heads, d),
                 out=present_v)
        q = _rope(g, _rms_norm(g, q, p + "self_attn.q_norm.weight", dims.rms_norm_eps, onnx_dtype), cos, sin, d)
        k = _rope(g, _rms_norm(g, k, p + "self_attn.k_norm.weight", dims.rms_norm_eps, onnx_dtype), cos, sin, d,
                  out=present_k)
        # [b, total, kv, d] -> grouped-query attention through 5-D broadcasting, no KV repeat
        keys = g.op("Concat", f"past_key_values.{i}.key", k, axis=1)
        values = g.op("Concat", f"past_key_values.{i}.value", v, axis=1)
        q5 = g.op("Transpose", g.op("Reshape", q, g.ints(0, 0, dims.kv_heads, n_rep, d)), perm=[0, 2, 3, 1, 4])
        k5 = g.op("Unsqueeze", g.op("Transpose", keys, perm=[0, 2, 3, 1]), g.ints(2))  # [b, kv, 1, d, total]
        v5 = g.op("Unsqueeze", g.op("Transpose", values, perm=[0, 2, 1, 3]), g.ints(2))  # [b, kv, 1, total, d]
        scores = g.op("Mul", _to_f32(g, g.op("MatMul", q5, k5), onnx_dtype), scale)
        probs = g.op("Softmax", g.op("Add", scores, bias), axis=-1)
        attn = g.op("MatMul", _cast(g, probs, onnx_dtype), v5)  # [b, kv, rep, s, d]
        attn = g.op("Reshape", g.op("Transpose", attn, perm=[0, 3, 1, 2, 4]), g.ints(0, 0, dims.q_size))
        x = g.op("Add", x, g.op("MatMul", attn, p + "self_attn.o_proj.weight"))
        h = _rms_norm(g, x, p + "post_attention_layernorm.weight", dims.rms_norm_eps, onnx_dtype)
        gate = g.op("MatMul", h, p + "mlp.gate_proj.weight")
        up = g.op("MatMul", h, p + "mlp.up_proj.weight")
        act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)  # SiLU as Mul+Sigmoid: portable
        x = g.op("Add", x, g.op("MatMul", act, p + "mlp.down_proj.weight"))

    h = _rms_norm(g, x, "model.norm.weight", dims.rms_norm_eps, onnx_dtype)
    # Linear weights are stored [in, out]; a tied head reads the embedding through a Transpose.
    head = g.op("Transpose", "model.embed_tokens.weight", perm=[1, 0]) if dims.tie_word_embeddings else "lm_head.weight"
    logits = _to_f32(g, g.op("MatMul", h, head), onnx_dtype)  # [b, s, vocab] fp32
    if "logits" in wants:
        logits = g.op("Identity", logits, out="logits")
    _heads(g, logits, "input_probs" in wants)

    graph = helper.make_graph(
        g.nodes,
        f"refusion_{spec.name}",
        [helper.make_tensor_value_info(t.name, core_dtype(t.dtype).onnx, list(t.axes)) for t in spec.inputs],
        [helper.make_tensor_value_info(t.name, core_dtype(t.dtype).onnx, list(t.axes)) for t in spec.outputs],
        initializer=[initializers[n] for n in _used_initializers(g, initializers)] + g.constants,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="refusion-trt")
    model.ir_version = 8  # readable by TensorRT 10's parser and onnxruntime >= 1.14
    return model


def _heads(g: _Builder, logits: str, verify: bool) -> None:
    """argmax id and its probability; with `verify`, the probability of each given token."""
    g.op("ArgMax", logits, axis=-1, keepdims=0, out="argmax_ids")
    top = g.op("ReduceMax", logits, axes=[-1], keepdims=1)  # [b, s, 1]
    denom = g.op("ReduceSum", g.op("Exp", g.op("Sub", logits, top)), g.ints(-1), keepdims=1)
    g.op("Squeeze", g.op("Reciprocal", denom), g.ints(-1), out="argmax_probs")
    if not verify:
        return
    # p(token j | before j) = softmax(logits[j-1])[ids[j]]; position 0 reads its own logits.
    ids = g.op("Unsqueeze", "input_ids", g.ints(-1))  # [b, s, 1]
    next_ids = g.op("Concat", g.op("Slice", ids, g.ints(1), g.ints(2**62), g.ints(1)),
                    g.op("Slice", ids, g.ints(-1), g.ints(2**62), g.ints(1)), axis=1)
    def prob_of(token_ids: str) -> str:  # [b, s, 1]
        picked = g.op("GatherElements", logits, token_ids, axis=-1)
        return g.op("Div", g.op("Exp", g.op("Sub", picked, top)), denom)
    first = g.op("Slice", prob_of(ids), g.ints(0), g.ints(1), g.ints(1))
    shifted = g.op("Slice", prob_of(next_ids), g.ints(0), g.ints(-1), g.ints(1))
    g.op("Squeeze", g.op("Concat", first, shifted, axis=1), g.ints(-1), out="input_probs")


def _rotary(g: _Builder, dims: ModelDims, dtype: int) -> tuple[str, str]:
    """cos/sin tables [b, s, 1, d] from position_ids, computed in fp32 as HF does."""
    half = dims.head_dim // 2
    inv_freq = 1.0 / (dims.rope_theta ** (np.arange(0, dims.head_dim, 2, dtype=np.int64).astype(np.float32) / dims.head_dim))
    pos = g.op("Unsqueeze", g.op("Cast", "position_ids", to=TensorProto.FLOAT), g.ints(-1))  # [b, s, 1]
    freqs = g.op("Mul", pos, g.const(inv_freq.astype(np.float32).reshape(1, 1, half)))
    emb = g.op("Unsqueeze", g.op("Concat", freqs, freqs, axis=-1), g.ints(2))
    return _cast(g, g.op("Cos", emb), dtype), _cast(g, g.op("Sin", emb), dtype)


def _rope(g: _Builder, x: str, cos: str, sin: str, head_dim: int, out: str | None = None) -> str:
    half = head_dim // 2
    x1 = g.op("Slice", x, g.ints(0), g.ints(half), g.ints(-1))
    x2 = g.op("Slice", x, g.ints(half), g.ints(head_dim), g.ints(-1))
    rotated = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
    return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rotated, sin), out=out)


def _rms_norm(g: _Builder, x: str, weight: str, eps: float, dtype: int) -> str:
    """Qwen3RMSNorm: variance in fp32, normalised value cast back, then scaled.

    Written as Pow -> ReduceMean -> Add -> Sqrt -> Div, the pattern onnxruntime fuses into one
    SimplifiedLayerNormalization kernel (seven nodes per norm otherwise; ~1/3 of all nodes)."""
    xf = _to_f32(g, x, dtype)
    var = g.op("ReduceMean", g.op("Pow", xf, g.const(np.array(2.0, np.float32))), axes=[-1], keepdims=1)
    std = g.op("Sqrt", g.op("Add", var, g.const(np.array(eps, np.float32))))
    return g.op("Mul", weight, _cast(g, g.op("Div", xf, std), dtype))


def _to_f32(g: _Builder, x: str, dtype: int) -> str:
    return x if dtype == TensorProto.FLOAT else g.op("Cast", x, to=TensorProto.FLOAT)


def _cast(g: _Builder, x: str, dtype: int) -> str:
    return x if dtype == TensorProto.FLOAT else g.op("Cast", x, to=dtype)


def _used_initializers(g: _Builder, initializers: dict[str, TensorProto]) -> list[str]:
    used = {i for node in g.nodes for i in node.input}
    return [name for name in initializers if name in used]

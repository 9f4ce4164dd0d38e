"""The onnxruntime-only variant of the two graphs (`refusion-export onnx --ops onnxruntime`): the same contract,
inputs and outputs as `onnx_graph`'s standard graphs, written with opset 23's fused Attention, RMSNormalization
and RotaryEmbedding and onnxruntime's SkipSimplifiedLayerNormalization, so a forward is about half the nodes.
Where per-call cost dominates (a small model, one token a forward) the node count is the forward's time. TensorRT
builds the standard graphs (docs/tensorrt.md): its parser does not take these ops in every version we support.

Per layer: norm, q/k/v projections, q_norm and k_norm over each head, RoPE from one cos/sin table a forward,
the past and new keys concatenated sequence-major (the contract's KV layout) and read as [b, total, kv x d] by a
grouped-query Attention over the contract's boolean mask turned into a bias once; the residual add fused into
the next norm.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from refusion.export.onnx_graph import _Builder, assemble, final_heads, rope_freqs
from refusion.runtime.core.contract import INPUTS_EMBEDS, ORT_OPSET, GraphSpec
from refusion.runtime.core.dims import ModelDims
from refusion.runtime.core.dtypes import dtype as core_dtype

IR_VERSION = 11  # what opset 23 (ORT_OPSET) needs
MS_DOMAIN = "com.microsoft"  # SkipSimplifiedLayerNormalization: onnxruntime's own


def build_ort_graph(
    spec: GraphSpec, dims: ModelDims, dtype: str, initializers: dict[str, TensorProto]
) -> onnx.ModelProto:
    """One graph of the contract in the fused onnxruntime form; inputs, outputs and weights as `build_graph`'s."""
    g = _Builder(initializers)
    g.opset = ORT_OPSET  # ReduceMax takes its axes as an input from opset 18
    onnx_dtype = core_dtype(dtype).onnx
    wants = {t.name for t in spec.outputs}
    n, kv, d, eps = dims.num_heads, dims.kv_heads, dims.head_dim, dims.rms_norm_eps

    fed = any(t.name == INPUTS_EMBEDS for t in spec.inputs)
    x = INPUTS_EMBEDS if fed else g.op("Gather", "model.embed_tokens.weight", "input_ids")
    cos, sin = _rope_tables(g, dims, onnx_dtype)
    # the boolean mask as an fp32 additive bias [b, 1, s, total], as the standard graphs add it
    zero, neg = g.const(np.array(0.0, np.float32)), g.const(np.array(np.finfo(np.float32).min, np.float32))
    bias = g.op("Where", g.op("Unsqueeze", "attention_mask", g.ints(1)), zero, neg)

    def norm(v: str, weight: str) -> str:
        return g.op("RMSNormalization", v, weight, axis=-1, epsilon=eps)

    def head_norm_rope(v: str, weight: str, heads: int) -> str:
        """q_norm / k_norm over each head, then RoPE: [b, s, heads x d] in and out."""
        per_head = norm(g.op("Reshape", v, g.ints(0, 0, heads, d)), weight)
        return g.op("RotaryEmbedding", g.op("Reshape", per_head, g.ints(0, 0, heads * d)), cos, sin, num_heads=heads)

    h = norm(x, "model.layers.0.input_layernorm.weight")
    for i in range(dims.num_layers):
        p = f"model.layers.{i}."
        infill = f"present.{i}.key" in wants
        q = head_norm_rope(g.linear(h, p + "self_attn.q_proj.weight"), p + "self_attn.q_norm.weight", n)
        k = head_norm_rope(g.linear(h, p + "self_attn.k_proj.weight"), p + "self_attn.k_norm.weight", kv)
        k4 = g.op("Reshape", k, g.ints(0, 0, kv, d), out=f"present.{i}.key" if infill else None)
        v4 = g.op("Reshape", g.linear(h, p + "self_attn.v_proj.weight"), g.ints(0, 0, kv, d),
                  out=f"present.{i}.value" if infill else None)
        keys = g.op("Reshape", g.op("Concat", f"past_key_values.{i}.key", k4, axis=1), g.ints(0, 0, kv * d))
        values = g.op("Reshape", g.op("Concat", f"past_key_values.{i}.value", v4, axis=1), g.ints(0, 0, kv * d))
        attn = _attention(g, q, keys, values, bias, n, kv, onnx_dtype)
        h, x = _skip_norm(g, g.linear(attn, p + "self_attn.o_proj.weight"), x, p + "post_attention_layernorm.weight",
                          eps)
        gate = g.linear(h, p + "mlp.gate_proj.weight")
        act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), g.linear(h, p + "mlp.up_proj.weight"))
        down = g.linear(act, p + "mlp.down_proj.weight")
        if i + 1 < dims.num_layers:
            h, x = _skip_norm(g, down, x, f"model.layers.{i + 1}.input_layernorm.weight", eps)
        else:
            x = g.op("Add", x, down)

    final_heads(g, spec, dims, x, norm, onnx_dtype)
    return assemble(g, spec, f"refusion_{spec.name}_onnxruntime",
                    [helper.make_opsetid("", ORT_OPSET), helper.make_opsetid(MS_DOMAIN, 1)], IR_VERSION)


def _rope_tables(g: _Builder, dims: ModelDims, dtype: int) -> tuple[str, str]:
    """cos and sin [b, s, head_dim / 2] at the fed positions (fp32, then the graph dtype), once a forward."""
    freqs = rope_freqs(g, dims)
    tables = g.op("Cos", freqs), g.op("Sin", freqs)
    if dtype == TensorProto.FLOAT:
        return tables
    return g.op("Cast", tables[0], to=dtype), g.op("Cast", tables[1], to=dtype)


def _attention(g: _Builder, q: str, keys: str, values: str, bias: str, heads: int, kv_heads: int, dtype: int) -> str:
    """Grouped-query attention of q [b, s, heads x d] over keys and values [b, total, kv_heads x d], in fp32: in
    fp16, onnxruntime's CPU kernel rounds the scores to fp16 (top ids off the torch definition's in validation),
    where the standard graphs take their softmax in fp32."""
    if dtype == TensorProto.FLOAT:
        return g.op("Attention", q, keys, values, bias, q_num_heads=heads, kv_num_heads=kv_heads)
    q, keys, values = (g.op("Cast", t, to=TensorProto.FLOAT) for t in (q, keys, values))
    out = g.op("Attention", q, keys, values, bias, q_num_heads=heads, kv_num_heads=kv_heads)
    return g.op("Cast", out, to=dtype)


def _skip_norm(g: _Builder, v: str, residual: str, weight: str, eps: float) -> tuple[str, str]:
    """(RMSNorm(residual + v), residual + v) in one node."""
    normed, _, _, total = g.ops("SkipSimplifiedLayerNormalization", v, residual, weight, outs=(None, "", "", None),
                                domain=MS_DOMAIN, epsilon=eps)
    return normed, total

"""Our own export-friendly Qwen3, in torch: the definition the ONNX graphs are validated against.

It takes exactly the graph contract's inputs (explicit position ids, a boolean attention
mask over past + new tokens, sequence-major past KV) and returns the contract's outputs.
Hugging Face transformers is only its test oracle.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from refusion.export.checkpoint import Checkpoint
from refusion.export.int4 import dequantize
from refusion.runtime.core.contract import candidates_for
from refusion.runtime.core.dims import ModelDims, is_linear_weight
from refusion.runtime.core.quantization import SCALE_SUFFIX, scale_name

UPCAST_ELEMENTS = 1 << 24  # a linear's weight is cast to a wider arithmetic this many elements (64 MiB fp32) at a time


class Linear(nn.Linear):
    """nn.Linear that computes in its input's dtype: an fp16 weight is cast up for fp32 arithmetic (`Qwen3.forward`'s
    `dtype`) a slice of output rows at a time, so no wider copy of a whole matrix is held. In the weight's own dtype
    it is nn.Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.dtype == x.dtype:
            return super().forward(x)
        rows = max(1, UPCAST_ELEMENTS // w.shape[1])
        return torch.cat([nn.functional.linear(x, w[i:i + rows].to(x.dtype)) for i in range(0, w.shape[0], rows)], -1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # variance in fp32 whatever the model dtype
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotary_tables(position_ids: torch.Tensor, dims: ModelDims, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [b, s, 1, head_dim], computed in fp32."""
    exponent = torch.arange(0, dims.head_dim, 2, dtype=torch.int64).float() / dims.head_dim
    inv_freq = 1.0 / (dims.rope_theta ** exponent)
    freqs = position_ids.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, dims: ModelDims, candidates: int | None = None):
        """`candidates`: K of the top-K outputs (default: an export's default for this vocabulary)."""
        super().__init__()
        self.dims = dims
        self.candidates = candidates or candidates_for(dims.vocab_size)
        self.q_proj = Linear(dims.hidden_size, dims.q_size, bias=False)
        self.k_proj = Linear(dims.hidden_size, dims.kv_size, bias=False)
        self.v_proj = Linear(dims.hidden_size, dims.kv_size, bias=False)
        self.o_proj = Linear(dims.q_size, dims.hidden_size, bias=False)
        self.q_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps)
        self.k_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps)

    def forward(self, x, cos, sin, bias, past_k, past_v):
        b, s, _ = x.shape
        dm = self.dims
        q = apply_rotary(self.q_norm(self.q_proj(x).view(b, s, dm.num_heads, dm.head_dim)), cos, sin)
        k = apply_rotary(self.k_norm(self.k_proj(x).view(b, s, dm.kv_heads, dm.head_dim)), cos, sin)
        v = self.v_proj(x).view(b, s, dm.kv_heads, dm.head_dim)
        keys = torch.cat([past_k.to(k.dtype), k], dim=1).transpose(1, 2)  # [b, kv, total, d]
        values = torch.cat([past_v.to(v.dtype), v], dim=1).transpose(1, 2)
        rep = dm.num_heads // dm.kv_heads
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        scores = (q.transpose(1, 2) @ keys.transpose(2, 3)).float() / dm.head_dim**0.5 + bias
        attn = torch.softmax(scores, dim=-1).to(x.dtype) @ values  # [b, heads, s, d]
        return self.o_proj(attn.transpose(1, 2).reshape(b, s, dm.q_size)), k, v


class MLP(nn.Module):
    def __init__(self, dims: ModelDims):
        super().__init__()
        self.gate_proj = Linear(dims.hidden_size, dims.intermediate_size, bias=False)
        self.up_proj = Linear(dims.hidden_size, dims.intermediate_size, bias=False)
        self.down_proj = Linear(dims.intermediate_size, dims.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, dims: ModelDims):
        super().__init__()
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.self_attn = Attention(dims)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.mlp = MLP(dims)

    def forward(self, x, cos, sin, bias, past_k, past_v):
        attn, k, v = self.self_attn(self.input_layernorm(x), cos, sin, bias, past_k, past_v)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class Qwen3(nn.Module):
    """Qwen3ForCausalLM with the refusion graph contract as its forward signature."""

    def __init__(self, dims: ModelDims, candidates: int | None = None):
        """`candidates`: K of the top-K outputs (default: an export's default for this vocabulary)."""
        super().__init__()
        self.dims = dims
        self.candidates = candidates or candidates_for(dims.vocab_size)
        self.embed_tokens = nn.Embedding(dims.vocab_size, dims.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(dims) for _ in range(dims.num_layers))
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.lm_head = Linear(dims.hidden_size, dims.vocab_size, bias=False)
        if dims.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @staticmethod
    def from_checkpoint(ckpt: Checkpoint, dtype: torch.dtype = torch.float32) -> Qwen3:
        return Qwen3.from_tensors(ckpt.dims, ((n, t.to(dtype)) for n, t in ckpt.tensors()))

    @staticmethod
    def from_export(dims: ModelDims, weights: dict[str, np.ndarray], dtype: str, candidates: int | None = None) -> Qwen3:
        """Built on an export's memory-mapped weight file: the same bytes the graphs run on. An int4
        weight (packed bytes beside its `_scale`) is dequantized as the graphs' DequantizeLinear does,
        so torch runs the same math on the same values."""
        def tensor(name: str, array: np.ndarray) -> torch.Tensor:
            if scale_name(name) in weights:
                scale = weights[scale_name(name)]  # [K / block, N]
                k, n = array.size * 2 // scale.shape[1], scale.shape[1]
                t = torch.from_numpy(dequantize(array, scale, (k, n))).to(getattr(torch, dtype))
            else:
                t = torch.from_numpy(array)
                t = t.view(torch.bfloat16) if dtype == "bfloat16" else t
            return t.T if is_linear_weight(name) else t  # stored [in, out]
        return Qwen3.from_tensors(dims, ((n, tensor(n, a)) for n, a in weights.items()
                                         if not n.endswith(SCALE_SUFFIX)), candidates)

    @staticmethod
    def from_tensors(dims: ModelDims, tensors: Iterable[tuple[str, torch.Tensor]],
                     candidates: int | None = None) -> Qwen3:
        with torch.device("meta"):
            model = Qwen3(dims, candidates)
        state = {_module_name(name): t for name, t in tensors}
        if dims.tie_word_embeddings:  # the tied head is the embedding; checkpoints and exports store it once
            state["lm_head.weight"] = state["embed_tokens.weight"]
        model.load_state_dict(state, strict=True, assign=True)
        if dims.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        return model.eval()

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor]],
        head_positions: torch.Tensor | None = None,
        vocab_mask: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> dict[str, torch.Tensor]:
        """The contract's outputs; the heads at `head_positions` [b, heads] (None: every position), each reading
        the logits with the tokens `vocab_mask` [b, 1 or heads, bytes] leaves out at -inf (None: every token).
        `dtype`: the arithmetic's (None: the weights'); float32 on fp16 weights and past evaluates their values
        without rounding to fp16 on the way (validation's reference for fp16 exports)."""
        x = self.embed_tokens(input_ids) if dtype is None else self.embed_tokens(input_ids).to(dtype)
        cos, sin = rotary_tables(position_ids, self.dims, x.dtype)
        bias = torch.where(attention_mask[:, None], 0.0, torch.finfo(torch.float32).min)
        out: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, cos, sin, bias, *past[i])
            out[f"present.{i}.key"], out[f"present.{i}.value"] = k, v
        b, s = input_ids.shape
        at = torch.arange(s).expand(b, s) if head_positions is None else head_positions
        logits = self.lm_head(self.norm(x[torch.arange(b)[:, None], at])).float()  # [b, heads, vocab]
        if vocab_mask is not None:
            bits = (vocab_mask.long()[..., None] >> torch.arange(8)) & 1  # little-endian bits of each byte
            allowed = bits.reshape(b, vocab_mask.shape[1], -1)[..., : logits.shape[-1]].bool()
            logits = logits.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        out["logits"] = logits
        out["argmax_ids"] = logits.argmax(-1)
        out["argmax_probs"] = probs.gather(-1, out["argmax_ids"][..., None])[..., 0]
        next_ids = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1).gather(1, at)  # the token after each head
        out["input_probs"] = probs.gather(-1, next_ids[..., None])[..., 0]
        out["top_logprobs"], out["top_ids"] = torch.log_softmax(logits, dim=-1).topk(self.candidates, dim=-1)
        return out


def _module_name(hf_name: str) -> str:
    """HF tensor name -> our module's parameter name (we drop the `model.` level)."""
    return hf_name.removeprefix("model.")

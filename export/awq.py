"""Activation-aware weight quantization (AWQ, Lin et al. 2023) as a rewrite of the float weights.

A few input channels of each linear carry much larger activations than the rest; their weights
matter most. AWQ scales those weight rows up by s (so rounding costs them less) and divides the
input by s, folded into the op that produces it, which keeps the float model's function exactly:

    input_layernorm.weight / s    ->  q, k, v rows x s
    v_proj columns / s            ->  o_proj rows x s     (attention is linear in v)
    post_attention_layernorm / s  ->  gate, up rows x s
    up_proj columns / s           ->  down_proj rows x s  (silu(gate) * up is linear in up)

so no Mul is added to the graphs. An int4 lm_head (`--quantize-head`) would pair the same way with
the final norm, but measured on the embedded model the scale does not help it (docs/quantization.md,
"The int4 lm_head"): the head gets the clipping search alone, on the last layer's outputs after that
norm. With grouped-query attention one v channel feeds `rep` o_proj
input channels, so the v -> o scale is tied across each group (llm-awq skips this pair then).
Per pair, s = mean|x| ** alpha (normalised), alpha on a grid of 20 in [0, 1), chosen to minimise
the squared output error of the round-to-nearest linears on the calibration activations; then
each block's clipping threshold (1 down to 0.55 x absmax) is searched the same way for every
linear but q and k (whose errors the attention scores amplify; llm-awq leaves them too).

The pass runs layer by layer through export/model.py's DecoderLayer: the calibration hidden
states enter layer i, its linears' inputs are captured, its weights rewritten, and the float
layer's outputs become layer i+1's inputs, so one layer's weights are in memory at a time.
export/quantize.py's round-to-nearest then writes the rewritten weights as int4.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from refusion.export.int4 import rtn
from refusion.export.model import DecoderLayer, rotary_tables
from refusion.export.progress import Progress, line
from refusion.runtime.core.dims import ModelDims, expected_weights

if TYPE_CHECKING:
    from refusion.export.checkpoint import Checkpoint

GRID = 20  # alpha in {0, 0.05, ..., 0.95}; clipping ratios 1, 0.95, ..., 0.55
MAX_SHRINK = 0.5
SEARCH_TOKENS = 2048  # calibration tokens the scale search evaluates (evenly subsampled)
CLIP_TOKENS = 512  # and the clipping search
CLIP_COLUMNS = 1024  # output columns per step of the clipping search (bounds its memory)


def fake_quant(w: torch.Tensor, block: int) -> torch.Tensor:
    """w [K, N] after int4 round-to-nearest and back, in float32."""
    q, scale = rtn(w, block, torch.float32)
    return (q.float().reshape(-1, block, w.shape[1]) * scale[:, None, :]).reshape(w.shape)


def scale_loss(x: torch.Tensor, weights: list[torch.Tensor], s: torch.Tensor, block: int) -> float:
    """Sum over `weights` of the mean squared error of (x / s) @ Q(s * W) against x @ W."""
    total = 0.0
    for w in weights:
        quantized = fake_quant(w * s[:, None], block) / s[:, None]
        total += float((x @ (quantized - w)).square().mean())
    return total


def search_scale(x: torch.Tensor, weights: list[torch.Tensor], block: int,
                 magnitude: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """(s [K], alpha): the per-input-channel scale for linears sharing the input x [T, K] (weights
    [K, N_i]); `magnitude` replaces mean|x| per channel (the tied v -> o case). alpha 0 is s = 1,
    plain round-to-nearest, so the result is never worse than that on these activations."""
    x = _subsample(x, SEARCH_TOKENS)
    magnitude = x.abs().mean(0) if magnitude is None else magnitude
    best: tuple[float, torch.Tensor, float] | None = None
    for i in range(GRID):
        alpha = i / GRID
        s = magnitude.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        loss = scale_loss(x, weights, s, block)
        if best is None or loss < best[0]:
            best = (loss, s, alpha)
    assert best is not None
    return best[1], best[2]


def search_clip(x: torch.Tensor, w: torch.Tensor, block: int) -> torch.Tensor:
    """Per block and output column, the clipping threshold [K / block, N] that minimises the block's
    squared output error x_block @ Q(clip(w_block)) against x_block @ w_block."""
    x = _subsample(x, CLIP_TOKENS)
    k, n = w.shape
    xg = x.reshape(len(x), k // block, block)
    out = torch.empty(k // block, n)
    for start in range(0, n, CLIP_COLUMNS):
        wg = w[:, start : start + CLIP_COLUMNS].reshape(k // block, block, -1)
        ref = torch.einsum("tgb,gbn->tgn", xg, wg)
        absmax = wg.abs().amax(dim=1)
        best_err = torch.full_like(absmax, float("inf"))
        best = absmax.clone()
        for i in range(int(MAX_SHRINK * GRID)):
            limit = absmax * (1 - i / GRID)
            clipped = torch.maximum(torch.minimum(wg, limit[:, None]), -limit[:, None])
            quantized = fake_quant(clipped.reshape(k, -1), block).reshape(wg.shape)
            err = ((torch.einsum("tgb,gbn->tgn", xg, quantized) - ref) ** 2).mean(0)
            better = err < best_err
            best_err, best = torch.where(better, err, best_err), torch.where(better, limit, best)
        out[:, start : start + CLIP_COLUMNS] = best
    return out


def clip(w: torch.Tensor, limit: torch.Tensor, block: int) -> torch.Tensor:
    bound = limit.repeat_interleave(block, dim=0)
    return torch.maximum(torch.minimum(w, bound), -bound)


def awq_tensors(ckpt: Checkpoint, prompts: list[list[int]], block: int, progress: Progress,
                head: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors (HF layout, weight-file order) with every decoder layer rewritten by AWQ,
    and with `head` the lm_head too (with the final norm it scales against)."""
    dims = ckpt.dims
    names = list(expected_weights(dims))
    (embed_name, embed), = ckpt.tensors(["model.embed_tokens.weight"])
    hidden = [embed[torch.tensor(ids)].float()[None] for ids in prompts]  # [1, s, hidden] per prompt
    yield embed_name, embed
    del embed
    for i in range(dims.num_layers):
        prefix = f"model.layers.{i}."
        tensors = {n: t.float() for n, t in ckpt.tensors([n for n in names if n.startswith(prefix)])}
        hidden, inputs = _run_layer(dims, tensors, prefix, hidden)
        alphas = _rewrite_layer(dims, tensors, prefix, inputs, block)
        yield from tensors.items()
        del tensors, inputs  # this layer's weights and activations, before the next layer's (or the lm_head) load
        line(progress, f"awq: layer {i + 1}/{dims.num_layers} rewritten (alpha qkv {alphas[0]:.2f}, "
                       f"vo {alphas[1]:.2f}, gate/up {alphas[2]:.2f}, down {alphas[3]:.2f})",
             "awq", i + 1, dims.num_layers, "layer")
    rest = [n for n in names if not n.startswith("model.layers.") and n != embed_name]  # the final norm, lm_head
    if not head:
        del hidden
        yield from ckpt.tensors(rest)
        return
    tensors = {n: t.float() for n, t in ckpt.tensors(rest)}
    rewrite_head(tensors, head_inputs(hidden, tensors[NORM], dims.rms_norm_eps), block)
    del hidden
    yield from tensors.items()
    line(progress, "awq: lm_head clipped")


NORM, HEAD = "model.norm.weight", "lm_head.weight"


def head_inputs(hidden: list[torch.Tensor], norm: torch.Tensor, eps: float) -> torch.Tensor:
    """What lm_head reads: the last layer's outputs [1, s, hidden] per prompt after the final RMSNorm, [tokens, hidden]."""
    x = torch.cat([h.reshape(-1, h.shape[-1]) for h in hidden]).float()
    return norm.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rewrite_head(t: dict[str, torch.Tensor], x: torch.Tensor, block: int) -> None:
    """Clip lm_head's blocks against its input x [tokens, hidden], in place (HF layout). No scale: measured, it
    did not help the head (the module docstring); the final norm is left as it is."""
    w = t[HEAD].T
    t[HEAD] = clip(w, search_clip(x, w, block), block).T.contiguous()


def _run_layer(dims: ModelDims, tensors: dict[str, torch.Tensor], prefix: str,
               hidden: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The float layer on every prompt's hidden states (causal attention): its outputs, and the inputs
    of q/k/v, o, gate/up and down, as [tokens, K]."""
    with torch.device("meta"):
        layer = DecoderLayer(dims)
    layer.load_state_dict({n.removeprefix(prefix): t for n, t in tensors.items()}, strict=True, assign=True)
    captured: dict[str, list[torch.Tensor]] = {"qkv": [], "o": [], "gate_up": [], "down": []}

    def keep(key: str) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
        return lambda _, args: captured[key].append(args[0].reshape(-1, args[0].shape[-1]))

    hooks = [module.register_forward_pre_hook(keep(key))
             for key, module in (("qkv", layer.self_attn.q_proj), ("o", layer.self_attn.o_proj),
                                 ("gate_up", layer.mlp.gate_proj), ("down", layer.mlp.down_proj))]
    outputs = []
    empty = torch.zeros(1, 0, dims.kv_heads, dims.head_dim)
    with torch.no_grad():
        for x in hidden:
            s = x.shape[1]
            cos, sin = rotary_tables(torch.arange(s)[None], dims, torch.float32)
            causal = torch.ones(s, s, dtype=torch.bool).tril()
            bias = torch.where(causal, 0.0, torch.finfo(torch.float32).min)[None, None]
            outputs.append(layer(x, cos, sin, bias, empty, empty)[0])
    for hook in hooks:
        hook.remove()
    return outputs, {key: torch.cat(parts) for key, parts in captured.items()}


def _rewrite_layer(dims: ModelDims, t: dict[str, torch.Tensor], p: str, inputs: dict[str, torch.Tensor],
                   block: int) -> tuple[float, float, float, float]:
    """Scale (and clip) one layer's weights in place (HF layout [out, in]); returns the four alphas."""
    def w(name: str) -> torch.Tensor:  # [K, N]
        return t[p + name].T

    def scale_rows(names: tuple[str, ...], s: torch.Tensor) -> None:
        for name in names:
            t[p + name] = (w(name) * s[:, None]).T.contiguous()

    q, k, v, o = (f"self_attn.{x}_proj.weight" for x in "qkvo")
    gate, up, down = (f"mlp.{x}_proj.weight" for x in ("gate", "up", "down"))
    x_qkv, x_o, x_gu, x_down = inputs["qkv"], inputs["o"], inputs["gate_up"], inputs["down"]

    s, a_qkv = search_scale(x_qkv, [w(q), w(k), w(v)], block)
    t[p + "input_layernorm.weight"] = t[p + "input_layernorm.weight"] / s
    scale_rows((q, k, v), s)
    x_qkv = x_qkv / s

    rep = dims.num_heads // dims.kv_heads  # o_proj input channel (head h, j) reads v channel (h // rep, j)
    tied = x_o.abs().mean(0).reshape(dims.kv_heads, rep, dims.head_dim).mean(1)
    s, a_vo = search_scale(x_o, [w(o)], block, tied[:, None, :].expand(-1, rep, -1).reshape(-1))
    t[p + v] = (w(v) / s.reshape(dims.kv_heads, rep, dims.head_dim)[:, 0].reshape(1, -1)).T.contiguous()
    scale_rows((o,), s)
    x_o = x_o / s

    s, a_gu = search_scale(x_gu, [w(gate), w(up)], block)
    t[p + "post_attention_layernorm.weight"] = t[p + "post_attention_layernorm.weight"] / s
    scale_rows((gate, up), s)
    x_gu = x_gu / s

    s, a_down = search_scale(x_down, [w(down)], block)
    t[p + up] = (w(up) / s[None, :]).T.contiguous()
    scale_rows((down,), s)
    x_down = x_down / s

    for name, x in ((v, x_qkv), (o, x_o), (gate, x_gu), (up, x_gu), (down, x_down)):
        t[p + name] = clip(w(name), search_clip(x, w(name), block), block).T.contiguous()
    return a_qkv, a_vo, a_gu, a_down


def _subsample(x: torch.Tensor, rows: int) -> torch.Tensor:
    """At most `rows` rows of x, evenly spaced."""
    return x if len(x) <= rows else x[torch.linspace(0, len(x) - 1, rows).long()]

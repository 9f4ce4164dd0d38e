"""int4 round-to-nearest, its packing (as onnx reads it), block-size rules, and AWQ's searches
against brute force on toy layers."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from refusion.export import awq
from refusion.export.int4 import dequantize, pack_int4, rtn, unpack_int4
from refusion.export.model import DecoderLayer
from refusion.export.quantize import (
    QUANT_METHODS,
    QuantizeOptions,
    QuantMethod,
    QuantPlan,
    default_block,
    float_tensors,
    plan_quantization,
)
from refusion.runtime.core.dims import ModelDims
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.quantization import CALIBRATED, METHODS, Quantization, block_problem, largest_block

onnx = pytest.importorskip("onnx")


def dims(hidden: int = 192, heads: int = 4, kv: int = 2, head_dim: int = 48, inter: int = 512) -> ModelDims:
    return ModelDims(num_layers=1, hidden_size=hidden, num_heads=heads, kv_heads=kv, head_dim=head_dim,
                     intermediate_size=inter, vocab_size=104, rms_norm_eps=1e-6, rope_theta=1e4,
                     tie_word_embeddings=False, max_position_embeddings=256)


# -- round-to-nearest and packing ----------------------------------------------------------------
def test_rtn_is_symmetric_absmax_over_seven_per_block():
    w = torch.randn(128, 24)
    w[5, 3] = -9.0  # the block's absmax, negative
    q, scale = rtn(w, 64, torch.float32)
    assert q.dtype == torch.int8 and scale.shape == (2, 24)
    assert int(q.min()) >= -7 and int(q.max()) <= 7  # -8 is never produced
    assert float(scale[0, 3]) == pytest.approx(9.0 / 7) and int(q[5, 3]) == -7  # the absmax lands on -7 exactly
    back = q.float() * scale.repeat_interleave(64, dim=0)
    assert float((back - w).abs().max()) <= float(scale.max()) / 2 + 1e-6  # round to nearest: half a step


def test_rtn_all_zero_block_and_fp16_scales():
    w = torch.zeros(32, 4)
    w[16:] = torch.randn(16, 4)
    q, scale = rtn(w, 16, torch.float16)
    assert scale.dtype == torch.float16 and torch.all(scale[0] == 1) and torch.all(q[:16] == 0)
    # q is rounded against the stored fp16 scale: dequantizing with it is within half a step
    back = q[16:].float() * scale[1].float()
    assert float((back - w[16:]).abs().max()) <= float(scale[1].float().max()) / 2 + 1e-6


@pytest.mark.parametrize("shape", [(4, 6), (16, 3), (3, 5)])
def test_packing_is_what_onnx_reads(shape):
    """Our bytes, handed to onnx as an INT4 tensor, read back as the same values; and onnx packs the same bytes."""
    import ml_dtypes

    q = np.random.default_rng(0).integers(-8, 8, shape).astype(np.int8)
    packed = pack_int4(q)
    assert packed.dtype == np.uint8 and packed.size == (q.size + 1) // 2
    np.testing.assert_array_equal(unpack_int4(packed, shape), q)
    tensor = onnx.helper.make_tensor("w", onnx.TensorProto.INT4, shape, packed.tobytes(), raw=True)
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(tensor).astype(np.int8), q)
    ours = onnx.numpy_helper.from_array(q.astype(ml_dtypes.int4), "w")
    assert ours.raw_data == packed.tobytes()


def test_dequantize_is_q_times_the_block_scale():
    q = np.arange(-7, 9, dtype=np.int8).reshape(4, 4) % 8
    scale = np.array([[1, 2, 3, 4], [0.5, 0.25, 1, 2]], np.float16)
    want = q.astype(np.float32) * np.repeat(scale.astype(np.float32), 2, axis=0)
    np.testing.assert_array_equal(dequantize(pack_int4(q), scale, (4, 4)), want)


# -- block sizes ---------------------------------------------------------------------------------
def test_block_sizes_of_the_embedded_model():
    d = dims()
    assert largest_block(d) == 64
    assert block_problem(d, 64) == "" and block_problem(d, 32) == ""
    problem = block_problem(d, 128)
    assert "does not divide hidden_size 192 and num_heads x head_dim 192" in problem
    assert "the largest power of two that divides all of hidden_size 192, num_heads x head_dim 192, " \
           "intermediate_size 512 is 64" in problem
    assert "not a power of two >= 16" in block_problem(d, 48)
    assert "not a power of two >= 16" in block_problem(d, 8)
    assert "cannot be quantized" in block_problem(dims(hidden=200, inter=512, heads=4, head_dim=50), 16)


def test_the_default_block_is_128_else_64_and_says_which():
    said: list[str] = []
    assert default_block(dims(), said.append) == 64  # the embedded model: hidden 192
    assert said == ["int4 block size 64: the largest of 128 and 64 that divides every linear's input (hidden_size "
                    "192, num_heads x head_dim 192, intermediate_size 512); --block-size sets another"]
    assert default_block(dims(hidden=256, heads=4, head_dim=64, inter=768), said.append) == 128
    assert said[-1].startswith("int4 block size 128: the largest of 128 and 64")
    with pytest.raises(RefusionError, match=r"neither int4 block size 128 nor 64 \(the ones TensorRT documents\) "
                                            r"fits: block size 64 does not divide hidden_size 96 .* is 32; pass "
                                            r"--block-size"):
        default_block(dims(hidden=96, heads=2, head_dim=48, inter=256), said.append)


# -- methods ----------------------------------------------------------------------------------------
def test_every_method_the_format_knows_has_a_handler_and_the_calibrated_ones_agree():
    """refusion.json's methods (runtime/core/quantization.py) and the export's handlers are one list: a method added
    to the format without a handler, or marked calibrated in one place only, fails here."""
    assert tuple(QUANT_METHODS) == METHODS
    assert tuple(name for name, method in QUANT_METHODS.items() if method.calibrated) == CALIBRATED


def test_a_calibrated_method_runs_its_own_tensors_not_awqs(monkeypatch):
    """The dispatch goes by the method's handler: a second calibrated method gets its own plan and tensors
    (before the handlers, every method listed as calibrated ran AWQ)."""
    from refusion.export.checkpoint import Checkpoint
    from refusion.export.progress import silent
    from refusion.models import EMBEDDED_MODEL

    class Fake(QuantMethod):
        name, calibrated = "int4-fake", True

        def plan(self, options, ckpt, block, progress):
            return QuantPlan(Quantization(self.name, block, 1, "0" * 64), [[1, 2, 3]])

        def tensors(self, ckpt, plan, progress):
            return iter([("mine", torch.zeros(1))])

    monkeypatch.setitem(QUANT_METHODS, Fake.name, Fake())
    ckpt = Checkpoint.open(EMBEDDED_MODEL)
    plan = plan_quantization(QuantizeOptions("int4-fake", 64), ckpt, "float32", silent)
    assert plan.quantization.method == "int4-fake" and plan.prompts == [[1, 2, 3]]
    assert [name for name, _ in float_tensors(ckpt, plan, silent)] == ["mine"]


# -- AWQ --------------------------------------------------------------------------------------------
def _toy(seed: int = 0, k: int = 8, n: int = 6, tokens: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations with two salient channels (large |x|), as in real layers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g)
    x[:, 1] *= 20
    x[:, k - 2] *= 8
    return x, torch.randn(k, n, generator=g)


def test_scale_search_finds_the_grid_minimum_and_beats_plain_rounding():
    x, w = _toy()
    s, alpha = awq.search_scale(x, [w], block=4)
    # brute force over the same grid, written out independently
    magnitude = x.abs().mean(0)
    losses = {}
    for i in range(awq.GRID):
        a = i / awq.GRID
        t = magnitude.pow(a).clamp(min=1e-4)
        t = t / (t.max() * t.min()).sqrt()
        qw, sc = rtn(w * t[:, None], 4, torch.float32)
        approx = qw.float() * sc.repeat_interleave(4, dim=0) / t[:, None]
        losses[a] = float(((x @ approx - x @ w) ** 2).mean())
    assert alpha == min(losses, key=losses.get)
    assert losses[alpha] < 0.8 * losses[0.0]  # the salient channels make scaling worth it
    assert awq.scale_loss(x, [w], s, 4) == pytest.approx(losses[alpha], rel=1e-5)


def test_scale_search_is_close_to_a_free_per_channel_search():
    """On a 4-channel layer (one block), a brute-force search over free per-channel scales
    (5^4 combinations) does no better than AWQ's one-parameter family."""
    x, w = _toy(k=4, n=3)
    _, alpha = awq.search_scale(x, [w], block=4)
    magnitude = x.abs().mean(0)
    s = magnitude.pow(alpha).clamp(min=1e-4)
    awq_loss = awq.scale_loss(x, [w], s / (s.max() * s.min()).sqrt(), 4)
    grid = (0.25, 0.5, 1.0, 2.0, 4.0)
    free = min(awq.scale_loss(x, [w], torch.tensor(c), 4) for c in itertools.product(grid, repeat=4))
    plain = awq.scale_loss(x, [w], torch.ones(4), 4)
    assert awq_loss < plain
    assert awq_loss <= free


def test_clip_search_matches_brute_force_per_block_and_column():
    x, w = _toy(k=8, n=3)
    limit = awq.search_clip(x, w, block=4)
    for g, col in itertools.product(range(2), range(3)):
        xb, wb = x[:, 4 * g : 4 * g + 4], w[4 * g : 4 * g + 4, col : col + 1]
        absmax = float(wb.abs().max())
        def err(ratio: float) -> float:
            clipped = wb.clamp(-absmax * ratio, absmax * ratio)
            return float(((xb @ awq.fake_quant(clipped, 4) - xb @ wb) ** 2).mean())
        ratios = [1 - i / awq.GRID for i in range(int(awq.MAX_SHRINK * awq.GRID))]
        best = min(ratios, key=err)
        assert float(limit[g, col]) == pytest.approx(absmax * best, rel=1e-6)


def test_folding_the_scales_keeps_the_float_layer_exactly(monkeypatch):
    """With clipping off, AWQ's rewrite (norm weights, v -> o tied over the GQA group, up -> down)
    leaves the float layer's output unchanged."""
    d = dims(hidden=64, heads=4, kv=2, head_dim=16, inter=96)
    torch.manual_seed(0)
    layer = DecoderLayer(d).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1) + (1 if p.dim() == 1 else 0))
    p = "model.layers.0."
    tensors = {p + n: t.detach().clone() for n, t in layer.state_dict().items()}
    hidden = [torch.randn(1, 7, 64), torch.randn(1, 5, 64)]
    outputs, inputs = awq._run_layer(d, tensors, p, hidden)
    monkeypatch.setattr(awq, "search_clip", lambda x, w, block: w.abs().reshape(-1, block, w.shape[1]).amax(1))
    alphas = awq._rewrite_layer(d, tensors, p, inputs, block=16)
    assert any(a > 0 for a in alphas), alphas  # something was scaled
    changed = [n for n in tensors if not torch.equal(tensors[n], layer.state_dict()[n.removeprefix(p)])]
    assert {n.removeprefix(p) for n in changed} >= {"input_layernorm.weight", "self_attn.v_proj.weight",
                                                   "self_attn.o_proj.weight", "mlp.up_proj.weight"}
    rewritten, _ = awq._run_layer(d, tensors, p, hidden)
    for a, b in zip(outputs, rewritten):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_awq_layer_error_is_below_rtn_on_salient_activations():
    """End to end on one layer: int4 after AWQ is closer to the float layer than plain int4 rounding."""
    d = dims(hidden=64, heads=4, kv=2, head_dim=16, inter=96)
    torch.manual_seed(1)
    layer = DecoderLayer(d).eval()
    p = "model.layers.0."
    tensors = {p + n: t.detach().clone() * (0.2 if t.dim() > 1 else 1) for n, t in layer.state_dict().items()}
    gen = torch.Generator().manual_seed(2)
    hidden = []
    for _ in range(6):
        h = torch.randn(1, 16, 64, generator=gen)
        h[..., 3] *= 25  # salient hidden channels, as trained models have
        hidden.append(h)
    reference, inputs = awq._run_layer(d, tensors, p, hidden)

    def quantized(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(t)
        for n, w in t.items():
            if n.endswith("_proj.weight"):
                out[n] = awq.fake_quant(w.T, 16).T
        return out

    def error(t: dict[str, torch.Tensor]) -> float:
        got, _ = awq._run_layer(d, quantized(t), p, hidden)
        return sum(float(((a - b) ** 2).mean()) for a, b in zip(got, reference))

    plain = error(tensors)
    awq._rewrite_layer(d, tensors, p, inputs, block=16)
    assert error(tensors) < 0.7 * plain



def test_the_int4_row_of_the_dtype_table():
    from refusion.runtime.core.dtypes import dtype, from_onnx

    row = dtype("int4")
    assert row.onnx == onnx.TensorProto.INT4 and from_onnx(onnx.TensorProto.INT4) is row and row.trt == "INT4"
    assert row.flag is None and row.safetensors is None  # never an export dtype, never in a checkpoint
    assert row.nbytes(4 * 6) == 12 and row.nbytes(5) == 3  # two values a byte, rounded up
    assert row.storage_shape((4, 6)) == (12,) and dtype("float32").storage_shape((4, 6)) == (4, 6)

"""Our torch Qwen3 against transformers' Qwen3ForCausalLM (eager attention), fp32."""

from __future__ import annotations

import pytest
import torch

from refusion.export.checkpoint import Checkpoint
from refusion.export.model import Qwen3
from tests.helpers import SPECS

transformers = pytest.importorskip("transformers")
TOL = 1e-4


@pytest.fixture(scope="module")
def models(store):
    cache = {}

    def get(name: str):
        if name not in cache:
            path = store.checkpoint(name)
            ours = Qwen3.from_checkpoint(Checkpoint.open(path))
            hf = transformers.Qwen3ForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
            cache[name] = ours, hf.eval()
        return cache[name]

    return get


def _no_past(model: Qwen3, batch: int):
    d = model.dims
    empty = torch.zeros(batch, 0, d.kv_heads, d.head_dim)
    return [(empty, empty)] * d.num_layers


def _causal(batch: int, seq: int, past: int = 0) -> torch.Tensor:
    mask = torch.cat([torch.ones(seq, past, dtype=torch.bool), torch.ones(seq, seq, dtype=torch.bool).tril()], dim=1)
    return mask.expand(batch, seq, past + seq)


def _ids(batch: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("name", list(SPECS))
def test_causal_logits_match_hf(models, name):
    ours, hf = models(name)
    ids = _ids(2, 9, ours.dims.vocab_size)
    pos = torch.arange(9).expand(2, 9)
    got = ours(ids, pos, _causal(2, 9), _no_past(ours, 2))
    with torch.no_grad():
        want = hf(input_ids=ids, position_ids=pos).logits
    assert _max_diff(got["logits"], want) <= TOL
    assert torch.equal(got["argmax_ids"], want.argmax(-1))


@pytest.mark.parametrize("name", ["gqa1", "gqa4", "head_dim", "tied"])
def test_past_kv_matches_hf(models, name):
    """prefix forward -> its present KV fed as past to the suffix == one HF forward over both."""
    ours, hf = models(name)
    prefix, suffix = 5, 4
    ids = _ids(1, prefix + suffix, ours.dims.vocab_size, seed=1)
    pos = torch.arange(prefix + suffix)[None]
    first = ours(ids[:, :prefix], pos[:, :prefix], _causal(1, prefix), _no_past(ours, 1))
    past = [(first[f"present.{i}.key"], first[f"present.{i}.value"]) for i in range(ours.dims.num_layers)]
    second = ours(ids[:, prefix:], pos[:, prefix:], _causal(1, suffix, past=prefix), past)
    with torch.no_grad():
        out = hf(input_ids=ids, position_ids=pos, use_cache=True)
    assert _max_diff(first["logits"], out.logits[:, :prefix]) <= TOL
    assert _max_diff(second["logits"], out.logits[:, prefix:]) <= TOL
    # Present KV is HF's cache in sequence-major layout: [b, seq, kv, d] vs HF's [b, kv, seq, d].
    for i, layer in enumerate(out.past_key_values.layers):
        keys = torch.cat([past[i][0], second[f"present.{i}.key"]], dim=1)
        values = torch.cat([past[i][1], second[f"present.{i}.value"]], dim=1)
        assert _max_diff(keys, layer.keys.transpose(1, 2)) <= TOL
        assert _max_diff(values, layer.values.transpose(1, 2)) <= TOL


@pytest.mark.parametrize("name", ["gqa2", "gqa4"])
def test_slot_mask_matches_hf_4d_mask(models, name):
    """Non-causal: two bidirectional slots over one causal prefix, at the same positions."""
    ours, hf = models(name)
    p, a, b = 3, 3, 2  # prefix, slot A, slot B
    seq = p + a + b
    mask = torch.zeros(seq, seq, dtype=torch.bool)
    mask[:p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
    mask[p:, :p] = True
    mask[p : p + a, p : p + a] = True
    mask[p + a :, p + a :] = True
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 3, 4]])
    ids = _ids(1, seq, ours.dims.vocab_size, seed=2)
    got = ours(ids, pos, mask[None], _no_past(ours, 1))
    additive = torch.where(mask, 0.0, torch.finfo(torch.float32).min)[None, None]
    with torch.no_grad():
        want = hf(input_ids=ids, position_ids=pos, attention_mask=additive).logits
        causal = hf(input_ids=ids, position_ids=pos).logits
    assert _max_diff(got["logits"], want) <= TOL
    assert _max_diff(got["logits"][:, p:], causal[:, p:]) > 10 * TOL  # the mask really mattered


def test_fp32_arithmetic_on_fp16_weights_is_the_upcast_model(store, monkeypatch):
    """forward(dtype=float32) on fp16 weights and past (validation's exact reference for fp16 exports) computes what
    the model cast to fp32 does, its linears' weights cast a slice of rows at a time (here 64 elements: many slices),
    and its fp16 forward is unchanged."""
    from refusion.export import model

    ckpt = Checkpoint.open(store.checkpoint("gqa2"))
    half = Qwen3.from_checkpoint(ckpt, torch.float16)
    full = Qwen3.from_checkpoint(ckpt, torch.float16).float()
    d = half.dims
    past = [(torch.randn(2, 3, d.kv_heads, d.head_dim, generator=torch.Generator().manual_seed(i)).half(),) * 2
            for i in range(d.num_layers)]
    ids, pos, mask = _ids(2, 5, d.vocab_size), torch.arange(3, 8).expand(2, 5), _causal(2, 5, past=3)
    want = full(ids, pos, mask, [(k.float(), v.float()) for k, v in past])
    monkeypatch.setattr(model, "UPCAST_ELEMENTS", 64)
    got = half(ids, pos, mask, past, dtype=torch.float32)
    assert got["logits"].dtype == got["present.0.key"].dtype == torch.float32
    assert max(_max_diff(got[k], want[k]) for k in want if got[k].is_floating_point()) <= 1e-5
    assert torch.equal(got["top_ids"], want["top_ids"])
    assert half(ids, pos, mask, past)["present.0.key"].dtype == torch.float16

"""Tiny random Qwen3 checkpoints for tests that need a real network but no weights.

A freshly initialised transformer (``initializer_range`` 0.02) is useless for
exercising ReFusion's control flow: its next-token distribution is nearly
uniform over the vocabulary (top probability ~1/vocab), so no slot ever passes
``slot_threshold`` and no drafted token ever passes ``token_threshold``; every
run would take the same "fallback + infill" path.

``make_peaky_model`` makes the predictions confident ("peaky") by scaling two
weight matrices after the ordinary random init:

* ``lm_head`` by ``head_scale``: the final RMSNorm pins the hidden state to a
  fixed norm, so the logits' spread is proportional to the lm_head weights.
  With hidden 64 and std 0.02 the logits have std ~0.16 (uniform softmax);
  ``head_scale`` ~ 40-60 gives std ~6-10, i.e. top probabilities spread over
  the whole (0, 1] range, which is what makes every threshold comparison
  reachable in both directions.
* the token embedding by ``embed_scale``: the embedding is the residual
  stream's starting point, and the attention / MLP outputs are added to it. A
  large embedding makes every prediction a function of the current token alone
  (a run of masks then drafts one constant token); a small one (default 0.25)
  lets the context and the position (RoPE) move the predictions, so different
  slots draft different tokens with different confidences.

What that means for ReFusion's thresholds (measured, defaults below): the
planner's first-token confidences spread over ~0.3-1.0, so slot_threshold
0.5 picks several slots and 0.8 usually none (fallback). The mask reading
tends to draft runs of one token, which the AR reading rarely predicts, so
drafted tokens are accepted only with a tiny token_threshold (0.0: all
accepted -> whole slots committed from verification; >= 0.02: mostly
rejected -> the infill loop). Using a frequently drafted token as EOS
(``frequent_tokens``) makes the EOS branches reachable.

The mapping "which settings reach which ReFusion branch" is measured in
tests/tools/bench/test_reference.py (``BRANCH_GRID``) and summarised there.
All models use eager attention in fp32, so CPU results are deterministic.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import transformers

# Defaults shared by every tiny test model (see the module docstring).
TINY_DIMS = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)

# The mask token of the tiny models: the last id, as in ReFusion (151670 is the
# last id of its 151671-token vocabulary).
TINY_MASK_ID = TINY_DIMS["vocab_size"] - 1


def tiny_config(**dims) -> transformers.Qwen3Config:
    """A Qwen3Config with the tiny defaults, RoPE theta 1e6, untied lm_head."""
    kw: dict[str, Any] = dict(TINY_DIMS)
    kw.update(dims)
    kw.update(
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=False,
        attn_implementation="eager",  # deterministic, and exact same math as the mask replay in tests
    )
    return transformers.Qwen3Config(**kw)


def make_peaky_model(
    seed: int,
    *,
    head_scale: float = 48.0,
    embed_scale: float = 0.25,
    **dims,
) -> transformers.Qwen3ForCausalLM:
    """Random tiny Qwen3ForCausalLM (fp32, eval, eager attention) with confident predictions.

    ``seed`` fixes the init; ``head_scale`` / ``embed_scale`` multiply the
    lm_head / embedding weights (1.0 gives the plain near-uniform random model);
    ``dims`` override fields of ``TINY_DIMS`` (e.g. ``num_hidden_layers=1``).
    """
    config = tiny_config(**dims)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
        model.model.embed_tokens.weight.mul_(embed_scale)
    return model.float().eval()


@torch.no_grad()
def frequent_tokens(model, prompt_ids: list[int], n_masks: int = 32) -> list[int]:
    """Tokens the planner drafts after ``prompt_ids``, most frequent first.

    Counts the argmax of the mask reading over a run of ``n_masks`` mask tokens
    (ties: first seen first). Tests use these as EOS ids so that EOS actually
    shows up in drafts: rank 0 is drafted almost everywhere (EOS early), later
    ranks less often (EOS later, or only inside the infill loop).
    """
    mask_id = model.config.vocab_size - 1
    ids = torch.tensor([list(prompt_ids) + [mask_id] * n_masks])
    drafted = model(input_ids=ids).logits[0, len(prompt_ids):].argmax(-1).tolist()
    counts = Counter(drafted)
    return sorted(counts, key=lambda t: (-counts[t], drafted.index(t)))

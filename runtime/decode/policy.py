"""Decode policy as pure functions over small numpy arrays (upstream `generate_refusion` semantics).

Tags are 0/1 int arrays: 1 where a token is accepted. Every function is tested without a model.
"""

from __future__ import annotations

import numpy as np


def choose_slots(first_token_probs: np.ndarray, slot_threshold: float) -> tuple[np.ndarray, bool]:
    """Slots whose first-token confidence exceeds the threshold, in position order; else the
    single most confident one. Returns (indices, fell_back)."""
    chosen = np.flatnonzero(first_token_probs > slot_threshold)
    if chosen.size:
        return chosen, False
    return np.array([int(np.argmax(first_token_probs))]), True


def verification_tags(probs: np.ndarray, token_threshold: float) -> tuple[np.ndarray, int]:
    """probs [n, k]: AR probability of each drafted token. The first token of every slot counts
    as accepted. Returns (per-slot accepted-prefix tags [n, k], length of the accepted prefix of
    the whole concatenation)."""
    accepted = probs > token_threshold
    accepted[:, 0] = True
    tags = np.cumprod(accepted, axis=1)
    prefix = int(np.cumprod(accepted.reshape(-1)).sum())
    return tags.astype(np.int64), prefix


def infill_tags(previous: np.ndarray, probs: np.ndarray, token_threshold: float) -> np.ndarray:
    """One infill verify pass over a window: token j is accepted when the token before it was
    accepted before this pass (so every pass gains at least one token), or its probability
    clears the threshold, and everything before it in the row is accepted."""
    accepted = probs > token_threshold
    before = np.concatenate([np.ones((previous.shape[0], 1), dtype=previous.dtype), previous[:, :-1]], axis=1)
    accepted |= before == 1
    return np.cumprod(accepted, axis=1).astype(np.int64)


def advance_window(start: int, tags: np.ndarray) -> int:
    """upstream's `accepted_prefix_len`: advance by the smallest accepted count in the window
    across rows, minus one while any token anywhere is still unaccepted (so the last accepted
    token is re-fed and its logits verify the next)."""
    newly = int(tags[:, start:].sum(axis=1).min())
    if newly <= 0:
        return start
    return start + newly - 1 if (tags == 0).any() else start + newly


def keep_through_first_eos(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """Mask over flattened tokens: everything up to and including the first EOS."""
    is_eos = (tokens == eos_id).astype(np.int64)
    return (np.cumsum(is_eos) - is_eos) == 0


def gumbel_argmax(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> np.ndarray:
    """Gumbel-max sampling from softmax(logits / temperature), in float64 as upstream does;
    written in log space (argmax of logits + T * Gumbel noise) so large logits cannot overflow."""
    u = rng.random(logits.shape)
    return np.argmax(logits.astype(np.float64) - temperature * np.log(-np.log(u)), axis=-1)


def softmax_prob_of(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """softmax(logits)[ids] along the last axis, in fp32."""
    z = logits.astype(np.float32) - logits.max(axis=-1, keepdims=True)
    picked = np.take_along_axis(z, ids[..., None], axis=-1)[..., 0]
    return np.exp(picked) / np.exp(z).sum(axis=-1)

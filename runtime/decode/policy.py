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


def leading_slots(confidence: list[float], slot_size: int, slot_threshold: float) -> int:
    """Tokens of the drafted slots after the frontier a guided forward verifies: the first slot always, then each
    next while its first draft's confidence clears the threshold (the guided loop's slot rule; choose_slots is the
    unguided one, over slots anywhere in the canvas)."""
    chosen = 0
    while chosen < len(confidence) and (chosen == 0 or confidence[chosen] > slot_threshold):
        chosen += slot_size
    return chosen


def accepted_prefix(accepted: np.ndarray) -> int:
    """How many tokens, in order, are accepted before the first that is not (accepted: bool, any shape, read
    flat): a drafted run is taken up to its first rejected token."""
    return int(np.cumprod(accepted.reshape(-1)).sum())


def verification_tags(probs: np.ndarray, token_threshold: float) -> tuple[np.ndarray, int]:
    """probs [n, k]: AR probability of each drafted token. The first token of every slot counts
    as accepted. Returns (per-slot accepted-prefix tags [n, k], length of the accepted prefix of
    the whole concatenation)."""
    accepted = probs > token_threshold
    accepted[:, 0] = True
    tags = np.cumprod(accepted, axis=1)
    return tags.astype(np.int64), accepted_prefix(accepted)


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


def gumbel_argmax(scores: np.ndarray, temperature: float, rng: np.random.Generator) -> np.ndarray:
    """Gumbel-max sampling from softmax(scores / temperature) along the last axis, in float64 as upstream does
    (upstream's `add_gumbel_noise`: argmax of exp(logits) / (-log u)^T), written in log space (argmax of
    scores - T * log(-log u)) so large scores cannot overflow. -inf scores are never drawn."""
    u = rng.random(scores.shape)
    return np.argmax(scores.astype(np.float64) - temperature * np.log(-np.log(u)), axis=-1)


def sample_candidates(ids: np.ndarray, logprobs: np.ndarray, temperature: float, top_k: int, top_p: float,
                      min_p: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One token per row from its K candidates (ids [s, K] and log-probabilities [s, K] under the whole
    vocabulary, most likely first: the graphs' top_ids / top_logprobs). The tempered distribution over the
    candidates is cut as Hugging Face's samplers cut it, in this order: the `top_k` most likely (0: all K), the
    smallest set whose probability reaches `top_p`, those at least `min_p` x the most likely's probability; one
    is drawn by Gumbel-max. Returns the ids and each one's untempered probability (the draft's confidence)."""
    lp = logprobs.astype(np.float64)
    keep = np.ones(lp.shape, dtype=bool)
    if top_k:
        keep[:, top_k:] = False
    tempered = np.where(keep, lp / temperature, -np.inf)
    probs = np.exp(tempered - tempered.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    if top_p < 1.0:
        before = np.cumsum(probs, axis=-1) - probs  # probability of the more likely candidates
        keep[:, 1:] &= before[:, 1:] < top_p  # the most likely always stays (top_p 0: it alone)
    if min_p > 0.0:
        keep &= probs >= min_p * probs[:, :1]
    chosen = gumbel_argmax(np.where(keep, lp, -np.inf), temperature, rng)
    rows = np.arange(len(ids))
    return ids[rows, chosen], np.exp(lp[rows, chosen]).astype(np.float32)


def log_probabilities(probs: np.ndarray) -> list[float]:
    """Each probability's log, in float64 (a probability of 0 in fp32 is -inf)."""
    p = probs.astype(np.float64)
    if p.all():  # the usual case, without np.errstate: it costs more than the log on a 1-token step
        return np.log(p).tolist()
    with np.errstate(divide="ignore"):
        return np.log(p).tolist()


def commit_logprobs(probs: np.ndarray, alternatives: np.ndarray
                    ) -> tuple[tuple[float, ...], tuple[tuple[tuple[int, float], ...], ...]]:
    """What a Commit reports of its tokens: each one's log-probability (probs [n]: a probability of 0 in fp32
    is -inf) and its alternatives (alternatives [n, top, 2] of (id, log-probability); top 0: none asked)."""
    logprobs = tuple(log_probabilities(probs))
    if not alternatives.shape[1]:
        return logprobs, ()
    return logprobs, tuple(tuple((int(i), float(lp)) for i, lp in row) for row in alternatives)

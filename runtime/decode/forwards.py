"""The graph calls a strategy makes, named by what they are for and counted in its trace."""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from refusion.runtime.core.contract import GraphName
from refusion.runtime.decode import masks, policy
from refusion.runtime.decode.kv_cache import KVCache
from refusion.runtime.decode.steps import DecodeTrace, Forward, KVMove, Outputs

if TYPE_CHECKING:
    from refusion.runtime.params import DecodeParams

T = TypeVar("T")
Calls = Generator[Forward | KVMove, Outputs | None, T]  # hands out forwards (and KV moves), returns what they tell
# token ids, the probability of each, and each one's alternatives: [..., top_logprobs, 2] of (id, log-probability)
Drafts = tuple[np.ndarray, np.ndarray, np.ndarray]


class Forwards:
    """The graph calls of the loop, named by what they are for, counted in the trace; each is a
    generator that hands out its Forward and returns what the loop needs from the outputs."""

    def __init__(self, cache: KVCache, trace: DecodeTrace, params: DecodeParams, top_logprobs: int = 0):
        self.cache, self.trace, self.params, self.top_logprobs = cache, trace, params, top_logprobs
        self.slot_size = params.slot_size  # the infill rows' length (ReFusion's loop sets it for a short last slot)
        self.rng = np.random.default_rng(params.seed) if params.temperature > 0 else None

    def run(self, kind: str, graph: GraphName, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray, past: int, *,
            write_at: int | None = None, heads: np.ndarray | None = None,
            vocab_mask: np.ndarray | None = None) -> Calls[Outputs]:
        """One forward; the heads at `heads` (indices into ids; default every position), each over the tokens its
        row of `vocab_mask` ([heads, mask bytes]) allows (None: every token)."""
        self.trace.forwards[kind] += 1
        at = np.arange(len(ids)) if heads is None else heads
        out = yield Forward(ids[None].astype(np.int64, copy=False), pos[None].astype(np.int64, copy=False), mask, past,
                            write_at, at[None].astype(np.int64, copy=False),
                            None if vocab_mask is None else vocab_mask[None], kind=kind, graph=graph)
        assert out is not None  # the driver sends every Forward's outputs back
        return out

    def verified(self, kind: str, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray, past: int,
                 write_at: int) -> Calls[np.ndarray]:
        """An infiller pass whose reading is each token's probability given those before it: token j's is the
        head at j - 1's next-token probability, so the heads run at [0, seq - 1) alone. Token 0 has none in
        this pass; it reads 1.0, as the loop accepts every slot's (and window's) first token whatever it reads."""
        heads = np.arange(max(len(ids) - 1, 1))  # a single token still computes one head, its reading unused
        out = yield from self.run(kind, "infiller", ids, pos, mask, past, write_at=write_at, heads=heads)
        return np.concatenate([np.ones(1, np.float32), out["input_probs"][0][: len(ids) - 1]])

    def draft(self, out: Outputs, sample: bool) -> Drafts:
        """(token ids, softmax probability of each, alternatives) from a forward's heads: the argmax, or with
        temperature > 0 a draw from the top-K candidates the graph emits (policy.sample_candidates)."""
        top = self.top_logprobs  # the graphs' candidates, most likely first, are the alternatives
        ids = out["argmax_ids"][0]
        alternatives = (np.stack([out["top_ids"][0][:, :top], out["top_logprobs"][0][:, :top]], axis=-1) if top
                        else np.zeros((len(ids), 0, 2)))  # none asked, the usual case: no stack
        if sample and self.rng is not None:
            p = self.params
            ids, probs = policy.sample_candidates(out["top_ids"][0], out["top_logprobs"][0], p.temperature, p.top_k,
                                                  p.top_p, p.min_p, self.rng)
            return ids, probs, alternatives
        return ids, out["argmax_probs"][0], alternatives

    def prefill_plan(self, prompt: np.ndarray, masks_ids: np.ndarray, mask_pos: np.ndarray) -> Calls[Drafts]:
        """The first plan: the prompt (past its cached prefix) and the masks in one infiller pass; the prompt's
        KV is kept."""
        c = self.cache.length
        ids = np.concatenate([prompt[c:], masks_ids])
        pos = np.concatenate([np.arange(c, len(prompt)), mask_pos])
        fed = len(prompt) - c  # the prompt's positions read nothing: only the masks' heads run
        out = yield from self.run("prefill_plan", "infiller", ids, pos, masks.causal_after(c, len(ids)), c, write_at=c,
                                  heads=np.arange(fed, len(ids)))
        self.cache.commit(fed)
        return self.draft(out, sample=True)

    def plan(self, masks_ids: np.ndarray, mask_pos: np.ndarray) -> Calls[Drafts]:
        c = self.cache.length
        out = yield from self.run("plan", "planner", masks_ids, mask_pos, masks.causal_after(c, len(masks_ids)), c)
        return self.draft(out, sample=True)

    def verify(self, ids: np.ndarray, pos: np.ndarray) -> Calls[np.ndarray]:
        """Drafted slots after the prefix, causally; their KV lands right after the prefix."""
        c = self.cache.length
        return (yield from self.verified("verify", ids, pos, masks.causal_after(c, len(ids)), c, c))

    def infill_draft(self, rows: np.ndarray, pos: np.ndarray, a: int, scratch_rows: int) -> Calls[Drafts]:
        """Every row's window [a, k) drafted (planner): ids and their probabilities, [n, k - a] each (greedy, as
        upstream's infill), and their alternatives."""
        n, window = rows.shape[0], self.slot_size - a
        mask, past = self._rows_mask(a, scratch_rows, n, window)
        out = yield from self.run("infill_draft", "planner", rows.reshape(-1), pos.reshape(-1), mask, past)
        ids, probs, alternatives = self.draft(out, sample=False)
        return ids.reshape(n, window), probs.reshape(n, window), alternatives.reshape(n, window, self.top_logprobs, 2)

    def infill_verify(self, rows: np.ndarray, pos: np.ndarray, a: int, scratch_rows: int) -> Calls[np.ndarray]:
        """Every row's window [a, k) verified (infiller): each token's AR probability, [n, k - a]."""
        n, window = rows.shape[0], self.slot_size - a
        mask, past = self._rows_mask(a, scratch_rows, n, window)
        # First pass: the windows are whole rows, written in place; later: staged, then moved.
        write_at = self.cache.length if a == 0 else self.cache.staging(scratch_rows, self.slot_size)
        probs = yield from self.verified("infill_verify", rows.reshape(-1), pos.reshape(-1), mask, past, write_at)
        if a:
            yield from self.cache.place_windows(scratch_rows, n, self.slot_size, a, window)
        return probs.reshape(n, window)

    def _rows_mask(self, a: int, scratch_rows: int, n: int, window: int) -> tuple[np.ndarray, int]:
        """The parallel infill mask of n rows' windows over the prefix (and the rows' scratch), and its past."""
        mask = masks.rows_over_prefix(self.cache.length, scratch_rows, self.slot_size, a, n, window)
        return mask, mask.shape[2] - n * window

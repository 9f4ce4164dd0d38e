"""Guided decoding: the answer follows a guide (runtime/structured/), exactly, with ReFusion's drafts where they hold.

The rule: a token is committed only if the guide accepts it given every committed token to its left. So the
answer grows as one run from the frontier (the first position not decided), and every forward is causal over it:

- **forced tokens** (what the guide allows alone: braces, keys, separators, an enum's only completion) are
  committed without a forward, and fed with the next one for their KV;
- each forward (one infiller pass) feeds the tokens committed since the last (P), then, in ReFusion, the drafted
  run to verify (R) and masks after it (M): heads at P's last token and at every token of R read the next token
  over the mask of what the guide allows there (masks along the draft), and M's heads draft what follows;
- R's tokens are accepted from the first while each is the token AR would commit there, the masked argmax of the
  head before it (greedy: the answer is then guided AR's, token for token), or, with `temperature` > 0, while
  their probability under those masks exceeds `token_threshold`; the head after the last accepted one gives the
  next token (its masked argmax, or a draw from its masked candidates), so a forward commits at least one token,
  as AR does, and each accepted draft is one more;
- R is chosen by ReFusion's rule over the drafts of the slots after the frontier (a slot while its first token's
  draft probability exceeds `slot_threshold`, the first always), cut where the guide rejects a draft, its forced
  tokens written in where a draft strays from them.

AR (no drafts) is the same loop with R and M empty: one forward a token, forced tokens free. docs/decoding.md,
"Structured output", has the figures and why the plan / verify / infill passes are fused into one forward here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.decode import masks, policy
from refusion.runtime.decode.forwards import Forwards
from refusion.runtime.decode.kv_cache import KVCache
from refusion.runtime.decode.steps import Commit, DecodeTrace, PrefixKV, StepMachine, Tokens
from refusion.runtime.structured.engine import Ending

if TYPE_CHECKING:
    from refusion.runtime.params import DecodeParams


# The most R and M take, whatever the block: a block is gen_length / serial_num_blocks, so a long canvas in few
# blocks (gen_length 512 in 4: 128) would feed up to 128 masks every guided forward, each costing its arithmetic,
# where the drafts gain nothing past 32 (the families' tokens per forward are the same at 32 and 128,
# docs/decoding.md).
MAX_LOOKAHEAD = 32


def lookahead(params: DecodeParams, most: int | None = None) -> int:
    """The most tokens a guided forward verifies and drafts (R and M) after those it must feed (P): a ReFusion
    block, within `most` (the runner's Tokens.lookahead; None: MAX_LOOKAHEAD) and at least two slots (one drafted,
    one of masks); an AR request whose canvas cuts into no blocks, a slot."""
    try:
        return min(params.block_length, max(MAX_LOOKAHEAD if most is None else most, 2 * params.slot_size))
    except RefusionError:
        return params.slot_size


def guided_steps(tokens: Tokens, params: DecodeParams, trace: DecodeTrace, positions: int, capacity: int,
                 drafting: bool) -> StepMachine:
    """The guided loop over `positions` after the prompt (in a KV region of `capacity` tokens); `drafting`:
    ReFusion's drafts and their verification, else AR's one token a forward. At its end the answer's KV, causal
    like the prompt's, is offered to the prefix cache (a conversation's next turn reuses it)."""
    loop = _Loop(tokens, params, trace, positions, capacity, drafting)
    yield from loop.run()
    yield PrefixKV(tuple(loop.sequence[: loop.cache.length]))


class _Loop:
    def __init__(self, tokens: Tokens, params: DecodeParams, trace: DecodeTrace, positions: int, capacity: int,
                 drafting: bool):
        assert tokens.guide is not None, "a guided request brings its compiled guide"
        self.tokens, self.params, self.trace, self.drafting = tokens, params, trace, drafting
        self.guide, self.matcher = tokens.guide, Ending(tokens.guide.matcher(), tokens.eos_id)
        self.p0 = len(tokens.prompt)
        self.end = self.p0 + positions  # no position at or past it is fed
        self.cap = self.p0 + (params.max_tokens if params.max_tokens is not None else positions)  # nor committed
        self.cache = KVCache(capacity, tokens.cached)
        self.fwd = Forwards(self.cache, trace, params, tokens.top_logprobs)
        self.sequence = list(tokens.prompt)  # the prompt and the answer so far, in position order: causal
        self.steps = 0

    def commit(self, ids: list[int], logprobs: list[float], alternatives: list[tuple[tuple[int, float], ...]],
               how: str) -> Iterator[Commit]:
        """Tokens the guide accepts become the answer's next (none at or past the cap)."""
        room = self.cap - len(self.sequence)
        ids, logprobs, alternatives = ids[:room], logprobs[:room], alternatives[:room]
        if ids:
            self.steps += 1
            self.matcher.consume(ids)
            at = len(self.sequence)
            self.sequence.extend(ids)
            yield Commit(self.steps, tuple(ids), tuple(range(at, at + len(ids))), how, tuple(logprobs),
                         tuple(alternatives) if self.tokens.top_logprobs else ())

    def forced(self, ids: list[int]) -> Iterator[Commit]:
        """Tokens the guide allows alone: probability 1 under it, their own only alternative; no forward."""
        self.trace.branches["forced_tokens"] += len(ids)
        yield from self.commit(ids, [0.0] * len(ids), [((t, 0.0),) for t in ids], "forced")

    def run(self) -> StepMachine:
        tokens, params, trace, matcher, cache = self.tokens, self.params, self.trace, self.matcher, self.cache
        eos, k, ahead, width = tokens.eos_id, params.slot_size, lookahead(params, tokens.lookahead), self.guide.width
        greedy = self.fwd.rng is None  # as fwd.draft reads it: no draws, the masked argmax
        drafts: list[int] = []  # drafted tokens for the positions after the answer, and their draft probabilities
        confidence: list[float] = []
        first, counted = True, len(self.sequence)
        while len(self.sequence) < self.cap:  # else max_tokens or the canvas end it: finish_reason "length"
            if matcher.finished:  # the structure is complete: the answer ends here
                yield from self.forced([eos])
                return
            run = matcher.forced()
            if run:
                yield from self.forced(run)
                drafts, confidence = drafts[len(run):], confidence[len(run):]
                if matcher.ended:
                    return
                continue  # the guide may be complete now
            pending = self.sequence[cache.length:]  # committed since the last forward, their KV not yet computed
            prompt = max(0, self.p0 - cache.length)  # the first forward feeds the prompt too
            bound = tokens.feed_bound if tokens.feed_bound is not None else len(pending) - prompt + ahead
            if len(pending) - prompt > bound:  # more forced tokens than a forward feeds whole: their KV first, a
                c, n = cache.length, min(bound + prompt, len(pending) - 1)  # chunk at a time, the last left to read
                yield from self.fwd.run("guided_kv", "infiller", np.array(pending[:n]), np.arange(c, c + n),  # at
                                        masks.causal_after(c, n), c, write_at=c, heads=np.array([n - 1]))
                cache.commit(n)
                continue
            room = min(ahead, bound + prompt - len(pending))  # R and M: a lookahead, within the bound
            run = _verifiable(matcher, drafts, confidence, min(room - k, self.cap - len(self.sequence)), k,
                              params.slot_threshold) if self.drafting else []
            along = np.empty((len(run) + 1, width), np.uint8)
            matcher.allowed_along(run, along)
            dead = next((j for j in range(1, len(run) + 1) if not along[j].any()), 0)
            while dead:  # a draft the guide accepts, after which it allows nothing: verify those before it, and
                along[dead - 1][run[dead - 1] // 8] &= ~np.uint8(1 << run[dead - 1] % 8)  # where its last token is
                run, along = run[: dead - 1], along[:dead]  # read, not that token
                dead = dead - 1 if dead > 1 and not along[dead - 1].any() else 0
            if not along[0].any():  # neither a token nor the end may follow: the answer is cut here, not ended
                trace.dead_end = "the guide allows no token here and the answer is not complete"
                return
            frontier, p, r = len(self.sequence), len(pending), len(run)
            # masks after R to draft what follows; none after a drafted EOS (nothing follows it)
            window = max(0, min(room - r, self.end - frontier - r)) if self.drafting and run[-1:] != [eos] else 0
            ids = np.array([*pending, *run, *[tokens.mask_id] * window], np.int64)
            c = cache.length
            heads = np.arange(p - 1, len(ids))  # P's last, R's (each reads the next token), M's (drafts)
            vocab_mask = np.full((len(heads), width), 255, np.uint8)
            vocab_mask[: r + 1] = along  # the guide's masks where the next token is read; M's drafts are free
            out = yield from self.fwd.run("guided_prefill" if first else "guided", "infiller", ids,
                                          np.arange(c, c + len(ids)), masks.causal_after(c, len(ids)), c, write_at=c,
                                          heads=heads, vocab_mask=vocab_mask)
            cache.commit(p)
            if first:
                yield PrefixKV(tuple(tokens.prompt))  # the prompt's KV is a causal prefill's
                first = False
            # R's tokens under the masks along it (a prefill cut into chunks returns no input_probs: it has no R)
            probs = out["input_probs"][0][:r] if r else np.zeros(0, np.float32)
            # none is taken for granted: greedy, a draft stands where AR's pick is the same token (a drafted token
            # of probability 0.1 that is not the argmax would make the answer another than guided AR's)
            agrees = np.asarray(run) == out["argmax_ids"][0][:r] if greedy else probs > params.token_threshold
            accepted = policy.accepted_prefix(agrees)
            trace.branches["drafts_verified"] += r
            trace.branches["drafts_accepted"] += accepted
            # every head's draft: the masked argmax (or a draw from the masked candidates) where R reads the next
            # token, the mask reading's draft over M
            picked, picked_probs, alternatives = self.fwd.draft(out, sample=True)
            others = [tuple((int(i), float(lp)) for i, lp in row) for row in alternatives[: accepted + 1]]
            lps = policy.log_probabilities(np.concatenate([probs[:accepted], picked_probs[accepted : accepted + 1]]))
            before = len(self.sequence)
            yield from self.commit(run[:accepted], lps[:accepted], others[:accepted], "draft")
            cache.commit(len(self.sequence) - before)  # R's accepted tokens' KV is in place
            if matcher.ended:  # R's drafted EOS accepted
                return
            nxt = int(picked[accepted])
            yield from self.commit([nxt], lps[accepted:], others[accepted:], "next")
            trace.tpf_sum += len(self.sequence) - counted
            trace.iterations += 1
            counted = len(self.sequence)
            if matcher.ended:
                return
            # drafts for the positions after the next token: R's after it, then M's (the next is M's first's)
            leftover = slice(accepted + 1, r)
            masks_from = r + 2 if accepted == r else r + 1
            drafts = [*run[leftover], *(int(t) for t in picked[masks_from:])]
            confidence = [*confidence[leftover], *(float(x) for x in picked_probs[masks_from:])]


def _verifiable(matcher: Ending, drafts: list[int], confidence: list[float], most: int, k: int,
                threshold: float) -> list[int]:
    """The drafted run to verify: the slots after the frontier while a slot's first draft clears `threshold` (the
    first always), at most `most` tokens, cut at the first draft the guide rejects, its forced tokens written in
    where a draft strays from them. The matcher is left where it was."""
    candidates = drafts[: max(0, min(policy.leading_slots(confidence, k, threshold), most))]
    run: list[int] = []
    while len(run) < len(candidates):
        taken = candidates[len(run): len(run) + matcher.valid(candidates[len(run):])]
        matcher.consume(taken)  # an EOS among them ends the run: nothing after it is valid or forced
        run += taken
        fill = matcher.forced()[: len(candidates) - len(run)]
        if len(run) == len(candidates) or not fill:
            break
        matcher.consume(fill)
        run += fill
    matcher.rollback(len(run))
    return run

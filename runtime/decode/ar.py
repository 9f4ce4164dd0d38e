"""Autoregressive decoding on the infiller, as a step machine: the baseline ReFusion is measured against."""

from __future__ import annotations

import numpy as np

from refusion.runtime.decode import masks, policy
from refusion.runtime.decode.forwards import Forwards
from refusion.runtime.decode.kv_cache import KVCache
from refusion.runtime.decode.steps import Commit, DecodeTrace, PrefixKV, StepMachine, Tokens
from refusion.runtime.params import DecodeParams, SizedParams


def kv_capacity(prompt_length: int, params: DecodeParams) -> int:
    """KV tokens a request needs: the prompt and every generated token."""
    return prompt_length + positions(params)


def positions(params: DecodeParams) -> int:
    """Tokens it generates at most: max_tokens when given, else gen_length (unpadded: AR has no slots), or a
    canvas cut to what the context leaves (SizedParams)."""
    if isinstance(params, SizedParams):
        return params.canvas
    return params.max_tokens if params.max_tokens is not None else params.gen_length


def profile_needs(params: DecodeParams) -> tuple[int, int, int]:
    """One token a forward: to the engines' limits, that many blocks of one token."""
    return positions(params), 1, positions(params)


def ar_steps(tokens: Tokens, params: DecodeParams, trace: DecodeTrace) -> StepMachine:
    """Greedy (or sampled) autoregressive decoding on the infiller: the baseline."""
    prompt = np.asarray(tokens.prompt, dtype=np.int64)
    p0, gen_len = len(prompt), positions(params)
    cache = KVCache(kv_capacity(p0, params), tokens.cached)
    fwd = Forwards(cache, trace, params, tokens.top_logprobs)
    ids, pos, kind = prompt[tokens.cached:], np.arange(tokens.cached, p0), "prefill"
    answer: list[int] = []
    for step in range(1, gen_len + 1):
        c = cache.length
        # the next token is read at the last position alone: a prefill runs one vocabulary head
        out = yield from fwd.run(kind, "infiller", ids, pos, masks.causal_after(c, len(ids)), c, write_at=c,
                                 heads=np.array([len(ids) - 1]))
        cache.commit(len(ids))
        if step == 1:
            yield PrefixKV(tuple(tokens.prompt))
        token, prob, alternatives = fwd.draft(out, sample=True)
        ids, pos, kind = token.astype(np.int64), np.array([p0 + step - 1]), "decode"
        answer.append(int(token[0]))
        trace.tpf_sum += 1.0
        trace.iterations += 1
        yield Commit(step, (int(token[0]),), (p0 + step - 1,), "ar", *policy.commit_logprobs(prob, alternatives))
        if int(token[0]) == tokens.eos_id:
            break
    # Fed one at a time, each over all before it: the answer's KV is causal too, so a conversation's next turn
    # (this prompt and answer, then more) reuses it.
    yield PrefixKV((*tokens.prompt, *answer[:-1]))  # the last token is never fed

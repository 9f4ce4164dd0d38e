"""ReFusion's plan / verify / infill / commit loop as a step machine: upstream `generate_refusion`
exactly, in the order docs/decoding.md describes it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from refusion.runtime.decode import policy
from refusion.runtime.decode.forwards import Forwards
from refusion.runtime.decode.kv_cache import KVCache
from refusion.runtime.decode.steps import Commit, DecodeTrace, PrefixKV, StepMachine, Tokens

if TYPE_CHECKING:
    from refusion.runtime.params import DecodeParams


def block_lengths(params: DecodeParams) -> list[int]:
    """The blocks decoded in turn. Upstream's layout: serial_num_blocks equal blocks of the padded gen_length.
    With max_tokens, blocks of that same length until they cover max_tokens in whole slots, the last one cut
    to the slots it needs: the answer is cut at max_tokens, so fewer than slot_size positions are decoded past it."""
    block = params.block_length
    if params.max_tokens is None:
        return [block] * params.serial_num_blocks
    k = params.slot_size
    canvas = -(-params.max_tokens // k) * k
    return [block] * (canvas // block) + ([canvas % block] if canvas % block else [])


def kv_capacity(prompt_length: int, params: DecodeParams) -> int:
    """KV tokens a request needs: prompt and generation, plus one block of infill scratch."""
    blocks = block_lengths(params)
    return prompt_length + sum(blocks) + max(blocks)


def positions(params: DecodeParams) -> int:
    """Positions the generation takes after the prompt: its blocks, in whole slots, as upstream pads gen_length."""
    return sum(block_lengths(params))


def profile_needs(params: DecodeParams) -> tuple[int, int, int]:
    """(gen_length, slot size, serial blocks) the engines' limits must hold: whole blocks of the longest."""
    blocks = block_lengths(params)
    return len(blocks) * max(blocks), params.slot_size, len(blocks)


def check(params: DecodeParams) -> None:
    """The generation must cut into serial_num_blocks blocks of whole slots."""
    _ = params.block_length  # raises, naming the block counts that fit


def refusion_steps(tokens: Tokens, params: DecodeParams, trace: DecodeTrace) -> StepMachine:
    """upstream `generate_refusion` (default mode), as a step machine."""
    k, thr_slot, thr_tok = params.slot_size, params.slot_threshold, params.token_threshold
    prompt = np.asarray(tokens.prompt, dtype=np.int64)
    p0, blocks = len(prompt), block_lengths(params)
    cap = p0 + (params.max_tokens if params.max_tokens is not None else sum(blocks))  # no token at or past it is returned
    cache = KVCache(kv_capacity(p0, params), tokens.cached)
    fwd = Forwards(cache, trace, params)
    step = 0
    eos_seen, planned = False, False

    def commit(ids: np.ndarray, pos: np.ndarray, probs: np.ndarray, how: str) -> Iterator[Commit]:
        nonlocal step
        step += 1
        kept = pos < cap
        if kept.any():
            with np.errstate(divide="ignore"):  # a probability of 0 in fp32 is a log-probability of -inf
                logprobs = tuple(float(x) for x in np.log(probs[kept]))
            yield Commit(step, tuple(int(t) for t in ids[kept]), tuple(int(p) for p in pos[kept]), how, logprobs)

    for block, block_len in enumerate(blocks):
        start = p0 + sum(blocks[:block])
        remaining = [start + j * k for j in range(block_len // k)]  # R: slot start positions, in order
        while remaining:
            slot_pos = np.add.outer(np.array(remaining, dtype=np.int64), np.arange(k))
            mask_ids = np.full(slot_pos.size, tokens.mask_id, dtype=np.int64)
            # 1. Plan
            if not planned:
                draft, probs = yield from fwd.prefill_plan(prompt, mask_ids, slot_pos.reshape(-1))
                planned = True
                yield PrefixKV(tuple(tokens.prompt))  # the prompt's KV is causal; the answer's (commit order) is not
            else:
                draft, probs = yield from fwd.plan(mask_ids, slot_pos.reshape(-1))
            draft, probs = draft.reshape(-1, k), probs.reshape(-1, k)
            chosen, fell_back = policy.choose_slots(probs[:, 0], thr_slot)
            if fell_back:
                trace.branches["fallback_single_slot"] += 1
            rows, row_pos, row_probs = draft[chosen].copy(), slot_pos[chosen], probs[chosen].copy()
            n = len(chosen)
            # 2. Global verification
            ar_probs = (yield from fwd.verify(rows.reshape(-1), row_pos.reshape(-1))).reshape(n, k)
            tags, prefix = policy.verification_tags(ar_probs, thr_tok)
            flat = rows.reshape(-1)
            eos_at = np.flatnonzero(flat[:prefix] == tokens.eos_id)
            if eos_at.size or prefix >= k:
                if eos_at.size:
                    count, slots = int(eos_at[0]) + 1, int(eos_at[0]) // k + 1
                    drop = set(range(int(chosen[slots - 1]), len(remaining)))
                    eos_seen = True
                    trace.branches["eos_in_verification"] += 1
                else:
                    slots = prefix // k
                    count, drop = slots * k, set()
                    trace.branches["commit_from_verification"] += 1
                cache.commit(count)  # their KV from this pass is already in place
                drop |= {int(c) for c in chosen[:slots]}
                remaining = [s for j, s in enumerate(remaining) if j not in drop]
                trace.tpf_sum += k * slots / 2
                trace.iterations += 1
                yield from commit(flat[:count], row_pos.reshape(-1)[:count], row_probs.reshape(-1)[:count],
                                  "verification")
                continue
            # 3. Parallel infill
            trace.branches["infill_loop"] += 1
            drop = {int(c) for c in chosen}
            a, eos_row, loop_iter = 0, None, 0
            for loop_iter in range(k):
                if tags.all():
                    break
                window = np.where(tags[:, a:] == 1, rows[:, a:], tokens.mask_id)
                proposed, proposed_probs = yield from fwd.infill_draft(window, row_pos[:, a:], a, n)
                rows[:, a:] = np.where(tags[:, a:] == 1, rows[:, a:], proposed)
                row_probs[:, a:] = np.where(tags[:, a:] == 1, row_probs[:, a:], proposed_probs)
                ar_probs = yield from fwd.infill_verify(rows[:, a:], row_pos[:, a:], a, n)
                tags[:, a:] = policy.infill_tags(tags[:, a:], ar_probs, thr_tok)
                eos_rows = np.flatnonzero(((rows[:, a:] == tokens.eos_id) & (tags[:, a:] == 1)).any(axis=1))
                if eos_rows.size:
                    eos_row = int(eos_rows[0])
                    rows, tags, row_pos = rows[: eos_row + 1], tags[: eos_row + 1], row_pos[: eos_row + 1]
                    row_probs = row_probs[: eos_row + 1]
                    tags[eos_row] = 1
                a = policy.advance_window(a, tags)
            trace.tpf_sum += k * n / (loop_iter * 2 + 2)
            trace.iterations += 1
            keep = policy.keep_through_first_eos(rows.reshape(-1), tokens.eos_id)
            count = int(keep.sum())  # a prefix of the row-major scratch: already contiguous
            cache.commit(count)
            if eos_row is not None:
                # upstream quirk: it drops R from index `eos_row`, a row index into the chosen
                # slots, not the R index of that slot; reproduced for token identity.
                drop |= set(range(eos_row, len(remaining)))
                eos_seen = True
                trace.branches["eos_in_infill"] += 1
            remaining = [s for j, s in enumerate(remaining) if j not in drop]
            yield from commit(rows.reshape(-1)[:count], row_pos.reshape(-1)[:count], row_probs.reshape(-1)[:count],
                              "infill")
        if eos_seen:
            break

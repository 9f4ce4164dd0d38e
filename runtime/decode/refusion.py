"""ReFusion's plan / verify / infill / commit loop as a step machine: upstream `generate_refusion`
exactly, in the order docs/decoding.md describes it, but for the slots dropped after an EOS found in infill:
upstream's drop leaves holes in the answer, ours only with `upstream_eos_drop`."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from refusion.runtime.decode import policy
from refusion.runtime.decode.forwards import Forwards
from refusion.runtime.decode.kv_cache import KVCache
from refusion.runtime.decode.steps import Commit, DecodeTrace, PrefixKV, StepMachine, Tokens
from refusion.runtime.params import DecodeParams, SizedParams


def block_count(params: DecodeParams) -> int:
    """Blocks decoded in turn, each `params.block_length` long: upstream's serial_num_blocks; with max_tokens, as
    many as cover it. Whole blocks either way, so a cap only cuts the answer: the plan chooses among the same
    slots as without it, and the tokens before the cap are the uncapped answer's. A canvas cut to what the
    context leaves (SizedParams) counts its last block, cut, as one."""
    if isinstance(params, SizedParams):
        return -(-params.canvas // params.block_length)
    if params.max_tokens is None:
        return params.serial_num_blocks
    return -(-params.max_tokens // params.block_length)


def positions(params: DecodeParams) -> int:
    """Positions the generation takes after the prompt: its blocks (upstream pads gen_length to whole slots), or
    a canvas cut to what the context leaves."""
    return params.canvas if isinstance(params, SizedParams) else block_count(params) * params.block_length


def layout(params: DecodeParams) -> list[tuple[int, int, int]]:
    """The blocks decoded in turn, as (offset after the prompt, length, slot size): `block_count` blocks of
    `block_length` in slots of `slot_size`. A canvas cut to what the context leaves ends with its last block cut
    there: the whole slots that fit, then, where the room ends inside a slot, that slot cut, decoded after them
    as a block of its own (one slot of the tokens left)."""
    b, k, end = params.block_length, params.slot_size, positions(params)
    blocks = [(start, min(b, end - start), k) for start in range(0, end, b)]
    start, length, _ = blocks[-1]
    if length % k:
        blocks[-1:] = [(start, length - length % k, k)] if length >= k else []
        blocks.append((start + length - length % k, length % k, length % k))
    return blocks


def kv_capacity(prompt_length: int, params: DecodeParams) -> int:
    """KV tokens a request needs: prompt and generation, plus one block of infill scratch."""
    return prompt_length + positions(params) + params.block_length


def profile_needs(params: DecodeParams) -> tuple[int, int, int]:
    """(gen_length, slot size, serial blocks) the engines' limits must hold: whole blocks (a cut canvas's last
    block is no longer than a whole one)."""
    return block_count(params) * params.block_length, params.slot_size, block_count(params)


def refusion_steps(tokens: Tokens, params: DecodeParams, trace: DecodeTrace) -> StepMachine:
    """upstream `generate_refusion` (default mode), as a step machine; its EOS drop only with
    `params.upstream_eos_drop` (docs/decoding.md)."""
    thr_slot, thr_tok = params.slot_threshold, params.token_threshold
    prompt = np.asarray(tokens.prompt, dtype=np.int64)
    p0 = len(prompt)
    answer = params.max_tokens if params.max_tokens is not None else positions(params)
    cap, unsettled = p0 + answer, answer  # no token at or past the cap is returned; once all before it are, it ends
    cache = KVCache(kv_capacity(p0, params), tokens.cached)
    fwd = Forwards(cache, trace, params, tokens.top_logprobs)
    step = 0
    eos_seen, planned = False, False

    def commit(ids: np.ndarray, pos: np.ndarray, probs: np.ndarray, alternatives: np.ndarray,
               how: str) -> Iterator[Commit]:
        nonlocal step, unsettled
        step += 1
        kept = pos < cap
        if kept.any():
            unsettled -= int(kept.sum())
            yield Commit(step, tuple(int(t) for t in ids[kept]), tuple(int(p) for p in pos[kept]), how,
                         *policy.commit_logprobs(probs[kept], alternatives[kept]))

    for offset, block_len, k in layout(params):
        start = p0 + offset
        fwd.slot_size = k  # the slot size, but in the short slot a canvas cut inside a slot ends with
        remaining = [start + j * k for j in range(block_len // k)]  # R: slot start positions, in order
        while remaining:
            slot_pos = np.add.outer(np.array(remaining, dtype=np.int64), np.arange(k))
            mask_ids = np.full(slot_pos.size, tokens.mask_id, dtype=np.int64)
            # 1. Plan
            if not planned:
                draft, probs, alts = yield from fwd.prefill_plan(prompt, mask_ids, slot_pos.reshape(-1))
                planned = True
                yield PrefixKV(tuple(tokens.prompt))  # the prompt's KV is causal; the answer's (commit order) is not
            else:
                draft, probs, alts = yield from fwd.plan(mask_ids, slot_pos.reshape(-1))
            draft, probs = draft.reshape(-1, k), probs.reshape(-1, k)
            alts = alts.reshape(*draft.shape, *alts.shape[1:])
            chosen, fell_back = policy.choose_slots(probs[:, 0], thr_slot)
            if fell_back:
                trace.branches["fallback_single_slot"] += 1
            rows, row_pos, row_probs = draft[chosen].copy(), slot_pos[chosen], probs[chosen].copy()
            row_alts = alts[chosen].copy()
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
                                  row_alts.reshape(rows.size, *row_alts.shape[2:])[:count], "verification")
                if not unsettled:
                    return
                continue
            # 3. Parallel infill
            trace.branches["infill_loop"] += 1
            drop = {int(c) for c in chosen}
            a, eos_row, loop_iter = 0, None, 0
            for loop_iter in range(k):
                if tags.all():
                    break
                window = np.where(tags[:, a:] == 1, rows[:, a:], tokens.mask_id)
                proposed, proposed_probs, proposed_alts = yield from fwd.infill_draft(window, row_pos[:, a:], a, n)
                rows[:, a:] = np.where(tags[:, a:] == 1, rows[:, a:], proposed)
                row_probs[:, a:] = np.where(tags[:, a:] == 1, row_probs[:, a:], proposed_probs)
                row_alts[:, a:] = np.where(tags[:, a:, None, None] == 1, row_alts[:, a:], proposed_alts)
                ar_probs = yield from fwd.infill_verify(rows[:, a:], row_pos[:, a:], a, n)
                tags[:, a:] = policy.infill_tags(tags[:, a:], ar_probs, thr_tok)
                eos_rows = np.flatnonzero(((rows[:, a:] == tokens.eos_id) & (tags[:, a:] == 1)).any(axis=1))
                if eos_rows.size:
                    eos_row = int(eos_rows[0])
                    rows, tags, row_pos = rows[: eos_row + 1], tags[: eos_row + 1], row_pos[: eos_row + 1]
                    row_probs, row_alts = row_probs[: eos_row + 1], row_alts[: eos_row + 1]
                    tags[eos_row] = 1
                a = policy.advance_window(a, tags)
            trace.tpf_sum += k * n / (loop_iter * 2 + 2)
            trace.iterations += 1
            keep = policy.keep_through_first_eos(rows.reshape(-1), tokens.eos_id)
            count = int(keep.sum())  # a prefix of the row-major scratch: already contiguous
            cache.commit(count)
            if eos_row is not None:
                if params.upstream_eos_drop:
                    # upstream drops R from index `eos_row`, a row index into the chosen slots, not the R index of
                    # that slot: the slots of R between the two are never decoded, a hole in the answer.
                    drop |= set(range(eos_row, len(remaining)))
                else:  # the slots from the EOS slot on; those before it are still decoded
                    drop |= {j for j, s in enumerate(remaining) if s >= row_pos[eos_row, 0]}
                eos_seen = True
                trace.branches["eos_in_infill"] += 1
            remaining = [s for j, s in enumerate(remaining) if j not in drop]
            yield from commit(rows.reshape(-1)[:count], row_pos.reshape(-1)[:count], row_probs.reshape(-1)[:count],
                              row_alts.reshape(rows.size, *row_alts.shape[2:])[:count], "infill")
            if not unsettled:
                return
        if eos_seen:
            break

"""The decode strategies: ReFusion's plan / verify / infill / commit, and plain autoregressive decoding.

Each is a step machine (runtime/steps.py): a generator that hands out each forward it needs
and takes its outputs back, hands out KV moves, and yields a `Commit` whenever tokens become
final. `run_on` drives one on a Runner directly; the engine (runtime/engine.py) drives many at
once. The loop reads like the algorithm in docs/decoding.md and follows upstream
`generate_refusion` exactly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from refusion.runtime import masks, policy
from refusion.runtime.core.contract import GraphName
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.kv_cache import KVCache
from refusion.runtime.params import DecodeParams
from refusion.runtime.runners.base import Runner
from refusion.runtime.steps import Commit, Forward, KVMove, Outputs, StepMachine


@dataclass
class DecodeTrace:
    """Counters the loop keeps: forwards by kind, upstream's TPF terms, branches taken."""

    forwards: Counter = field(default_factory=Counter)
    branches: Counter = field(default_factory=Counter)
    tpf_sum: float = 0.0
    iterations: int = 0

    @property
    def tpf(self) -> float:
        """upstream's tokens per forward: the mean over iterations of tokens / forwards."""
        return self.tpf_sum / self.iterations if self.iterations else 0.0


@dataclass(frozen=True)
class Tokens:
    prompt: list[int]
    mask_id: int
    eos_id: int


def kv_capacity(prompt_length: int, params: DecodeParams) -> int:
    """KV tokens a request needs: prompt and generation, plus one block of infill scratch."""
    if params.mode == "ar":
        return prompt_length + params.gen_length
    return prompt_length + params.padded_gen_length + params.block_length


def steps_for(tokens: Tokens, params: DecodeParams, trace: DecodeTrace, logits: bool) -> StepMachine:
    """The step machine of params.mode."""
    strategy = refusion_steps if params.mode == "refusion" else ar_steps
    return strategy(tokens, params, trace, logits)


def run_on(runner: Runner, steps: StepMachine, capacity: int, slot: int = 0) -> Iterator[Commit]:
    """Drive one step machine on `runner`'s KV slot `slot`, yielding its commits."""
    runner.allocate_kv(capacity, slot)
    sent: Outputs | None = None
    while True:
        try:
            step = steps.send(sent)
        except StopIteration:
            return
        sent = None
        if isinstance(step, Forward):
            sent = runner.run(step.graph, step.input_ids, step.position_ids, step.attention_mask, step.past,
                              step.write_at, slot)
        elif isinstance(step, KVMove):
            runner.move_kv(step.src, step.dst, step.length, slot)
        else:
            yield step


def refusion_decode(runner: Runner, tokens: Tokens, params: DecodeParams, trace: DecodeTrace,
                    logits: bool) -> Iterator[Commit]:
    """ReFusion on one runner, alone (the parity tests' entry point)."""
    return run_on(runner, refusion_steps(tokens, params, trace, logits), kv_capacity(len(tokens.prompt), params))


def ar_decode(runner: Runner, tokens: Tokens, params: DecodeParams, trace: DecodeTrace,
              logits: bool) -> Iterator[Commit]:
    """Autoregressive decoding on one runner, alone."""
    return run_on(runner, ar_steps(tokens, params, trace, logits), kv_capacity(len(tokens.prompt), params))


class _Forwards:
    """The graph calls of the loop, named by what they are for, counted in the trace; each is a
    generator that hands out its Forward and returns what the loop needs from the outputs."""

    def __init__(self, cache: KVCache, trace: DecodeTrace, params: DecodeParams, logits: bool):
        self.cache, self.trace, self.params = cache, trace, params
        self.sampling = params.temperature > 0
        self.rng = np.random.default_rng(params.seed) if self.sampling else None
        if self.sampling and not logits:
            raise RefusionError(
                f"temperature={params.temperature} needs the graphs' logits output; re-export with "
                "`refusion-export onnx ... --logits`, or use temperature 0."
            )

    def run(self, kind: str, graph: GraphName, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray, past: int,
            write_at: int | None = None) -> Iterator[Forward]:
        self.trace.forwards[kind] += 1
        out = yield Forward(kind, graph, ids[None].astype(np.int64), pos[None].astype(np.int64), mask, past, write_at)
        return out

    def draft(self, out: dict[str, np.ndarray], sample: bool) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, softmax probability of each) from a forward's heads."""
        if sample and self.rng is not None:
            ids = policy.gumbel_argmax(out["logits"][0], self.params.temperature, self.rng)
            return ids, policy.softmax_prob_of(out["logits"][0], ids)
        return out["argmax_ids"][0], out["argmax_probs"][0]

    def prefill_plan(self, prompt: np.ndarray, masks_ids: np.ndarray, mask_pos: np.ndarray):
        """The first plan: prompt and masks in one infiller pass; the prompt's KV is kept."""
        ids = np.concatenate([prompt, masks_ids])
        pos = np.concatenate([np.arange(len(prompt)), mask_pos])
        out = yield from self.run("prefill_plan", "infiller", ids, pos, masks.causal_after(0, len(ids)), 0, 0)
        self.cache.commit(len(prompt))
        return self.draft({k: v[:, len(prompt):] for k, v in out.items()}, sample=True)

    def plan(self, masks_ids: np.ndarray, mask_pos: np.ndarray):
        c = self.cache.length
        out = yield from self.run("plan", "planner", masks_ids, mask_pos, masks.causal_after(c, len(masks_ids)), c)
        return self.draft(out, sample=True)

    def verify(self, ids: np.ndarray, pos: np.ndarray):
        """Drafted slots after the prefix, causally; their KV lands right after the prefix."""
        c = self.cache.length
        out = yield from self.run("verify", "infiller", ids, pos, masks.causal_after(c, len(ids)), c, c)
        return out["input_probs"][0]

    def infill_pass(self, kind: str, rows: np.ndarray, pos: np.ndarray, a: int, scratch_rows: int):
        """One pass over every row's window [a, k): draft (planner) or verify (infiller)."""
        k = self.params.slot_size
        n, window = rows.shape[0], k - a
        mask = masks.rows_over_prefix(self.cache.length, scratch_rows, k, a, n, window)
        past = mask.shape[2] - n * window
        if kind == "infill_draft":
            out = yield from self.run(kind, "planner", rows.reshape(-1), pos.reshape(-1), mask, past)
            return out["argmax_ids"][0].reshape(n, window)
        # First pass: the windows are whole rows, written in place; later: staged, then moved.
        write_at = self.cache.length if a == 0 else self.cache.staging(scratch_rows, k)
        out = yield from self.run(kind, "infiller", rows.reshape(-1), pos.reshape(-1), mask, past, write_at)
        if a:
            yield from self.cache.place_windows(scratch_rows, n, k, a, window)
        return out["input_probs"][0].reshape(n, window)


def refusion_steps(tokens: Tokens, params: DecodeParams, trace: DecodeTrace, logits: bool) -> StepMachine:
    """upstream `generate_refusion` (default mode), as a step machine."""
    k, thr_slot, thr_tok = params.slot_size, params.slot_threshold, params.token_threshold
    prompt = np.asarray(tokens.prompt, dtype=np.int64)
    p0, block_len = len(prompt), params.block_length
    cache = KVCache(kv_capacity(p0, params))
    fwd = _Forwards(cache, trace, params, logits)
    step = 0
    eos_seen = False

    def commit(ids: np.ndarray, pos: np.ndarray, how: str) -> Commit:
        nonlocal step
        step += 1
        return Commit(step, tuple(int(t) for t in ids), tuple(int(p) for p in pos), how)

    for block in range(params.serial_num_blocks):
        start = p0 + block * block_len
        remaining = [start + j * k for j in range(block_len // k)]  # R: slot start positions, in order
        while remaining:
            slot_pos = np.add.outer(np.array(remaining, dtype=np.int64), np.arange(k))
            mask_ids = np.full(slot_pos.size, tokens.mask_id, dtype=np.int64)
            # 1. Plan
            if cache.length == 0:
                draft, probs = yield from fwd.prefill_plan(prompt, mask_ids, slot_pos.reshape(-1))
            else:
                draft, probs = yield from fwd.plan(mask_ids, slot_pos.reshape(-1))
            draft, probs = draft.reshape(-1, k), probs.reshape(-1, k)
            chosen, fell_back = policy.choose_slots(probs[:, 0], thr_slot)
            if fell_back:
                trace.branches["fallback_single_slot"] += 1
            rows, row_pos = draft[chosen].copy(), slot_pos[chosen]
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
                yield commit(flat[:count], row_pos.reshape(-1)[:count], "verification")
                continue
            # 3. Parallel infill
            trace.branches["infill_loop"] += 1
            drop = {int(c) for c in chosen}
            a, eos_row, loop_iter = 0, None, 0
            for loop_iter in range(k):
                if tags.all():
                    break
                window = np.where(tags[:, a:] == 1, rows[:, a:], tokens.mask_id)
                proposed = yield from fwd.infill_pass("infill_draft", window, row_pos[:, a:], a, n)
                rows[:, a:] = np.where(tags[:, a:] == 1, rows[:, a:], proposed)
                probs = yield from fwd.infill_pass("infill_verify", rows[:, a:], row_pos[:, a:], a, n)
                tags[:, a:] = policy.infill_tags(tags[:, a:], probs, thr_tok)
                eos_rows = np.flatnonzero(((rows[:, a:] == tokens.eos_id) & (tags[:, a:] == 1)).any(axis=1))
                if eos_rows.size:
                    eos_row = int(eos_rows[0])
                    rows, tags, row_pos = rows[: eos_row + 1], tags[: eos_row + 1], row_pos[: eos_row + 1]
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
            yield commit(rows.reshape(-1)[:count], row_pos.reshape(-1)[:count], "infill")
        if eos_seen:
            break


def ar_steps(tokens: Tokens, params: DecodeParams, trace: DecodeTrace, logits: bool) -> StepMachine:
    """Greedy (or sampled) autoregressive decoding on the infiller: the baseline."""
    prompt = np.asarray(tokens.prompt, dtype=np.int64)
    p0, gen_len = len(prompt), params.gen_length
    cache = KVCache(kv_capacity(p0, params))
    fwd = _Forwards(cache, trace, params, logits)
    ids, pos, kind = prompt, np.arange(p0), "prefill"
    for step in range(1, gen_len + 1):
        c = cache.length
        out = yield from fwd.run(kind, "infiller", ids, pos, masks.causal_after(c, len(ids)), c, c)
        cache.commit(len(ids))
        token, _ = fwd.draft({k: v[:, -1:] for k, v in out.items()}, sample=True)
        ids, pos, kind = token.astype(np.int64), np.array([p0 + step - 1]), "decode"
        trace.tpf_sum += 1.0
        trace.iterations += 1
        yield Commit(step, (int(token[0]),), (p0 + step - 1,), "ar")
        if int(token[0]) == tokens.eos_id:
            break

"""Token-level masked-diffusion decoding without KV reuse (LLaDA-style): the benchmark's baseline.

LLaDA (Nie et al. 2025, `generate.py`, `remasking="low_confidence"`, temperature 0) decodes a span of
`gen_length` masks in `steps` forwards: blocks of `block_length` left to right, `steps / num_blocks` steps
each, step i committing the `num_transfer[i]` most confident drafts of the block's masks (ties: lowest
position first). Every step feeds prompt + the whole span again with no past: no KV is reused. The answer
is the tokens up to the first EOS in position order.

It runs through the same scheduler, Runner and network as ReFusion, on the planner graph (no KV written):
our attention is causal in sequence order, so this is ReFusion's network read LLaDA-style, with LLaDA's
schedule and cost. `order="clean_first"` feeds the committed tokens before the masks (each at its true
position), so every mask sees every committed token. `early_exit=True` (not LLaDA) stops once an EOS is
committed and every position before it is filled. It takes its own params (DiffusionParams), so it is a
bench's method, not a mode the CLIs or the server offer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.decode import masks
from refusion.runtime.decode.steps import Commit, DecodeTrace, Forward, StepMachine, Tokens

Order = Literal["position", "clean_first"]
FORWARD_KIND = "diffusion_step"


@dataclass(frozen=True)
class DiffusionParams:
    mode: ClassVar[str] = "llada"  # its row in decode.STRATEGIES
    gen_length: int = 64
    steps: int = 64
    block_length: int = 32
    order: Order = "position"
    early_exit: bool = False

    def __post_init__(self) -> None:
        for name in ("gen_length", "steps", "block_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise RefusionError(f"{name}={value!r} must be a positive integer.", name)
        if self.gen_length % self.block_length:
            raise RefusionError(
                f"gen_length {self.gen_length} is not a multiple of block_length {self.block_length} (LLaDA needs whole blocks).",
                "gen_length"
            )
        if self.steps % self.num_blocks:
            raise RefusionError(
                f"steps {self.steps} cannot be shared equally by {self.num_blocks} blocks of {self.block_length}; "
                f"choose steps as a multiple of {self.num_blocks}."
            )
        if self.steps > self.gen_length:
            raise RefusionError(f"steps {self.steps} > gen_length {self.gen_length}: a step must commit at least one token.")
        if self.order not in ("position", "clean_first"):
            raise RefusionError(f"order={self.order!r} is not one of 'position', 'clean_first'.")

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks

    def label(self) -> str:
        per = self.gen_length / self.steps
        extra = (", clean-first" if self.order == "clean_first" else "") + (", early exit" if self.early_exit else "")
        return f"steps={self.steps} block={self.block_length} ({per:g} tok/step{extra})"


def num_transfer_tokens(masked: int, steps: int) -> list[int]:
    """LLaDA's `get_num_transfer_tokens`: `masked` tokens over `steps` steps, evenly, the
    remainder one each to the first steps."""
    base, rest = divmod(masked, steps)
    return [base + (1 if i < rest else 0) for i in range(steps)]


def kv_capacity(prompt_length: int, params: DiffusionParams) -> int:
    """A KV region of one token: the runner binds an (empty) past view of it; nothing is cached."""
    return 1


def positions(params: DiffusionParams) -> int:
    return params.gen_length


def llada_steps(tokens: Tokens, params: DiffusionParams, trace: DecodeTrace) -> StepMachine:
    """LLaDA-style decoding of one prompt as a step machine (see the module docstring): each step
    hands out one planner Forward over prompt + span and commits the tokens it fills."""
    p0, gen, eos_id = len(tokens.prompt), params.gen_length, tokens.eos_id
    span = np.full(gen, tokens.mask_id, dtype=np.int64)
    is_masked = np.ones(gen, dtype=bool)
    prompt_arr = np.asarray(tokens.prompt, dtype=np.int64)
    pos_ids = np.arange(p0 + gen, dtype=np.int64)
    mask = masks.causal_after(0, p0 + gen)  # same shape every step: prompt + whole span, past 0
    done, step = False, 0
    for block in range(params.num_blocks):
        if done:
            break
        lo, hi = block * params.block_length, (block + 1) * params.block_length
        for count in num_transfer_tokens(int(is_masked[lo:hi].sum()), params.steps_per_block):
            if done:
                break
            if params.order == "position":
                order = np.arange(gen)
            else:  # committed tokens first, then the masks, each group in position order
                order = np.concatenate([np.flatnonzero(~is_masked), np.flatnonzero(is_masked)])
            ids = np.concatenate([prompt_arr, span[order]])
            pos = np.concatenate([pos_ids[:p0], pos_ids[p0:][order]])
            trace.forwards[FORWARD_KIND] += 1
            heads = np.arange(p0, len(ids))[None]  # the generation's positions; the prompt's read nothing
            out = yield Forward(ids[None], pos[None], mask, 0, None, heads, kind=FORWARD_KIND, graph="planner")
            assert out is not None  # every Forward gets its outputs back
            draft = np.empty(gen, dtype=np.int64)
            conf = np.empty(gen, dtype=np.float32)
            draft[order] = out["argmax_ids"][0]
            conf[order] = out["argmax_probs"][0]
            candidates = np.flatnonzero(is_masked[lo:hi]) + lo
            if count and candidates.size:
                best = candidates[np.argsort(-conf[candidates], kind="stable")[:count]]
                span[best] = draft[best]
                is_masked[best] = False
                trace.tpf_sum += len(best)
                trace.iterations += 1
                step += 1
                with np.errstate(divide="ignore"):
                    logprobs = tuple(float(x) for x in np.log(conf[best]))
                yield Commit(step, tuple(int(t) for t in draft[best]), tuple(int(p0 + b) for b in best), "diffusion",
                             logprobs)
            done = params.early_exit and _settled_through_eos(span, is_masked, eos_id)


def _settled_through_eos(span: np.ndarray, is_masked: np.ndarray, eos_id: int) -> bool:
    """An EOS is committed and every position before it is filled."""
    eos = np.flatnonzero((span == eos_id) & ~is_masked)
    return bool(eos.size) and not is_masked[: eos[0]].any()

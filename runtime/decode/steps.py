"""What a decode strategy hands out, one step at a time: forwards to run, KV to move, commits.

The strategies (runtime/decode/) are step machines: generators that yield a `Forward` and
receive its outputs back through `send`, yield a `KVMove` for the runner to do, yield a
`Commit` when tokens become final, or a `PrefixKV` when KV they hold may be reused by others. All coordinates are request-local (KV token 0 is the
request's first prompt token), so whoever drives them decides where the request's KV lives
and may gather forwards from many requests into one call (runtime/scheduler.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from refusion.runtime.core.contract import GraphName

if TYPE_CHECKING:
    from refusion.runtime.structured.engine import Grammar


@dataclass(frozen=True)
class Feed:
    """What one forward feeds of a request: tokens at their positions over KV [0, past) of the request; the
    infiller writes their KV at [write_at, write_at + seq) (None: the planner, which writes none)."""

    input_ids: np.ndarray  # int64 [1, seq]
    position_ids: np.ndarray  # int64 [1, seq]
    attention_mask: np.ndarray  # bool [1, seq, past + seq]
    past: int
    write_at: int | None


@dataclass(frozen=True)
class Forward(Feed):
    """One forward of `graph`, as a strategy asks it: its vocabulary heads run at `heads` alone (indices into seq,
    the positions the step reads), so its outputs hold one row per head, each over the tokens its row of
    `vocab_mask` allows (a guided request's; None: every token)."""

    heads: np.ndarray  # int64 [1, heads]
    vocab_mask: np.ndarray | None = None  # uint8 [1, heads, mask bytes]
    kind: str = field(kw_only=True)  # what the loop uses it for: prefill_plan, plan, verify, infill_draft, ...
    graph: GraphName = field(kw_only=True)


@dataclass(frozen=True)
class KVMove:
    """Copy the KV of tokens [src, src + length) to [dst, dst + length); ranges may overlap."""

    src: int
    dst: int
    length: int


@dataclass(frozen=True)
class Commit:
    """Tokens that became final in one loop iteration, with their true positions."""

    step: int
    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    how: str  # "verification" (whole slots from the verify pass), "infill", "ar"; guided: "forced", "draft", "next"
    logprobs: tuple[float, ...] = ()  # each token's log-probability when it was drafted (its draft's reading)
    # with Tokens.top_logprobs: each token's most likely alternatives in that reading, (id, log-probability)
    alternatives: tuple[tuple[tuple[int, float], ...], ...] = ()


@dataclass(frozen=True)
class PrefixKV:
    """KV [0, len(token_ids)) of the request now holds exactly what a causal prefill of `token_ids` at positions
    0, 1, ... computes: the prefix cache may keep it for later requests that start with these tokens."""

    token_ids: tuple[int, ...]


Step = Forward | KVMove | Commit | PrefixKV
Outputs = dict[str, np.ndarray]
StepMachine = Generator[Step, Outputs | None, None]


@dataclass
class DecodeTrace:
    """Counters the loop keeps: forwards by kind, upstream's TPF terms, branches taken."""

    forwards: Counter = field(default_factory=Counter)
    branches: Counter = field(default_factory=Counter)
    tpf_sum: float = 0.0
    iterations: int = 0
    dead_end: str = ""  # a guided decode stopped where its guide allowed no token: why (finish_reason "dead_end")

    @property
    def tpf(self) -> float:
        """upstream's tokens per forward: the mean over iterations of tokens / forwards."""
        return self.tpf_sum / self.iterations if self.iterations else 0.0


@dataclass(frozen=True)
class Tokens:
    prompt: list[int]
    mask_id: int
    eos_id: int
    cached: int = 0  # KV of prompt[:cached] is already in the request's region (the prefix cache's copy)
    top_logprobs: int = 0  # alternatives each commit reports per token (Commit.alternatives), at most the graphs' K
    guide: Grammar | None = None  # the structure the answer follows (runtime/decode/guided.py), compiled
    # the most tokens one forward over the answer may feed whole (not cut into chunks, every output read): the
    # runner's decode bound or the scheduler's prefill chunk, the smaller; None: any number
    feed_bound: int | None = None
    # the most tokens a guided ReFusion forward verifies and drafts past those it feeds (Runner.guided_lookahead):
    # None, a block within MAX_LOOKAHEAD
    lookahead: int | None = None

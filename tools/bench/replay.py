"""Record a decode's forward shapes on one model and replay them on another (the scale bench's ReFusion side).

A random-weight model cannot decode meaningfully, so ReFusion's cost on it is measured by replaying what a real
decode on the embedded model ran: the same forwards in the same order, each with the same graph, rows, tokens fed,
past, KV write offset and head positions, and the same KV moves. The runner records them itself
(RunnerStats.record); a replay feeds random ids at consecutive positions under a causal mask over the past, which
costs what the decode's ids and masks cost (onnxruntime's attention is dense whatever the mask says), and the
committed tokens are the recording's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from refusion.runtime.core.contract import GraphName
from refusion.runtime.runners.base import Runner
from refusion.runtime.runners.rows import RowFeed
from refusion.runtime.runners.stats import ForwardShape, MoveShape, Recorded, RowShape

T = TypeVar("T")


@dataclass(frozen=True)
class Recording:
    """One request's forwards and KV moves, in order, and the tokens it generated (through its first EOS)."""

    events: tuple[Recorded, ...]
    tokens: int

    @property
    def forwards(self) -> list[ForwardShape]:
        return [e for e in self.events if isinstance(e, ForwardShape)]

    @property
    def capacity(self) -> int:
        """KV tokens the events reach: what a region must hold to replay them."""
        ends = [0]
        for e in self.events:
            if isinstance(e, MoveShape):
                ends.append(max(e.src, e.dst) + e.length)
            else:
                ends += [max(r.past, r.past if r.write_at is None else r.write_at) + r.fed for r in e.rows]
        return max(ends)

    def to_json(self) -> dict[str, Any]:
        """Compact: a forward as {graph, rows: [[fed, past, write_at, heads], ...]}, a move as [src, dst, length]."""
        return {"tokens": self.tokens, "events": [
            [e.src, e.dst, e.length] if isinstance(e, MoveShape)
            else {"graph": e.graph, "rows": [[r.fed, r.past, r.write_at, list(r.heads)] for r in e.rows]}
            for e in self.events]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Recording:
        events: list[Recorded] = [
            MoveShape(*e) if isinstance(e, list)
            else ForwardShape(e["graph"], tuple(RowShape(f, p, w, tuple(h)) for f, p, w, h in e["rows"]))
            for e in data["events"]]
        return cls(tuple(events), data["tokens"])


def recorded(runner: Runner, run: Callable[[], T], tokens: Callable[[T], int]) -> tuple[T, Recording]:
    """`run()`'s result and the shapes of what it made `runner` do (nothing else may use the runner meanwhile)."""
    events: list[Recorded] = []
    runner.stats.record = events
    try:
        result = run()
    finally:
        runner.stats.record = None
    return result, Recording(tuple(events), tokens(result))


@dataclass(frozen=True)
class Replay:
    """A recording's feeds made once, so that replaying it times the runner alone."""

    steps: tuple[tuple[GraphName, list[RowFeed]] | MoveShape, ...]
    capacity: int
    tokens: int


def prepare(rec: Recording, vocab: int, seed: int = 0) -> Replay:
    """The feeds of `rec`'s forwards for a model of `vocab` tokens: random ids, positions past, past + 1, ...,
    each token seeing the whole past and the tokens before it; KV region 0."""
    rng = np.random.default_rng(seed)
    steps: list[tuple[GraphName, list[RowFeed]] | MoveShape] = []
    for e in rec.events:
        if isinstance(e, MoveShape):
            steps.append(e)
            continue
        assert e.graph in ("planner", "infiller")  # what a runner records
        graph: GraphName = "planner" if e.graph == "planner" else "infiller"
        rows = []
        for r in e.rows:
            mask = np.ones((1, r.fed, r.past + r.fed), bool)
            mask[0, :, r.past:] = np.tril(np.ones((r.fed, r.fed), bool))
            rows.append(RowFeed(rng.integers(0, vocab, (1, r.fed), dtype=np.int64),
                                np.arange(r.past, r.past + r.fed, dtype=np.int64)[None], mask, r.past, r.write_at, 0,
                                np.asarray(r.heads, np.int64)[None]))
        steps.append((graph, rows))
    return Replay(tuple(steps), rec.capacity, rec.tokens)


def replay(runner: Runner, plan: Replay) -> None:
    """Run a prepared recording's forwards and KV moves on `runner`, in order (one request at a time: region 0)."""
    runner.allocate_kv(plan.capacity, 0)
    for step in plan.steps:
        if isinstance(step, MoveShape):
            runner.move_kv(step.src, step.dst, step.length, 0)
        else:
            runner.run_batch(*step)

"""What a Runner counts of its own work, so that benches read it instead of wrapping the runner's methods."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields

from refusion.runtime.runners.rows import RowFeed


@dataclass
class ForwardStats:
    """One graph's forwards."""

    forwards: int = 0  # run_batch calls: one (packed) forward each, a chunk of a cut forward one each
    rows: int = 0  # requests' rows in them
    fed: int = 0  # tokens fed: every row's own tokens
    padded: int = 0  # tokens computed: rows x the longest row's tokens, as the rows are packed
    seconds: float = 0.0  # inside run_batch: packing, KV copies and the backend
    backend_seconds: float = 0.0  # inside the backend's own call (onnxruntime's run; TensorRT's execution)
    kv_copies: int = 0  # KV copy calls the forwards made: pasts gathered into a batch, presents put in regions
    kv_copy_bytes: int = 0  # and the bytes they copied (a past bound in place, a present written in place: none)

    def add(self, rows: list[RowFeed], seconds: float) -> None:
        seqs = [r.input_ids.shape[1] for r in rows]
        self.forwards += 1
        self.rows += len(rows)
        self.fed += sum(seqs)
        self.padded += len(rows) * max(seqs)
        self.seconds += seconds


@dataclass(frozen=True)
class RowShape:
    """One row of a recorded forward: tokens fed, the past read, where its KV went (infiller) and its heads."""

    fed: int
    past: int
    write_at: int | None
    heads: tuple[int, ...]  # indices into the row's fed tokens


@dataclass(frozen=True)
class ForwardShape:
    """A run_batch call as the runner saw it: the graph and each row's shape."""

    graph: str
    rows: tuple[RowShape, ...]


@dataclass(frozen=True)
class MoveShape:
    """A move_kv call that moved anything."""

    src: int
    dst: int
    length: int


Recorded = ForwardShape | MoveShape


@dataclass
class RunnerStats:
    """Forwards by graph, and KV moves; counters only grow (take differences with `since`)."""

    graphs: dict[str, ForwardStats] = field(default_factory=dict)
    moves: int = 0  # move_kv calls that moved anything (every layer's K and V)
    moved_tokens: int = 0
    move_seconds: float = 0.0
    copies: int = 0  # copy_kv calls between regions (the prefix cache's loads and stores; one device copy
    # each on the GPU runners)
    copied_tokens: int = 0
    copy_seconds: float = 0.0
    # A list to have every forward's and KV move's shape appended, in order (the scale bench records decodes
    # to replay them on another model: tools/bench/replay.py); None, as by default: nothing kept.
    record: list[Recorded] | None = None

    def graph(self, name: str) -> ForwardStats:
        return self.graphs.setdefault(name, ForwardStats())

    @property
    def total(self) -> ForwardStats:
        """Every graph's forwards together."""
        out = ForwardStats()
        for stats in self.graphs.values():
            for f in fields(ForwardStats):
                setattr(out, f.name, getattr(out, f.name) + getattr(stats, f.name))
        return out

    @property
    def busy_seconds(self) -> float:
        """Inside the runner: forwards, KV moves and copies."""
        return self.total.seconds + self.move_seconds + self.copy_seconds

    def copy(self) -> RunnerStats:
        return copy.deepcopy(self)

    def since(self, earlier: RunnerStats) -> RunnerStats:
        """What was counted after `earlier` (a copy taken before)."""
        out = RunnerStats(**{name: getattr(self, name) - getattr(earlier, name)
                             for name in ("moves", "moved_tokens", "move_seconds", "copies", "copied_tokens",
                                          "copy_seconds")})
        for name, stats in self.graphs.items():
            before = earlier.graphs.get(name, ForwardStats())
            out.graphs[name] = ForwardStats(**{f.name: getattr(stats, f.name) - getattr(before, f.name)
                                               for f in fields(ForwardStats)})
        return out

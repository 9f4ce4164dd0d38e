"""The Runner interface: one backend running the planner and infiller graphs of one export.

A Runner owns the device: the sessions or engines, and a pool of KV regions (runners/kv_pool.py: in host memory
or on the device, one interface), one per request in flight, each a preallocated `[1, capacity, kv_heads,
head_dim]` tensor per layer for keys and values; the Runner checks every KV call and hands it to the pool, so a
backend writes none of them. A decode strategy only ever says *where* in its request's region a forward reads its
past and writes its present; it never sees device memory, nor which backend it runs on. `run_batch` packs
forwards of several requests (each over its own region) into one call, on backends that can (`max_batch` > 1);
the others run them one by one. Regions beyond the requests' can be added (`add_region`: the prefix cache's) and
KV copied between regions (`copy_kv`). Every runner counts its own forwards, the KV copies they make, KV moves
and copies between regions in `stats` (runners/stats.py).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from functools import cached_property
from types import TracebackType

import numpy as np

from refusion.runtime.core.contract import VOCAB_MASK, GraphName, mask_bytes
from refusion.runtime.core.dtypes import dtype
from refusion.runtime.core.embeddings import EmbeddingTable, token_feed
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.core.signals import main_thread_signals
from refusion.runtime.runners.kv_pool import KVPool
from refusion.runtime.runners.rows import RowFeed
from refusion.runtime.runners.stats import ForwardShape, ForwardStats, MoveShape, RowShape, RunnerStats

_INT64, _BOOL = np.dtype(np.int64), np.dtype(np.bool_)  # compared as dtypes: a scalar type is converted each time


class _BackendTime:
    """A `with` block's time added to a graph's backend_seconds (a class: a generator's context manager costs more,
    once a forward)."""

    __slots__ = ("stats", "t0")

    def __init__(self, stats: ForwardStats):
        self.stats, self.t0 = stats, 0.0

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.stats.backend_seconds += time.perf_counter() - self.t0


class Runner(ABC):
    """activate / run / deactivate, usable as a context manager (as Polygraphy's runners are)."""

    name: str = "runner"
    max_requests: int = 1  # requests whose KV the runner holds at once
    max_batch: int = 1  # forwards `run_batch` packs into one call
    # the most tokens a guided ReFusion forward verifies and drafts past those it must feed (decode/guided.py
    # `lookahead`), where feeding more costs more than the drafts win; None: a block (within MAX_LOOKAHEAD), as on a
    # GPU, where a forward's extra tokens cost about nothing
    guided_lookahead: int | None = None

    def __init__(self, manifest: ExportManifest):
        self.manifest = manifest
        self.kv_capacities = [0] * self.max_requests
        self.kv: KVPool | None = None  # the KV regions, in the pool the backend makes at activation
        self.stats = RunnerStats()  # what the benches read
        self.is_active = False
        self.embeddings = EmbeddingTable.of(manifest.path, manifest.embeddings)  # a host table, mapped on first use
        self.takes_masks = manifest.takes_masks  # the graphs take vocab_mask (format 7 on)
        self._all_ones: dict[int, np.ndarray] = {}  # _every_token's masks, by batch rows

    # -- lifecycle -------------------------------------------------------------------
    def activate(self) -> None:
        if not self.is_active:
            if self.embeddings is not None:
                self.embeddings.load()  # a missing or damaged table refused before any device work
            with main_thread_signals():  # the backend's thread pools (onnxruntime's, the GPU driver's)
                self._activate()
            self.is_active = True

    def deactivate(self) -> None:
        if self.is_active:
            self._deactivate()
            self.is_active = False
            self.kv_capacities = [0] * self.max_requests
            if self.embeddings is not None:
                self.embeddings.close()

    def __enter__(self) -> Runner:
        self.activate()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.deactivate()

    @property
    def max_forward_tokens(self) -> int | None:
        """The most tokens one forward may feed, if the backend was built for a bound (TensorRT engines built with
        --prefill-chunk); None: any number (onnxruntime)."""
        return None

    @property
    def decode_tokens(self) -> int | None:
        """The most tokens one forward over a past beyond the prompt may feed and still read every output (a
        guided forward's verified run needs input_probs, which a forward cut into chunks does not give): TensorRT
        engines' block, their decode profile's longest; None: any number (onnxruntime)."""
        return None

    def chunk_bound(self, graph: GraphName, seq: int, past: int, heads: int) -> int | None:
        """None where this backend runs a forward of `graph` feeding `seq` tokens over `past` (`heads` heads) in one
        execution; else the most tokens a chunk of it may feed, where it is cut into chunks, each over the KV the
        ones before it wrote (0: it cannot be). The scheduler does the cutting (decode/chunks.py); a runner never
        does. onnxruntime: None, any shape; TensorRT: from its profiles."""
        return None

    def check_request(self, prompt_length: int, needs: tuple[int, int, int] | None, mode: str) -> None:
        """Refuse, before any work, a request outside what this backend was built for: a prompt of `prompt_length`
        tokens and a `mode` strategy's forwards (`needs`: its generated positions, slot size and serial blocks;
        None: a strategy whose forwards engines hold no profiles for). onnxruntime takes any shape; TensorRT checks
        its engines' profiles."""

    # -- KV cache ----------------------------------------------------------------------
    def allocate_kv(self, capacity: int, region: int = 0) -> None:
        """Make room for `capacity` tokens of KV in `region` (kept if already that large). Called at
        the start of a request: growing the buffer does not preserve its contents."""
        self._require_active()
        self._check_region(region)
        if capacity > self.kv_capacities[region]:
            self._kv.allocate(region, capacity)
            self.kv_capacities[region] = capacity

    @cached_property
    def kv_bytes_per_token(self) -> int:
        m = self.manifest
        return 2 * m.num_layers * m.kv_heads * m.head_dim * dtype(m.dtype).itemsize

    @property
    def kv_bytes(self) -> int:
        """Bytes the KV regions hold now (the requests' and any added ones): capacity x per-token size, nothing
        per infill row."""
        return sum(self.kv_capacities) * self.kv_bytes_per_token

    def add_region(self) -> int:
        """One more KV region, beyond the requests' `max_requests` (the prefix cache keeps its KV in such
        regions); it holds nothing until `allocate_kv`. Returns its index. Regions added go at deactivate."""
        self._require_active()
        self._kv.add_region()
        self.kv_capacities.append(0)
        return len(self.kv_capacities) - 1

    def copy_kv(self, src_region: int, src: int, dst_region: int, dst: int, length: int) -> None:
        """Copy KV of tokens [src, src+length) of `src_region` to [dst, dst+length) of another region."""
        if length <= 0:
            return
        if src_region == dst_region:
            raise RefusionError(f"copy_kv within region {src_region}: use move_kv, which allows overlapping ranges.")
        self._check_region(src_region)
        self._check_region(dst_region)
        self._check_range("copy source", src, length, src_region)
        self._check_range("copy destination", dst, length, dst_region)
        t0 = time.perf_counter()
        self._kv.copy(src_region, src, dst_region, dst, length)
        self.stats.copies += 1
        self.stats.copied_tokens += length
        self.stats.copy_seconds += time.perf_counter() - t0

    def move_kv(self, src: int, dst: int, length: int, region: int = 0) -> None:
        """Copy KV of tokens [src, src+length) to [dst, dst+length) in `region`; overlapping ranges are fine."""
        if length <= 0 or src == dst:
            return
        self._check_range("move source", src, length, region)
        self._check_range("move destination", dst, length, region)
        t0 = time.perf_counter()
        self._kv.move(region, src, dst, length)
        self.stats.moves += 1
        self.stats.moved_tokens += length
        self.stats.move_seconds += time.perf_counter() - t0
        if self.stats.record is not None:
            self.stats.record.append(MoveShape(src, dst, length))

    def kv_to_host(self, start: int, length: int, region: int = 0) -> dict[str, np.ndarray]:
        """KV of tokens [start, start + length) per layer of `region`, on the host, by present name (for checks,
        not the loop). bfloat16 comes back as its raw uint16 bits."""
        self._require_active()
        self._check_region(region)
        self._check_range("KV read", start, length, region)
        return self._kv.to_host(region, start, length)

    def kv_from_host(self, start: int, past: dict[str, np.ndarray], region: int = 0) -> None:
        """Write a feed's past KV (`past_key_values.{i}.key|value`, [1, length, kv_heads, head_dim])
        into `region` at token `start`, all checked before any is written (for checks, not the loop)."""
        self._require_active()
        self._check_region(region)
        for length in self._kv.past_lengths(past):
            self._check_range("KV upload", start, length, region)
        self._kv.from_host(region, start, past)

    @property
    def _kv(self) -> KVPool:
        if self.kv is None:
            raise RefusionError(f"{self.name} runner is not active; call activate() first.")
        return self.kv

    # -- forwards ----------------------------------------------------------------------
    def run(
        self,
        graph: GraphName,
        input_ids: np.ndarray,
        position_ids: np.ndarray,
        attention_mask: np.ndarray,
        past_length: int,
        write_at: int | None = None,
        region: int = 0,
        heads: np.ndarray | None = None,
        vocab_mask: np.ndarray | None = None,
    ) -> dict[str, np.ndarray]:
        """One forward of `graph` over KV tokens [0, past_length) of `region`.

        The infiller writes its new tokens' KV to [write_at, write_at + seq); the planner
        keeps none. Returns the graph's other outputs on the host, at the head positions `heads`
        (int64 [1, heads], indices into seq; default every position), each head reading only the tokens its row of
        `vocab_mask` (uint8 [1, heads, mask bytes]; None: every token) allows.
        """
        row = RowFeed(input_ids, position_ids, attention_mask, past_length, write_at, region, heads, vocab_mask)
        return self.run_batch(graph, [row])[0]

    def run_batch(self, graph: GraphName, rows: list[RowFeed]) -> list[dict[str, np.ndarray]]:
        """Forwards of `graph` for several requests, each over its own region; packed into one call
        where the backend can (max_batch), else one by one. Outputs per row, as `run` gives them."""
        self._require_active()
        rows = [row.with_heads() for row in rows]
        for row in rows:
            self._check_row(graph, row)
        if len(rows) > self.max_batch:
            raise RefusionError(f"{len(rows)} rows exceed this runner's max_batch {self.max_batch}.")
        t0 = time.perf_counter()
        out = self._run(graph, rows)
        self.stats.graph(graph).add(rows, time.perf_counter() - t0)
        if self.stats.record is not None:
            self.stats.record.append(ForwardShape(graph, tuple(
                RowShape(r.input_ids.shape[1], r.past, r.write_at, tuple(r.heads_at[0].tolist())) for r in rows)))
        return out

    def _feed(self, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray, heads: np.ndarray,
              vocab_mask: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """A forward's inputs but KV, by the contract's names, as host arrays every backend binds as they come:
        the ids as `token_feed` makes them (where the export keeps its embedding table on the host, the rows
        are gathered from its map here, for every backend, into `_embeds_out`), positions, mask, head positions
        and, where the graphs take it, vocab_mask (None: one all-ones row a batch row, every token allowed)."""
        out = self._embeds_out(ids) if self.embeddings is not None else None
        feed = {**token_feed(self.embeddings, ids, out), "position_ids": pos,
                "attention_mask": np.ascontiguousarray(mask), "head_positions": np.ascontiguousarray(heads)}
        if self.takes_masks:
            feed[VOCAB_MASK] = self._every_token(ids.shape[0]) if vocab_mask is None else np.ascontiguousarray(vocab_mask)
        return feed

    def _every_token(self, rows: int) -> np.ndarray:
        """vocab_mask's all-ones row for each of `rows` batch rows: made once a batch size, read-only."""
        mask = self._all_ones.get(rows)
        if mask is None:
            mask = self._all_ones[rows] = np.full((rows, 1, mask_bytes(self.manifest.vocab_size)), 255, np.uint8)
            mask.flags.writeable = False
        return mask

    def _embeds_out(self, ids: np.ndarray) -> np.ndarray | None:
        """Where a host table's rows for `ids` are gathered: a new array (None), or memory the backend uploads from."""
        return None

    def _in_backend(self, graph: GraphName) -> _BackendTime:
        """Around the backend's own call in a forward (a `with` block): its time goes to RunnerStats.backend_seconds."""
        return _BackendTime(self.stats.graph(graph))

    def _count_copies(self, graph: GraphName, copied: tuple[int, int]) -> None:
        """KV copies (calls, bytes) a forward of `graph` made: RunnerStats' kv_copies and kv_copy_bytes."""
        stats = self.stats.graph(graph)
        stats.kv_copies += copied[0]
        stats.kv_copy_bytes += copied[1]

    def _check_row(self, graph: GraphName, row: RowFeed) -> None:
        # Every forward passes here: the index bounds are read off Python lists, each numpy reduction costing more
        # than the list on the few heads and positions of a decode step (docs/benchmark.md, "Where a CPU forward's
        # time goes"); a long feed's list costs little beside its forward.
        self._check_region(row.region)
        seq = self._check_feed(graph, row.input_ids, row.position_ids, row.attention_mask, row.past, row.region)
        heads = row.heads_at
        if heads.ndim != 2 or heads.shape[0] != 1 or not 1 <= heads.shape[1] <= seq or heads.dtype != _INT64:
            raise RefusionError(f"heads must be int64 [1, n] with 1 <= n <= seq ({seq}); got {heads.dtype} "
                                f"{list(heads.shape)}.")
        at = heads[0].tolist()
        if min(at) < 0 or max(at) >= seq:
            raise RefusionError(f"head positions {at} must index the {seq} tokens fed, 0..{seq - 1}.")
        if row.vocab_mask is not None:
            if not self.takes_masks:
                raise RefusionError(f"{self.manifest.path} is an export of format {self.manifest.format_version}, whose "
                                    "graphs take no vocab_mask (structured output); re-export it.")
            shape = (1, heads.shape[1], mask_bytes(self.manifest.vocab_size))
            if row.vocab_mask.shape != shape or row.vocab_mask.dtype != np.uint8:
                raise RefusionError(f"vocab_mask must be uint8 {list(shape)} (a row of bits a head); got "
                                    f"{row.vocab_mask.dtype} {list(row.vocab_mask.shape)}.")
        write_at = row.write_at
        if (graph == "infiller") != (write_at is not None):
            raise RefusionError(f"write_at={write_at!r}: the infiller needs a KV write offset and the planner takes none.")
        if write_at is not None:
            if write_at < row.past:
                raise RefusionError(f"write_at={write_at} < past_length={row.past}: a forward may not overwrite the past it reads.")
            self._check_range("KV write", write_at, seq, row.region)

    def _check_feed(self, graph: GraphName, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray, past: int,
                    region: int) -> int:
        if ids.ndim != 2 or ids.shape[0] != 1 or ids.dtype != _INT64:
            raise RefusionError(f"input_ids must be int64 [1, seq]; got {ids.dtype} {list(ids.shape)}.")
        seq = ids.shape[1]
        if pos.shape != ids.shape or pos.dtype != _INT64:
            raise RefusionError(f"position_ids must be int64 {list(ids.shape)}; got {pos.dtype} {list(pos.shape)}.")
        if mask.shape != (1, seq, past + seq) or mask.dtype != _BOOL:
            raise RefusionError(
                f"attention_mask must be bool [1, {seq}, {past + seq}] (past {past} + seq {seq}); "
                f"got {mask.dtype} {list(mask.shape)}."
            )
        if not mask.any(axis=-1).all():
            row = int(np.flatnonzero(~mask.any(axis=-1)[0])[0])
            raise RefusionError(
                f"attention_mask row {row} attends to nothing; every token must attend to at least one position "
                "(itself, in the decode loop's masks): an all-masked row's softmax is NaN in half precision."
            )
        if not self.kv_capacities[region]:  # the pools' regions exist from allocate_kv on, a planner's too
            raise RefusionError(f"KV region {region} holds no KV yet; allocate_kv() with the request's limit first.")
        self._check_range("past", 0, past, region)
        last = max(pos[0].tolist(), default=0)
        if last >= self.manifest.max_positions:
            raise RefusionError(
                f"position id {last} exceeds the model's max_position_embeddings "
                f"{self.manifest.max_positions}; shorten the prompt or gen_length."
            )
        return seq

    def _check_range(self, what: str, start: int, length: int, region: int = 0) -> None:
        if start < 0 or start + length > self.kv_capacities[region]:
            raise RefusionError(
                f"{what} [{start}, {start + length}) lies outside the KV cache of {self.kv_capacities[region]} tokens "
                f"(region {region}); "
                "allocate_kv() with the request's limit first."
            )

    def _check_region(self, region: int) -> None:
        if not 0 <= region < len(self.kv_capacities):
            raise RefusionError(f"KV region {region} does not exist; this {self.name} runner holds "
                                f"{len(self.kv_capacities)} ({self.max_requests} for requests).")

    def _require_active(self) -> None:
        if not self.is_active:
            raise RefusionError(f"{self.name} runner is not active; call activate() or use it as a context manager.")

    # -- what a backend implements -----------------------------------------------------
    @abstractmethod
    def _activate(self) -> None:
        """Load the backend, and make its KV pool (`self.kv`): every region empty."""

    @abstractmethod
    def _deactivate(self) -> None:
        """Free the KV pool (`self.kv` None again) and everything else the backend holds."""

    @abstractmethod
    def _run(self, graph: GraphName, rows: list[RowFeed]) -> list[dict[str, np.ndarray]]:
        """The forwards of `rows` (checked, at most max_batch, each with its heads), outputs per row as `run` gives
        them: one row alone over its region in place (the fast path: most forwards are one request's), several
        packed into one call where the backend can."""

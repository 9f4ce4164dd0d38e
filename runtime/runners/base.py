"""The Runner interface: one backend running the planner and infiller graphs of one export.

A Runner owns the device: the sessions or engines, and the KV cache buffer, a
preallocated `[1, capacity, kv_heads, head_dim]` tensor per layer for keys and values.
The decode loop only ever says *where* in that buffer a forward reads its past and
writes its present; it never sees device memory, nor which backend it runs on.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from types import TracebackType

import numpy as np

from refusion.runtime.core.contract import GraphName
from refusion.runtime.core.dtypes import dtype
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.params import DecodeParams


class Runner(ABC):
    """activate / run / deactivate, usable as a context manager (as Polygraphy's runners are)."""

    name: str = "runner"

    def __init__(self, manifest: ExportManifest):
        self.manifest = manifest
        self.kv_capacity = 0
        self.engine_seconds = 0.0  # wall time spent inside `run` and `move_kv`, for stats
        self.is_active = False

    # -- lifecycle -------------------------------------------------------------------
    def activate(self) -> None:
        if not self.is_active:
            self._activate()
            self.is_active = True

    def deactivate(self) -> None:
        if self.is_active:
            self._deactivate()
            self.is_active = False
            self.kv_capacity = 0

    def __enter__(self) -> Runner:
        self.activate()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.deactivate()

    def check_request(self, prompt_length: int, params: DecodeParams) -> None:
        """Refuse, before any work, a request outside what this backend was built for.
        onnxruntime takes any shape; TensorRT checks its engines' profiles."""

    # -- KV cache ----------------------------------------------------------------------
    def allocate_kv(self, capacity: int) -> None:
        """Make room for `capacity` tokens of KV (kept if already that large). Called at the
        start of a request: growing the buffer does not preserve its contents."""
        self._require_active()
        if capacity > self.kv_capacity:
            self._allocate_kv(capacity)
            self.kv_capacity = capacity

    @property
    def kv_bytes_per_token(self) -> int:
        m = self.manifest
        return 2 * m.num_layers * m.kv_heads * m.head_dim * dtype(m.dtype).itemsize

    @property
    def kv_bytes(self) -> int:
        """Bytes the KV buffer holds now: capacity x per-token size, nothing per slot."""
        return self.kv_capacity * self.kv_bytes_per_token

    def move_kv(self, src: int, dst: int, length: int) -> None:
        """Copy KV of tokens [src, src+length) to [dst, dst+length); overlapping ranges are fine."""
        if length <= 0 or src == dst:
            return
        self._check_range("move source", src, length)
        self._check_range("move destination", dst, length)
        t0 = time.perf_counter()
        self._move_kv(src, dst, length)
        self.engine_seconds += time.perf_counter() - t0

    # -- forwards ----------------------------------------------------------------------
    def run(
        self,
        graph: GraphName,
        input_ids: np.ndarray,
        position_ids: np.ndarray,
        attention_mask: np.ndarray,
        past_length: int,
        write_at: int | None = None,
    ) -> dict[str, np.ndarray]:
        """One forward of `graph` over KV tokens [0, past_length) of the cache.

        The infiller writes its new tokens' KV to [write_at, write_at + seq); the planner
        keeps none. Returns the graph's other outputs on the host.
        """
        self._require_active()
        seq = self._check_feed(graph, input_ids, position_ids, attention_mask, past_length)
        if (graph == "infiller") != (write_at is not None):
            raise RefusionError(f"write_at={write_at!r}: the infiller needs a KV write offset and the planner takes none.")
        if write_at is not None:
            if write_at < past_length:
                raise RefusionError(f"write_at={write_at} < past_length={past_length}: a forward may not overwrite the past it reads.")
            self._check_range("KV write", write_at, seq)
        t0 = time.perf_counter()
        out = self._run(graph, input_ids, position_ids, attention_mask, past_length, write_at)
        self.engine_seconds += time.perf_counter() - t0
        return out

    def _check_feed(self, graph: GraphName, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray, past: int) -> int:
        if ids.ndim != 2 or ids.shape[0] != 1 or ids.dtype != np.int64:
            raise RefusionError(f"input_ids must be int64 [1, seq]; got {ids.dtype} {list(ids.shape)}.")
        seq = ids.shape[1]
        if pos.shape != ids.shape or pos.dtype != np.int64:
            raise RefusionError(f"position_ids must be int64 {list(ids.shape)}; got {pos.dtype} {list(pos.shape)}.")
        if mask.shape != (1, seq, past + seq) or mask.dtype != np.bool_:
            raise RefusionError(
                f"attention_mask must be bool [1, {seq}, {past + seq}] (past {past} + seq {seq}); "
                f"got {mask.dtype} {list(mask.shape)}."
            )
        self._check_range("past", 0, past)
        if int(pos.max(initial=0)) >= self.manifest.max_positions:
            raise RefusionError(
                f"position id {int(pos.max())} exceeds the model's max_position_embeddings "
                f"{self.manifest.max_positions}; shorten the prompt or gen_length."
            )
        return seq

    def _check_range(self, what: str, start: int, length: int) -> None:
        if start < 0 or start + length > self.kv_capacity:
            raise RefusionError(
                f"{what} [{start}, {start + length}) lies outside the KV cache of {self.kv_capacity} tokens; "
                "allocate_kv() with the request's limit first."
            )

    def _require_active(self) -> None:
        if not self.is_active:
            raise RefusionError(f"{self.name} runner is not active; call activate() or use it as a context manager.")

    # -- what a backend implements -----------------------------------------------------
    @abstractmethod
    def _activate(self) -> None: ...

    @abstractmethod
    def _deactivate(self) -> None: ...

    @abstractmethod
    def _allocate_kv(self, capacity: int) -> None: ...

    @abstractmethod
    def _move_kv(self, src: int, dst: int, length: int) -> None: ...

    @abstractmethod
    def _run(
        self, graph: GraphName, input_ids: np.ndarray, position_ids: np.ndarray,
        attention_mask: np.ndarray, past_length: int, write_at: int | None,
    ) -> dict[str, np.ndarray]: ...


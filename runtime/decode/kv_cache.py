"""KV cache bookkeeping: which tokens of the runner's preallocated buffer are committed.

Layout (tokens along the buffer):
    [ committed prefix C | infill row scratch: row r at C + r*k | staging for a pass's new KV ]
The committed prefix is always contiguous and starts at 0, so feeding it as past is a
view. Slots commit out of order in position, but in order in the buffer, each token with
its true position id: this is ReFusion's "reorder", and why every forward is causal.
The device work (writes, moves) is the runner's; this class only decides where, and hands
out the moves it needs as `KVMove` steps (decode/steps.py), in request-local coordinates.
"""

from __future__ import annotations

from collections.abc import Iterator

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.decode.steps import KVMove


class KVCache:
    def __init__(self, capacity: int, committed: int = 0):
        self.capacity = capacity
        self.length = committed  # committed tokens, [0, length): a cached prompt prefix to begin with

    def commit(self, count: int) -> None:
        """The `count` tokens already written right after the prefix become committed."""
        if count < 0 or self.length + count > self.capacity:
            raise RefusionError(f"cannot commit {count} tokens at {self.length}: KV capacity is {self.capacity}.")
        self.length += count

    def row_start(self, row: int, stride: int) -> int:
        """Where infill row `row`'s private tokens live (right after the prefix)."""
        return self.length + row * stride

    def staging(self, rows: int, stride: int) -> int:
        """Where a pass over rows writes its new KV before it is moved into each row."""
        return self.length + rows * stride

    def place_windows(self, scratch_rows: int, rows: int, stride: int, offset: int, window: int) -> Iterator[KVMove]:
        """Move each of `rows` rows' `window` new tokens from staging into the row at `offset`."""
        stage = self.staging(scratch_rows, stride)
        for r in range(rows):
            yield KVMove(stage + r * window, self.row_start(r, stride) + offset, window)

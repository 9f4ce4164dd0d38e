"""The KV regions every Runner keeps, behind one interface (`KVPool`), in host memory or on the device; and the
GPU runners' named scratch buffers.

A pool holds one KV region per request in flight (and any added: the prefix cache's), each region its caches (K of
every layer, then V of every layer: the graphs' past order), `capacity` tokens of [kv_heads, head_dim] each. The
Runner's KV methods (allocate_kv, move_kv, add_region, copy_kv, kv_to_host, kv_from_host) check their arguments
and call the pool, whichever it is; a backend only makes its pool at activation and frees it at deactivation.

`HostKVPool` (onnxruntime's CPU provider) keeps a region in one numpy array, so a forward feeds a region's committed
prefix as views of it, and a token range of every cache is one copy. `DeviceKVPool` keeps a region in one device
buffer laid out layer-major, each cache at a pitch rounded up to 256 bytes (TensorRT's alignment). So a cache's
committed prefix is contiguous, bound in place as a [1, past, H, D] tensor, and a token range of every cache is one
strided copy (cudaMemcpy2DAsync: a row per cache, the region's pitch apart): a backend that takes a batch as one
[rows, past, H, D] tensor per cache gets it by `gather` (one copy per row, from its region into the batch buffer)
and gives the present back by `scatter` (one copy per row, into its region at its write_at); `place` writes one
staged present. Each returns the copies and bytes it queued, which the runners count per forward (RunnerStats).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from refusion.runtime.core.contract import kv_names
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.runners.cuda import DeviceBuffer, Stream

if TYPE_CHECKING:
    from refusion.runtime.runners.rows import RowFeed

ALIGNMENT = 256  # bytes: TensorRT's requirement for tensor addresses (every cache of a region starts at one)


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to ALIGNMENT (tensors packed in one buffer)."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class Copied(NamedTuple):
    """What KV copies a pool call queued: calls and bytes."""

    copies: int
    bytes: int


class KVPool(ABC):
    """`regions` KV regions of `num_layers` layers' K and V, [kv_heads, head_dim] a token, in `dtype`; each
    empty until `allocate`, and `add_region` adds more until `free`."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: np.dtype, regions: int):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype = np.dtype(dtype)
        self.token_bytes = kv_heads * head_dim * self.dtype.itemsize  # one token's K (or V) in one layer
        self.regions = regions  # the requests'

    @cached_property  # names fixed by the export: not rebuilt per forward
    def past_names(self) -> list[str]:
        """The graph inputs of a region's caches, in their order."""
        return kv_names(self.num_layers, past=True)

    @cached_property
    def present_names(self) -> list[str]:
        """The graph outputs of a region's caches, in their order."""
        return kv_names(self.num_layers, past=False)

    @property
    def caches(self) -> int:
        """Caches per region: a K and a V per layer."""
        return 2 * self.num_layers

    @abstractmethod
    def allocate(self, region: int, capacity: int) -> None:
        """Fresh caches of `capacity` tokens for `region` (what it held is gone)."""

    @abstractmethod
    def add_region(self) -> None:
        """One more region (empty until `allocate`), at the next index."""

    @abstractmethod
    def copy(self, src_region: int, src: int, dst_region: int, dst: int, length: int) -> Copied:
        """KV of tokens [src, src + length) of one region to [dst, dst + length) of another, in every cache."""

    @abstractmethod
    def move(self, region: int, src: int, dst: int, length: int) -> None:
        """KV of tokens [src, src + length) to [dst, dst + length) in every cache; the ranges may overlap."""

    @abstractmethod
    def to_host(self, region: int, start: int, length: int) -> dict[str, np.ndarray]:
        """KV of tokens [start, start + length) per cache, on the host, by present name (bfloat16 as its raw
        uint16 bits)."""

    @abstractmethod
    def from_host(self, region: int, start: int, past: dict[str, np.ndarray]) -> None:
        """Write a feed's past (checked by `past_lengths`) into `region` at token `start`."""

    @abstractmethod
    def free(self) -> None:
        """Every region's memory; the regions added since go too."""

    def past_lengths(self, past: dict[str, np.ndarray]) -> list[int]:
        """The tokens each layer's past in `past` holds, once every one is checked to be of this pool's
        dtype and [1, length, kv_heads, head_dim] (what `from_host` takes)."""
        for name in self.past_names:
            array = past[name]
            if array.dtype != self.dtype or array.shape[0] != 1 or array.shape[2:] != (self.kv_heads, self.head_dim):
                raise RefusionError(f"{name} must be {self.dtype} [1, length, {self.kv_heads}, {self.head_dim}]; "
                                    f"got {array.dtype} {list(array.shape)}.")
        return [past[name].shape[1] for name in self.past_names]


class HostKVPool(KVPool):
    """The regions in host memory: a region is one [caches, 1, capacity, kv_heads, head_dim] array, so a forward
    feeds each cache's first tokens as a view of it, and a token range of every cache (a forward's new KV, a move,
    a copy between regions) is one numpy copy, not one a cache (onnxruntime's CPU provider)."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: np.dtype, regions: int):
        super().__init__(num_layers, kv_heads, head_dim, dtype, regions)
        self._regions: list[np.ndarray | None] = [None] * regions

    def arrays(self, region: int) -> list[np.ndarray]:
        """The region's caches (past_names order), each [1, capacity, kv_heads, head_dim]; none before `allocate`."""
        caches = self._regions[region]
        return [] if caches is None else list(caches)

    def pasts(self, region: int, length: int) -> np.ndarray:
        """Every cache's first `length` tokens, a view [caches, 1, length, kv_heads, head_dim] (past_names order):
        each cache's, contiguous, is the graph's past input."""
        return self._region(region)[:, :, :length]

    def write(self, region: int, at: int, presents: list[np.ndarray]) -> None:
        """Every cache's new tokens ([1, seq, kv_heads, head_dim] each, present_names order) at token `at`."""
        self._region(region)[:, :, at : at + presents[0].shape[1]] = presents

    def allocate(self, region: int, capacity: int) -> None:
        self._regions[region] = np.zeros((self.caches, 1, capacity, self.kv_heads, self.head_dim), self.dtype)

    def add_region(self) -> None:
        self._regions.append(None)

    def copy(self, src_region: int, src: int, dst_region: int, dst: int, length: int) -> Copied:
        self._region(dst_region)[:, :, dst : dst + length] = self._region(src_region)[:, :, src : src + length]
        return Copied(1, self.caches * length * self.token_bytes) if length else Copied(0, 0)

    def move(self, region: int, src: int, dst: int, length: int) -> None:
        caches = self._region(region)
        caches[:, :, dst : dst + length] = caches[:, :, src : src + length]  # numpy copies through a buffer on overlap

    def to_host(self, region: int, start: int, length: int) -> dict[str, np.ndarray]:
        return dict(zip(self.present_names, self._region(region)[:, :, start : start + length].copy()))

    def from_host(self, region: int, start: int, past: dict[str, np.ndarray]) -> None:
        caches = self._region(region)
        for name, cache in zip(self.past_names, caches):
            cache[:, start : start + past[name].shape[1]] = past[name]

    def free(self) -> None:
        self._regions = [None] * self.regions

    def _region(self, region: int) -> np.ndarray:
        caches = self._regions[region]
        assert caches is not None, "the Runner allocates a region before any KV call on it"
        return caches


class DeviceKVPool(KVPool):
    """The regions on the device. With a `stream`, buffers are made on it (copies ordered on it); without, every
    copy returns when done (a framework that runs on its own stream)."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: np.dtype, regions: int,
                 stream: Stream | None = None):
        super().__init__(num_layers, kv_heads, head_dim, dtype, regions)
        self.stream = stream
        self._buffers: list[DeviceBuffer | None] = [None] * regions  # a region's caches, layer-major
        self._pitches: list[int] = [0] * regions  # bytes from one cache of a region to the next

    def addresses(self, region: int) -> list[int]:
        """Where each of the region's caches starts (past_names order), 256-byte aligned."""
        buf, pitch = self._region(region), self._pitches[region]
        return [buf.ptr + j * pitch for j in range(self.caches)]

    def pitch(self, region: int) -> int:
        return self._pitches[region]

    def allocated(self, region: int) -> int:
        """Device bytes the region holds (0 before `allocate`)."""
        buf = self._buffers[region]
        return buf.nbytes if buf is not None else 0

    def allocate(self, region: int, capacity: int) -> None:
        """A fresh buffer of `capacity` tokens a cache for `region`; its old one is freed once queued work is done."""
        if self.stream is not None:
            self.stream.synchronize()  # queued forwards and moves may still use the old buffer
        old = self._buffers[region]
        if old is not None:
            old.free()
        pitch = aligned(capacity * self.token_bytes)
        self._buffers[region] = DeviceBuffer(self.caches * pitch, self.stream)
        self._pitches[region] = pitch

    def add_region(self) -> None:
        """One more region (empty until `allocate`), at the next index."""
        self._buffers.append(None)
        self._pitches.append(0)

    def copy(self, src_region: int, src: int, dst_region: int, dst: int, length: int) -> Copied:
        """KV of tokens [src, src + length) of one region to [dst, dst + length) of another, in every cache: one
        copy (on the pool's stream when it has one: ordered before the next forward, as a move is)."""
        t = self.token_bytes
        self._region(src_region).copy_rows_to(self._region(dst_region), length * t, self.caches, src * t,
                                              self._pitches[src_region], dst * t, self._pitches[dst_region])
        return Copied(1, self.caches * length * t) if length else Copied(0, 0)

    def move(self, region: int, src: int, dst: int, length: int) -> None:
        """KV of tokens [src, src + length) to [dst, dst + length) in every cache (one call, two where the
        ranges overlap)."""
        t = self.token_bytes
        self._region(region).copy_rows_within(src * t, dst * t, length * t, self.caches, self._pitches[region])

    def gather(self, rows: list[RowFeed], past: int, into: DeviceBuffer, stride: int,
               stream: Stream | None = None) -> Copied:
        """Each row's past from its region into `into`: cache j (past_names order) at j * stride, row b of it at
        b * past tokens; one copy a row. Ordered on `stream` when given (the caller synchronizes it)."""
        t, copies, nbytes = self.token_bytes, 0, 0
        for b, r in enumerate(rows):
            if r.past:
                self._region(r.region).copy_rows_to(into, r.past * t, self.caches, 0, self._pitches[r.region],
                                                    b * past * t, stride, stream=stream)
                copies, nbytes = copies + 1, nbytes + self.caches * r.past * t
        return Copied(copies, nbytes)

    def scatter(self, rows: list[RowFeed], seq: int, source: DeviceBuffer, stride: int,
                stream: Stream | None = None) -> Copied:
        """Each infiller row's own new tokens from `source` (laid out as `gather` lays out pasts, seq tokens a
        row) into its region at its write_at, one copy a row; padding stays behind."""
        copies, nbytes = 0, 0
        for b, r in enumerate(rows):
            if r.write_at is not None:
                done = self.place(r.region, r.write_at, source, r.input_ids.shape[1], b * seq * self.token_bytes,
                                  stride, stream)
                copies, nbytes = copies + done.copies, nbytes + done.bytes
        return Copied(copies, nbytes)

    def place(self, region: int, write_at: int, source: DeviceBuffer, tokens: int, offset: int, stride: int,
              stream: Stream | None = None) -> Copied:
        """`tokens` tokens of every cache from `source` (cache j at offset + j * stride) into `region` at
        `write_at`: one copy."""
        t = self.token_bytes
        source.copy_rows_to(self._region(region), tokens * t, self.caches, offset, stride, write_at * t,
                            self._pitches[region], stream=stream)
        return Copied(1, self.caches * tokens * t) if tokens else Copied(0, 0)

    def to_host(self, region: int, start: int, length: int) -> dict[str, np.ndarray]:
        """KV of tokens [start, start + length) per cache, on the host, by present name (bfloat16 as its
        raw uint16 bits): one copy."""
        t = self.token_bytes
        rows = self._region(region).copy_rows_to_host(length * t, self.caches, start * t, self._pitches[region])
        shape = (1, length, self.kv_heads, self.head_dim)
        return {name: rows[j].view(self.dtype).reshape(shape) for j, name in enumerate(self.present_names)}

    def from_host(self, region: int, start: int, past: dict[str, np.ndarray]) -> None:
        """Write a feed's past (checked by `past_lengths`) into `region` at token `start`."""
        buf, pitch = self._region(region), self._pitches[region]
        for j, name in enumerate(self.past_names):
            buf.copy_from_host(past[name], j * pitch + start * self.token_bytes)

    def free(self) -> None:
        """Every region's buffers; the regions added since go too."""
        if self.stream is not None:
            self.stream.synchronize()  # queued forwards and moves may still use the buffers
        for buf in self._buffers:
            if buf is not None:
                buf.free()
        self._buffers = [None] * self.regions
        self._pitches = [0] * self.regions

    def _region(self, region: int) -> DeviceBuffer:
        buf = self._buffers[region]
        assert buf is not None, f"region {region} holds no KV: allocate it first"
        return buf


class ScratchBuffers:
    """Named device buffers, each grown (never shrunk) to the largest size asked of it. Made on `stream`
    when given, and an outgrown buffer is freed once the stream's queued work is done; without one, the
    caller has waited for every copy before asking again."""

    def __init__(self, stream: Stream | None = None):
        self.stream = stream
        self._buffers: dict[str, DeviceBuffer] = {}

    def get(self, name: str, nbytes: int, zeroed: bool = False) -> DeviceBuffer:
        """The buffer `name`, at least `nbytes`; `zeroed`: set to 0 when (re)allocated (a padded position is
        masked, but 0 x NaN would still be NaN, so padding must hold finite values)."""
        buf = self._buffers.get(name)
        if buf is None or buf.nbytes < nbytes:
            if buf is not None:
                if self.stream is not None:
                    self.stream.synchronize()  # the old buffer may still be read by queued work
                buf.free()
            buf = self._buffers[name] = DeviceBuffer(nbytes, self.stream)
            if zeroed:
                buf.zero()
        return buf

    def __getitem__(self, name: str) -> DeviceBuffer:
        """The buffer `name` as last asked for."""
        return self._buffers[name]

    def free(self) -> None:
        for buf in self._buffers.values():
            buf.free()
        self._buffers = {}

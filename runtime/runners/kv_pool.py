"""Device memory the GPU runners share: every request's KV on the device, and named scratch buffers.

A `DeviceKVPool` holds one KV region per request in flight: a K and a V buffer per layer, `capacity`
tokens of [kv_heads, head_dim] each, so a region's committed prefix is one contiguous block per
layer. A backend that takes a batch as one [rows, past, H, D] tensor gets it by `gather` (each row's
past copied from its region into a batch buffer) and gives the present back by `scatter` (each row's
new tokens copied from the batch's output into its region at its write_at).
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from refusion.runtime.core.contract import kv_names, present_key_name, present_value_name
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.runners.cuda import DeviceBuffer, Stream

if TYPE_CHECKING:
    from refusion.runtime.runners.base import RowFeed


class DeviceKVPool:
    """`regions` KV regions on the device. With a `stream`, buffers are made on it (copies ordered on it);
    without, every copy returns when done (a framework that runs on its own stream)."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: np.dtype, regions: int,
                 stream: Stream | None = None):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.stream = np.dtype(dtype), stream
        self.token_bytes = kv_heads * head_dim * self.dtype.itemsize  # one token's K (or V) in one layer
        self.regions = regions  # the requests'; `add_region` adds more until `free`
        self._keys: list[list[DeviceBuffer]] = [[] for _ in range(regions)]  # [region][layer]
        self._values: list[list[DeviceBuffer]] = [[] for _ in range(regions)]

    @cached_property  # names fixed by the export: not rebuilt per forward
    def past_names(self) -> list[str]:
        """The graph inputs of `caches()`, in its order."""
        return kv_names(self.num_layers, past=True)

    @cached_property
    def present_names(self) -> list[str]:
        """The graph outputs of `caches()`, in its order."""
        return kv_names(self.num_layers, past=False)

    def caches(self, region: int | None = None) -> list[DeviceBuffer]:
        """A region's K buffers then its V buffers, by layer (every region's when `region` is None)."""
        regions = range(len(self._keys)) if region is None else (region,)
        return [buf for r in regions for buf in self._keys[r] + self._values[r]]

    def allocate(self, region: int, capacity: int) -> None:
        """Fresh buffers of `capacity` tokens for `region`; its old ones are freed once queued work is done."""
        if self.stream is not None:
            self.stream.synchronize()  # queued forwards and moves may still use the old buffers
        for buf in self.caches(region):
            buf.free()
        size = capacity * self.token_bytes
        self._keys[region] = [DeviceBuffer(size, self.stream) for _ in range(self.num_layers)]
        self._values[region] = [DeviceBuffer(size, self.stream) for _ in range(self.num_layers)]

    def add_region(self) -> None:
        """One more region (empty until `allocate`), at the next index."""
        self._keys.append([])
        self._values.append([])

    def copy(self, src_region: int, src: int, dst_region: int, dst: int, length: int) -> None:
        """KV of tokens [src, src + length) of one region to [dst, dst + length) of another, in every layer (on
        the pool's stream when it has one: ordered before the next forward, as a move is)."""
        t = self.token_bytes
        for source, target in zip(self.caches(src_region), self.caches(dst_region)):
            source.copy_to(target, length * t, src * t, dst * t)

    def move(self, region: int, src: int, dst: int, length: int) -> None:
        """KV of tokens [src, src + length) to [dst, dst + length) in every layer; the ranges may overlap."""
        t = self.token_bytes
        for buf in self.caches(region):
            buf.copy_within(src * t, dst * t, length * t)

    def gather(self, rows: list[RowFeed], past: int, into: DeviceBuffer, stride: int,
               stream: Stream | None = None) -> None:
        """Each row's past from its region into `into`: cache j (caches() order) at j * stride, row b of it at
        b * past tokens. Ordered on `stream` when given (the caller synchronizes it)."""
        t = self.token_bytes
        for b, r in enumerate(rows):
            for j, cache in enumerate(self.caches(r.region)):
                cache.copy_to(into, r.past * t, dst_offset=j * stride + b * past * t, stream=stream)

    def scatter(self, rows: list[RowFeed], seq: int, source: DeviceBuffer, stride: int,
                stream: Stream | None = None) -> None:
        """Each infiller row's own new tokens from `source` (laid out as `gather` lays out pasts, seq tokens a
        row) into its region at its write_at; padding stays behind."""
        t = self.token_bytes
        for b, r in enumerate(rows):
            if r.write_at is None:
                continue
            tokens = r.input_ids.shape[1] * t
            for j, cache in enumerate(self.caches(r.region)):
                source.copy_to(cache, tokens, src_offset=j * stride + b * seq * t, dst_offset=r.write_at * t,
                               stream=stream)

    def to_host(self, region: int, start: int, length: int) -> dict[str, np.ndarray]:
        """KV of tokens [start, start + length) per layer, on the host, by present name (bfloat16 as its
        raw uint16 bits)."""
        shape, t = (1, length, self.kv_heads, self.head_dim), self.token_bytes
        out = {}
        for i in range(self.num_layers):
            out[present_key_name(i)] = self._keys[region][i].copy_to_host(shape, self.dtype, start * t)
            out[present_value_name(i)] = self._values[region][i].copy_to_host(shape, self.dtype, start * t)
        return out

    def past_lengths(self, past: dict[str, np.ndarray]) -> list[int]:
        """The tokens each layer's past in `past` holds, once every one is checked to be of this pool's
        dtype and [1, length, kv_heads, head_dim] (what `from_host` takes)."""
        for name in self.past_names:
            array = past[name]
            if array.dtype != self.dtype or array.shape[0] != 1 or array.shape[2:] != (self.kv_heads, self.head_dim):
                raise RefusionError(f"{name} must be {self.dtype} [1, length, {self.kv_heads}, {self.head_dim}]; "
                                    f"got {array.dtype} {list(array.shape)}.")
        return [past[name].shape[1] for name in self.past_names]

    def from_host(self, region: int, start: int, past: dict[str, np.ndarray]) -> None:
        """Write a feed's past (checked by `past_lengths`) into `region` at token `start`."""
        for name, cache in zip(self.past_names, self.caches(region)):
            cache.copy_from_host(past[name], start * self.token_bytes)

    def free(self) -> None:
        """Every region's buffers; the regions added since go too."""
        for buf in self.caches():
            buf.free()
        self._keys = [[] for _ in range(self.regions)]
        self._values = [[] for _ in range(self.regions)]


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

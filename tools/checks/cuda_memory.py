"""The CUDA check for a GPU machine that has CUDA and cuda-bindings but neither TensorRT nor onnxruntime-gpu:
the runners' device memory code (runtime/runners/cuda.py, kv_pool.py) on real memory, every result against numpy.

    python -m refusion.tools.checks.gpu --cuda-only

One PASS/FAIL line a check, exit 0 only if all pass (seconds on any GPU; the largest buffer is the pitch check's,
just over the device's memPitch, 2 GiB on current GPUs, skipped where less memory is free):
- a stream's synchronize waits for the work queued before it (large device copies, then a pinned read of them);
- the heads' path: several device buffers read into one pinned buffer at their offsets, one wait for all;
- DeviceKVPool with a stream (TensorRT's) and without (onnxruntime CUDA's: overlapping moves through the shared
  staging stream): pasts uploaded and read back, moves (apart, overlapping forwards and backwards), a copy between
  regions, a batch's pasts gathered, its presents scattered back, a staged present placed;
- inputs_embeds: a host table's rows gathered into pinned memory and uploaded from it, the buffer grown between
  two forwards as the TensorRT runner grows it;
- a cudaMemcpy2DAsync pitch above the device's memPitch fails as a RefusionError naming the call.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import numpy as np

from refusion.runtime.core.embeddings import Embeddings, EmbeddingTable
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.runners.cuda import (
    DeviceBuffer,
    HostBuffer,
    Stream,
    cudart,
    device_info,
    device_properties,
    driver_cuda,
    runtime_cuda,
)
from refusion.runtime.runners.kv_pool import ALIGNMENT, DeviceKVPool, aligned
from refusion.runtime.runners.rows import RowFeed
from refusion.tools.checks.verdict import line

LAYERS, KV_HEADS, HEAD_DIM = 3, 2, 64  # 256 bytes a token and cache in fp16: aligned, as real models' are


def run() -> bool:
    """Every check, a PASS/FAIL (or SKIP) line each after an INFO line of the versions; True when all pass."""
    t0 = time.perf_counter()
    try:
        cudart()  # cuda-python's CUDA against the driver's, in one line
    except RefusionError as e:
        return line(False, f"cuda-python: {e}")
    print(f"INFO: {versions()}", flush=True)
    ok = True
    for name, check in CHECKS:
        try:
            what = check()
        except (AssertionError, RefusionError) as e:  # a wrong result, or a CUDA call that failed
            ok &= line(False, f"{name}: {e}")
        else:
            if what.startswith("skipped"):
                print(f"SKIP: {name}: {what}", flush=True)
            else:
                line(True, f"{name}: {what}")
    return line(ok, f"CUDA check ({time.perf_counter() - t0:.1f} s)")


def versions() -> str:
    """The driver's CUDA, cuda-python's and the GPU, in one line."""
    bindings = next((f"{name} {metadata.version(name)}" for name in ("cuda-bindings", "cuda-python")
                     if _installed(name)), "cuda-python")
    driver, runtime = driver_cuda(), runtime_cuda()
    gpu, capability = device_info()
    props = device_properties()
    return (f"driver CUDA {driver[0]}.{driver[1]}; {bindings} (CUDA runtime {runtime[0]}.{runtime[1]}); {gpu}, "
            f"sm {capability}, {'integrated' if props.integrated else 'discrete'}, memPitch {props.memPitch}")


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def _equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    if got.shape != want.shape or not np.array_equal(got, want):
        wrong = int(np.count_nonzero(got != want)) if got.shape == want.shape else f"shape {got.shape}: all"
        raise AssertionError(f"{what}: {wrong} of {want.size} values differ from numpy's")


def stream_waits() -> str:
    """64 MiB copied device to device 8 times, then read into pinned memory, all queued; after synchronize the
    pinned bytes must be the source's (one that returned early would leave the zeros written there before)."""
    nbytes = 64 << 20
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    stream = Stream()
    src, dst, host = DeviceBuffer(nbytes, stream), DeviceBuffer(nbytes, stream), HostBuffer(nbytes)
    try:
        host.view((nbytes,), np.uint8)[:] = 0
        src.copy_from_host(data)
        for _ in range(8):  # enough work to be in flight when the host waits
            src.copy_to(dst, nbytes, stream=stream)
        dst.copy_to_pinned(host, nbytes)
        stream.synchronize()
        _equal(host.array((nbytes,), np.uint8), data, "pinned bytes after synchronize")
    finally:
        _release(stream, src, dst, host)
    return f"{nbytes >> 20} MiB copied 8 times and read into pinned memory behind one wait"


def pinned_heads() -> str:
    """The heads' path (TensorRTRunner._fetch): each output copied into one pinned buffer at an 8-byte aligned
    offset behind the forward's work, one wait, each read back."""
    rng = np.random.default_rng(1)
    heads: list[np.ndarray] = [rng.integers(0, 1 << 40, (1, 7)), rng.random((1, 7), np.float32),
                               rng.random((1, 7, 64), np.float32)]
    stream = Stream()
    buffers = [DeviceBuffer(h.nbytes, stream) for h in heads]
    offsets = [0]
    for h in heads:
        offsets.append(offsets[-1] + -(-h.nbytes // 8) * 8)
    host = HostBuffer(offsets[-1])
    try:
        for buf, h, at in zip(buffers, heads, offsets):
            buf.copy_from_host(h)
            buf.copy_to_pinned(host, h.nbytes, dst_offset=at)
        stream.synchronize()
        for h, at in zip(heads, offsets):
            _equal(host.array(h.shape, h.dtype, at), h, f"{h.dtype} output at offset {at}")
    finally:
        _release(stream, *buffers, host)
    return f"{len(heads)} outputs ({offsets[-1]} bytes) behind one wait"


class _Regions:
    """A DeviceKVPool's regions beside numpy arrays [caches, capacity, kv_heads, head_dim] that get every
    change the pool is asked to make, to compare the device's bytes with."""

    def __init__(self, pool: DeviceKVPool, capacities: list[int], rng: np.random.Generator):
        self.pool = pool
        self.kv: list[np.ndarray] = []
        for region, capacity in enumerate(capacities):
            pool.allocate(region, capacity)
            kv = rng.standard_normal((pool.caches, capacity, KV_HEADS, HEAD_DIM)).astype(pool.dtype)
            pool.from_host(region, 0, {name: kv[j][None] for j, name in enumerate(pool.past_names)})
            self.kv.append(kv)

    def check(self, what: str) -> None:
        if self.pool.stream is not None:
            self.pool.stream.synchronize()
        for region, kv in enumerate(self.kv):
            got = self.pool.to_host(region, 0, kv.shape[1])
            _equal(np.stack([got[name][0] for name in self.pool.present_names]), kv, f"{what}, region {region}")


def kv_pool(with_stream: bool) -> Callable[[], str]:
    """DeviceKVPool's copies against numpy: on TensorRT's (a stream, copies ordered on it) or onnxruntime CUDA's
    (stream-less: each copy done on return, overlapping moves staged through the shared stream)."""

    def check() -> str:
        rng = np.random.default_rng(2)
        stream = Stream() if with_stream else None
        pool = DeviceKVPool(LAYERS, KV_HEADS, HEAD_DIM, np.dtype(np.float16), 3, stream)
        scratch: list[DeviceBuffer] = []
        try:
            regions = _Regions(pool, [50, 37, 64], rng)
            regions.check("pasts uploaded")
            for src, dst, n, how in ((0, 30, 10, "apart"), (5, 8, 20, "overlapping forwards"),
                                     (10, 2, 20, "overlapping backwards")):
                pool.move(0, src, dst, n)
                regions.kv[0][:, dst:dst + n] = regions.kv[0][:, src:src + n].copy()
                regions.check(f"move {how} ({src} -> {dst}, {n} tokens)")
            pool.copy(0, 3, 1, 20, 12)
            regions.kv[1][:, 20:32] = regions.kv[0][:, 3:15]
            regions.check("copy between regions")
            scratch += _gather_and_scatter(pool, regions, rng, stream)
            scratch.append(_place(pool, regions, rng, stream))
        finally:
            pool.free()
            _release(stream, *scratch)
        return "upload, read back, 3 moves, a copy between regions, gather, scatter and place of 3 regions"

    return check


def _rows(pasts: list[int], seq: int) -> list[RowFeed]:
    """Feeds of a batch as the pool reads them: each region's past and where its present goes."""
    return [RowFeed(np.zeros((1, seq), np.int64), np.zeros((1, seq), np.int64), np.ones((1, seq, past + seq), bool),
                    past, past, region) for region, past in enumerate(pasts)]


def _gather_and_scatter(pool: DeviceKVPool, regions: _Regions, rng: np.random.Generator,
                        stream: Stream | None) -> list[DeviceBuffer]:
    """A packed forward's copies: each row's past into one [rows, longest past] buffer per cache, then each row's
    new tokens from a [rows, seq] buffer per cache into its region at its write_at."""
    pasts, seq = [20, 33, 7], 4
    rows, t, longest = _rows(pasts, seq), pool.token_bytes, max(pasts)
    stride = aligned(len(rows) * longest * t)
    gathered = DeviceBuffer(pool.caches * stride, stream)
    gathered.zero()
    pool.gather(rows, longest, gathered, stride, stream)
    if stream is not None:
        stream.synchronize()
    got = gathered.copy_to_host((pool.caches, stride), np.uint8)[:, : len(rows) * longest * t]
    got = got.view(np.float16).reshape(pool.caches, len(rows), longest, KV_HEADS, HEAD_DIM)
    for b, past in enumerate(pasts):
        _equal(got[:, b, :past], regions.kv[b][:, :past], f"gathered past of row {b}")
    present_stride = aligned(len(rows) * seq * t)
    presents = DeviceBuffer(pool.caches * present_stride, stream)
    new = rng.standard_normal((pool.caches, len(rows), seq, KV_HEADS, HEAD_DIM)).astype(np.float16)
    for j in range(pool.caches):
        presents.copy_from_host(new[j], j * present_stride)
    pool.scatter(rows, seq, presents, present_stride, stream)
    for b, past in enumerate(pasts):
        regions.kv[b][:, past:past + seq] = new[:, b]
    regions.check("presents scattered")
    return [gathered, presents]


def _place(pool: DeviceKVPool, regions: _Regions, rng: np.random.Generator, stream: Stream | None) -> DeviceBuffer:
    """A present staged apart (an unaligned write or a planner's scratch) placed into region 2 at token 41."""
    tokens, stride = 5, aligned(5 * pool.token_bytes)
    staged = DeviceBuffer(pool.caches * stride, stream)
    new = rng.standard_normal((pool.caches, tokens, KV_HEADS, HEAD_DIM)).astype(np.float16)
    for j in range(pool.caches):
        staged.copy_from_host(new[j], j * stride)
    pool.place(2, 41, staged, tokens, 0, stride, stream)
    regions.kv[2][:, 41:41 + tokens] = new
    regions.check("staged present placed")
    return staged


def embeds_upload() -> str:
    """inputs_embeds as the TensorRT runner feeds a host table: the rows gathered from the mapped table straight
    into pinned memory, uploaded on the stream from there; the next, larger forward grows the pinned buffer once
    the stream is done with the old one."""
    vocab, hidden = 512, 96
    table = np.random.default_rng(3).standard_normal((vocab, hidden)).astype(np.float16)
    stream = Stream()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "embeddings.bin"
        path.write_bytes(table.tobytes())
        rows = EmbeddingTable(path, Embeddings("host", "float16", (vocab, hidden)))
        host: HostBuffer | None = None
        uploaded: list[DeviceBuffer] = []
        try:
            for seq in (7, 300):
                ids = np.random.default_rng(seq).integers(0, vocab, (1, seq))
                nbytes = ids.size * hidden * 2
                if host is None or host.nbytes < nbytes:
                    if host is not None:
                        stream.synchronize()  # the upload from the old buffer is done before it is freed
                        host.free()
                    host = HostBuffer(nbytes)
                device = DeviceBuffer(nbytes, stream)
                uploaded.append(device)
                device.copy_from_host(rows.gather(ids, out=host.view((*ids.shape, hidden), np.float16)))
                stream.synchronize()
                _equal(device.copy_to_host((*ids.shape, hidden), np.float16), table[ids], f"{seq} rows uploaded")
        finally:
            _release(stream, *uploaded, *([host] if host is not None else []))
            rows.close()
    return "7 and 300 rows gathered into pinned memory and uploaded from it"


def pitch_limit() -> str:
    """A strided copy whose destination pitch exceeds memPitch: cudaMemcpy2DAsync refuses it, and the runners
    say so in a RefusionError naming the call (every pitch the runners use is far below it)."""
    limit = int(device_properties().memPitch)
    pitch = aligned(limit + 1)
    free = int(cudart().cudaMemGetInfo()[1])
    if pitch + ALIGNMENT > free // 2:
        return f"skipped: memPitch {limit} needs a {pitch + ALIGNMENT}-byte buffer, {free} bytes are free"
    stream = Stream()
    src, dst = DeviceBuffer(2 * ALIGNMENT, stream), DeviceBuffer(pitch + ALIGNMENT, stream)
    try:
        src.copy_rows_to(dst, ALIGNMENT, 2, 0, ALIGNMENT, 0, pitch, stream=stream)
        stream.synchronize()
    except RefusionError as e:
        if "cudaMemcpy2DAsync" not in str(e):
            raise AssertionError(f"the refusal names another call: {e}") from e
        return f"pitch {pitch} > memPitch {limit} refused: {e}"
    finally:
        _release(stream, src, dst)
    raise AssertionError(f"a copy at pitch {pitch} > memPitch {limit} was not refused")


def _release(stream: Stream | None, *buffers: DeviceBuffer | HostBuffer) -> None:
    """Free `buffers` once the stream's work is done, then the stream."""
    if stream is not None:
        stream.synchronize()
    for buf in buffers:
        buf.free()
    if stream is not None:
        stream.close()


CHECKS: tuple[tuple[str, Callable[[], str]], ...] = (
    ("stream synchronize waits for queued work", stream_waits),
    ("heads into pinned memory", pinned_heads),
    ("KV pool on a stream (TensorRT)", kv_pool(with_stream=True)),
    ("KV pool without a stream (onnxruntime CUDA)", kv_pool(with_stream=False)),
    ("inputs_embeds through pinned memory", embeds_upload),
    ("pitch above memPitch", pitch_limit),
)

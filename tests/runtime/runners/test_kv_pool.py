"""The device KV pool both GPU runners hold, on the fake cuda-python (tests/fakes.py): regions (one buffer each,
its caches layer-major at an aligned pitch), moves, the gather / scatter of packed rows (one copy a row, counted),
host round trips, scratch buffers; with a stream (TensorRT) and without (onnxruntime CUDA, whose copies each
return when done). The CPU runner's host pool does what the device pool does, through the same interface."""

from __future__ import annotations

import numpy as np
import pytest

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.runners.cuda import Stream
from refusion.runtime.runners.kv_pool import DeviceKVPool, HostKVPool, KVPool, ScratchBuffers
from refusion.runtime.runners.rows import RowFeed

LAYERS, HEADS, DIM = 2, 2, 4  # 32 bytes a token in fp32


def _pool(stream: Stream | None, regions: int = 2) -> DeviceKVPool:
    return DeviceKVPool(LAYERS, HEADS, DIM, np.dtype(np.float32), regions, stream)


def _past(length: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"past_key_values.{i}.{kind}": rng.standard_normal((1, length, HEADS, DIM)).astype(np.float32)
            for i in range(LAYERS) for kind in ("key", "value")}


def _row(region: int, past: int, seq: int, write_at: int | None) -> RowFeed:
    ids = np.zeros((1, seq), np.int64)
    return RowFeed(ids, ids, np.ones((1, seq, past + seq), bool), past, write_at, region)


@pytest.fixture(params=["stream", "stream-less"])
def stream(request, fakes):
    own = Stream() if request.param == "stream" else None
    yield own
    if own is not None:
        own.close()


def test_regions_hold_what_is_written_and_moves_may_overlap(stream, fakes):
    pool = _pool(stream)
    pool.allocate(0, 10)
    pool.allocate(1, 10)
    assert pool.caches == 2 * LAYERS and pool.token_bytes == HEADS * DIM * 4
    pitch = pool.pitch(1)
    assert pitch == 512 and pool.allocated(1) == 2 * LAYERS * pitch  # 10 x 32 bytes, rounded up to 256
    addresses = pool.addresses(1)
    assert addresses == [addresses[0] + j * pitch for j in range(2 * LAYERS)] and addresses[0] % 256 == 0
    past = _past(6, seed=0)
    assert pool.past_lengths(past) == [6] * 2 * LAYERS
    pool.from_host(1, 2, past)
    got = pool.to_host(1, 2, 6)
    for name, array in past.items():
        np.testing.assert_array_equal(got[name.replace("past_key_values", "present")], array)
    calls = fakes[1].copies_2d
    pool.move(1, 2, 4, 6)  # [2, 8) -> [4, 10): overlapping, staged
    assert fakes[1].copies_2d == calls + 2  # every cache at once, through the scratch and back
    moved = pool.to_host(1, 4, 6)
    for name, array in past.items():
        np.testing.assert_array_equal(moved[name.replace("past_key_values", "present")], array)
    pool.move(1, 4, 0, 3)  # disjoint: one direct copy
    assert fakes[1].copies_2d == calls + 2 + 1 + 1  # and to_host's one
    pool.free()
    if stream is not None:
        stream.synchronize()
    assert pool.allocated(0) == pool.allocated(1) == 0


def test_a_copy_between_regions_is_one_call_whatever_their_pitches(stream, fakes):
    """copy (the prefix cache's copy_kv) moves a token range of every cache from one region to another, an added
    one of another capacity included, in one strided copy; added regions go at free."""
    pool = _pool(stream)
    pool.allocate(0, 10)
    pool.add_region()
    pool.allocate(2, 20)  # the added region: another pitch
    assert pool.pitch(0) != pool.pitch(2)
    past = _past(6, seed=3)
    pool.from_host(0, 1, past)
    calls = fakes[1].copies_2d
    assert pool.copy(0, 1, 2, 12, 6) == (1, 2 * LAYERS * 6 * pool.token_bytes)
    assert pool.copy(0, 1, 2, 12, 0) == (0, 0)
    assert fakes[1].copies_2d == calls + 1
    got = pool.to_host(2, 12, 6)
    for name, array in past.items():
        np.testing.assert_array_equal(got[name.replace("past_key_values", "present")], array)
    pool.free()
    if stream is not None:
        stream.synchronize()
    assert pool.allocated(0) == 0 and len(pool._buffers) == 2  # the added region is gone


def _kv_story(pool: KVPool) -> list[dict[str, np.ndarray]]:
    """The same calls on any pool, and what it reads back after each (of the tokens written: a device region is
    not zeroed): an upload, moves overlapping both ways, a copy into an added region of another capacity."""
    pool.allocate(0, 12)
    pool.allocate(1, 12)
    pool.from_host(0, 1, _past(8, seed=4))
    pool.from_host(1, 0, _past(12, seed=5))
    seen = [pool.to_host(0, 1, 8)]
    pool.move(0, 1, 3, 8)  # forwards, overlapping
    seen.append(pool.to_host(0, 1, 10))
    pool.move(0, 3, 2, 8)  # backwards, overlapping
    seen.append(pool.to_host(0, 1, 10))
    pool.add_region()
    pool.allocate(2, 30)
    assert pool.copy(1, 2, 2, 20, 7).bytes == 2 * LAYERS * 7 * pool.token_bytes
    seen.append(pool.to_host(2, 20, 7))
    seen.append(pool.to_host(1, 0, 12))  # the source is left as it was
    return seen


def test_the_host_pool_reads_back_what_the_device_pool_does(fakes):
    """One interface, two memories: the CPU runner's pool and the GPU runners' give the same KV after the same
    calls (the device one's result checked on its own by the tests above)."""
    host = HostKVPool(LAYERS, HEADS, DIM, np.dtype(np.float32), 2)
    device = _pool(None)
    for got, want in zip(_kv_story(host), _kv_story(device), strict=True):
        assert got.keys() == want.keys() == set(device.present_names)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
    host.free()
    device.free()
    assert host.regions == 2 and [host.arrays(r) for r in range(2)] == [[], []]
    with pytest.raises(IndexError):
        host.arrays(2)  # the added region goes at free, as on the device


def test_a_past_of_another_shape_or_dtype_is_refused(fakes):
    pool = _pool(None)
    past = _past(3, seed=1)
    with pytest.raises(RefusionError, match=r"past_key_values.0.key must be float32 \[1, length, 2, 4\]"):
        pool.past_lengths({**past, "past_key_values.0.key": past["past_key_values.0.key"].astype(np.float16)})


def test_gather_then_scatter_round_trips_each_rows_tokens(stream, fakes):
    """Rows of different pasts gathered into one batch buffer (padded to the longest), then the batch's
    present scattered back: each row's own tokens land at its write_at, padding and planner rows nowhere."""
    pool, scratch = _pool(stream, regions=3), ScratchBuffers(stream)
    pasts = {0: _past(5, 2), 1: _past(3, 3), 2: _past(4, 4)}
    for region, past in pasts.items():
        pool.allocate(region, 16)
        pool.from_host(region, 0, past)
    rows = [_row(0, 5, 2, 5), _row(1, 3, 1, 3), _row(2, 4, 2, None)]  # the last: a planner row, writes nothing
    longest, seq, t = 5, 2, pool.token_bytes
    stride = len(rows) * longest * t
    batch = scratch.get("past", 2 * LAYERS * stride, zeroed=True)
    calls = fakes[1].copies_2d
    assert pool.gather(rows, longest, batch, stride, stream) == (3, 2 * LAYERS * (5 + 3 + 4) * t)
    assert fakes[1].copies_2d == calls + 3  # one a row, whatever the layers
    if stream is not None:
        stream.synchronize()
    for j, name in enumerate(pool.past_names):
        laid = batch.copy_to_host((len(rows), longest, HEADS, DIM), np.float32, j * stride)
        for b, r in enumerate(rows):
            np.testing.assert_array_equal(laid[b, : r.past], pasts[r.region][name][0])
            assert not laid[b, r.past :].any()  # zeroed padding: finite, masked
    before = {region: pool.to_host(region, 0, 16) for region in pasts}
    present_stride = len(rows) * seq * t
    present = scratch.get("present", 2 * LAYERS * present_stride)
    new = np.arange(2 * LAYERS * len(rows) * seq * HEADS * DIM, dtype=np.float32)
    present.copy_from_host(new)
    calls = fakes[1].copies_2d
    assert pool.scatter(rows, seq, present, present_stride, stream) == (2, 2 * LAYERS * (2 + 1) * t)
    assert fakes[1].copies_2d == calls + 2  # the planner row writes nothing
    if stream is not None:
        stream.synchronize()
    written = new.reshape(2 * LAYERS, len(rows), seq, HEADS, DIM)
    for region, r in enumerate(rows):
        after = pool.to_host(region, 0, 16)
        for j, name in enumerate(pool.present_names):
            want = before[region][name].copy()
            if r.write_at is not None:
                n = r.input_ids.shape[1]
                want[0, r.write_at : r.write_at + n] = written[j, region, :n]
            np.testing.assert_array_equal(after[name], want)
    pool.free()
    scratch.free()
    if stream is not None:
        stream.synchronize()
    assert fakes[1].allocations == {}


def test_scratch_grows_never_shrinks_and_zeroes_when_asked(stream, fakes):
    scratch = ScratchBuffers(stream)
    small = scratch.get("x", 64, zeroed=True)
    assert scratch.get("x", 32) is small and scratch["x"] is small
    assert not small.copy_to_host((64,), np.uint8).any()
    grown = scratch.get("x", 128)
    assert grown is not small and grown.nbytes == 128
    assert scratch.get("y", 8).nbytes == 8
    scratch.free()
    with pytest.raises(KeyError):
        scratch["x"]


def test_both_gpu_runners_keep_their_kv_in_the_pool(tiny_export, fakes, tmp_path):
    from refusion.runtime.core.export_manifest import ExportManifest
    from refusion.runtime.runners.tensorrt import TensorRTRunner
    from tests.fakes import CpuBoundCudaRunner
    from tests.helpers import fake_engines

    with CpuBoundCudaRunner(ExportManifest.load(tiny_export), threads=1) as ort, \
            TensorRTRunner.from_dir(fake_engines(tiny_export, tmp_path / "engines")) as trt:
        for runner in (ort, trt):
            runner.allocate_kv(8)
            assert isinstance(runner._kv, DeviceKVPool)
            layers, t = runner.manifest.num_layers, runner._kv.token_bytes
            assert runner._kv.allocated(0) == 2 * layers * -(-8 * t // 256) * 256
    assert fakes[1].allocations == {}

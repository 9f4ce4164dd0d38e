"""The TensorRT Runner on CPU fakes of TensorRT and cuda-python (tests/fakes.py).

The fakes execute the real ONNX graphs over the runner's real pointer arithmetic, so these
tests pin the bindings (past as a view of the cache, present written in place at write_at,
staged when unaligned, an empty past apart from present), profile selection and refusal, the
output-shape check, loading through TensorRT's stream readers, KV moves, the staging of
overlapping copies, and decode parity with the ORT Runner.
What only a GPU shows (kernels, precision, timing) is tools/checks/gpu.py's.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.decode import profile_needs
from refusion.runtime.decode.steps import Tokens
from refusion.runtime.params import DecodeParams
from refusion.runtime.runners import cuda
from refusion.runtime.runners.onnxruntime import OrtRunner
from refusion.runtime.runners.tensorrt import TensorRTRunner
from tests.helpers import MASK_ID, decode_on, fake_engines

pytest.importorskip("onnxruntime")  # the fakes run the graphs on it
pytest.importorskip("transformers")  # the fixtures' checkpoints

PROMPTS = ([5, 17, 42, 99, 7], [200, 3, 3, 64, 81, 12, 150, 9, 31])
LAYOUTS = ((4, 32, 2), (8, 48, 3), (32, 64, 2))  # (slot_size, gen_length, serial blocks)
THRESHOLDS = ((0.9, 0.4), (0.2, 0.7), (0.0, 0.0))


def _decode(runner, prompt, eos, params):
    result = decode_on(runner, Tokens(prompt, MASK_ID, eos), params)
    return result.token_ids, result.stats.branches, result.stats.forwards


def test_decode_parity_with_the_ort_runner(peaky_export, fakes, tmp_path):
    """Planner forwards included: on the TensorRT side they run on the one engine's plan profile."""
    _, cudart = fakes
    engines = fake_engines(peaky_export, tmp_path / "engines")
    ort = OrtRunner(ExportManifest.load(peaky_export), threads=1)
    branches: set[str] = set()
    eos_ids = (-1, 7, 42)
    graphs: list[str] = []
    with TensorRTRunner.from_dir(engines) as trt, ort:
        real_run = trt._run
        trt._run = lambda graph, *args: graphs.append(graph) or real_run(graph, *args)
        for i, ((k, gen, blocks), (st, tt)) in enumerate(itertools.product(LAYOUTS, THRESHOLDS)):
            prompt, eos = PROMPTS[i % 2], eos_ids[i % 3]
            params = DecodeParams(gen_length=gen, slot_size=k, serial_num_blocks=blocks, slot_threshold=st,
                                  token_threshold=tt)
            trt.check_request(len(prompt), profile_needs(params), params.mode)
            ours = _decode(trt, prompt, eos, params)
            assert ours == _decode(ort, prompt, eos, params), (k, gen, blocks, st, tt)
            branches |= set(ours[1])
        ar = DecodeParams(gen_length=20, mode="ar")
        trt.check_request(len(PROMPTS[1]), profile_needs(ar), ar.mode)
        assert _decode(trt, PROMPTS[1], -1, ar) == _decode(ort, PROMPTS[1], -1, ar)
        assert trt._contexts[2].runs == graphs.count("planner") > 0  # the plan profile, every planner forward
        assert trt._contexts[0].runs + trt._contexts[1].runs == graphs.count("infiller")
    assert {"infill_loop", "commit_from_verification"} <= branches
    # 128-byte tokens: odd write offsets went through the aligned staging buffer, KV moves ran on device
    assert ("cudaMemcpyDeviceToDevice", 0) not in cudart.copies
    assert any(kind == "cudaMemcpyDeviceToDevice" for kind, _ in cudart.copies)
    assert cudart.allocations == {}


@pytest.mark.parametrize("head", [False, True], ids=["float-head", "int4-head"])
def test_int4_engine_decodes_as_the_ort_runner(peaky_int4, peaky_int4_head, fakes, tmp_path, monkeypatch, head):
    """An int4 export (block 64; with --quantize-head the lm_head too) builds (plan and op check) and its engine
    decodes token for token as the ORT Runner, both computing fp32 over the dequantized weights (the fake as
    TensorRT's float GEMM does; the ORT Runner's int8-activation level is gpu_check's comparison, not an identity)."""
    from refusion.runtime.runners import ort_session

    monkeypatch.setattr(ort_session, "RUNTIME_ACCURACY_LEVEL", ort_session.EXACT_ACCURACY_LEVEL)
    export = peaky_int4_head if head else peaky_int4[64]
    engines = fake_engines(export, tmp_path / "engines")
    ort = OrtRunner(ExportManifest.load(export), threads=1)
    with TensorRTRunner.from_dir(engines) as trt, ort:
        for prompt, (k, gen, blocks) in zip(PROMPTS, LAYOUTS):
            params = DecodeParams(gen_length=gen, slot_size=k, serial_num_blocks=blocks)
            trt.check_request(len(prompt), profile_needs(params), params.mode)
            ours = _decode(trt, prompt, 7, params)
            assert ours == _decode(ort, prompt, 7, params), (k, gen, blocks)
        ar = DecodeParams(gen_length=20, mode="ar")
        assert _decode(trt, PROMPTS[1], -1, ar) == _decode(ort, PROMPTS[1], -1, ar)


def test_present_lands_in_the_cache_at_write_at(peaky_export, fakes, tmp_path):
    engines = fake_engines(peaky_export, tmp_path / "engines")
    ort = OrtRunner(ExportManifest.load(peaky_export), threads=1)
    ids = np.array([[5, 17, 42, 99, 7, 3]], dtype=np.int64)
    pos = np.arange(6, dtype=np.int64)[None]
    mask = np.tril(np.ones((6, 6), dtype=bool))[None]
    with TensorRTRunner.from_dir(engines) as trt, ort:
        for runner in (trt, ort):
            runner.allocate_kv(40)
        for write_at in (0, 3, 8):  # aligned (0, 8: 128-byte tokens x 2) and staged (3)
            got = trt.run("infiller", ids, pos, mask, 0, write_at)
            want = ort.run("infiller", ids, pos, mask, 0, write_at)
            for name in want:
                np.testing.assert_array_equal(got[name], want[name])
            kv, expected = trt.kv_to_host(write_at, 6), ort.kv_to_host(write_at, 6)
            assert kv.keys() == expected.keys()
            for name in expected:
                np.testing.assert_array_equal(kv[name], expected[name])
        before = trt.kv_to_host(0, 14)
        trt.move_kv(3, 5, 9)  # overlapping, forwards
        after = trt.kv_to_host(5, 9)
        for name in before:
            np.testing.assert_array_equal(after[name], before[name][:, 3:12])


def test_planner_forward_runs_on_the_one_engine_and_leaves_the_cache(peaky_export, fakes, tmp_path):
    """A planner forward runs on the engine's plan profile, returns the planner graph's heads, and
    writes the present KV it computes to scratch apart from the cache, which the next forward may reuse."""
    engines = fake_engines(peaky_export, tmp_path / "engines")
    ort = OrtRunner(ExportManifest.load(peaky_export), threads=1)
    ids = np.array([[5, 17, 42, 99, 7, 3]], dtype=np.int64)
    with TensorRTRunner.from_dir(engines) as trt, ort:
        for runner in (trt, ort):
            runner.allocate_kv(10)
            runner.run("infiller", ids, np.arange(6)[None], np.tril(np.ones((6, 6), bool))[None], 0, 0)
        cache = trt.kv_to_host(0, 10)
        plan = (np.full((1, 4), MASK_ID), np.arange(6, 10)[None], np.ones((1, 4, 10), bool), 6)
        got, want = trt.run("planner", *plan), ort.run("planner", *plan)
        assert got.keys() == want.keys() == {"argmax_ids", "argmax_probs", "top_ids", "top_logprobs"}
        np.testing.assert_array_equal(got["argmax_ids"], want["argmax_ids"])
        np.testing.assert_allclose(got["argmax_probs"], want["argmax_probs"], rtol=1e-6)
        assert [c.runs for c in trt._contexts] == [1, 0, 1]  # prefill, then the plan profile
        for name, array in trt.kv_to_host(0, 10).items():  # the whole cache, [6, 10) included, untouched
            np.testing.assert_array_equal(array, cache[name])
        scratch, plan_context = trt._io["present staging"], trt._contexts[2]
        presents = [ptr for name, ptr in plan_context.addresses.items() if name.startswith("present.")]
        assert len(presents) == 2 * trt.manifest.num_layers
        assert all(scratch.ptr <= ptr < scratch.ptr + scratch.nbytes for ptr in presents)


def test_past_uploaded_from_the_host_reads_back(peaky_export, fakes, tmp_path):
    """kv_from_host writes a feed's past into the cache where kv_to_host reads it; wrong shapes are refused."""
    engines = fake_engines(peaky_export, tmp_path / "engines")
    with TensorRTRunner.from_dir(engines) as trt:
        m = trt.manifest
        trt.allocate_kv(20)
        rng = np.random.default_rng(0)
        past = {f"past_key_values.{i}.{kind}": rng.standard_normal((1, 7, m.kv_heads, m.head_dim)).astype(np.float32)
                for i in range(m.num_layers) for kind in ("key", "value")}
        trt.kv_from_host(3, past)  # 3: an unaligned token offset (128-byte tokens)
        back = trt.kv_to_host(3, 7)
        for name, array in past.items():
            np.testing.assert_array_equal(back[name.replace("past_key_values", "present")], array)
        with pytest.raises(RefusionError, match=r"past_key_values.0.key must be float32 \[1, length, 2, 16\]"):
            trt.kv_from_host(0, {**past, "past_key_values.0.key": past["past_key_values.0.key"][0]})
        with pytest.raises(RefusionError, match=r"KV upload \[15, 22\) lies outside the KV cache of 20 tokens"):
            trt.kv_from_host(15, past)

def test_outside_the_profiles_is_refused_before_device_work(peaky_export, fakes, tmp_path):
    _, cudart = fakes
    engines = fake_engines(peaky_export, tmp_path / "engines")  # max_prompt 16, block 32
    with TensorRTRunner.from_dir(engines) as trt:
        trt.allocate_kv(200)
        copies = len(cudart.copies)
        seq = 33
        ids = np.zeros((1, seq), dtype=np.int64)
        with pytest.raises(RefusionError, match=r"planner forward of 33 tokens.*--max-slots 8 x --slot-size 4"):
            trt.run("planner", ids, ids, np.ones((1, seq, 10 + seq), dtype=bool), 10)
        assert len(cudart.copies) == copies
        with pytest.raises(RefusionError, match="--max-prompt 16"):
            trt.check_request(17, profile_needs(DecodeParams(gen_length=64, slot_size=4, serial_num_blocks=2)), "refusion")
        with pytest.raises(RefusionError, match="--gen-length 80"):
            trt.check_request(5, profile_needs(DecodeParams(gen_length=80, mode="ar")), "ar")
        trt.check_request(5, profile_needs(DecodeParams(gen_length=64, mode="ar")), "ar")


def test_engine_that_does_not_match_refusion_json_is_refused(peaky_export, exports, fakes, tmp_path):
    """An engines dir whose refusion.json describes another model (e.g. copied over by hand)."""
    engines = fake_engines(peaky_export, tmp_path / "engines")
    (engines / "refusion.json").write_text((exports["fp16"] / "refusion.json").read_text())
    with pytest.raises(RefusionError, match="does not match refusion.json"):
        TensorRTRunner.from_dir(engines).activate()


def test_profile_ranges_are_checked_against_engines_json_at_load(peaky_export, fakes, tmp_path):
    """engines.json is not hashed: an edited profile range (same count of profiles; past, or heads) is refused at
    load, naming the profile and both ranges, instead of surfacing later as TensorRT refusing shapes."""
    import json

    engines = fake_engines(peaky_export, tmp_path / "engines")
    with TensorRTRunner.from_dir(engines):
        pass
    raw = json.loads((engines / "engines.json").read_text())
    original = dict(raw["engine"]["profiles"][1])
    raw["engine"]["profiles"][1]["past"] = [0, 20, 200]
    (engines / "engines.json").write_text(json.dumps(raw))
    with pytest.raises(RefusionError, match=r"profile 1 \(decode\) takes past_key_values.0.key from \[1, 0, 2, 16\] "
                                            r"to \[1, 112, 2, 16\] \(opt \[1, 40, 2, 16\]\), but engines.json records "
                                            r"\[1, 0, 2, 16\] to \[1, 200, 2, 16\] \(opt \[1, 20, 2, 16\]\).*Rebuild"):
        TensorRTRunner.from_dir(engines).activate()
    raw["engine"]["profiles"][1]["past"] = original["past"]
    raw["engine"]["profiles"][1]["heads"] = [1, 2, 3]  # the heads range: head_positions carries it
    (engines / "engines.json").write_text(json.dumps(raw))
    with pytest.raises(RefusionError, match=r"profile 1 \(decode\) takes head_positions from \[1, 1\] to "
                                            rf"\[1, {original['heads'][2]}\].*but engines.json records \[1, 1\] to \[1, 3\]"):
        TensorRTRunner.from_dir(engines).activate()
    assert fakes[1].allocations == {}


def _prefill(trt, seq=6, write_at=0):
    ids = np.arange(5, 5 + seq, dtype=np.int64)[None]
    return trt.run("infiller", ids, np.arange(seq, dtype=np.int64)[None], np.tril(np.ones((seq, seq), bool))[None], 0,
                   write_at)


def test_empty_past_is_bound_apart_from_present(peaky_export, fakes, tmp_path):
    """At prefill (past 0, write_at 0) the empty past must not share present's address: the fake
    refuses any input, empty or not, bound where an output is written."""
    engines = fake_engines(peaky_export, tmp_path / "engines")
    with TensorRTRunner.from_dir(engines) as trt:
        trt.allocate_kv(16)
        _prefill(trt)
        context = trt._contexts[0]
        past, present = context.addresses["past_key_values.0.key"], context.addresses["present.0.key"]
        assert past == trt._empty.ptr and present == trt._kv.addresses(0)[0] and past != present


def test_profile_refused_by_tensorrt_names_the_rebuild(peaky_export, fakes, tmp_path, monkeypatch):
    """The binding raises RuntimeError where the C++ call returns false (tests/fakes.py)."""
    from tests.fakes import _Context

    _, cudart = fakes
    engines = fake_engines(peaky_export, tmp_path / "engines")
    with TensorRTRunner.from_dir(engines) as trt, pytest.raises(RuntimeError, match="Error in set optimization"):
        trt._contexts[0].set_optimization_profile_async(3, 0)  # the engine has three profiles
    real = _Context.set_optimization_profile_async
    monkeypatch.setattr(_Context, "set_optimization_profile_async", lambda self, index, stream: real(self, index + 1, stream))
    with pytest.raises(RefusionError, match=r"refused profile 2 \(plan\) of model.engine \(Error in set optimization "
                                            r"profile async.\); rebuild with: refusion-export build"):
        TensorRTRunner.from_dir(engines).activate()
    assert cudart.allocations == {}


def test_output_shapes_are_checked_once_per_shape_and_refused_when_wrong(peaky_export, fakes, tmp_path, monkeypatch):
    from tests.fakes import _Context

    engines = fake_engines(peaky_export, tmp_path / "engines")
    with TensorRTRunner.from_dir(engines) as trt:
        trt.allocate_kv(32)
        for write_at in (0, 0, 8):
            _prefill(trt, write_at=write_at)
        _prefill(trt, seq=7)
        assert trt._contexts[0].shape_queries == 2  # seq 6 and seq 7 over past 0
        for past in (7, 8, 9):  # no output's shape depends on the past, which grows every step
            trt.run("infiller", np.zeros((1, 3), np.int64), np.arange(past, past + 3)[None],
                    np.ones((1, 3, past + 3), bool), past, past)
        assert trt._contexts[1].shape_queries == 1
        trt.run("infiller", np.zeros((1, 3), np.int64), np.arange(10, 13)[None], np.ones((1, 3, 13), bool), 10, 10,
                heads=np.array([[2]]))  # the outputs' shapes do depend on the head count
        assert trt._contexts[1].shape_queries == 2
        real = _Context.get_tensor_shape
        monkeypatch.setattr(_Context, "get_tensor_shape",
                            lambda self, name: (1, 99) if name == "argmax_probs" else real(self, name))
        runs = trt._contexts[0].runs
        with pytest.raises(RefusionError, match=r"model.engine computes outputs of other shapes than its buffers "
                                                r"are sized for \(argmax_probs: engine \[1, 99\], refusion.json \[1, 5\]\); "
                                                r"rebuild with: refusion-export build"):
            _prefill(trt, seq=5)
        assert trt._contexts[0].runs == runs  # refused before running
        monkeypatch.setattr(_Context, "infer_shapes", lambda self: ["position_ids"])
        with pytest.raises(RefusionError, match=r"cannot infer the engine's output shapes: \['position_ids'\]"):
            _prefill(trt, seq=4)


@pytest.mark.parametrize("reader", ["IStreamReaderV2", "IStreamReader"])
def test_engines_are_streamed_from_their_files(peaky_export, fakes, tmp_path, monkeypatch, reader):
    """TensorRT >= 10.7 gets an IStreamReaderV2, 10.1-10.6 an IStreamReader; either hands out views
    of the mapped file, never a copy of the engine, and never reads the file into bytes."""
    trt_module, _ = fakes
    if reader == "IStreamReader":
        monkeypatch.delattr(type(trt_module), "IStreamReaderV2")
    engines = fake_engines(peaky_export, tmp_path / "engines")
    monkeypatch.setattr(type(engines), "read_bytes", lambda self: pytest.fail(f"read_bytes({self})"))
    with TensorRTRunner.from_dir(engines) as trt:
        trt.allocate_kv(16)
        _prefill(trt)
    # the fake reads a 16-byte header, then (V2, after seeking back to the start) the whole engine or (V1) the rest
    rest = (engines / "model.engine").stat().st_size - (16 if reader == "IStreamReader" else 0)
    assert [(asked, got) for asked, got, _ in trt_module.reads] == [(16, 16), (rest, rest)]
    assert {kind for _, _, kind in trt_module.reads} == {"memoryview"}


def test_tensorrt_older_than_10_1_is_refused(fakes, monkeypatch):
    from refusion.runtime.runners.trt_loader import require_tensorrt

    trt, _ = fakes
    require_tensorrt()
    monkeypatch.setattr(trt, "__version__", "10.0.1.6")
    with pytest.raises(RefusionError, match=r"TensorRT 10.0.1.6 is installed; refusion-trt needs TensorRT >= 10.1.*"
                                            r"pip install 'refusion-trt\[trt\]'"):
        require_tensorrt()


def test_stream_less_buffers_share_one_staging_stream_and_scratch(fakes):
    """The onnxruntime CUDA runner's KV buffers have no stream: 72 of them (a 36-layer model) stage
    their overlapping copies through one stream and one scratch buffer, freed with the last of them."""
    _, cudart = fakes
    streams = cudart.streams
    buffers = [cuda.DeviceBuffer(64) for _ in range(72)]
    for buf in buffers:
        buf.copy_from_host(np.arange(64, dtype=np.uint8))
        buf.copy_within(0, 8, 40)
    assert cudart.streams == streams + 1 and len(cudart.allocations) == 72 + 1
    np.testing.assert_array_equal(buffers[-1].copy_to_host((16,), np.uint8), [0, 1, 2, 3, 4, 5, 6, 7, *range(8)])
    for buf in buffers:
        buf.free()
    assert cudart.allocations == {}


def test_scratch_is_freed_only_after_its_queued_copies(fakes):
    """Growing a stream's scratch frees the old one: the stream is synchronized first (the fake
    refuses to free memory that queued work still uses)."""
    _, cudart = fakes
    stream = cuda.Stream()
    buf = cuda.DeviceBuffer(64, stream)
    buf.copy_within(0, 8, 40)  # staged through a 40-byte scratch, queued on the stream
    syncs = cudart.syncs
    buf.copy_within(0, 4, 60)  # needs a larger scratch
    assert cudart.syncs == syncs + 1
    stream.synchronize()
    buf.free()
    stream.close()
    assert cudart.allocations == {}


@pytest.mark.parametrize("stream", [True, False])
def test_device_buffer_copies(fakes, stream):
    _, cudart = fakes
    s = cuda.Stream() if stream else None
    buf = cuda.DeviceBuffer(64, s)
    data = np.arange(64, dtype=np.uint8)
    buf.copy_from_host(data)
    buf.copy_within(0, 8, 40)  # overlapping, dst after src
    expect = data.copy()
    expect[8:48] = data[0:40]
    np.testing.assert_array_equal(buf.copy_to_host((64,), np.uint8), expect)
    buf.copy_within(10, 2, 50)  # overlapping, dst before src
    expect[2:52] = expect[10:60].copy()
    np.testing.assert_array_equal(buf.copy_to_host((64,), np.uint8), expect)
    buf.copy_within(0, 32, 32)  # disjoint: one direct copy
    other = cuda.DeviceBuffer(16, s)
    buf.copy_to(other, 16, src_offset=4)
    np.testing.assert_array_equal(other.copy_to_host((16,), np.uint8), buf.copy_to_host((64,), np.uint8)[4:20])
    with pytest.raises(RefusionError, match=r"bytes \[60, 68\) lie outside the 64-byte buffer"):
        buf.copy_within(0, 60, 8)
    for b in (buf, other):
        b.free()
    if s:
        s.close()
    assert cudart.allocations == {}
    with pytest.raises(RefusionError, match="freed"):
        buf.copy_to_host((1,), np.uint8)


def test_cuda_errors_name_the_call(fakes):
    _, cudart = fakes
    cudart.memory_limit = 100
    with pytest.raises(RefusionError, match=r"cudaMalloc of 1000 bytes failed: cudaErrorMemoryAllocation\. Free GPU"):
        cuda.DeviceBuffer(1000)
    assert cuda.device_info() == ("Fake GPU", "9.0")


def test_missing_cuda_python_names_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_cuda(name, *args, **kwargs):
        if name == "cuda" or name.startswith("cuda."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(cuda, "_CUDART", None)
    monkeypatch.setattr(builtins, "__import__", no_cuda)
    with pytest.raises(RefusionError, match=r"refusion-trt\[trt\]"):
        cuda.cudart()


@pytest.mark.parametrize("integrated", [0, 1])
def test_heads_come_back_behind_one_wait_into_pinned_memory(peaky_export, fakes, tmp_path, integrated):
    """A forward queues its heads' copies into one pinned host buffer and waits once, on an event of the runner's
    non-blocking stream; on an integrated GPU (Jetson) that event blocks the thread instead of spinning."""
    _, cudart = fakes
    cudart.integrated = integrated
    engines = fake_engines(peaky_export, tmp_path / "engines")
    with TensorRTRunner.from_dir(engines) as trt:
        trt.allocate_kv(32)
        _prefill(trt)  # sizes every buffer
        syncs, events, pinned = cudart.syncs, cudart.event_syncs, cudart.pinned_reads
        out = trt.run("infiller", np.array([[7, 8]]), np.array([[6, 7]]), np.ones((1, 2, 8), bool), 6, 8)
        assert (cudart.syncs - syncs, cudart.event_syncs - events) == (1, 1)
        # argmax ids and probabilities, the top-K candidates, input_probs: every head one pinned read, one wait
        assert cudart.pinned_reads - pinned == len(out) == 5
        assert set(cudart.stream_flags.values()) == {cudart.cudaStreamNonBlocking}
        flags = {f for f, _, _ in cudart.events.values()}
        assert flags == {cudart.cudaEventDisableTiming | (cudart.cudaEventBlockingSync if integrated else 0)}
        ort = OrtRunner(ExportManifest.load(peaky_export), threads=1)
        with ort:
            ort.allocate_kv(32)
            _prefill(ort)
            want = ort.run("infiller", np.array([[7, 8]]), np.array([[6, 7]]), np.ones((1, 2, 8), bool), 6, 8)
        for name in want:
            np.testing.assert_allclose(out[name], want[name], rtol=1e-6)
    assert cudart.allocations == {} and cudart.host_allocations == {}


def test_a_cuda_mismatch_is_named_in_one_line(peaky_export, fakes, tmp_path, monkeypatch):
    """cuda-python, TensorRT's wheels and onnxruntime-gpu each built for a CUDA major newer than the driver's:
    refused at start, one line naming both versions and the fix (CUDA 12 runtimes run on a CUDA 13 driver)."""
    from importlib import metadata

    from refusion.runtime.runners import trt_loader

    _, cudart = fakes
    cudart.runtime_version = 13000
    with pytest.raises(RefusionError, match=r"^CUDA mismatch: cuda-python \(CUDA runtime 13.0\) is built for CUDA "
                                            r"13.0, but this machine's NVIDIA driver runs CUDA 12.6 at most \(CUDA 13 "
                                            r"needs driver >= 580.65\): pip install 'cuda-python>=12,<13'.*update the "
                                            r"driver.$"):
        cuda.check_cuda_python(cudart)
    cudart.driver_version = 13000
    cuda.check_cuda_python(cudart)
    cudart.runtime_version, cudart.driver_version = 12080, 13020  # an older major runs on a newer driver
    cuda.check_cuda_python(cudart)
    cudart.driver_version = 0
    with pytest.raises(RefusionError, match="needs an NVIDIA driver, and none is installed"):
        cuda.check_cuda_python(cudart)

    cudart.driver_version = 12060
    engines = fake_engines(peaky_export, tmp_path / "engines")
    assert trt_loader.tensorrt_cuda() is None  # no TensorRT wheel here (JetPack's packages are none either)
    wheel = type("Dist", (), {"metadata": {"Name": "tensorrt_cu13_libs"}})
    monkeypatch.setattr(metadata, "distributions", lambda: [wheel()])
    assert trt_loader.tensorrt_cuda() == 13
    with pytest.raises(RefusionError, match=r"TensorRT 10.13.0.35 \(tensorrt-cu13\) is built for CUDA 13.0.*"
                                            r"pip install 'refusion-trt\[trt-cu12\]'"):
        TensorRTRunner.from_dir(engines).activate()

    from onnxruntime.capi import build_and_package_info

    from tests.fakes import CpuBoundCudaRunner

    monkeypatch.setattr(build_and_package_info, "cuda_version", "13.0", raising=False)
    monkeypatch.setattr(build_and_package_info, "package_name", "onnxruntime-gpu")
    with pytest.raises(RefusionError, match=r"onnxruntime-gpu 1[\d.]+ \(CUDA 13.0\) is built for CUDA 13.0.*install "
                                            r"the onnxruntime-gpu of the driver's CUDA: pip install 'refusion-trt\[ort-gpu\]'"):
        CpuBoundCudaRunner(ExportManifest.load(peaky_export), threads=1).activate()
    assert cudart.allocations == {}


def test_a_prefill_over_a_past_is_cut_by_the_scheduler_into_chunks_the_engine_holds(peaky_export, fakes, tmp_path):
    """A prefill over a cached prefix, longer than the decode profile takes (a block: 16) and with a past the
    prefill profile does not take: the runner refuses it whole and states the chunk its profiles hold
    (chunk_bound); chunks.cut, as the scheduler calls it, cuts 40 tokens into 3 forwards of at most 16, each head
    where onnxruntime's one forward puts it, each chunk a forward in RunnerStats, and no input_probs (at a chunk's
    last token it would read its own id, not the next chunk's first)."""
    from refusion.runtime.core.profiles import DecodeLimits
    from refusion.runtime.decode.chunks import cut, merge
    from refusion.runtime.decode.masks import causal_after
    from refusion.runtime.decode.steps import Forward
    from refusion.runtime.runners.rows import RowFeed

    limits = DecodeLimits(max_prompt=64, gen_length=32, slot_size=4, serial_blocks=2)
    engines = fake_engines(peaky_export, tmp_path / "engines", limits)
    ids = np.random.default_rng(0).integers(0, 300, (1, 50))
    pos = np.arange(50)[None]
    heads = np.array([[0, 15, 16, 17, 31, 39]])  # a chunk's last token and the next one's first among them
    forward = Forward(ids[:, 10:], pos[:, 10:], causal_after(10, 40), 10, 10, heads, kind="prefill", graph="infiller")
    outs = []
    for runner in (TensorRTRunner.from_dir(engines), OrtRunner(ExportManifest.load(peaky_export), threads=1)):
        with runner:
            runner.allocate_kv(64)
            runner.run("infiller", ids[:, :10], pos[:, :10], causal_after(0, 10), 0, 0, heads=np.array([[9]]))
            before = runner.stats.copy()
            chunks = cut(forward, None, runner)
            ran = [runner.run_batch("infiller", [RowFeed.of(c, 0)])[0] for c in chunks]
            outs.append(ran[0] if len(chunks) == 1 else merge(forward, chunks, ran))
            counted = runner.stats.since(before).graph("infiller")
            outs.append((counted.forwards, counted.rows, counted.fed, counted.padded, runner.chunk_bound(
                "infiller", 40, 10, 6)))
            if runner.name == "trt":
                with pytest.raises(RefusionError, match="infiller forward of 40 tokens"):
                    runner.run("infiller", ids[:, 10:], pos[:, 10:], causal_after(10, 40), 10, 10, heads=heads)
    got, trt_counted, want, ort_counted = outs
    assert trt_counted == (3, 3, 40, 40, 16) and ort_counted == (1, 1, 40, 40, None)
    assert set(got) == set(want) - {"input_probs"}
    for name in got:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_activation_checks_the_engine_size_and_hashes_it_only_to_verify(peaky_export, fakes, tmp_path, monkeypatch):
    """Hashing reads the whole engine, 16 GB for ReFusion-8B (seconds on every start, and page cache a Jetson
    shares with its GPU: review 4, S3): a start checks its size, `verify` (refusion-run --verify, the engines check)
    its sha256 too, as the onnxruntime runners treat an export's files."""
    from refusion.engines.check import check_engines
    from refusion.runtime.core import engines_manifest
    from refusion.runtime.runners import make_runner

    engines = fake_engines(peaky_export, tmp_path / "engines")
    hashed = []
    real = engines_manifest.sha256_file
    monkeypatch.setattr(engines_manifest, "sha256_file", lambda file: hashed.append(file.name) or real(file))
    with TensorRTRunner.from_dir(engines):
        pass
    assert hashed == []
    assert make_runner(ExportManifest.read(engines), "trt", verify=True).verify
    with TensorRTRunner.from_dir(engines, verify=True):
        pass
    assert hashed == ["model.engine"]
    assert check_engines(engines, report=lambda line: None) and hashed == ["model.engine"] * 2
    engine = engines / "model.engine"
    damaged = bytearray(engine.read_bytes())
    damaged[-1] ^= 1
    engine.write_bytes(damaged)
    with pytest.raises(RefusionError, match=r"model.engine does not match engines.json \(sha256 .*modified or damaged"):
        TensorRTRunner.from_dir(engines, verify=True).activate()
    engine.write_bytes(damaged[:-1])
    with pytest.raises(RefusionError, match=r"model.engine has \d+ bytes and engines.json records \d+: .*truncated"):
        TensorRTRunner.from_dir(engines).activate()


def test_engines_built_with_a_prefill_bound_take_chunks_of_it_and_decode_as_onnxruntime(peaky_export, fakes, tmp_path):
    """Issue 34: engines built with --prefill-chunk 16 have a prefill profile of 1..16 tokens over a past (not the
    whole prompt over none); the Generator takes the bound from them, so a 200-token prompt is prefilled as chunks,
    each a forward of the engine within its profiles, with onnxruntime's tokens; the scheduler alone cuts (issue 43):
    onnxruntime at the same bound makes the same forwards, and with the prefix cache on a repeated prompt's
    prefill over its cached prefix is cut alike on both."""
    from refusion.runtime.core.profiles import DecodeLimits
    from refusion.runtime.generator import Generator
    from refusion.runtime.runners.stats import ForwardShape

    limits = DecodeLimits(max_prompt=256, gen_length=32, slot_size=4, serial_blocks=2, prefill_chunk=16)
    engines = fake_engines(peaky_export, tmp_path / "engines", limits)
    prompt = np.random.default_rng(3).integers(3, 300, 200).tolist()
    settings = dict(gen_length=32, slot_size=4, serial_num_blocks=2, slot_threshold=0.5, token_threshold=0.1)
    with Generator.from_dir(peaky_export, backend="ort-cpu", threads=1, prefill_chunk=0, prefix_cache_mb=0) as ort:
        want = [ort.generate(prompt_ids=prompt, **settings).committed_ids,
                ort.generate(prompt_ids=prompt, gen_length=12, mode="ar").committed_ids]

    def decode(gen: Generator) -> tuple[list[list[int]], list[ForwardShape]]:
        gen.runner.stats.record = []
        ids = [gen.generate(prompt_ids=prompt, **settings).committed_ids,
               gen.generate(prompt_ids=prompt, gen_length=12, mode="ar").committed_ids]
        return ids, [c for c in gen.runner.stats.record if isinstance(c, ForwardShape)]

    with Generator.from_dir(peaky_export, backend="ort-cpu", threads=1, prefill_chunk=16, prefix_cache_mb=4,
                            max_requests=1) as ort:
        _, ort_calls = decode(ort)
    with Generator.from_dir(engines, backend="trt", prefix_cache_mb=4) as trt:
        assert trt.prefill_chunk == 16
        prefill = trt.runner.engines.engine.profiles[0]
        assert prefill.seq[2] == 16 and prefill.past[2] == 256 + 16 - 1
        got, calls = decode(trt)
        assert all(row.fed <= 16 for call in calls for row in call.rows)
        assert trt.runner.stats.graph("infiller").forwards == sum(call.graph == "infiller" for call in calls)
        assert trt.prefix_cache is not None and trt.prefix_cache.stats.hit_tokens > 0  # the AR request's prefill
    assert got == want
    assert [(c.graph, [(r.fed, r.past, r.write_at) for r in c.rows]) for c in calls] == \
        [(c.graph, [(r.fed, r.past, r.write_at) for r in c.rows]) for c in ort_calls]


def test_a_guided_request_binds_vocab_mask_and_decodes_as_on_onnxruntime(peaky_export, fakes, tmp_path):
    """vocab_mask is an engine input whose profile ranges take one row (no guide) up to a block of heads; a guided
    decode binds its masks and gives onnxruntime's tokens, in both modes."""
    pytest.importorskip("llguidance")
    from refusion.runtime.core.engines_manifest import EngineManifest
    from refusion.runtime.generator import Generator
    from refusion.runtime.tokenizer import Tokenizer

    engines = fake_engines(peaky_export, tmp_path / "engines")
    spec = ExportManifest.read(engines).graphs["infiller"]
    for profile in EngineManifest.load(engines).engine.profiles:
        lo, opt, hi = profile.shapes(spec)["vocab_mask"]
        assert (lo[1], opt[1], hi[1]) == (1, 1, profile.head_range[2])
    settings = dict(gen_length=32, slot_size=4, serial_num_blocks=2, slot_threshold=0.5, token_threshold=0.1,
                    regex=r"[a-z]{3,9}( [a-z]{3,9}){0,2}")
    runner = TensorRTRunner.from_dir(engines)
    runner.activate()
    assert runner.decode_tokens == EngineManifest.load(engines).limits.block_length  # a guided forward's bound
    with Generator(ExportManifest.read(engines), runner, Tokenizer.from_dir(engines)) as trt, \
            Generator.from_dir(peaky_export, backend="ort-cpu") as ort:
        for mode in ("refusion", "ar"):
            ours = trt.generate("robot", mode=mode, **settings)
            assert ours.token_ids == ort.generate("robot", mode=mode, **settings).token_ids
            assert re.fullmatch(settings["regex"], ours.text) and ours.finish_reason == "eos"

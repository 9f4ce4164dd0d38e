"""The TensorRT Runner on CPU fakes of TensorRT and cuda-python (tests/engines/fakes.py).

The fakes execute the real ONNX graphs over the runner's real pointer arithmetic, so these
tests pin the bindings (past as a view of the cache, present written in place at write_at,
staged when unaligned), profile selection, KV moves, and decode parity with the ORT Runner.
What only a GPU shows (kernels, precision, timing) is tools/gpu_check.py's.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.decode import DecodeTrace, Tokens, ar_decode, refusion_decode
from refusion.runtime.params import DecodeParams
from refusion.runtime.runners import cuda
from refusion.runtime.runners.onnxruntime import OrtRunner
from refusion.runtime.runners.tensorrt import TensorRTRunner
from tests.engines.conftest import fake_engines
from tests.runtime.conftest import MASK_ID

PROMPTS = ([5, 17, 42, 99, 7], [200, 3, 3, 64, 81, 12, 150, 9, 31])
LAYOUTS = ((4, 32, 2), (8, 48, 3), (32, 64, 2))  # (slot_size, gen_length, serial blocks)
THRESHOLDS = ((0.9, 0.4), (0.2, 0.7), (0.0, 0.0))


def _decode(loop, runner, prompt, eos, params):
    trace = DecodeTrace()
    committed = {}
    for commit in loop(runner, Tokens(prompt, MASK_ID, eos), params, trace, logits=False):
        committed.update(zip(commit.positions, commit.token_ids))
    return [committed[p] for p in sorted(committed)], dict(trace.branches), dict(trace.forwards)


def test_decode_parity_with_the_ort_runner(peaky_export, fakes, tmp_path):
    _, cudart = fakes
    engines = fake_engines(peaky_export, tmp_path / "engines")
    ort = OrtRunner(ExportManifest.load(peaky_export), threads=1)
    branches: set[str] = set()
    eos_ids = (-1, 7, 42)
    with TensorRTRunner.from_dir(engines) as trt, ort:
        for i, ((k, gen, blocks), (st, tt)) in enumerate(itertools.product(LAYOUTS, THRESHOLDS)):
            prompt, eos = PROMPTS[i % 2], eos_ids[i % 3]
            params = DecodeParams(gen_length=gen, slot_size=k, serial_num_blocks=blocks, slot_threshold=st,
                                  token_threshold=tt)
            trt.check_request(len(prompt), params)
            ours = _decode(refusion_decode, trt, prompt, eos, params)
            assert ours == _decode(refusion_decode, ort, prompt, eos, params), (k, gen, blocks, st, tt)
            branches |= set(ours[1])
        ar = DecodeParams(gen_length=20, mode="ar")
        trt.check_request(len(PROMPTS[1]), ar)
        assert _decode(ar_decode, trt, PROMPTS[1], -1, ar) == _decode(ar_decode, ort, PROMPTS[1], -1, ar)
    assert {"infill_loop", "commit_from_verification"} <= branches
    # 128-byte tokens: odd write offsets went through the aligned staging buffer, KV moves ran on device
    assert ("cudaMemcpyDeviceToDevice", 0) not in cudart.copies
    assert any(kind == "cudaMemcpyDeviceToDevice" for kind, _ in cudart.copies)
    assert cudart.allocations == {}


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
            kv = trt.kv_to_host(write_at, 6)
            for i in range(ort.manifest.num_layers):
                np.testing.assert_array_equal(kv[f"present.{i}.key"], ort.keys[0][i][:, write_at:write_at + 6])
                np.testing.assert_array_equal(kv[f"present.{i}.value"], ort.values[0][i][:, write_at:write_at + 6])
        before = trt.kv_to_host(0, 14)
        trt.move_kv(3, 5, 9)  # overlapping, forwards
        after = trt.kv_to_host(5, 9)
        for name in before:
            np.testing.assert_array_equal(after[name], before[name][:, 3:12])



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
            trt.check_request(17, DecodeParams(gen_length=64, slot_size=4, serial_num_blocks=2))
        with pytest.raises(RefusionError, match="--gen-length 80"):
            trt.check_request(5, DecodeParams(gen_length=80, mode="ar"))
        trt.check_request(5, DecodeParams(gen_length=64, mode="ar"))


def test_engine_that_does_not_match_refusion_json_is_refused(peaky_export, exports, fakes, tmp_path):
    """An engines dir whose refusion.json describes another model (e.g. copied over by hand)."""
    engines = fake_engines(peaky_export, tmp_path / "engines")
    (engines / "refusion.json").write_text((exports["fp16"] / "refusion.json").read_text())
    with pytest.raises(RefusionError, match="does not match refusion.json"):
        TensorRTRunner.from_dir(engines).activate()


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

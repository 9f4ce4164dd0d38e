"""The CUDA-only check (`python -m refusion.tools.checks.gpu --cuda-only`) on the fake cuda-python: every check
passes on the runners' code, fails where that code or the device answers wrong, and the path imports neither
TensorRT nor onnxruntime (a bare GPU machine has neither)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from refusion.runtime.runners import cuda
from refusion.runtime.runners.kv_pool import DeviceKVPool
from refusion.tools.checks import cuda_memory, gpu
from tests.helpers import REPO


def test_every_check_passes_on_the_runners_code(fakes, capsys):
    _, cudart = fakes
    cudart.mem_pitch = 1 << 16  # a device's 2 GiB pitch limit, scaled down: the fake's memory is the host's
    assert gpu.main(["--cuda-only"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("INFO: driver CUDA 12.6; ") and "Fake GPU, sm 9.0, discrete, memPitch 65536" in out[0]
    assert [text.split(":")[0] + ": " + text.split(": ")[1] for text in out[1:-1]] == [
        f"PASS: {name}" for name, _ in cuda_memory.CHECKS]
    assert "pitch 65792 > memPitch 65536 refused: CUDA cudaMemcpy2DAsync failed: cudaErrorInvalidPitchValue" in out[-2]
    assert out[-1].startswith("PASS: CUDA check (") and cudart.allocations == {} and cudart.host_allocations == {}


def test_a_wrong_copy_fails_and_the_pitch_check_skips_where_its_buffer_does_not_fit(fakes, monkeypatch, capsys):
    """A KV move that moves nothing: a FAIL line for each pool, exit 1; a memPitch larger than half the free memory:
    the pitch check skipped, and said so."""
    _, cudart = fakes
    monkeypatch.setattr(DeviceKVPool, "move", lambda self, region, src, dst, length: None)
    cudart.mem_pitch = 1 << 40
    assert gpu.main(["--cuda-only"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: KV pool on a stream (TensorRT): move apart (0 -> 30, 10 tokens), region 0: " in out
    assert "FAIL: KV pool without a stream (onnxruntime CUDA): move apart" in out
    assert f"SKIP: pitch above memPitch: skipped: memPitch {1 << 40} needs a " in out
    assert out.splitlines()[-1].startswith("FAIL: CUDA check")


def test_a_wait_that_does_not_wait_or_a_pitch_taken_fails(fakes, monkeypatch):
    """A synchronize that returns before the stream's work is done (the fake then refuses freeing memory that work
    still uses); a device that takes a pitch above its memPitch."""
    _, cudart = fakes
    cudart.mem_pitch = 1 << 16
    real = cudart.cudaMemcpy2DAsync
    monkeypatch.setattr(cudart, "cudaMemcpy2DAsync", lambda dst, dpitch, src, spitch, *args: real(
        dst, min(dpitch, 1 << 16), src, min(spitch, 1 << 16), *args))  # ignores its own limit
    with pytest.raises(AssertionError, match=r"a copy at pitch 65792 > memPitch 65536 was not refused"):
        cuda_memory.pitch_limit()
    monkeypatch.setattr(cuda.Stream, "synchronize", lambda self: None)
    with pytest.raises(AssertionError, match=r"cudaFree of memory that work queued on stream\(s\) .* still uses"):
        cuda_memory.stream_waits()


def test_the_cuda_only_path_needs_neither_tensorrt_nor_onnxruntime():
    """With tensorrt, polygraphy, onnxruntime, onnx and torch unimportable, `--cuda-only` runs: here, without
    cuda-python, to its one FAIL line naming the extra (on a GPU machine, to the checks)."""
    blocked = ("tensorrt", "polygraphy", "onnxruntime", "onnx", "torch")
    code = (f"import sys; sys.modules.update(dict.fromkeys({blocked!r})); "
            "sys.modules['cuda'] = None; sys.modules['cuda.bindings'] = None; "
            "from refusion.tools.checks import gpu; sys.exit(gpu.main(['--cuda-only']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 1, done.stderr
    assert done.stdout.startswith("FAIL: cuda-python: GPU runners need cuda-python: pip install 'refusion-trt[trt]'")

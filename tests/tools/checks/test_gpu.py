"""tools/checks/gpu.py's checks that need no GPU to run: the long-position comparison on the CPU
fakes (it passes on the export's graphs and fails when the rotary frequencies are rounded to
fp16, as TensorRT could store them), the one-engine check, and the search of the build log for
weight conversions."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.core.profiles import DecodeLimits
from refusion.tools.checks import gpu as gpu_check
from tests.fakes import CpuBoundCudaRunner
from tests.helpers import fake_engines

REPO = Path(__file__).resolve().parents[3]


def _with_half_inv_freq(export: Path, out: Path) -> Path:
    """A copy of `export` whose rotary inv_freq ([1, 1, head_dim / 2], fp32) holds fp16-rounded values."""
    shutil.copytree(export, out)
    for graph in ("planner", "infiller"):
        model = onnx.load(str(out / f"{graph}.onnx"), load_external_data=False)
        inv_freq = [i for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) == 3]
        assert len(inv_freq) == 1
        values = numpy_helper.to_array(inv_freq[0])
        inv_freq[0].raw_data = values.astype(np.float16).astype(np.float32).tobytes()  # same size: the manifest holds
        onnx.save(model, str(out / f"{graph}.onnx"))
    return out


def test_long_positions_pass_on_the_export_and_fail_with_fp16_rotary_tables(exports, fakes, tmp_path, capsys):
    limits = DecodeLimits(**gpu_check.LIMITS)
    assert limits.max_prompt + limits.gen_length + limits.block_length == 1024  # the fixture's max positions
    good = fake_engines(exports["fp16"], tmp_path / "good", limits)
    assert gpu_check.long_positions(exports["fp16"], exports["fp32"], good)
    assert "PASS: TensorRT fp16 vs onnxruntime fp32 up to position 1023" in capsys.readouterr().out
    half = _with_half_inv_freq(exports["fp16"], tmp_path / "half-inv-freq")
    assert not gpu_check.long_positions(half, exports["fp32"], fake_engines(half, tmp_path / "bad", limits))
    assert "present.*" in capsys.readouterr().out.split("FAIL (over tolerance")[0].splitlines()[-1]


def test_weight_conversion_warnings_are_found():
    log = """[I] Building engine
[W] [TRT] TensorRT encountered issues when converting weights between types and that could affect accuracy.
[W] [TRT] If this is not the desired behavior, please modify the weights or retrain with regularization.
[W] [TRT] Check verbose logs for the list of affected weights.
[W] [TRT] - 2 weights are affected by this issue: Detected subnormal FP16 values.
[I] Finished engine building in 3 s"""
    assert gpu_check.weight_conversions(log) == [log.splitlines()[1], log.splitlines()[4]]
    assert gpu_check.weight_conversions("[I] Finished engine building in 3 s") == []


def test_each_build_log_gets_its_own_weight_conversion_warning(exports, tmp_path, monkeypatch):
    """Polygraphy logs TensorRT's warnings once per process: without clearing that, the int4 build's warning
    would be dropped when the fp16 build had printed the same, and its PASS line would be false."""
    from polygraphy.logger import G_LOGGER, LogMode

    from refusion.engines import build

    warning = "TensorRT encountered issues when converting weights between types and that could affect accuracy."

    def build_engines(plan, force, report):
        G_LOGGER.warning(warning, mode=LogMode.ONCE)  # as Polygraphy's TensorRT logger passes it on
        return plan.output

    monkeypatch.setattr(build, "build_engines", build_engines)
    for name in ("engines", "engines-int4"):
        assert gpu_check.build(exports["fp16"], tmp_path, True, name)[1] == [f"[W] {warning}"]


def test_island_layers_are_judged_by_the_engine_inspector(exports, fakes, tmp_path, capsys):
    """The fp32 islands' precisions as the engine inspector shows them (the fake's: a layer per node in the graph's
    types, as a strongly typed unfused build has them): all fp32 on the export; a layer shown in half precision
    fails, one fused into a Myelin node or beside other nodes is counted apart."""
    engines = fake_engines(exports["fp16"], tmp_path / "engines", DecodeLimits(**gpu_check.LIMITS))
    assert gpu_check.islands_in_fp32(exports["fp16"], engines)
    assert "PASS: fp32 islands (engines): " in capsys.readouterr().out
    island = {"n3_ReduceMean", "n4_Add"}
    info = {"Layers": [
        {"Name": "n3_ReduceMean + n4_Add", "LayerType": "Reduce", "Outputs": [{"Format/Datatype": "Row major FP32"}]},
        {"Name": "n4_Add", "Metadata": "[ONNX Layer: n4_Add]", "Outputs": [{"Format/Datatype": "Half"}]},
        {"Name": "{ForeignNode[n3_ReduceMean...n9_MatMul]}", "LayerType": "Myelin",
         "Metadata": "[ONNX Layer: n3_ReduceMean]\x1e[ONNX Layer: n9_MatMul]", "Outputs": []},
        {"Name": "n9_MatMul", "Outputs": [{"Format/Datatype": "Row major linear FP16 format"}]},
    ]}
    fp32, opaque, half = gpu_check.island_layers(info, island)
    assert (fp32, opaque) == (1, 1) and half == ["n4_Add: ['Half']"]


def test_one_engine_for_both_roles(exports, fakes, tmp_path, capsys):
    engines = fake_engines(exports["fp16"], tmp_path / "engines")
    assert gpu_check.one_engine(exports["fp16"], engines)
    out = capsys.readouterr().out
    assert "PASS: one engine for both roles: ['model.engine'], profiles [('prefill', 'infiller'), ('decode', " \
           "'infiller'), ('plan', 'planner')]" in out
    assert "device memory held by the active runner: 0.0 MiB" in out  # the fakes' 4 KiB of activations
    (engines / "planner.engine").write_bytes(b"")  # a second engine would hold the weights again
    assert not gpu_check.one_engine(exports["fp16"], engines)


@pytest.mark.parametrize("head", [False, True], ids=["float-head", "int4-head"])
def test_int4_parity_runs_at_the_exact_accuracy_level(peaky_int4, peaky_int4_head, fakes, tmp_path, capsys, head):
    """The int4 half of the check on the fakes: the int4 engine (with an int4 lm_head too) generates the
    onnxruntime Runner's tokens."""
    limits = DecodeLimits(max_prompt=64, gen_length=128, slot_size=8, serial_blocks=2)
    export = peaky_int4_head if head else peaky_int4[gpu_check.INT4_BLOCK]
    engines = fake_engines(export, tmp_path / "engines", limits)
    assert gpu_check.parity(export, engines)
    out = capsys.readouterr().out
    assert out.count("PASS: generation parity") == len(gpu_check.PROMPTS) * (len(gpu_check.DECODES) + 1)


def test_batched_requests_get_their_tokens_alone(peaky_export, fakes, tmp_path, capsys):
    """The batched half of the check on the fakes: TensorRT and the onnxruntime CUDA runner's code."""
    limits = DecodeLimits(max_prompt=64, gen_length=128, slot_size=8, serial_blocks=2, max_batch=4)
    engines = fake_engines(peaky_export, tmp_path / "engines", limits)
    assert gpu_check.batched(peaky_export, engines, cuda_runner=CpuBoundCudaRunner)
    out = capsys.readouterr().out
    jobs = len(gpu_check.PROMPTS) * (len(gpu_check.DECODES) + 1)
    assert f"PASS: TensorRT: {jobs} requests together" in out and f"PASS: onnxruntime CUDA: {jobs} requests" in out
    gpu_check.latency(engines, repeats=1)
    assert "latency: infiller verify, 4 requests packed" in capsys.readouterr().out


@pytest.mark.slow
def test_the_whole_check_runs_on_the_fakes(fakes, tmp_path, monkeypatch, capsys):
    """`python -m refusion.tools.checks.gpu` end to end on the CPU fakes, the builds replaced by fake engines
    of the same plans: every check runs and passes (onnxruntime CUDA, absent here, is skipped and said so)."""
    import functools

    from refusion.engines import build
    from refusion.runtime.runners.trt_loader import current_target
    from tests.fakes import fake_engine_bytes

    def build_engines(plan, force, report):
        plan.output.mkdir(parents=True, exist_ok=force)
        build.write_engines_dir(plan, plan.output, fake_engine_bytes(plan), current_target(),
                                plan.options.strongly_typed, 0.0)
        return plan.output

    from refusion.tools.checks import chunked

    monkeypatch.setattr(build, "build_engines", build_engines)
    monkeypatch.setattr(gpu_check, "latency", functools.partial(gpu_check.latency, repeats=1))
    monkeypatch.setattr(gpu_check, "attention_fusion", functools.partial(gpu_check.attention_fusion, repeats=1))
    monkeypatch.setattr(chunked, "chunked_prefill", functools.partial(chunked.chunked_prefill, repeats=1))
    assert gpu_check.main(["--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and out.splitlines()[-1].startswith("PASS: GPU check")
    steps = [text for text in out.splitlines() if text.startswith("== ")]
    assert [text.split(".")[0] for text in steps] == [f"== {n}" for n in range(1, 8)] + [
        "== then: the other typing mode, onnxruntime's fused ops on CUDA"]
    for check in ("Polygraphy 0.53.6 builds on TensorRT 10.13.0.35", "stream synchronize waits for queued work",
                  "KV pool on a stream (TensorRT)", "CUDA check", "chunked prefill (320 tokens over 128, 5 forwards",
                  "TensorRT: 6 generations over a shared 128-token prefix, the prefix cache on as off",
                  "engines (strongly typed): no weights converted", "fp32 islands (engines)", "one engine for both",
                  "TensorRT fp16 engines vs onnxruntime (comparator)", "TensorRT fp16 vs onnxruntime fp32 up to",
                  "generation parity", "TensorRT: 8 requests together", "engines-weak (weakly typed)",
                  "fp32 islands (engines-weak)", "TensorRT fp16 engines, weakly typed, vs onnxruntime",
                  "TensorRT fp32 engines vs onnxruntime with TF32 off", "engines-int4 (strongly typed)",
                  "fp32 islands (engines-int4)", "TensorRT int4 (block 64) engine", "engines-int4-head (strongly typed)",
                  "fp32 islands (engines-int4-head)", "TensorRT int4 (block 64, int4 lm_head) engine",
                  "engines-host (strongly typed)", "fp32 islands (engines-host)",
                  "TensorRT fp16 engine, embeddings host, vs onnxruntime",
                  "embeddings host: 8 generations token-identical to the graph-embedding engine's"):
        assert f"PASS: {check}" in out, check
    for skipped in ("onnxruntime CUDA session", "fp32 on onnxruntime CUDA", "onnxruntime CUDA batched requests"):
        assert f"SKIP: {skipped} (onnxruntime here has no CUDAExecutionProvider" in out, skipped
    assert "INFO: attention: " in out and "INFO: engines-int4-head: engine " in out


def test_weakly_typed_is_refused_up_front_on_tensorrt_11(fakes, monkeypatch, tmp_path, capsys):
    """TensorRT 11 builds strongly typed networks only: refused before the fixture is exported, not at the first
    build minutes later (review 4, K1)."""
    trt, _ = fakes
    monkeypatch.setattr(trt, "__version__", "11.4.0.106")
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--weakly-typed", "--workdir", str(tmp_path / "work")])
    assert exit_.value.code == 2 and not (tmp_path / "work").exists()
    assert "--weakly-typed: TensorRT 11.4.0.106 builds strongly typed networks only" in capsys.readouterr().err


def test_without_tensorrt_the_check_points_to_cuda_only(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--workdir", str(tmp_path / "work")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "TensorRT is not installed" in err and "--cuda-only checks the device" in err


def test_the_chunked_prefill_step_on_the_fakes(exports, fakes, tmp_path, monkeypatch, capsys):
    """Step 4 on the fakes: the chunked forward against onnxruntime's one forward, generations with the prefix
    cache on as off, and the latency line; fails when the runner cannot chunk the forward."""
    from refusion.runtime.runners.tensorrt import TensorRTRunner
    from refusion.tools.checks import chunked

    engines = fake_engines(exports["fp16"], tmp_path / "engines", DecodeLimits(**gpu_check.LIMITS))
    assert chunked.chunked_prefill(exports["fp16"], engines, repeats=1)
    out = capsys.readouterr().out
    assert "PASS: chunked prefill (320 tokens over 128, 5 forwards of at most 64) vs onnxruntime's one forward" in out
    for runner in ("TensorRT", "onnxruntime"):
        assert f"PASS: {runner}: 6 generations over a shared 128-token prefix, the prefix cache on as off" in out
        assert f"INFO: {runner}, prefix cache on: " in out and f"INFO: {runner}, prefix cache on: 0 " not in out
    assert "latency: prefill of 512 tokens in one forward " in out and "384 tokens in 6 chunks of at most 64" in out
    monkeypatch.setattr(TensorRTRunner, "chunk_bound", lambda self, *args: 0)
    assert not chunked.chunks_as_onnxruntime(exports["fp16"], engines)
    assert "left out: 320 tokens over a 128-token past (infiller): seq 320 over past 128" in capsys.readouterr().out


def test_the_onnxruntime_ops_step_runs_its_comparison_and_generations(exports, tmp_path, capsys):
    """ort_ops_on_cuda's code on the CPU provider (on a GPU it compares CUDA with the CPU provider)."""
    from refusion.export.exporter import export_onnx

    ckpt = Path(ExportManifest.load(exports["fp16"]).source["checkpoint"])
    fused = export_onnx(ckpt, tmp_path / "ort", dtype="fp16", ops="onnxruntime", validate=False)
    assert gpu_check.ort_ops_on_cuda(fused, exports["fp16"], provider="CPUExecutionProvider")
    out = capsys.readouterr().out
    assert "PASS: --ops onnxruntime on CPUExecutionProvider vs the CPU provider (comparator)" in out
    assert "generations token-identical to the standard export's; AR" in out
    assert gpu_check.ort_ops_on_cuda(fused, exports["fp16"], provider="NoSuchExecutionProvider")  # a skip
    assert "SKIP: --ops onnxruntime on onnxruntime CUDA" in capsys.readouterr().out

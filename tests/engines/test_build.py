"""`build_engines` on the CPU fakes, its TensorRT build (Polygraphy's loaders) replaced by a serialized engine
of a given size: the engine is written and hashed where the builder holds it, and the typing mode is chosen
as the TensorRT version allows."""

from __future__ import annotations

import hashlib
import tracemalloc

import numpy as np
import pytest

from refusion.engines import build
from refusion.runtime.core.engines_manifest import EngineManifest
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.profiles import DecodeLimits

LIMITS = DecodeLimits(max_prompt=64, gen_length=64, slot_size=8, serial_blocks=2)


def test_the_engine_is_written_from_the_builders_memory_without_a_copy(exports, fakes, tmp_path, monkeypatch):
    """TensorRT's serialized engine (an IHostMemory: a buffer) goes to the file and the hash as it lies; a copy
    of it in host memory (bytes(memoryview(...)): 16 GB for ReFusion-8B, from the memory a Jetson's GPU
    shares) would show in the traced peak."""
    serialized = np.random.default_rng(0).integers(0, 256, 32 << 20, dtype=np.uint8)
    monkeypatch.setattr(build, "engine_loader", lambda plan, report: lambda: serialized)
    lines: list[str] = []
    plan = build.plan_build(exports["fp16"], tmp_path / "engines", LIMITS)
    tracemalloc.start()
    try:
        out = build.build_engines(plan, report=lines.append)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # what is traced is the export's hashing buffer (16 MiB, runtime/core/files.py); a copy would be the whole engine
    assert peak < serialized.nbytes, f"{peak} bytes traced while writing a {serialized.nbytes}-byte engine"
    manifest = EngineManifest.load(out)
    assert manifest.strongly_typed and manifest.engine.bytes == serialized.nbytes
    assert manifest.engine.sha256 == hashlib.sha256(serialized.tobytes()).hexdigest()
    assert (out / "model.engine").read_bytes() == serialized.tobytes()
    assert "strongly typed" in lines[0] and "32.0 MiB" in "".join(lines)


def test_weak_typing_is_an_opt_in_tensorrt_11_refuses_it_and_an_old_polygraphy(exports, fakes, tmp_path, monkeypatch):
    trt, _ = fakes
    monkeypatch.setattr(build, "engine_loader", lambda plan, report: lambda: b"engine")
    weak = build.plan_build(exports["fp16"], tmp_path / "engines", LIMITS, strongly_typed=False)
    lines: list[str] = []
    build.build_engines(weak, report=lines.append)  # the fakes are TensorRT 10.13
    assert "weakly typed (the FP16/BF16 flags it needs are deprecated since TensorRT 10.12)" in lines[0]
    assert not EngineManifest.load(tmp_path / "engines").strongly_typed
    monkeypatch.setattr(trt, "__version__", "11.1.0.3")
    with pytest.raises(RefusionError, match=r"--weakly-typed: TensorRT 11.1.0.3 builds strongly typed networks only"):
        build.build_engines(weak, force=True)
    strong = build.plan_build(exports["fp16"], tmp_path / "engines", LIMITS)
    build.build_engines(strong, force=True)
    import polygraphy

    monkeypatch.setattr(polygraphy, "__version__", "0.49.27")  # whose CreateConfig fails on TensorRT 11
    with pytest.raises(RefusionError, match=r"Polygraphy 0.49.27 cannot build engines with TensorRT 11.1.0.3"):
        build.build_engines(strong, force=True)


def test_an_embeddings_host_export_plans_inputs_embeds_over_every_profile(checkpoint, fakes, tmp_path):
    """The engine's 3-D inputs_embeds gets each profile's batch and seq ranges of input_ids, its hidden axis
    fixed, from the contract like every input; the op check passes on a graph with no embedding Gather."""
    from refusion.export.exporter import export_onnx

    export = export_onnx(checkpoint, tmp_path / "host", dtype="fp16", embeddings="host", validate=False)
    plan = build.plan_build(export, tmp_path / "engines", LIMITS)
    spec = plan.export.graphs["infiller"]
    hidden = plan.export.dims.hidden_size
    assert spec.input("inputs_embeds").axes == ("batch", "seq", hidden)
    for profile in plan.profiles:
        shapes = profile.shapes(spec)
        assert shapes["inputs_embeds"] == tuple((*ids, hidden) for ids in shapes["input_ids"]), profile.name

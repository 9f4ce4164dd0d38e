"""engines.json: written beside the engines, and every mismatch refused before deserialization."""

from __future__ import annotations

import json

import pytest

from refusion.runtime.core.engines_manifest import EngineManifest, Target
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.core.profiles import DecodeLimits
from refusion.runtime.runners.tensorrt import TensorRTRunner
from tests.helpers import fake_engines


@pytest.fixture
def engines_dir(exports, tmp_path):
    return fake_engines(exports["fp32"], tmp_path / "engines")


def test_directory_serves_the_runtime_alone(engines_dir, exports):
    names = {p.name for p in engines_dir.iterdir()}
    assert {"engines.json", "model.engine", "refusion.json", "tokenizer.json"} <= names
    assert not any(name.endswith(".engine") for name in names - {"model.engine"})  # one engine serves both roles
    assert ExportManifest.read(engines_dir).graphs == ExportManifest.load(exports["fp32"]).graphs
    m = EngineManifest.load(engines_dir)
    assert m.limits == DecodeLimits(max_prompt=16, gen_length=64, slot_size=4, serial_blocks=2)
    assert [(p.name, p.graph) for p in m.engine.profiles] == [
        ("prefill", "infiller"), ("decode", "infiller"), ("plan", "planner")]
    assert m.target == Target("10.13.0.35", "Fake GPU", "9.0") and m.precision == "float32"
    assert set(m.source["sha256"]) == {"planner.onnx", "infiller.onnx", "weights.bin", "refusion.json"}
    assert m.rebuild_command.startswith("refusion-export build ")
    m.verify_file()


@pytest.mark.parametrize("target, message", [
    (Target("10.0.1.6", "Fake GPU", "9.0"), r"built with TensorRT 10.13.0.35, and this machine has TensorRT 10.0.1.6"),
    (Target("10.13.0.35", "NVIDIA Jetson AGX Orin", "8.7"), r"a Fake GPU \(compute capability 9.0\), and this GPU"),
])
def test_other_tensorrt_or_gpu_is_refused_with_the_rebuild_command(engines_dir, target, message):
    m = EngineManifest.load(engines_dir)
    with pytest.raises(RefusionError, match=message) as e:
        m.verify_target(target)
    assert m.rebuild_command in str(e.value)
    m.verify_target(Target("10.13.0.35", "Fake GPU", "9.0"))


def test_tampered_truncated_or_missing_engines_are_refused(engines_dir):
    m = EngineManifest.load(engines_dir)
    engine = engines_dir / "model.engine"
    data = bytearray(engine.read_bytes())
    data[10] ^= 1
    engine.write_bytes(bytes(data))
    with pytest.raises(RefusionError, match=r"does not match engines.json \(sha256.*Rebuild with: refusion-export"):
        m.verify_file()
    engine.write_bytes(bytes(data[:-1]))
    with pytest.raises(RefusionError, match=r"has \d+ bytes and engines.json records"):
        m.verify_file()
    engine.unlink()
    with pytest.raises(RefusionError, match="model.engine is missing"):
        m.verify_file()


def test_damaged_or_absent_manifest(engines_dir, tmp_path):
    with pytest.raises(RefusionError, match="holds no TensorRT engines"):
        EngineManifest.load(tmp_path)
    raw = json.loads((engines_dir / "engines.json").read_text())
    del raw["limits"]
    (engines_dir / "engines.json").write_text(json.dumps(raw))
    with pytest.raises(RefusionError, match="damaged"):
        EngineManifest.load(engines_dir)
    raw["limits"], raw["format_version"] = {}, 99
    (engines_dir / "engines.json").write_text(json.dumps(raw))
    with pytest.raises(RefusionError, match="v99"):
        EngineManifest.load(engines_dir)


def test_v1_engines_json_is_refused_with_its_rebuild_command(engines_dir):
    """v1: a planner and an infiller engine, each with all the weights (before one engine served both)."""
    raw = json.loads((engines_dir / "engines.json").read_text())
    command = raw["build"]["command"]
    v1 = {**raw, "format_version": 1, "engines": {"planner": raw["engine"], "infiller": raw["engine"]}}
    del v1["engine"]
    (engines_dir / "engines.json").write_text(json.dumps(v1))
    refusal = (r"describes v1 engines: a planner and an infiller engine, each holding all the weights.*serves both "
               r"and holds the weights once; rebuild with: ")
    with pytest.raises(RefusionError, match=refusal) as e:
        EngineManifest.load(engines_dir)
    assert str(e.value).endswith(command)
    del v1["build"]
    (engines_dir / "engines.json").write_text(json.dumps(v1))
    with pytest.raises(RefusionError, match=rf"rebuild with: refusion-export build EXPORT_DIR --output {engines_dir} "):
        EngineManifest.load(engines_dir)


def _spy_deserialize(trt, monkeypatch):
    calls = []
    original = trt.Runtime.deserialize_cuda_engine
    monkeypatch.setattr(trt.Runtime, "deserialize_cuda_engine", lambda self, data: calls.append(1) or original(self, data))
    return calls


def test_runner_refuses_before_deserializing(engines_dir, fakes, monkeypatch):
    trt, cudart = fakes
    calls = _spy_deserialize(trt, monkeypatch)
    engine = engines_dir / "model.engine"
    good = engine.read_bytes()
    engine.write_bytes(good.replace(b"input_ids", b"input_idz"))  # the same size: its sha256 tells, to verify
    with pytest.raises(RefusionError, match="model.engine does not match engines.json"):
        TensorRTRunner.from_dir(engines_dir, verify=True).activate()
    engine.write_bytes(good[:-1])  # the size, checked at every start
    with pytest.raises(RefusionError, match="model.engine has .* bytes and engines.json records"):
        TensorRTRunner.from_dir(engines_dir).activate()
    engine.write_bytes(good)
    monkeypatch.setattr(trt, "__version__", "10.14.0")
    with pytest.raises(RefusionError, match="TensorRT 10.14.0"):
        TensorRTRunner.from_dir(engines_dir).activate()
    assert calls == [] and cudart.allocations == {}
    monkeypatch.setattr(trt, "__version__", "10.13.0.35")
    with TensorRTRunner.from_dir(engines_dir):
        assert len(calls) == 1  # one engine: the weights once
    assert cudart.allocations == {}  # everything freed on deactivate

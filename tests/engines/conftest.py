"""Fixture exports (made once per session) and the CPU fakes of TensorRT and cuda-python."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.engines.fakes import FakeCudart, FakeTensorRT, fake_engine_bytes

pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    from tests.fixtures.checkpoints import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("trt") / "ckpt")


@pytest.fixture(scope="session")
def exports(tmp_path_factory, checkpoint) -> dict[str, Path]:
    """The same tiny checkpoint exported at each precision (validation is the exporter's own test)."""
    from refusion.export.exporter import export_onnx

    root = tmp_path_factory.mktemp("exports")
    return {d: export_onnx(checkpoint, root / d, dtype=d, validate=False) for d in ("fp32", "fp16", "bf16")}


@pytest.fixture(scope="session")
def peaky_export(tmp_path_factory) -> Path:
    """A confident tiny model: its decodes reach every branch of the loop."""
    from tests.runtime.conftest import export_peaky

    return export_peaky(tmp_path_factory.mktemp("peaky"), seed=0)[1]


@pytest.fixture(scope="session")
def peaky_int4(peaky_export) -> dict[int, Path]:
    """The peaky model (hidden 64, intermediate 128) as int4-rtn, by block size."""
    from refusion.export.exporter import export_onnx
    from refusion.export.quantize import QuantizeOptions

    ckpt = peaky_export.parent / "ckpt0"  # export_peaky's checkpoint beside its export
    return {b: export_onnx(ckpt, peaky_export.parent / f"int4-{b}", validate=False,
                           quantize=QuantizeOptions("int4-rtn", b)) for b in (32, 64)}


@pytest.fixture
def fakes(monkeypatch) -> tuple[FakeTensorRT, FakeCudart]:
    """Install the fakes where the code imports tensorrt and cuda-python from."""
    from refusion.runtime.runners import cuda

    cudart = FakeCudart()
    trt = FakeTensorRT(cudart)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(cuda, "_CUDART", cudart)
    monkeypatch.setattr(cuda, "_STAGING", cuda._SharedStaging())  # its stream belongs to this test's fake
    return trt, cudart


def fake_engines(export: Path, output: Path, limits=None, **target) -> Path:
    """An engines directory as `build_engines` writes it, with a fake engine file."""
    from refusion.engines.build import plan_build, write_engines_dir
    from refusion.runtime.core.engines_manifest import Target
    from refusion.runtime.core.profiles import DecodeLimits

    plan = plan_build(export, output, limits or DecodeLimits(max_prompt=16, gen_length=64, slot_size=4, serial_blocks=2))
    output.mkdir(parents=True)
    where = {"tensorrt": "10.13.0.35", "gpu": "Fake GPU", "compute_capability": "9.0", **target}
    write_engines_dir(plan, output, fake_engine_bytes(plan), Target(**where), strongly_typed=False, seconds=0.0)
    return output

"""Fixtures the tests share across packages: exports made once per session, the CPU fakes of TensorRT
and cuda-python. Heavy imports stay inside the fixtures, so collecting a test needs none of them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.helpers import REPO

if TYPE_CHECKING:
    from tests.fakes import FakeCudart, FakeTensorRT


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory) -> Path:
    """The embedded model (models/refusion-tiny), exported once."""
    from refusion.export.exporter import export_onnx

    return export_onnx(REPO / "models" / "refusion-tiny", tmp_path_factory.mktemp("tiny") / "onnx", validate=False)


# The embedded model's chat template before tool calls: one that never reads `tools`
UNTOOLED_TEMPLATE = ("{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                     "'<|im_end|>\\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
                     "{%- endif -%}")


@pytest.fixture(scope="session")
def untooled_export(tmp_path_factory) -> Path:
    """The embedded model with a chat template that has no tool format (as many base models' have), exported."""
    import json
    import shutil

    from refusion.export.exporter import export_onnx

    root = tmp_path_factory.mktemp("untooled")
    checkpoint = Path(shutil.copytree(REPO / "models" / "refusion-tiny", root / "checkpoint"))
    (checkpoint / "chat_template.jinja").write_text(UNTOOLED_TEMPLATE, encoding="utf-8")
    config = json.loads((checkpoint / "tokenizer_config.json").read_text(encoding="utf-8"))
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": UNTOOLED_TEMPLATE}),
                                                      encoding="utf-8")
    return export_onnx(checkpoint, root / "onnx", validate=False)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    from refusion.tools.checks.fixtures.checkpoints import make_checkpoint

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
    from tests.helpers import export_peaky

    return export_peaky(tmp_path_factory.mktemp("peaky"), seed=0)[1]


@pytest.fixture(scope="session")
def peaky_int4(peaky_export) -> dict[int, Path]:
    """The peaky model (hidden 64, intermediate 128) as int4-rtn, by block size: fp16 graphs, as TensorRT
    takes int4 (weight-only, half-precision activations; an fp32 int4 build is refused)."""
    from refusion.export.exporter import export_onnx
    from refusion.export.quantize import QuantizeOptions

    ckpt = peaky_export.parent / "ckpt0"  # export_peaky's checkpoint beside its export
    return {b: export_onnx(ckpt, peaky_export.parent / f"int4-{b}", dtype="fp16", validate=False,
                           quantize=QuantizeOptions("int4-rtn", b)) for b in (32, 64)}


@pytest.fixture(scope="session")
def peaky_int4_head(peaky_export) -> Path:
    """The peaky model as int4-rtn block 64 with its lm_head int4 too (--quantize-head), fp16 graphs."""
    from refusion.export.exporter import export_onnx
    from refusion.export.quantize import QuantizeOptions

    return export_onnx(peaky_export.parent / "ckpt0", peaky_export.parent / "int4-head", dtype="fp16", validate=False,
                       quantize=QuantizeOptions("int4-rtn", 64, head=True))


@pytest.fixture
def fakes(monkeypatch) -> tuple[FakeTensorRT, FakeCudart]:
    """Install the fakes where the code imports tensorrt and cuda-python from."""
    from refusion.runtime.runners import cuda
    from tests.fakes import FakeCudart, FakeTensorRT

    cudart = FakeCudart()
    trt = FakeTensorRT(cudart)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(cuda, "_CUDART", cudart)
    monkeypatch.setattr(cuda, "_STAGING", cuda._SharedStaging())  # its stream belongs to this test's fake
    return trt, cudart

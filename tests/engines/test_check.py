"""`refusion-export check ENGINES_DIR` end to end on the CPU fakes: it passes on engines of the
export and fails on engines of another model."""

from __future__ import annotations

import pytest

from refusion.engines import check
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from tests.engines.conftest import fake_engines


def test_check_passes_on_engines_of_the_export(peaky_export, fakes, tmp_path):
    lines: list[str] = []
    engines = fake_engines(peaky_export, tmp_path / "engines")
    assert check.check_engines(engines, report=lines.append)
    assert lines[-1].startswith("PASS")
    assert any(line.startswith("slot rows") for line in lines)
    assert any("within abs/rel 0.001 in all 5 cases" in line for line in lines)


def test_check_fails_on_engines_of_another_model(peaky_export, exports, fakes, tmp_path, monkeypatch):
    engines = fake_engines(peaky_export, tmp_path / "engines")
    monkeypatch.setattr(check, "source_export", lambda m: ExportManifest.load(exports["fp32"]))
    lines: list[str] = []
    assert not check.check_engines(engines, report=lines.append)
    assert lines[-1].startswith("FAIL") and any("FAIL" in line for line in lines[:-1])


def test_check_refuses_a_changed_export_and_bf16(peaky_export, exports, fakes, tmp_path):
    engines = fake_engines(peaky_export, tmp_path / "engines")
    (peaky_export / "planner.onnx").write_bytes((peaky_export / "planner.onnx").read_bytes() + b" ")
    try:
        with pytest.raises(RefusionError, match="planner.onnx changed since the engines were built"):
            check.check_engines(engines)
    finally:
        (peaky_export / "planner.onnx").write_bytes((peaky_export / "planner.onnx").read_bytes()[:-1])
    with pytest.raises(RefusionError, match="bfloat16 engines; onnxruntime cannot feed"):
        check.check_engines(fake_engines(exports["bf16"], tmp_path / "bf16"))

"""`refusion-export build` refuses what it can before TensorRT; without TensorRT it says how to get it."""

from __future__ import annotations

import importlib.util

import pytest
from click.testing import CliRunner

from refusion.runtime.core.defaults import DecodeDefaults
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.core.profiles import DecodeLimits, export_limits
from refusion.tools.build_command import build_command, check_engines
from tests.helpers import fake_engines


def test_build_refuses_before_tensorrt(exports, tmp_path):
    runner = CliRunner()
    out = tmp_path / "engines"
    result = runner.invoke(build_command, [str(exports["fp32"]), "-o", str(out), "--precision", "fp16"])
    assert isinstance(result.exception, RefusionError) and "--dtype fp16" in str(result.exception)
    result = runner.invoke(build_command, [str(exports["fp32"]), "-o", str(out), "--serial-num-blocks", "3"])
    assert isinstance(result.exception, RefusionError) and "--serial-num-blocks 3" in str(result.exception)
    if importlib.util.find_spec("tensorrt") is None:  # on GPU machines the build would run
        result = runner.invoke(build_command, [str(exports["fp32"]), "-o", str(out), "--max-prompt", "64"])
        assert isinstance(result.exception, RefusionError)
        assert "pip install 'refusion-trt[trt]'" in str(result.exception) and not out.exists()


def test_build_takes_the_exports_recorded_limits_by_default(tiny_export, tmp_path):
    """The embedded model: 256 positions, defaults gen_length 64, slot_size 4, 4 blocks (the paper's 2048 + 512
    would not fit); a flag overrides its own limit, and the prompt limit follows a longer generation."""
    manifest = ExportManifest.read(tiny_export)
    assert export_limits(manifest.defaults, manifest.max_positions) == DecodeLimits(192, 64, 4, 4)
    assert export_limits(manifest.defaults, manifest.max_positions, gen_length=128, max_batch=2) == \
        DecodeLimits(128, 128, 4, 4, max_batch=2)
    assert export_limits(DecodeDefaults(), 40960) == DecodeLimits()  # ReFusion-8B: the paper's limits, as before
    result = CliRunner().invoke(build_command, [str(tiny_export), "-o", str(tmp_path / "engines")])
    assert "an engine for prompts <= 192, gen_length <= 64, blocks <= 16 tokens" in result.stderr
    if importlib.util.find_spec("tensorrt") is None:  # no flag needed to get as far as TensorRT
        assert isinstance(result.exception, RefusionError) and "pip install 'refusion-trt[trt]'" in str(result.exception)


def test_check_engines_entry_point(peaky_export, fakes, tmp_path, capsys):
    assert check_engines(fake_engines(peaky_export, tmp_path / "engines"))
    assert "PASS" in capsys.readouterr().out
    with pytest.raises(RefusionError, match="holds no TensorRT engines"):
        check_engines(tmp_path)

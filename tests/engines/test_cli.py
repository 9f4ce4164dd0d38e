"""`refusion-export build` refuses what it can before TensorRT; without TensorRT it says how to get it."""

from __future__ import annotations

import importlib.util

import pytest
from click.testing import CliRunner

from refusion.runtime.core.errors import RefusionError
from refusion.tools.build_command import build_command, check_engines
from tests.helpers import fake_engines


def test_build_refuses_before_tensorrt(exports, tmp_path):
    runner = CliRunner()
    out = tmp_path / "engines"
    result = runner.invoke(build_command, [str(exports["fp32"]), "-o", str(out), "--precision", "fp16"])
    assert isinstance(result.exception, RefusionError) and "--dtype fp16" in str(result.exception)
    result = runner.invoke(build_command, [str(exports["fp32"]), "-o", str(out), "--serial-blocks", "3"])
    assert isinstance(result.exception, RefusionError) and "--serial-blocks 3" in str(result.exception)
    if importlib.util.find_spec("tensorrt") is None:  # on GPU machines the build would run
        result = runner.invoke(build_command, [str(exports["fp32"]), "-o", str(out), "--max-prompt", "64"])
        assert isinstance(result.exception, RefusionError)
        assert "pip install 'refusion-trt[trt]'" in str(result.exception) and not out.exists()


def test_check_engines_entry_point(peaky_export, fakes, tmp_path, capsys):
    assert check_engines(fake_engines(peaky_export, tmp_path / "engines"))
    assert "PASS" in capsys.readouterr().out
    with pytest.raises(RefusionError, match="holds no TensorRT engines"):
        check_engines(tmp_path)

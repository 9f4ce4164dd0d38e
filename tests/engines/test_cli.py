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
    """The embedded model: 512 positions, defaults gen_length 64, slot_size 4, 4 blocks (the paper's 2048 + 512
    would not fit); a flag overrides its own limit, and the prompt limit follows a longer generation."""
    manifest = ExportManifest.read(tiny_export)
    assert manifest.max_positions == 512
    assert export_limits(manifest.defaults, manifest.max_positions) == DecodeLimits(448, 64, 4, 4, prefill_chunk=256)
    assert export_limits(manifest.defaults, manifest.max_positions, gen_length=128, max_batch=2) == \
        DecodeLimits(384, 128, 4, 4, max_batch=2, prefill_chunk=256)
    # ReFusion-8B: the paper's limits, as before, built for prefills in chunks of 256
    assert export_limits(DecodeDefaults(), 40960) == DecodeLimits(prefill_chunk=256)
    result = CliRunner().invoke(build_command, [str(tiny_export), "-o", str(tmp_path / "engines")])
    assert "an engine for prompts <= 448, gen_length <= 64, blocks <= 16 tokens" in result.stderr
    assert "forwards of <= 256 tokens" in result.stderr
    if importlib.util.find_spec("tensorrt") is None:  # no flag needed to get as far as TensorRT
        assert isinstance(result.exception, RefusionError) and "pip install 'refusion-trt[trt]'" in str(result.exception)


def test_build_bounds_prefills_by_default(tiny_export, tmp_path):
    """Issue 43: a build bounds a forward at 256 tokens unless told otherwise (0: whole prefills; a bound below a
    block is refused, naming the way out), and its help says so; the default never refuses a longer block, whose
    plan and verify forwards cannot be cut: it takes the block."""
    manifest = ExportManifest.read(tiny_export)
    bound = {chunk: export_limits(manifest.defaults, manifest.max_positions, prefill_chunk=chunk).prefill_chunk
             for chunk in (None, 0, 64)}
    assert bound == {None: 256, 0: None, 64: 64}
    long_blocks = export_limits(DecodeDefaults(), 40960, gen_length=2048, serial_blocks=4)
    assert (long_blocks.block_length, long_blocks.prefill_chunk) == (512, 512)
    with pytest.raises(RefusionError, match=r"--prefill-chunk 8 must be .* block of 16 .* --prefill-chunk 0 for no bound"):
        export_limits(manifest.defaults, manifest.max_positions, prefill_chunk=8)
    help_text = " ".join(CliRunner().invoke(build_command, ["--help"]).output.split())
    assert "0: no bound, the whole prompt in one forward. [default: 256, or the block where that is longer]" in help_text
    result = CliRunner().invoke(build_command, [str(tiny_export), "-o", str(tmp_path / "engines"), "--prefill-chunk",
                                                "0"])
    assert "whole prefills" in result.stderr


def test_check_engines_entry_point(peaky_export, fakes, tmp_path, capsys):
    assert check_engines(fake_engines(peaky_export, tmp_path / "engines"))
    assert "PASS" in capsys.readouterr().out
    with pytest.raises(RefusionError, match="holds no TensorRT engines"):
        check_engines(tmp_path)

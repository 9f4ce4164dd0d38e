"""tools/estimates/jetson_memory.py's arithmetic on a tiny export, against values worked out by hand."""

from __future__ import annotations

import pytest

from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.core.profiles import DecodeLimits
from refusion.tools.estimates import jetson_memory

pytest.importorskip("transformers")

LIMITS = DecodeLimits(max_prompt=16, gen_length=64, slot_size=4, serial_blocks=2)  # block 32, KV capacity 112


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """TinySpec: 2 layers, hidden 64, 4/2 heads of 16, intermediate 96, vocabulary 384, untied."""
    from refusion.export.exporter import export_onnx
    from refusion.tools.checks.fixtures.checkpoints import make_checkpoint

    root = tmp_path_factory.mktemp("jetson")
    return export_onnx(make_checkpoint(root / "ckpt"), root / "onnx", validate=False)


def test_memory_of_a_tiny_export(tiny, capsys):
    fp16, int4 = jetson_memory.memory(ExportManifest.read(tiny).dims, LIMITS, block_size=32)
    # params: embed + lm_head 2 x 384 x 64 = 49152; per layer norms 64 + 64 + 16 + 16 = 160 and linears
    # q 64x64 + k 64x32 + v 64x32 + o 64x64 + gate, up 64x96 + down 96x64 = 30720; final norm 64
    assert fp16.weights == 2 * (49152 + 2 * (160 + 30720) + 64) == 221952
    # int4: 61440 linear values, two a byte; scales [K/32, N]: q 2x64, k 2x32, v 2x32, o 2x64, gate/up 2x96,
    # down 3x64 = 960 a layer, fp16; the rest fp16
    assert int4.weights == 61440 // 2 + 2 * 2 * 960 + 2 * (110976 - 61440) == 133632
    # 112 tokens x 2 layers x (K, V) x 2 kv heads x 16 x 2 bytes
    assert fp16.kv == int4.kv == 112 * 2 * 2 * 2 * 16 * 2 == 28672
    # decode profile at its largest: seq 32 over past 16 + 64 + 32 = 112, context 144:
    # layer 32 x (128 + 64 + 64 + 288) x 2 = 34816, attention 4 x 32 x 144 x 10 = 184320 (heads 32 x 384 x 10 less);
    # the prefill's 48 tokens compute the heads of a block, 32 x 384 x 10 = 122880, and its layers
    # 48 x 544 x 2 + 4 x 48 x 48 x 10 = 144384 < 219136
    assert (fp16.activations, fp16.activations_profile) == (34816 + 184320, "decode")
    assert jetson_memory.main([str(tiny), "--max-prompt", "16", "--gen-length", "64", "--slot-size", "4",
                               "--serial-blocks", "2", "--block-size", "32"]) == 0
    out = capsys.readouterr().out
    assert "| fp16 | 0.00 GiB (0.00 GB) |" in out and out.count("fits (+61.0)") == 2


def test_refusion_8b_int4_weights_fit_the_target():
    fp16, int4 = jetson_memory.memory(jetson_memory.REFUSION_8B, DecodeLimits(), 128)
    assert int4.weights / 2**30 <= 6 < fp16.weights / 2**30
    assert int4.kv == 2688 * 36 * 2 * 8 * 128 * 2

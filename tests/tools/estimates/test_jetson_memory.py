"""tools/estimates/jetson_memory.py's arithmetic on a tiny export, against values worked out by hand."""

from __future__ import annotations

import dataclasses
import json

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
                               "--serial-num-blocks", "2", "--block-size", "32"]) == 0
    out = capsys.readouterr().out
    assert "| fp16 | 0.00 GiB (0.00 GB) | in the engine |" in out and out.count("fits (+61.0)") == 6


def test_int4_head_and_host_embeddings_of_a_tiny_export(tiny, tmp_path):
    rows = jetson_memory.memory(ExportManifest.read(tiny).dims, LIMITS, 32, heads=(False, True), host=(False, True))
    by = {(m.precision, m.host_embeddings): m for m in rows}
    assert len(rows) == 6
    int4, head = by["int4-awq block 32", False], by["int4-awq block 32, int4 lm_head", False]
    # the int4 head: 64 x 384 values two a byte, scales [64 / 32, 384] fp16, instead of 64 x 384 fp16
    assert head.weights == int4.weights - 49152 + 64 * 384 // 2 + 2 * 384 * 2 == 98304
    # on the host the engine holds all but the 384 x 64 fp16 table; resident: 112 rows (the KV capacity) of
    # 128 bytes, a page each, is more than the 49152-byte table, so the table; plus inputs_embeds at the
    # prefill's 48 tokens x 128 bytes
    host = by["int4-awq block 32", True]
    assert (host.weights, host.embeddings) == (int4.weights - 49152, 49152 + 48 * 128)
    assert host.total == int4.total - 49152 + 49152 + 48 * 128
    assert by["fp16", True].weights == by["fp16", False].weights - 49152
    assert jetson_memory.main([str(tiny), "--max-prompt", "16", "--gen-length", "64", "--slot-size", "4",
                               "--serial-num-blocks", "2", "--block-size", "32", "--head", "int4", "--embeddings", "host",
                               "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "jetson.json").read_text())
    assert [(r["precision"], r["host_embeddings"]) for r in report["rows"]] == [
        ("fp16", True), ("int4-awq block 32, int4 lm_head", True)]
    assert report["rows"][1]["weights"] == head.weights - 49152
    assert "only the rows looked up" in (tmp_path / "jetson.md").read_text()


def test_a_tied_head_stays_in_the_engine():
    """A tied head is the embedding table: neither an int4 head nor the table out of the engine applies."""
    tied = dataclasses.replace(jetson_memory.REFUSION_8B, tie_word_embeddings=True)
    rows = jetson_memory.memory(tied, DecodeLimits(), 128, heads=(False, True), host=(False, True))
    assert [(m.precision, m.host_embeddings, m.embeddings) for m in rows] == [
        ("fp16", False, 0), ("fp16", False, 0), ("int4-awq block 128", False, 0), ("int4-awq block 128", False, 0)]


def test_refusion_8b_int4_weights_fit_the_target():
    fp16, int4 = jetson_memory.memory(jetson_memory.REFUSION_8B, DecodeLimits(), 128)
    assert int4.weights / 2**30 <= 6 < fp16.weights / 2**30
    assert int4.kv == 2688 * 36 * 2 * 8 * 128 * 2


def test_refusion_8b_int4_on_an_orin_nano_fits_with_the_embeddings_on_the_host():
    """Issue 22's target at --max-prompt 512 --gen-length 256 with the 3 GiB headroom: int4 fits with the table on
    the host (with or without the int4 head, which adds margin), not with it in the engine."""
    rows = jetson_memory.memory(jetson_memory.REFUSION_8B, DecodeLimits(max_prompt=512, gen_length=256), 128,
                                heads=(False, True), host=(False, True))
    fits = {(m.precision.endswith("int4 lm_head"), m.host_embeddings): m.total / 2**30 + 3 <= 8
            for m in rows if m.precision != "fp16"}
    assert fits == {(False, False): False, (False, True): True, (True, False): False, (True, True): True}
    # the table's resident pages: 832 rows (KV capacity) x 8 KiB, plus inputs_embeds at the prefill's 576 tokens
    host = next(m for m in rows if m.host_embeddings)
    assert host.embeddings == 832 * 8192 + 576 * 8192


def test_a_prefill_bound_sizes_the_prefill_profile_and_fits_refusion_8b_on_the_orin_nano_at_the_defaults():
    """Issue 34: at --max-prompt 2048 --gen-length 512 the 2176-token prefill's attention sets the activations;
    engines built with --prefill-chunk 256 take 256 tokens over a past instead, and ReFusion-8B int4 (int4 head,
    embeddings on the host) fits an Orin Nano 8GB with the 3 GiB headroom."""
    whole, chunked = DecodeLimits(), DecodeLimits(prefill_chunk=256)
    dims = jetson_memory.REFUSION_8B
    (acts, _), (bounded, profile) = (jetson_memory.activation_bytes(dims, lim) for lim in (whole, chunked))
    # 256 tokens over a past of up to 2048 + 128 - 1: context 2431, 32 heads x 256 x 2431 x 10 bytes of attention
    layer = 256 * (2 * 4096 + 4096 + 2 * 1024 + 3 * 12288) * 2
    assert (bounded, profile) == (layer + 32 * 256 * 2431 * 10, "prefill") and bounded < acts / 7
    nano = jetson_memory.DEVICES["Orin Nano 8GB"]
    for limits, fits in ((whole, False), (chunked, True)):
        row = jetson_memory.memory(dims, limits, 128, heads=(True,), host=(True,))[-1]
        assert (row.total / jetson_memory.GIB + jetson_memory.HEADROOM_GIB <= nano) is fits


def test_the_default_run_is_a_default_build_and_fits_refusion_8b_int4_on_the_orin_nano(capsys):
    """Issue 43: the table's default run takes the bound `refusion-export build` builds with (256 tokens), so its
    int4 row with the embeddings on the host and an int4 head fits the Orin Nano 8GB at the default limits;
    `--prefill-chunk 0` is an engine built for whole prefills, which does not."""
    assert jetson_memory.main([]) == 0
    out = capsys.readouterr().out
    assert "--max-prompt 2048 --gen-length 512" in out and "--prefill-chunk 256" in out
    row = next(line for line in out.splitlines() if "int4 lm_head | 3.63 GiB" in line)
    assert "0.21 GiB (prefill)" in row and row.endswith("| fits (+0.8) |")
    assert jetson_memory.main(["--prefill-chunk", "0"]) == 0
    whole = capsys.readouterr().out
    assert "--prefill-chunk 0" in whole and "1.62 GiB (prefill)" in whole
    nano = [line.rsplit("|", 2)[1].strip() for line in whole.splitlines() if line.startswith("| int4")]
    assert len(nano) == 4 and all(cell.startswith("no") for cell in nano)

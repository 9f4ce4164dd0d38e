"""Fixtures for runtime tests: peaky tiny HF models exported once per module; the embedded model's
export once per session, and the tokens each job gets decoded alone (the concurrency oracle)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refusion.export.exporter import export_onnx
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.decode import DecodeTrace, Tokens, ar_decode, refusion_decode
from refusion.runtime.params import DecodeParams
from tests.fixtures.tokenizer_files import write_tokenizer
from tests.reference.models import make_peaky_model

REPO = Path(__file__).resolve().parents[2]
VOCAB = 384  # room for the fixture tokenizer's 326 tokens; the mask is the last id, as in ReFusion
MASK_ID = VOCAB - 1


def export_peaky(tmp: Path, seed: int, **dims) -> tuple[object, Path]:
    """(HF model, export dir) for a peaky tiny model with the fixture tokenizer."""
    model = make_peaky_model(seed, vocab_size=VOCAB, **dims)
    ckpt = tmp / f"ckpt{seed}"
    model.save_pretrained(ckpt, safe_serialization=True)
    write_tokenizer(ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["mask_token_id"] = MASK_ID
    (ckpt / "config.json").write_text(json.dumps(config))
    out = export_onnx(ckpt, tmp / f"onnx{seed}", validate=False)
    return model, out


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory) -> Path:
    """The embedded model (models/refusion-tiny), exported once."""
    return export_onnx(REPO / "models" / "refusion-tiny", tmp_path_factory.mktemp("tiny") / "onnx", validate=False)


# A mix for the concurrency tests: slot sizes, block counts and thresholds, AR and ReFusion, EOS early or never.
MIXED_SETTINGS = [
    dict(gen_length=64, slot_size=4, serial_num_blocks=4, slot_threshold=0.5, token_threshold=0.1),
    dict(gen_length=32, slot_size=8, serial_num_blocks=2, slot_threshold=0.7, token_threshold=0.3),
    dict(gen_length=48, slot_size=4, serial_num_blocks=1, slot_threshold=0.9, token_threshold=0.6),
    dict(gen_length=40, mode="ar"),
    dict(gen_length=8, slot_size=4, serial_num_blocks=2, slot_threshold=0.0, token_threshold=1.0),  # no EOS: length
]


def decode_alone(export: Path, jobs: list[tuple[list[int], dict]]) -> list[list[int]]:
    """Each job's tokens decoded by itself on onnxruntime CPU (no engine): the oracle."""
    from refusion.runtime.runners.onnxruntime import OrtRunner

    manifest = ExportManifest.load(export)
    with OrtRunner(manifest, threads=1) as runner:
        return decode_alone_on(runner, manifest, jobs)


def decode_alone_on(runner, manifest: ExportManifest, jobs: list[tuple[list[int], dict]]) -> list[list[int]]:
    """Each job decoded by itself on `runner` (slot 0, no engine)."""
    out = []
    for ids, settings in jobs:
        params = DecodeParams(**settings)
        decode = ar_decode if params.mode == "ar" else refusion_decode
        tokens = Tokens(ids, manifest.mask_token_id, manifest.eos_token_id)
        committed = {p: t for c in decode(runner, tokens, params, DecodeTrace(), False)
                     for p, t in zip(c.positions, c.token_ids)}
        out.append([committed[p] for p in sorted(committed)])
    return out


def chat_jobs(export: Path, n: int, settings: list[dict]) -> list[tuple[list[int], dict]]:
    """The first `n` held-out prompts, chat-templated, each with one of `settings` in turn."""
    from refusion.runtime.generator import Generator
    from refusion.tools.tasks import held_out

    with Generator.from_dir(export, backend="ort-cpu", threads=1) as gen:
        prompts = [gen.prompt_ids(ex.prompt, chat=True) for ex in held_out(n)]
    return [(ids, settings[i % len(settings)]) for i, ids in enumerate(prompts)]

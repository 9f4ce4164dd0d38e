"""Fixtures for runtime tests: peaky tiny HF models exported once per module."""

from __future__ import annotations

import json
from pathlib import Path

from refusion.export.exporter import export_onnx
from tests.fixtures.tokenizer_files import write_tokenizer
from tests.reference.models import make_peaky_model

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

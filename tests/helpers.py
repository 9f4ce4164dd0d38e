"""Helpers the tests share across packages (fixtures live in tests/conftest.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.decode import strategy
from refusion.runtime.decode.steps import Tokens
from refusion.runtime.params import DecodeParams
from refusion.runtime.request import GenerationResult, Request
from refusion.runtime.scheduler import Scheduler
from refusion.tools.checks.fixtures.checkpoints import TinySpec

REPO = Path(__file__).resolve().parents[1]
VOCAB = 384  # room for the fixture tokenizer's 326 tokens; the mask is the last id, as in ReFusion
MASK_ID = VOCAB - 1

# One feature per export fixture, so a failure names the feature it breaks.
SPECS: dict[str, TinySpec] = {
    "gqa1": TinySpec(num_heads=4, kv_heads=4),  # plain multi-head attention
    "gqa2": TinySpec(num_heads=4, kv_heads=2),
    "gqa4": TinySpec(num_heads=8, kv_heads=2, head_dim=8, weight_scale=3.0),  # peaky logits too
    "head_dim": TinySpec(num_heads=4, kv_heads=2, head_dim=24),  # head_dim != hidden / heads (16)
    "tied": TinySpec(tie_word_embeddings=True),
    "sharded": TinySpec(shard_size="100KB"),
    "bf16": TinySpec(dtype="bfloat16"),  # bf16-stored weights, exported to fp32 graphs
}


def export_peaky(tmp: Path, seed: int, **dims) -> tuple[object, Path]:
    """(HF model, export dir) for a peaky tiny model with the fixture tokenizer."""
    from refusion.export.exporter import export_onnx
    from refusion.tools.checks.fixtures.tokenizer_files import write_tokenizer
    from tests.tiny_models import make_peaky_model

    model = make_peaky_model(seed, vocab_size=VOCAB, **dims)
    ckpt = tmp / f"ckpt{seed}"
    model.save_pretrained(ckpt, safe_serialization=True)
    write_tokenizer(ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["mask_token_id"] = MASK_ID
    (ckpt / "config.json").write_text(json.dumps(config))
    out = export_onnx(ckpt, tmp / f"onnx{seed}", validate=False)
    return model, out


# A mix for the concurrency tests: slot sizes, block counts and thresholds, AR and ReFusion, EOS early or never.
MIXED_SETTINGS = [
    dict(gen_length=64, slot_size=4, serial_num_blocks=4, slot_threshold=0.5, token_threshold=0.1),
    dict(gen_length=32, slot_size=8, serial_num_blocks=2, slot_threshold=0.7, token_threshold=0.3),
    dict(gen_length=48, slot_size=4, serial_num_blocks=1, slot_threshold=0.9, token_threshold=0.6),
    dict(gen_length=40, mode="ar"),
    dict(gen_length=8, slot_size=4, serial_num_blocks=2, slot_threshold=0.0, token_threshold=1.0),  # no EOS: length
]


# jobs for the peaky checkpoint (export_peaky): prompts as raw ids, each with one of MIXED_SETTINGS in turn
PEAKY_JOBS = [(list(range(5 + i, 17 + 2 * i)), MIXED_SETTINGS[i % len(MIXED_SETTINGS)]) for i in range(6)]


def decode_on(runner, tokens: Tokens, params) -> GenerationResult:
    """One request by itself through a scheduler over `runner` (the only driver of step machines), with
    `tokens`' own mask and EOS ids: its tokens, commits and stats."""
    scheduler = Scheduler(runner)
    try:
        return scheduler.submit(Request(tokens, params)).result()
    finally:
        scheduler.close()


def broken_request(gen, ids: list[int], error: BaseException, **settings) -> Request:
    """A request of `gen` whose step machine raises `error` at its second step (after its first forward), as a
    bug in a strategy would: it must fail alone, with that error."""
    m = gen.manifest
    request = Request(Tokens(ids, m.mask_token_id, m.eos_token_id), gen.params(**settings))
    steps = [0]
    real = request.send

    def send(outputs):
        steps[0] += 1
        if steps[0] == 2:
            raise error
        return real(outputs)

    request.send = send  # before the scheduler sees it
    return gen.scheduler.submit(request)


def decode_alone(export: Path, jobs: list[tuple[list[int], dict]]) -> list[list[int]]:
    """Each job's tokens decoded by itself on onnxruntime CPU: the oracle."""
    return [result.token_ids for result in results_alone(export, jobs)]


def results_alone(export: Path, jobs: list[tuple[list[int], dict]]) -> list[GenerationResult]:
    """Each job decoded by itself on onnxruntime CPU, its whole result."""
    from refusion.runtime.runners.onnxruntime import OrtRunner

    manifest = ExportManifest.load(export)
    with OrtRunner(manifest, threads=1) as runner:
        return results_alone_on(runner, manifest, jobs)


def decode_alone_on(runner, manifest: ExportManifest, jobs: list[tuple[list[int], dict]]) -> list[list[int]]:
    """Each job's tokens decoded by itself on `runner`, one request at a time."""
    return [result.token_ids for result in results_alone_on(runner, manifest, jobs)]


def results_alone_on(runner, manifest: ExportManifest, jobs: list[tuple[list[int], dict]]) -> list[GenerationResult]:
    tokens = [Tokens(ids, manifest.mask_token_id, manifest.eos_token_id) for ids, _ in jobs]
    return [decode_on(runner, t, DecodeParams(**settings)) for t, (_, settings) in zip(tokens, jobs)]


def chat_jobs(export: Path, n: int, settings: list[dict]) -> list[tuple[list[int], dict]]:
    """The first `n` held-out prompts, chat-templated, each with one of `settings` in turn."""
    from refusion.runtime.generator import Generator
    from refusion.tools.tasks import held_out

    with Generator.from_dir(export, backend="ort-cpu", threads=1) as gen:
        prompts = [gen.prompt_ids(ex.prompt, chat=True) for ex in held_out(n)]
    return [(ids, settings[i % len(settings)]) for i, ids in enumerate(prompts)]


def fake_engines(export: Path, output: Path, limits=None, **target) -> Path:
    """An engines directory as `build_engines` writes it, with a fake engine file."""
    from refusion.engines.build import plan_build, write_engines_dir
    from refusion.runtime.core.engines_manifest import Target
    from refusion.runtime.core.profiles import DecodeLimits
    from tests.fakes import fake_engine_bytes

    plan = plan_build(export, output, limits or DecodeLimits(max_prompt=16, gen_length=64, slot_size=4, serial_blocks=2))
    output.mkdir(parents=True)
    where = {"tensorrt": "10.13.0.35", "gpu": "Fake GPU", "compute_capability": "9.0", **target}
    write_engines_dir(plan, output, fake_engine_bytes(plan), Target(**where), plan.options.strongly_typed, seconds=0.0)
    return output


def assert_nothing_published(out: Path) -> None:
    assert not (out / "refusion.json").exists(), f"{out} looks like a complete export"
    assert not list(out.parent.glob(f".{out.name}.partial-*")), "staging directory left behind"


def pyproject() -> dict[str, Any]:
    """The project's pyproject.toml, parsed (tomllib is Python 3.11's; the dev extra brings tomli to 3.10)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def export_unvalidated(checkpoint: Path, out: Path, **options) -> Path:
    """export_onnx without its validation (the tests that call it compare tokens instead)."""
    from refusion.export.exporter import export_onnx

    return export_onnx(checkpoint, out, validate=False, **options)


def edited_export(export: Path, tmp_path: Path, change) -> Path:
    """A copy of `export` whose refusion.json `change(raw)` edits, its digests recomputed: only the field checks
    can refuse it."""
    import shutil

    from refusion.runtime.core.export_manifest import _SECTIONS, _digest

    d = Path(shutil.copytree(export, tmp_path / "edited"))
    raw = json.loads((d / "refusion.json").read_text())
    change(raw)
    raw["digests"] = {k: _digest(raw[k]) for k in _SECTIONS}
    (d / "refusion.json").write_text(json.dumps(raw))
    return d


def as_format_6(export: Path, tmp_path: Path) -> Path:
    """A copy of `export` as refusion-trt wrote it before structured output (refusion.json v6): graphs that take no
    vocab_mask (here the input made an all-ones constant), the contract, file records and digests to match."""
    import shutil

    import numpy as np
    import onnx
    from onnx import numpy_helper

    from refusion.runtime.core.contract import VOCAB_MASK, mask_bytes
    from refusion.runtime.core.export_manifest import _SECTIONS, _digest
    from refusion.runtime.core.files import FileRecord

    d = Path(shutil.copytree(export, tmp_path / "v6"))
    raw = json.loads((d / "refusion.json").read_text())
    width = mask_bytes(raw["model"]["vocab_size"])
    for name, graph in raw["graphs"].items():
        model = onnx.load(d / graph["file"], load_external_data=False)
        kept = [i for i in model.graph.input if i.name != VOCAB_MASK]
        del model.graph.input[:]
        model.graph.input.extend(kept)
        model.graph.initializer.append(numpy_helper.from_array(np.full((1, 1, width), 255, np.uint8), VOCAB_MASK))
        onnx.save(model, d / graph["file"])
        graph["inputs"] = [t for t in graph["inputs"] if t["name"] != VOCAB_MASK]
        raw["files"][graph["file"]] = FileRecord.of(d / graph["file"]).to_json()
    raw["format_version"] = 6
    raw["digests"] = {k: _digest(raw[k]) for k in _SECTIONS}
    (d / "refusion.json").write_text(json.dumps(raw))
    return d


def positions(params: DecodeParams) -> int:
    """The positions a request of `params` generates into: its strategy's count."""
    return strategy(params.mode).positions(params)

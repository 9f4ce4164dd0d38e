"""Bad checkpoints and outputs: one clear RefusionError each, and nothing left that looks like an export."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from refusion.export.exporter import export_onnx
from refusion.runtime.core.errors import RefusionError
from tests.helpers import assert_nothing_published


@pytest.fixture
def ckpt(store, tmp_path) -> Path:
    """A private copy of a good checkpoint, to break."""
    return Path(shutil.copytree(store.checkpoint("gqa2"), tmp_path / "ckpt"))


def _edit_config(ckpt: Path, **changes) -> dict:
    config = json.loads((ckpt / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (ckpt / "config.json").write_text(json.dumps(config))
    return config


def _fails(ckpt: Path, out: Path, match: str, **kwargs) -> RefusionError:
    with pytest.raises(RefusionError, match=match) as info:
        export_onnx(ckpt, out, validate=False, **kwargs)
    assert_nothing_published(out)
    return info.value


def test_missing_checkpoint_dir(tmp_path):
    _fails(tmp_path / "nope", tmp_path / "out", r"nope is not a directory")
    assert not (tmp_path / "out").exists()


def test_missing_config(ckpt, tmp_path):
    (ckpt / "config.json").unlink()
    _fails(ckpt, tmp_path / "out", r"config\.json not found")


def test_wrong_architecture(ckpt, tmp_path):
    _edit_config(ckpt, architectures=["LlamaForCausalLM"])
    _fails(ckpt, tmp_path / "out", r"architectures=\['LlamaForCausalLM'\] is not supported.*Qwen3ForCausalLM")


@pytest.mark.parametrize("content, match", [
    ("[]", r"config\.json holds a JSON list, not an object; restore it"),
    ('{"architectures": ["Qwen3ForCausalLM"], "hidden_size": "abc"}',
     r"config\.json: field hidden_size is 'abc' \(str\), expected an integer >= 1; restore the original config\.json"),
    ('{"architectures": ["Qwen3ForCausalLM"], "hidden_size": null}',
     r"config\.json: field hidden_size is None \(NoneType\), expected an integer >= 1"),
], ids=["list", "string", "null"])
def test_config_of_the_wrong_shape(ckpt, tmp_path, content, match):
    config = json.loads((ckpt / "config.json").read_text())
    if content.startswith("{"):
        config.update(json.loads(content))
        content = json.dumps(config)
    (ckpt / "config.json").write_text(content)
    _fails(ckpt, tmp_path / "out", match)


def test_checkpoint_decode_defaults_are_recorded_and_checked(ckpt, tmp_path):
    from refusion.runtime.core.export_manifest import ExportManifest

    mine = {"gen_length": 48, "slot_size": 8, "serial_num_blocks": 2, "slot_threshold": 0.7, "token_threshold": 0.2}
    (ckpt / "generation_config.json").write_text(json.dumps({"refusion_decode": mine}))
    out = export_onnx(ckpt, tmp_path / "out", validate=False)
    assert ExportManifest.load(out).defaults.to_json() == mine
    (ckpt / "generation_config.json").write_text(json.dumps({"refusion_decode": {**mine, "slot_size": "8"}}))
    _fails(ckpt, tmp_path / "out2", r"generation_config\.json: field refusion_decode\.slot_size: decode default slot_size='8' must be a "
                                          "positive integer")


@pytest.mark.parametrize("keep", ["data", "header"], ids=["truncated-data", "truncated-header"])
def test_truncated_safetensors(ckpt, tmp_path, keep):
    file = ckpt / "model.safetensors"
    size = file.stat().st_size
    os.truncate(file, size - 1000 if keep == "data" else 20)
    _fails(ckpt, tmp_path / "out", r"model\.safetensors is not a readable safetensors file.*truncated")


def test_shape_mismatch(ckpt, tmp_path):
    _edit_config(ckpt, intermediate_size=128)
    _fails(ckpt, tmp_path / "out", r"mlp\.gate_proj\.weight.*shape \[96, 64\], expected \[128, 64\].*config and weights disagree")


def test_missing_mask_token_id_and_the_flag_that_fixes_it(ckpt, tmp_path):
    mask_id = json.loads((ckpt / "config.json").read_text())["mask_token_id"]
    _edit_config(ckpt, mask_token_id=None)
    _fails(ckpt, tmp_path / "out", r"no mask_token_id.*--mask-token-id")
    _fails(ckpt, tmp_path / "out", r"mask_token_id=100000 is outside the vocabulary \[0, 384\)", mask_token_id=100000)
    out = export_onnx(ckpt, tmp_path / "out", mask_token_id=mask_id, validate=False)
    assert json.loads((out / "refusion.json").read_text())["tokens"]["mask_token_id"] == mask_id


def test_pickle_checkpoint_refused_with_conversion_hint(ckpt, tmp_path):
    (ckpt / "model.safetensors").rename(ckpt / "pytorch_model.bin")
    err = _fails(ckpt, tmp_path / "out", r"pickle weights \(pytorch_model\.bin\)")
    assert "save_pretrained(DST, safe_serialization=True)" in str(err)


def test_missing_shard(store, tmp_path):
    ckpt = Path(shutil.copytree(store.checkpoint("sharded"), tmp_path / "ckpt"))
    shard = sorted(ckpt.glob("model-*.safetensors"))[1]
    shard.unlink()
    _fails(ckpt, tmp_path / "out", rf"shard {shard.name} listed in model\.safetensors\.index\.json is missing")


def test_existing_output_needs_force(store, tmp_path):
    ckpt = store.checkpoint("gqa2")
    out = export_onnx(ckpt, tmp_path / "out", validate=False)
    (out / "stale.txt").write_text("from an earlier export")
    with pytest.raises(RefusionError, match=r"already exists; pass --force"):
        export_onnx(ckpt, out, validate=False)
    assert (out / "stale.txt").exists()
    export_onnx(ckpt, out, validate=False, force=True)
    assert (out / "refusion.json").is_file() and not (out / "stale.txt").exists()
    assert not list(tmp_path.glob(".out.partial-*"))


def test_force_never_deletes_a_directory_that_is_not_an_export(store, tmp_path):
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(RefusionError, match=r"not an earlier export.*--force replaces only"):
        export_onnx(store.checkpoint("gqa2"), precious, validate=False, force=True)
    assert (precious / "notes.txt").read_text() == "keep me"
    assert_nothing_published(precious)


def test_output_under_a_regular_file(store, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    _fails(store.checkpoint("gqa2"), blocker / "out", r"cannot write to .*a-file \(a file is in the way\); choose a writable --output")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions; see test_output_under_a_regular_file")
def test_output_in_read_only_dir(store, tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        _fails(store.checkpoint("gqa2"), parent / "out", r"cannot write to .*ro \(Permission denied\)")
    finally:
        parent.chmod(0o700)


def test_interrupted_export_leaves_nothing(store, tmp_path):
    def interrupt(message: str) -> None:
        if message.startswith("infiller.onnx written"):
            raise KeyboardInterrupt

    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        export_onnx(store.checkpoint("gqa2"), out, progress=interrupt)
    assert not out.exists()
    assert_nothing_published(out)


def test_failed_validation_publishes_nothing(store, tmp_path, monkeypatch):
    from refusion.export import validate

    def failing(path, seed=0, pending=False, progress=None):
        report = validate.ValidationReport("float32")
        report.rows.append(("planner", "argmax_probs", 1.0, 1e-4))
        return report

    monkeypatch.setattr(validate, "validate_export", failing)
    out = tmp_path / "out"
    with pytest.raises(RefusionError, match=r"export validation failed \(report above\); nothing was written"):
        export_onnx(store.checkpoint("gqa2"), out)
    assert not out.exists()
    assert_nothing_published(out)

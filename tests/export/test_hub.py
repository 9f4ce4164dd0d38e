"""`refusion-export onnx ORG/NAME`: hub ids resolved through huggingface_hub, offline from a hub-style
cache under a temporary HF_HOME, online against a fake hub (no network)."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
from pathlib import Path
from unittest.mock import MagicMock

import pytest
from click.testing import CliRunner

from refusion.export import hub
from refusion.models import EMBEDDED_MODEL
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.tools.export_cli import cli

REPO_ID = "refusion-org/tiny-chat"
MAIN = "1" * 40
OTHER = "2" * 40


def cache_model(cache: Path, commit: str, src: Path = EMBEDDED_MODEL, refs: tuple[str, ...] = ("main",),
                skip: tuple[str, ...] = ()) -> Path:
    """A snapshot laid out as huggingface_hub writes it: blobs by hash, snapshot links, refs."""
    root = cache / f"models--{REPO_ID.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if f.name not in skip:
            data = f.read_bytes()
            blob = root / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(exist_ok=True)
            blob.write_bytes(data)
            (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return snapshot


def variant(tmp_path: Path, gen_length: int) -> Path:
    """The embedded model with other recorded decode defaults: which snapshot was exported shows in refusion.json."""
    out = Path(shutil.copytree(EMBEDDED_MODEL, tmp_path / f"variant-{gen_length}"))
    config = json.loads((out / "generation_config.json").read_text())
    config["refusion_decode"]["gen_length"] = gen_length
    (out / "generation_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture
def offline(tmp_path, monkeypatch) -> Path:
    """HF_HOME in tmp, HF_HUB_OFFLINE=1, the working directory empty; returns the hub cache."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return tmp_path / "hf" / "hub"


def export(*args: str):
    return CliRunner().invoke(cli, ["onnx", *map(str, args), "--no-validate"])


def exported_defaults(out: Path) -> int:
    return ExportManifest.read(out).defaults.gen_length


def test_offline_export_from_the_cache(offline, tmp_path):
    snapshot = cache_model(offline, MAIN)
    result = export(REPO_ID, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert f"{REPO_ID}: looking in the Hugging Face cache {offline}" in result.stderr
    assert f"{REPO_ID}: snapshot {MAIN} in {snapshot.parent}" in result.stderr
    manifest = json.loads((tmp_path / "out" / "refusion.json").read_text())
    assert manifest["source"]["checkpoint"] == str(snapshot.resolve())
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def test_revision_picks_the_snapshot(offline, tmp_path):
    cache_model(offline, MAIN)
    cache_model(offline, OTHER, variant(tmp_path, 32), refs=("v2",))
    for revision, out, gen_length in ((None, "main", 64), ("v2", "tag", 32), (OTHER, "commit", 32), (MAIN, "c1", 64)):
        args = ["--revision", revision] if revision else []
        result = export(REPO_ID, "-o", tmp_path / out, *args)
        assert result.exit_code == 0, result.output
        assert exported_defaults(tmp_path / out) == gen_length, revision


def test_hf_hub_cache_overrides_hf_home(offline, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    cache_model(elsewhere, MAIN)
    monkeypatch.setenv("HF_HUB_CACHE", str(elsewhere))
    result = export(REPO_ID, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert str(elsewhere) in result.stderr


def test_offline_and_not_cached_is_one_error(offline, tmp_path):
    result = export(REPO_ID, "-o", tmp_path / "out")
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1] == (
        f"error: {REPO_ID}: no local directory of that name, and the Hugging Face cache {offline} does not hold it; "
        "HF_HUB_OFFLINE is set, so nothing is downloaded. Fetch it once online, set HF_HOME or HF_HUB_CACHE to the "
        "cache that holds it, or pass a checkpoint directory.")
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()
    revision = export(REPO_ID, "-o", tmp_path / "out", "--revision", "v9")
    assert f"error: {REPO_ID} at revision v9: no local directory" in revision.stderr


def test_offline_and_partly_cached_names_the_missing_file(offline, tmp_path):
    cache_model(offline, MAIN, skip=("model.safetensors",))
    result = export(REPO_ID, "-o", tmp_path / "out")
    assert result.exit_code == 1
    assert f"cache {offline} holds it only in part (no model.safetensors); HF_HUB_OFFLINE is set" in result.stderr


def test_a_local_path_wins_over_a_hub_id(offline, tmp_path):
    cache_model(offline, MAIN)
    local = Path.cwd() / REPO_ID
    shutil.copytree(variant(tmp_path, 32), local)
    result = export(REPO_ID, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert exported_defaults(tmp_path / "out") == 32
    assert "Hugging Face" not in result.stderr
    refused = export(REPO_ID, "-o", tmp_path / "out2", "--revision", "main")
    assert refused.exit_code == 1
    assert (f"error: --revision main applies to a Hugging Face model id (ORG/NAME); {REPO_ID} is a local path. "
            "Drop --revision.") in refused.stderr


@pytest.mark.parametrize("spec", ["models/refusion-tiny", "a/b/c", "/abs/path", "./org/name", "org--x/name", "name"])
def test_what_counts_as_a_hub_id(spec):
    assert hub.is_repo_id(spec) == (spec == "models/refusion-tiny")


# -- online, against a fake hub ------------------------------------------------------------------

REMOTE = {
    "config.json": "{}", "generation_config.json": "{}", "tokenizer.json": "{}", "tokenizer_config.json": "{}",
    "vocab.json": "{}", "merges.txt": "", "chat_template.jinja": "", "README.md": "", ".gitattributes": "",
    "model.safetensors.index.json": json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                               "b": "model-00002-of-00002.safetensors"}}),
    "model-00001-of-00002.safetensors": "", "model-00002-of-00002.safetensors": "",
    "pytorch_model.bin": "", "pytorch_model.bin.index.json": "{}", "training_args.bin": "", "optimizer.pt": "",
    "original/consolidated.00.pth": "", "onnx/model.onnx": "", "subfolder/config.json": "{}",
}


class FakeHub:
    """snapshot_download over REMOTE-like files: writes what the patterns allow into a snapshot."""

    def __init__(self, files: dict[str, str]):
        self.files, self.calls, self.fetched, self.bars = files, [], set(), []

    def __call__(self, repo_id, *, revision, cache_dir, local_files_only, allow_patterns, tqdm_class):
        self.calls.append((repo_id, revision, Path(cache_dir), local_files_only))
        self.bars.append(tqdm_class)
        snapshot = Path(cache_dir) / "models--fake" / "snapshots" / ("3" * 40)
        for name, text in self.files.items():
            if any(fnmatch.fnmatch(name, p) for p in allow_patterns):
                (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
                (snapshot / name).write_text(text)
                self.fetched.add(name)
        return str(snapshot)


@pytest.fixture
def online(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)

    def install(files: dict[str, str]) -> FakeHub:
        fake = FakeHub(files)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
        return fake

    return install


def test_fetches_only_what_the_export_reads_never_pickles(online, tmp_path):
    fake = online(REMOTE)
    folder = hub.resolve_checkpoint(REPO_ID, "v1")
    assert fake.fetched == {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                            "vocab.json", "merges.txt", "chat_template.jinja", "model.safetensors.index.json",
                            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert all(call == (REPO_ID, "v1", tmp_path / "cache", False) for call in fake.calls)
    assert (folder / "model-00002-of-00002.safetensors").is_file()


def test_download_bars_only_where_ours_show(online):
    class Bars(list):
        ticks = True

        def __call__(self, event: str) -> None:
            self.append(event)

    fake = online(REMOTE)
    hub.resolve_checkpoint(REPO_ID)
    hub.resolve_checkpoint(REPO_ID, progress=print)  # a plain callable: no ticks, so no bars
    hub.resolve_checkpoint(REPO_ID, progress=Bars())
    assert fake.bars == [hub._NoBars] * 4 + [None] * 2  # None: huggingface_hub's own bars (rate, ETA)
    quiet = hub._NoBars(total=0, initial=0, unit="B", unit_scale=True, desc="Downloading", bar_format="{desc}")
    quiet.total = 10
    quiet.update(5)  # what huggingface_hub does with it: all silent
    quiet.close()


@pytest.mark.parametrize("index", ["[]", "{}", '{"weight_map": {}}', "not json"])
def test_a_broken_index_is_named(online, index):
    online(REMOTE | {"model.safetensors.index.json": index})
    with pytest.raises(RefusionError, match=r"safetensors\.index\.json (is not a JSON object|has no weight_map)"):
        hub.resolve_checkpoint(REPO_ID)


def test_a_single_file_checkpoint_fetches_model_safetensors(online):
    files = {k: v for k, v in REMOTE.items() if "model-0" not in k and "index" not in k} | {"model.safetensors": ""}
    fake = online(files)
    hub.resolve_checkpoint(REPO_ID)
    assert "model.safetensors" in fake.fetched and not any(n.endswith((".bin", ".pt", ".pth")) for n in fake.fetched)


def test_a_pickle_only_model_is_refused(online):
    online({k: v for k, v in REMOTE.items() if "safetensors" not in k})
    with pytest.raises(RefusionError, match=r"^refusion-org/tiny-chat has no model.safetensors: refusion-trt reads "
                                            r"safetensors weights only, never pickles; convert it once"):
        hub.resolve_checkpoint(REPO_ID)


@pytest.mark.parametrize("error, message", [
    ("RepositoryNotFoundError", "refusion-org/tiny-chat is neither a local directory nor a model on the Hugging Face "
                                "hub (a private one needs `hf auth login` or HF_TOKEN); check the spelling."),
    ("GatedRepoError", "refusion-org/tiny-chat is gated: accept its terms on https://huggingface.co/"
                       "refusion-org/tiny-chat, then log in (`hf auth login`, or set HF_TOKEN)."),
    ("RevisionNotFoundError", "refusion-org/tiny-chat has no revision 'v7'; pass a branch, tag or commit of the "
                              "model to --revision, or leave it out for main."),
    ("LocalEntryNotFoundError", "refusion-org/tiny-chat at revision v7: no local directory of that name, the Hugging "
                                "Face hub cannot be reached, and the cache"),
])
def test_hub_failures_are_refusion_errors(online, monkeypatch, error, message):
    import huggingface_hub
    from huggingface_hub import errors

    cls = getattr(errors, error)

    def failing(*args, **kwargs):
        raise cls("hub says no") if error == "LocalEntryNotFoundError" else cls("hub says no", response=MagicMock())

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
    with pytest.raises(RefusionError) as info:
        hub.resolve_checkpoint(REPO_ID, "v7")
    assert str(info.value).startswith(message)

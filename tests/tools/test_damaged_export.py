"""A damaged export is refused with one RefusionError everywhere: load, generate, check, inspect.

Each case takes a fresh copy of an export of the embedded model and damages one thing: a
file deleted, truncated, with bytes flipped, replaced by `[]`, one tensor scaled, or one
field of refusion.json edited. Changes that keep a file's size are only seen by hashing, so
`load` is asserted with `verify=True` for them (the default load checks sizes only) and the
default load may then succeed, but never with another exception type; `check` and `inspect`
always hash, so they must catch every byte change.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.generator import Generator
from refusion.tools.export_cli import cli

pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
FILES = ("refusion.json", "planner.onnx", "infiller.onnx", "weights.bin", "tokenizer.json", "tokenizer_config.json",
         "chat_template.jinja")


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    from refusion.export.exporter import export_onnx

    return export_onnx(REPO / "models" / "refusion-tiny", tmp_path_factory.mktemp("damage") / "tiny", validate=False)


# -- damage ----------------------------------------------------------------------------------
Damage = Callable[[Path], None]


def delete(name: str) -> Damage:
    return lambda d: (d / name).unlink()


def truncate(name: str) -> Damage:
    return lambda d: (d / name).write_bytes((d / name).read_bytes()[: (d / name).stat().st_size // 2])


def empty_list(name: str) -> Damage:
    return lambda d: (d / name).write_text("[]")


def flip(name: str) -> Damage:
    """Invert 8 bytes in the middle of the file: same size, other content."""
    def apply(d: Path) -> None:
        data = bytearray((d / name).read_bytes())
        middle = len(data) // 2
        data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
        (d / name).write_bytes(bytes(data))
    return apply


def scale_tensor(d: Path) -> None:
    """One weight tensor times -3, in place in weights.bin (what `check` used to pass)."""
    entry = ExportManifest.load(d).weights["model.layers.1.mlp.down_proj.weight"]
    with (d / "weights.bin").open("r+b") as f:
        f.seek(entry.offset)
        values = np.frombuffer(f.read(entry.nbytes), dtype=np.float32) * -3
        f.seek(entry.offset)
        f.write(values.tobytes())


def edit(path: tuple[str | int, ...], value: Any) -> Damage:
    """Set (or with value REMOVE, delete) one field of refusion.json, keeping valid JSON."""
    def apply(d: Path) -> None:
        raw = json.loads((d / "refusion.json").read_text())
        node = raw
        for key in path[:-1]:
            node = node[key]
        if value is REMOVE:
            del node[path[-1]]
        else:
            node[path[-1]] = value(node[path[-1]]) if callable(value) else value
        (d / "refusion.json").write_text(json.dumps(raw))
    return apply


REMOVE = object()


def _changed(value: Any) -> Any:
    """Another value of the same JSON type."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, list):
        return value[:-1] if value else [0]
    return {}


def _leaves(node: Any, path: tuple[str | int, ...] = ()) -> Iterator[tuple[str | int, ...]]:
    """Every leaf of refusion.json; of the long repeated parts (tensors, contract entries), the first."""
    if isinstance(node, dict) and node:
        keys = list(node)
        if path in (("weights", "tensors"),):
            keys = keys[:1]
        for key in keys:
            yield from _leaves(node[key], (*path, key))
    elif isinstance(node, list) and node and isinstance(node[0], (dict, list)):
        yield from _leaves(node[0], (*path, 0))
    else:
        yield path


def cases(export: Path) -> dict[str, tuple[Damage, bool]]:
    """name -> (damage, whether only a hash can see it)."""
    found: dict[str, tuple[Damage, bool]] = {}
    for name in FILES:
        found[f"delete {name}"] = (delete(name), False)
        found[f"truncate {name}"] = (truncate(name), False)
        found[f"[] in {name}"] = (empty_list(name), False)
        found[f"flip bytes in {name}"] = (flip(name), name != "refusion.json")
    found["scale one tensor"] = (scale_tensor, True)
    raw = json.loads((export / "refusion.json").read_text())
    for path in _leaves(raw):
        if path[0] != "source":  # informative only: where the checkpoint was, how long the export took
            found["edit " + ".".join(map(str, path))] = (edit(path, _changed), False)
    for section in ("model", "tokens", "defaults", "graphs", "weights", "tokenizer", "files", "digests"):
        found[f"remove {section}"] = (edit((section,), REMOVE), False)
    # The edits the issue names, each of which used to pass a check or run with wrong limits.
    for path, value in ((("model", "kv_heads"), REMOVE), (("tokens",), REMOVE), (("model", "head_dim"), 64),
                        (("model", "num_layers"), 2), (("tokens", "mask_token_id"), 9999),
                        (("model", "vocab_size"), 50), (("model", "max_position_embeddings"), 100000),
                        (("model", "hidden_size"), "abc"), (("model", "hidden_size"), None)):
        found[f"set {'.'.join(map(str, path))} = {value if value is not REMOVE else 'missing'}"] = (edit(path, value), False)
    return found


# -- the assertions ---------------------------------------------------------------------------
def _generate(d: Path, verify: bool) -> None:
    with Generator.from_dir(d, backend="ort-cpu", threads=1, verify=verify) as gen:
        gen.generate(prompt_ids=[5, 6, 7], gen_length=8, slot_size=4, serial_num_blocks=1)


def _cli_refuses(command: str, d: Path) -> str:
    result = CliRunner().invoke(cli, [command, str(d)])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (command, result.output, result.exception)
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    return errors[0]


def test_every_damage_is_one_refusion_error(export, tmp_path):
    failures = []
    for name, (damage, hash_only) in sorted(cases(export).items()):
        d = Path(shutil.copytree(export, tmp_path / name.replace(" ", "_").replace("/", "_")))
        damage(d)
        try:
            if hash_only:
                try:
                    _generate(d, verify=False)  # may run (sizes match), but never raise anything else
                except RefusionError:
                    pass
            with pytest.raises(RefusionError):
                _generate(d, verify=True)
            _cli_refuses("check", d)
            _cli_refuses("inspect", d)
        except (AssertionError, pytest.fail.Exception) as e:
            failures.append(f"{name}: {e}")
        shutil.rmtree(d)
    assert not failures, "\n".join(failures)


def test_messages_name_the_file_the_field_and_the_fix(export, tmp_path):
    d = Path(shutil.copytree(export, tmp_path / "x"))
    edit(("model", "kv_heads"), "two")(d)
    with pytest.raises(RefusionError, match=r"refusion.json: field model.kv_heads is 'two' \(str\), expected an "
                                             r"integer >= 1; re-export with `refusion-export onnx"):
        ExportManifest.load(d)
    shutil.copyfile(export / "refusion.json", d / "refusion.json")
    truncate("weights.bin")(d)
    recorded = (export / "weights.bin").stat().st_size
    with pytest.raises(RefusionError, match=rf"weights.bin has \d+ bytes, {recorded} recorded \(truncated or replaced\)"
                                             r"; the export is damaged: re-export"):
        ExportManifest.load(d)
    shutil.copyfile(export / "weights.bin", d / "weights.bin")
    scale_tensor(d)
    _cli_refuses("check", d)
    assert "weights.bin has sha256" in CliRunner().invoke(cli, ["check", str(d)]).stdout


def test_an_older_format_is_refused_with_how_to_re_export(export, tmp_path):
    """v5 exports have no embeddings section; an engines directory's copy says to rebuild after (v6 ones still run,
    without structured output)."""
    d = Path(shutil.copytree(export, tmp_path / "v5"))
    edit(("format_version",), 5)(d)
    with pytest.raises(RefusionError, match=r"refusion.json: format 'refusion-onnx' v5 is not 'refusion-onnx' v7 \(or v6\), "
                                             r"the one this version of refusion-trt reads \(CHANGELOG.md says what "
                                             r"changed\); re-export with `refusion-export onnx CHECKPOINT"):
        Generator.from_dir(d, backend="ort-cpu")
    (d / "engines.json").write_text("{}")
    with pytest.raises(RefusionError, match="--force`, then rebuild the engines from it with `refusion-export build`"):
        ExportManifest.read(d)


def test_a_clean_export_passes_all_four(export):
    _generate(export, verify=True)
    assert CliRunner().invoke(cli, ["inspect", str(export)]).exit_code == 0

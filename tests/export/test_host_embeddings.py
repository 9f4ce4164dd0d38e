"""`refusion-export onnx --embeddings host`: the table beside the graphs, validated, refused where it cannot be,
and every damage to it one RefusionError."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.generator import Generator
from refusion.tools.export_cli import cli
from tests.helpers import assert_nothing_published


@pytest.fixture(scope="module")
def host(store):
    return store.export("gqa2", "fp32", embeddings="host")


def test_validation_passes_on_the_fed_rows(host):
    """The comparator's cases feed the table's rows, and torch embeds the ids from the same file."""
    assert host.report.ok, host.report.text()
    assert {row[0] for row in host.report.rows} == {"planner", "infiller"}


def test_no_graph_gathers_the_table(host):
    for name in ("planner", "infiller"):
        graph = onnx.load(str(host.path / f"{name}.onnx"), load_external_data=False).graph
        assert "model.embed_tokens.weight" not in {i.name for i in graph.initializer}
        assert not [n for n in graph.node if "model.embed_tokens.weight" in n.input]
        assert [n for n in graph.node if "inputs_embeds" in n.input], "inputs_embeds feeds the first layer"


def test_a_tied_head_is_refused_before_anything_is_written(store, tmp_path):
    from refusion.export.exporter import export_onnx

    out = tmp_path / "tied"
    with pytest.raises(RefusionError, match=r"--embeddings host: this checkpoint ties its lm_head to the embedding "
                                             r"\(tie_word_embeddings\).*export it with --embeddings graph"):
        export_onnx(store.checkpoint("tied"), out, embeddings="host")
    assert not out.exists()
    assert_nothing_published(out)


def test_cli_option_and_inspect(host, store, tmp_path):
    out = tmp_path / "cli"
    result = CliRunner().invoke(cli, ["onnx", str(store.checkpoint("gqa2")), "--output", str(out), "--embeddings",
                                      "host", "--no-validate"])
    assert result.exit_code == 0, result.output
    assert "embeddings on the host" in result.stderr
    shown = CliRunner().invoke(cli, ["inspect", str(out)])
    assert shown.exit_code == 0, shown.output
    m = ExportManifest.load(out)
    assert f"embeds   host: embeddings.bin float32 [{m.vocab_size}, {m.dims.hidden_size}] (fed as inputs_embeds)" \
        in shown.stdout
    assert "embeddings.bin" in shown.stdout and "inputs_embeds" in shown.stdout
    result = CliRunner().invoke(cli, ["onnx", str(store.checkpoint("gqa2")), "--output", str(tmp_path / "x"),
                                      "--embeddings", "device"])
    assert result.exit_code == 2 and "'device' is not one of 'graph', 'host'" in result.output


def _damages() -> dict[str, Callable[[Path], None]]:
    def edit(key: str, value: object) -> Callable[[Path], None]:
        def apply(d: Path) -> None:
            raw = json.loads((d / "refusion.json").read_text())
            raw["embeddings"][key] = value
            (d / "refusion.json").write_text(json.dumps(raw))
        return apply

    def truncate(d: Path) -> None:
        with open(d / "embeddings.bin", "r+b") as f:
            f.truncate(100)

    def flip(d: Path) -> None:
        with open(d / "embeddings.bin", "r+b") as f:
            f.seek(64)
            byte = f.read(1)
            f.seek(64)
            f.write(bytes([byte[0] ^ 0xFF]))

    return {"delete": lambda d: (d / "embeddings.bin").unlink(), "truncate": truncate, "flip a byte": flip,
            "graph placement": edit("placement", "graph"), "dtype": edit("dtype", "float16"),
            "shape": edit("shape", [10, 64]), "file": edit("file", "weights.bin")}


@pytest.mark.parametrize("damage", list(_damages()))
def test_every_damage_to_the_table_is_one_refusion_error(host, tmp_path, damage):
    d = Path(shutil.copytree(host.path, tmp_path / "d"))
    _damages()[damage](d)
    with pytest.raises(RefusionError), Generator.from_dir(d, backend="ort-cpu", threads=1, verify=True) as gen:
        gen.generate(prompt_ids=[5, 6, 7], gen_length=8, slot_size=4, serial_num_blocks=1)
    result = CliRunner().invoke(cli, ["check", str(d)])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output

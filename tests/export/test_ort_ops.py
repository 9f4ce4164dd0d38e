"""`refusion-export onnx --ops onnxruntime`: graphs of the same contract written with fused ops, validated against
the torch definition on every checkpoint shape and precision, recorded in refusion.json, refused by TensorRT's
build with the command that makes a standard export."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.tools.export_cli import cli
from tests.helpers import edited_export


def _ops(path: Path, graph: str = "infiller") -> Counter:
    return Counter(n.op_type for n in onnx.load(str(path / f"{graph}.onnx"), load_external_data=False).graph.node)


@pytest.mark.parametrize("name, dtype", [("gqa1", "fp32"), ("gqa4", "fp32"), ("head_dim", "fp32"), ("tied", "fp32"),
                                         ("gqa2", "fp16")])
def test_validates_against_the_torch_definition(store, name, dtype):
    """Plain multi-head and grouped attention, head_dim unlike hidden / heads, a tied head, fp16."""
    fused = store.export(name, dtype, ops="onnxruntime")
    assert fused.report.ok, fused.report.text()
    assert ExportManifest.load(fused.path).ops == "onnxruntime"


def test_int4_and_a_host_table_validate(store, tmp_path):
    from refusion.export.exporter import export_onnx
    from refusion.export.quantize import QuantizeOptions
    from refusion.export.validate import validate_export

    for dtype in ("fp32", "fp16"):
        out = export_onnx(store.checkpoint("gqa2"), tmp_path / dtype, dtype=dtype, ops="onnxruntime",
                          quantize=QuantizeOptions("int4-rtn", 32, head=True), embeddings="host")
        report = validate_export(out)
        assert report.ok, report.text()
        assert _ops(out)["DequantizeLinear"] == 2 * 7 + 1  # two layers' linears and the head


def test_half_the_nodes_of_the_standard_graphs(store):
    """One Attention a layer where the standard graph spells it out (MatMul, Softmax, Transpose...), RoPE and
    norms as single nodes, the residual adds inside the norms."""
    standard, fused = store.export("gqa2").path, store.export("gqa2", ops="onnxruntime").path
    layers = ExportManifest.load(fused).num_layers
    for graph in ("planner", "infiller"):
        ops, before = _ops(fused, graph), _ops(standard, graph)
        assert sum(ops.values()) < 0.6 * sum(before.values()), (ops, before)
        assert ops["Attention"] == layers and ops["RotaryEmbedding"] == 2 * layers
        assert ops["SkipSimplifiedLayerNormalization"] == 2 * layers - 1
        assert not ops["Softmax"] and not ops["Transpose"]
    model = onnx.load(str(fused / "infiller.onnx"), load_external_data=False)
    assert {(o.domain, o.version) for o in model.opset_import} == {("", 23), ("com.microsoft", 1)}


def test_an_export_before_the_field_reads_as_standard(store, tmp_path):
    edited = edited_export(store.export("gqa2").path, tmp_path, lambda r: [g.pop("ops") for g in r["graphs"].values()])
    assert ExportManifest.load(edited).ops == "standard"


@pytest.mark.parametrize("change, match", [
    (lambda r: [g.update(opset=17) for g in r["graphs"].values()],
     r"graphs.planner.opset is 17.*23 for --ops onnxruntime"),
    (lambda r: r["graphs"]["infiller"].update(ops="standard"), r"graphs.infiller.ops is 'standard'.*onnxruntime, as"),
    (lambda r: [g.update(ops="tensorrt") for g in r["graphs"].values()],
     r"graphs.planner.ops is 'tensorrt'.*one of standard, onnxruntime"),
])
def test_inconsistent_records_are_refused(store, tmp_path, change, match):
    edited = edited_export(store.export("gqa2", ops="onnxruntime").path, tmp_path, change)
    with pytest.raises(RefusionError, match=match):
        ExportManifest.load(edited)


def test_tensorrt_build_refuses_it_with_the_command_that_works(store, tmp_path):
    from refusion.engines.build import plan_build
    from refusion.runtime.core.profiles import DecodeLimits

    fused = store.export("gqa2", ops="onnxruntime").path
    with pytest.raises(RefusionError, match=r"exported with --ops onnxruntime.*re-export with `refusion-export onnx "
                                            r"CHECKPOINT --output DIR` \(--ops standard, the default\)"):
        plan_build(fused, tmp_path / "engines", DecodeLimits(max_prompt=16, gen_length=16, slot_size=4,
                                                             serial_blocks=1))


def test_cli_option_inspect_and_bad_value(store, tmp_path):
    out = tmp_path / "cli"
    result = CliRunner().invoke(cli, ["onnx", str(store.checkpoint("gqa2")), "--output", str(out), "--ops",
                                      "onnxruntime", "--no-validate"])
    assert result.exit_code == 0, result.output
    assert "onnxruntime ops" in result.stderr
    shown = CliRunner().invoke(cli, ["inspect", str(out)])
    assert "ops      onnxruntime (opset 23)" in shown.output, shown.output
    bad = CliRunner().invoke(cli, ["onnx", str(store.checkpoint("gqa2")), "--output", str(tmp_path / "x"), "--ops",
                                   "fused"])
    assert bad.exit_code == 2 and "'fused' is not one of 'standard', 'onnxruntime'" in bad.output
    from refusion.export.exporter import export_onnx

    with pytest.raises(RefusionError, match=r"ops='fused' \(--ops\) must be one of standard, onnxruntime"):
        export_onnx(store.checkpoint("gqa2"), tmp_path / "y", ops="fused")

"""The int4 lm_head (`--quantize-head`): the head as the layers' blocked DequantizeLinear -> MatMul, recorded in
refusion.json's quantization section (absent in older v6 exports: a float head), its logits against an
independent dequantization, AWQ's scaling folded into the final norm, and a tied head refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

from refusion.export.compare import cases
from refusion.export.exporter import export_onnx
from refusion.export.model import Qwen3
from refusion.export.quantize import QuantizeOptions
from refusion.export.validate import validate_export
from refusion.export.weights_file import map_weights
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.core.quantization import scale_name
from refusion.tools.export_cli import cli
from tests.export.test_quantized_exports import _refused
from tests.helpers import edited_export

HEAD = "lm_head.weight"


@pytest.fixture(scope="module")
def head_exports(store, tmp_path_factory) -> dict[str, Path]:
    """gqa2 (hidden 64, vocabulary 384) as int4-rtn block 32 with a float and an int4 head, with logits."""
    root = tmp_path_factory.mktemp("int4-head")
    return {name: export_onnx(store.checkpoint("gqa2"), root / name, logits=True,
                              quantize=QuantizeOptions("int4-rtn", 32, head=head))
            for name, head in (("float-head", False), ("int4-head", True))}


@pytest.mark.parametrize("graph", ["planner", "infiller"])
def test_the_head_is_a_blocked_dequantize_into_the_logits_matmul(head_exports, graph):
    model = onnx.load(str(head_exports["int4-head"] / f"{graph}.onnx"), load_external_data=False)
    inits = {i.name: i for i in model.graph.initializer}
    assert inits[HEAD].data_type == onnx.TensorProto.INT4 and list(inits[HEAD].dims) == [64, 384]
    assert list(inits[scale_name(HEAD)].dims) == [2, 384]
    (dq,) = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == HEAD]
    assert {a.name: onnx.helper.get_attribute_value(a) for a in dq.attribute} == {"axis": 0, "block_size": 32}
    (user,) = [n for n in model.graph.node if dq.output[0] in n.input]
    assert user.op_type == "MatMul" and user.input[1] == dq.output[0]
    assert inits["model.embed_tokens.weight"].data_type == onnx.TensorProto.FLOAT  # the Gather's table stays float
    float_head = onnx.load(str(head_exports["float-head"] / f"{graph}.onnx"), load_external_data=False)
    assert sum(n.op_type == "DequantizeLinear" for n in model.graph.node) == \
        sum(n.op_type == "DequantizeLinear" for n in float_head.graph.node) + 1
    onnx.checker.check_model(str(head_exports["int4-head"] / f"{graph}.onnx"), full_check=True)


def test_refusion_json_records_the_head(head_exports):
    raw = json.loads((head_exports["int4-head"] / "refusion.json").read_text())
    assert raw["quantization"] == {"method": "int4-rtn", "bits": 4, "block_size": 32, "head": True,
                                   "calibration": None}
    tensors = raw["weights"]["tensors"]
    assert (tensors[HEAD]["dtype"], tensors[HEAD]["shape"], tensors[HEAD]["nbytes"]) == ("int4", [64, 384], 64 * 384 // 2)
    assert (tensors[scale_name(HEAD)]["dtype"], tensors[scale_name(HEAD)]["shape"]) == ("float32", [2, 384])
    manifest = ExportManifest.load(head_exports["int4-head"])
    assert manifest.quantization.head and manifest.precision == "float32, int4-rtn block 32, int4 lm_head"
    float_head = ExportManifest.load(head_exports["float-head"])
    assert not float_head.quantization.head and float_head.weights[HEAD].dtype == "float32"
    assert (head_exports["int4-head"] / "weights.bin").stat().st_size < (head_exports["float-head"] / "weights.bin").stat().st_size


def test_an_export_without_the_field_has_a_float_head(head_exports, tmp_path):
    """Exports made before --quantize-head (same format version) have no `head` field: their head is float."""
    d = edited_export(head_exports["float-head"], tmp_path, lambda r: r["quantization"].pop("head"))
    assert ExportManifest.load(d).quantization.head is False
    d = edited_export(head_exports["float-head"], tmp_path / "b", lambda r: r["quantization"].update(head=True))
    with pytest.raises(RefusionError, match=r"weights.tensors lacks 'lm_head.weight_scale' .*int4 lm_head\)"):
        ExportManifest.load(d)
    d = edited_export(head_exports["int4-head"], tmp_path / "c", lambda r: r["quantization"].update(head="yes"))
    with pytest.raises(RefusionError, match=r"quantization.head is 'yes'"):
        ExportManifest.load(d)


def _onnx_dequantized(export: Path) -> dict[str, torch.Tensor]:
    """Every weight in the HF layout, int4 ones dequantized from onnx's own decoding of the initializers (not
    ours): q x the block's scale, repeated over the block's rows."""
    model = onnx.load(str(export / "infiller.onnx"))  # with external data
    arrays = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    out = {}
    for name, a in arrays.items():
        if name.endswith("_scale") or not name.startswith(("model.", "lm_head")):
            continue
        if scale_name(name) in arrays:
            scale = arrays[scale_name(name)]
            a = a.astype(np.float32) * np.repeat(scale, a.shape[0] // scale.shape[0], axis=0)
        out[name] = torch.from_numpy(np.array(a.T if name.endswith(".weight") and a.ndim == 2
                                                          and name != "model.embed_tokens.weight" else a))
    return out


def test_onnxruntime_logits_equal_an_independent_dequantized_reference(head_exports):
    import onnxruntime as ort

    export = head_exports["int4-head"]
    manifest = ExportManifest.load(export)
    reference = Qwen3.from_tensors(manifest.dims, _onnx_dequantized(export).items())
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")  # fp32 on the dequantized weights
    session = ort.InferenceSession(str(export / "infiller.onnx"), opts, providers=["CPUExecutionProvider"])
    float_head = ort.InferenceSession(str(head_exports["float-head"] / "infiller.onnx"), opts,
                                      providers=["CPUExecutionProvider"])
    checked = 0
    for case in cases(manifest):
        if "infiller" not in case.graphs:
            continue
        feed = case.feed
        (logits,) = session.run(["logits"], feed)
        past = [(torch.from_numpy(feed[f"past_key_values.{i}.key"]), torch.from_numpy(feed[f"past_key_values.{i}.value"]))
                for i in range(manifest.dims.num_layers)]
        want = reference(torch.from_numpy(feed["input_ids"]), torch.from_numpy(feed["position_ids"]),
                         torch.from_numpy(feed["attention_mask"]), past, torch.from_numpy(feed["head_positions"]),
                         torch.from_numpy(feed["vocab_mask"]))["logits"].numpy()  # -inf where the mask says
        np.testing.assert_allclose(logits, want, atol=1e-4, rtol=1e-4)
        (with_float_head,) = float_head.run(["logits"], feed)
        kept = np.isfinite(logits)  # the mask's -inf on both sides is no difference
        assert np.abs(logits[kept] - with_float_head[kept]).max() > 1e-3  # the head really is int4
        checked += 1
    assert checked


def test_awq_clips_the_head_and_leaves_the_final_norm(store, head_exports, tmp_path):
    """int4-awq --quantize-head clips the head's blocks (AWQ's scale is not applied to it: docs/quantization.md)."""
    lines: list[str] = []
    awq = export_onnx(store.checkpoint("gqa2"), tmp_path / "awq", progress=lines.append,
                      quantize=QuantizeOptions("int4-awq", 32, head=True))
    assert "awq: lm_head clipped" in lines
    report = validate_export(awq)
    assert report.ok, report.text()
    rtn, clipped = map_weights(ExportManifest.load(head_exports["int4-head"])), map_weights(ExportManifest.load(awq))
    assert np.array_equal(rtn["model.norm.weight"], clipped["model.norm.weight"])
    # a clipped block's absmax is below the weight's, so its scale is smaller
    assert (clipped[scale_name(HEAD)] <= rtn[scale_name(HEAD)] * (1 + 1e-6)).all()
    assert (clipped[scale_name(HEAD)] < rtn[scale_name(HEAD)]).any()


def test_a_tied_head_is_refused_with_the_reason(store, tmp_path):
    _refused(store.checkpoint("tied"), tmp_path / "out", r"--quantize-head: the model ties lm_head to the embedding "
             r"\(tie_word_embeddings=true\).*Drop --quantize-head", quantize=QuantizeOptions("int4-rtn", 32, head=True))


def test_cli_quantize_head(store, head_exports, tmp_path):
    result = CliRunner().invoke(cli, ["onnx", str(store.checkpoint("gqa2")), "-o", str(tmp_path / "x"),
                                      "--quantize-head"])
    assert result.exit_code == 1 and "--quantize-head" in result.stderr and "need --quantize" in result.stderr
    assert not (tmp_path / "x").exists()
    result = CliRunner().invoke(cli, ["onnx", str(store.checkpoint("gqa2")), "-o", str(tmp_path / "y"), "--no-validate",
                                      "--quantize", "int4-rtn", "--block-size", "32", "--quantize-head"])
    assert result.exit_code == 0, result.output
    assert "(fp32, int4-rtn block 32, int4 lm_head)" in result.stderr
    assert ExportManifest.load(tmp_path / "y").quantization.head
    for name, shown in (("int4-head", "lm_head=int4"), ("float-head", "lm_head=float")):
        result = CliRunner().invoke(cli, ["inspect", str(head_exports[name])])
        assert shown in next(line for line in result.stdout.splitlines() if line.startswith("weights "))

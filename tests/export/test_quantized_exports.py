"""int4 exports end to end: the graphs' DequantizeLinear -> MatMul pattern, the packed weights,
onnxruntime's MatMulNBits fusion, validation, refusion.json's quantization section and its strict
reading, the CLI, generation, and every bad request refused before anything is published."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from refusion.export.calibration import TASK_EXAMPLES
from refusion.export.compare import cases
from refusion.export.exporter import export_onnx
from refusion.export.int4 import unpack_int4
from refusion.export.quantize import QuantizeOptions
from refusion.export.validate import validate_export
from refusion.export.weights_file import map_weights
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.core.quantization import scale_name
from refusion.runtime.generator import Generator
from refusion.tools.export_cli import cli
from tests.helpers import assert_nothing_published, edited_export

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "models" / "refusion-tiny"
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def rtn(store, tmp_path_factory) -> Path:
    """gqa2 (hidden 64, intermediate 96: block 32 divides both) as int4-rtn."""
    out = tmp_path_factory.mktemp("int4") / "rtn"
    return export_onnx(store.checkpoint("gqa2"), out, quantize=QuantizeOptions("int4-rtn", 32))


@pytest.fixture(scope="module")
def awq_export(store, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("int4")
    prompts = root / "prompts.txt"
    prompts.write_text("hello world\n\nthe cat sat on the mat\nadd: 12+34\nsort: 3 1 2\nunused fifth line\n")
    return export_onnx(store.checkpoint("gqa2"), root / "awq",
                       quantize=QuantizeOptions("int4-awq", 32, prompts, calibration_samples=4))


@pytest.fixture(scope="module")
def tiny_int4(tmp_path_factory) -> tuple[Path, Path]:
    """The embedded model as fp32 and as int4-rtn block 64, through the CLI."""
    root = tmp_path_factory.mktemp("tiny")
    for name, extra in (("fp32", ()), ("int4", ("--quantize", "int4-rtn", "--block-size", "64"))):
        result = CliRunner().invoke(cli, ["onnx", str(TINY), "--output", str(root / name), *extra])
        assert result.exit_code == 0, result.output
    return root / "fp32", root / "int4"


# -- the graphs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("graph", ["planner", "infiller"])
def test_linears_are_blocked_dequantize_into_matmul(rtn, graph):
    model = onnx.load(str(rtn / f"{graph}.onnx"), load_external_data=False)
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 21)] and model.ir_version == 10
    inits = {i.name: i for i in model.graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    dqs = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dqs) == 2 * len(LINEARS)
    for node in dqs:
        weight, scale = node.input  # no zero point: symmetric
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs == {"axis": 0, "block_size": 32}
        assert inits[weight].data_type == onnx.TensorProto.INT4
        assert inits[weight].data_location == onnx.TensorProto.EXTERNAL
        assert scale == scale_name(weight) and inits[scale].data_type == onnx.TensorProto.FLOAT
        assert list(inits[scale].dims) == [inits[weight].dims[0] // 32, inits[weight].dims[1]]
        (user,) = consumers[node.output[0]]
        assert user.op_type == "MatMul" and user.input[1] == node.output[0]  # straight in: no Transpose
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert inits[name].data_type == onnx.TensorProto.FLOAT
    onnx.checker.check_model(str(rtn / f"{graph}.onnx"), full_check=True)


def test_onnx_reads_the_int4_external_data_we_wrote(rtn):
    """onnx's own external-data loader unpacks weights.bin's nibbles to the values our index says."""
    model = onnx.load(str(rtn / "infiller.onnx"))  # with external data
    weights = map_weights(ExportManifest.load(rtn))
    name = "model.layers.1.mlp.down_proj.weight"
    init = next(i for i in model.graph.initializer if i.name == name)
    values = onnx.numpy_helper.to_array(init).astype(np.int8)
    assert values.shape == (96, 64)
    np.testing.assert_array_equal(values, unpack_int4(weights[name], (96, 64)))
    assert values.min() >= -7 and values.max() <= 7 and values.std() > 1  # rounded weights, not zeros


def test_onnxruntime_fuses_every_linear_into_matmulnbits(rtn, tmp_path):
    import onnxruntime as ort

    from refusion.export.compare import OrtSessions
    from refusion.runtime.runners.ort_session import open_session

    def level(session) -> str:
        return session.get_session_options().get_session_config_entry("session.qdq_matmulnbits_accuracy_level")

    manifest = ExportManifest.load(rtn)
    assert level(open_session(manifest, "infiller", ["CPUExecutionProvider"])) == "4"  # what runners use
    comparator = OrtSessions(manifest)
    comparator("planner", cases(manifest)[0].feed)
    assert level(comparator._session) == "1"  # validation: fp32 on the dequantized weights, as torch computes
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    opts.log_severity_level = 3
    ort.InferenceSession(str(rtn / "infiller.onnx"), opts, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx"), load_external_data=False).graph.node]
    assert ops.count("MatMulNBits") == 2 * len(LINEARS) and "DequantizeLinear" not in ops
    assert "SimplifiedLayerNormalization" in ops  # the RMSNorm fusion survives opset 21's ReduceMean


def test_float_exports_keep_opset_17(store):
    model = onnx.load(str(store.export("gqa2").path / "planner.onnx"), load_external_data=False)
    assert model.opset_import[0].version == 17 and model.ir_version == 8
    assert "DequantizeLinear" not in {n.op_type for n in model.graph.node}
    assert ExportManifest.load(store.export("gqa2").path).quantization is None


# -- validation and the manifest -----------------------------------------------------------------
def test_rtn_export_validates_against_dequantized_torch(rtn):
    report = validate_export(rtn)
    assert report.ok and not report.skipped, report.text()
    assert "float32, int4-rtn block 32" in report.text() and "tolerance abs 1e-04" in report.text()


def test_torch_reads_the_scales_the_graphs_read(rtn, tmp_path):
    """Validation runs torch on the export's own int4 bytes and scales (zeroing one linear's scales changes
    both sides alike); what catches a changed file is its sha256 record."""
    d = Path(shutil.copytree(rtn, tmp_path / "x"))
    entry = ExportManifest.load(d).weights[scale_name("model.layers.0.mlp.up_proj.weight")]
    with (d / "weights.bin").open("r+b") as f:
        f.seek(entry.offset)
        zeros = np.frombuffer(f.read(entry.nbytes), np.float32) * 0
        f.seek(entry.offset)
        f.write(zeros.tobytes())
    assert validate_export(d).ok
    assert "weights.bin has sha256" in ExportManifest.load(d).file_problems(verify=True)[0]


def test_manifest_records_the_quantization(rtn, awq_export):
    raw = json.loads((rtn / "refusion.json").read_text())
    assert raw["quantization"] == {"method": "int4-rtn", "bits": 4, "block_size": 32, "head": False, "calibration": None}
    assert raw["graphs"]["planner"]["opset"] == 21
    tensors = raw["weights"]["tensors"]
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q["dtype"] == "int4" and q["shape"] == [64, 64] and q["nbytes"] == 64 * 64 // 2
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale"] == {
        **tensors["model.layers.0.self_attn.q_proj.weight_scale"], "dtype": "float32", "shape": [2, 64], "nbytes": 512}
    assert tensors["lm_head.weight"]["dtype"] == "float32"
    awq = json.loads((awq_export / "refusion.json").read_text())["quantization"]
    assert awq["method"] == "int4-awq" and awq["calibration"]["samples"] == 4
    assert len(awq["calibration"]["sha256"]) == 64


Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("change, match", [
    (lambda r: r["quantization"].update(method="int3"), r"field quantization.method is 'int3'"),
    (lambda r: r["quantization"].update(bits=8), r"field quantization.bits is 8"),
    (lambda r: r["quantization"].update(block_size=16),
     r'weights.tensors\["model.layers.0.self_attn.q_proj.weight_scale"\].shape is \[2, 64\].*\[4, 64\]'),
    (lambda r: r["quantization"].update(block_size=48), r"block_size is 48.*not a power of two"),
    (lambda r: r["quantization"].update(block_size=128), r"block size 128 does not divide hidden_size 64"),
    (lambda r: r["quantization"].update(calibration={"samples": 1, "sha256": "0" * 64}),
     r"quantization.calibration is .* expected null for int4-rtn"),
    (lambda r: r.update(quantization=None), r"field weights.tensors has unexpected 'model.layers.0.mlp.down_proj."
                                            r"weight_scale' for a 2-layer model \(tie_word_embeddings=False\)"),
    (lambda r: r.update(dtype="bfloat16"), r"field dtype is 'bfloat16'.*one of float32, float16 for an int4 export"),
    (lambda r: [g.update(opset=17) for g in r["graphs"].values()], r"graphs.planner.opset is 17.*21 for an int4"),
    (lambda r: r["weights"]["tensors"][Q].update(dtype="float32"), r"q_proj.weight\"\].dtype is 'float32'.*int4"),
    (lambda r: r["weights"]["tensors"][Q].update(nbytes=64 * 64), r"q_proj.weight\"\].nbytes is 4096.*2048"),
    (lambda r: r["weights"]["tensors"].pop(Q + "_scale"), r"lacks 'model.layers.0.self_attn.q_proj.weight_scale'.*"
                                                          r"int4-rtn block 32"),
    (lambda r: r["weights"]["tensors"][Q + "_scale"].update(shape=[64, 2]), r"_scale\"\].shape is \[64, 2\]"),
], ids=["method", "bits", "block vs scales", "block not power of two", "block not dividing", "calibration for rtn",
        "section removed", "bf16", "opset", "weight dtype", "weight bytes", "scale missing", "scale shape"])
def test_strict_reader_refuses_inconsistent_quantization(rtn, tmp_path, change, match):
    d = edited_export(rtn, tmp_path, change)
    with pytest.raises(RefusionError, match=match):
        ExportManifest.load(d)


def test_strict_reader_checks_the_calibration_record(awq_export, tmp_path):
    d = edited_export(awq_export, tmp_path, lambda r: r["quantization"]["calibration"].update(sha256="xyz"))
    with pytest.raises(RefusionError, match=r"quantization.calibration.sha256 is 'xyz'.*64 lowercase hex"):
        ExportManifest.load(d)


# -- AWQ --------------------------------------------------------------------------------------------
def test_awq_export_validates_and_differs_from_rtn(rtn, awq_export):
    report = validate_export(awq_export)
    assert report.ok, report.text()
    a, b = map_weights(ExportManifest.load(rtn)), map_weights(ExportManifest.load(awq_export))
    norm = "model.layers.0.input_layernorm.weight"
    assert not np.array_equal(a[norm], b[norm])  # 1/s folded into the norm weights
    assert np.array_equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])


def test_calibration_sha_is_of_the_token_ids_fed(store, awq_export):
    from refusion.export.calibration import calibration_set
    from refusion.export.checkpoint import Checkpoint

    ids, sha = calibration_set(Checkpoint.open(store.checkpoint("gqa2")), awq_export.parent / "prompts.txt", 4,
                               lambda _: None)
    assert len(ids) == 4 and sha == hashlib.sha256(json.dumps(ids).encode()).hexdigest()
    assert json.loads((awq_export / "refusion.json").read_text())["quantization"]["calibration"]["sha256"] == sha
    _, other = calibration_set(Checkpoint.open(store.checkpoint("gqa2")), awq_export.parent / "prompts.txt", 3,
                               lambda _: None)
    assert other != sha


def test_builtin_calibration_set_is_the_end_of_the_reserved_held_out_stream():
    from refusion.tools import tasks

    stream = tasks.held_out(tasks.HELD_OUT_RESERVED)
    assert [(e.prompt, e.answer) for e in stream[-len(TASK_EXAMPLES):]] == list(TASK_EXAMPLES)
    assert not {p for p, _ in TASK_EXAMPLES} & {e.prompt for e in tasks.held_out(200)}


# -- the embedded model through the CLI ------------------------------------------------------------
def test_embedded_model_int4_is_small_checks_and_generates(tiny_int4):
    fp32, int4 = tiny_int4
    assert (int4 / "weights.bin").stat().st_size <= 0.4 * (fp32 / "weights.bin").stat().st_size
    result = CliRunner().invoke(cli, ["check", str(int4)])
    assert result.exit_code == 0, result.output
    assert "float32, int4-rtn block 64" in result.stdout and "result: PASS" in result.stdout
    with Generator.from_dir(int4, backend="ort-cpu", threads=1) as gen:
        text = gen.generate("reverse: abcdefgh", chat=True).text
    with Generator.from_dir(fp32, backend="ort-cpu", threads=1) as gen:
        assert gen.generate("reverse: abcdefgh", chat=True).text == text == "hgfedcba"


def test_cli_progress_names_the_method_and_warns_on_untested_blocks(store, tmp_path):
    result = CliRunner().invoke(cli, ["onnx", str(store.checkpoint("gqa2")), "-o", str(tmp_path / "x"), "--no-validate",
                                      "--quantize", "int4-rtn", "--block-size", "32"])
    assert result.exit_code == 0, result.output
    assert "(fp32, int4-rtn block 32)" in result.stderr
    assert "note: --block-size 32: TensorRT documents INT4 blocks of 64 and 128 only" in result.stderr


def test_inspect_shows_the_quantization_section(rtn, awq_export):
    for export, method in ((rtn, "int4-rtn"), (awq_export, "int4-awq")):
        result = CliRunner().invoke(cli, ["inspect", str(export)])
        assert result.exit_code == 0, result.output
        section = json.loads((export / "refusion.json").read_text())["quantization"]
        weights = next(line for line in result.stdout.splitlines() if line.startswith("weights "))
        assert f"{method}  bits=4  block_size=32" in weights
        assert "onnxruntime accuracy_level=4 (runners), 1 (check)" in weights
        calibration = section["calibration"]
        if calibration:
            assert f"calibration={calibration['samples']} prompts sha256:{calibration['sha256']}" in weights
        else:
            assert "calibration" not in weights


def test_api_doc_names_every_export_argument_and_quantize_option():
    import dataclasses
    import inspect

    text = (REPO / "docs" / "api.md").read_text()
    signature = text[text.index("`export_onnx(checkpoint"):]
    signature = signature[:signature.index(")`")]
    for name in inspect.signature(export_onnx).parameters:
        assert f"{name}=" in signature or f"{name}," in signature, f"export_onnx({name}) is not in docs/api.md"
    for field in dataclasses.fields(QuantizeOptions):
        assert f"| `{field.name}` |" in text, f"QuantizeOptions.{field.name} is not in docs/api.md"


# -- bad requests ------------------------------------------------------------------------------------
def _refused(ckpt: Path, out: Path, match: str, **kwargs) -> None:
    with pytest.raises(RefusionError, match=match):
        export_onnx(ckpt, out, validate=False, **kwargs)
    assert_nothing_published(out)
    assert not out.exists()


@pytest.mark.parametrize("options, kwargs, match", [
    (QuantizeOptions("int8"), {}, r"--quantize 'int8' is not supported; choose one of int4-rtn, int4-awq"),
    (QuantizeOptions("int4-rtn", 128), {},
     r"--block-size 128: block size 128 does not divide hidden_size 64 and num_heads x head_dim 64 .*"
     r"the largest power of two that divides all of .* is 32; pass another --block-size"),
    (QuantizeOptions("int4-rtn", 24), {}, r"block size 24 is not a power of two >= 16"),
    (QuantizeOptions("int4-rtn", 32), {"dtype": "bf16"},
     r"--quantize int4-rtn with --dtype bf16 is not supported: onnxruntime's CPU provider runs no bfloat16 MatMul"),
    (QuantizeOptions("int4-rtn", 32, Path("prompts.txt")), {}, r"--calibration and --calibration-samples apply to "
                                                               r"int4-awq only, not int4-rtn"),
    (QuantizeOptions("int4-awq", 32, calibration_samples=0), {}, r"--calibration-samples 0: needs at least 1 prompt"),
], ids=["unknown method", "block not dividing", "block not power of two", "bf16", "calibration with rtn",
        "zero samples"])
def test_bad_quantize_requests(store, tmp_path, options, kwargs, match):
    _refused(store.checkpoint("gqa2"), tmp_path / "out", match, quantize=options, **kwargs)


@pytest.mark.parametrize("content, match", [
    (None, r"calibration file .*prompts.txt does not exist; pass a UTF-8 text file with one prompt per line"),
    ("", r"calibration file .*prompts.txt is empty \(no non-blank line\)"),
    ("\n   \n\t\n", r"calibration file .*prompts.txt is empty"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", r"prompts.txt is not text: byte 0x89 at offset 0 is not UTF-8"),
    (b"hello\x00world\n", r"prompts.txt is not text: it holds NUL bytes \(offset 5\)"),
    ("directory", r"calibration file .*prompts.txt is not a regular file"),
    ("first\n\n" + "x" * 2000 + "\n", r"calibration prompt line 3 of .*prompts.txt is \d+ tokens \(chat template "
                                       r"included\), longer than the model's max_position_embeddings 1024"),
], ids=["missing", "empty", "blank", "binary", "nul", "directory", "too long"])
def test_bad_calibration_files(store, tmp_path, content, match):
    file = tmp_path / "prompts.txt"
    if content == "directory":
        file.mkdir()
    elif isinstance(content, bytes):
        file.write_bytes(content)
    elif content is not None:
        file.write_text(content)
    _refused(store.checkpoint("gqa2"), tmp_path / "out", match, quantize=QuantizeOptions("int4-awq", 32, file))


def test_cli_refuses_calibration_options_without_quantize(store, tmp_path):
    result = CliRunner().invoke(cli, ["onnx", str(store.checkpoint("gqa2")), "-o", str(tmp_path / "x"),
                                      "--block-size", "64"])
    assert result.exit_code == 1
    assert "--block-size, --quantize-head, --calibration and --calibration-samples need --quantize" in result.stderr
    assert not (tmp_path / "x").exists()

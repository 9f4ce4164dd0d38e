"""Every fixture exports and validates; validation compares every output of both graphs."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from refusion.export.checkpoint import Checkpoint
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.tools.checks.fixtures.checkpoints import TinySpec, make_checkpoint
from tests.helpers import SPECS


def _graph_outputs(path, name: str) -> list[str]:
    return [o.name for o in onnx.load(str(path / f"{name}.onnx"), load_external_data=False).graph.output]


@pytest.mark.parametrize("name", list(SPECS))
def test_fp32_export_validates(store, name):
    export = store.export(name, "fp32")
    report = export.report
    assert report.ok, report.text()
    assert not report.skipped
    assert "result: PASS" in report.text()
    for graph in ("planner", "infiller"):
        compared = {out for g, out, _, _ in report.rows if g == graph}
        assert compared == set(_graph_outputs(export.path, graph)), f"{graph}: validation skipped some outputs"
    manifest = ExportManifest.load(export.path)
    spec = SPECS[name]
    assert manifest.dtype == "float32"
    assert (manifest.num_layers, manifest.kv_heads, manifest.head_dim) == (spec.num_layers, spec.kv_heads, spec.head_dim)
    assert manifest.dims.tie_word_embeddings == spec.tie_word_embeddings
    assert ("lm_head.weight" in manifest.weights) == (not spec.tie_word_embeddings)
    assert manifest.source["dtype"] == spec.dtype


def test_sharded_fixture_is_sharded(store):
    ckpt = store.checkpoint("sharded")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


def test_fp16_export_validates(store):
    export = store.export("gqa2", "fp16")
    assert export.report.ok, export.report.text()
    assert ExportManifest.load(export.path).dtype == "float16"
    infiller = {out for g, out, _, _ in export.report.rows if g == "infiller"}
    assert infiller == set(_graph_outputs(export.path, "infiller"))
    # fp16 weights: half the fp32 export's weight bytes (within alignment padding)
    fp32 = (store.export("gqa2", "fp32").path / "weights.bin").stat().st_size
    fp16 = (export.path / "weights.bin").stat().st_size
    assert fp16 < 0.6 * fp32


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_a_tied_head_reads_the_embedding_in_place(store, dtype):
    """The tied head is one Gemm(transB=1) over the embedding the Gather reads, with no Transpose of it, which
    TensorRT would fold into a second vocab x hidden constant; the export still validates against HF."""
    export = store.export("tied", dtype)
    assert export.report.ok, export.report.text()
    model = onnx.load(str(export.path / "infiller.onnx"), load_external_data=False)
    readers = [n for n in model.graph.node if "model.embed_tokens.weight" in n.input]
    assert sorted(n.op_type for n in readers) == ["Gather", "Gemm"]
    gemm = next(n for n in readers if n.op_type == "Gemm")
    assert {a.name: a.i for a in gemm.attribute} == {"transB": 1} and list(gemm.input)[1] == "model.embed_tokens.weight"
    assert not [n for n in model.graph.node if n.op_type == "Transpose" and "embed" in n.input[0]]


def test_logits_export_validates_logits(store):
    export = store.export("gqa2", "fp32", logits=True)
    assert export.report.ok, export.report.text()
    for graph in ("planner", "infiller"):
        assert (graph, "logits") in {(g, out) for g, out, _, _ in export.report.rows}


def test_export_directory_is_readable_by_others(store):
    """mkdtemp's 0700 must not leak into the published export (a TensorRT build may run as another user)."""
    import os

    umask = os.umask(0o22)
    os.umask(umask)
    assert store.export("gqa2").path.stat().st_mode & 0o777 == 0o777 & ~umask


def test_nan_weights_fail_validation_and_show_as_nan(store, tmp_path):
    """NaN in one layer's weights: every output downstream is NaN and the report says so, never `0.00e+00 ok`."""
    import shutil

    import numpy as np

    from refusion.export.validate import validate_export

    broken = shutil.copytree(store.export("gqa2", "fp32").path, tmp_path / "nan")
    entry = ExportManifest.load(broken).weights["model.layers.1.self_attn.k_norm.weight"]
    with open(broken / "weights.bin", "r+b") as f:  # same size: the manifest's size checks still pass
        f.seek(entry.offset)
        f.write(np.full(entry.nbytes // 4, np.nan, np.float32).tobytes())
    report = validate_export(broken)
    text = report.text()
    assert not report.ok and "result: FAIL" in text
    assert "0.00e+00" not in text
    lines = {line.split()[1]: line for line in text.splitlines()[1:] if line.startswith("  infiller")}
    for output in ("argmax_probs", "input_probs", "present.*"):  # present.0.* is fine, present.1.key is not
        assert "max|diff| nan" in lines[output] and "FAIL (non-finite output" in lines[output], lines[output]
    assert "present.1.key" in lines["present.*"]
    assert "mismatches nan" in lines["argmax_ids"] and "non-finite reference logits" in lines["argmax_ids"]



def test_validation_runs_torch_once_per_case(store, monkeypatch):
    """One torch forward serves both graphs of a case (the comparator runs onnxruntime first, then torch)."""
    from refusion.export import validate
    from refusion.export.compare import cases

    forwards = []
    forward = validate.TorchRunner._forward
    monkeypatch.setattr(validate.TorchRunner, "_forward", lambda self, feed: forwards.append(1) or forward(self, feed))
    path = store.export("gqa2", "fp32").path
    report = validate.validate_export(path)
    assert report.ok
    shared = cases(ExportManifest.load(path))
    assert len(forwards) == len(shared) < report.forwards == sum(len(c.graphs) for c in shared)


def _mapped_kib(file: Path) -> int:
    """KiB of `file` resident in this process's mappings (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0]:  # a mapping's header: address range first, path last
            inside = line.endswith(str(file))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="reads Linux's /proc/self/smaps")
def test_checkpoint_tensors_do_not_keep_the_shard_resident(tmp_path):
    """Each tensor's checkpoint pages leave our RSS with it: the exporter never holds a whole shard's pages."""
    ckpt = Checkpoint.open(make_checkpoint(tmp_path / "ckpt", TinySpec(vocab_size=16384)))  # 4 MiB embed, lm_head
    file = ckpt.path / "model.safetensors"
    largest, peak = 0, 0
    for _, tensor in ckpt.tensors():
        float(tensor.float().sum())  # touch every page, as the weight writer does
        largest, peak = max(largest, tensor.nbytes // 1024), max(peak, _mapped_kib(file))
    assert file.stat().st_size > 2 * largest * 1024
    assert peak <= largest + 256, f"{peak} KiB of the checkpoint resident; its largest tensor is {largest} KiB"


@pytest.mark.parametrize("name, dtype", [("gqa1", "fp32"), ("gqa4", "fp32"), ("gqa4", "fp16"), ("gqa2", "bf16")])
def test_attention_has_the_shape_tensorrt_fuses(store, name, dtype):
    """Every layer's attention as TensorRT's "Fused Attention" takes it: the first MatMul of 4-D operands, the
    queries [b, kv, rep x s, d] (a key head's query heads folded into the sequence axis) by the keys transposed
    [b, kv, d, total]; between it and the Softmax only the fp32 Cast and the mask bias's Add, [b, 1, rep x s, total]
    (no scale there: the queries arrive scaled, their rotary tables carrying 1 / sqrt(head_dim)); the probabilities
    (cast back) by the values [b, kv, total, d]. Validation and HF parity hold (the other tests of this file)."""
    import numpy as np
    from onnx import numpy_helper

    spec = SPECS[name]
    rep, d = spec.num_heads // spec.kv_heads, spec.head_dim
    path = store.export(name, dtype).path if dtype != "bf16" else _bf16_export(store, name)
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path / "infiller.onnx"), load_external_data=False))
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    readers = {}
    for node in graph.node:
        for i in node.input:
            readers.setdefault(i, []).append(node)
    shapes = {v.name: [dim.dim_value or dim.dim_param for dim in v.type.tensor_type.shape.dim]
              for v in list(graph.value_info) + list(graph.input)}

    def past_cast(node):  # the node a Cast (fp16 and bf16 graphs: the fp32 island's edge) stands before
        return producer[node.input[0]] if node.op_type == "Cast" else node

    softmaxes = [n for n in graph.node if n.op_type == "Softmax"]
    assert len(softmaxes) == spec.num_layers
    for softmax in softmaxes:
        add = producer[softmax.input[0]]
        scores, bias = add.input
        bmm1 = past_cast(producer[scores])
        assert (add.op_type, bmm1.op_type) == ("Add", "MatMul")  # nothing else between: no scale on the scores
        q, keys = (shapes[t] for t in bmm1.input)
        assert len(q) == len(keys) == 4 and q[1] == keys[1] == spec.kv_heads and q[3] == keys[2] == d, (q, keys)
        assert producer[bias].op_type == ("Tile" if rep > 1 else "Where")
        probs = readers[softmax.output[0]][0]
        bmm2 = readers[probs.output[0]][0] if probs.op_type == "Cast" else probs
        values = shapes[bmm2.input[1]]
        assert bmm2.op_type == "MatMul" and len(values) == 4 and values[1] == spec.kv_heads and values[3] == d
    constants = {i.name: numpy_helper.to_array(i) for i in graph.initializer if not i.dims and i.data_type == 1}
    scales = [n for n in graph.node if n.op_type == "Mul" and any(
        i in constants and np.isclose(constants[i], 1 / np.sqrt(d)) for i in n.input)]
    assert len(scales) == 2  # the queries' cos and sin tables, once a forward


def test_no_gather_picks_single_elements(store):
    """onnxruntime's CPU Gather copies one row of the axis after `axis` per index: over the last axis, one element.
    RoPE's rotate-half gathers the two halves of [..., 2, d / 2] instead of d elements (10% of a ReFusion token's
    instructions on the embedded model): every Gather of the graph reads rows, never along the last axis."""
    model = onnx.shape_inference.infer_shapes(onnx.load(str(store.export("gqa2", "fp32").path / "infiller.onnx"),
                                                        load_external_data=False))
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in list(model.graph.value_info) + list(model.graph.input)}
    ranks |= {i.name: len(i.dims) for i in model.graph.initializer}
    gathers = [n for n in model.graph.node if n.op_type == "Gather"]
    rotations = 0
    for node in gathers:
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        rank = ranks[node.input[0]]
        assert axis % rank != rank - 1, f"{node.name} gathers single elements of a rank-{rank} tensor"
        rotations += axis == -2
    assert rotations == 2 * SPECS["gqa2"].num_layers  # the queries' and the keys' rotate-half, each layer


def _bf16_export(store, name: str) -> Path:
    """bf16 graphs (onnxruntime's CPU provider runs no bfloat16 MatMul: exported unvalidated)."""
    from refusion.export.exporter import export_onnx

    out = store.root / f"{name}-bf16-attention"
    return out if (out / "refusion.json").exists() else export_onnx(store.checkpoint(name), out, dtype="bf16",
                                                                     validate=False)

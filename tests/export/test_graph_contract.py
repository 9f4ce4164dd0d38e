"""The ONNX files against the graph contract: names, dtypes, axes, ops, shared weights, fused heads."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

from refusion.export.checkpoint import Checkpoint
from refusion.export.model import Qwen3
from refusion.runtime.core.contract import GRAPH_NAMES, graph_specs, mask_bytes
from refusion.runtime.core.export_manifest import ExportManifest

ort = pytest.importorskip("onnxruntime")


def _load(path, name):
    return onnx.load(str(path / f"{name}.onnx"), load_external_data=False)


def _io(values) -> list[tuple[str, str, list]]:
    out = []
    for v in values:
        t = v.type.tensor_type
        out.append((v.name, helper.tensor_dtype_to_np_dtype(t.elem_type).name,
                    [d.dim_param if d.HasField("dim_param") else d.dim_value for d in t.shape.dim]))
    return out


def _spec_io(tensors) -> list[tuple[str, str, list]]:
    return [(t.name, t.dtype, list(t.axes)) for t in tensors]


@pytest.fixture(scope="module", params=[("gqa4", "fp32", False), ("gqa2", "fp16", False), ("gqa2", "fp32", True),
                                        ("gqa2", "fp16", False, "host")],
                ids=["fp32", "fp16", "fp32-logits", "fp16-embeddings-host"])
def export(request, store):
    return store.export(*request.param)


def test_io_exactly_as_declared(export):
    manifest = ExportManifest.load(export.path)
    m = manifest.dims
    declared = graph_specs(m.num_layers, m.kv_heads, m.head_dim, m.vocab_size, manifest.dtype, export.logits,
                           embeds_hidden=manifest.embeddings.fed_hidden)
    for name in GRAPH_NAMES:
        graph = _load(export.path, name).graph
        assert manifest.graphs[name] == declared[name], "refusion.json disagrees with runtime.contract"
        assert _io(graph.input) == _spec_io(declared[name].inputs)
        assert _io(graph.output) == _spec_io(declared[name].outputs)
        assert manifest.has_logits == export.logits


def test_kv_axes_are_symbolic_and_sequence_major(export):
    manifest = ExportManifest.load(export.path)
    infiller = dict((n, axes) for n, _, axes in _io(_load(export.path, "infiller").graph.output))
    for i in range(manifest.num_layers):
        assert infiller[f"present.{i}.key"] == ["batch", "seq", manifest.kv_heads, manifest.head_dim]
    planner_in = dict((n, axes) for n, _, axes in _io(_load(export.path, "planner").graph.input))
    assert planner_in["past_key_values.0.value"] == ["batch", "past_seq", manifest.kv_heads, manifest.head_dim]
    assert planner_in["attention_mask"] == ["batch", "seq", "total_seq"]


def test_planner_has_no_present_outputs(export):
    names = [o.name for o in _load(export.path, "planner").graph.output]
    assert not [n for n in names if n.startswith("present")]
    assert set(names) == {"argmax_ids", "argmax_probs", "top_ids", "top_logprobs"} | ({"logits"} if export.logits else set())


def test_standard_onnx_ops_only(export):
    for name in GRAPH_NAMES:
        model = _load(export.path, name)
        assert {o.domain for o in model.opset_import} <= {"", "ai.onnx"}
        assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}
        assert not model.functions
    onnx.checker.check_model(str(export.path / "planner.onnx"))  # path form: external data allowed


def test_one_weights_file_shared_at_identical_offsets(export):
    manifest = ExportManifest.load(export.path)
    located = {}
    for name in GRAPH_NAMES:
        graph = _load(export.path, name).graph
        for init in graph.initializer:
            if init.data_location != onnx.TensorProto.EXTERNAL:
                assert init.name.startswith("const_"), f"{name}: weight {init.name} embedded in the graph"
                continue
            ext = {e.key: e.value for e in init.external_data}
            where = (ext["location"], int(ext["offset"]), int(ext["length"]))
            assert located.setdefault(init.name, where) == where, f"{init.name} differs between graphs"
    assert {loc for loc, _, _ in located.values()} == {"weights.bin"}
    assert set(located) == set(manifest.weights)
    for tensor, (_, offset, length) in located.items():
        entry = manifest.weights[tensor]
        assert (entry.offset, entry.nbytes) == (offset, length)
        assert offset % 4096 == 0
    assert (export.path / "weights.bin").stat().st_size == manifest.files["weights.bin"].bytes
    # nothing else holds weights: two small graph files beside one weights file
    assert sorted(p.name for p in export.path.glob("*.onnx")) == ["infiller.onnx", "planner.onnx"]
    bins = sorted(["weights.bin", *manifest.embeddings.files])  # and a host embedding table, which no graph reads
    assert not list(export.path.glob("*.data")) and sorted(p.name for p in export.path.glob("*.bin")) == bins
    assert all((export.path / f"{g}.onnx").stat().st_size < 200_000 for g in GRAPH_NAMES)


def test_vocabulary_leaves_only_with_logits(export):
    vocab = ExportManifest.load(export.path).vocab_size
    for name in GRAPH_NAMES:
        outputs = _io(_load(export.path, name).graph.output)
        vocab_sized = [n for n, _, axes in outputs if vocab in axes]
        assert vocab_sized == (["logits"] if export.logits else [])


def test_logits_output_matches_torch(store):
    """At head positions out of order and repeated, the graphs' logits are torch's at those positions."""
    export = store.export("gqa2", "fp32", logits=True)
    model = Qwen3.from_checkpoint(Checkpoint.open(export.checkpoint))
    d = model.dims
    rng = np.random.default_rng(3)
    past, seq = 4, 3
    feed = {
        "input_ids": rng.integers(0, d.vocab_size, (1, seq)),
        "position_ids": np.arange(past, past + seq)[None],
        "attention_mask": np.concatenate([np.ones((seq, past), bool), np.tril(np.ones((seq, seq), bool))], 1)[None],
        "head_positions": np.array([[2, 0, 2]]),
        "vocab_mask": np.full((1, 1, mask_bytes(d.vocab_size)), 255, np.uint8),
    }
    for i in range(d.num_layers):
        for kind in ("key", "value"):
            feed[f"past_key_values.{i}.{kind}"] = rng.standard_normal((1, past, d.kv_heads, d.head_dim)).astype(np.float32)
    want = model(*(torch.from_numpy(feed[k]) for k in ("input_ids", "position_ids", "attention_mask")),
                 [(torch.from_numpy(feed[f"past_key_values.{i}.key"]), torch.from_numpy(feed[f"past_key_values.{i}.value"]))
                  for i in range(d.num_layers)])
    for name in GRAPH_NAMES:
        session = ort.InferenceSession(str(export.path / f"{name}.onnx"), providers=["CPUExecutionProvider"])
        (logits,) = session.run(["logits"], feed)
        assert logits.shape == (1, 3, d.vocab_size)
        assert np.abs(logits - want["logits"].numpy()[:, [2, 0, 2]]).max() <= 1e-4


def test_heads_at_some_positions_are_those_of_every_position(store):
    """A forward's heads at a subset of its positions equal the same forward's heads at every position there;
    input_probs is the next fed token's probability (the last position's, its own token's)."""
    export = store.export("gqa2", "fp32", logits=True)
    m = ExportManifest.load(export.path)
    rng = np.random.default_rng(5)
    seq = 6
    feed = {"input_ids": rng.integers(0, m.vocab_size, (2, seq)), "position_ids": np.tile(np.arange(seq), (2, 1)),
            "attention_mask": np.tile(np.tril(np.ones((seq, seq), bool)), (2, 1, 1)),
            "vocab_mask": np.full((2, 1, mask_bytes(m.vocab_size)), 255, np.uint8)}
    for i in range(m.num_layers):
        for kind in ("key", "value"):
            feed[f"past_key_values.{i}.{kind}"] = np.zeros((2, 0, m.kv_heads, m.head_dim), np.float32)
    session = ort.InferenceSession(str(export.path / "infiller.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs() if not o.name.startswith("present.")]
    every = dict(zip(names, session.run(names, feed | {"head_positions": np.tile(np.arange(seq), (2, 1))})))
    some = np.array([[5, 1], [0, 0]])
    got = dict(zip(names, session.run(names, feed | {"head_positions": some})))
    rows = np.arange(2)[:, None]
    for name in names:
        assert got[name].shape[:2] == (2, 2)
        np.testing.assert_allclose(got[name], every[name][rows, some], rtol=1e-5, atol=1e-6)
    probs = np.exp(every["logits"] - every["logits"].max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    following = np.concatenate([feed["input_ids"][:, 1:], feed["input_ids"][:, -1:]], axis=1)
    want = np.take_along_axis(probs, following[..., None], -1)[..., 0]
    np.testing.assert_allclose(every["input_probs"], want, rtol=1e-4, atol=1e-6)


def test_vocab_mask_keeps_the_allowed_logits_bit_for_bit_and_the_others_at_minus_inf(store):
    """One all-ones row leaves every head as without a mask; a mask a head sets the tokens it leaves out to -inf and
    nothing else, so the heads are the masked logits' (argmax, top-K, the next token's probability)."""
    export = store.export("gqa2", "fp32", logits=True)
    m = ExportManifest.load(export.path)
    rng = np.random.default_rng(7)
    seq, width = 4, mask_bytes(m.vocab_size)
    feed = {"input_ids": rng.integers(0, m.vocab_size, (1, seq)), "position_ids": np.arange(seq)[None],
            "attention_mask": np.tril(np.ones((seq, seq), bool))[None], "head_positions": np.arange(seq)[None]}
    for i in range(m.num_layers):
        for kind in ("key", "value"):
            feed[f"past_key_values.{i}.{kind}"] = np.zeros((1, 0, m.kv_heads, m.head_dim), np.float32)
    session = ort.InferenceSession(str(export.path / "infiller.onnx"), providers=["CPUExecutionProvider"])
    names = ["logits", "argmax_ids", "top_ids", "input_probs"]
    free = dict(zip(names, session.run(names, feed | {"vocab_mask": np.full((1, 1, width), 255, np.uint8)})))
    allowed = rng.random((1, seq, 8 * width)) < 0.3
    masked = dict(zip(names, session.run(names, feed | {"vocab_mask": np.packbits(allowed, -1, bitorder="little")})))
    allowed = allowed[..., : m.vocab_size]
    assert np.array_equal(masked["logits"][allowed], free["logits"][allowed])
    assert np.all(masked["logits"][~allowed] == -np.inf)
    assert np.array_equal(masked["argmax_ids"], np.where(allowed, free["logits"], -np.inf).argmax(-1))
    assert allowed[0, np.arange(seq)[:, None], masked["top_ids"][0][:, : allowed.sum(-1).min()]].all()

"""The build plan and its Polygraphy loaders, made and inspected without TensorRT."""

from __future__ import annotations

from types import SimpleNamespace

import onnx
import pytest

from refusion.engines.build import (
    PhaseTracker,
    _Tuning,
    engine_loader,
    fp32_island,
    keep_fp32,
    layer_node,
    plan_build,
    progress_monitor,
)
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.profiles import DecodeLimits, engine_profiles

LIMITS = DecodeLimits(max_prompt=64, gen_length=64, slot_size=8, serial_blocks=2)


def test_plan_checks_the_export_before_tensorrt(exports, tmp_path):
    plan = plan_build(exports["fp32"], tmp_path / "engines", LIMITS)
    assert plan.options.precision == "fp32"  # defaults to the export's
    assert plan.profiles == engine_profiles(LIMITS)
    with pytest.raises(RefusionError, match=r"--precision fp16 needs a fp16 export.*--dtype fp16"):
        plan_build(exports["fp32"], tmp_path / "e", LIMITS, precision="fp16")
    with pytest.raises(RefusionError, match="max_position_embeddings 1024"):
        plan_build(exports["fp32"], tmp_path / "e", DecodeLimits(max_prompt=1000, gen_length=64, slot_size=8,
                                                                 serial_blocks=2))
    with pytest.raises(RefusionError, match="--workspace"):
        plan_build(exports["fp32"], tmp_path / "e", LIMITS, workspace_gib=0)


def test_int4_with_fp32_activations_is_refused_with_the_reason(peaky_export, tmp_path):
    """TensorRT documents INT4 as weight-only W4A16: an fp32 int4 export is refused before any build, with the
    re-export that fits (onnxruntime still runs it)."""
    from refusion.export.exporter import export_onnx
    from refusion.export.quantize import QuantizeOptions

    fp32 = export_onnx(peaky_export.parent / "ckpt0", tmp_path / "int4-fp32", validate=False,
                       quantize=QuantizeOptions("int4-rtn", 64))
    with pytest.raises(RefusionError, match=r"int4 weights \(float32, int4-rtn block 64\) with fp32 activations; "
                                            r"TensorRT documents INT4 only as weight-only W4A16.*--dtype fp16 "
                                            r"--quantize int4-rtn --block-size 64"):
        plan_build(fp32, tmp_path / "engines", LIMITS)
    head = export_onnx(peaky_export.parent / "ckpt0", tmp_path / "int4-head-fp32", validate=False,
                       quantize=QuantizeOptions("int4-rtn", 64, head=True))
    with pytest.raises(RefusionError, match=r"\(float32, int4-rtn block 64, int4 lm_head\) with fp32 activations.*"
                                            r"--dtype fp16 --quantize int4-rtn --block-size 64 --quantize-head "):
        plan_build(head, tmp_path / "engines", LIMITS)


def test_rebuild_command_carries_every_choice(exports, tmp_path):
    plan = plan_build(exports["fp16"], tmp_path / "engines", LIMITS, strongly_typed=False, workspace_gib=4,
                      timing_cache=tmp_path / "tc.cache")
    cmd = plan.command
    for part in ("refusion-export build", str(exports["fp16"].resolve()), "--precision fp16", "--max-prompt 64",
                 "--gen-length 64", "--slot-size 8", "--serial-num-blocks 2", "--max-slots 4", "--weakly-typed",
                 "--workspace 4", f"--timing-cache {(tmp_path / 'tc.cache').resolve()}", "--force"):
        assert part in cmd
    assert "typed" not in plan_build(exports["fp16"], tmp_path / "engines", LIMITS).command  # strongly: the default


def test_weakly_typed_fp16_loaders(exports, tmp_path):
    from polygraphy.backend.trt import (
        CreateConfig,
        EngineBytesFromNetwork,
        NetworkFromOnnxPath,
        PostprocessConfig,
        PostprocessNetwork,
    )

    cache = tmp_path / "timing.cache"
    plan = plan_build(exports["fp16"], tmp_path / "engines", LIMITS, timing_cache=cache, workspace_gib=2,
                      strongly_typed=False)
    loader = engine_loader(plan)
    assert isinstance(loader, EngineBytesFromNetwork) and loader.timing_cache_path == str(cache)
    network = loader._network
    assert isinstance(network, PostprocessNetwork)  # the fp32 islands are pinned after parsing
    parse = network._network
    assert isinstance(parse, NetworkFromOnnxPath) and not parse.strongly_typed
    assert parse.path == str(exports["fp16"] / "infiller.onnx")
    tuning = loader._config
    assert isinstance(tuning, PostprocessConfig) and isinstance(tuning._func, _Tuning)
    config = tuning._config
    assert isinstance(config, CreateConfig)
    assert config.fp16 and not config.bf16 and not config.tf32
    assert config.precision_constraints == "obey"
    assert config.timing_cache_path == str(cache)
    # one engine for both roles: one Polygraphy profile per ProfileSpec, the planner's included, every
    # input with its min/opt/max
    spec = plan.export.graphs["infiller"]
    assert [(p.name, p.graph) for p in plan.profiles] == [("prefill", "infiller"), ("decode", "infiller"),
                                                           ("plan", "planner")]
    assert len(config.profiles) == 3
    for polygraphy_profile, ours in zip(config.profiles, plan.profiles):
        expected = ours.shapes(spec)
        assert set(polygraphy_profile) == set(expected)
        for name, (lo, opt, hi) in expected.items():
            shape = polygraphy_profile[name]
            assert (tuple(shape.min), tuple(shape.opt), tuple(shape.max)) == (lo, opt, hi)


def test_strongly_typed_and_fp32_loaders_set_no_precision_flags(exports, tmp_path):
    from polygraphy.backend.trt import NetworkFromOnnxPath

    plan = plan_build(exports["bf16"], tmp_path / "engines", LIMITS)
    assert plan.options.strongly_typed  # the default
    loader = engine_loader(plan)
    assert isinstance(loader._network, NetworkFromOnnxPath) and loader._network.strongly_typed
    assert loader._network.path == str(exports["bf16"] / "infiller.onnx")
    config = loader._config._config
    assert not config.fp16 and not config.bf16 and config.precision_constraints is None
    assert len(config.profiles) == 3 and loader.timing_cache_path is None
    fp32 = engine_loader(plan_build(exports["fp32"], tmp_path / "e", LIMITS, strongly_typed=False))
    assert isinstance(fp32._network, NetworkFromOnnxPath)


def test_fp32_island_is_what_the_export_keeps_in_fp32(exports):
    model = onnx.load(str(exports["fp16"] / "infiller.onnx"), load_external_data=False)
    island = fp32_island(model)
    ops = {n.name: n.op_type for n in model.graph.node}
    kinds = {ops[n] for n in island}
    assert {"ReduceMean", "Softmax", "Sqrt", "Reciprocal", "Cos", "Sin", "ReduceMax", "Exp", "ArgMax", "Where",
            "TopK"} <= kinds  # TopK: the sampling candidates over the fp32 logits
    # weight matmuls stay in half precision; only the score matmul's fp32 cast follows it
    weight_matmuls = [n.name for n in model.graph.node
                      if n.op_type == "MatMul" and any(i.endswith("_proj.weight") for i in n.input)]
    assert weight_matmuls and not island & set(weight_matmuls)
    assert fp32_island(onnx.load(str(exports["fp32"] / "infiller.onnx"), load_external_data=False)) == set()


def test_an_int4_head_stays_out_of_the_island_and_its_argmax_and_topk_in(peaky_int4_head):
    """With --quantize-head the logits MatMul reads a DequantizeLinear of fp16 scales: both stay half precision
    (TensorRT's W4A16 GEMM), and the Cast to fp32 after them starts the island that holds ArgMax and TopK."""
    model = onnx.load(str(peaky_int4_head / "infiller.onnx"), load_external_data=False)
    island = fp32_island(model)
    (dq,) = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == "lm_head.weight"]
    (matmul,) = [n for n in model.graph.node if dq.output[0] in n.input]
    (cast,) = [n for n in model.graph.node if matmul.output[0] in n.input]
    assert matmul.op_type == "MatMul" and cast.op_type == "Cast"
    assert dq.name not in island and matmul.name not in island and cast.name in island
    ops = {n.name: n.op_type for n in model.graph.node}
    assert {"ArgMax", "TopK", "Softmax"} <= {ops[n] for n in island}
    assert not any(ops[n] == "DequantizeLinear" for n in island)


def test_a_node_with_fp32_and_integer_outputs_is_in_the_island():
    """A TopK over fp32 logits (its values fp32, its indices int64) computes in fp32; over half values it does not."""
    from onnx import TensorProto, helper

    k = helper.make_tensor("k", TensorProto.INT64, [1], [2])
    nodes = [helper.make_node("Cast", ["h"], ["logits"], name="n1_Cast", to=TensorProto.FLOAT),
             helper.make_node("TopK", ["logits", "k"], ["top", "top_ids"], name="n2_TopK"),
             helper.make_node("TopK", ["h", "k"], ["half_top", "half_ids"], name="n3_TopK")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("h", TensorProto.FLOAT16, [1, 8])],
                              [helper.make_tensor_value_info(n, t, [1, 2]) for n, t in
                               (("top", TensorProto.FLOAT), ("top_ids", TensorProto.INT64),
                                ("half_top", TensorProto.FLOAT16), ("half_ids", TensorProto.INT64))],
                              initializer=[k])
    assert fp32_island(helper.make_model(graph)) == {"n1_Cast", "n2_TopK"}


def test_layer_to_node_mapping():
    assert layer_node("[ONNX Layer: n12_ReduceMean]") == "n12_ReduceMean"
    assert layer_node("[ONNX Layer: n7_Softmax | Local Function: f]") == "n7_Softmax"
    assert layer_node("") is None  # a layer the parser made for itself (a constant, a broadcast)


class _Tensor(SimpleNamespace):
    pass


class _Layer:
    """An ILayer as keep_fp32 sees it."""

    def __init__(self, name, inputs, outputs, metadata=""):
        self.name, self.metadata = name, metadata
        self._inputs, self._outputs = inputs, outputs
        self.num_inputs, self.num_outputs = len(inputs), len(outputs)
        self.precision = None
        self.output_types = {}

    def get_input(self, i):
        return self._inputs[i]

    def get_output(self, i):
        return self._outputs[i]

    def set_output_type(self, i, dtype):
        self.output_types[i] = dtype


def _network(layers):
    return SimpleNamespace(num_layers=len(layers), get_layer=lambda i: layers[i])


def test_keep_fp32_pins_island_layers_and_the_constants_feeding_them(fakes):
    trt, _ = fakes
    x, w = _Tensor(name="x", dtype=trt.float16), _Tensor(name="w", dtype=trt.float16)
    t = {n: _Tensor(name=n, dtype=trt.float32) for n in ("a", "b", "eps", "eps_b", "g", "zero", "bias", "top")}
    i64, i32 = _Tensor(name="idx", dtype="INT64"), _Tensor(name="top_i", dtype="INT32")
    ids = _Tensor(name="ids", dtype="INT64")
    mask = _Tensor(name="mask", dtype=trt.bool)
    half = _Tensor(name="h", dtype=trt.float16)
    layers = [
        _Layer("n3_ReduceMean", [t["a"]], [t["b"]], "[ONNX Layer: n3_ReduceMean]"),
        _Layer("eps", [], [t["eps"]]),  # the parser's constant for an initializer: no metadata
        _Layer("ONNXTRT_Broadcast", [t["eps"]], [t["eps_b"]]),
        _Layer("n4_Add", [t["b"], t["eps_b"]], [t["a"]], "[ONNX Layer: n4_Add]"),
        _Layer("zero", [], [t["zero"]]),
        _Layer("n8_Where", [mask, t["zero"], t["eps_b"]], [t["bias"]], "[ONNX Layer: n8_Where]"),  # the mask bias
        _Layer("n6_ArgMax", [t["a"]], [t["top"], i32], "[ONNX Layer: n6_ArgMax]"),  # the parser's TopK for ArgMax
        _Layer("n6_ArgMax_cast", [i32], [ids], "[ONNX Layer: n6_ArgMax]"),  # and its cast to int64
        _Layer("n9_GatherElements", [t["a"], i64], [t["g"]], "[ONNX Layer: n9_GatherElements]"),
        _Layer("w", [], [w]),  # a half weight feeding only half layers
        _Layer("n5_MatMul", [x, w], [half], "[ONNX Layer: n5_MatMul]"),
    ]
    island = {"n3_ReduceMean", "n4_Add", "n8_Where", "n6_ArgMax", "n9_GatherElements"}
    assert keep_fp32(_network(layers), island) == 9
    for layer in layers[:7]:  # the Where with its bool mask and the TopK included
        assert layer.precision is trt.float32 and layer.output_types == {0: trt.float32}, layer.name
    assert layers[7].precision is None and layers[7].output_types == {}  # the int cast: nothing to pin
    assert layers[8].precision is None and layers[8].output_types == {0: trt.float32}  # int indices: output only
    assert all(layer.precision is None and layer.output_types == {} for layer in layers[9:])


_TRT_TYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
              onnx.TensorProto.BFLOAT16: "bfloat16", onnx.TensorProto.BOOL: "bool"}


def _parsed(model, trt):
    """The network onnx-tensorrt makes of `model`, as keep_fp32 sees it: a layer per node with
    "[ONNX Layer: <node>]" metadata; for a float initializer a node takes as a tensor, a constant
    layer named after it without metadata, behind an "ONNXTRT_Broadcast" reshape (no metadata
    either) where its rank is below the other operand's (importerUtils.cpp: convertToTensor,
    broadcastTensors)."""
    inferred = onnx.shape_inference.infer_shapes(model).graph
    info = {v.name: v.type.tensor_type for v in [*inferred.value_info, *inferred.input, *inferred.output]}
    inits = {i.name: i for i in model.graph.initializer}

    def tensor(name, elem):
        return _Tensor(name=name, dtype=getattr(trt, _TRT_TYPES[elem]) if elem in _TRT_TYPES else f"onnx type {elem}")

    tensors = {name: tensor(name, t.elem_type) for name, t in info.items()}
    layers, constants = [], {}
    for node in model.graph.node:
        inputs = []
        for name in node.input:
            init = inits.get(name)
            if init is None or init.data_type not in _TRT_TYPES:
                inputs.append(tensors.get(name))  # int initializers stay weights: no tensor
                continue
            if name not in constants:
                constants[name] = tensor(name, init.data_type)
                layers.append(_Layer(name, [], [constants[name]]))
            source = constants[name]
            ranks = [len(info[i].shape.dim) for i in node.input if i in info]
            if ranks and len(init.dims) < max(ranks):
                source = tensor(f"{name}_broadcast_{node.name}", init.data_type)
                layers.append(_Layer("ONNXTRT_Broadcast", [constants[name]], [source]))
            inputs.append(source)
        layers.append(_Layer(node.name, inputs, [tensors[o] for o in node.output], f"[ONNX Layer: {node.name}]"))
    return layers, constants


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "int4-head"])
@pytest.mark.parametrize("graph", ["planner", "infiller"])
def test_every_constant_feeding_the_fp32_island_is_pinned(exports, peaky_int4_head, fakes, dtype, graph):
    """On the parse of a real export: each float initializer an fp32 node reads (inv_freq, the
    RMSNorm epsilon and exponent, the attention scale, the mask bias) is a constant pinned to fp32,
    as is each broadcast between; the half weights are left to the builder, the int4 head's fp16 scales too."""
    trt, _ = fakes
    export = peaky_int4_head if dtype == "int4-head" else exports[dtype]
    model = onnx.load(str(export / f"{graph}.onnx"), load_external_data=False)
    island = fp32_island(model)
    layers, constants = _parsed(model, trt)
    keep_fp32(_network(layers), island)
    producer = {t.name: layer for layer in layers for t in layer._outputs}

    floats = (trt.float32, trt.float16, trt.bfloat16)

    def pinned(layer):  # float outputs fp32; and fp32 compute unless an input is an integer (a Cast of position ids)
        outputs = {i: trt.float32 for i, t in enumerate(layer._outputs) if t.dtype in floats}
        computes = all(t is not None and t.dtype in (*floats, trt.bool) for t in layer._inputs)
        return layer.output_types == outputs and (layer.precision is trt.float32 or not computes)

    checked = set()
    for layer in layers:
        if layer.name not in island:
            continue
        assert pinned(layer), layer.name
        todo = [t for t in layer._inputs if t is not None and t.name in producer]
        while todo:  # everything without metadata upstream of an island layer: constants, broadcasts
            source = producer[todo.pop().name]
            if not source.metadata:
                assert pinned(source), f"{source.name} feeds {layer.name}"
                checked.add(source.name)
                todo += source._inputs
    consumers = {n.op_type for n in model.graph.node if n.name in island and set(n.input) & checked}
    assert len(checked & set(constants)) >= 5 and {"Mul", "Add", "Pow"} <= consumers
    half = [t for t in constants.values() if t.dtype is not trt.float32]
    assert half and all(producer[t.name].output_types == {} and producer[t.name].precision is None for t in half)
    # the mask bias's Where (its bool mask beside fp32 values) and ArgMax over the fp32 logits compute in fp32
    ops = {n.name: n.op_type for n in model.graph.node}
    assert {"Where", "ArgMax"} <= {ops.get(layer.name) for layer in layers if layer.precision is trt.float32}
    if dtype == "int4-head":
        scale = constants["lm_head.weight_scale"]
        assert scale.dtype is trt.float16 and producer[scale.name].output_types == {}


def test_progress_lines(fakes):
    lines: list[str] = []
    monitor = progress_monitor(lines.append)
    monitor.tracker.interval = 0.0
    monitor.phase_start("Building engine", None, 3)
    monitor.phase_start("Tactic selection", "Building engine", 2)
    assert monitor.step_complete("Tactic selection", 0) is True
    monitor.phase_start("too deep", "Tactic selection", 1)
    monitor.phase_finish("too deep")
    monitor.phase_finish("Tactic selection")
    monitor.phase_finish("Building engine")
    assert lines[0] == "Building engine (3 steps)"
    assert lines[1] == "  Tactic selection (2 steps)"
    assert lines[2].startswith("  Tactic selection: 1/2")
    assert lines[3].startswith("Building engine done in")
    assert len(lines) == 4


def test_phase_tracker_throttles_steps():
    lines: list[str] = []
    tracker = PhaseTracker(lines.append, interval=3600)
    tracker.start("p", None, 100)
    for step in range(100):
        tracker.step("p", step)
    assert lines == ["p (100 steps)"]


def test_tuning_sets_workspace_and_monitor(fakes):
    config = SimpleNamespace(limits={}, progress_monitor=None)
    config.set_memory_pool_limit = lambda pool, size: config.limits.__setitem__(pool, size)
    tuning = _Tuning(1.5, lambda m: None)
    tuning(None, None, config)
    assert config.limits == {"workspace": int(1.5 * 2**30)}
    assert config.progress_monitor is tuning.monitor is not None

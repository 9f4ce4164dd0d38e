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


def test_rebuild_command_carries_every_choice(exports, tmp_path):
    plan = plan_build(exports["fp16"], tmp_path / "engines", LIMITS, strongly_typed=True, workspace_gib=4,
                      timing_cache=tmp_path / "tc.cache")
    cmd = plan.command
    for part in ("refusion-export build", str(exports["fp16"].resolve()), "--precision fp16", "--max-prompt 64",
                 "--gen-length 64", "--slot-size 8", "--serial-blocks 2", "--max-slots 4", "--strongly-typed",
                 "--workspace 4", f"--timing-cache {(tmp_path / 'tc.cache').resolve()}", "--force"):
        assert part in cmd


def test_weakly_typed_fp16_loaders(exports, tmp_path):
    from polygraphy.backend.trt import (
        CreateConfig,
        EngineBytesFromNetwork,
        NetworkFromOnnxPath,
        PostprocessConfig,
        PostprocessNetwork,
    )

    cache = tmp_path / "timing.cache"
    plan = plan_build(exports["fp16"], tmp_path / "engines", LIMITS, timing_cache=cache, workspace_gib=2)
    loader = engine_loader(plan, "infiller", strongly_typed=False)
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
    # one Polygraphy profile per ProfileSpec, every input with its min/opt/max
    spec = plan.export.graphs["infiller"]
    assert len(config.profiles) == 2
    for polygraphy_profile, ours in zip(config.profiles, plan.profiles["infiller"]):
        expected = ours.shapes(spec)
        assert set(polygraphy_profile) == set(expected)
        for name, (lo, opt, hi) in expected.items():
            shape = polygraphy_profile[name]
            assert (tuple(shape.min), tuple(shape.opt), tuple(shape.max)) == (lo, opt, hi)


def test_strongly_typed_and_fp32_loaders_set_no_precision_flags(exports, tmp_path):
    from polygraphy.backend.trt import NetworkFromOnnxPath

    plan = plan_build(exports["bf16"], tmp_path / "engines", LIMITS)
    loader = engine_loader(plan, "planner", strongly_typed=True)
    assert isinstance(loader._network, NetworkFromOnnxPath) and loader._network.strongly_typed
    config = loader._config._config
    assert not config.fp16 and not config.bf16 and config.precision_constraints is None
    assert len(config.profiles) == 1 and loader.timing_cache_path is None
    fp32 = engine_loader(plan_build(exports["fp32"], tmp_path / "e", LIMITS), "planner", strongly_typed=False)
    assert isinstance(fp32._network, NetworkFromOnnxPath)


def test_fp32_island_is_what_the_export_keeps_in_fp32(exports):
    model = onnx.load(str(exports["fp16"] / "infiller.onnx"), load_external_data=False)
    island = fp32_island(model)
    ops = {n.name: n.op_type for n in model.graph.node}
    kinds = {ops[n] for n in island}
    assert {"ReduceMean", "Softmax", "Sqrt", "Reciprocal", "Cos", "Sin", "ReduceMax", "Exp"} <= kinds
    # weight matmuls stay in half precision; only the score matmul's fp32 cast follows it
    weight_matmuls = [n.name for n in model.graph.node
                      if n.op_type == "MatMul" and any(i.endswith("_proj.weight") for i in n.input)]
    assert weight_matmuls and not island & set(weight_matmuls)
    assert fp32_island(onnx.load(str(exports["fp32"] / "infiller.onnx"), load_external_data=False)) == set()


def test_layer_to_node_mapping():
    assert layer_node("n12_ReduceMean_3", "[ONNX Layer: n12_ReduceMean]") == "n12_ReduceMean"
    assert layer_node("x", "[ONNX Layer: n7_Softmax | Local Function: f]") == "n7_Softmax"
    assert layer_node("n12_ReduceMean_3", "") == "n12_ReduceMean"  # older parsers: the name's suffix
    assert layer_node("n12_ReduceMean", "") == "n12_ReduceMean"


class _Tensor(SimpleNamespace):
    pass


class _Layer:
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


def test_keep_fp32_pins_island_layers(fakes):
    trt, _ = fakes
    half, f32, i64 = _Tensor(dtype=trt.float16), _Tensor(dtype=trt.float32), _Tensor(dtype="INT64")
    layers = [
        _Layer("n3_ReduceMean", [f32], [f32], "[ONNX Layer: n3_ReduceMean]"),
        _Layer("n3_ReduceMean_1", [f32], [f32], "[ONNX Layer: n3_ReduceMean]"),
        _Layer("n9_GatherElements", [f32, i64], [f32], "[ONNX Layer: n9_GatherElements]"),
        _Layer("n4_MatMul", [half, half], [half], "[ONNX Layer: n4_MatMul]"),
    ]
    network = SimpleNamespace(num_layers=len(layers), get_layer=lambda i: layers[i])
    assert keep_fp32(network, {"n3_ReduceMean", "n9_GatherElements"}) == 3
    assert layers[0].precision is trt.float32 and layers[0].output_types == {0: trt.float32}
    assert layers[1].precision is trt.float32
    assert layers[2].precision is None and layers[2].output_types == {0: trt.float32}  # int indices: output only
    assert layers[3].precision is None and layers[3].output_types == {}


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

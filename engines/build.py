"""`refusion-export build`: an ONNX export -> model.engine + engines.json.

The build is planned first as plain values (`plan_build`: limits, profiles, precision,
checks against the export), then expressed as Polygraphy loaders (`engine_loader`), which
are lazy: both can be made and inspected without TensorRT. Only `build_engines` runs the
builder. One engine serves both roles, so the weights are resident once: it is parsed from
the infiller graph, with the infiller's prefill and decode profiles and the planner's
decode profile ("plan"); a planner forward runs on it and discards its present KV (the
runner binds that to scratch). The planner graph stays the onnxruntime planner. With
`--max-batch N` the decode and plan profiles take 1..N rows, one per request (the prefill
profile stays at 1; runtime/core/profiles.py says why).

Precision follows the export: its fp16/bf16 graphs already carry the fp32 islands
(RMSNorm variance, rotary tables, attention softmax, the heads' softmax) as explicit casts.
So the network is strongly typed by default: it keeps those types exactly, and every TensorRT
this project runs on (>= 10.1) builds such networks. A weakly typed build (`--weakly-typed`,
TensorRT 10's own default) gets the FP16/BF16 flag instead, so each island layer is pinned to
fp32 with "obey" precision constraints, or the builder could run it in half precision and
overflow, and so is every constant and parser helper that feeds an island (the parser gives
those no node metadata), or the builder could store inv_freq or the attention scale in half
precision. TensorRT deprecated those flags and constraints in 10.12 and removed them in 11,
which builds strongly typed networks only: there `--weakly-typed` is refused.
"""

from __future__ import annotations

import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refusion.export.progress import line, tick
from refusion.export.publish import clean_leftovers, cleanup_on_signals, make_staging, publish
from refusion.runtime.core.dtypes import EXPORT_DTYPES, dtype
from refusion.runtime.core.engines_manifest import (
    ENGINE_FILE,
    ENGINE_GRAPH,
    ENGINES_MANIFEST,
    EngineFile,
    EngineManifest,
    Target,
)
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import MANIFEST_NAME, ExportManifest
from refusion.runtime.core.files import sha256_file
from refusion.runtime.core.profiles import DecodeLimits, ProfileSpec, engine_profiles
from refusion.runtime.runners.trt_loader import current_target, require_tensorrt

if TYPE_CHECKING:
    import tensorrt

Report = Callable[[str], None]
# TensorRT 11 removed ILayer.precision_is_set, which Polygraphy's CreateConfig reads on every build up to 0.49.27:
# there every build fails on its first layer with an AttributeError. 0.50.3 guards the read (the table's row in
# tests/engines/test_versions.py; the extras' floor).
POLYGRAPHY_FOR_TENSORRT_11 = "0.50.3"


@dataclass(frozen=True)
class BuildOptions:
    precision: str  # fp32 | fp16 | bf16
    strongly_typed: bool = True
    workspace_gib: float | None = None
    timing_cache: Path | None = None


@dataclass(frozen=True)
class BuildPlan:
    export: ExportManifest
    output: Path
    limits: DecodeLimits
    options: BuildOptions
    profiles: list[ProfileSpec]

    @property
    def onnx_path(self) -> Path:
        """The graph the engine is parsed from."""
        return self.export.graph_path(ENGINE_GRAPH)

    @property
    def command(self) -> str:
        """The command that rebuilds these engines (quoted in every load-time refusal)."""
        o = self.options
        parts = ["refusion-export build", str(self.export.path.resolve()), "--output", str(self.output.resolve()),
                 "--precision", o.precision, *self.limits.flags()]
        if not o.strongly_typed:
            parts.append("--weakly-typed")
        if o.workspace_gib is not None:
            parts += ["--workspace", f"{o.workspace_gib:g}"]
        if o.timing_cache is not None:
            parts += ["--timing-cache", str(o.timing_cache.resolve())]
        return " ".join(parts) + " --force"


def plan_build(export_dir: str | Path, output: str | Path, limits: DecodeLimits, *, precision: str | None = None,
               strongly_typed: bool = True, workspace_gib: float | None = None,
               timing_cache: str | Path | None = None) -> BuildPlan:
    """Validate everything that can be known before TensorRT runs, and fix the profiles."""
    from refusion.engines.onnx_support import require_supported

    export = ExportManifest.load(export_dir)
    if export.ops != "standard":
        raise RefusionError(
            f"{export.path} was exported with --ops {export.ops}: its fused ops (opset {export.opset}, "
            "com.microsoft) are onnxruntime's. TensorRT builds the standard graphs: re-export with `refusion-export "
            "onnx CHECKPOINT --output DIR` (--ops standard, the default) and build from DIR (onnxruntime runs this "
            "export as it is)."
        )
    exported = dtype(export.dtype).flag
    precision = precision or exported
    if precision not in EXPORT_DTYPES:
        raise RefusionError(f"--precision {precision!r} is not one of {', '.join(EXPORT_DTYPES)}.")
    if precision != exported:
        raise RefusionError(
            f"--precision {precision} needs a {precision} export; {export.path} holds {export.dtype} graphs. The "
            "export decides the precision (and which ops stay fp32); re-export with "
            f"`refusion-export onnx CHECKPOINT --dtype {precision} --output DIR` and build from DIR."
        )
    if export.quantization is not None and precision == "fp32":
        raise RefusionError(
            f"{export.path} holds int4 weights ({export.precision}) with fp32 activations; TensorRT documents INT4 "
            "only as weight-only W4A16 (fp16/bf16 activations), so an fp32 engine would dequantize every weight "
            "to fp32 (8x their bytes) or run no documented kernel. Re-export with `refusion-export onnx CHECKPOINT "
            f"--dtype fp16 {export.quantization.flags()} "
            "--output DIR` and build from DIR (onnxruntime runs this export as it is)."
        )
    if workspace_gib is not None and workspace_gib <= 0:
        raise RefusionError(f"--workspace {workspace_gib} GiB must be positive (or omitted to let TensorRT choose).")
    positions = limits.max_prompt + limits.gen_length
    if positions > export.max_positions:
        raise RefusionError(
            f"--max-prompt {limits.max_prompt} + --gen-length {limits.gen_length} = {positions} exceeds the model's "
            f"max_position_embeddings {export.max_positions}; lower them."
        )
    require_supported(export.path)
    options = BuildOptions(precision, strongly_typed, workspace_gib, Path(timing_cache) if timing_cache else None)
    return BuildPlan(export, Path(output), limits, options, engine_profiles(limits))


# -- fp32 islands for weakly typed builds ------------------------------------------------------
def fp32_island(model: Any) -> set[str]:
    """Names of the nodes of a reduced-precision export that compute in fp32: their float outputs are
    typed float32 (beside integer ones: a TopK's values and indices), or they have none and read
    float32 tensors only (ArgMax over the fp32 logits, whose TopK would otherwise be free to run in
    half precision, where near ties flip). Empty for an fp32 export: nothing there is reduced."""
    import onnx

    graph = onnx.shape_inference.infer_shapes(model).graph
    float_types = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
    types = {v.name: v.type.tensor_type.elem_type for v in list(graph.value_info) + list(graph.output)}
    types.update({i.name: i.data_type for i in graph.initializer})
    if not any(t in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16) for t in types.values()):
        return set()
    island = set()
    for node in graph.node:
        outputs = [types.get(o) for o in node.output]
        float_outputs = [t for t in outputs if t in float_types]
        float_inputs = [types.get(i) for i in node.input if types.get(i) in float_types]
        if float_outputs and None not in outputs and all(t == onnx.TensorProto.FLOAT for t in float_outputs):
            island.add(node.name)
        elif not float_outputs and float_inputs and all(t == onnx.TensorProto.FLOAT for t in float_inputs):
            island.add(node.name)
    return island


_METADATA = re.compile(r"^\[ONNX Layer: (?P<node>.*?)(?: \| .*)?\]$")


def layer_node(metadata: str) -> str | None:
    """The ONNX node a parsed layer came from: the parser (TensorRT >= 10) writes "[ONNX Layer:
    <node>]" into the metadata of the layers it makes for a node. Layers it makes for itself
    (constants for initializers, broadcast reshapes, casts) carry none: None."""
    match = _METADATA.match(metadata or "")
    return match["node"] if match else None


def keep_fp32(network: tensorrt.INetworkDefinition, island: set[str]) -> int:
    """Pin the island's layers to fp32 (compute and float outputs), and with them every layer
    without metadata that feeds them, through float tensors: the constants the parser makes for
    initializers (inv_freq, the RMSNorm epsilon and exponent, the attention scale, the mask bias)
    and its broadcast and cast helpers. Unpinned, TensorRT may store such a constant in half
    precision when it picks fp16 for it. A layer's compute precision is pinned when its inputs are
    floats or bools (the mask's Where: run in half precision, its float32-min bias would become
    -inf); not when an input is an integer (indices, shapes), whose type a precision would not
    describe. Returns how many layers were pinned."""
    import tensorrt as trt

    floating = {trt.float32, trt.float16, trt.bfloat16}
    data = floating | {trt.bool}
    layers = [network.get_layer(i) for i in range(network.num_layers)]
    producer = {layer.get_output(i).name: j for j, layer in enumerate(layers) for i in range(layer.num_outputs)}
    todo = [j for j, layer in enumerate(layers) if layer_node(layer.metadata) in island]
    pinned: set[int] = set()
    while todo:
        j = todo.pop()
        if j in pinned:
            continue
        pinned.add(j)
        layer = layers[j]
        inputs = [layer.get_input(i) for i in range(layer.num_inputs)]
        if all(t is not None and t.dtype in data for t in inputs):
            layer.precision = trt.float32
        for i in range(layer.num_outputs):
            if layer.get_output(i).dtype in floating:
                layer.set_output_type(i, trt.float32)
        for t in inputs:
            source = producer.get(t.name) if t is not None and t.dtype in floating else None
            if source is not None and layer_node(layers[source].metadata) is None:
                todo.append(source)
    return len(pinned)


# -- progress ----------------------------------------------------------------------------------
class PhaseTracker:
    """Turns TensorRT's phase/step callbacks into a few readable lines (thread-safe: the builder
    calls from its own threads). Steps print at most every `interval` seconds per phase; a report
    that takes ticks (export/progress.py) gets every step, for a bar per phase."""

    def __init__(self, report: Report, max_depth: int = 2, interval: float = 10.0):
        self.report, self.max_depth, self.interval = report, max_depth, interval
        self._lock = threading.Lock()
        self._phases: dict[str, tuple[int, int, float, float]] = {}  # name -> depth, steps, start, last print

    def start(self, phase: str, parent: str | None, steps: int) -> None:
        with self._lock:
            depth = self._phases[parent][0] + 1 if parent in self._phases else 0
            now = time.monotonic()
            self._phases[phase] = (depth, steps, now, now)
            if depth < self.max_depth:
                line(self.report, f"{'  ' * depth}{phase} ({steps} steps)", phase, 0, steps, "step")

    def step(self, phase: str, step: int) -> None:
        with self._lock:
            if phase not in self._phases:
                return
            depth, steps, start, last = self._phases[phase]
            now = time.monotonic()
            if depth >= self.max_depth:
                return
            if now - last >= self.interval:
                self._phases[phase] = (depth, steps, start, now)
                line(self.report, f"{'  ' * depth}{phase}: {step + 1}/{steps} ({now - start:.0f} s)", phase, step + 1,
                     steps, "step")
            else:
                tick(self.report, phase, step + 1, steps, "step")

    def finish(self, phase: str) -> None:
        with self._lock:
            depth, steps, start, _ = self._phases.pop(phase, (self.max_depth, 0, 0.0, 0.0))
            if depth == 0:
                line(self.report, f"{phase} done in {time.monotonic() - start:.0f} s", phase, steps, steps, "step")
            elif depth < self.max_depth:
                tick(self.report, phase, steps, steps, "step")  # ends the phase's bar


def progress_monitor(report: Report) -> tensorrt.IProgressMonitor:
    """A trt.IProgressMonitor reporting through a PhaseTracker (the class needs tensorrt to exist)."""
    import tensorrt as trt

    class _Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.tracker = PhaseTracker(report)

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            self.tracker.start(phase_name, parent_phase, num_steps)

        def step_complete(self, phase_name: str, step: int) -> bool:
            self.tracker.step(phase_name, step)
            return True  # never cancel

        def phase_finish(self, phase_name: str) -> None:
            self.tracker.finish(phase_name)

    return _Monitor()


# -- loaders -----------------------------------------------------------------------------------
def engine_loader(plan: BuildPlan, report: Report = lambda m: None) -> Any:
    """Polygraphy's lazy loader chain for the engine; calling it builds and returns the serialized engine."""
    from polygraphy.backend.trt import (
        CreateConfig,
        EngineBytesFromNetwork,
        NetworkFromOnnxPath,
        PostprocessConfig,
        PostprocessNetwork,
        Profile,
    )

    precision, strongly_typed = plan.options.precision, plan.options.strongly_typed
    reduced = precision != "fp32" and not strongly_typed
    network: Any = NetworkFromOnnxPath(str(plan.onnx_path), strongly_typed=strongly_typed)
    if reduced:
        network = PostprocessNetwork(network, _KeepFp32(plan.onnx_path, report), name="keep fp32 islands")
    spec = plan.export.graphs[ENGINE_GRAPH]  # the planner's inputs are the same
    profiles = []
    for prof in plan.profiles:
        p = Profile()
        for name, (lo, opt, hi) in prof.shapes(spec).items():
            p.add(name, min=lo, opt=opt, max=hi)
        profiles.append(p)
    config = CreateConfig(
        profiles=profiles,
        fp16=reduced and precision == "fp16",
        bf16=reduced and precision == "bf16",
        tf32=False,  # fp32 engines are the accuracy reference; TF32 would round their matmuls
        precision_constraints="obey" if reduced else None,
        load_timing_cache=str(plan.options.timing_cache) if plan.options.timing_cache else None,
    )
    config = PostprocessConfig(config, _Tuning(plan.options.workspace_gib, report))
    save = str(plan.options.timing_cache) if plan.options.timing_cache else None
    return EngineBytesFromNetwork(network, config, save_timing_cache=save)


class _KeepFp32:
    """PostprocessNetwork step: pin the export's fp32 islands (computed from the ONNX file)."""

    def __init__(self, onnx_path: Path, report: Report):
        self.onnx_path, self.report = onnx_path, report
        self.__name__ = "keep_fp32"

    def __call__(self, network: tensorrt.INetworkDefinition) -> None:
        import onnx

        island = fp32_island(onnx.load(str(self.onnx_path), load_external_data=False))
        pinned = keep_fp32(network, island)
        if island and not pinned:
            raise RefusionError(
                "no TensorRT layer could be traced to the export's fp32 nodes (this parser writes no "
                "[ONNX Layer: ...] metadata), so half precision could overflow them; build with --strongly-typed instead."
            )
        self.report(f"pinned {pinned} layers to fp32: those of {len(island)} fp32 nodes and the constants feeding them")


class _Tuning:
    """PostprocessConfig step: what CreateConfig takes only as TensorRT objects (workspace, progress)."""

    def __init__(self, workspace_gib: float | None, report: Report):
        self.workspace_gib, self.report = workspace_gib, report
        self.monitor: tensorrt.IProgressMonitor | None = None  # must outlive the build: TensorRT keeps a pointer

    def __call__(self, builder: tensorrt.Builder, network: tensorrt.INetworkDefinition,
                 config: tensorrt.IBuilderConfig) -> None:
        import tensorrt as trt

        if self.workspace_gib is not None:
            config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(self.workspace_gib * 2**30))
        self.monitor = progress_monitor(self.report)
        config.progress_monitor = self.monitor


# -- the build ---------------------------------------------------------------------------------
def build_engines(plan: BuildPlan, *, force: bool = False, report: Report = lambda m: None) -> Path:
    """Build the engine into a staging directory and publish it as plan.output when all is done."""
    out = plan.output
    if out.exists() and not force:
        raise RefusionError(f"output {out} already exists; pass --force to replace it.")
    if out.exists() and not (out.is_dir() and not out.is_symlink()
                             and ((out / ENGINES_MANIFEST).is_file() or not any(out.iterdir()))):
        raise RefusionError(f"output {out} exists and is not an engines directory (no {ENGINES_MANIFEST}) nor empty; "
                            "--force replaces only those. Choose another --output.")
    require_tensorrt()
    import tensorrt as trt

    target = current_target()
    strongly = plan.options.strongly_typed
    version = _version(str(trt.__version__))
    require_polygraphy(str(trt.__version__))
    if not strongly and version >= (11, 0):
        raise RefusionError(f"--weakly-typed: TensorRT {trt.__version__} builds strongly typed networks only (the "
                            "FP16/BF16 builder flags are gone from TensorRT 11); build without --weakly-typed.")
    report(f"building a {plan.options.precision} engine for {target.gpu} (sm {target.compute_capability}) with "
           f"TensorRT {target.tensorrt}, {'strongly' if strongly else 'weakly'} typed"
           + (" (the FP16/BF16 flags it needs are deprecated since TensorRT 10.12)"
              if not strongly and version >= (10, 12) else ""))
    with cleanup_on_signals():  # SIGTERM/SIGHUP during a long build clean up like Ctrl-C
        out.parent.mkdir(parents=True, exist_ok=True)
        clean_leftovers(out, report, complete_marker=ENGINES_MANIFEST)
        staging = make_staging(out)
        try:
            t0 = time.perf_counter()
            profiles = ", ".join(f"{p.name} ({p.graph})" for p in plan.profiles)
            report(f"parsing {plan.onnx_path.name}, profiles: {profiles}")
            serialized = engine_loader(plan, report=report)()
            with memoryview(serialized) as engine:  # TensorRT's host memory, written as it is: no second copy
                report(f"{ENGINE_FILE}: {engine.nbytes / 2**20:.1f} MiB in {time.perf_counter() - t0:.0f} s")
                write_engines_dir(plan, staging, engine, target, strongly, time.perf_counter() - t0)  # engines.json last
            del serialized
            publish(staging, out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return out


def require_polygraphy(tensorrt_version: str) -> None:
    """Refuse, before parsing, a Polygraphy whose CreateConfig cannot build on this TensorRT (NGC images and older
    venvs carry 0.49.x: only a fresh install of the extras picks a newer one)."""
    try:
        import polygraphy
    except ImportError as e:
        raise RefusionError("building engines needs Polygraphy: pip install 'refusion-trt[trt]'.") from e
    found = str(polygraphy.__version__)
    if _version(tensorrt_version) >= (11, 0) and _version(found) < _version(POLYGRAPHY_FOR_TENSORRT_11):
        raise RefusionError(
            f"Polygraphy {found} cannot build engines with TensorRT {tensorrt_version}: its "
            "CreateConfig reads ILayer.precision_is_set, which TensorRT 11 removed. pip install "
            f"'polygraphy>={POLYGRAPHY_FOR_TENSORRT_11}' (what refusion-trt[trt] installs), then build again."
        )


def _version(text: str) -> tuple[int, ...]:
    """A release's numbers, to compare: "10.13.0.35" -> (10, 13, 0)."""
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def write_engines_dir(plan: BuildPlan, directory: Path, engine: bytes | memoryview, target: Target,
                      strongly_typed: bool, seconds: float) -> EngineManifest:
    """The engine file, engines.json, and the export's refusion.json and tokenizer files beside them,
    so the directory alone serves `refusion-run`. `engine` is written and hashed where it lies (the
    builder's host memory: a 16 GB engine is not copied again, which on Jetson would come out of the
    memory the GPU shares)."""
    import hashlib

    export = plan.export
    for name in (MANIFEST_NAME, *export.tokenizer_files, *export.embeddings.files):  # a host table: the runner maps it
        shutil.copyfile(export.path / name, directory / name)
    with memoryview(engine).cast("B") as view, open(directory / ENGINE_FILE, "wb") as file:
        file.write(view)
        digest, size = hashlib.sha256(view).hexdigest(), view.nbytes
    # the planner graph is in the sources: `refusion-export check` compares the planner forwards with it
    sources = [*export.model_files, MANIFEST_NAME]
    manifest = EngineManifest(
        path=directory,
        target=target,
        precision=export.dtype,
        strongly_typed=strongly_typed,
        limits=plan.limits,
        engine=EngineFile(ENGINE_FILE, digest, size, tuple(plan.profiles)),
        source={"export": str(export.path.resolve()),
                "sha256": {name: sha256_file(export.path / name) for name in sources}},
        build={"command": plan.command, "seconds": round(seconds, 1),
               "workspace_gib": plan.options.workspace_gib,
               "timing_cache": str(plan.options.timing_cache) if plan.options.timing_cache else None},
    )
    manifest.write()
    return manifest

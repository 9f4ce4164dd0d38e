"""`refusion-export check ENGINES_DIR`: the TensorRT engines against onnxruntime on the same inputs.

Both run the shared cases of refusion.export.compare (the decode loop's forwards: prefill +
plan, plan, verify, slot rows with private scratch over a shared prefix, an AR step; and the
validation's shapes) through the one comparator. TensorRT takes each case's past KV uploaded
into its cache, writes present after it and reads it back, so the check also covers the
engine's KV layout and the runner's bindings (aligned and staged writes). The planner's cases
run on the one engine's planner profile, against the planner graph. It runs the cases
it can: batch 1 (up to --max-batch rows on batched engines, each row a request of its own),
inside the engine's profiles; the report lists the rest. Differences are
max |diff| per output against abs + rel x the output's largest magnitude, NaN and inf shown
as such; argmax and top-K ids count mismatches (a near tie may legitimately flip between kernels, so a
few are allowed, and none where an export with logits shows the tokens further apart than the
tolerance). The shared report replaces Polygraphy's comparator here: one tolerance rule and one NaN
rule for every check, and no dependence on Polygraphy's version (SimpleCompareFunc needs >= 0.53).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from refusion.export.compare import (
    CaseRunner,
    ComparisonReport,
    Feed,
    OrtSessions,
    Outputs,
    Tolerance,
    cases,
    compare_runners,
    feed_shape,
)
from refusion.runtime.core.contract import VOCAB_MASK, GraphName, past_key_name, past_value_name
from refusion.runtime.core.engines_manifest import EngineManifest
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import MANIFEST_NAME, ExportManifest
from refusion.runtime.core.files import sha256_file
from refusion.runtime.core.profiles import DecodeLimits, select_profile
from refusion.runtime.decode.chunks import cut, merge
from refusion.runtime.decode.steps import Forward
from refusion.runtime.runners.ort_session import CUDA_PROVIDER, Provider, configured_provider, import_onnxruntime
from refusion.runtime.runners.rows import RowFeed
from refusion.runtime.runners.tensorrt import TensorRTRunner

TOLERANCE = {"float32": Tolerance(1e-3, 1e-3, 0.02), "float16": Tolerance(2e-2, 2e-2, 0.02)}  # by engine precision
Report = Callable[[str], None]


def check_engines(path: str | Path, report: Report = print) -> bool:
    """Verify an engines directory against onnxruntime; True when every comparison passes."""
    engines = EngineManifest.load(path)
    if engines.precision not in TOLERANCE:
        raise RefusionError(
            f"{path} holds {engines.precision} engines; onnxruntime cannot feed {engines.precision} KV from the host, "
            "so there is nothing to compare against. Check an fp16 build of the same export instead "
            "(the engine path is the same)."
        )
    export = source_export(engines)
    result = compare(TensorRTRunner.from_dir(path, verify=True), export, engines.limits, engines.precision, report)
    report("PASS: TensorRT engines match onnxruntime" if result.ok else "FAIL: TensorRT engines differ from onnxruntime")
    return result.ok


def source_export(engines: EngineManifest) -> ExportManifest:
    """The export the engines were built from, checked unchanged since (by sha256)."""
    export_dir = Path(engines.source["export"])
    if not (export_dir / MANIFEST_NAME).is_file():
        raise RefusionError(f"the check needs the export the engines were built from, {export_dir}, and it is gone; "
                            f"rebuild from an export you keep: {engines.rebuild_command}")
    for name, digest in engines.source["sha256"].items():
        file = export_dir / name
        if not file.is_file() or sha256_file(file) != digest:
            raise RefusionError(f"{file} changed since the engines were built from it; rebuild with: "
                                f"{engines.rebuild_command}")
    return ExportManifest.load(export_dir)


def compare(runner: TensorRTRunner, export: ExportManifest, limits: DecodeLimits, precision: str,
            report: Report) -> ComparisonReport:
    """`runner` (activated here, deactivated after) against onnxruntime over `export`, on the shared
    cases sized to fit `limits`; the report's lines go to `report`."""
    shared = cases(export, prefix=min(limits.max_prompt, 12), block=min(limits.block_length, 8), slot=limits.slot_size)
    result = compare_runners(TensorRTCases(runner), OrtSessions(export, reference_providers(precision)), shared,
                             TOLERANCE[precision], export.dtype)
    for line in result.text().splitlines():
        report(line)
    return result


def reference_providers(precision: str) -> list[Provider]:
    """onnxruntime's providers for the reference: CUDA where it has it, else the CPU. For fp32 engines
    (built with TF32 off: the accuracy reference) the CUDA provider runs with TF32 off too, which it
    turns on for fp32 GEMMs by default (`use_tf32`, onnxruntime >= 1.18); a TF32 reference would fail
    right engines at 1e-3 or hide wrong ones in its noise. A CUDA provider that fails to start is refused
    (open_session), not left to run the reference on the CPU."""
    available = import_onnxruntime().get_available_providers()
    return [configured_provider(CUDA_PROVIDER, precision)] * (CUDA_PROVIDER in available) + ["CPUExecutionProvider"]


class TensorRTCases(CaseRunner):
    """A TensorRTRunner as the comparator's runner: the case's past KV uploaded into the cache, the
    forward run over it (the infiller writing present right after it), present read back. A batch
    case on engines built with --max-batch: each row a request of its own (its own KV region), the
    rows run as the scheduler runs them (run_batch: packed where a profile takes them; a forward no profile holds
    whole cut into the chunks one holds by chunks.cut, its outputs merged back)."""

    name = "tensorrt"

    def __init__(self, runner: TensorRTRunner):
        self.runner = runner

    def unsupported(self, graph: GraphName, feed: Feed) -> str:
        batch, seq, past = feed_shape(feed)
        if batch > self.runner.max_requests:
            return (f"batch {batch}; this TensorRT runner holds {self.runner.max_requests} request(s) "
                    f"(engines built with --max-batch {self.runner.max_batch})")
        heads = feed["head_positions"].shape[1]
        if (select_profile(list(self.runner.engines.engine.profiles), graph, seq, past, 1, heads) is None
                and len(cut(self._forward(graph, feed, 0), None, self.runner)) == 1):
            return f"seq {seq} over past {past} ({heads} heads) lies outside the engine's {graph} profiles"
        return ""

    @staticmethod
    def _forward(graph: GraphName, feed: Feed, row: int) -> Forward:
        """Row `row` of the case as the forward the scheduler would hand the runner."""
        _, _, past = feed_shape(feed)
        masks = feed.get(VOCAB_MASK)  # a row's masks, one a head (a mask for all heads, repeated)
        heads = feed["head_positions"][row : row + 1]
        return Forward(feed["input_ids"][row : row + 1], feed["position_ids"][row : row + 1],
                       feed["attention_mask"][row : row + 1], past, past if graph == "infiller" else None, heads,
                       None if masks is None else np.ascontiguousarray(
                           np.broadcast_to(masks[row : row + 1], (1, heads.shape[1], masks.shape[2]))),
                       kind="check", graph=graph)

    def __call__(self, graph: GraphName, feed: Feed) -> Outputs:
        batch, seq, past = feed_shape(feed)
        runner = self.runner
        runner.activate()
        write_at = past if graph == "infiller" else None
        forwards = [self._forward(graph, feed, b) for b in range(batch)]
        pieces = [cut(forward, None, self.runner) for forward in forwards]  # as the scheduler cuts them
        for b in range(batch):
            runner.allocate_kv(past + seq, b)
            runner.kv_from_host(0, {name: feed[name][b : b + 1] for i in range(runner.manifest.num_layers)
                                    for name in (past_key_name(i), past_value_name(i))}, b)
        if all(len(chunks) == 1 for chunks in pieces):
            rows = [RowFeed.of(forward, b) for b, forward in enumerate(forwards)]
            outs = [out for start in range(0, batch, runner.max_batch)
                    for out in runner.run_batch(graph, rows[start : start + runner.max_batch])]
        else:  # each request's chunks in turn, each over the KV those before it wrote, merged as the scheduler does
            outs = [merge(forward, chunks, [runner.run_batch(graph, [RowFeed.of(c, b)])[0] for c in chunks])
                    for b, (forward, chunks) in enumerate(zip(forwards, pieces))]
        if write_at is not None:
            for b, out in enumerate(outs):
                out.update(runner.kv_to_host(write_at, seq, b))
        return {name: np.concatenate([out[name] for out in outs]) for name in outs[0]}

    def close(self) -> None:
        self.runner.deactivate()

"""Export validation: onnxruntime (CPU) outputs against our torch definition on the same weights.

Runs both graphs on the shared cases of refusion.export.compare (batch 1 and 2, past 0 and
> 0, several sequence lengths, out-of-order position ids, slot rows over a shared past, and
the decode loop's forwards) and reports the largest difference per output, NaN and inf as
such. Used after every export and by `refusion-export check`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from refusion.export.compare import (
    ROUNDED,
    CaseRunner,
    ComparisonReport,
    Feed,
    OrtSessions,
    Outputs,
    Tolerance,
    cases,
    compare_runners,
)
from refusion.export.progress import Progress, line, silent, tick
from refusion.export.weights_file import map_weights
from refusion.runtime.core.contract import VOCAB_MASK, GraphName, past_key_name, past_value_name
from refusion.runtime.core.export_manifest import ExportManifest

# fp16 rounds relative to magnitude, hence a relative term; an fp16 export is compared with torch's fp32 arithmetic on
# its weights and feeds, each limit widened by torch's own fp16 error on that output (TorchRunner; export/compare.py
# says why). int4 exports: torch runs the dequantized weights and onnxruntime's MatMulNBits (accuracy level 1)
# computes in fp32 on the same values, so they agree as closely as a float export of their dtype.
TOLERANCE = {"float32": Tolerance(1e-4), "float16": Tolerance(2e-2, rel=2e-3)}
ValidationReport = ComparisonReport


def validate_export(path: str | Path, seed: int = 0, pending: bool = False,
                    progress: Progress = silent) -> ValidationReport:
    """The export's graphs on onnxruntime CPU against the torch definition; `pending` reads an export
    not yet published (the exporter's own validation). `progress` counts the forwards of both runners."""
    manifest = ExportManifest.load(path, pending=pending)
    if manifest.dtype not in TOLERANCE:
        return ValidationReport(manifest.dtype, skipped=(
            f"onnxruntime's CPU provider has no {manifest.dtype} MatMul; "
            "run `refusion-export check` where onnxruntime-gpu is installed, or export with --dtype fp32 or fp16"
        ))
    # onnxruntime first, one session at a time, then torch once per case for both graphs:
    # peak memory is the larger of the two, not their sum, and torch runs half as often.
    todo = cases(manifest, seed)
    counter = _Counter(progress, 2 * sum(len(case.graphs) for case in todo))  # both runners take every forward
    tolerance = TOLERANCE[manifest.dtype]
    # Unpacked sessions: measured on one ReFusion-8B layer, the session's peak 5.4 -> 4.3 GiB (fp16), 4.8 -> 3.7
    # GiB (int4), its forwards 2.5-7x slower (docs/quantization.md).
    sessions = OrtSessions(manifest, unpacked=True)
    report = compare_runners(counter.wrap(sessions), counter.wrap(TorchRunner(manifest)), todo,
                             tolerance, manifest.precision)
    if manifest.dtype != "float32":
        report.tolerance += f"; torch in fp32, each limit widened by its own {manifest.dtype} error"
    return report


class _Counter:
    """Reports the validation's forwards (stage "validation"), with a line as each runner finishes."""

    def __init__(self, progress: Progress, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def wrap(self, runner: CaseRunner) -> CaseRunner:
        return _Counted(runner, self)

    def count(self, runner: str) -> None:
        self.done += 1
        if self.done in (self.total // 2, self.total):
            line(self.progress, f"validation: {runner} ran {self.total // 2} forwards", "validation", self.done,
                 self.total, "forward")
        else:
            tick(self.progress, "validation", self.done, self.total, "forward")


class _Counted(CaseRunner):
    def __init__(self, runner: CaseRunner, counter: _Counter):
        self.runner, self.counter, self.name = runner, counter, runner.name

    def __call__(self, graph: GraphName, feed: Feed) -> Outputs:
        outputs = self.runner(graph, feed)
        self.counter.count(self.name)
        return outputs

    def unsupported(self, graph: GraphName, feed: Feed) -> str:
        return self.runner.unsupported(graph, feed)

    def close(self) -> None:
        self.runner.close()


class TorchRunner(CaseRunner):
    """export/model.py on the export's own weight file (the bytes the graphs run on). One forward
    per feed serves both graphs, their outputs and the logits (the argmax tie rule reads them). On an fp16 export
    that forward computes in fp32 (exact arithmetic on the export's values: the reference) and again in fp16, whose
    outputs (`ROUNDED` + name) measure the rounding fp16 arithmetic costs on this model and input: the comparator's
    margin for it (export/compare.py)."""

    name = "torch"

    def __init__(self, manifest: ExportManifest):
        self.manifest = manifest
        self._model: Any = None  # Qwen3, loaded on the first forward
        self._done: dict[int, tuple[Feed, Outputs]] = {}  # by id(feed), until close; the feed is kept, so is its id

    def __call__(self, graph: GraphName, feed: Feed) -> Outputs:
        if id(feed) not in self._done:
            self._done[id(feed)] = (feed, self._forward(feed))
        outputs = self._done[id(feed)][1]
        names = [t.name for t in self.manifest.graphs[graph].outputs] + ["logits"]
        return {name: outputs[name] for name in names} | {ROUNDED + n: outputs[ROUNDED + n] for n in names
                                                         if ROUNDED + n in outputs}

    def _forward(self, feed: Feed) -> Outputs:
        import torch

        from refusion.export.model import Qwen3

        m = self.manifest
        if self._model is None:
            self._model = Qwen3.from_export(m.dims, map_weights(m), m.dtype, m.candidates)
        t = torch.from_numpy
        past = [(t(feed[past_key_name(i)]), t(feed[past_value_name(i)])) for i in range(m.num_layers)]
        masks = t(feed[VOCAB_MASK]) if VOCAB_MASK in feed else None
        args = (t(feed["input_ids"]), t(feed["position_ids"]), t(feed["attention_mask"]), past,
                t(feed["head_positions"]), masks)

        def arrays(out: dict[str, Any], prefix: str = "") -> Outputs:
            return {prefix + name: (v.float() if v.is_floating_point() else v).numpy() for name, v in out.items()}
        if m.dtype == "float32":
            return arrays(self._model(*args))
        return arrays(self._model(*args, dtype=torch.float32)) | arrays(self._model(*args), ROUNDED)

    def close(self) -> None:
        self._model = None
        self._done.clear()

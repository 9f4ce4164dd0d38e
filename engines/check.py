"""`refusion-export check ENGINES_DIR`: the TensorRT engines against onnxruntime on the same inputs.

Both backends replay the loop's kinds of forward on a short random request (prefill + plan,
plan, verify, slot rows over a shared prefix, one AR step), each over the KV its own prefill
wrote, so the check also covers the engines' KV layout and the runner's bindings. The float
outputs (probabilities and present KV) go through Polygraphy's comparator; argmax ids are
compared as an agreement rate, because a near tie may legitimately flip between kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from refusion.runtime.core.contract import GraphName, past_key_name, past_value_name
from refusion.runtime.core.engines_manifest import EngineManifest
from refusion.runtime.core.files import sha256_file
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest

TOLERANCE = {"float32": 1e-3, "float16": 2e-2}  # abs and rel, per element
MIN_ARGMAX_AGREEMENT = 0.98
Report = Callable[[str], None]


@dataclass(frozen=True)
class Case:
    name: str
    graph: GraphName
    ids: np.ndarray  # [1, seq]
    positions: np.ndarray  # [1, seq]
    mask: np.ndarray  # [1, seq, past + seq]
    past: int
    write_at: int | None  # infiller only


@dataclass
class CheckReport:
    lines: list[str] = field(default_factory=list)
    ok: bool = True

    def fail(self, line: str) -> None:
        self.lines.append(line)
        self.ok = False


def check_engines(path: str | Path, report: Report = print) -> bool:
    """Verify an engines directory against onnxruntime; True when every comparison passes."""
    from refusion.runtime.runners.tensorrt import TensorRTRunner

    engines = EngineManifest.load(path)
    if engines.precision not in TOLERANCE:
        raise RefusionError(
            f"{path} holds {engines.precision} engines; onnxruntime cannot feed {engines.precision} KV from the host, "
            "so there is nothing to compare against. Check an fp16 build of the same export instead "
            "(the engine path is the same)."
        )
    export = source_export(engines)
    runner = TensorRTRunner.from_dir(path)
    with runner:
        result = compare(runner, export, engines.limits.max_prompt, engines.limits.block_length,
                         engines.limits.slot_size, report)
    report("PASS: TensorRT engines match onnxruntime" if result.ok else "FAIL: TensorRT engines differ from onnxruntime")
    return result.ok


def source_export(engines: EngineManifest) -> ExportManifest:
    """The export the engines were built from, checked unchanged since (by sha256)."""
    export_dir = Path(engines.source["export"])
    if not (export_dir / "refusion.json").is_file():
        raise RefusionError(f"the check needs the export the engines were built from, {export_dir}, and it is gone; "
                            f"rebuild from an export you keep: {engines.rebuild_command}")
    for name, digest in engines.source["sha256"].items():
        file = export_dir / name
        if not file.is_file() or sha256_file(file) != digest:
            raise RefusionError(f"{file} changed since the engines were built from it; rebuild with: "
                                f"{engines.rebuild_command}")
    return ExportManifest.load(export_dir)


def cases(prefix: int, block: int, slot: int, mask_id: int, vocab: int, seed: int = 0) -> list[Case]:
    """The loop's forward kinds at small sizes inside the limits (prefix <= max_prompt, block, slot)."""
    rng = np.random.default_rng(seed)
    m = min(block, 8)
    w = min(slot, block // 2)  # two slot rows of w tokens fit in one block

    def causal(past: int, seq: int) -> np.ndarray:
        mask = np.ones((1, seq, past + seq), dtype=bool)
        mask[0, :, past:] = np.tril(np.ones((seq, seq), dtype=bool))
        return mask

    def row(values: Any) -> np.ndarray:
        return np.asarray(values, dtype=np.int64).reshape(1, -1)

    prompt = rng.integers(0, vocab, prefix)
    masks = np.full(m, mask_id)
    rows_mask = causal(prefix, 2 * w)
    rows_mask[0, w:, prefix:prefix + w] = False  # the second row does not see the first
    verify = min(slot, block)
    all_cases = [
        Case("prefill+plan", "infiller", row(np.concatenate([prompt, masks])), row(np.arange(prefix + m)),
             causal(0, prefix + m), 0, 0),
        Case("plan", "planner", row(masks), row(np.arange(prefix, prefix + m)), causal(prefix, m), prefix, None),
        Case("verify", "infiller", row(rng.integers(0, vocab, verify)), row(np.arange(prefix, prefix + verify)),
             causal(prefix, verify), prefix, prefix),
        Case("ar step", "infiller", row(rng.integers(0, vocab, 1)), row([prefix]), causal(prefix, 1), prefix, prefix),
    ]
    if w:
        all_cases.append(Case("slot rows", "infiller", row(rng.integers(0, vocab, 2 * w)),
                              row(np.arange(prefix, prefix + 2 * w)), rows_mask, prefix, prefix))
    return all_cases


def compare(runner: Any, export: ExportManifest, max_prompt: int, block: int, slot: int, report: Report) -> CheckReport:
    """Run every case on `runner` (a TensorRTRunner, or anything with its run / kv_to_host) and on
    onnxruntime over `export`; report per case and in total."""
    from polygraphy.comparator import Comparator, IterationResult, RunResults
    from polygraphy.comparator.compare import SimpleCompareFunc

    prefix = min(max_prompt, 12)
    all_cases = cases(prefix, block, slot, export.mask_token_id, export.vocab_size)
    ort = _OrtReference(export)
    runner.allocate_kv(prefix + 2 * block + 1)
    trt_iters, ort_iters = [], []
    result = CheckReport()
    for case in all_cases:
        got = runner.run(case.graph, case.ids, case.positions, case.mask, case.past, case.write_at)
        want = ort.run(case)
        if case.write_at is not None:
            got.update(runner.kv_to_host(case.write_at, case.ids.shape[1]))
        if case.name == "prefill+plan":
            ort.keep_prefix(want, prefix)
        agree = float(np.mean(got["argmax_ids"] == want["argmax_ids"]))
        line = f"{case.name:13s} {case.graph:8s} seq {case.ids.shape[1]:3d} past {case.past:3d}  argmax agreement {agree:.3f}"
        if agree < MIN_ARGMAX_AGREEMENT:
            result.fail(line + f"  FAIL (< {MIN_ARGMAX_AGREEMENT})")
        else:
            result.lines.append(line)
        floats = [k for k in want if k != "argmax_ids"]
        trt_iters.append(IterationResult({k: np.asarray(got[k], np.float32) for k in floats}, runner_name="tensorrt"))
        ort_iters.append(IterationResult({k: np.asarray(want[k], np.float32) for k in floats}, runner_name="onnxruntime"))
    results = RunResults()
    results.append(("tensorrt", trt_iters))
    results.append(("onnxruntime", ort_iters))
    tol = TOLERANCE[export.dtype]
    compared = Comparator.compare_accuracy(results, compare_func=SimpleCompareFunc(atol=tol, rtol=tol))
    if not bool(compared):
        result.fail(f"float outputs: differ beyond abs/rel {tol} (Polygraphy's report above)")
    else:
        result.lines.append(f"float outputs: within abs/rel {tol} in all {len(all_cases)} cases")
    for line in result.lines:
        report(line)
    return result


class _OrtReference:
    """The export's graphs on onnxruntime with explicit past KV: the reference side."""

    def __init__(self, export: ExportManifest):
        import onnxruntime

        providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider")
                     if p in onnxruntime.get_available_providers()]
        self.export = export
        self.sessions = {g: onnxruntime.InferenceSession(str(export.graph_path(g)), providers=providers)
                         for g in ("planner", "infiller")}
        m = export
        empty = np.zeros((1, 0, m.kv_heads, m.head_dim), dtype=np.dtype(m.dtype))
        self.past = {name: empty for i in range(m.num_layers) for name in (past_key_name(i), past_value_name(i))}

    def keep_prefix(self, outputs: dict[str, np.ndarray], length: int) -> None:
        for i in range(self.export.num_layers):
            self.past[past_key_name(i)] = outputs[f"present.{i}.key"][:, :length]
            self.past[past_value_name(i)] = outputs[f"present.{i}.value"][:, :length]

    def run(self, case: Case) -> dict[str, np.ndarray]:
        session = self.sessions[case.graph]
        feed = {"input_ids": case.ids, "position_ids": case.positions, "attention_mask": case.mask}
        feed.update({k: v[:, :case.past] for k, v in self.past.items()})
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, feed)))

"""Export validation: onnxruntime (CPU) outputs against our torch definition on the same weights.

Runs both graphs on shapes unlike the export's (batch 1 and 2, past 0 and > 0, several
sequence lengths, out-of-order position ids, block-diagonal slot masks) and reports the
largest difference per output. Used after every export and by `refusion-export check`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from refusion.runtime.core.contract import GRAPH_NAMES
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.weights import map_weights

# (batch, past, seq, slot rows sharing the past)
CASES = ((1, 0, 5, 1), (2, 0, 3, 1), (1, 7, 4, 1), (2, 6, 1, 1), (1, 5, 6, 3))
TOLERANCE = {"float32": 1e-4, "float16": 2e-2}


@dataclass
class ValidationReport:
    dtype: str
    rows: list[tuple[str, str, float, float]] = field(default_factory=list)  # graph, output, diff, tol (per case)
    skipped: str = ""

    @property
    def ok(self) -> bool:
        return all(diff <= tol for *_, diff, tol in self.rows)

    def text(self) -> str:
        if self.skipped:
            return f"validation skipped: {self.skipped}"
        worst: dict[tuple[str, str], float] = {}
        for graph, output, diff, _ in self.rows:
            output = "present.*" if output.startswith("present.") else output  # one line for all layers
            worst[(graph, output)] = max(worst.get((graph, output), 0.0), diff)
        lines = [f"validation ({self.dtype}, {len(CASES)} shapes per graph, tolerance {TOLERANCE.get(self.dtype)}):"]
        for (graph, output), diff in worst.items():
            flag = "ok" if diff <= TOLERANCE[self.dtype] else "FAIL"
            lines.append(f"  {graph:8s} {output:22s} max|diff| {diff:.2e}  {flag}")
        lines.append("  result: " + ("PASS" if self.ok else "FAIL"))
        return "\n".join(lines)


def validate_export(path: str | Path, seed: int = 0, pending: bool = False) -> ValidationReport:
    import onnxruntime as ort
    import torch

    from refusion.export.model import Qwen3

    manifest = ExportManifest.load(path, pending=pending)
    report = ValidationReport(manifest.dtype)
    if manifest.dtype not in TOLERANCE:
        report.skipped = (
            f"onnxruntime's CPU provider has no {manifest.dtype} MatMul; "
            "run `refusion-export check` where onnxruntime-gpu is installed, or export with --dtype fp32 or fp16"
        )
        return report
    dims = manifest.dims
    rng = np.random.default_rng(seed)
    feeds = [_random_feed(rng, dims, manifest.num_layers, *case, np.dtype(manifest.dtype)) for case in CASES]
    # onnxruntime first, one session at a time, then torch once per case for both graphs:
    # peak memory is the larger of the two, not their sum, and torch runs half as often.
    got: dict[str, list[dict[str, np.ndarray]]] = {}
    for name in GRAPH_NAMES:
        session = ort.InferenceSession(str(manifest.graph_path(name)), providers=["CPUExecutionProvider"])
        wanted = [o.name for o in session.get_outputs()]
        got[name] = [dict(zip(wanted, session.run(wanted, feed))) for feed in feeds]
        del session
    model = Qwen3.from_export(dims, map_weights(manifest), manifest.dtype)
    for i, feed in enumerate(feeds):
        past_kv = [
            (torch.from_numpy(feed[f"past_key_values.{j}.key"]), torch.from_numpy(feed[f"past_key_values.{j}.value"]))
            for j in range(manifest.num_layers)
        ]
        ref = model(torch.from_numpy(feed["input_ids"]), torch.from_numpy(feed["position_ids"]),
                    torch.from_numpy(feed["attention_mask"]), past_kv)
        logits = ref["logits"].numpy()
        for name in GRAPH_NAMES:
            for out, value in got[name][i].items():
                diff = _diff(out, value, ref[out].float().numpy(), logits)
                report.rows.append((name, out, diff, TOLERANCE[manifest.dtype]))
    return report


def _diff(name: str, got: np.ndarray, expect: np.ndarray, logits: np.ndarray) -> float:
    if got.shape != expect.shape:
        return float("inf")
    if name == "argmax_ids":
        # Ties (top-2 logits closer than float noise) may break either way; count real mismatches only.
        top2 = np.sort(logits, axis=-1)[..., -2:]
        decided = (top2[..., 1] - top2[..., 0]) > 1e-3
        return float(np.any((got != expect) & decided))
    return float(np.max(np.abs(got.astype(np.float32) - expect))) if got.size else 0.0


def _random_feed(rng, dims, num_layers, batch, past, seq, rows, kv_dtype) -> dict[str, np.ndarray]:
    """Random tokens at shuffled positions; `rows` slot rows over a shared past, each causal."""
    total = past + seq
    ids = rng.integers(0, dims.vocab_size, (batch, seq), dtype=np.int64)
    positions = rng.permutation(total + 8)[None, :seq].repeat(batch, 0).astype(np.int64)
    row_of = np.minimum(np.arange(seq) * rows // max(seq, 1), rows - 1)
    causal = np.tril(np.ones((seq, seq), dtype=bool)) & (row_of[:, None] == row_of[None, :])
    mask = np.concatenate([np.ones((seq, past), dtype=bool), causal], axis=1)
    feed = {
        "input_ids": ids,
        "position_ids": positions,
        "attention_mask": np.broadcast_to(mask, (batch, seq, total)).copy(),  # writable: torch.from_numpy warns otherwise
    }
    for i in range(num_layers):
        for kind in ("key", "value"):
            feed[f"past_key_values.{i}.{kind}"] = rng.standard_normal(
                (batch, past, dims.kv_heads, dims.head_dim)).astype(kv_dtype)
    return feed

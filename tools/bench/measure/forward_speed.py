"""Time one infiller forward of int4 exports at each MatMulNBits accuracy level (and of the fp32 export),
interleaved, median of repeats, one thread. Writes results/quantization/forward_speed.json.

    python -m refusion.tools.bench.measure.forward_speed NAME EXPORT_DIR...   (NAME: the key in forward_speed.json)
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.decode.masks import causal_after
from refusion.runtime.runners import ort_session

PAST, SEQS, REPEATS = 48, (1, 8, 32), 60


def feed(m: ExportManifest, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    f = {"input_ids": rng.integers(0, m.vocab_size, (1, seq)), "position_ids": np.arange(PAST, PAST + seq)[None],
         "attention_mask": causal_after(PAST, seq)}
    for i in range(m.num_layers):
        for kind in ("key", "value"):
            f[f"past_key_values.{i}.{kind}"] = rng.standard_normal((1, PAST, m.kv_heads, m.head_dim)).astype(np.float32)
    return f


def main() -> None:
    sessions = {}
    name, paths = sys.argv[1], [Path(p) for p in sys.argv[2:]]
    for path in paths:
        m = ExportManifest.load(path)
        for level in ((1, 4) if m.quantization else (1,)):
            label = f"{path.name}" + (f" level {level}" if m.quantization else "")
            session = ort_session.open_session(m, "infiller", ["CPUExecutionProvider"], threads=1, accuracy_level=level)
            sessions[label] = (session, m)
    times: dict[str, dict[int, list[float]]] = {label: {s: [] for s in SEQS} for label in sessions}
    feeds = {label: {s: feed(m, s) for s in SEQS} for label, (_, m) in sessions.items()}
    for _ in range(REPEATS):
        for seq in SEQS:
            for label, (session, _) in sessions.items():
                t0 = time.perf_counter()
                session.run(None, feeds[label][seq])
                times[label][seq].append(time.perf_counter() - t0)
    result = {label: {f"seq {s}": round(statistics.median(v) * 1e3, 3) for s, v in per.items()}
              for label, per in times.items()}
    out = Path("results/quantization/forward_speed.json")  # from the checkout's root
    data = json.loads(out.read_text()) if out.exists() else {}
    data[name] = {"ms_median": result, "past": PAST, "repeats": REPEATS}
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

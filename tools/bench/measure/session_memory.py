"""Peak RSS of one onnxruntime CPU session on an export's infiller graph, loaded and run on validation's
cases, per way of opening it: with prepacking (what validation did), without (what it does now, weights
handed over unpacked), and at optimization level basic (casts left unfolded, run in every forward). Each
configuration runs in a fresh process. Writes results/quantization/session_memory.json (merged by export name);
docs/quantization.md quotes it.

    python -m refusion.tools.bench.measure.session_memory NAME=EXPORT_DIR...     (e.g. fp16=/tmp/fp16 int4-rtn=/tmp/rtn)
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {  # name -> (graph optimization level, prepacking)
    "all, prepacked": ("ORT_ENABLE_ALL", True),
    "all, unpacked": ("ORT_ENABLE_ALL", False),
    "basic, unpacked": ("ORT_ENABLE_BASIC", False),
}
OUT = Path("results/quantization/session_memory.json")  # from the checkout's root


def peak_mib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def child(export: str, config: str) -> dict:
    import onnxruntime as ort

    from refusion.export.compare import cases
    from refusion.runtime.core.export_manifest import ExportManifest
    from refusion.runtime.runners.ort_session import EXACT_ACCURACY_LEVEL, SharedWeights

    level, prepack = CONFIGS[config]
    manifest = ExportManifest.load(export)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    opts.add_session_config_entry("session.disable_prepacking", "0" if prepack else "1")
    opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(EXACT_ACCURACY_LEVEL))
    weights = None if prepack else SharedWeights(manifest)  # as export validation's OrtSessions(unpacked=True)
    for name, value in (weights.values.items() if weights else ()):
        opts.add_initializer(name, value)
    before = peak_mib()
    t0 = time.perf_counter()
    session = ort.InferenceSession(str(manifest.graph_path("infiller")), opts)
    load_s, loaded = time.perf_counter() - t0, peak_mib()
    t0 = time.perf_counter()
    for case in cases(manifest):
        if "infiller" in case.graphs:
            session.run(None, case.feed)
    return {"process_before_mib": before, "peak_after_load_mib": loaded, "peak_after_run_mib": peak_mib(),
            "load_s": round(load_s, 1), "run_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(child(sys.argv[2], sys.argv[3])))
        return
    report = json.loads(OUT.read_text()) if OUT.is_file() else {}
    for arg in sys.argv[1:]:
        name, _, export = arg.partition("=")
        rows = report.setdefault(name, {})
        for config in CONFIGS:
            done = subprocess.run([sys.executable, __file__, "--child", export, config], capture_output=True,
                                  text=True, check=True)
            rows[config] = json.loads(done.stdout.splitlines()[-1])
            print(name, config, rows[config], flush=True)
        OUT.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()

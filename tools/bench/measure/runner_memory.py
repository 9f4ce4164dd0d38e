"""Resident memory and speed of the onnxruntime CPU runner, per way of loading the weights: the runner as it is
(one session for both roles) and four ways with a session per graph. Each configuration runs in a fresh
subprocess: RSS (VmRSS, and PSS, which counts a page mapped twice once) after the imports, after loading the
sessions, and after timed generates; tokens/s of AR and ReFusion
(best of REPEATS, the machine being shared). Writes results/memory/measure.json.

    python -m refusion.tools.bench.measure.runner_memory NAME=EXPORT_DIR...     (e.g. tiny=/tmp/tiny fp32=/tmp/fp32 int4=/tmp/int4)
    python -m refusion.tools.bench.measure.runner_memory --configs runtime,"runtime low_memory" NAME=EXPORT_DIR...   (rerun those only)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

THREADS, REPEATS, GEN = 2, 2, {"gen_length": 64, "slot_size": 8}
PROMPT = list(range(5, 21))
# how the sessions get their weights: (prepacking, initializers) -- "own": onnxruntime maps weights.bin per session;
# "shared": SharedWeights' one map, handed to both (these four open a session per graph, as the runner did before
# it served both roles from one session); "runtime": OrtRunner as it is (and with low_memory=True).
CANDIDATES = {"own+prepack": (True, "own"), "own": (False, "own"), "shared+prepack": (True, "shared"),
              "shared": (False, "shared"), "runtime": None, "runtime low_memory": None}


def memory() -> dict[str, float]:
    """MiB: VmRSS, its peak VmHWM, RssAnon, RssFile, and Pss."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = round(int(value.split()[0]) / 1024, 1)
    pss = next(line for line in Path("/proc/self/smaps_rollup").read_text().splitlines() if line.startswith("Pss:"))
    return out | {"Pss": round(int(pss.split()[1]) / 1024, 1)}


def child(export: str, candidate: str) -> dict:
    import onnxruntime as ort

    from refusion.runtime.core.export_manifest import ExportManifest
    from refusion.runtime.generator import Generator
    from refusion.runtime.runners import onnxruntime as runners
    from refusion.runtime.runners import ort_session
    from refusion.runtime.tokenizer import Tokenizer

    class Candidate(runners.OrtRunner):
        def _activate(self) -> None:
            prepack, source = CANDIDATES[candidate]
            self.weights = ort_session.SharedWeights(self.manifest) if source == "shared" else None
            for graph in ("planner", "infiller"):
                opts = ort.SessionOptions()
                opts.intra_op_num_threads = THREADS
                opts.add_session_config_entry("session.disable_prepacking", "0" if prepack else "1")
                level = str(ort_session.RUNTIME_ACCURACY_LEVEL)
                opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", level)
                for name, value in (self.weights.values.items() if self.weights else ()):
                    opts.add_initializer(name, value)
                session = ort.InferenceSession(str(self.manifest.graph_path(graph)), opts)
                self.sessions[graph] = session
                self._outputs[graph] = [o.name for o in session.get_outputs() if not o.name.startswith("present.")]
            self.kv = self._kv_pool()
            self._presents = self.kv.present_names

    manifest = ExportManifest.load(Path(export))
    before = memory()
    if CANDIDATES[candidate] is None:
        runner = runners.OrtRunner(manifest, threads=THREADS, low_memory=candidate.endswith("low_memory"))
    else:
        runner = Candidate(manifest, threads=THREADS)
    t0 = time.perf_counter()
    runner.activate()
    load_s = time.perf_counter() - t0
    loaded = memory()
    g = Generator(manifest, runner, Tokenizer.from_dir(manifest.path))
    speed = {}
    for mode in ("ar", "refusion"):
        g.generate(prompt_ids=PROMPT, mode=mode, **GEN)  # warm-up
        best = 0.0
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            tokens = len(g.generate(prompt_ids=PROMPT, mode=mode, **GEN).token_ids)
            best = max(best, tokens / (time.perf_counter() - t0))
        speed[mode] = round(best, 1)
    return {"imports": before, "loaded": loaded, "after_generate": memory(), "load_s": round(load_s, 2),
            "tokens_per_s": speed, "loadavg": os.getloadavg()[0]}


def main() -> None:
    if sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3])))
        return
    out = Path("results/memory/measure.json")  # from the checkout's root
    data = json.loads(out.read_text()) if out.exists() else {}
    args = sys.argv[1:]
    configs = list(CANDIDATES)
    if args[0] == "--configs":
        configs, args = args[1].split(","), args[2:]
        if not set(configs) <= set(CANDIDATES):
            raise SystemExit(f"--configs {','.join(configs)!r}: choose among {', '.join(CANDIDATES)}")
    for arg in args:
        name, _, export = arg.partition("=")
        weights = (Path(export) / "weights.bin").stat().st_size / 2**20
        rows = data.get(name, {}).get("configs", {}) if configs != list(CANDIDATES) else {}
        for candidate in configs:
            run = subprocess.run([sys.executable, __file__, "--child", export, candidate], capture_output=True,
                                 text=True, check=True)
            row = json.loads(run.stdout.splitlines()[-1])
            grown = row["after_generate"]["VmHWM"] - row["imports"]["VmRSS"]
            row["peak_rss_over_imports"] = round(grown, 1)
            row["target"] = round(1.3 * weights + 64, 1)
            rows[candidate] = row
            print(f"{name:5} {candidate:20} peak RSS +{grown:6.1f} MiB (target {row['target']}), PSS "
                  f"{row['after_generate']['Pss'] - row['imports']['Pss']:+6.1f}, AR {row['tokens_per_s']['ar']:6.1f} "
                  f"tok/s, ReFusion {row['tokens_per_s']['refusion']:6.1f} tok/s", flush=True)
        data[name] = {"weights_bin_mib": round(weights, 1), "threads": THREADS, "generate": GEN, "configs": rows}
    out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Node counts of exports' infiller graphs, as written and after onnxruntime's optimizations, and the time of one
infiller forward of each (1, 16 and 22 tokens over a past, interleaved, median, one thread). Exports of other
format versions are read too (the feed is built from the session's own inputs), so an export made at an older
commit can be set beside a new one. Writes nodes.json and nodes.md to --out (default results/graph-nodes).

    python -m refusion.tools.bench.measure.graph_nodes [--out DIR] LABEL=EXPORT_DIR...
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from refusion.runtime.decode.masks import causal_after
from refusion.tools.bench.common import cpu_model, host_info

PAST, REPEATS = 64, 200
# (seq, heads): a 1-token step; 16 and 22 tokens with every head (a verify pass) and with one (a prefill's)
SHAPES = ((1, 1), (16, 16), (16, 1), (22, 22), (22, 1))
OUT = Path("results/graph-nodes")  # from the checkout's root


def graph_feed(session: Any, fed: int, past: int, heads: int, head_dim: int | None = None) -> dict[str, np.ndarray]:
    """Random ids over a random past, causal, built from the session's own inputs, for either graph family: ours
    (bool [1, fed, past + fed] mask, KV [1, past, kv_heads, head_dim], the heads at the last `heads` positions,
    every token allowed) or onnxruntime-genai's (int64 [1, past + fed] mask, KV [1, kv_heads, past, head_dim]: its
    head_dim is symbolic, so given)."""
    rng = np.random.default_rng(0)
    feed: dict[str, np.ndarray] = {}
    for i in session.get_inputs():
        if i.name == "input_ids":
            feed[i.name] = rng.integers(0, 100, (1, fed))
        elif i.name == "position_ids":
            feed[i.name] = np.arange(past, past + fed)[None]
        elif i.name == "attention_mask":
            feed[i.name] = causal_after(past, fed) if "bool" in i.type else np.ones((1, past + fed), np.int64)
        elif i.name == "head_positions":
            feed[i.name] = np.arange(fed - heads, fed)[None]
        elif i.name == "vocab_mask":  # every token allowed (no guide)
            feed[i.name] = np.full((1, 1, i.shape[2]), 255, np.uint8)
        elif i.shape[2] == "past_sequence_length":  # onnxruntime-genai's
            assert head_dim is not None, "onnxruntime-genai's KV axes name no head_dim: give it"
            feed[i.name] = rng.standard_normal((1, i.shape[1], past, head_dim)).astype(np.float32)
        else:  # ours
            feed[i.name] = rng.standard_normal((1, past, *i.shape[2:])).astype(np.float32)
    return feed


def _optimized_nodes(path: Path) -> Counter:
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "weights.data")
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        return Counter(n.op_type for n in onnx.load(options.optimized_model_filepath, load_external_data=False).graph.node)


def _labelled(arg: str) -> tuple[str, str]:
    label, sep, directory = arg.partition("=")
    if not (sep and label and directory):
        raise argparse.ArgumentTypeError(f"{arg!r} is not LABEL=EXPORT_DIR (e.g. new=out/refusion-onnx)")
    return label, directory


def main() -> None:
    import onnxruntime as ort

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("exports", nargs="+", metavar="LABEL=EXPORT_DIR", type=_labelled)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    out, exports = args.out, dict(args.exports)
    result: dict[str, Any] = {"host": host_info(("onnxruntime",)) | {"cpu": cpu_model()}, "past": PAST, "repeats": REPEATS, "exports": {}}
    sessions = {}
    for label, directory in exports.items():
        path = Path(directory) / "infiller.onnx"
        written = Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)
        optimized = _optimized_nodes(path)
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        sessions[label] = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        result["exports"][label] = {"dir": directory, "nodes": sum(written.values()),
                                    "nodes_optimized": sum(optimized.values()), "ops": dict(written.most_common()),
                                    "ops_optimized": dict(optimized.most_common())}
    times: dict[str, dict[str, list[float]]] = {label: {f"{s}/{h}": [] for s, h in SHAPES} for label in sessions}
    feeds = {label: {f"{s}/{h}": graph_feed(sess, s, PAST, h) for s, h in SHAPES} for label, sess in sessions.items()}
    labels = list(sessions)
    for repeat in range(REPEATS):
        for key in times[labels[0]]:
            for label in labels[::-1] if repeat % 2 else labels:  # each export first as often as the others
                t0 = time.perf_counter()
                sessions[label].run(None, feeds[label][key])
                times[label][key].append(time.perf_counter() - t0)
    for label, per in times.items():
        result["exports"][label]["forward_ms_median"] = {f"seq/heads {k}": round(statistics.median(v) * 1e3, 4)
                                                         for k, v in per.items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "nodes.json").write_text(json.dumps(result, indent=1) + "\n")
    rows = ["| export | nodes | after onnxruntime's fusions | " + " | ".join(f"ms, seq/heads {s}/{h}" for s, h in SHAPES)
            + " |", "|---|---|---|" + "---|" * len(SHAPES)]
    for label, e in result["exports"].items():
        ms = " | ".join(f"{v:.3f}" for v in e["forward_ms_median"].values())
        rows.append(f"| {label} | {e['nodes']} | {e['nodes_optimized']} | {ms} |")
    cpu = result["host"].get("cpu", "")
    md = (f"# Infiller graph nodes\n\nCPU: {cpu}; onnxruntime {result['host'].get('onnxruntime')}; one thread, past "
          f"{PAST}, median of {REPEATS} interleaved runs, the order reversed every other (every output fetched). Written by "
          "`python -m refusion.tools.bench.measure.graph_nodes`.\n\n" + "\n".join(rows) + "\n")
    (out / "nodes.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()

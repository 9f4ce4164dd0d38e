"""Where a CPU forward's time goes, on the embedded model, one onnxruntime thread: by graph node (onnxruntime's
profiler, for our standard graphs, our `--ops onnxruntime` graphs and onnxruntime-genai's graph of the same
checkpoint), by piece of our runner's Python around onnxruntime's call, and over real decodes (onnxruntime's call,
the runner's Python, the decode loop's). Writes cpu-forward.json and .md to --out (default results/cpu-forward).

    pip install -e '.[bench-genai]'
    python -m refusion.tools.bench.measure.cpu_forward --work DIR [--out results/cpu-forward] [--prompts 40]

Two forward shapes, the means ar_genai records on the embedded model's held-out prompts (results/ar-genai): an AR
step (1 token over a past of 40, one head) and a ReFusion forward (24 tokens over 30, 15 heads). Timings are
interleaved medians; the profiler's times are inflated by its own per-node cost, so its column is each op type's
share of the profiled kernel time, set beside the unprofiled time of the whole call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from refusion.runtime.decode.masks import causal_after
from refusion.tools.bench.common import cpu_flags, cpu_model, host_info, write_report
from refusion.tools.bench.measure.ar_genai import checkpoint, exports
from refusion.tools.bench.measure.graph_nodes import graph_feed

# (tokens fed, past, heads): ar_genai's recorded means for AR and ReFusion on the embedded model
SHAPES = {"ar": (1, 40, 1), "refusion": (24, 30, 15)}
GRAPHS = {"standard": "", "onnxruntime ops": "_ort"}  # our exports, by ar_genai's side suffix
REPEATS, PROFILED_RUNS = 400, 300


def interleaved(calls: dict[str, Callable[[], Any]], repeats: int = REPEATS) -> dict[str, float]:
    """Each call's median time in µs, the calls taking turns so that the machine's drift falls on all alike."""
    for call in calls.values():
        for _ in range(20):
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def session(path: Path, profile: bool = False) -> Any:
    """One thread, every optimization: how both our runner and onnxruntime-genai open their graphs."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if profile:
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "profile")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def op_profile(path: Path, feed: dict[str, np.ndarray]) -> dict[str, Any]:
    """onnxruntime's profile of PROFILED_RUNS calls: each op type's nodes and share of the kernel time."""
    s = session(path, profile=True)
    for _ in range(PROFILED_RUNS):
        s.run(None, feed)
    events = json.loads(Path(s.end_profiling()).read_text())
    kernel: dict[str, float] = defaultdict(float)
    nodes: Counter[str] = Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            kernel[e["args"]["op_name"]] += e["dur"]
            nodes[e["args"]["op_name"]] += 1
    total = sum(kernel.values())
    return {"kernels_run": sum(nodes.values()) // PROFILED_RUNS,
            "ops": {op: {"nodes": nodes[op] // PROFILED_RUNS, "share": kernel[op] / total}
                    for op in sorted(kernel, key=kernel.__getitem__, reverse=True)}}


def graphs(ours: dict[str, Path], genai: Path, head_dim: int) -> dict[str, Any]:
    """Per graph family and shape: the unprofiled time of one call (all outputs fetched) and the op profile."""
    import onnx

    paths = {**{label: ours[suffix] / "infiller.onnx" for label, suffix in GRAPHS.items()},
             "onnxruntime-genai": genai / "model.onnx"}
    out: dict[str, Any] = {label: {"nodes": len(onnx.load(str(p), load_external_data=False).graph.node)}
                           for label, p in paths.items()}
    sessions = {label: session(p) for label, p in paths.items()}
    for shape, (fed, past, heads) in SHAPES.items():
        feeds = {label: graph_feed(s, fed, past, heads, head_dim) for label, s in sessions.items()}
        times = interleaved({label: lambda s=s, f=feeds[label]: s.run(None, f) for label, s in sessions.items()})
        for label, p in paths.items():
            out[label][shape] = {"call_us": times[label], **op_profile(p, feeds[label])}
    return out


def runner_parts(gen: Any, fed: int, past: int, heads: int) -> dict[str, float]:
    """One forward through our runner against onnxruntime's call alone on the same feed, and the runner's pieces
    around it, each timed alone: the checks, the feed, the past's views, the new KV's writes, the counters."""
    from refusion.runtime.runners.rows import RowFeed

    r = gen.runner
    r.allocate_kv(past + fed + 8)
    ids, pos = np.full((1, fed), 5, np.int64), np.arange(past, past + fed)[None]
    row = RowFeed(ids, pos, causal_after(past, fed), past, past, 0, np.arange(fed - heads, fed)[None], None)
    s = r.sessions["infiller"]
    names = r._outputs["infiller"] + r._presents
    feed = r._feed(ids, pos, row.attention_mask, row.heads_at)
    feed |= dict(zip(r.kv.past_names, r.kv.pasts(0, past)))
    presents = s.run(names, feed)[len(r._outputs["infiller"]):]

    def views() -> None:
        dict(zip(r.kv.past_names, r.kv.pasts(0, past)))

    whole = interleaved({"runner": lambda: r.run_batch("infiller", [row]), "onnxruntime": lambda: s.run(names, feed)})
    pieces = interleaved({
        "checks": lambda: r._check_row("infiller", row),
        "feed": lambda: r._feed(ids, pos, row.attention_mask, row.heads_at),
        "past views": views,
        "KV writes": lambda: r._keep_present("infiller", presents, 0, past),
        "counters": lambda: r.stats.graph("infiller").add([row], 0.0),
    })
    return {"runner_us": whole["runner"], "onnxruntime_us": whole["onnxruntime"],
            "python_us": whole["runner"] - whole["onnxruntime"], **{f"{k}_us": v for k, v in pieces.items()}}


def decodes(gen: Any, feeds: list[list[int]], options: dict[str, Any]) -> dict[str, float]:
    """Real decodes of the held-out prompts with `options` (after one untimed pass): per generated token, the time
    in onnxruntime's calls, in the runner around them, in the decode loop (GenerationStats.loop_seconds) and per
    request outside the scheduler's round (submit, admission, result)."""
    for ids in feeds:
        gen.generate(prompt_ids=ids, **options)
    before, tokens, wall, loop, outside = gen.runner.stats.copy(), 0, 0.0, 0.0, 0.0
    for ids in feeds:
        t0 = time.perf_counter()
        stats = gen.generate(prompt_ids=ids, **options).stats
        outside += time.perf_counter() - t0 - stats.wall_seconds
        tokens, wall, loop = tokens + stats.tokens, wall + stats.wall_seconds, loop + stats.loop_seconds
    runner = gen.runner.stats.since(before)
    total = runner.total
    return {"tokens": tokens, "forwards": total.forwards, "us_per_token": (wall + outside) / tokens * 1e6,
            "onnxruntime_us": total.backend_seconds / tokens * 1e6,
            "runner_python_us": (runner.busy_seconds - total.backend_seconds) / tokens * 1e6,
            "loop_us": loop / tokens * 1e6, "outside_us": outside / tokens * 1e6}


def measure(work: Path, n: int, max_tokens: int) -> dict[str, Any]:
    from refusion.runtime.generator import Generator
    from refusion.tools.bench.measure.ar_genai import prompts

    ours, genai = exports(checkpoint("embedded", work), work / "embedded", 1)
    data: dict[str, Any] = {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "threads": 1,
                            "host": host_info(("onnxruntime", "onnxruntime_genai", "numpy")), "shapes": SHAPES,
                            "prompts": n, "runner": {}, "decodes": {}}
    for label, suffix in GRAPHS.items():
        with Generator.from_dir(ours[suffix], backend="ort-cpu", threads=1, prefix_cache_mb=0) as gen:
            head_dim = gen.manifest.head_dim
            feeds = prompts("embedded", gen, n, gen.manifest.vocab_size)
            data["runner"][label] = {shape: runner_parts(gen, *dims) for shape, dims in SHAPES.items()}
            # AR to max_tokens, as ar_genai runs it; ReFusion at the export's recorded setting
            decoders: dict[str, dict[str, Any]] = {"ar": {"mode": "ar", "max_tokens": max_tokens}, "refusion": {}}
            data["decodes"][label] = {name: decodes(gen, feeds, options) for name, options in decoders.items()}
    data["graphs"] = graphs(ours, genai, head_dim)
    return data


def markdown(d: dict[str, Any]) -> str:
    lines = ["# Where a CPU forward's time goes", "",
             f"CPU: {d['cpu']} ({', '.join(d['cpu_flags']) or 'flags unknown'}); onnxruntime "
             f"{d['host'].get('onnxruntime', '?')}, onnxruntime-genai {d['host'].get('onnxruntime_genai', '?')}; one "
             "thread, fp32, the embedded model. Written by `python -m refusion.tools.bench.measure.cpu_forward`; "
             "timings are interleaved medians (the machine is shared: compare within a table).", "",
             "## Real decodes, per generated token", "",
             f"{d['prompts']} held-out prompts, greedy. onnxruntime: inside its calls; runner: the runner's Python around "
             "them (checks, feeds, KV writes, KV moves); loop: the decode loop between forwards (policy, masks, "
             "commits, the scheduler); outside: per request, beyond the scheduler's rounds.", "",
             "| graphs | mode | tokens | forwards | µs / token | onnxruntime | runner | loop | outside |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, modes in d["decodes"].items():
        for mode, r in modes.items():
            lines.append(f"| {label} | {mode} | {r['tokens']} | {r['forwards']} | {r['us_per_token']:.0f} | "
                         f"{r['onnxruntime_us']:.0f} | {r['runner_python_us']:.0f} | {r['loop_us']:.0f} | "
                         f"{r['outside_us']:.0f} |")
    lines += ["", "## One forward through the runner", "",
              "The runner's `run_batch` against onnxruntime's call alone on the same feed; then the runner's pieces, "
              "each timed alone (µs).", "",
              "| graphs | forward (fed, past, heads) | runner | onnxruntime | Python | checks | feed | past views | "
              "KV writes | counters |", "|---|---|---|---|---|---|---|---|---|---|"]
    for label, shapes in d["runner"].items():
        for shape, r in shapes.items():
            lines.append(f"| {label} | {shape} {tuple(d['shapes'][shape])} | {r['runner_us']:.0f} | "
                         f"{r['onnxruntime_us']:.0f} | {r['python_us']:.0f} | {r['checks_us']:.1f} | "
                         f"{r['feed_us']:.1f} | {r['past views_us']:.1f} | {r['KV writes_us']:.1f} | "
                         f"{r['counters_us']:.1f} |")
    lines += ["", "## The graphs, by node", "",
              "One call (every output fetched), unprofiled, and onnxruntime's profile: the op types by share of the "
              "profiled kernel time (the profiler's own per-node cost inflates each kernel, so shares, not times).", ""]
    for shape in d["shapes"]:
        lines += [f"### {shape} forward {tuple(d['shapes'][shape])}", "",
                  "| graph | nodes written | kernels run | call µs | op types by share of kernel time |",
                  "|---|---|---|---|---|"]
        for label, g in d["graphs"].items():
            ops = ", ".join(f"{op} {o['share']:.0%} (x{o['nodes']})" for op, o in list(g[shape]["ops"].items())[:8])
            lines.append(f"| {label} | {g['nodes']} | {g[shape]['kernels_run']} | {g[shape]['call_us']:.0f} | {ops} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="where the exports are written (ar_genai's layout)")
    ap.add_argument("--out", type=Path, default=Path("results/cpu-forward"))
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--stem", default="cpu-forward", help="the reports' file name (a before/after pair: two stems)")
    args = ap.parse_args()
    data = measure(args.work, args.prompts, args.max_tokens)
    write_report(args.out, args.stem, markdown(data), data, None, print)


if __name__ == "__main__":
    main()

"""Our AR against onnxruntime-genai's AR, per generated token, on the same checkpoint: the embedded model and a
random 8-layer hidden-1024 model made at run time (seeded, nothing downloaded). Writes results/ar-genai/
(ar-genai.json and .md).

    pip install -e '.[bench-genai]'
    python -m refusion.tools.bench.measure.ar_genai --work DIR [--out results/ar-genai] [--repeats 3]

Both sides greedy, one onnxruntime thread, fp32, from a fresh request per prompt (ours: Generator.generate with
mode "ar", its scheduler thread and all; onnxruntime-genai: a Generator from its model builder's export, prompt
appended, tokens generated to the end). Ours stops at its EOS; onnxruntime-genai is given exactly as many tokens
(min_length = max_length, so its EOS is ignored), so both sides are timed over the same tokens, prefill included.
The tokens before our EOS are compared. Each prompt runs on both sides in turn, the order alternating, and the
passes over the prompts repeat: tokens/s is the median pass's. The machine is shared: read the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from refusion.tools.bench.common import cpu_model, host_info

RANDOM_SPEC = dict(num_layers=8, hidden_size=1024, num_heads=8, kv_heads=4, head_dim=128, intermediate_size=3072,
                   vocab_size=2048, rope_theta=10000.0)  # the theta onnxruntime-genai's builder reads (see below)
PROMPTS = {"embedded": 40, "random": 8}  # the random model's forwards cost ~50x the embedded one's


def checkpoint(model: str, work: Path) -> Path:
    """The embedded model, or the random one written under `work` (seed 0)."""
    from refusion.models import EMBEDDED_MODEL
    from refusion.tools.checks.fixtures.checkpoints import TinySpec, make_checkpoint

    if model == "embedded":
        return Path(EMBEDDED_MODEL)
    ckpt = work / "random-ckpt"
    return ckpt if (ckpt / "config.json").is_file() else make_checkpoint(ckpt, TinySpec(**RANDOM_SPEC))


def exports(ckpt: Path, out: Path, threads: int) -> tuple[Path, Path]:
    """(our export, onnxruntime-genai's) of `ckpt` under `out`, each made once. onnxruntime-genai's builder reads
    RoPE's theta from config.rope_theta alone (else 10000), which transformers >= 5 keeps in rope_parameters: the
    random model uses 10000, and the tokens compared say whether both graphs compute one model."""
    from refusion.export.exporter import export_onnx

    ours, genai = out / "onnx", out / "genai"
    if not (ours / "refusion.json").is_file():
        export_onnx(ckpt, ours, force=True, validate=False)
    if not (genai / "genai_config.json").is_file():
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(genai),
                        "-p", "fp32", "-e", "cpu", "-c", str(out / "genai-cache")], check=True)
    config_path = genai / "genai_config.json"
    config = json.loads(config_path.read_text())
    options = config["model"]["decoder"].setdefault("session_options", {})
    options["intra_op_num_threads"] = options["inter_op_num_threads"] = threads
    config_path.write_text(json.dumps(config, indent=1))
    return ours, genai


def prompts(model: str, gen: Any, n: int, vocab: int) -> list[list[int]]:
    """The held-out task prompts through the chat template (embedded), or random 32-token prompts (seed 0)."""
    from refusion.tools import tasks as T

    if model == "embedded":
        return [gen.prompt_ids(ex.prompt, chat=True) for ex in T.held_out(n)]
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, 32).tolist() for _ in range(n)]


def genai_run(og: Any, model: Any, ids: list[int], new: int) -> list[int]:
    """onnxruntime-genai's greedy tokens after `ids`: exactly `new` of them."""
    params = og.GeneratorParams(model)
    length = len(ids) + new
    params.set_search_options(max_length=length, min_length=length, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray([ids], dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)][len(ids):]


def graph_nodes(path: Path) -> int:
    import onnx

    return len(onnx.load(str(path), load_external_data=False).graph.node)


def measure(model: str, work: Path, n: int, max_tokens: int, repeats: int, threads: int) -> dict[str, Any]:
    import onnxruntime_genai as og

    from refusion.runtime.generator import Generator

    ckpt = checkpoint(model, work)
    ours_dir, genai_dir = exports(ckpt, work / model, threads)
    genai = og.Model(og.Config(str(genai_dir)))
    with Generator.from_dir(ours_dir, backend="ort-cpu", threads=threads, prefix_cache_mb=0) as gen:
        m = gen.manifest
        feeds = prompts(model, gen, n, m.vocab_size)

        def ours(ids: list[int]) -> list[int]:
            return list(gen.generate(prompt_ids=ids, mode="ar", max_tokens=max_tokens).token_ids)

        # untimed pass (the warm-up): each prompt's tokens on both sides, compared before our EOS
        want = [ours(ids) for ids in feeds]
        got = [genai_run(og, genai, ids, len(w)) for ids, w in zip(feeds, want)]
        before_eos = [w[:-1] if w and w[-1] == m.eos_token_id else w for w in want]
        identical = sum(g[: len(b)] == b for g, b in zip(got, before_eos))
        sides = {"ours": lambda i: ours(feeds[i]), "genai": lambda i: genai_run(og, genai, feeds[i], len(want[i]))}
        seconds: dict[str, list[float]] = {side: [] for side in sides}
        for r in range(repeats):
            spent = dict.fromkeys(sides, 0.0)
            for i in range(len(feeds)):
                order = list(sides) if (i + r) % 2 == 0 else list(sides)[::-1]
                for side in order:
                    t0 = time.perf_counter()
                    sides[side](i)
                    spent[side] += time.perf_counter() - t0
            for side in sides:
                seconds[side].append(spent[side])
            print(f"{model}: pass {r + 1}/{repeats}: " + ", ".join(f"{s} {spent[s]:.2f} s" for s in sides), flush=True)
    tokens = sum(len(w) for w in want)
    per_pass = {side: [tokens / s for s in secs] for side, secs in seconds.items()}
    ratios = [a / b for a, b in zip(per_pass["ours"], per_pass["genai"])]
    return {
        "checkpoint": str(ckpt), "layers": m.num_layers, "hidden": json.loads((ckpt / "config.json").read_text())["hidden_size"],
        "vocab": m.vocab_size,
        "prompts": len(feeds), "prompt_tokens_mean": statistics.mean(len(f) for f in feeds), "tokens": tokens,
        "max_tokens": max_tokens, "repeats": repeats,
        "tokens_per_second": {side: statistics.median(v) for side, v in per_pass.items()},
        "tokens_per_second_range": {side: [min(v), max(v)] for side, v in per_pass.items()},
        "ours_over_genai": statistics.median(ratios), "ours_over_genai_range": [min(ratios), max(ratios)],
        "identical_before_eos": identical,
        "graph_nodes": {"ours_infiller": graph_nodes(ours_dir / "infiller.onnx"),
                        "genai": graph_nodes(genai_dir / "model.onnx")},
    }


def markdown(data: dict[str, Any]) -> str:
    lines = ["# Our AR against onnxruntime-genai's AR", "",
             f"CPU: {data['cpu']} (2 cores shared with a training job and other work: the ratios, measured within "
             f"one run, are what to read); onnxruntime {data['host'].get('onnxruntime', '?')}, onnxruntime-genai "
             f"{data['host'].get('onnxruntime_genai', '?')}; {data['threads']} thread(s), fp32, greedy. Written by "
             "`python -m refusion.tools.bench.measure.ar_genai`.", "",
             "| model | prompts | tokens | ours tokens/s | onnxruntime-genai tokens/s | ours / genai (range) | "
             "identical before EOS | graph nodes ours / genai |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in data["models"].items():
        tps, lo, hi = r["tokens_per_second"], *r["ours_over_genai_range"]
        lines.append(f"| {name} ({r['layers']} layers, hidden {r['hidden']}) | {r['prompts']} | {r['tokens']} | "
                     f"{tps['ours']:.0f} | {tps['genai']:.0f} | {r['ours_over_genai']:.2f}x ({lo:.2f}-{hi:.2f}) | "
                     f"{r['identical_before_eos']}/{r['prompts']} | {r['graph_nodes']['ours_infiller']} / "
                     f"{r['graph_nodes']['genai']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="where the checkpoints and exports are written")
    ap.add_argument("--out", type=Path, default=Path("results/ar-genai"))
    ap.add_argument("--models", default=",".join(PROMPTS))
    ap.add_argument("--prompts", type=int, help="prompts per model (default: embedded 40, random 8)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    data: dict[str, Any] = {"cpu": cpu_model(), "threads": args.threads,
                            "host": host_info(("onnxruntime", "onnxruntime_genai", "numpy")), "models": {}}
    for model in args.models.split(","):
        if model not in PROMPTS:
            raise SystemExit(f"--models: {model!r} is not one of {', '.join(PROMPTS)}")
        n = args.prompts or PROMPTS[model]
        data["models"][model] = measure(model, args.work, n, args.max_tokens, args.repeats, args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ar-genai.json").write_text(json.dumps(data, indent=1) + "\n")
    (args.out / "ar-genai.md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()

"""Our AR and ReFusion against onnxruntime-genai's AR, per generated token, on the same checkpoint: the embedded
model and a random 8-layer hidden-1024 model made at run time (seeded, nothing downloaded). Writes results/ar-genai/
(ar-genai.json, .md and .png).

    pip install -e '.[bench-genai]'
    python -m refusion.tools.bench.measure.ar_genai --work DIR [--out results/ar-genai] [--repeats 3]

Ours runs twice over: the standard graphs and those of `--ops onnxruntime` (export/ort_graph.py), the sides of the
latter suffixed "_ort". Both sides greedy, one onnxruntime thread, fp32, from a fresh request per prompt (ours: Generator.generate with
mode "ar", its scheduler thread and all; onnxruntime-genai: a Generator from its model builder's export, prompt
appended, tokens generated to the end). Ours stops at its EOS; onnxruntime-genai is given exactly as many tokens
(min_length = max_length, so its EOS is ignored), so both sides are timed over the same tokens, prefill included.
The tokens before our EOS are compared.

ReFusion (the export's recorded setting) decodes the embedded model's prompts once with the runner recording every
forward's and KV move's shape (tools/bench/replay.py); our AR's decodes are recorded the same way. On the embedded
model ReFusion runs for real; on both models each recording is also replayed on the runner alone (same forwards,
fed tokens, past and heads; the recording's committed tokens), so at the random model, which cannot decode
meaningfully, ReFusion is the replay, set beside the replay of our AR on the same prompts. Each prompt runs on
every side in turn, the order rotating, and the passes over the prompts repeat: tokens/s is the median pass's,
ratios are per pass (median and range). The machine is shared: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from refusion.tools.bench.common import cpu_flags, cpu_model, host_info
from refusion.tools.bench.replay import Recording, prepare, recorded, replay

RANDOM_SPEC = dict(num_layers=8, hidden_size=1024, num_heads=8, kv_heads=4, head_dim=128, intermediate_size=3072,
                   vocab_size=2048, rope_theta=10000.0)  # the theta onnxruntime-genai's builder reads (see below)
PROMPTS = {"embedded": 100, "random": 8}  # issue 42 measures 100; the random model's forwards cost ~50x the embedded one's
DECODERS = ("ar", "refusion")  # the decodes recorded on the embedded model, replayed on every model
OURS = {"": "onnx", "_ort": "onnx-ort"}  # side suffix -> export directory: standard ops, then --ops onnxruntime
OPS_LABEL = {"": "standard", "_ort": "onnxruntime ops"}
# reported ratios: (numerator side, denominator side), per pass; each of our exports' sides alike, then across them
RATIOS = tuple((a + x, b if b == "genai" else b + x) for x in OURS for a, b in (
    ("ours", "genai"), ("refusion", "genai"), ("refusion", "ours"), ("refusion_replay", "ar_replay"),
    ("refusion_replay", "genai"), ("refusion_replay", "ours"), ("ar_replay", "ours"), ("ar_replay", "genai"),
)) + (("ours_ort", "ours"), ("refusion_ort", "refusion"))


def checkpoint(model: str, work: Path) -> Path:
    """The embedded model, or the random one written under `work` (seed 0)."""
    from refusion.models import EMBEDDED_MODEL
    from refusion.tools.checks.fixtures.checkpoints import TinySpec, make_checkpoint

    if model == "embedded":
        return Path(EMBEDDED_MODEL)
    ckpt = work / "random-ckpt"
    return ckpt if (ckpt / "config.json").is_file() else make_checkpoint(ckpt, TinySpec(**RANDOM_SPEC))


def exports(ckpt: Path, out: Path, threads: int) -> tuple[dict[str, Path], Path]:
    """(our exports by side suffix, onnxruntime-genai's) of `ckpt` under `out`, each made once. onnxruntime-genai's
    builder reads RoPE's theta from config.rope_theta alone (else 10000), which transformers >= 5 keeps in
    rope_parameters: the random model uses 10000, and the tokens compared say whether both graphs compute one
    model."""
    from refusion.export.exporter import export_onnx

    ours, genai = {suffix: out / name for suffix, name in OURS.items()}, out / "genai"
    for suffix, path in ours.items():
        if not (path / "refusion.json").is_file():
            export_onnx(ckpt, path, force=True, validate=False, ops="onnxruntime" if suffix else "standard")
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


def record(work: Path, n: int, max_tokens: int, threads: int) -> dict[str, list[Recording]]:
    """Our AR's and ReFusion's decodes of the embedded model's first `n` prompts, each forward's shape recorded."""
    from refusion.runtime.generator import Generator

    ours, _ = exports(checkpoint("embedded", work), work / "embedded", threads)
    with Generator.from_dir(ours[""], backend="ort-cpu", threads=threads, prefix_cache_mb=0) as gen:
        feeds = prompts("embedded", gen, n, gen.manifest.vocab_size)
        options: dict[str, dict[str, Any]] = {"ar": {"mode": "ar", "max_tokens": max_tokens}, "refusion": {}}
        return {decoder: [recorded(gen.runner, lambda: gen.generate(prompt_ids=ids, **options[decoder]),
                                   lambda r: r.stats.tokens)[1] for ids in feeds]
                for decoder in DECODERS}


def shape_summary(recs: list[Recording]) -> dict[str, float]:
    """Forwards per generated token and the mean tokens fed, past and heads per forward."""
    rows = [r for rec in recs for f in rec.forwards for r in f.rows]
    forwards = sum(len(rec.forwards) for rec in recs)
    return {"forwards_per_token": forwards / sum(rec.tokens for rec in recs),
            "fed_per_forward": statistics.mean(r.fed for r in rows),
            "past_per_forward": statistics.mean(r.past for r in rows),
            "heads_per_forward": statistics.mean(len(r.heads) for r in rows)}


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


def measure(model: str, work: Path, n: int, max_tokens: int, repeats: int, threads: int,
            recs: dict[str, list[Recording]]) -> dict[str, Any]:
    import onnxruntime_genai as og

    from refusion.runtime.generator import Generator

    ckpt = checkpoint(model, work)
    ours_dirs, genai_dir = exports(ckpt, work / model, threads)
    genai = og.Model(og.Config(str(genai_dir)))
    with ExitStack() as stack:
        gens = {suffix: stack.enter_context(Generator.from_dir(path, backend="ort-cpu", threads=threads,
                                                               prefix_cache_mb=0))
                for suffix, path in ours_dirs.items()}
        m = gens[""].manifest
        feeds = prompts(model, gens[""], n, m.vocab_size)
        plans = {d: [prepare(rec, m.vocab_size, seed=i) for i, rec in enumerate(recs[d][:n])] for d in DECODERS}

        def ours(gen: Any, ids: list[int]) -> list[int]:
            return list(gen.generate(prompt_ids=ids, mode="ar", max_tokens=max_tokens).token_ids)

        # untimed pass (the warm-up): each prompt's tokens on every side, compared before our EOS
        want = [ours(gens[""], ids) for ids in feeds]
        got = [genai_run(og, genai, ids, len(w)) for ids, w in zip(feeds, want)]
        before_eos = [w[:-1] if w and w[-1] == m.eos_token_id else w for w in want]
        identical = sum(g[: len(b)] == b for g, b in zip(got, before_eos))
        identical_ort = sum(ours(gens["_ort"], ids) == w for ids, w in zip(feeds, want))
        sides: dict[str, Callable[[int], Any]] = {
            "genai": lambda i: genai_run(og, genai, feeds[i], len(want[i]))}
        tokens = {"genai": sum(len(w) for w in want)}
        reproduced = {}
        for suffix, gen in gens.items():
            sides["ours" + suffix] = lambda i, gen=gen: ours(gen, feeds[i])
            sides["ar_replay" + suffix] = lambda i, gen=gen: replay(gen.runner, plans["ar"][i])
            sides["refusion_replay" + suffix] = lambda i, gen=gen: replay(gen.runner, plans["refusion"][i])
            tokens |= {"ours" + suffix: tokens["genai"],
                       **{f"{d}_replay{suffix}": sum(p.tokens for p in plans[d]) for d in DECODERS}}
            if model == "embedded":  # the recorded decodes, for real: their tokens are the recording's
                sides["refusion" + suffix] = lambda i, gen=gen: gen.generate(prompt_ids=feeds[i]).stats.tokens
                tokens["refusion" + suffix] = tokens["refusion_replay"]
                reproduced[suffix] = sum(sides["refusion" + suffix](i) == p.tokens
                                         for i, p in enumerate(plans["refusion"]))
            for side in ("ar_replay" + suffix, "refusion_replay" + suffix):
                for i in range(len(feeds)):
                    sides[side](i)  # the replays' warm-up
        seconds: dict[str, list[float]] = {side: [] for side in sides}
        for r in range(repeats):
            spent = dict.fromkeys(sides, 0.0)
            for i in range(len(feeds)):
                turn = (i + r) % len(sides)
                for side in list(sides)[turn:] + list(sides)[:turn]:
                    t0 = time.perf_counter()
                    sides[side](i)
                    spent[side] += time.perf_counter() - t0
            for side in sides:
                seconds[side].append(spent[side])
            print(f"{model}: pass {r + 1}/{repeats}: " + ", ".join(f"{s} {spent[s]:.2f} s" for s in sides), flush=True)
    per_pass = {side: [tokens[side] / s for s in secs] for side, secs in seconds.items()}
    ratios = {f"{a}/{b}": [x / y for x, y in zip(per_pass[a], per_pass[b])]
              for a, b in RATIOS if a in per_pass and b in per_pass}
    return {
        "checkpoint": str(ckpt), "layers": m.num_layers, "hidden": json.loads((ckpt / "config.json").read_text())["hidden_size"],
        "vocab": m.vocab_size,
        "prompts": len(feeds), "prompt_tokens_mean": statistics.mean(len(f) for f in feeds), "tokens": tokens,
        "max_tokens": max_tokens, "repeats": repeats,
        "tokens_per_second": {side: statistics.median(v) for side, v in per_pass.items()},
        "tokens_per_second_range": {side: [min(v), max(v)] for side, v in per_pass.items()},
        "ratios": {k: statistics.median(v) for k, v in ratios.items()},
        "ratios_range": {k: [min(v), max(v)] for k, v in ratios.items()},
        "identical_before_eos": identical, "ort_ops_identical": identical_ort,
        "refusion_reproduces_recording": reproduced.get("") if reproduced else None,
        "refusion_ort_reproduces_recording": reproduced.get("_ort") if reproduced else None,
        "graph_nodes": {"ours_infiller": graph_nodes(ours_dirs[""] / "infiller.onnx"),
                        "ours_ort_infiller": graph_nodes(ours_dirs["_ort"] / "infiller.onnx"),
                        "genai": graph_nodes(genai_dir / "model.onnx")},
    }


def ratio(r: dict[str, Any], key: str) -> str:
    if key not in r["ratios"]:
        return "-"
    lo, hi = r["ratios_range"][key]
    return f"{r['ratios'][key]:.2f}x ({lo:.2f}-{hi:.2f})"


def markdown(data: dict[str, Any]) -> str:
    lines = ["# Our AR and ReFusion against onnxruntime-genai's AR", "",
             f"CPU: {data['cpu']} ({', '.join(data.get('cpu_flags', [])) or 'flags not recorded'}; timings move with "
             "what else runs: the ratios, measured within one run, are what to read); "
             f"onnxruntime {data['host'].get('onnxruntime', '?')}, onnxruntime-genai "
             f"{data['host'].get('onnxruntime_genai', '?')}; {data['threads']} thread(s), fp32, greedy. Written by "
             "`python -m refusion.tools.bench.measure.ar_genai`.", "",
             "## AR", "",
             "| model | prompts | tokens | ours tokens/s | ours, onnxruntime ops tokens/s | onnxruntime-genai tokens/s | "
             "ours / genai (range) | onnxruntime ops / genai (range) | identical before EOS | onnxruntime ops' tokens "
             "as ours | graph nodes ours / onnxruntime ops / genai |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in data["models"].items():
        tps, tokens, nodes = r["tokens_per_second"], r["tokens"], r["graph_nodes"]
        lines.append(f"| {name} ({r['layers']} layers, hidden {r['hidden']}) | {r['prompts']} | {tokens['ours']} | "
                     f"{tps['ours']:.1f} | {tps['ours_ort']:.1f} | {tps['genai']:.1f} | {ratio(r, 'ours/genai')} | "
                     f"{ratio(r, 'ours_ort/genai')} | {r['identical_before_eos']}/{r['prompts']} | "
                     f"{r['ort_ops_identical']}/{r['prompts']} | {nodes['ours_infiller']} / {nodes['ours_ort_infiller']} "
                     f"/ {nodes['genai']} |")
    lines += ["", "## ReFusion, real and replayed", "",
              "ReFusion at the export's recorded setting decodes the embedded model's prompts; every forward's shape is "
              "recorded and replayed on each model's exports (the runner alone: no decode loop, no scheduler), beside "
              "the replay of our AR's decodes of the same prompts. Replayed tokens are the recording's.", "",
              "| model | graphs | prompts | ReFusion tokens | ReFusion tokens/s | replayed ReFusion tokens/s | "
              "replayed AR tokens/s | ReFusion / genai AR | replayed ReFusion / replayed AR | "
              "replayed ReFusion / genai AR | replayed ReFusion / our AR | replayed AR / our AR |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in data["models"].items():
        tps = r["tokens_per_second"]
        for x, label in OPS_LABEL.items():
            real = f"{tps['refusion' + x]:.1f}" if "refusion" + x in tps else "- (random weights)"
            lines.append(f"| {name} | {label} | {r['prompts']} | {r['tokens']['refusion_replay' + x]} | {real} | "
                         f"{tps['refusion_replay' + x]:.1f} | {tps['ar_replay' + x]:.1f} | "
                         f"{ratio(r, f'refusion{x}/genai')} | {ratio(r, f'refusion_replay{x}/ar_replay{x}')} | "
                         f"{ratio(r, f'refusion_replay{x}/genai')} | {ratio(r, f'refusion_replay{x}/ours{x}')} | "
                         f"{ratio(r, f'ar_replay{x}/ours{x}')} |")
    embedded = data["models"].get("embedded", {})
    if embedded.get("refusion_reproduces_recording") is not None:
        lines += ["", f"ReFusion's timed decodes generate the recording's token counts on "
                      f"{embedded['refusion_reproduces_recording']}/{embedded['prompts']} prompts (standard graphs) and "
                      f"{embedded['refusion_ort_reproduces_recording']}/{embedded['prompts']} (onnxruntime ops)."]
    lines += ["", "Recorded shapes (embedded model, all prompts recorded):", "",
              "| decoder | prompts | tokens | forwards / token | fed tokens / forward | past / forward | heads / forward |",
              "|---|---|---|---|---|---|---|"]
    for decoder, recs in data["recordings"].items():
        s = data["recorded_shapes"][decoder]
        lines.append(f"| {decoder} | {len(recs)} | {sum(rec['tokens'] for rec in recs)} | "
                     f"{s['forwards_per_token']:.3f} | {s['fed_per_forward']:.2f} | {s['past_per_forward']:.1f} | "
                     f"{s['heads_per_forward']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(data: dict[str, Any], path: Path) -> None:
    """Each side's tokens/s over onnxruntime-genai's AR, per model, the passes' range as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = (("ours/genai", "our AR"), ("ours_ort/genai", "our AR, onnxruntime ops"), ("refusion/genai", "ReFusion"),
            ("refusion_ort/genai", "ReFusion, onnxruntime ops"), ("refusion_replay/genai", "replayed ReFusion"),
            ("refusion_replay_ort/genai", "replayed ReFusion, onnxruntime ops"))
    fig, ax = plt.subplots(figsize=(7, 4))
    models = list(data["models"])
    width = 0.8 / len(bars)
    for b, (key, label) in enumerate(bars):
        xs = [i + (b - (len(bars) - 1) / 2) * width for i, name in enumerate(models) if key in data["models"][name]["ratios"]]
        rs = [data["models"][name] for name in models if key in data["models"][name]["ratios"]]
        mid = [r["ratios"][key] for r in rs]
        err = [[m - r["ratios_range"][key][0] for m, r in zip(mid, rs)],
               [r["ratios_range"][key][1] - m for m, r in zip(mid, rs)]]
        ax.bar(xs, mid, width, yerr=err, capsize=3, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(models)), [f"{n} ({data['models'][n]['layers']}L, h{data['models'][n]['hidden']})"
                                       for n in models])
    ax.set_ylabel("tokens/s / onnxruntime-genai AR")
    ax.set_title(f"Per generated token, 1 thread, {data['cpu']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="where the checkpoints and exports are written")
    ap.add_argument("--out", type=Path, default=Path("results/ar-genai"))
    ap.add_argument("--models", default=",".join(PROMPTS))
    ap.add_argument("--prompts", type=int, help="prompts per model (default: embedded 100, random 8)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    models = args.models.split(",")
    for model in models:
        if model not in PROMPTS:
            raise SystemExit(f"--models: {model!r} is not one of {', '.join(PROMPTS)}")
    counts = {model: args.prompts or PROMPTS[model] for model in models}
    print(f"recording AR and ReFusion on the embedded model's first {max(counts.values())} prompts", flush=True)
    recs = record(args.work, max(counts.values()), args.max_tokens, args.threads)
    data: dict[str, Any] = {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "threads": args.threads,
                            "host": host_info(("onnxruntime", "onnxruntime_genai", "numpy")), "models": {},
                            "recorded_shapes": {d: shape_summary(recs[d]) for d in DECODERS},
                            "recordings": {d: [rec.to_json() for rec in recs[d]] for d in DECODERS}}
    for model in models:
        data["models"][model] = measure(model, args.work, counts[model], args.max_tokens, args.repeats, args.threads,
                                        recs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ar-genai.json").write_text(json.dumps(data, indent=1) + "\n")
    (args.out / "ar-genai.md").write_text(markdown(data))
    plot(data, args.out / "ar-genai.png")
    print(markdown(data))


if __name__ == "__main__":
    main()

"""What the prefix cache buys: time to first token with a ~200-token system prompt, and chat turn times as a
conversation grows to the model's positions, the cache on against off, on the embedded model and on a random
4-layer hidden-1024 model; with the block size swept. Writes results/prefix-cache/ (prefix-cache.json and .md).

    python -m refusion.tools.bench.measure.prefix_cache --work DIR [--out results/prefix-cache] [--repeats 7]

TTFT is from submit to the first piece of settled text (what a stream shows first; AR: its first token), also
reported to the first commit (ReFusion commits slots out of order: the prefill's effect without the decode's),
the request then cancelled; conditions, each sample interleaved with the others (the machine is shared: ratios, not times):
  none       the question alone (the chat template's user turn)
  first      a system prompt never seen before, then the question
  repeated   the system prompt of the `first` just before, with another question
  different  another new system prompt (the cache holds others)
each with the cache on and off, in both modes. Chat: the same user turns in two conversations run turn for
turn, one with the cache and one without, through Generator.fit_messages as refusion-run chat does, until some
turns past the first drop of the oldest turns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from refusion.runtime.decode.masks import causal_after
from refusion.runtime.generator import Generator
from refusion.runtime.prefix_cache import BLOCK_TOKENS, DEFAULT_MB, PrefixCache
from refusion.runtime.text import SettledText
from refusion.tools.bench.common import cpu_model, host_info

WORDS = ("robot arm gripper camera frame target object table left right move stop slow fast grasp release "
         "safety limit joint speed torque sensor report state goal plan step wait check clear path obstacle").split()
QUESTIONS = ["sort: 3 1 2", "reverse: a b c", "sort: 9 8 7 1", "count: 1 2 3", "sort: 5 4 6", "reverse: x y z"]
MODES = {"ar": dict(mode="ar", max_tokens=8),
         "refusion": dict(mode="refusion", max_tokens=8, gen_length=16, slot_size=4, serial_num_blocks=1)}
CONDITIONS = ("none", "first", "repeated", "different")
FLOOR_MODE = "ar"  # whose prompts the forward floor takes (one prefill forward, as AR's first token needs)
RANDOM_SPEC = dict(num_layers=4, hidden_size=1024, num_heads=8, kv_heads=4, head_dim=128, intermediate_size=3072,
                   vocab_size=2048)


def system_prompt(gen: Generator, rng: np.random.Generator, tokens: int = 200) -> str:
    """Words drawn from WORDS until the system message alone renders to about `tokens` tokens."""
    words: list[str] = []
    while len(gen.prompt_ids(messages=[{"role": "system", "content": " ".join(words)}])) < tokens:
        words.append(str(rng.choice(WORDS)))
    return " ".join(words)


def messages(system: str | None, question: str) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]


def ttft(gen: Generator, cache: PrefixCache | None, msgs: list[dict[str, str]],
         settings: dict[str, Any]) -> tuple[float, float, int]:
    """Seconds from submit to the first commit and to the first settled text, through `cache` (None: off), and
    the prompt tokens it gave; the request is then cancelled and waited for, so the next may use another cache."""
    assert gen.tokenizer is not None
    gen.prefix_cache = gen.scheduler.prefix_cache = cache  # no request in flight: the scheduler reads it per step
    t0 = time.perf_counter()
    request = gen.submit(messages=msgs, **settings)
    text = SettledText(len(request.prompt_ids), gen.manifest.eos_token_id, gen.tokenizer.decode)
    first_commit = 0.0
    for commit in request.events():
        first_commit = first_commit or time.perf_counter() - t0
        if text.add(commit) or text.ended:
            break
    first_text = time.perf_counter() - t0
    request.cancel()
    request.result()
    return first_commit, first_text, request.cached_tokens


def measure_ttft(export: Path, repeats: int, blocks: tuple[int, ...], threads: int) -> dict[str, Any]:
    """Median TTFT per (block size, mode, condition) on one Generator, each block size's cache swapped in for
    its samples; block size 0 is the cache off."""
    gen = Generator.from_dir(export, backend="ort-cpu", threads=threads, prefix_cache_mb=0)
    caches = {b: PrefixCache(gen.runner, DEFAULT_MB << 20, b) if b else None for b in (0, *blocks)}
    try:
        rng = np.random.default_rng(0)
        some = gen
        for mode, settings in MODES.items():  # warm-up: onnxruntime's first runs of each shape
            for cache in caches.values():
                for _ in range(2):
                    ttft(gen, cache, messages(system_prompt(some, rng), QUESTIONS[0]), settings)
        samples: dict[tuple[int, str, str], list[tuple[float, float, int]]] = {}
        prompt_tokens: dict[str, int] = {}
        for rep in range(repeats):
            for mode, settings in MODES.items():
                first, different = system_prompt(some, rng), system_prompt(some, rng)  # new to every cache
                asked = {"none": (None, QUESTIONS[rep % 6]), "first": (first, QUESTIONS[rep % 6]),
                         "repeated": (first, QUESTIONS[(rep + 1) % 6]), "different": (different, QUESTIONS[rep % 6])}
                for condition in CONDITIONS:  # in this order: `repeated` follows its `first`
                    msgs = messages(*asked[condition])
                    prompt_tokens[condition] = len(some.prompt_ids(messages=msgs))
                    for block, cache in caches.items():
                        samples.setdefault((block, mode, condition), []).append(ttft(gen, cache, msgs, settings))
        rows = []
        for (block, mode, condition), values in samples.items():
            commit, text, cached = (statistics.median(v) for v in zip(*values))
            none_commit, none_text, _ = (statistics.median(v) for v in zip(*samples[(block, mode, "none")]))
            rows.append({"block_tokens": block, "cache": bool(block), "mode": mode, "condition": condition,
                         "prompt_tokens": prompt_tokens[condition], "cached_tokens": cached,
                         "ttft_ms": round(1000 * text, 3), "vs_none": round(text / none_text, 3),
                         "first_commit_ms": round(1000 * commit, 3), "first_commit_vs_none": round(commit / none_commit, 3),
                         "samples": len(values)})
        return {"export": str(export), "repeats": repeats, "rows": rows,
                "forward_floor": forward_floor(gen, rows, repeats * 10)}
    finally:
        gen.close()


def forward_floor(gen: Generator, rows: list[dict[str, Any]], repeats: int) -> dict[str, float]:
    """What a perfect cache would leave: one infiller forward of the repeated prompt's uncached tokens over its
    cached past, against one of the question alone over none; medians, interleaved, on the Generator's runner."""
    by_key = {(r["block_tokens"], r["mode"], r["condition"]): r for r in rows}
    repeated, none = (by_key[(BLOCK_TOKENS, FLOOR_MODE, condition)] for condition in ("repeated", "none"))
    past = int(repeated["cached_tokens"])
    shapes = {"repeated": (repeated["prompt_tokens"] - past, past), "none": (none["prompt_tokens"], 0)}
    runner = gen.runner
    runner.allocate_kv(repeated["prompt_tokens"], 0)
    times: dict[str, list[float]] = {name: [] for name in shapes}
    for _ in range(repeats):
        for name, (seq, before) in shapes.items():
            ids = np.ones((1, seq), np.int64)
            t0 = time.perf_counter()
            runner.run("infiller", ids, np.arange(before, before + seq)[None], causal_after(before, seq), before, before)
            times[name].append(time.perf_counter() - t0)
    ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
    return {"repeated_seq": shapes["repeated"][0], "repeated_past": past, "none_seq": shapes["none"][0],
            "repeated_ms": round(ms["repeated"], 3), "none_ms": round(ms["none"], 3),
            "ratio": round(ms["repeated"] / ms["none"], 3)}


def measure_chat(export: Path, mode: str, max_tokens: int, extra_turns: int, threads: int) -> dict[str, Any]:
    """Two conversations turn for turn, cache on and off: each turn's wall time, prompt and cached tokens."""
    settings = dict(MODES[mode], max_tokens=max_tokens)
    gens = {"on": Generator.from_dir(export, backend="ort-cpu", threads=threads),
            "off": Generator.from_dir(export, backend="ort-cpu", threads=threads, prefix_cache_mb=0)}
    try:
        system = system_prompt(gens["on"], np.random.default_rng(1), 60)
        history = {k: [{"role": "system", "content": system}] for k in gens}
        turns: list[dict[str, Any]] = []
        dropped_at = None
        turn = 0
        while dropped_at is None or turn <= dropped_at + extra_turns:
            row: dict[str, Any] = {"turn": turn + 1}
            for key, gen in gens.items():
                history[key].append({"role": "user", "content": QUESTIONS[turn % 6] + f" {turn}"})
                history[key], dropped = gen.fit_messages(history[key], **settings)
                t0 = time.perf_counter()
                result = gen.generate(messages=history[key], **settings)
                row[f"{key}_seconds"] = round(time.perf_counter() - t0, 4)
                row[f"{key}_prompt_tokens"] = result.stats.prompt_tokens
                row[f"{key}_cached_tokens"] = result.stats.cached_prompt_tokens
                row[f"{key}_dropped"] = dropped
                history[key].append({"role": "assistant", "content": result.text})
                if dropped and dropped_at is None:
                    dropped_at = turn
            row["off_over_on"] = round(row["off_seconds"] / row["on_seconds"], 3)
            turns.append(row)
            turn += 1
        return {"export": str(export), "mode": mode, "max_tokens": max_tokens, "first_drop_turn": (dropped_at or 0) + 1,
                "max_positions": gens["on"].manifest.max_positions, "turns": turns}
    finally:
        for gen in gens.values():
            gen.close()


def markdown(data: dict[str, Any]) -> str:
    lines = [f"# Prefix cache: TTFT and chat turns ({data['cpu']}, {data['threads']} thread(s))", "",
             "TTFT: median of interleaved samples, ms; `vs none` is TTFT over the question alone's TTFT in the same "
             "configuration. Block 0: the cache off.", ""]
    for model, ttft_data in data["ttft"].items():
        lines += [f"## TTFT, {model}", "", "| mode | block | condition | prompt tokens | cached | TTFT ms | vs none | "
                  "first commit ms | vs none |", "|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(ttft_data["rows"], key=lambda r: (r["mode"], r["block_tokens"], CONDITIONS.index(r["condition"]))):
            lines.append(f"| {r['mode']} | {r['block_tokens'] or 'off'} | {r['condition']} | {r['prompt_tokens']} | "
                         f"{r['cached_tokens']:g} | {r['ttft_ms']:.2f} | {r['vs_none']:.2f} | "
                         f"{r['first_commit_ms']:.2f} | {r['first_commit_vs_none']:.2f} |")
        f = ttft_data["forward_floor"]
        lines += ["", f"The floor, one forward as the cache leaves it: {f['repeated_seq']} tokens over {f['repeated_past']} "
                  f"cached ones {f['repeated_ms']:.2f} ms, the question's {f['none_seq']} tokens alone {f['none_ms']:.2f} ms: "
                  f"{f['ratio']:.2f}x.", ""]
    for name, chat in data["chat"].items():
        lines += [f"## Chat turns, {name} ({chat['mode']}, max_tokens {chat['max_tokens']}, "
                  f"{chat['max_positions']} positions; oldest turns first dropped at turn {chat['first_drop_turn']})", "",
                  "| turn | prompt tokens | cached (on) | on s | off s | off / on |", "|---|---|---|---|---|---|"]
        for t in chat["turns"]:
            lines.append(f"| {t['turn']} | {t['on_prompt_tokens']} | {t['on_cached_tokens']} | {t['on_seconds']:.3f} | "
                         f"{t['off_seconds']:.3f} | {t['off_over_on']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="where the exports are written")
    ap.add_argument("--out", type=Path, default=Path("results/prefix-cache"))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--blocks", default="8,16,32,64", help="block sizes swept (the default is %d)" % BLOCK_TOKENS)
    ap.add_argument("--chat-extra-turns", type=int, default=6, help="turns measured past the first drop")
    ap.add_argument("--models", default="embedded,random")
    args = ap.parse_args()
    from refusion.export.exporter import export_onnx
    from refusion.models import EMBEDDED_MODEL
    from refusion.tools.checks.fixtures.checkpoints import TinySpec, make_checkpoint

    blocks = tuple(int(b) for b in args.blocks.split(","))
    exports = {}
    for model in args.models.split(","):
        out = args.work / model
        if not (out / "refusion.json").is_file():
            source = EMBEDDED_MODEL if model == "embedded" else make_checkpoint(args.work / "random-ckpt",
                                                                                 TinySpec(**RANDOM_SPEC))
            export_onnx(source, out, force=True, validate=False)
        exports[model] = out
    data: dict[str, Any] = {"cpu": cpu_model(), "threads": args.threads, "host": host_info(("onnxruntime", "numpy")),
                            "default_block_tokens": BLOCK_TOKENS, "ttft": {}, "chat": {}}
    for model, export in exports.items():
        print(f"TTFT on {model} ...", flush=True)
        data["ttft"][model] = measure_ttft(export, args.repeats, blocks, args.threads)
    for model, export in exports.items():
        for mode, max_tokens in (("ar", 32), ("refusion", 32)):
            print(f"chat on {model}, {mode} ...", flush=True)
            data["chat"][f"{model} {mode}"] = measure_chat(export, mode, max_tokens, args.chat_extra_turns, args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix-cache.json").write_text(json.dumps(data, indent=1))
    (args.out / "prefix-cache.md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()

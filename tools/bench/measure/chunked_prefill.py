"""What chunked prefill buys (issue 34): short streaming requests' time between tokens, p50 and p99, alone and while
long prompts keep arriving, the prefill whole and in chunks; and the peak memory of one long prompt's prefill,
whole and in chunks, on onnxruntime CPU. On a random mid-size model (8 layers, hidden 1024, 4096 positions), where a
2,000-token prefill takes seconds. Writes results/chunked-prefill/ (chunked-prefill.json and .md).

    python -m refusion.tools.bench.measure.chunked_prefill --work DIR [--out results/chunked-prefill]
        [--chunks 0,256] [--long 2000] [--short 4] [--tokens 24] [--threads 2]

Short requests: `--short` AR requests of `--tokens` tokens each, submitted together and streamed; the time between
tokens is the gap between two of a request's commits (AR commits one token at a time). Long prompts: one in flight
at a time, the next submitted as the last ends, each an AR request of one token (its prefill is the work), from
before the short ones start until they end. Conditions, each the same short requests: alone; with long prompts, for
each bound of `--chunks` (0: the prefill whole). Memory: a child process per bound prefills one long prompt, its
peak resident set (VmHWM) reported.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from refusion.runtime.generator import Generator
from refusion.tools.bench.common import cpu_model, host_info, percentiles, write_report
from refusion.tools.bench.measure.ar_genai import RANDOM_SPEC
from refusion.tools.cli_common import progress

OUT = Path("results/chunked-prefill")  # from the checkout's root
SPEC = {**RANDOM_SPEC, "max_positions": 4096}


def export(work: Path) -> Path:
    """The random mid-size model, exported once under `work`."""
    from refusion.export.exporter import export_onnx
    from refusion.tools.checks.fixtures.checkpoints import TinySpec, make_checkpoint

    out = work / "onnx"
    if not (out / "refusion.json").is_file():
        ckpt = work / "ckpt"
        if not (ckpt / "config.json").is_file():
            make_checkpoint(ckpt, TinySpec(**SPEC))
        export_onnx(ckpt, out, validate=False)
    return out


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab - 2, n).tolist()


def gaps(gen: Generator, short: int, tokens: int, long: int, seed: int) -> list[float]:
    """Seconds between consecutive tokens of `short` streamed AR requests of `tokens` tokens, with long prompts of
    `long` tokens arriving one after another meanwhile (none when `long` is 0)."""
    vocab = gen.manifest.vocab_size
    submitted, done = threading.Event(), threading.Event()

    def arrive() -> None:
        i = 0
        while not done.is_set():
            request = gen.submit(prompt_ids=_prompt(long, seed + 1000 + i, vocab), mode="ar", max_tokens=1)
            submitted.set()
            request.result()
            i += 1

    def stream(request: Any, out: list[float]) -> None:
        """Each commit's time as it lands (a thread a request: every stream read live)."""
        out += [time.perf_counter() for _ in request.events()]

    background = threading.Thread(target=arrive, daemon=True) if long else None
    if background is not None:
        background.start()
        submitted.wait()
    requests = [gen.submit(prompt_ids=_prompt(16, seed + i, vocab), mode="ar", max_tokens=tokens)
                for i in range(short)]
    stamps: list[list[float]] = [[] for _ in requests]
    readers = [threading.Thread(target=stream, args=(r, s)) for r, s in zip(requests, stamps)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    done.set()
    if background is not None:
        background.join()
    return [b - a for times in stamps for a, b in zip(times, times[1:])]


def peak_rss(model: Path, chunk: int, long: int, threads: int) -> float:
    """MiB a process holds at most while it prefills one `long`-token prompt with the bound `chunk` (0: whole): its
    VmHWM (ru_maxrss would count what the parent held when it forked: Linux carries it across exec)."""
    code = (f"from pathlib import Path; from refusion.runtime.generator import Generator\n"
            f"from refusion.tools.bench.measure.chunked_prefill import _prompt\n"
            f"with Generator.from_dir({str(model)!r}, backend='ort-cpu', threads={threads}, prefix_cache_mb=0, "
            f"prefill_chunk={chunk}) as g:\n"
            f"    g.generate(prompt_ids=_prompt({long}, 0, g.manifest.vocab_size), mode='ar', max_tokens=1)\n"
            f"print(next(line.split()[1] for line in Path('/proc/self/status').read_text().splitlines() "
            f"if line.startswith('VmHWM:')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(out.split()[-1]) / 1024


def measure(model: Path, chunks: list[int], long: int, short: int, tokens: int, threads: int) -> dict[str, Any]:
    rows = []
    for label, chunk, arriving in [("alone", 0, 0), *((f"long prompts, chunk {c or 'off'}", c, long) for c in chunks)]:
        with Generator.from_dir(model, backend="ort-cpu", threads=threads, prefix_cache_mb=0,
                                prefill_chunk=chunk) as gen:
            gen.generate(prompt_ids=_prompt(64, 1, gen.manifest.vocab_size), mode="ar", max_tokens=2)  # warm-up
            seconds = gaps(gen, short, tokens, arriving, seed=len(rows))
        rows.append({"condition": label, "prefill_chunk": chunk or None, "long_prompt": arriving,
                     "time_between_tokens_ms": percentiles(seconds), "samples": len(seconds)})
        print(f"{label}: {rows[-1]['time_between_tokens_ms']}", file=sys.stderr)
    memory = [{"prefill_chunk": c or None, "peak_rss_mib": peak_rss(model, c, long, threads)} for c in chunks]
    return {"cpu": cpu_model(), "host": host_info(), "model": SPEC, "long_prompt_tokens": long, "short_requests": short,
            "short_tokens": tokens, "threads": threads, "conditions": rows, "memory": memory}


def render(report: dict[str, Any]) -> str:
    spec = report["model"]
    lines = [f"Short streaming AR requests ({report['short_requests']} at once, {report['short_tokens']} tokens each) "
             f"on a random model ({spec['num_layers']} layers, hidden {spec['hidden_size']}), onnxruntime CPU, "
             f"{report['threads']} thread(s), CPU {report['cpu']}: the time between two of a request's tokens, alone "
             f"and while {report['long_prompt_tokens']}-token prompts keep arriving (one in flight at a time).", "",
             "| condition | p50 ms | p99 ms | samples |", "|---|---|---|---|"]
    for row in report["conditions"]:
        t = row["time_between_tokens_ms"]
        lines.append(f"| {row['condition']} | {t['p50']:.1f} | {t['p99']:.1f} | {row['samples']} |")
    lines += ["", f"Peak resident memory of one process prefilling one {report['long_prompt_tokens']}-token prompt:", "",
              "| prefill_chunk | peak RSS MiB |", "|---|---|"]
    lines += [f"| {m['prefill_chunk'] or 'off'} | {m['peak_rss_mib']:.0f} |" for m in report["memory"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="where the random model and its export are kept")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--chunks", default="0,256", help="bounds to compare, 0: the prefill whole")
    parser.add_argument("--long", type=int, default=2000, help="tokens of each long prompt")
    parser.add_argument("--short", type=int, default=4, help="short requests streamed at once")
    parser.add_argument("--tokens", type=int, default=24, help="tokens each short request generates")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    chunks = [int(c) for c in args.chunks.split(",")]
    report = measure(export(args.work), chunks, args.long, args.short, args.tokens, args.threads)
    markdown = render(report)
    write_report(args.out, "chunked-prefill", markdown, report, None, progress)
    print(markdown, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

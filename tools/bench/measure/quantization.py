"""Measure int4 exports of the embedded model against fp32: weights.bin size, held-out accuracy
(AR and ReFusion at the export's default settings), tokens/s, and the onnxruntime MatMulNBits
accuracy level's effect. Writes results/quantization/measure.json; docs/quantization.md quotes it.

    python -m refusion.tools.bench.measure.quantization --work /tmp/quant-measure --n 200 --threads 1

Methods are run interleaved, prompt by prompt, so machine load spreads over all of them alike.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from refusion.export.exporter import export_onnx
from refusion.export.quantize import QuantizeOptions
from refusion.models import EMBEDDED_MODEL
from refusion.runtime.generator import Generator
from refusion.runtime.runners import ort_session
from refusion.tools import tasks as T


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=64)
    args = ap.parse_args()
    exports, report = {}, {"n": args.n, "threads": args.threads, "block_size": args.block_size, "exports": {}}
    for name, quant in (("fp32", None), ("int4-rtn", "int4-rtn"), ("int4-awq", "int4-awq")):
        out = args.work / name
        t0 = time.perf_counter()
        export_onnx(EMBEDDED_MODEL, out, force=True,
                    quantize=QuantizeOptions(quant, args.block_size) if quant else None)
        report["exports"][name] = {"weights_bytes": (out / "weights.bin").stat().st_size,
                                   "export_seconds": round(time.perf_counter() - t0, 2)}
        exports[name] = out
    runs = {"fp32": (exports["fp32"], 1)}
    for name in ("int4-rtn", "int4-awq"):
        for level in (1, 4):
            runs[f"{name} level {level}"] = (exports[name], level)
    gens = {}
    for label, (path, level) in runs.items():
        ort_session.RUNTIME_ACCURACY_LEVEL = level  # read when the sessions open: at the first generation
        gen = Generator.from_dir(path, backend="ort-cpu", threads=args.threads)
        gen.generate(prompt_ids=[5, 6, 7], mode="ar", gen_length=8)
        gens[label] = gen
    examples = T.held_out(args.n)
    results: dict[str, dict[str, list]] = {label: {"ar": [], "refusion": []} for label in runs}
    for ex in examples:
        for label, gen in gens.items():
            ids = gen.prompt_ids(ex.prompt, chat=True)
            for mode in ("ar", "refusion"):
                r = gen.generate(prompt_ids=ids, mode=mode)
                results[label][mode].append((T.score(ex, r.text), r.token_ids, r.stats.tokens, r.stats.wall_seconds))
    for gen in gens.values():
        gen.close()
    table = {}
    for label, modes in results.items():
        row = {}
        for mode, samples in modes.items():
            base = results["fp32"][mode]
            row[mode] = {
                "accuracy": sum(s[0] for s in samples) / len(samples),
                "tokens_per_s": sum(s[2] for s in samples) / sum(s[3] for s in samples),
                "same_tokens_as_fp32": sum(a[1] == b[1] for a, b in zip(samples, base)) / len(samples),
            }
        table[label] = row
    for name in ("int4-rtn", "int4-awq"):
        for mode in ("ar", "refusion"):
            a, b = results[f"{name} level 1"][mode], results[f"{name} level 4"][mode]
            table[f"{name} level 4"][mode]["same_tokens_as_level_1"] = sum(x[1] == y[1] for x, y in zip(a, b)) / len(a)
    report["runs"] = table
    text = json.dumps(report, indent=1)
    Path("results/quantization/measure.json").write_text(text + "\n")  # from the checkout's root
    print(text)


if __name__ == "__main__":
    main()

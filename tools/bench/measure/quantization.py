"""Measure int4 exports of the embedded model against fp32: weights.bin size, held-out accuracy
(AR and ReFusion at the export's default settings), tokens/s, the onnxruntime MatMulNBits accuracy
level's effect, and the int4 lm_head (`--quantize-head`): the layers' linears int4 with a float head
against the same with an int4 head, and the head's own error with and without AWQ's scaling. Writes
results/quantization/measure.json and measure.md; docs/quantization.md quotes them.

    python -m refusion.tools.bench.measure.quantization --work /tmp/quant-measure --n 200 --threads 1

Accuracy level 1 computes in fp32 over the dequantized weights: the fake-quant baseline (the
weights' rounding alone). Level 4 (the runners') also quantizes activations to int8 per block.
Methods are run interleaved, prompt by prompt, so machine load spreads over all of them alike.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from refusion.export.awq import HEAD, NORM, clip, fake_quant, rewrite_head, search_clip, search_scale
from refusion.export.calibration import calibration_set
from refusion.export.checkpoint import Checkpoint
from refusion.export.exporter import export_onnx
from refusion.export.model import Qwen3
from refusion.export.quantize import QuantizeOptions
from refusion.models import EMBEDDED_MODEL
from refusion.runtime.generator import Generator
from refusion.runtime.runners import ort_session
from refusion.tools import tasks as T

OUT = Path("results/quantization")  # from the checkout's root
# export name -> (method, int4 lm_head)
EXPORTS = {"fp32": (None, False), "int4-rtn": ("int4-rtn", False), "int4-rtn + head": ("int4-rtn", True),
           "int4-awq": ("int4-awq", False), "int4-awq + head": ("int4-awq", True)}
LEVELS = (1, 4)
MODES = ("ar", "refusion")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    exports, report = {}, {"n": args.n, "threads": args.threads, "block_size": args.block_size, "exports": {}}
    for name, (method, head) in EXPORTS.items():
        out = args.work / name.replace(" + ", "-")
        t0 = time.perf_counter()
        export_onnx(EMBEDDED_MODEL, out, force=True,
                    quantize=QuantizeOptions(method, args.block_size, head=head) if method else None)
        report["exports"][name] = {"weights_bytes": (out / "weights.bin").stat().st_size,
                                   "export_seconds": round(time.perf_counter() - t0, 2)}
        exports[name] = out
    runs = {"fp32": (exports["fp32"], 1)}
    for name in EXPORTS:
        if name != "fp32":
            for level in LEVELS:
                runs[f"{name}, level {level}"] = (exports[name], level)
    gens = {}
    for label, (path, level) in runs.items():
        ort_session.RUNTIME_ACCURACY_LEVEL = level  # read when the sessions open: at the first generation
        gen = Generator.from_dir(path, backend="ort-cpu", threads=args.threads)
        gen.generate(prompt_ids=[5, 6, 7], mode="ar", gen_length=8)
        gens[label] = gen
    settings = gens["fp32"].manifest.defaults.to_json()
    examples = T.held_out(args.n)
    results: dict[str, dict[str, list]] = {label: {mode: [] for mode in MODES} for label in runs}
    prompts = []
    for i, ex in enumerate(examples):
        prompts.append(gens["fp32"].prompt_ids(ex.prompt, chat=True))
        for label, gen in gens.items():
            ids = gen.prompt_ids(ex.prompt, chat=True)
            for mode in MODES:
                r = gen.generate(prompt_ids=ids, mode=mode)
                results[label][mode].append((T.score(ex, r.text), r.token_ids, r.stats.tokens, r.stats.wall_seconds))
        if (i + 1) % 20 == 0:
            print(f"{i + 1}/{len(examples)} prompts", flush=True)
    for gen in gens.values():
        gen.close()
    # the head's error is measured where greedy AR reads it: each prompt followed by fp32's AR answer
    held_out_ids = [(ids + list(answer[1]), len(ids) - 1, len(ids) + len(answer[1]) - 1)
                    for ids, answer in zip(prompts, results["fp32"]["ar"])]
    report["settings"] = settings
    report["runs"] = _table(results)
    report["head_error"] = head_error(held_out_ids, args.block_size)
    OUT.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=1)
    (OUT / "measure.json").write_text(text + "\n")
    (OUT / "measure.md").write_text(markdown(report) + "\n")
    print(markdown(report))


def _table(results: dict[str, dict[str, list]]) -> dict[str, dict]:
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
            level1 = label.replace(", level 4", ", level 1")
            if level1 != label:
                row[mode]["same_tokens_as_level_1"] = sum(
                    x[1] == y[1] for x, y in zip(samples, results[level1][mode])) / len(samples)
        table[label] = row
    return table


def _norm_outputs(model: Qwen3, sequences: list[tuple[list[int], int, int]]) -> torch.Tensor:
    """What lm_head reads at positions [start, stop) of each (ids, start, stop) (causal, no past): [positions, hidden]."""
    captured: list[torch.Tensor] = []
    hook = model.norm.register_forward_hook(lambda _, __, out: captured.append(out[0]))
    d = model.dims
    empty = [(torch.zeros(1, 0, d.kv_heads, d.head_dim),) * 2 for _ in range(d.num_layers)]
    rows = []
    for ids, start, stop in sequences:
        s = len(ids)
        model(torch.tensor([ids]), torch.arange(s)[None], torch.ones(s, s, dtype=torch.bool).tril()[None], empty)
        rows.append(captured.pop()[start:stop])
    hook.remove()
    return torch.cat(rows).float()


def head_error(held_out: list[tuple[list[int], int, int]], block: int) -> dict[str, dict[str, float]]:
    """lm_head alone, int4: round-to-nearest; AWQ's clipping alone (what int4-awq --quantize-head writes); AWQ's
    scale alone (s searched as for the layers, 1/s folded into the final norm); scale then clipping. Both searches
    run on the calibration set's final-norm outputs at every position, as the export's.
    On the held-out prompts followed by fp32's AR answers, at the positions that predict the answer's tokens (what
    greedy AR reads): the relative squared logit error and how often the argmax stays the float head's."""
    ckpt = Checkpoint.open(EMBEDDED_MODEL)
    model = Qwen3.from_checkpoint(ckpt)
    prompts, _ = calibration_set(ckpt, None, None, lambda *_: None)
    norm, w = model.norm.weight.detach().clone(), model.lm_head.weight.detach().clone()  # HF layout [vocab, hidden]
    x, calibration = _norm_outputs(model, held_out), _norm_outputs(model, [(ids, 0, len(ids)) for ids in prompts])
    ref = x @ w.T
    wk = w.T.contiguous()  # [K, N]
    s, alpha = search_scale(calibration, [wk], block)
    t = {NORM: norm.clone(), HEAD: w.clone()}
    rewrite_head(t, calibration, block)
    scaled = wk * s[:, None]
    variants = {"rtn": x @ fake_quant(wk, block),
                "clip": x @ fake_quant(t[HEAD].T.contiguous(), block),
                "scale": (x / s) @ fake_quant(scaled, block),
                "scale_clip": (x / s) @ fake_quant(clip(scaled, search_clip(calibration / s, scaled, block), block),
                                                   block)}
    out: dict[str, dict[str, float]] = {
        name: {"relative_sq_error": float((y - ref).square().sum() / ref.square().sum()),
               "same_argmax": float((y.argmax(-1) == ref.argmax(-1)).float().mean())}
        for name, y in variants.items()}
    out["positions"] = {"held_out": len(x), "calibration": len(calibration), "alpha": alpha}
    return out


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [f"Held-out accuracy (`held_out({report['n']})`, exact match), embedded model, block size "
             f"{report['block_size']}, {report['threads']} thread(s); AR and ReFusion at the export's recorded "
             f"defaults ({', '.join(f'{k} {v}' for k, v in s.items())}). Level 1: fp32 over the dequantized weights "
             "(fake-quant); level 4: the runners' (int8 activations).", "",
             "| export | weights.bin | AR | ReFusion | same tokens as fp32 (AR / ReFusion) | same as level 1 | "
             "AR tok/s | ReFusion tok/s |", "|---|---|---|---|---|---|---|---|"]
    for label, row in report["runs"].items():
        size = report["exports"][label.split(",")[0]]["weights_bytes"]
        same = "" if label == "fp32" else " / ".join(f"{100 * row[m]['same_tokens_as_fp32']:.1f}" for m in MODES) + " %"
        lvl1 = (" / ".join(f"{100 * row[m]['same_tokens_as_level_1']:.1f}" for m in MODES) + " %"
                if "same_tokens_as_level_1" in row["ar"] else "")
        lines.append(f"| {label} | {size:,} B | {100 * row['ar']['accuracy']:.1f} % | "
                     f"{100 * row['refusion']['accuracy']:.1f} % | {same} | {lvl1} | {row['ar']['tokens_per_s']:.0f} | "
                     f"{row['refusion']['tokens_per_s']:.0f} |")
    h = report["head_error"]
    p = h["positions"]
    lines += ["", f"lm_head alone, int4 block {report['block_size']}: at the {p['held_out']} held-out positions that "
              f"predict fp32's AR answers; AWQ searched on {p['calibration']} calibration positions (alpha "
              f"{p['alpha']:.2f}):", "",
              "| head | relative squared logit error | same argmax as the float head |", "|---|---|---|"]
    labels = {"rtn": "round-to-nearest (int4-rtn --quantize-head)",
              "clip": "AWQ's clipping alone (int4-awq --quantize-head)", "scale": "AWQ's scale alone",
              "scale_clip": "AWQ's scale, then its clipping"}
    for name, label in labels.items():
        lines.append(f"| {label} | {h[name]['relative_sq_error']:.2e} | {100 * h[name]['same_argmax']:.2f} % |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

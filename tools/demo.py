"""`refusion-export demo`: the embedded model, exported, run, and shown decoding.

Exports models/refusion-tiny, builds TensorRT engines when TensorRT is there (else runs
onnxruntime), answers a few held-out task prompts with ReFusion and with AR decoding on
the same backend, and draws each ReFusion decode: every token coloured by the loop
iteration that committed it (terminal, and an HTML page beside the export).
"""

from __future__ import annotations

import colorsys
import html
import time
from dataclasses import dataclass
from pathlib import Path

import click

from refusion.models import EMBEDDED_MODEL
from refusion.runtime.generator import GenerationResult, Generator
from refusion.runtime.runners import available_backend
from refusion.tools.cli_common import progress
from refusion.tools.tasks import Example, held_out

# The fastest benchmark setting within a point of AR accuracy (docs/benchmark.md: 1.71x AR, -1.0 point).
DEMO_SETTINGS = dict(gen_length=64, slot_size=4, serial_num_blocks=4, slot_threshold=0.5, token_threshold=0.1)
DEMO_TASKS = ("sort", "reverse", "list", "add")


@dataclass
class DemoRow:
    example: Example
    refusion: GenerationResult
    ar: GenerationResult


def demo_examples() -> list[Example]:
    """The first held-out example of each demo task: fixed, never seen in training."""
    pool = held_out(40)
    return [next(e for e in pool if e.task == task) for task in DEMO_TASKS]


def run_demo(output: Path, backend: str = "auto", threads: int | None = None) -> list[DemoRow]:
    from refusion.export.exporter import export_onnx

    t0 = time.perf_counter()
    use_trt = backend == "trt" or (backend == "auto" and _tensorrt_present())
    progress(f"[1/4] exporting the embedded model {EMBEDDED_MODEL.name} -> {output / 'onnx'}")
    export = export_onnx(EMBEDDED_MODEL, output / "onnx", dtype="fp16" if use_trt else "fp32", force=True,
                         progress=lambda m: progress("      " + m))
    model_dir = export
    if use_trt:
        from refusion.engines.build import build_engines, plan_build
        from refusion.runtime.core.profiles import DecodeLimits

        progress(f"[2/4] building TensorRT engines -> {output / 'engines'}")
        limits = DecodeLimits(256, DEMO_SETTINGS["gen_length"], DEMO_SETTINGS["slot_size"],
                              DEMO_SETTINGS["serial_num_blocks"], None)
        plan = plan_build(export, output / "engines", limits)
        model_dir = build_engines(plan, force=True, report=lambda m: progress("      " + m))
        backend = "trt"
    else:
        progress("[2/4] no TensorRT here: running the ONNX graphs on onnxruntime")
        backend = available_backend(export) if backend == "auto" else backend
    progress(f"[3/4] loading {model_dir}")
    rows = []
    with Generator.from_dir(model_dir, backend=backend, threads=threads) as gen:
        progress(f"      backend {gen.runner.name}")
        examples = demo_examples()
        gen.generate(examples[0].prompt, chat=True, **DEMO_SETTINGS)  # warm-up: first-run costs are not decoding
        for i, ex in enumerate(examples, 1):
            progress(f"[4/4] prompt {i}/{len(examples)}: {ex.prompt!r}")
            rows.append(DemoRow(ex, gen.generate(ex.prompt, chat=True, **DEMO_SETTINGS),
                                gen.generate(ex.prompt, chat=True, **{**DEMO_SETTINGS, "mode": "ar"})))
        for row in rows:
            _show(row, gen)
        page = output / "decode.html"
        page.write_text(_html(rows, gen))
    _summary(rows)
    click.echo(f"\ndecode pictures: {page}    ({time.perf_counter() - t0:.1f} s in all)")
    return rows


def _tensorrt_present() -> bool:
    try:
        import tensorrt

        return hasattr(tensorrt, "__version__")
    except ImportError:
        return False


def _colour(step: int, steps: int) -> tuple[int, int, int]:
    hue = 0.66 * (1 - (step - 1) / max(steps - 1, 1))  # blue (first) -> red (last)
    r, g, b = colorsys.hsv_to_rgb(hue, 0.75, 1.0)
    return int(255 * r), int(255 * g), int(255 * b)


def _pieces(row: DemoRow, gen: Generator) -> list[tuple[str, int]]:
    """(text, commit step) per generated token before the first EOS, in position order, special tokens not shown."""
    res, tok = row.refusion, gen.tokenizer
    assert tok is not None
    eos = gen.manifest.eos_token_id
    out = []
    for token, step in zip(res.token_ids, res.steps):
        if token == eos:
            break
        out.append((tok.decode([token]), step))
    return out


def _show(row: DemoRow, gen: Generator) -> None:
    res, ex = row.refusion, row.example
    steps = len(res.commits)
    ok = "correct" if ex.answer.strip() == res.text.strip() else f"expected {ex.answer!r}"
    click.echo(f"\n{ex.prompt}")
    pieces = "".join(click.style(t.replace("\n", "\\n"), fg=_colour(s, steps), bold=True) for t, s in _pieces(row, gen))
    click.echo(f"  refusion  {pieces}   ({ok})")
    click.echo("  iterations " + "  ".join(
        click.style(f"{c.step}:{c.how[:5]} {len(c.token_ids)}", fg=_colour(c.step, steps)) for c in res.commits))
    for name, r in (("refusion", res), ("ar", row.ar)):
        s = r.stats
        click.echo(f"  {name:9s} {s.tokens:3d} tokens, {s.forward_count:3d} forwards, "
                   f"{s.tokens_per_forward:4.2f} tokens/forward, {s.tokens_per_second:7.1f} tokens/s")


def _summary(rows: list[DemoRow]) -> None:
    def total(mode: str, attr: str) -> float:
        return sum(getattr(getattr(r, mode).stats, attr) for r in rows)

    tps = {m: total(m, "tokens") / total(m, "wall_seconds") for m in ("refusion", "ar")}
    tpf = {m: total(m, "tokens") / total(m, "forward_count") for m in ("refusion", "ar")}
    correct = {m: sum(r.example.answer.strip() == getattr(r, m).text.strip() for r in rows) for m in ("refusion", "ar")}
    click.echo("\n            tokens/s  tokens/forward  correct")
    for m in ("refusion", "ar"):
        click.echo(f"  {m:9s} {tps[m]:8.1f}  {tpf[m]:14.2f}  {correct[m]}/{len(rows)}")
    click.echo(f"  ReFusion / AR: {tps['refusion'] / tps['ar']:.2f}x tokens/s, "
               f"{tpf['refusion'] / tpf['ar']:.2f}x tokens per forward")


def _html(rows: list[DemoRow], gen: Generator) -> str:
    parts = ["<!doctype html><meta charset='utf-8'><title>ReFusion decode</title>",
             "<style>body{font-family:sans-serif;background:#111;color:#ddd}"
             "code{font-size:1.3em;background:#222;padding:.3em}span{padding:0 1px}</style>",
             "<h1>ReFusion decode of the embedded model</h1>",
             "<p>Each token is coloured by the loop iteration that committed it: blue first, red last. "
             "Slots commit out of order and are reordered by position.</p>"]
    for row in rows:
        steps = len(row.refusion.commits)
        spans = "".join(
            f"<span style='color:rgb{_colour(s, steps)}' title='iteration {s}'>{html.escape(t)}</span>"
            for t, s in _pieces(row, gen))
        how = ", ".join(f"{c.step}: {c.how} ({len(c.token_ids)} tokens)" for c in row.refusion.commits)
        s, a = row.refusion.stats, row.ar.stats
        parts.append(f"<h3>{html.escape(row.example.prompt)}</h3><code>{spans}</code>"
                     f"<p>iterations: {html.escape(how)}<br>ReFusion {s.tokens_per_forward:.2f} tokens/forward, "
                     f"{s.tokens_per_second:.1f} tokens/s; AR {a.tokens_per_second:.1f} tokens/s</p>")
    return "\n".join(parts)


@click.command("demo")
@click.option("--output", "-o", type=click.Path(path_type=Path), default=Path("out/demo"), show_default=True,
              help="Where the export (and engines) and decode.html go.")
@click.option("--backend", type=click.Choice(["auto", "trt", "ort-cuda", "ort-cpu"]), default="auto", show_default=True)
@click.option("--threads", type=int, default=None, help="onnxruntime intra-op threads (default: all cores).")
def demo_command(output: Path, backend: str, threads: int | None) -> None:
    """Export the embedded ReFusion model, run it, and show how it decodes (ReFusion next to AR)."""
    run_demo(output, backend, threads)

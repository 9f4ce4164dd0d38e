"""`refusion-export demo`: the embedded model, exported, run, and shown decoding.

Exports models/refusion-tiny, builds TensorRT engines when TensorRT is there (else runs
onnxruntime), answers a few held-out task prompts, a robot command under its JSON schema and a
tool call with ReFusion and with AR decoding on the same backend (each prompt's KV read from the
prefix cache by both, so the answers' decodes are what is compared), and draws each ReFusion
decode: every token coloured by the loop iteration that committed it (terminal, and an HTML
page beside the export).
"""

from __future__ import annotations

import colorsys
import html
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from refusion.models import EMBEDDED_MODEL
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.generator import GenerationResult, Generator
from refusion.runtime.runners import available_backend
from refusion.tools import families
from refusion.tools.cli_common import progress
from refusion.tools.tasks import Example, held_out

# The export's recorded setting, the bench's fastest (docs/benchmark.md: 2.02x AR's tokens/s, 95.0% to its 98.5%).
DEMO_SETTINGS: dict[str, Any] = dict(gen_length=64, slot_size=4, serial_num_blocks=4, slot_threshold=0.5, token_threshold=0.1)
DEMO_TASKS = ("sort", "reverse", "list", "add")
# The structured rows, each a fixed held-out example (an index into families.held_out), each under its guide: a robot
# command under ROBOT_SCHEMA, and a tool call among several functions offered, tool_choice "required" (the call's
# form guided as the schema guides the robot's; which function, and its arguments, are the model's).
ROBOT_EXAMPLE = 5
TOOL_EXAMPLE = 13
TOOL_CHOICE = "required"


@dataclass(frozen=True)
class DemoCase:
    example: Example
    label: str = ""  # what the row shows besides its prompt (a base task's prompt names its task)
    request: dict[str, Any] = field(default_factory=dict)  # generate() keywords beyond messages and settings

    @property
    def title(self) -> str:
        return f"{self.label}: {self.example.prompt}" if self.label else self.example.prompt


@dataclass
class DemoRow:
    case: DemoCase
    refusion: GenerationResult
    ar: GenerationResult


def demo_cases() -> list[DemoCase]:
    """The demo's prompts, all held out (never seen in training): the first of each demo task, the robot command
    and the tool call the constants above pick."""
    pool = held_out(40)
    robot = families.held_out("robot", ROBOT_EXAMPLE + 1)[ROBOT_EXAMPLE]
    tool = families.held_out("tool", TOOL_EXAMPLE + 1)[TOOL_EXAMPLE]
    if tool.call is None:
        raise RefusionError(f"TOOL_EXAMPLE={TOOL_EXAMPLE} picks the held-out tool example {tool.prompt!r}, whose "
                            "answer is not a call; pick the index of one answered with a call.")
    offered = ", ".join(t["function"]["name"] for t in tool.tools)
    return [*(DemoCase(next(e for e in pool if e.task == task)) for task in DEMO_TASKS),
            DemoCase(robot, "robot command (json_schema ROBOT_SCHEMA)", {"json_schema": families.ROBOT_SCHEMA}),
            DemoCase(tool, f"tool call (tool_choice {TOOL_CHOICE}; tools {offered})",
                     {"tools": list(tool.tools), "tool_choice": TOOL_CHOICE})]


def run_demo(output: Path, backend: str = "auto", threads: int | None = None,
             model: Path = EMBEDDED_MODEL) -> list[DemoRow]:
    """The demo on `model`, a checkpoint trained on the demo's tasks (default: the embedded one)."""
    from refusion.export.exporter import export_onnx

    t0 = time.perf_counter()
    use_trt = backend == "trt" or (backend == "auto" and _tensorrt_present())
    if not use_trt and backend == "auto":
        backend = available_backend(output / "onnx")  # no engines there: onnxruntime's CUDA, else its CPU
    # onnxruntime's CPU runs the fused-op graphs faster, token for token the same (results/cpu-forward)
    ops = "onnxruntime" if backend == "ort-cpu" else "standard"
    progress(f"[1/4] exporting the {'embedded ' if model == EMBEDDED_MODEL else ''}model {model.name} -> "
             f"{output / 'onnx'}")
    export = export_onnx(model, output / "onnx", dtype="fp16" if use_trt else "fp32", force=True, ops=ops,
                         progress=lambda m: progress("      " + m))
    model_dir = export
    if use_trt:
        from refusion.engines.build import build_engines, plan_build
        from refusion.runtime.core.export_manifest import ExportManifest
        from refusion.runtime.core.profiles import export_limits

        progress(f"[2/4] building TensorRT engines -> {output / 'engines'}")
        manifest = ExportManifest.read(export)  # prompts up to the positions left: a tool call's functions are long
        limits = export_limits(manifest.defaults, manifest.max_positions, gen_length=DEMO_SETTINGS["gen_length"],
                               slot_size=DEMO_SETTINGS["slot_size"], serial_blocks=DEMO_SETTINGS["serial_num_blocks"])
        plan = plan_build(export, output / "engines", limits)
        model_dir = build_engines(plan, force=True, report=lambda m: progress("      " + m))
        backend = "trt"
    else:
        progress("[2/4] no TensorRT here: running the ONNX graphs on onnxruntime")
    progress(f"[3/4] loading {model_dir}")
    rows = []
    with Generator.from_dir(model_dir, backend=backend, threads=threads) as gen:
        progress(f"      backend {gen.runner.name}")
        cases = demo_cases()
        # warm-up: first-run costs are not decoding, nor is a structured prompt's guide (compiled once and cached),
        # nor a prompt's prefill, which the method run second would read from the prefix cache that the first one
        # filled: every case is decoded once in each mode first, so both timed decodes read its prompt from there
        for case in cases:
            _decode(gen, case, mode="refusion")
            _decode(gen, case, mode="ar")
        for i, case in enumerate(cases, 1):
            progress(f"[4/4] prompt {i}/{len(cases)}: {case.title!r}")
            rows.append(DemoRow(case, _decode(gen, case, mode="refusion"), _decode(gen, case, mode="ar")))
        for row in rows:
            _show(row, gen)
        page = output / "decode.html"
        page.write_text(_html(rows, gen))
    _summary(rows)
    click.echo(f"\ndecode pictures: {page}    ({time.perf_counter() - t0:.1f} s in all)")
    return rows


def _decode(gen: Generator, case: DemoCase, **settings: Any) -> GenerationResult:
    return gen.generate(messages=case.example.messages(), **case.request, **{**DEMO_SETTINGS, **settings})


def answer(result: GenerationResult) -> str:
    """The answer as the demo shows it: its text, then each call as name(arguments)."""
    calls = [f"{c['function']['name']}({c['function']['arguments']})" for c in result.tool_calls or []]
    return " ".join([result.text, *calls]).strip()


def _expected(example: Example) -> str:
    return f"{example.call[0]}({json.dumps(example.call[1])})" if example.call else example.answer


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
    res, ex = row.refusion, row.case.example
    steps = len(res.commits)
    ok = "correct" if families.correct(ex, res) else f"expected {_expected(ex)!r}"
    click.echo(f"\n{row.case.title}")
    pieces = "".join(click.style(t.replace("\n", "\\n"), fg=_colour(s, steps), bold=True) for t, s in _pieces(row, gen))
    click.echo(f"  refusion  {pieces}   ({ok})")
    if res.tool_calls:
        click.echo(f"  call      {answer(res)}")
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
    right = {m: sum(families.correct(r.case.example, getattr(r, m)) for r in rows) for m in ("refusion", "ar")}
    click.echo("\n            tokens/s  tokens/forward  correct")
    for m in ("refusion", "ar"):
        click.echo(f"  {m:9s} {tps[m]:8.1f}  {tpf[m]:14.2f}  {right[m]}/{len(rows)}")
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
        s, a, ex = row.refusion.stats, row.ar.stats, row.case.example
        ok = "correct" if families.correct(ex, row.refusion) else f"expected {_expected(ex)}"
        call = f"call: {html.escape(answer(row.refusion))}<br>" if row.refusion.tool_calls else ""
        parts.append(f"<h3>{html.escape(row.case.title)}</h3><code>{spans}</code>"
                     f"<p>{call}{html.escape(ok)}<br>iterations: {html.escape(how)}<br>ReFusion "
                     f"{s.tokens_per_forward:.2f} tokens/forward, {s.tokens_per_second:.1f} tokens/s; "
                     f"AR {a.tokens_per_second:.1f} tokens/s</p>")
    return "\n".join(parts)


@click.command("demo")
@click.option("--output", "-o", type=click.Path(path_type=Path), default=Path("out/demo"), show_default=True,
              help="Where the export (and engines) and decode.html go.")
@click.option("--backend", type=click.Choice(["auto", "trt", "ort-cuda", "ort-cpu"]), default="auto", show_default=True)
@click.option("--threads", type=int, default=None, help="onnxruntime intra-op threads (default: all cores).")
@click.option("--model", type=click.Path(exists=True, file_okay=False, path_type=Path), default=EMBEDDED_MODEL,
              help="A checkpoint trained on the demo's tasks, run instead of the embedded one.")
def demo_command(output: Path, backend: str, threads: int | None, model: Path) -> None:
    """Export the embedded ReFusion model, run it, and show how it decodes (ReFusion next to AR)."""
    run_demo(output, backend, threads, model)

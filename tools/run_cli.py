"""`refusion-run`: generate with an export (or engines), and benchmark decoding methods.

    refusion-run generate out/refusion-onnx "prompt" [--chat] [--stream] [--json] [--prompt-ids 1,2,3]
                 [--mode refusion|ar] [--gen-length N --slot-size K --serial-blocks B
                  --slot-threshold X --token-threshold Y --temperature T --seed S]
                 [--backend ...] [--threads N] [--low-memory] [--verify]

Decode settings left out take the values the export recorded for its model (refusion.json "defaults").
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import click

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.generator import GenerationResult, Generator
from refusion.runtime.params import DecodeParams
from refusion.runtime.runners import BACKENDS
from refusion.tools.bench import bench
from refusion.tools.cli_common import ErrorReportingGroup, progress

_RECORDED = "default: the export's recorded value"


@click.group(cls=ErrorReportingGroup)
def cli() -> None:
    """Run ReFusion decoding on an export (onnxruntime) or engines (TensorRT)."""


def _prompt_ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as e:
        raise RefusionError(f"--prompt-ids {text!r} is not a comma-separated list of integers, e.g. 1,2,3.") from e


@cli.command("generate")
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.argument("prompt", required=False)
@click.option("--chat", is_flag=True, help="Wrap PROMPT as a user message in the model's chat template.")
@click.option("--no-thinking", is_flag=True, help="With --chat: render the template with enable_thinking=False.")
@click.option("--prompt-ids", help="Exact prompt token ids, comma-separated (no template, no tokenizer).")
@click.option("--stream", is_flag=True, help="Print text as the settled prefix grows.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: token_ids, text, stats.")
@click.option("--mode", type=click.Choice(["refusion", "ar"]), default="refusion", show_default=True)
@click.option("--gen-length", type=int, help=f"Tokens to generate ({_RECORDED}).")
@click.option("--slot-size", type=int, help=f"Tokens per slot ({_RECORDED}).")
@click.option("--serial-blocks", type=int,
              help=f"Equal blocks the generation is cut into, decoded in turn ({_RECORDED}).")
@click.option("--slot-threshold", type=float,
              help=f"A slot is chosen when its first token's draft probability exceeds it ({_RECORDED}).")
@click.option("--token-threshold", type=float,
              help=f"A drafted token is accepted when its AR probability exceeds it ({_RECORDED}).")
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Seed of the Gumbel noise when --temperature > 0.")
@click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True,
              help="auto: trt if engines are there, else ort-cuda if available, else ort-cpu.")
@click.option("--threads", type=int, default=None, help="onnxruntime intra-op threads (default: all cores).")
@click.option("--low-memory", is_flag=True,
              help="onnxruntime only: turn off weight prepacking, about half the peak memory for ~30% slower forwards.")
@click.option("--verify", is_flag=True, help="Check every file's sha256 before loading (a full read of the export).")
def generate(model_dir: Path, prompt: str | None, chat: bool, no_thinking: bool, prompt_ids: str | None,
             stream: bool, as_json: bool, mode: str, gen_length: int | None, slot_size: int | None,
             serial_blocks: int | None, slot_threshold: float | None, token_threshold: float | None,
             temperature: float, seed: int | None, backend: str, threads: int | None, low_memory: bool,
             verify: bool) -> None:
    """Generate a continuation of PROMPT (or --prompt-ids) with the export or engines in MODEL_DIR.
    Decode settings left out take the values the export recorded for its model."""
    if stream and as_json:
        raise RefusionError("--stream and --json do not combine; choose one.")
    if chat and prompt_ids is not None:
        raise RefusionError("--chat does not combine with --prompt-ids: token ids are fed exactly as given, "
                            "without the chat template; drop --chat, or give the PROMPT text instead.")
    params = DecodeParams.with_defaults(  # validated before loading anything
        ExportManifest.read(model_dir).defaults, gen_length=gen_length, slot_size=slot_size,
        serial_num_blocks=serial_blocks, slot_threshold=slot_threshold, token_threshold=token_threshold,
        temperature=temperature, seed=seed, mode=mode)
    prompt_kwargs = dict(prompt_ids=_prompt_ids(prompt_ids), chat=chat, enable_thinking=not no_thinking)
    with Generator.from_dir(model_dir, backend=backend, threads=threads, verify=verify, low_memory=low_memory) as gen:
        progress(f"{gen.runner.name}: {gen.manifest.path} ({gen.manifest.dtype})")
        if stream:
            for piece in gen.stream(prompt, **prompt_kwargs, **asdict(params)):
                click.echo(piece, nl=False)
                sys.stdout.flush()
            click.echo()
            return
        result = gen.generate(prompt, **prompt_kwargs, **asdict(params))
    if as_json:
        click.echo(json.dumps({"token_ids": result.token_ids, "text": result.text,
                               "prompt_ids": result.prompt_ids, "stats": result.stats.to_json()}))
        return
    click.echo(result.text)
    progress(_summary(result))


def _summary(result: GenerationResult) -> str:
    s = result.stats
    return (f"{s.mode}: {s.tokens} tokens in {s.forward_count} forwards ({s.tokens_per_forward:.2f} tokens/forward, "
            f"TPF {s.tpf:.2f}), {s.tokens_per_second:.1f} tokens/s; engine {s.engine_seconds:.3f} s, "
            f"loop {s.loop_seconds:.3f} s ({100 * s.loop_share:.0f}%)")


cli.add_command(bench)


def main() -> None:
    cli(prog_name="refusion-run")


if __name__ == "__main__":
    main()

"""`refusion-run`: generate with an export (or engines), and benchmark decoding methods.

    refusion-run generate out/refusion-onnx "prompt" [--chat] [--stream] [--json] [--prompt-ids 1,2,3]
                 [--mode refusion|ar] [--gen-length N --slot-size K --serial-blocks B
                  --slot-threshold X --token-threshold Y --temperature T --seed S] [--backend ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.generator import GenerationResult, Generator
from refusion.runtime.params import DecodeParams
from refusion.runtime.runners import BACKENDS
from refusion.tools.bench import bench
from refusion.tools.cli_common import ErrorReportingGroup, progress

_DEFAULTS = DecodeParams()


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
@click.option("--gen-length", type=int, default=_DEFAULTS.gen_length, show_default=True)
@click.option("--slot-size", type=int, default=_DEFAULTS.slot_size, show_default=True)
@click.option("--serial-blocks", type=int, default=_DEFAULTS.serial_num_blocks, show_default=True)
@click.option("--slot-threshold", type=float, default=_DEFAULTS.slot_threshold, show_default=True)
@click.option("--token-threshold", type=float, default=_DEFAULTS.token_threshold, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Seed of the Gumbel noise when --temperature > 0.")
@click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True,
              help="auto: trt if engines are there, else ort-cuda if available, else ort-cpu.")
@click.option("--threads", type=int, default=None, help="onnxruntime intra-op threads (default: all cores).")
def generate(model_dir: Path, prompt: str | None, chat: bool, no_thinking: bool, prompt_ids: str | None,
             stream: bool, as_json: bool, mode: str, gen_length: int, slot_size: int, serial_blocks: int,
             slot_threshold: float, token_threshold: float, temperature: float, seed: int | None,
             backend: str, threads: int | None) -> None:
    """Generate a continuation of PROMPT (or --prompt-ids) with the export or engines in MODEL_DIR."""
    if stream and as_json:
        raise RefusionError("--stream and --json do not combine; choose one.")
    params = dict(gen_length=gen_length, slot_size=slot_size, serial_num_blocks=serial_blocks,
                  slot_threshold=slot_threshold, token_threshold=token_threshold,
                  temperature=temperature, seed=seed, mode=mode)
    DecodeParams(**params)  # validate before loading anything
    prompt_kwargs = dict(prompt_ids=_prompt_ids(prompt_ids), chat=chat, enable_thinking=not no_thinking)
    with Generator.from_dir(model_dir, backend=backend, threads=threads) as gen:
        progress(f"{gen.runner.name}: {gen.manifest.path} ({gen.manifest.dtype})")
        if stream:
            for piece in gen.stream(prompt, **prompt_kwargs, **params):
                click.echo(piece, nl=False)
                sys.stdout.flush()
            click.echo()
            return
        result = gen.generate(prompt, **prompt_kwargs, **params)
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

"""`refusion-run`: generate with an export (or engines), chat, and benchmark decoding methods.

    refusion-run generate out/refusion-onnx "prompt" [--chat] [--stream] [--json [--logprobs]] [--prompt-ids 1,2,3]
                 [--max-tokens N] [--stop TEXT ...] [--stop-token-id ID ...] [--timeout S]
                 [--mode refusion|ar] [--gen-length N --slot-size K --serial-num-blocks B
                  --slot-threshold X --token-threshold Y --temperature T --top-k K --top-p P --min-p P --seed S
                  --upstream-eos-drop]
                 [--backend ...] [--threads N] [--low-memory] [--verify]
    refusion-run chat out/refusion-onnx [the same decode and load options] [--system TEXT] [--no-stats]
    refusion-run serve out/refusion-onnx [--http-port 8000 --grpc-port 8001 --metrics-port 8002] (docs/serving.md)
    refusion-run client "prompt" [--url http://127.0.0.1:8000] [--api openai|triton] [--chat] [--stream] [--json]
                 [decode options]

Decode settings left out take the values the export recorded for its model (refusion.json "defaults").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.generator import GenerationResult, Generator
from refusion.runtime.options import RequestOptions
from refusion.runtime.params import DecodeParams
from refusion.tools.bench.concurrency import bench_concurrency
from refusion.tools.bench.decoding import bench
from refusion.tools.bench.serving import bench_serve
from refusion.tools.chat import chat
from refusion.tools.cli_common import (
    ErrorReportingGroup,
    given_settings,
    load_options,
    load_settings,
    progress,
    read_prompt,
    setting_options,
    version_option,
)
from refusion.tools.serve_command import client, serve


@click.group(cls=ErrorReportingGroup)
@version_option
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
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object: text, token_ids, prompt_ids, finish_reason, stats.")
@click.option("--logprobs", is_flag=True, help="With --json: each token's log-probability too (logprobs).")
@setting_options
@load_options
def generate(model_dir: Path, prompt: str | None, chat: bool, no_thinking: bool, prompt_ids: str | None,
             stream: bool, as_json: bool, logprobs: bool, **options: Any) -> None:
    """Generate a continuation of PROMPT (or --prompt-ids) with the export or engines in MODEL_DIR.
    Decode settings left out take the values the export recorded for its model. PROMPT - reads the prompt
    from stdin (its trailing newline dropped)."""
    if (prompt is None) == (prompt_ids is None):
        raise RefusionError("give a PROMPT (or - to read it from stdin) or --prompt-ids 1,2,3, not both.")
    if stream and as_json:
        raise RefusionError("--stream and --json do not combine; choose one.")
    if logprobs and not as_json:
        raise RefusionError("--logprobs is reported in the JSON output; add --json.")
    if chat and prompt_ids is not None:
        raise RefusionError("--chat does not combine with --prompt-ids: token ids are fed exactly as given, "
                            "without the chat template; drop --chat, or give the PROMPT text instead.")
    given = given_settings(options)
    asked = {name: given.pop(name) for name in RequestOptions.names() if name in given} | {"logprobs": logprobs}
    DecodeParams.with_defaults(ExportManifest.read(model_dir).defaults, **given)  # checked before loading anything
    RequestOptions(**asked)  # the stop options too are checked before loading
    prompt_kwargs = dict(prompt_ids=_prompt_ids(prompt_ids), chat=chat, enable_thinking=not no_thinking)
    prompt = read_prompt(prompt)
    with Generator.from_dir(model_dir, **load_settings(options)) as gen:
        progress(f"{gen.runner.name}: {gen.manifest.path} ({gen.manifest.precision})")
        if stream:
            for piece in gen.stream(prompt, **prompt_kwargs, **given, **asked):  # left out: the export's
                click.echo(piece, nl=False)
                sys.stdout.flush()
            click.echo()
            return
        result = gen.generate(prompt, **prompt_kwargs, **given, **asked)
    if as_json:
        extra = {"logprobs": result.logprobs} if logprobs else {}
        click.echo(json.dumps({"text": result.text, "token_ids": result.token_ids, "prompt_ids": result.prompt_ids,
                               "finish_reason": result.finish_reason, **extra, "stats": result.stats.to_json()}))
        return
    click.echo(result.text)
    progress(_summary(result))


def _summary(result: GenerationResult) -> str:
    s = result.stats
    return (f"{s.mode}: {s.tokens} tokens in {s.forward_count} forwards ({s.tokens_per_forward:.2f} tokens/forward, "
            f"TPF {s.tpf:.2f}), {s.tokens_per_second:.1f} tokens/s; runner {s.runner_seconds:.3f} s, "
            f"loop {s.loop_seconds:.3f} s ({100 * s.loop_share:.0f}%)")


cli.add_command(chat)
cli.add_command(bench)
cli.add_command(bench_concurrency)
cli.add_command(serve)
cli.add_command(client)
cli.add_command(bench_serve)


def main() -> None:
    cli(prog_name="refusion-run")


if __name__ == "__main__":
    main()

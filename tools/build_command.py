"""`refusion-export build`: ONNX export -> TensorRT engines; and the engines half of `refusion-export check`.

Progress goes to stderr, results to stdout, as in tools/export_cli.py (whose group turns a
RefusionError into one `error:` line and exit code 1).
"""

from __future__ import annotations

from pathlib import Path

import click

from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.core.profiles import DEFAULT_PREFILL_CHUNK, export_limits
from refusion.tools.cli_common import progress


@click.command("build")
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--output", "-o", required=True, type=click.Path(path_type=Path), help="Engines directory to create.")
@click.option("--precision", type=click.Choice(["fp16", "bf16", "fp32"]), default=None,
              help="Engine precision; the export's dtype (the default), which decides what stays fp32.")
@click.option("--max-prompt", type=int, default=None,
              help="Longest prompt, in tokens [default: what fits beside --gen-length in the model's positions, "
                   "at most 2048].")
@click.option("--gen-length", type=int, default=None,
              help="Longest generation, in tokens [default: the export's recorded gen_length].")
@click.option("--slot-size", type=int, default=None,
              help="Typical slot size (sets opt shapes) [default: the export's recorded slot_size].")
@click.option("--serial-num-blocks", "--serial-blocks", "serial_blocks", type=int, default=None,
              help="Typical serial blocks [default: the export's recorded serial_num_blocks].")
@click.option("--max-slots", type=int, default=None,
              help="Slots per block the engines take [default: gen-length / serial-num-blocks / slot-size]; "
                   "raise it to serve fewer, longer blocks.")
@click.option("--max-batch", type=int, default=1, show_default=True,
              help="Requests whose decode forwards run as one batch; the runner then holds this many at once "
                   "(prefills stay one at a time).")
@click.option("--prefill-chunk", type=int, default=None,
              help="The most tokens one forward feeds: prompts are prefilled in chunks of it, so the prefill profile "
                   "spans 1..N tokens over a past instead of the whole prompt (less activation memory, kernels tuned "
                   "for the shapes run); at least a block; 0: no bound, the whole prompt in one forward. "
                   f"[default: {DEFAULT_PREFILL_CHUNK}, or the block where that is longer]")
@click.option("--timing-cache", type=click.Path(path_type=Path), default=None,
              help="Tactic timing cache to load and update (rebuilds of the same model get much faster).")
@click.option("--strongly-typed/--weakly-typed", default=True, show_default=True,
              help="Strongly typed: the engine keeps every type of the export exactly (its casts already fix what "
                   "stays fp32). Weakly typed: TensorRT's FP16/BF16 flags, with the fp32 islands pinned by "
                   "precision constraints; deprecated in TensorRT 10.12 and refused by 11.")
@click.option("--workspace", type=float, default=None, help="Builder workspace limit in GiB [default: TensorRT's].")
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
def build_command(export_dir: Path, output: Path, precision: str | None, max_prompt: int | None,
                  gen_length: int | None, slot_size: int | None, serial_blocks: int | None, max_slots: int | None,
                  max_batch: int, prefill_chunk: int | None, timing_cache: Path | None, strongly_typed: bool,
                  workspace: float | None, force: bool) -> None:
    """Build the TensorRT engine for EXPORT_DIR (a `refusion-export onnx` directory): one engine, holding the
    weights once, runs both planner and infiller forwards. Limits left out are the export's recorded decode
    settings (refusion.json `defaults`) and the longest prompt that fits beside them."""
    from refusion.engines.build import build_engines, plan_build

    export = ExportManifest.read(export_dir)
    limits = export_limits(export.defaults, export.max_positions, max_prompt=max_prompt, gen_length=gen_length,
                           slot_size=slot_size, serial_blocks=serial_blocks, max_slots=max_slots, max_batch=max_batch,
                           prefill_chunk=prefill_chunk)
    plan = plan_build(export_dir, output, limits, precision=precision, strongly_typed=strongly_typed,
                      workspace_gib=workspace, timing_cache=timing_cache)
    chunk = limits.prefill_chunk
    progress(f"an engine for prompts <= {limits.max_prompt}, gen_length <= {limits.gen_length}, blocks <= "
              f"{limits.block_length} tokens, {limits.max_batch} request(s) per batch, "
              f"{'whole prefills' if chunk is None else f'forwards of <= {chunk} tokens'}; KV capacity "
              f"{limits.kv_capacity} tokens per request (limits not given: the export's recorded decode settings "
              f"and the longest prompt beside them in its {export.max_positions} positions)")
    click.echo(str(build_engines(plan, force=force, report=progress)))


def check_engines(path: Path) -> bool:
    """`refusion-export check` on a directory holding engines.json: TensorRT vs onnxruntime."""
    from refusion.engines.check import check_engines as compare

    progress(f"comparing the TensorRT engines in {path} with onnxruntime on the same inputs")
    return compare(path, report=click.echo)

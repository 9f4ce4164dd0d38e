"""`refusion-export`: checkpoint -> ONNX export (`onnx`), re-validation (`check`), description (`inspect`).

Progress goes to stderr (bars on a terminal, plain lines elsewhere, none with --quiet), results
to stdout. A RefusionError becomes one `error: ...` line on stderr and exit code 1; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from refusion.runtime.core.contract import DEFAULT_CANDIDATES
from refusion.runtime.core.engines_manifest import ENGINES_MANIFEST
from refusion.runtime.core.errors import RefusionError
from refusion.tools.build_command import build_command, check_engines
from refusion.tools.cli_common import ErrorReportingGroup, progress, quiet_option, version_option
from refusion.tools.demo import demo_command

if TYPE_CHECKING:
    from refusion.runtime.core.quantization import Quantization


@click.group(cls=ErrorReportingGroup)
@version_option
def cli() -> None:
    """Export ReFusion checkpoints to ONNX graphs and check them."""


def _need_export_extra() -> None:
    """The export path needs torch, onnx, safetensors and onnxruntime; say which pip extra is missing."""
    import importlib

    for module, extra in (("torch", "export"), ("onnx", "export"), ("safetensors", "export"), ("onnxruntime", "ort")):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            raise RefusionError(f"{module} is not installed; pip install 'refusion-trt[{extra}]'.") from e


@click.command("onnx")
@click.argument("checkpoint")
@click.option("--revision", default=None,
              help="With a Hugging Face model id: the branch, tag or commit to export [default: main].")
@click.option("--output", "-o", required=True, type=click.Path(path_type=Path), help="Export directory to create.")
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32", show_default=True,
              help="Weight and KV dtype of the graphs.")
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
@click.option("--logits", is_flag=True,
              help="Also output full [batch, heads, vocab] fp32 logits at the head positions (for debugging).")
@click.option("--candidates", type=int, default=DEFAULT_CANDIDATES, show_default=True,
              help="Top-K candidates (ids and log-probabilities) the graphs emit at each position for sampling: "
                   "requests' top_k may not exceed it (at most the vocabulary).")
@click.option("--embeddings", type=click.Choice(["graph", "host"]), default="graph", show_default=True,
              help="Where the token embedding lives: in the graphs, or host (embeddings.bin beside them, memory-mapped "
                   "by the runtime, which feeds the rows it looks up as inputs_embeds: the engine holds no table). "
                   "host needs an untied lm_head.")
@click.option("--ops", type=click.Choice(["standard", "onnxruntime"]), default="standard", show_default=True,
              help="The ops the graphs are written with: standard (opset 17, 21 with --quantize: what TensorRT and "
                   "onnxruntime both build), or onnxruntime (opset 23's Attention, RMSNormalization and "
                   "RotaryEmbedding and onnxruntime's SkipSimplifiedLayerNormalization: about half the nodes, faster "
                   "where per-call cost dominates; onnxruntime only, `build` refuses it).")
@click.option("--mask-token-id", type=int, default=None, help="Mask token id, when config.json lacks mask_token_id.")
@click.option("--validate/--no-validate", default=True, show_default=True,
              help="Check the graphs against the torch definition on onnxruntime CPU before publishing.")
@click.option("--quantize", default=None, metavar="int4-rtn|int4-awq",
              help="int4 weights for the decoder layers' linears (docs/quantization.md).")
@click.option("--block-size", type=int, default=None,
              help="With --quantize: input rows per int4 scale, a power of two >= 16 dividing every linear's input "
                   "[default: 128, else 64: the largest TensorRT documents that divides the model].")
@click.option("--quantize-head", is_flag=True,
              help="With --quantize: lm_head int4 too (an untied head only; a tied one is the embedding table).")
@click.option("--calibration", type=click.Path(path_type=Path), default=None,
              help="With int4-awq: a text file, one prompt per line [default: the built-in set].")
@click.option("--calibration-samples", type=int, default=None,
              help="With int4-awq: use the first N calibration prompts [default: 64].")
@quiet_option
def onnx_command(checkpoint: str, revision: str | None, output: Path, dtype: str, force: bool, logits: bool,
                 candidates: int, embeddings: str, ops: str, mask_token_id: int | None, validate: bool,
                 quantize: str | None,
                 block_size: int | None, quantize_head: bool, calibration: Path | None,
                 calibration_samples: int | None) -> None:
    """Export CHECKPOINT to planner/infiller ONNX graphs. CHECKPOINT is a Qwen3/ReFusion directory in the
    Hugging Face layout, or a model id ORG/NAME fetched from the hub into its cache (HF_HOME; offline with
    HF_HUB_OFFLINE=1); a local directory of that name wins."""
    _need_export_extra()
    from refusion.export.exporter import export_onnx
    from refusion.export.hub import resolve_checkpoint
    from refusion.export.quantize import QuantizeOptions

    t0 = time.perf_counter()
    if quantize is None and ((block_size, calibration, calibration_samples) != (None, None, None) or quantize_head):
        raise RefusionError("--block-size, --quantize-head, --calibration and --calibration-samples need "
                            "--quantize int4-rtn|int4-awq.")
    options = (QuantizeOptions(quantize, block_size, calibration, calibration_samples, quantize_head)
               if quantize else None)
    path = resolve_checkpoint(checkpoint, revision, progress)  # after the flags are checked: it may download
    block = f" block {block_size}" if block_size else ""  # left out: the exporter says which it takes
    head = ", int4 lm_head" if quantize_head else ""
    what = (f"{dtype}{f', {quantize}{block}{head}' if options else ''}{', with logits' if logits else ''}"
            f"{', embeddings on the host' if embeddings == 'host' else ''}"
            f"{', onnxruntime ops' if ops == 'onnxruntime' else ''}")
    progress(f"exporting {path} -> {output} ({what})")
    out = export_onnx(path, output, dtype=dtype, logits=logits, mask_token_id=mask_token_id,
                      force=force, validate=validate, quantize=options, candidates=candidates,
                      embeddings=embeddings, ops=ops, progress=progress)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    progress(f"done in {time.perf_counter() - t0:.1f} s: {out} ({_size(size)})")
    click.echo(str(out))


@click.command("check")
@click.argument("export_dir", type=click.Path(path_type=Path))
@quiet_option
def check_command(export_dir: Path) -> None:
    """Check an export (every file's size and sha256, the graphs against refusion.json, then
    onnxruntime CPU against torch) or engines (TensorRT against onnxruntime); exit 0 only when all pass."""
    if (export_dir / ENGINES_MANIFEST).is_file():
        if not check_engines(export_dir):
            raise RefusionError(f"{export_dir}: the TensorRT engines disagree with onnxruntime (report above).")
        return
    _need_export_extra()
    from refusion.export.audit import audit
    from refusion.export.validate import validate_export
    from refusion.runtime.core.export_manifest import REEXPORT, ExportManifest

    manifest = ExportManifest.read(export_dir)
    progress(f"verifying {len(manifest.files)} files (sizes, sha256) and both graphs against refusion.json")
    problems = audit(manifest)
    for problem in problems:
        click.echo(f"  {problem}")
    if problems:
        raise RefusionError(f"{export_dir}: {len(problems)} problem(s), listed above; {REEXPORT}.")
    click.echo(f"files and graphs: match refusion.json ({len(manifest.files)} files, sha256 verified)")
    progress(f"validating {export_dir} on onnxruntime CPU against the torch definition")
    report = validate_export(export_dir, progress=progress)
    click.echo(report.text())
    if report.skipped:
        raise RefusionError(f"{export_dir} was not checked: {report.skipped}")
    if not report.ok:
        raise RefusionError(f"{export_dir} failed validation: the graphs disagree with the torch definition.")


@click.command("inspect")
@click.argument("export_dir", type=click.Path(path_type=Path))
def inspect_command(export_dir: Path) -> None:
    """Describe an export (model dims, token ids, defaults, files, each graph's inputs and outputs)
    and list every mismatch with refusion.json (sizes, sha256, graphs); exit 1 if there is one."""
    _need_export_extra()
    from refusion.export.audit import audit, graph_io
    from refusion.runtime.core.contract import GRAPH_NAMES
    from refusion.runtime.core.export_manifest import FORMAT, FORMAT_VERSION, MANIFEST_NAME, REEXPORT, ExportManifest

    m = ExportManifest.read(export_dir)
    echo = click.echo
    echo(f"export   {m.path}  ({FORMAT} v{FORMAT_VERSION}, dtype {m.dtype})")
    echo("model    " + "  ".join(f"{k}={v}" for k, v in m.dims.to_json().items()))
    echo(f"tokens   mask_token_id={m.mask_token_id}  eos_token_id={m.eos_token_id}")
    echo(f"weights  {_quantization(m.quantization)}")
    echo(f"ops      {m.ops} (opset {m.opset})")
    e = m.embeddings
    echo("embeds   " + (f"host: {e.files[0]} {e.dtype} {list(e.shape)} (fed as inputs_embeds)" if e.on_host
                        else "graph (the graphs gather the table)"))
    echo("defaults " + "  ".join(f"{k}={v}" for k, v in m.defaults.to_json().items()))
    if m.source:
        echo(f"source   {m.source.get('checkpoint')} ({m.source.get('dtype')})")
    problems = audit(m)
    echo("files")
    for name in [*m.files, MANIFEST_NAME]:
        f = m.path / name
        size = _size(f.stat().st_size) if f.is_file() else "MISSING"
        bad = any(str(f) in p for p in problems)
        echo(f"  {name:24s} {size:>10s}  {'MISMATCH' if bad else 'ok' if name in m.files else ''}")
    for name in GRAPH_NAMES:
        path = m.graph_path(name)
        if not any(str(path) in p for p in problems):
            echo(f"graph {name}  ({path.name})")
            for kind, tensor, dtype, axes in graph_io(m, name):
                echo(f"  {kind:3s}  {tensor:26s} {dtype:9s} [{', '.join(map(str, axes))}]")
            echo("  contract: matches refusion.json")
    if problems:
        echo("mismatches")
        for problem in problems:
            echo(f"  {problem}")
        raise RefusionError(f"{export_dir}: {len(problems)} mismatch(es) with refusion.json, listed above; {REEXPORT}.")


def _quantization(q: Quantization | None) -> str:
    """refusion.json's quantization section, and the MatMulNBits accuracy levels onnxruntime runs it at
    (the runner's choice, not recorded in the export: docs/quantization.md)."""
    if q is None:
        return "float (not quantized)"
    from refusion.runtime.runners.ort_session import EXACT_ACCURACY_LEVEL, RUNTIME_ACCURACY_LEVEL

    calibration = (f"  calibration={q.calibration_samples} prompts sha256:{q.calibration_sha256}"
                   if q.calibration_sha256 else "")
    return (f"{q.method}  bits={q.bits}  block_size={q.block_size}  lm_head={'int4' if q.head else 'float'}"
            f"{calibration}  onnxruntime accuracy_level="
            f"{RUNTIME_ACCURACY_LEVEL} (runners), {EXACT_ACCURACY_LEVEL} (check)")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


# Commands, in help order; the engine build takes --quiet too.
for _command in (demo_command, onnx_command, quiet_option(build_command), check_command, inspect_command):
    cli.add_command(_command)


def main() -> None:
    cli(prog_name="refusion-export")


if __name__ == "__main__":
    main()

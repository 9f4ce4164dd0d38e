"""`refusion-export`: checkpoint -> ONNX export (`onnx`), re-validation (`check`), description (`inspect`).

Progress goes to stderr, results to stdout. A RefusionError becomes one `error: ...` line
on stderr and exit code 1; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from refusion.runtime.core.errors import RefusionError
from refusion.tools.build_command import build_command, check_engines
from refusion.tools.cli_common import ErrorReportingGroup, progress
from refusion.tools.demo import demo_command


@click.group(cls=ErrorReportingGroup)
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
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--output", "-o", required=True, type=click.Path(path_type=Path), help="Export directory to create.")
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32", show_default=True,
              help="Weight and KV dtype of the graphs.")
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
@click.option("--logits", is_flag=True, help="Also output full [batch, seq, vocab] fp32 logits (debug/sampling).")
@click.option("--mask-token-id", type=int, default=None, help="Mask token id, when config.json lacks mask_token_id.")
@click.option("--validate/--no-validate", default=True, show_default=True,
              help="Check the graphs against the torch definition on onnxruntime CPU before publishing.")
def onnx_command(checkpoint: Path, output: Path, dtype: str, force: bool, logits: bool,
                 mask_token_id: int | None, validate: bool) -> None:
    """Export CHECKPOINT (a Hugging Face Qwen3/ReFusion directory) to planner/infiller ONNX graphs."""
    _need_export_extra()
    from refusion.export.exporter import export_onnx

    t0 = time.perf_counter()
    progress(f"exporting {checkpoint} -> {output} ({dtype}{', with logits' if logits else ''})")
    out = export_onnx(checkpoint, output, dtype=dtype, logits=logits, mask_token_id=mask_token_id,
                      force=force, validate=validate, progress=progress)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    progress(f"done in {time.perf_counter() - t0:.1f} s: {out} ({_size(size)})")
    click.echo(str(out))


@click.command("check")
@click.argument("export_dir", type=click.Path(path_type=Path))
def check_command(export_dir: Path) -> None:
    """Re-validate an export (onnxruntime CPU vs torch) or engines (TensorRT vs onnxruntime);
    exit 0 only on parity."""
    if (export_dir / "engines.json").is_file():
        if not check_engines(export_dir):
            raise RefusionError(f"{export_dir}: the TensorRT engines disagree with onnxruntime (report above).")
        return
    _need_export_extra()
    from refusion.export.validate import validate_export

    progress(f"validating {export_dir} on onnxruntime CPU against the torch definition")
    report = validate_export(export_dir)
    click.echo(report.text())
    if report.skipped:
        raise RefusionError(f"{export_dir} was not checked: {report.skipped}")
    if not report.ok:
        raise RefusionError(f"{export_dir} failed validation: the graphs disagree with the torch definition.")


@click.command("inspect")
@click.argument("export_dir", type=click.Path(path_type=Path))
def inspect_command(export_dir: Path) -> None:
    """Describe an export: model dims, token ids, files, and each graph's inputs and outputs."""
    from refusion.runtime.core.contract import GRAPH_NAMES
    from refusion.runtime.core.export_manifest import ExportManifest

    m = ExportManifest.load(export_dir)
    echo = click.echo
    echo(f"export   {m.path}  ({m.raw['format']} v{m.raw['format_version']}, dtype {m.dtype})")
    echo("model    " + "  ".join(f"{k}={v}" for k, v in m.model.items()))
    echo(f"tokens   mask_token_id={m.mask_token_id}  eos_token_id={m.eos_token_id}")
    source = m.raw.get("source", {})
    if source:
        echo(f"source   {source.get('checkpoint')} ({source.get('dtype')})")
    echo("files")
    files = [m.graph_files[g] for g in GRAPH_NAMES] + [m.weights_file, "refusion.json", *m.tokenizer_files]
    for name in files:
        f = m.path / name
        echo(f"  {name:24s} {_size(f.stat().st_size) if f.is_file() else 'MISSING':>10s}")
    echo(f"  {'total':24s} {_size(sum((m.path / n).stat().st_size for n in files if (m.path / n).is_file())):>10s}"
         f"  ({len(m.weights)} weight tensors)")
    for name in GRAPH_NAMES:
        _echo_graph(m, name)


def _echo_graph(m: Any, name: str) -> None:
    """A graph as the ONNX file declares it (not just the manifest), flagged if the two differ."""
    path = m.graph_path(name)
    if not path.is_file():
        click.echo(f"graph {name}: {path.name} MISSING")
        return
    try:
        import onnx
    except ModuleNotFoundError as e:
        raise RefusionError("onnx is not installed; pip install 'refusion-trt[export]'.") from e
    from onnx import helper

    model = onnx.load(str(path), load_external_data=False)
    opsets = ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in model.opset_import)
    click.echo(f"graph {name}  ({path.name}, {opsets}, {len(model.graph.node)} nodes)")
    found = []
    for kind, values in (("in ", model.graph.input), ("out", model.graph.output)):
        for v in values:
            t = v.type.tensor_type
            dtype = helper.tensor_dtype_to_np_dtype(t.elem_type).name
            axes = [d.dim_param or d.dim_value for d in t.shape.dim]
            found.append((kind, v.name, dtype, axes))
            click.echo(f"  {kind}  {v.name:26s} {dtype:9s} [{', '.join(map(str, axes))}]")
    spec = m.graphs[name]
    declared = [("in ", t.name, t.dtype, list(t.axes)) for t in spec.inputs]
    declared += [("out", t.name, t.dtype, list(t.axes)) for t in spec.outputs]
    click.echo("  contract: " + ("matches refusion.json" if found == declared else "DIFFERS from refusion.json"))


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


# Commands, in help order.
for _command in (demo_command, onnx_command, build_command, check_command, inspect_command):
    cli.add_command(_command)


def main() -> None:
    cli(prog_name="refusion-export")


if __name__ == "__main__":
    main()

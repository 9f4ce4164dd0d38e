"""`refusion-export onnx`: checkpoint directory -> planner.onnx + infiller.onnx + weights.bin + refusion.json.

The export is written into a hidden staging directory beside the output and published only
when everything (graphs, weights, tokenizer, manifest, validation) is done, so a failed or
interrupted export never leaves a directory that loads (export/publish.py says how).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import onnx

from refusion.export.checkpoint import Checkpoint
from refusion.export.onnx_graph import OPSET, build_graph
from refusion.export.publish import clean_leftovers, cleanup_on_signals, make_staging, publish
from refusion.export.weights_file import WeightsWriter
from refusion.runtime.core.contract import GRAPH_NAMES, graph_specs
from refusion.runtime.core.dtypes import from_flag
from refusion.runtime.core.dims import expected_weights, is_linear_weight
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import MANIFEST_NAME, PENDING_NAME, ExportManifest, WeightEntry, with_files
from refusion.runtime.tokenizer import TOKENIZER_FILES

Progress = Callable[[str], None]


def export_onnx(
    checkpoint: str | Path,
    output: str | Path,
    *,
    dtype: str = "fp32",
    logits: bool = False,
    mask_token_id: int | None = None,
    force: bool = False,
    validate: bool = True,
    progress: Progress = lambda msg: None,
) -> Path:
    output = Path(output)
    export_dtype = from_flag(dtype).name
    if output.exists() and not force:
        raise RefusionError(f"output {output} already exists; pass --force to replace it.")
    if output.exists() and not _replaceable(output):
        raise RefusionError(
            f"output {output} exists and is not an earlier export (no {MANIFEST_NAME}) nor an empty directory; "
            "--force replaces only those. Choose another --output."
        )
    ckpt = Checkpoint.open(checkpoint, mask_token_id)
    eos_id = ckpt.eos_token_id()
    d = ckpt.dims
    progress(f"checkpoint {ckpt.path}: {d.num_layers} layers, hidden {d.hidden_size}, heads {d.num_heads}/{d.kv_heads} "
             f"kv, head_dim {d.head_dim}, vocab {d.vocab_size}, {ckpt.source_dtype} weights, {len(ckpt.files)} tensors")
    with cleanup_on_signals():
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
            clean_leftovers(output, progress)
            staging = make_staging(output)
        except OSError as e:
            why = "a file is in the way" if isinstance(e, (FileExistsError, NotADirectoryError)) else e.strerror
            raise RefusionError(f"cannot write to {output.parent} ({why}); choose a writable --output.") from e
        try:
            _write_export(ckpt, staging, export_dtype, logits, eos_id, progress)
            if validate:
                from refusion.export.validate import validate_export

                progress("validating graphs against the torch definition on onnxruntime CPU")
                report = validate_export(staging, pending=True)
                progress(report.text())
                if not report.ok:
                    raise RefusionError(f"export validation failed (report above); nothing was written to {output}.")
            (staging / PENDING_NAME).rename(staging / MANIFEST_NAME)  # complete: the very last write
            publish(staging, output)
            progress(f"{MANIFEST_NAME} written: the export is complete")
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return output


def _replaceable(output: Path) -> bool:
    """--force may delete an earlier export or an empty directory, never anything else."""
    return output.is_dir() and not output.is_symlink() and (
        (output / MANIFEST_NAME).is_file() or not any(output.iterdir()))


def _write_export(ckpt: Checkpoint, out: Path, dtype: str, logits: bool, eos_id: int, progress: Progress) -> None:
    dims = ckpt.dims
    t0 = time.perf_counter()
    writer = WeightsWriter(out / ExportManifest.weights_file, dtype)
    names = list(expected_weights(dims))
    index = {}
    for n, (name, tensor) in enumerate(ckpt.tensors(names), 1):
        init = writer.add(name, tensor.T if is_linear_weight(name) else tensor)
        ext = {e.key: e.value for e in init.external_data}
        index[name] = WeightEntry(dtype, tuple(init.dims), int(ext["offset"]), int(ext["length"]))
        if n % max(1, len(names) // 10) == 0 or n == len(names):
            progress(f"weights {n}/{len(names)} written ({writer.bytes_written / 2**20:.0f} MiB)")
    writer.close()

    specs = graph_specs(dims.num_layers, dims.kv_heads, dims.head_dim, dims.vocab_size, dtype, logits)
    for name in GRAPH_NAMES:
        model = build_graph(specs[name], dims, dtype, writer.initializers)
        onnx.save_model(model, out / ExportManifest.graph_files[name])
        progress(f"{ExportManifest.graph_files[name]} written ({len(model.graph.node)} nodes)")

    tokenizer_files = tuple(f for f in TOKENIZER_FILES if (ckpt.path / f).is_file())
    for f in tokenizer_files:
        shutil.copyfile(ckpt.path / f, out / f)

    defaults = ckpt.decode_defaults().clamped(dims.max_position_embeddings)
    manifest = ExportManifest(
        path=out, dims=dims, dtype=dtype, mask_token_id=ckpt.mask_token_id, eos_token_id=eos_id,
        defaults=defaults, graphs=specs, opset=OPSET, has_logits=logits, weights=index,
        tokenizer_files=tokenizer_files, files={},
        source={"checkpoint": str(ckpt.path.resolve()), "dtype": ckpt.source_dtype,
                "export_seconds": round(time.perf_counter() - t0, 2)},
    )
    with_files(manifest).write(pending=True)
    progress(f"tokenizer ({', '.join(tokenizer_files) or 'none'}) and {PENDING_NAME} written; "
             f"default decode settings {defaults.to_json()}")

"""`refusion-export onnx`: checkpoint directory -> planner.onnx + infiller.onnx + weights.bin + refusion.json.

The export is written into a hidden staging directory beside the output and published only
when everything (graphs, weights, tokenizer, manifest, validation) is done, so a failed or
interrupted export never leaves a directory that loads (export/publish.py says how).
"""

from __future__ import annotations

import ctypes
import errno
import gc
import math
import shutil
import time
from pathlib import Path

import onnx

from refusion.export.checkpoint import Checkpoint
from refusion.export.onnx_graph import build_graph, graph_opset
from refusion.export.ort_graph import build_ort_graph
from refusion.export.progress import Progress, line, silent, tick
from refusion.export.publish import clean_leftovers, cleanup_on_signals, exclusive, make_staging, publish
from refusion.export.quantize import QuantizeOptions, QuantPlan, float_tensors, plan_quantization, write_weight
from refusion.export.weights_file import WeightsWriter
from refusion.runtime.core.contract import (
    DEFAULT_CANDIDATES,
    GRAPH_NAMES,
    GRAPH_OPS,
    ORT_OPSET,
    candidates_for,
    graph_specs,
)
from refusion.runtime.core.dims import expected_weights
from refusion.runtime.core.dtypes import dtype as dtype_row
from refusion.runtime.core.dtypes import from_flag
from refusion.runtime.core.embeddings import EMBEDDING_WEIGHT, TABLE_FILE, Embeddings
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import MANIFEST_NAME, PENDING_NAME, ExportManifest, WeightEntry, with_files
from refusion.runtime.core.quantization import weight_index
from refusion.runtime.tokenizer import TOKENIZER_FILES


def export_onnx(
    checkpoint: str | Path,
    output: str | Path,
    *,
    dtype: str = "fp32",
    logits: bool = False,
    mask_token_id: int | None = None,
    force: bool = False,
    validate: bool = True,
    quantize: QuantizeOptions | None = None,
    candidates: int = DEFAULT_CANDIDATES,
    embeddings: str = "graph",
    ops: str = "standard",
    progress: Progress = silent,
) -> Path:
    """Export `checkpoint` (a local Hugging Face directory) to `output`. `progress` receives
    ProgressEvents (export/progress.py): the weights by bytes, the graphs, validation by forwards.
    `quantize` makes the decoder layers' linear weights int4 (export/quantize.py). `candidates`: K, the most
    likely tokens the graphs emit at each position for sampling (top_k may not exceed it; at most the vocabulary).
    `embeddings`: "graph" (the graphs gather the table) or "host" (embeddings.bin beside them, which the runtime
    maps and gathers from; the graphs take inputs_embeds). `ops`: "standard" (opset 17, 21 with int4: what every
    backend builds) or "onnxruntime" (opset 23's fused ops, about half the nodes: onnxruntime only; export/ort_graph.py)."""
    output = Path(output)
    if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates <= 0:
        raise RefusionError(f"candidates={candidates!r} (--candidates) must be a positive number of tokens.")
    export_dtype = from_flag(dtype).name
    if ops not in GRAPH_OPS:
        raise RefusionError(f"ops={ops!r} (--ops) must be one of {', '.join(GRAPH_OPS)}.")
    _check_output(output, force)
    ckpt = Checkpoint.open(checkpoint, mask_token_id)
    eos_id = ckpt.eos_token_id()
    d = ckpt.dims
    placement = Embeddings.for_export(embeddings, d, export_dtype)
    line(progress, f"checkpoint {ckpt.path}: {d.num_layers} layers, hidden {d.hidden_size}, heads "
                   f"{d.num_heads}/{d.kv_heads} kv, head_dim {d.head_dim}, vocab {d.vocab_size}, {ckpt.source_dtype} "
                   f"weights, {len(ckpt.files)} tensors")
    quant_plan = plan_quantization(quantize, ckpt, export_dtype, progress) if quantize else None
    with cleanup_on_signals():
        try:
            output.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            why = "a file is in the way" if isinstance(e, (FileExistsError, NotADirectoryError)) else e.strerror
            raise RefusionError(f"cannot write to {output.parent} ({why}); choose a writable --output.") from e
        with exclusive(output):  # another export to it is refused while this one writes
            _check_output(output, force)  # again: another export may have published it since the first look
            try:
                clean_leftovers(output, lambda text: line(progress, text))
                staging = make_staging(output)
            except OSError as e:
                raise RefusionError(f"cannot write to {output.parent} ({e.strerror}); choose a writable --output.") \
                    from e
            try:
                _write_export(ckpt, staging, export_dtype, logits, candidates_for(d.vocab_size, candidates), eos_id,
                              quant_plan, placement, ops, progress)
                if validate:
                    from refusion.export.validate import validate_export

                    _release_freed_memory()

                    line(progress, "validating graphs against the torch definition on onnxruntime CPU")
                    report = validate_export(staging, pending=True, progress=progress)
                    line(progress, report.text())
                    if not report.ok:
                        raise RefusionError(f"export validation failed (report above); nothing was written to "
                                            f"{output}.")
                (staging / PENDING_NAME).rename(staging / MANIFEST_NAME)  # complete: the very last write
                publish(staging, output)
                line(progress, f"{MANIFEST_NAME} written: the export is complete")
            except BaseException as e:
                shutil.rmtree(staging, ignore_errors=True)
                if isinstance(e, OSError) and e.errno in _NO_ROOM:
                    where = f" ({e.filename})" if e.filename else ""
                    raise RefusionError(f"no room left to write the export in {output.parent}: {e.strerror}{where}; "
                                        f"nothing was written to {output}. Free space there, or choose another "
                                        "--output.") from None
                raise
    return output


_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a quota, a file-size limit


def _check_output(output: Path, force: bool) -> None:
    if output.exists() and not force:
        raise RefusionError(f"output {output} already exists; pass --force to replace it.")
    if output.exists() and not _replaceable(output):
        raise RefusionError(
            f"output {output} exists and is not an earlier export (no {MANIFEST_NAME}) nor an empty directory; "
            "--force replaces only those. Choose another --output."
        )


def _release_freed_memory() -> None:
    """Give the memory the export phase freed back to the OS before validation loads its sessions: glibc keeps
    freed heap pages, and AWQ's search frees many tensors under its 32 MiB mmap threshold (0.6 GiB stayed
    resident after one ReFusion-8B layer)."""
    gc.collect()
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: its allocator returns memory its own way
        return
    libc.malloc_trim(0)


def _replaceable(output: Path) -> bool:
    """--force may delete an earlier export or an empty directory, never anything else."""
    return output.is_dir() and not output.is_symlink() and (
        (output / MANIFEST_NAME).is_file() or not any(output.iterdir()))


def _write_export(ckpt: Checkpoint, out: Path, dtype: str, logits: bool, candidates: int, eos_id: int,
                  quant_plan: QuantPlan | None, embeddings: Embeddings, ops: str, progress: Progress) -> None:
    dims = ckpt.dims
    t0 = time.perf_counter()
    writer = WeightsWriter(out / ExportManifest.weights_file, dtype)
    # a host table: raw rows, alone in a file of its own (offset 0), which the graphs do not reference
    table = WeightsWriter(out / TABLE_FILE, dtype) if embeddings.on_host else None
    quantization = quant_plan.quantization if quant_plan else None
    layout = weight_index(dims, dtype, quantization)
    names = list(expected_weights(dims))
    total = sum(dtype_row(d).nbytes(math.prod(shape)) for d, shape in layout.values())
    index = {}
    done = n = 0
    # Not enumerate(): it holds the previous (name, tensor) until the next is made, and AWQ rewrites a whole layer
    # between two tensors (the embedding's 1.2 GiB stayed resident through layer 0's search on ReFusion-8B).
    for name, tensor in float_tensors(ckpt, quant_plan, progress):
        n += 1
        target = table if table is not None and name == EMBEDDING_WEIGHT else writer
        for init in write_weight(target, name, tensor, quantization):
            ext = {e.key: e.value for e in init.external_data}
            if target is writer:  # weights.bin's index; the host table's file holds it alone
                index[init.name] = WeightEntry(layout[init.name][0], tuple(init.dims), int(ext["offset"]),
                                               int(ext["length"]))
            done += int(ext["length"])
        del tensor  # its checkpoint pages are released before the next tensor is mapped
        if n % max(1, len(names) // 10) == 0 or n == len(names):
            line(progress, f"weights {n}/{len(names)} written ({writer.bytes_written / 2**20:.0f} MiB)",
                 "weights", done, total, "B")
        else:
            tick(progress, "weights", done, total, "B")
    writer.close()
    if table is not None:
        table.close()

    specs = graph_specs(dims.num_layers, dims.kv_heads, dims.head_dim, dims.vocab_size, dtype, logits, candidates,
                        embeddings.fed_hidden)
    build = build_ort_graph if ops == "onnxruntime" else build_graph
    for name in GRAPH_NAMES:
        model = build(specs[name], dims, dtype, writer.initializers)
        onnx.save_model(model, out / ExportManifest.graph_files[name])
        line(progress, f"{ExportManifest.graph_files[name]} written ({len(model.graph.node)} nodes)")

    tokenizer_files = tuple(f for f in TOKENIZER_FILES if (ckpt.path / f).is_file())
    for f in tokenizer_files:
        shutil.copyfile(ckpt.path / f, out / f)

    defaults = ckpt.decode_defaults().clamped(dims.max_position_embeddings)
    manifest = ExportManifest(
        path=out, dims=dims, dtype=dtype, mask_token_id=ckpt.mask_token_id, eos_token_id=eos_id,
        defaults=defaults, graphs=specs, opset=ORT_OPSET if ops == "onnxruntime" else graph_opset(writer.initializers),
        has_logits=logits,
        candidates=candidates, weights=index,
        tokenizer_files=tokenizer_files, files={}, quantization=quantization, embeddings=embeddings, ops=ops,
        source={"checkpoint": str(ckpt.path.resolve()), "dtype": ckpt.source_dtype,
                "export_seconds": round(time.perf_counter() - t0, 2)},
    )
    with_files(manifest).write(pending=True)
    line(progress, f"tokenizer ({', '.join(tokenizer_files) or 'none'}) and {PENDING_NAME} written; "
                   f"default decode settings {defaults.to_json()}")

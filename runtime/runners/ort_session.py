"""The one place onnxruntime sessions are made for an export's graphs: options, weights shared or
prepacked, int4 accuracy levels, and the graph's inputs and outputs checked against refusion.json."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import zip_longest
from pathlib import Path
from typing import Any

import numpy as np

from refusion.runtime.core.contract import GraphName, GraphSpec
from refusion.runtime.core.dtypes import dtype, from_onnxruntime
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import REEXPORT, ExportManifest

# int4 graphs run their DequantizeLinear -> MatMul as onnxruntime's MatMulNBits, whose accuracy level says how:
# 1 computes in fp32 on the dequantized weights (exactly the graphs' math), 4 quantizes the activations to int8
# per block: faster at unchanged held-out accuracy (docs/quantization.md has the measurements), so runners use 4;
# the comparator's sessions (export/compare.py OrtSessions: validation, `check`, TensorRT checks) use 1, so the
# graphs are compared with torch on the dequantized weights exactly. No effect on float graphs.
RUNTIME_ACCURACY_LEVEL = 4
EXACT_ACCURACY_LEVEL = 1


def import_onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError as e:
        raise RefusionError(
            "the onnxruntime backend needs onnxruntime: pip install 'refusion-trt[ort]' "
            "(or '[ort-gpu]' for CUDA)."
        ) from e
    return onnxruntime


class SharedWeights:
    """One read-only memory map of weights.bin and an OrtValue over each float tensor's bytes (no copy):
    every session given it reads the same pages, unpacked (export validation's sessions)."""

    def __init__(self, manifest: ExportManifest):
        ort = import_onnxruntime()
        self.map = np.memmap(manifest.path / manifest.weights_file, np.uint8, "r")
        self.values = {
            name: ort.OrtValue.ortvalue_from_numpy(
                self.map[e.offset : e.offset + e.nbytes].view(dtype(e.dtype).numpy).reshape(e.shape))
            for name, e in manifest.weights.items() if e.dtype != "int4"
        }


Provider = str | tuple[str, dict[str, str]]  # a provider's name, or its name and options


def open_session(manifest: ExportManifest, graph: GraphName, providers: Sequence[Provider], threads: int | None = None,
                 low_memory: bool = False, accuracy_level: int | None = None,
                 weights: SharedWeights | None = None) -> Any:
    """The one place an onnxruntime session is made for an export graph: options, onnxruntime's own
    exceptions as a RefusionError, and the graph's inputs and outputs checked against refusion.json.
    `low_memory`: no CPU memory arena (activations are freed after each forward, not kept). `accuracy_level`:
    of int4 MatMulNBits (None: RUNTIME_ACCURACY_LEVEL). `weights`: initializers shared with the other
    sessions given the same, unpacked (they must outlive the session)."""
    ort = import_onnxruntime()
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.enable_cpu_mem_arena = not low_memory
    opts.add_session_config_entry("session.disable_prepacking", "1" if weights is not None else "0")
    level = RUNTIME_ACCURACY_LEVEL if accuracy_level is None else accuracy_level
    opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(level))
    for name, value in (weights.values.items() if weights else ()):
        opts.add_initializer(name, value)
    path = manifest.graph_path(graph)
    try:
        session = ort.InferenceSession(str(path), opts, providers=list(providers))
    except Exception as e:  # onnxruntime raises its own exception types
        raise RefusionError(f"{path} could not be loaded by onnxruntime ({e}); {REEXPORT}.") from e
    _check_io(session, manifest.graphs[graph], path)
    return session


def _check_io(session: Any, spec: GraphSpec, path: Path) -> None:
    """The session's inputs and outputs must be the contract's, in order: names (and so the layer
    count), element types and axes (fixed sizes such as kv_heads and head_dim, symbolic ones by name)."""
    for kind, args, tensors in (("input", session.get_inputs(), spec.inputs),
                                ("output", session.get_outputs(), spec.outputs)):
        found = [f"{a.name} {_type_name(a.type)} {list(a.shape)}" for a in args]
        wanted = [f"{t.name} {t.dtype} {list(t.axes)}" for t in tensors]
        for i, (got, want) in enumerate(zip_longest(found, wanted, fillvalue="nothing")):
            if got != want:
                raise RefusionError(
                    f"{path} does not match refusion.json beside it: its {kind} {i} is {got}, the contract says "
                    f"{want}; the graph and refusion.json come from different exports: {REEXPORT}."
                )


def _type_name(ort_type: str) -> str:
    """onnxruntime's "tensor(float)" as the contract's "float32" (unknown types as onnxruntime spells them)."""
    row = from_onnxruntime(ort_type)
    return row.name if row else ort_type

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
CUDA_PROVIDER = "CUDAExecutionProvider"
# onnxruntime-gpu as each CUDA major's extra installs it (pyproject.toml): with its CUDA and cuDNN libraries
CUDA_INSTALL = ("pip install 'refusion-trt[ort-gpu]' (onnxruntime-gpu[cuda,cudnn] < 1.27, built for CUDA 12) or "
                "'refusion-trt[ort-gpu-cu13]' (onnxruntime-gpu[cuda,cudnn] >= 1.27, CUDA 13: a driver >= 580)")


def configured_provider(name: str, export_dtype: str) -> Provider:
    """A provider as a session over graphs of `export_dtype` runs it: CUDA with TF32 off for fp32 graphs (its
    `use_tf32` defaults on, rounding fp32 GEMMs' inputs to 10 bits), so an fp32 export stays the fp32 reference it
    is on the CPU provider and on TensorRT fp32 engines (built with TF32 off)."""
    return (name, {"use_tf32": "0"}) if name == CUDA_PROVIDER and export_dtype == "float32" else name


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
    _check_provider(session, providers[0] if isinstance(providers[0], str) else providers[0][0])
    _check_io(session, manifest.graphs[graph], path)
    return session


def _check_provider(session: Any, wanted: str) -> None:
    """The session must run on the provider asked first: onnxruntime makes a CPU session, logging only a warning,
    when a provider's libraries fail to load (onnxruntime-gpu without CUDA or cuDNN: from 1.27 they come only
    with its [cuda,cudnn] extras), and a CUDA runner would then bind device memory to it."""
    got = list(session.get_providers())
    if got[:1] != [wanted]:
        package, cuda = build_info()
        raise RefusionError(
            f"onnxruntime could not start {wanted} and made a session on {', '.join(got)} instead ({package}"
            f"{f', built for CUDA {cuda}' if cuda else ''}; its log above says which library failed to load). "
            f"Install onnxruntime-gpu with the CUDA and cuDNN it is built for: {CUDA_INSTALL}; or run on the CPU "
            "(--backend ort-cpu)."
        )


def build_info() -> tuple[str, str | None]:
    """The installed onnxruntime's package and version ("onnxruntime-gpu 1.31.1"), and the CUDA it is built for as
    its build info records it ("13.0"; None for a CPU build)."""
    ort = import_onnxruntime()
    try:
        from onnxruntime.capi import build_and_package_info as info
    except ImportError:
        return f"onnxruntime {ort.__version__}", None
    cuda = str(getattr(info, "cuda_version", "") or "") or None
    return f"{getattr(info, 'package_name', 'onnxruntime')} {ort.__version__}", cuda


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

"""Backends behind one Runner interface; `make_runner` picks one by name or automatically."""

from __future__ import annotations

from pathlib import Path

from refusion.runtime.core.engines_manifest import ENGINES_MANIFEST, EngineManifest
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.runners.base import Runner

BACKENDS = ("auto", "trt", "ort-cuda", "ort-cpu")


def available_backend(path: Path) -> str:
    """trt when engines are built there and tensorrt imports; else ort-cuda when onnxruntime has
    CUDA; else ort-cpu."""
    if (path / ENGINES_MANIFEST).is_file():
        try:
            import tensorrt

            if hasattr(tensorrt, "__version__"):  # not an empty namespace (e.g. stubs alone)
                return "trt"
        except ImportError:
            pass
    try:
        import onnxruntime
        if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
            return "ort-cuda"
    except ImportError:
        pass
    return "ort-cpu"


def make_runner(manifest: ExportManifest, backend: str = "auto", threads: int | None = None,
                verify: bool = False, low_memory: bool = False) -> Runner:
    """The backend's Runner over `manifest`, its files checked (sizes; sha256 too with `verify`).
    `low_memory` (onnxruntime only) turns off weight prepacking: about half the peak memory, ~30% slower forwards."""
    if backend not in BACKENDS:
        raise RefusionError(f"backend {backend!r} is unknown; choose one of {', '.join(BACKENDS)}.")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads <= 0):
        raise RefusionError(f"threads={threads!r} (--threads) is not a positive number of onnxruntime threads; "
                            "give 1 or more, or leave it out to use every core.")
    if backend == "auto":
        backend = available_backend(manifest.path)
    if backend == "trt" and low_memory:
        raise RefusionError("low_memory=True (--low-memory) is an onnxruntime option (it turns off weight prepacking) "
                            "and does not apply to the trt backend; drop it, or choose --backend ort-cpu or ort-cuda.")
    if backend == "trt":
        try:
            from refusion.runtime.runners.tensorrt import TensorRTRunner
        except ImportError as e:
            raise RefusionError("the trt backend needs TensorRT: pip install 'refusion-trt[trt]' on a CUDA machine.") from e
        return TensorRTRunner(manifest, EngineManifest.load(manifest.path))
    from refusion.runtime.runners.onnxruntime import OrtCudaRunner, OrtRunner

    runner = OrtCudaRunner if backend == "ort-cuda" else OrtRunner
    return runner(manifest, threads=threads, low_memory=low_memory, verify=verify)

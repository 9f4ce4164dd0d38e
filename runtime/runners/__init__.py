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
                verify: bool = False) -> Runner:
    """The backend's Runner over `manifest`, its files checked (sizes; sha256 too with `verify`)."""
    if backend not in BACKENDS:
        raise RefusionError(f"backend {backend!r} is unknown; choose one of {', '.join(BACKENDS)}.")
    if backend == "auto":
        backend = available_backend(manifest.path)
    if backend == "trt":
        try:
            from refusion.runtime.runners.tensorrt import TensorRTRunner
        except ImportError as e:
            raise RefusionError("the trt backend needs TensorRT: pip install 'refusion-trt[trt]' on a CUDA machine.") from e
        return TensorRTRunner(manifest, EngineManifest.load(manifest.path))
    from refusion.runtime.runners.onnxruntime import OrtCudaRunner, OrtRunner

    runner = OrtCudaRunner if backend == "ort-cuda" else OrtRunner
    return runner(manifest, threads, verify=verify)

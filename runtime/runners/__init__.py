"""Backends behind one Runner interface; `make_runner` picks one by name or automatically."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from refusion.runtime.core.engines_manifest import ENGINES_MANIFEST, EngineManifest
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.runners.base import Runner

BACKENDS = ("auto", "trt", "ort-cuda", "ort-cpu")
CPU_MAX_REQUESTS = 16  # KV regions of the CPU runner: requests in flight at once (each grows on demand)
CPU_MAX_BATCH = 16  # of which one forward packs at most this many


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


@dataclass(frozen=True)
class RunnerOptions:
    backend: str  # resolved: never "auto"
    max_requests: int | None  # None on trt: the engine's --max-batch, checked when it loads
    max_batch: int | None


def runner_options(manifest: ExportManifest, backend: str = "auto", threads: int | None = None,
                   low_memory: bool = False, max_requests: int | None = None,
                   max_batch: int | None = None) -> RunnerOptions:
    """make_runner's arguments checked, and resolved, before anything loads (refusion-run serve checks
    them before it starts Triton)."""
    if backend not in BACKENDS:
        raise RefusionError(f"backend {backend!r} is unknown; choose one of {', '.join(BACKENDS)}.")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads <= 0):
        raise RefusionError(f"threads={threads!r} (--threads) is not a positive number of onnxruntime threads; "
                            "give 1 or more, or leave it out to use every core.")
    for name, value in (("max_requests", max_requests), ("max_batch", max_batch)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise RefusionError(f"{name}={value!r} must be a positive integer.")
    if backend == "auto":
        backend = available_backend(manifest.path)
    if backend == "trt" and low_memory:
        raise RefusionError("low_memory=True (--low-memory) is an onnxruntime option (no memory arena) "
                            "and does not apply to the trt backend; drop it, or choose --backend ort-cpu or ort-cuda.")
    if backend == "trt":  # its sizes default to the engine's --max-batch, and are checked against it
        return RunnerOptions(backend, max_requests, max_batch)
    cpu = backend == "ort-cpu"
    max_requests = max_requests or (CPU_MAX_REQUESTS if cpu else 1)
    max_batch = max_batch or (min(CPU_MAX_BATCH, max_requests) if cpu else 1)
    if max_batch > max_requests:
        raise RefusionError(f"max_batch={max_batch} exceeds max_requests={max_requests}: a forward packs requests "
                            "in flight; raise max_requests or lower max_batch.")
    return RunnerOptions(backend, max_requests, max_batch)


def make_runner(manifest: ExportManifest, backend: str = "auto", threads: int | None = None,
                verify: bool = False, low_memory: bool = False, max_requests: int | None = None,
                max_batch: int | None = None) -> Runner:
    """The backend's Runner over `manifest`, its files checked (sizes; sha256 too with `verify`).
    `low_memory` (onnxruntime only): no memory arena (activations freed after each forward).
    `max_requests`: requests in flight at once (a KV region each); `max_batch`: their forwards packed per call.
    Defaults: CPU_MAX_REQUESTS and CPU_MAX_BATCH on onnxruntime's CPU provider; on TensorRT the engine's
    --max-batch (engines.json) for both; 1 and 1 on onnxruntime CUDA (device memory is the budget)."""
    options = runner_options(manifest, backend, threads, low_memory, max_requests, max_batch)
    if options.backend == "trt":
        try:
            from refusion.runtime.runners.tensorrt import TensorRTRunner
        except ImportError as e:
            raise RefusionError("the trt backend needs TensorRT: pip install 'refusion-trt[trt]' on a CUDA machine.") from e
        return TensorRTRunner(manifest, EngineManifest.load(manifest.path), options.max_requests, options.max_batch,
                              verify)
    from refusion.runtime.runners.onnxruntime import OrtCudaRunner, OrtRunner

    runner = OrtCudaRunner if options.backend == "ort-cuda" else OrtRunner
    return runner(manifest, threads=threads, low_memory=low_memory, verify=verify,
                  max_requests=options.max_requests or 1, max_batch=options.max_batch or 1)

"""The GPU check's first step: the versions every later step rests on, in one line, and the two that would fail
them all judged before any build: a Polygraphy that builds on this TensorRT (TensorRT 11 needs >= 0.50.3), and an
onnxruntime CUDA session that really runs on CUDA (onnxruntime-gpu falls back to the CPU, logging only a warning,
when its CUDA or cuDNN libraries do not load)."""

from __future__ import annotations

from pathlib import Path

from refusion.runtime.core.errors import RefusionError
from refusion.tools.checks.verdict import line


def versions(export: Path) -> bool:
    """The INFO line of versions, then the Polygraphy and onnxruntime CUDA verdicts; `export`: one the session
    loads."""
    import polygraphy
    import tensorrt

    from refusion.runtime.runners.cuda import device_info, driver_cuda, runtime_cuda
    from refusion.runtime.runners.ort_session import build_info
    from refusion.runtime.runners.trt_loader import tensorrt_cuda

    gpu, capability = device_info()
    driver, runtime = driver_cuda(), runtime_cuda()
    package, cuda = build_info()
    wheels = tensorrt_cuda()
    print(f"INFO: versions: {gpu} (sm {capability}), driver CUDA {driver[0]}.{driver[1]}; TensorRT "
          f"{tensorrt.__version__} ({f'tensorrt-cu{wheels}' if wheels else 'no wheels: system packages'}); "
          f"Polygraphy {polygraphy.__version__}; cuda-python's CUDA runtime {runtime[0]}.{runtime[1]}; {package}"
          f"{f' (CUDA {cuda})' if cuda else ''}", flush=True)
    return polygraphy_builds(str(tensorrt.__version__)) & cuda_session(export)


def polygraphy_builds(tensorrt_version: str) -> bool:
    import polygraphy

    from refusion.engines.build import require_polygraphy

    try:
        require_polygraphy(tensorrt_version)
    except RefusionError as e:
        return line(False, str(e))
    return line(True, f"Polygraphy {polygraphy.__version__} builds on TensorRT {tensorrt_version}")


def cuda_session(export: Path) -> bool:
    """A session of `export`'s infiller on onnxruntime's CUDA provider, as the CUDA runner opens it, and the
    providers it got; skipped where onnxruntime lists no CUDA provider (a CPU build)."""
    from refusion.runtime.core.export_manifest import ExportManifest
    from refusion.runtime.runners.ort_session import CUDA_PROVIDER, configured_provider, import_onnxruntime, open_session

    if CUDA_PROVIDER not in import_onnxruntime().get_available_providers():
        print("SKIP: onnxruntime CUDA session (onnxruntime here has no CUDAExecutionProvider; pip install "
              "'refusion-trt[ort-gpu]' or '[ort-gpu-cu13]')", flush=True)
        return True
    manifest = ExportManifest.load(export)
    try:
        session = open_session(manifest, "infiller", [configured_provider(CUDA_PROVIDER, manifest.dtype)])
    except RefusionError as e:
        return line(False, f"onnxruntime CUDA session: {e}")
    return line(True, f"onnxruntime CUDA session on {session.get_providers()}")

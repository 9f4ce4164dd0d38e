"""Loading TensorRT, apart from running it (Polygraphy keeps its loaders apart from its runners, as cuda.py keeps
CUDA): whether the installed TensorRT is one we run (`require_tensorrt`), this machine's TensorRT and GPU
(`current_target`, with the CUDA its wheels are built for checked against the driver), and an engine read from
its file by a stream reader over a read-only mapping (`deserialize_engine`). engines/build.py checks the
environment with these before it builds; the runner loads its engine with them.
"""

from __future__ import annotations

import mmap
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refusion.runtime.core.engines_manifest import Target
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.runners.cuda import device_info, require_driver

if TYPE_CHECKING:
    import tensorrt

MIN_TENSORRT = (10, 1)  # the V2 device memory API: IExecutionContext.set_device_memory(ptr, size)


def require_tensorrt() -> None:
    """Fail with the install hint when TensorRT cannot be imported (callers then import it typed).
    A module without __version__ is a stub folder seen as a namespace package, not TensorRT."""
    hint = ("pip install 'refusion-trt[trt]' on a machine with an NVIDIA GPU (TensorRT for CUDA 12, any driver >= "
            "525; 'refusion-trt[trt-cu13]' for CUDA 13, drivers >= 580; on Jetson, JetPack's python3-libnvinfer; "
            "see docs/tensorrt.md).")
    try:
        import tensorrt
    except ImportError as e:
        raise RefusionError(f"TensorRT is not installed: {hint}") from e
    if not hasattr(tensorrt, "__version__"):
        raise RefusionError(f"`import tensorrt` finds only {list(tensorrt.__path__)} (type stubs?), not TensorRT: {hint}")
    version = str(tensorrt.__version__)
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) < MIN_TENSORRT:
        raise RefusionError(
            f"TensorRT {version} is installed; refusion-trt needs TensorRT >= 10.1 (its runner gives contexts their "
            "activation memory with set_device_memory(ptr, size)). pip install 'refusion-trt[trt]' (on Jetson: JetPack "
            "6.1 or later, which ships TensorRT 10.3), then rebuild the engines with it."
        )


def current_target() -> Target:
    """This machine's TensorRT and GPU (imports tensorrt and cuda-python, creates no engine), once
    TensorRT's CUDA is checked against the driver."""
    require_tensorrt()
    import tensorrt

    major = tensorrt_cuda()
    if major is not None:
        require_driver(f"TensorRT {tensorrt.__version__} (tensorrt-cu{major})", (major, 0),
                       f"pip uninstall the tensorrt-cu{major} packages and pip install 'refusion-trt[trt-cu12]'")
    gpu, capability = device_info()
    return Target(str(tensorrt.__version__), gpu, capability)


def tensorrt_cuda() -> int | None:
    """The CUDA major the installed TensorRT wheels are built for, as their names say (tensorrt-cu12,
    tensorrt-cu13 and their -libs and -bindings; plain `tensorrt` installs one of them, cu13 from 10.16).
    None for JetPack's Debian packages, which are no wheels and come with the system's CUDA."""
    from importlib import metadata

    names = ((d.metadata["Name"] or "").lower() for d in metadata.distributions())
    majors = {int(found[1]) for name in names if (found := re.fullmatch(r"tensorrt[-_]cu(\d+)(?:[-_].*)?", name))}
    return max(majors, default=None)


def deserialize_engine(runtime: tensorrt.Runtime, path: Path) -> tensorrt.ICudaEngine | None:
    """An engine read from its file by a TensorRT stream reader over a read-only mapping: the
    reader hands out views of the mapped file (page cache), never a copy of it."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        return runtime.deserialize_cuda_engine(_stream_reader(_MappedFile(mapped)))


class _MappedFile:
    """A position in a mapped file; reads are views of the mapping, not copies."""

    def __init__(self, mapped: mmap.mmap):
        self.mapped, self.pos = mapped, 0

    def read(self, nbytes: int) -> memoryview:
        view = memoryview(self.mapped)[self.pos:self.pos + max(nbytes, 0)]
        self.pos += len(view)
        return view

    def seek(self, offset: int, whence: int) -> bool:
        """whence as in io: 0 from the start, 1 from the position, 2 from the end (TensorRT's SeekPosition)."""
        pos = offset + (0, self.pos, len(self.mapped))[whence]
        if not 0 <= pos <= len(self.mapped):
            return False
        self.pos = pos
        return True


def _stream_reader(source: _MappedFile) -> Any:
    """TensorRT's IStreamReaderV2 (10.7+; the binding copies what read returns to device or host
    destinations, asking again until it has all it asked for), else IStreamReader (10.1-10.6).
    The Python overrides take other arguments than the C++ methods the stubs describe."""
    import tensorrt as trt

    if hasattr(trt, "IStreamReaderV2"):
        class ReaderV2(trt.IStreamReaderV2):
            def __init__(self) -> None:
                trt.IStreamReaderV2.__init__(self)

            def read(self, num_bytes: int, stream: int) -> memoryview:  # type: ignore[override]
                return source.read(num_bytes)

            def seek(self, offset: int, where: tensorrt.SeekPosition) -> bool:
                return source.seek(offset, int(where))

        return ReaderV2()

    class Reader(trt.IStreamReader):
        def __init__(self) -> None:
            trt.IStreamReader.__init__(self)

        def read(self, size: int) -> memoryview:  # type: ignore[override]
            return source.read(size)  # never more than asked: the binding copies at most `size` bytes

    return Reader()

"""CPU stand-ins for cuda-python's runtime module and for TensorRT, strict where the real ones are.

"Device" memory is aligned host memory, so the runner's pointer arithmetic runs for real:
every copy and every engine read or write is bounds-checked against live allocations, an
overlapping device-to-device copy fails (cudaMemcpy leaves it undefined), and a tensor
address that is not 256-byte aligned is refused, as TensorRT documents. A fake engine is a
JSON blob naming its ONNX graph and profiles; executing it runs the graph on onnxruntime
over the bound device memory and writes the outputs where they are bound. Input shapes
outside the active profile are refused, as TensorRT refuses them.
"""

from __future__ import annotations

import ctypes
import enum
import json
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from types import SimpleNamespace
from typing import Any

import numpy as np

from refusion.engines.build import BuildPlan
from refusion.runtime.core.contract import GraphName


class FakeCudart:
    class cudaError_t(enum.Enum):
        cudaSuccess = 0
        cudaErrorInvalidValue = 1
        cudaErrorMemoryAllocation = 2

    class cudaMemcpyKind(enum.Enum):
        cudaMemcpyHostToDevice = 1
        cudaMemcpyDeviceToHost = 2
        cudaMemcpyDeviceToDevice = 3

    def __init__(self, memory_limit: int = 1 << 30):
        self.allocations: dict[int, tuple[np.ndarray, int]] = {}
        self.memory_limit = memory_limit
        self.copies: list[tuple[str, int]] = []  # (kind, bytes), for assertions
        self.streams = 0
        self.syncs = 0

    # memory
    def cudaMalloc(self, nbytes: int):
        if nbytes + self.used > self.memory_limit:
            return (self.cudaError_t.cudaErrorMemoryAllocation, 0)
        backing = np.zeros(nbytes + 256, np.uint8)
        ptr = (backing.ctypes.data + 255) // 256 * 256
        self.allocations[ptr] = (backing, nbytes)
        return (self.cudaError_t.cudaSuccess, ptr)

    def cudaFree(self, ptr: int):
        if ptr not in self.allocations:
            return (self.cudaError_t.cudaErrorInvalidValue,)
        del self.allocations[ptr]
        return (self.cudaError_t.cudaSuccess,)

    @property
    def used(self) -> int:
        return sum(n for _, n in self.allocations.values())

    def check_device(self, ptr: int, nbytes: int) -> None:
        for base, (_, size) in self.allocations.items():
            if base <= ptr and ptr + nbytes <= base + size:
                return
        raise AssertionError(f"device access [{ptr:#x}, +{nbytes}) outside every live allocation")

    def cudaMemcpyAsync(self, dst: int, src: int, nbytes: int, kind, stream):
        K = self.cudaMemcpyKind
        if kind in (K.cudaMemcpyDeviceToHost, K.cudaMemcpyDeviceToDevice):
            self.check_device(src, nbytes)
        if kind in (K.cudaMemcpyHostToDevice, K.cudaMemcpyDeviceToDevice):
            self.check_device(dst, nbytes)
        if kind == K.cudaMemcpyDeviceToDevice and src < dst + nbytes and dst < src + nbytes:
            raise AssertionError("overlapping device-to-device cudaMemcpy is undefined")
        ctypes.memmove(dst, src, nbytes)
        self.copies.append((kind.name, nbytes))
        return (self.cudaError_t.cudaSuccess,)

    # streams and device
    def cudaStreamCreate(self):
        self.streams += 1
        return (self.cudaError_t.cudaSuccess, 1000 + self.streams)

    def cudaStreamSynchronize(self, stream):
        self.syncs += 1
        return (self.cudaError_t.cudaSuccess,)

    def cudaStreamDestroy(self, stream):
        return (self.cudaError_t.cudaSuccess,)

    def cudaGetDevice(self):
        return (self.cudaError_t.cudaSuccess, 0)

    def cudaGetDeviceProperties(self, device: int):
        return (self.cudaError_t.cudaSuccess, SimpleNamespace(name=b"Fake GPU\x00\x00", major=9, minor=0))

    def cudaGetErrorName(self, err):
        return (self.cudaError_t.cudaSuccess, err.name.encode())


# -- TensorRT ----------------------------------------------------------------------------------
_TRT_NAMES = {"float32": "FLOAT", "float16": "HALF", "int64": "INT64", "bool": "BOOL"}


class _Mode(enum.Enum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


@dataclass(frozen=True)
class _DataType:
    name: str


def fake_engine_bytes(plan: BuildPlan, graph: GraphName) -> bytes:
    """What a build of `graph` under `plan` would describe: its ONNX file, I/O and profiles."""
    spec = plan.export.graphs[graph]
    return json.dumps({
        "onnx": str(plan.onnx_path(graph)),
        "io": [[t.name, "in", t.dtype] for t in spec.inputs] + [[t.name, "out", t.dtype] for t in spec.outputs],
        "profiles": [{k: [list(s) for s in v] for k, v in p.shapes(spec).items()} for p in plan.profiles[graph]],
    }).encode()


class FakeTensorRT:
    """The slice of the tensorrt module the runner and the build helpers use."""

    __version__ = "10.13.0.35"
    __spec__ = ModuleSpec("tensorrt", None)  # importlib.util.find_spec (torch asks) needs one
    TensorIOMode = _Mode
    float32, float16, bfloat16 = _DataType("FLOAT"), _DataType("HALF"), _DataType("BF16")
    ExecutionContextAllocationStrategy = SimpleNamespace(USER_MANAGED="user-managed")
    MemoryPoolType = SimpleNamespace(WORKSPACE="workspace")

    class Logger:
        WARNING = 2

        def __init__(self, severity: int):
            self.severity = severity

    class IProgressMonitor:
        def __init__(self) -> None:
            pass

    def __init__(self, cudart: FakeCudart):
        self.cudart = cudart
        fake = self

        class Runtime:
            def __init__(self, logger: Any):
                self.logger = logger

            def deserialize_cuda_engine(self, data: bytes) -> Any:
                try:
                    return _Engine(json.loads(data), fake)
                except ValueError:
                    return None

        self.Runtime = Runtime


class _Engine:
    device_memory_size_v2 = 4096

    def __init__(self, spec: dict, trt: FakeTensorRT):
        import onnxruntime

        self.spec, self.trt = spec, trt
        self.io = [(name, mode, dtype) for name, mode, dtype in spec["io"]]
        self.profiles = spec["profiles"]
        opts = onnxruntime.SessionOptions()
        opts.intra_op_num_threads = 1
        self.session = onnxruntime.InferenceSession(spec["onnx"], opts, providers=["CPUExecutionProvider"])

    @property
    def num_io_tensors(self) -> int:
        return len(self.io)

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.profiles)

    def get_tensor_name(self, i: int) -> str:
        return self.io[i][0]

    def _entry(self, name: str) -> tuple[str, str, str]:
        return next(e for e in self.io if e[0] == name)

    def get_tensor_mode(self, name: str) -> _Mode:
        return _Mode.INPUT if self._entry(name)[1] == "in" else _Mode.OUTPUT

    def get_tensor_dtype(self, name: str) -> _DataType:
        return _DataType(_TRT_NAMES[self._entry(name)[2]])

    def create_execution_context(self, strategy: str) -> _Context:
        assert strategy == "user-managed"
        return _Context(self)


class _Context:
    def __init__(self, engine: _Engine):
        self.engine = engine
        self.profile: int | None = None
        self.memory: tuple[int, int] | None = None
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.runs = 0

    def set_device_memory(self, ptr: int, size: int) -> None:
        assert size >= self.engine.device_memory_size_v2
        self.engine.trt.cudart.check_device(ptr, size)
        self.memory = (ptr, size)

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        self.profile = index
        return 0 <= index < self.engine.num_optimization_profiles

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        assert self.profile is not None
        lo, _, hi = self.engine.profiles[self.profile][name]
        if len(shape) != len(lo) or any(not a <= s <= b for a, s, b in zip(lo, shape, hi)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        if ptr % 256:
            return False
        self.addresses[name] = ptr
        return True

    def execute_async_v3(self, stream: int) -> bool:
        assert self.memory is not None, "no device memory for a user-managed context"
        cudart = self.engine.trt.cudart
        feed = {}
        for name, mode, dtype in self.engine.io:
            if mode == "in":
                shape, dt = self.shapes[name], np.dtype(dtype)
                nbytes = int(np.prod(shape)) * dt.itemsize
                if nbytes:
                    cudart.check_device(self.addresses[name], nbytes)
                    raw = (ctypes.c_char * nbytes).from_address(self.addresses[name])
                    feed[name] = np.frombuffer(raw, dtype=dt).reshape(shape).copy()
                else:
                    feed[name] = np.zeros(shape, dt)
        names = [name for name, mode, _ in self.engine.io if mode == "out"]
        for name, value in zip(names, self.engine.session.run(names, feed)):
            out = np.ascontiguousarray(value)
            cudart.check_device(self.addresses[name], out.nbytes)
            ctypes.memmove(self.addresses[name], out.ctypes.data, out.nbytes)
        self.runs += 1
        return True

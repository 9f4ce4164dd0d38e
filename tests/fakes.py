"""CPU stand-ins for cuda-python's runtime module and for TensorRT, strict where the real ones are.

"Device" memory is aligned host memory, so the runner's pointer arithmetic runs for real:
every copy and every engine read or write is bounds-checked against live allocations, an
overlapping device-to-device copy fails (cudaMemcpy leaves it undefined), freeing memory that
work queued on a stream still uses fails (until that stream is synchronized), and a tensor
address that is not 256-byte aligned is refused, as TensorRT documents. A fake engine is a
JSON blob naming its ONNX graph, tensors and profiles; executing it runs the graph on
onnxruntime over the bound device memory and writes the outputs where they are bound, after
checking that no input, empty or not, is bound where an output is written. Input shapes
outside the active profile are refused, as TensorRT refuses them. Where the Python bindings
differ from the C++ API they wrap, the fakes do as the bindings do: set_optimization_profile_async
raises RuntimeError instead of returning False, stream readers are called as the binding calls
their Python overrides (IStreamReaderV2: read(num_bytes, stream), asked again until all bytes
came; IStreamReader: read(size), of which at most `size` bytes are copied). cudaMalloc'd memory
starts as 0xFF bytes (NaN as floats), not zeros: the real one is not cleared either.

`FakeRunner` is a model, not a device: a deterministic numpy Runner over an export's dims (`fake_manifest`), for
the scheduler's tests without torch or onnxruntime.
"""

from __future__ import annotations

import ctypes
import enum
import json
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from refusion.engines.build import BuildPlan
from refusion.runtime.core.contract import DEFAULT_CANDIDATES, GraphName, candidates_for, graph_specs, mask_bytes
from refusion.runtime.core.defaults import DecodeDefaults
from refusion.runtime.core.dims import ModelDims
from refusion.runtime.core.engines_manifest import ENGINE_GRAPH
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.decode.masks import causal_after
from refusion.runtime.runners.base import Runner
from refusion.runtime.runners.kv_pool import HostKVPool
from refusion.runtime.runners.onnxruntime import OrtCudaRunner
from refusion.runtime.runners.rows import RowFeed
from refusion.runtime.structured.engine import Grammar, Matcher
from refusion.runtime.tokenizer import TOKENIZER_FILES


class FakeCudart:
    class cudaError_t(enum.Enum):
        cudaSuccess = 0
        cudaErrorInvalidValue = 1
        cudaErrorMemoryAllocation = 2
        cudaErrorInvalidPitchValue = 12

    class cudaMemcpyKind(enum.Enum):
        cudaMemcpyHostToDevice = 1
        cudaMemcpyDeviceToHost = 2
        cudaMemcpyDeviceToDevice = 3

    cudaStreamNonBlocking = 1
    cudaEventBlockingSync, cudaEventDisableTiming = 1, 2

    def __init__(self, memory_limit: int = 1 << 30):
        self.allocations: dict[int, tuple[np.ndarray, int]] = {}
        self.host_allocations: dict[int, tuple[np.ndarray, int]] = {}  # cudaMallocHost's (pinned)
        self.memory_limit = memory_limit
        self.copies: list[tuple[str, int]] = []  # (kind, bytes), for assertions
        self.pending: dict[int, dict[int, int]] = {}  # allocation (device or pinned) -> {stream: its last work's number}
        self.work = 0  # numbers queued work, so an event covers only what was queued before it was recorded
        self.stream_flags: dict[int, int] = {}  # stream -> the flags it was made with
        self.events: dict[int, tuple[int, int, dict[int, int]]] = {}  # event -> (flags, stream, work it covers)
        self.streams = 0
        self.syncs = 0  # waits: stream and event synchronizations
        self.event_syncs = 0
        self.pinned_reads = 0  # device-to-host copies into cudaMallocHost memory
        self.pinned_uploads = 0  # host-to-device copies from it
        self.copies_2d = 0  # cudaMemcpy2DAsync calls (each one entry of `copies`, all its rows' bytes)
        self.memsets = 0
        self.driver_version = self.runtime_version = 12060  # CUDA 12.6, as cuda(Driver|Runtime)GetVersion encode it
        self.integrated = 0  # cudaDeviceProp.integrated: 1 on Jetson
        self.mem_pitch = 2**31 - 1  # cudaDeviceProp.memPitch: the largest pitch a 2D copy takes (2 GiB on GPUs)

    # memory
    def cudaMalloc(self, nbytes: int):
        if nbytes + self.used > self.memory_limit:
            return (self.cudaError_t.cudaErrorMemoryAllocation, 0)
        backing = np.full(nbytes + 256, 0xFF, np.uint8)  # cudaMalloc does not clear: 0xFF.. is NaN as a float
        ptr = (backing.ctypes.data + 255) // 256 * 256
        self.allocations[ptr] = (backing, nbytes)
        return (self.cudaError_t.cudaSuccess, ptr)

    def cudaMallocHost(self, nbytes: int):
        backing = np.full(nbytes + 256, 0xFF, np.uint8)
        ptr = (backing.ctypes.data + 255) // 256 * 256
        self.host_allocations[ptr] = (backing, nbytes)
        return (self.cudaError_t.cudaSuccess, ptr)

    def cudaFreeHost(self, ptr: int):
        if ptr not in self.host_allocations:
            return (self.cudaError_t.cudaErrorInvalidValue,)
        if self.pending.get(ptr):
            raise AssertionError(f"cudaFreeHost of pinned memory that work queued on stream(s) {self.pending[ptr]} "
                                 "still uses")
        del self.host_allocations[ptr]
        self.pending.pop(ptr, None)
        return (self.cudaError_t.cudaSuccess,)

    def cudaFree(self, ptr: int):
        if ptr not in self.allocations:
            return (self.cudaError_t.cudaErrorInvalidValue,)
        if self.pending.get(ptr):
            raise AssertionError(f"cudaFree of memory that work queued on stream(s) {self.pending[ptr]} still uses")
        del self.allocations[ptr]
        self.pending.pop(ptr, None)
        return (self.cudaError_t.cudaSuccess,)

    def cudaMemGetInfo(self):
        return (self.cudaError_t.cudaSuccess, self.memory_limit - self.used, self.memory_limit)

    @property
    def used(self) -> int:
        return sum(n for _, n in self.allocations.values())

    def check_device(self, ptr: int, nbytes: int) -> int:
        """The allocation [ptr, ptr + nbytes) lies in."""
        for base, (_, size) in self.allocations.items():
            if base <= ptr and ptr + nbytes <= base + size:
                return base
        raise AssertionError(f"device access [{ptr:#x}, +{nbytes}) outside every live allocation")

    def queue(self, ptr: int, nbytes: int, stream: int) -> None:
        """Work on `stream` uses [ptr, ptr + nbytes) until the stream is synchronized."""
        self._queue_at(self.check_device(ptr, nbytes), stream)

    def _queue_at(self, allocation: int, stream: int) -> None:
        self.work += 1
        self.pending.setdefault(allocation, {})[stream] = self.work

    def pinned(self, ptr: int, nbytes: int) -> int | None:
        """The pinned allocation [ptr, ptr + nbytes) lies in; None for pageable host memory."""
        return next((base for base, (_, size) in self.host_allocations.items()
                     if base <= ptr and ptr + nbytes <= base + size), None)

    def cudaMemcpyAsync(self, dst: int, src: int, nbytes: int, kind, stream):
        K = self.cudaMemcpyKind
        if kind in (K.cudaMemcpyDeviceToHost, K.cudaMemcpyDeviceToDevice):
            self.queue(src, nbytes, stream)
        if kind in (K.cudaMemcpyHostToDevice, K.cudaMemcpyDeviceToDevice):
            self.queue(dst, nbytes, stream)
        host = self.pinned(dst, nbytes) if kind == K.cudaMemcpyDeviceToHost else None
        if host is not None:
            self._queue_at(host, stream)
            self.pinned_reads += 1
        source = self.pinned(src, nbytes) if kind == K.cudaMemcpyHostToDevice else None
        if source is not None:  # the copy reads it until the stream gets there: no freeing it before
            self._queue_at(source, stream)
            self.pinned_uploads += 1
        if kind == K.cudaMemcpyDeviceToDevice and src < dst + nbytes and dst < src + nbytes:
            raise AssertionError("overlapping device-to-device cudaMemcpy is undefined")
        ctypes.memmove(dst, src, nbytes)
        self.copies.append((kind.name, nbytes))
        return (self.cudaError_t.cudaSuccess,)

    def cudaMemcpy2DAsync(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind,
                          stream):
        """`height` rows of `width` bytes, each checked as one cudaMemcpyAsync; no copied byte may be one
        another row writes (CUDA: "the memory areas may not overlap")."""
        if width > dpitch or width > spitch or max(dpitch, spitch) > self.mem_pitch:
            return (self.cudaError_t.cudaErrorInvalidPitchValue,)
        reads = [(src + i * spitch, src + i * spitch + width) for i in range(height)]
        writes = [(dst + i * dpitch, dst + i * dpitch + width) for i in range(height)]
        if kind == self.cudaMemcpyKind.cudaMemcpyDeviceToDevice:
            assert not any(a < d and c < b for a, b in reads for c, d in writes), "overlapping 2D copy is undefined"
        copies = len(self.copies)
        for (r, _), (w, _) in zip(reads, writes):
            self.cudaMemcpyAsync(w, r, width, kind, stream)
        del self.copies[copies:]
        self.copies.append((kind.name, width * height))
        self.copies_2d += 1
        return (self.cudaError_t.cudaSuccess,)

    def cudaMemsetAsync(self, ptr: int, value: int, nbytes: int, stream):
        self.queue(ptr, nbytes, stream)
        ctypes.memset(ptr, value, nbytes)
        self.memsets += 1
        return (self.cudaError_t.cudaSuccess,)

    # streams, events and device (no cudaStreamCreate: the runners' streams must be non-blocking)
    def cudaStreamCreateWithFlags(self, flags: int):
        self.streams += 1
        self.stream_flags[1000 + self.streams] = flags
        return (self.cudaError_t.cudaSuccess, 1000 + self.streams)

    def cudaStreamSynchronize(self, stream):
        self.syncs += 1
        for streams in self.pending.values():
            streams.pop(stream, None)
        return (self.cudaError_t.cudaSuccess,)

    def cudaEventCreateWithFlags(self, flags: int):
        event = 5000 + len(self.events)
        self.events[event] = (flags, 0, {})
        return (self.cudaError_t.cudaSuccess, event)

    def cudaEventRecord(self, event: int, stream: int):
        """A wait on the event covers the work queued on `stream` so far, not what comes after."""
        flags = self.events[event][0]
        self.events[event] = (flags, stream, {ptr: streams[stream] for ptr, streams in self.pending.items()
                                              if stream in streams})
        return (self.cudaError_t.cudaSuccess,)

    def cudaEventSynchronize(self, event: int):
        self.syncs += 1
        self.event_syncs += 1
        _, stream, covered = self.events[event]
        for ptr, work in covered.items():
            if self.pending.get(ptr, {}).get(stream) == work:
                del self.pending[ptr][stream]
        return (self.cudaError_t.cudaSuccess,)

    def cudaEventDestroy(self, event: int):
        del self.events[event]
        return (self.cudaError_t.cudaSuccess,)

    def cudaDriverGetVersion(self):
        return (self.cudaError_t.cudaSuccess, self.driver_version)

    def cudaRuntimeGetVersion(self):
        return (self.cudaError_t.cudaSuccess, self.runtime_version)

    def cudaStreamDestroy(self, stream):
        return (self.cudaError_t.cudaSuccess,)

    def cudaGetDevice(self):
        return (self.cudaError_t.cudaSuccess, 0)

    def cudaGetDeviceProperties(self, device: int):
        return (self.cudaError_t.cudaSuccess, SimpleNamespace(name=b"Fake GPU\x00\x00", major=9, minor=0,
                                                              integrated=self.integrated, memPitch=self.mem_pitch))

    def cudaGetErrorName(self, err):
        return (self.cudaError_t.cudaSuccess, err.name.encode())


# -- TensorRT ----------------------------------------------------------------------------------
_TRT_NAMES = {"float32": "FLOAT", "float16": "HALF", "int64": "INT64", "bool": "BOOL", "uint8": "UINT8"}


class _Mode(enum.Enum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


@dataclass(frozen=True)
class _DataType:
    name: str


_MAGIC = b"FAKE-TRT"  # then the JSON's length (8 bytes, little-endian), then the JSON


def fake_engine_bytes(plan: BuildPlan) -> bytes:
    """What the build under `plan` would describe: its ONNX file, I/O (with axes) and profiles."""
    spec = plan.export.graphs[ENGINE_GRAPH]
    body = json.dumps({
        "onnx": str(plan.onnx_path),
        "io": [[t.name, "in", t.dtype, list(t.axes)] for t in spec.inputs]
        + [[t.name, "out", t.dtype, list(t.axes)] for t in spec.outputs],
        "profiles": [{k: [list(s) for s in v] for k, v in p.shapes(spec).items()} for p in plan.profiles],
    }).encode()
    return _MAGIC + len(body).to_bytes(8, "little") + body


def _parse_engine(data: bytes) -> dict | None:
    if data[:8] != _MAGIC or int.from_bytes(data[8:16], "little") != len(data) - 16:
        return None
    try:
        return json.loads(data[16:])
    except ValueError:
        return None


class _SeekPosition(enum.IntEnum):
    SET = 0
    CUR = 1
    END = 2


class FakeTensorRT:
    """The slice of the tensorrt module the runner and the build helpers use."""

    __version__ = "10.13.0.35"
    __spec__ = ModuleSpec("tensorrt", None)  # importlib.util.find_spec (torch asks) needs one
    TensorIOMode = _Mode
    SeekPosition = _SeekPosition
    IStreamReader = type("IStreamReader", (), {})  # bases for the runner's readers
    IStreamReaderV2 = type("IStreamReaderV2", (), {})  # TensorRT >= 10.7
    float32, float16, bfloat16, bool = _DataType("FLOAT"), _DataType("HALF"), _DataType("BF16"), _DataType("BOOL")
    ExecutionContextAllocationStrategy = SimpleNamespace(USER_MANAGED="user-managed")
    MemoryPoolType = SimpleNamespace(WORKSPACE="workspace")
    LayerInformationFormat = SimpleNamespace(ONELINE="oneline", JSON="json")

    class Logger:
        WARNING = 2

        def __init__(self, severity: int):
            self.severity = severity

    class IProgressMonitor:
        def __init__(self) -> None:
            pass

    def __init__(self, cudart: FakeCudart):
        self.cudart = cudart
        self.reads: list[tuple[int, int, str]] = []  # stream reader calls: (asked, returned, type of what came)
        fake = self

        class Runtime:
            def __init__(self, logger: Any):
                self.logger = logger

            def deserialize_cuda_engine(self, source: Any) -> Any:
                if isinstance(source, getattr(fake, "IStreamReaderV2", ())):  # absent before TensorRT 10.7
                    data = fake.read_v2(source)
                elif isinstance(source, fake.IStreamReader):
                    data = fake.read_v1(source)
                else:
                    data = bytes(memoryview(source))
                spec = _parse_engine(data) if data is not None else None
                return _Engine(spec, fake) if spec is not None else None

        self.Runtime = Runtime

    def _take(self, reader_read: Any, asked: int, *args: Any) -> memoryview:
        got = reader_read(asked, *args)
        view = memoryview(got)
        self.reads.append((asked, view.nbytes, type(got).__name__))
        return view

    def read_v2(self, reader: Any) -> bytes | None:
        """Header, then back to the start and the whole engine, as a reader of sections would; each
        read asked again until all its bytes came (the binding's loop), None when one returns nothing."""

        def exactly(n: int) -> bytes | None:
            out = bytearray()
            while len(out) < n:
                chunk = self._take(reader.read, n - len(out), 1234)
                if not chunk.nbytes:
                    return None  # the binding: "User aborted the operation"
                out += chunk[: n - len(out)]
            return bytes(out)

        header = exactly(16)
        if header is None or not reader.seek(0, _SeekPosition.SET):
            return None
        return exactly(16 + int.from_bytes(header[8:], "little"))

    def read_v1(self, reader: Any) -> bytes | None:
        """Header, then the rest; a read must return what it was asked for."""

        def exactly(n: int) -> bytes | None:
            got = self._take(reader.read, n)
            assert got.nbytes <= n, "the binding copies at most `size` bytes but reports all that came"
            return bytes(got) if got.nbytes == n else None

        header = exactly(16)
        body = exactly(int.from_bytes(header[8:], "little")) if header is not None else None
        return header + body if header is not None and body is not None else None


class _Engine:
    device_memory_size_v2 = 4096

    def __init__(self, spec: dict, trt: FakeTensorRT):
        import onnxruntime

        self.spec, self.trt = spec, trt
        self.io = [(name, mode, dtype) for name, mode, dtype, _ in spec["io"]]
        self.axes = {name: axes for name, _, _, axes in spec["io"]}
        self.profiles = spec["profiles"]
        opts = onnxruntime.SessionOptions()
        opts.intra_op_num_threads = 1
        # int4 graphs: TensorRT dequantizes the weights and runs a float GEMM, as MatMulNBits' accuracy level 1 does
        opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
        self.session = onnxruntime.InferenceSession(spec["onnx"], opts, providers=["CPUExecutionProvider"])

    @property
    def num_io_tensors(self) -> int:
        return len(self.io)

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.profiles)

    def get_tensor_name(self, i: int) -> str:
        return self.io[i][0]

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[list[int]]:
        """An input's min, opt and max shapes in a profile, as built."""
        return [list(shape) for shape in self.profiles[profile_index][name]]

    def _entry(self, name: str) -> tuple[str, str, str]:
        return next(e for e in self.io if e[0] == name)

    def get_tensor_mode(self, name: str) -> _Mode:
        return _Mode.INPUT if self._entry(name)[1] == "in" else _Mode.OUTPUT

    def get_tensor_dtype(self, name: str) -> _DataType:
        return _DataType(_TRT_NAMES[self._entry(name)[2]])

    def create_execution_context(self, strategy: str) -> _Context:
        assert strategy == "user-managed"
        return _Context(self)

    def create_engine_inspector(self) -> _Inspector:
        return _Inspector(self)


class _Inspector:
    """The engine inspector of a strongly typed build without fusion: a layer per ONNX node, its outputs in the
    graph's types; formats only for a context with bound shapes, as TensorRT gives them."""

    _FORMATS = {1: "Row major linear FP32", 10: "Row major linear FP16 format", 16: "Row major linear BF16",
                7: "Row major linear Int64", 9: "Row major linear BOOL"}

    def __init__(self, engine: _Engine):
        self.engine = engine
        self.execution_context: _Context | None = None

    def get_engine_information(self, format: str) -> str:
        import onnx

        assert format == "json"
        model = onnx.shape_inference.infer_shapes(onnx.load(self.engine.spec["onnx"], load_external_data=False))
        types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.value_info, *model.graph.output]}
        bound = self.execution_context is not None and bool(self.execution_context.shapes)
        layers = [{"Name": node.name, "LayerType": node.op_type, "Metadata": f"[ONNX Layer: {node.name}]",
                   "Outputs": [{"Name": o, "Format/Datatype": self._FORMATS.get(types.get(o, 0), "Unknown")
                                if bound else "N/A due to dynamic shapes"} for o in node.output]}
                  for node in model.graph.node]
        return json.dumps({"Layers": layers, "Bindings": [name for name, _, _ in self.engine.io]})


class _Context:
    def __init__(self, engine: _Engine):
        self.engine = engine
        self.profile: int | None = None
        self.memory: tuple[int, int] | None = None
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.runs = 0
        self.shape_queries = 0

    def set_device_memory(self, ptr: int, size: int) -> None:
        assert size >= self.engine.device_memory_size_v2
        self.engine.trt.cudart.check_device(ptr, size)
        self.memory = (ptr, size)

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        """The binding raises where IExecutionContext::setOptimizationProfileAsync returns false."""
        if not 0 <= index < self.engine.num_optimization_profiles:
            raise RuntimeError("Error in set optimization profile async.")
        self.profile = index
        return True

    def infer_shapes(self) -> list[str]:
        """Names of the inputs without a shape (what TensorRT cannot infer outputs without)."""
        self.shape_queries += 1
        return [name for name, mode, _ in self.engine.io if mode == "in" and name not in self.shapes]

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        """An input's shape as set; an output's from its axes, resolved by the inputs' shapes."""
        if name in self.shapes:
            return self.shapes[name]
        sizes = {a: s for n, shape in self.shapes.items() for a, s in zip(self.engine.axes[n], shape)}
        return tuple(sizes.get(a, -1) if isinstance(a, str) else a for a in self.engine.axes[name])

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
        cudart.queue(*self.memory, stream)
        feed, reads = {}, {}
        for name, mode, dtype in self.engine.io:
            if mode == "in":
                shape, dt = self.shapes[name], np.dtype(dtype)
                nbytes = int(np.prod(shape)) * dt.itemsize
                reads[name] = (self.addresses[name], max(nbytes, 1))  # an empty tensor still has an address
                cudart.queue(*reads[name], stream)
                raw = (ctypes.c_char * nbytes).from_address(self.addresses[name])
                feed[name] = np.frombuffer(raw, dtype=dt).reshape(shape).copy()
        names = [name for name, mode, _ in self.engine.io if mode == "out"]
        for name, value in zip(names, self.engine.session.run(names, feed)):
            out = np.ascontiguousarray(value)
            ptr = self.addresses[name]
            assert out.shape == self.get_tensor_shape(name), (name, out.shape)
            for other, (start, size) in reads.items():
                assert ptr + out.nbytes <= start or start + size <= ptr, f"{name} is written where {other} is read"
            cudart.queue(ptr, out.nbytes, stream)
            ctypes.memmove(ptr, out.ctypes.data, out.nbytes)
        self.runs += 1
        return True


class CpuBoundCudaRunner(OrtCudaRunner):
    """OrtCudaRunner's own code (KV regions, gathers, scatters, IO binding by address) over the fake
    cuda-python, whose "device" memory is host memory: onnxruntime's CPU provider reads and writes
    it through the same bindings, by pointer. What only CUDA shows is tools/checks/gpu.py's."""

    provider = "CPUExecutionProvider"
    device = "cpu"


# -- a model in numpy, for the scheduler -----------------------------------------------------------------------
def fake_manifest(checkpoint: Path) -> ExportManifest:
    """refusion.json as an fp32 export of `checkpoint` would record its dims, ids, tokenizer and contract, without
    exporting (nothing of torch, onnx or onnxruntime): no graph or weight file stands behind it, so only a
    FakeRunner runs it. The decode defaults are the paper's, fitted to the positions."""
    config = json.loads((checkpoint / "config.json").read_text())
    dims = ModelDims.from_hf_config(config, str(checkpoint / "config.json"))
    candidates = candidates_for(dims.vocab_size, DEFAULT_CANDIDATES)
    specs = graph_specs(dims.num_layers, dims.kv_heads, dims.head_dim, dims.vocab_size, "float32", False, candidates)
    return ExportManifest(
        path=checkpoint, dims=dims, dtype="float32", mask_token_id=config["mask_token_id"],
        eos_token_id=config["eos_token_id"], defaults=DecodeDefaults().clamped(dims.max_position_embeddings),
        graphs=specs, opset=17, has_logits=False, candidates=candidates, weights={},
        tokenizer_files=tuple(f for f in TOKENIZER_FILES if (checkpoint / f).is_file()), files={})


class FakeRunner(Runner):
    """A deterministic model in numpy behind the real Runner (its checks, stats and KV methods, a HostKVPool).

    A token's KV is one number, its id and position (id x 1024 + position), written where the forward's write_at
    says; what a forward outputs at a head is a function of exactly the tokens that head attends to, its own fed
    tokens and its past read back from its request's region. So a request decodes the same tokens alone or batched
    beside others, and a scheduler that fed a wrong past, another request's region, a KV move gone wrong or a stale
    prefix would change them. The prediction: a hash of the attended (id, position) pairs picks the argmax (never
    the mask; EOS about once in `eos_every`) and its probability in [0.3, 1); the other candidates follow with
    falling probabilities, and `input_probs` reads the next fed token's probability from the same list."""

    name = "fake"

    def __init__(self, manifest: ExportManifest, max_requests: int = 4, max_batch: int = 4, eos_every: int = 40):
        self.max_requests, self.max_batch = max_requests, max_batch
        super().__init__(manifest)
        self.eos_every = eos_every
        self._vocab = [t for t in range(manifest.vocab_size) if t not in (manifest.mask_token_id, manifest.eos_token_id)]

    def prefill(self, region: int, ids: list[int]) -> None:
        """A causal forward of `ids` at positions 0, 1, ... into `region`: its KV then holds them."""
        self.allocate_kv(len(ids) + 1, region)
        self.run("infiller", np.array([ids]), np.arange(len(ids))[None], causal_after(0, len(ids)), 0, 0, region)

    def tokens(self, region: int, length: int) -> list[int]:
        """The ids the first `length` tokens of `region` hold KV of."""
        return [int(v) // 1024 for v in self.kv_to_host(0, length, region)["present.0.key"].reshape(-1)]

    def _activate(self) -> None:
        self.kv = HostKVPool(1, 1, 1, np.dtype(np.float32), self.max_requests)

    def _deactivate(self) -> None:
        self.kv = None

    def _run(self, graph: GraphName, rows: list[RowFeed]) -> list[dict[str, np.ndarray]]:
        with self._in_backend(graph):
            return [self._forward(graph, row) for row in rows]

    def _forward(self, graph: GraphName, row: RowFeed) -> dict[str, np.ndarray]:
        assert isinstance(self.kv, HostKVPool)
        cache = self.kv.arrays(row.region)[0]
        ids, pos = row.input_ids[0], row.position_ids[0]
        past = cache[0, : row.past, 0, 0].astype(np.int64)
        keys = np.concatenate([past, ids * 1024 + pos])  # every attendable token as (id, position), one number
        mixed = (keys + 1) * 2654435761 % 2**32  # a multiplicative hash: which ids sit at which positions counts
        heads = row.heads_at[0]
        states = np.where(row.attention_mask[0, heads], mixed[None, :], 0).sum(-1) % 1_000_003
        k = self.manifest.candidates
        allowed = (np.unpackbits(row.vocab_mask[0], axis=-1, bitorder="little").astype(bool)
                   if row.vocab_mask is not None else None)
        top = np.array([self._candidates(int(state), k, None if allowed is None else allowed[h])
                        for h, state in enumerate(states)], np.int64)
        first = 0.3 + 0.7 * (states // 7 % 1000) / 1000
        probs = np.concatenate([first[:, None], (1 - first)[:, None] / 4.0 ** np.arange(1, k)[None]], axis=1)
        if allowed is not None:  # a candidate the mask leaves out has probability 0, as a masked graph's has
            probs = np.where(allowed[np.arange(len(top))[:, None], top], probs, 0.0)
        out = {"argmax_ids": top[None, :, 0], "argmax_probs": first[None].astype(np.float32), "top_ids": top[None],
               "top_logprobs": np.log(probs)[None].astype(np.float32)}
        if graph == "infiller":
            following = ids[np.minimum(heads + 1, len(ids) - 1)]  # the last fed token reads its own
            hit = top == following[:, None]
            out["input_probs"] = np.where(hit.any(1), (probs * hit).sum(1), 1e-4)[None].astype(np.float32)
            cache[0, row.write_at : row.write_at + len(ids), 0, 0] = ids * 1024 + pos
        return out

    def _candidates(self, state: int, k: int, allowed: np.ndarray | None) -> list[int]:
        """The k most likely tokens at a head in this state; under a vocab_mask, the first k it allows, in the same
        order (padded with the last, at probability 0, where it allows fewer)."""
        if allowed is None:
            return [self._candidate(state, j) for j in range(k)]
        found: list[int] = []
        for j in range(len(self._vocab) + 1):
            token = self._candidate(state, j)
            if allowed[token] and token not in found:
                found.append(token)
                if len(found) == k:
                    break
        eos = self.manifest.eos_token_id  # first where this state reads it unmasked, or where it alone is allowed
        found = found or ([eos] if allowed[eos] else [self._candidate(state, 0)])
        return found + found[-1:] * (k - len(found))

    def _candidate(self, state: int, j: int) -> int:
        """The j-th most likely token at a head in this state, distinct for every j < K (37 is prime to the
        vocabulary left); EOS only ever first."""
        if j == 0 and state % self.eos_every == 0:
            return self.manifest.eos_token_id
        return self._vocab[(state + 37 * j) % len(self._vocab)]


class FakeChoice(Grammar):
    """A guide of a few answers, as token ids: a trie. What guided decoding needs of a grammar engine, without one,
    so its loop runs on the FakeRunner (tests/runtime/decode/test_guided_fake.py)."""

    def __init__(self, answers: list[list[int]], vocab_size: int, eos: int):
        self.answers, self.eos, self.width = [tuple(a) for a in answers], eos, mask_bytes(vocab_size)

    def matcher(self) -> Matcher:
        return _ChoiceMatcher(self)


class _ChoiceMatcher(Matcher):
    def __init__(self, guide: FakeChoice):
        self.guide, self.taken = guide, []  # the tokens consumed

    def _next(self, prefix: tuple[int, ...]) -> set[int]:
        """The tokens that may follow `prefix`, the EOS where it is an answer."""
        n = len(prefix)
        tokens = {a[n] for a in self.guide.answers if len(a) > n and a[:n] == prefix}
        return tokens | ({self.guide.eos} if prefix in self.guide.answers else set())

    def allowed(self, out: np.ndarray) -> bool:
        bits = np.zeros(out.size * 8, np.uint8)
        bits[list(self._next(tuple(self.taken)))] = 1
        out[:] = np.packbits(bits, bitorder="little")
        return bool(out.any())

    def valid(self, tokens) -> int:
        prefix = tuple(self.taken)
        for n, token in enumerate(tokens):
            if token not in self._next(prefix):
                return n
            if token == self.guide.eos:
                return n + 1
            prefix += (token,)
        return len(tokens)

    def consume(self, tokens) -> None:
        assert self.valid(tokens) == len(tokens), "consumed what the guide does not allow"
        self.taken += list(tokens)

    def rollback(self, count: int) -> None:
        del self.taken[len(self.taken) - count:]

    def forced(self) -> list[int]:
        run, prefix = [], tuple(self.taken)
        while len(following := self._next(prefix)) == 1 and self.guide.eos not in following:
            run.append(following.pop())
            prefix += (run[-1],)
        return run

    @property
    def finished(self) -> bool:
        return self._next(tuple(self.taken)) == {self.guide.eos}

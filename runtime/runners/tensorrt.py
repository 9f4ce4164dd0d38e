"""The TensorRT Runner: planner and infiller engines on one CUDA stream, KV cache on the device.

Loading verifies engines.json (TensorRT version, GPU, engine sha256) before deserializing.
Each (engine, profile) pair gets its own execution context, set to that profile once, and
all contexts share one activation buffer: forwards are serialized on the stream, so only
one context ever runs at a time. A forward binds the cache's committed prefix as past
(base address, shape [1, past, H, D]) and the infiller's present straight into the cache at
`write_at`; only ids, positions and the mask go up, and only the small heads come back.

TensorRT wants every tensor address 256-byte aligned. A cache slot is aligned when a
token's KV per layer is a multiple of 256 bytes (kv_heads x head_dim x itemsize: 2048 for
Qwen3-8B in fp16); otherwise present is written to an aligned staging area and copied into
the cache on the stream, which only tiny test models need.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from refusion.runtime.core.contract import (
    BATCH,
    GRAPH_NAMES,
    SEQ,
    GraphName,
    past_key_name,
    past_value_name,
)
from refusion.runtime.core.engines_manifest import EngineManifest, Target
from refusion.runtime.core.dtypes import dtype, from_trt
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.core.profiles import check_request, select_profile
from refusion.runtime.params import DecodeParams
from refusion.runtime.runners.base import Runner
from refusion.runtime.runners.cuda import DeviceBuffer, Stream, device_info

if TYPE_CHECKING:
    import tensorrt

ALIGNMENT = 256  # bytes; TensorRT's requirement for tensor addresses


def require_tensorrt() -> None:
    """Fail with the install hint when TensorRT cannot be imported (callers then import it typed).
    A module without __version__ is a stub folder seen as a namespace package, not TensorRT."""
    hint = ("pip install 'refusion-trt[trt]' on a machine with an NVIDIA GPU (on Jetson, JetPack's "
            "python3-libnvinfer; see docs/tensorrt.md).")
    try:
        import tensorrt
    except ImportError as e:
        raise RefusionError(f"TensorRT is not installed: {hint}") from e
    if not hasattr(tensorrt, "__version__"):
        raise RefusionError(f"`import tensorrt` finds only {list(tensorrt.__path__)} (type stubs?), not TensorRT: {hint}")


def current_target() -> Target:
    """This machine's TensorRT and GPU (imports tensorrt and cuda-python, creates no engine)."""
    require_tensorrt()
    import tensorrt

    gpu, capability = device_info()
    return Target(str(tensorrt.__version__), gpu, capability)


class TensorRTRunner(Runner):
    name = "trt"

    def __init__(self, manifest: ExportManifest, engines: EngineManifest):
        super().__init__(manifest)
        self.engines = engines
        self.limits = engines.limits
        self._runtime: tensorrt.Runtime | None = None
        self._stream: Stream | None = None
        self._cuda_engines: dict[GraphName, tensorrt.ICudaEngine] = {}
        self._contexts: dict[GraphName, list[tensorrt.IExecutionContext]] = {}
        self._activations: DeviceBuffer | None = None
        self._io: dict[str, DeviceBuffer] = {}  # ids, positions, mask, heads: grown on demand
        self._keys: list[DeviceBuffer] = []
        self._values: list[DeviceBuffer] = []

    @staticmethod
    def from_dir(path: str | Path) -> TensorRTRunner:
        """Engines built by `refusion-export build` (the directory also holds refusion.json)."""
        engines = EngineManifest.load(path)
        return TensorRTRunner(ExportManifest.read(Path(path)), engines)

    # -- requests ----------------------------------------------------------------------------
    def check_request(self, prompt_length: int, params: DecodeParams) -> None:
        if params.mode == "ar":
            # AR decoding feeds one token per forward: a "block" of one token, gen_length of them.
            check_request(self.limits, prompt_length, params.gen_length, 1, params.gen_length)
        else:
            check_request(self.limits, prompt_length, params.gen_length, params.slot_size, params.serial_num_blocks)

    # -- lifecycle ---------------------------------------------------------------------------
    def _activate(self) -> None:
        self.engines.verify_target(current_target())  # needs tensorrt; says how to install it
        self.engines.verify_files()  # every check before any deserialization
        try:
            self._load()
        except BaseException:
            self._deactivate()
            raise

    def _load(self) -> None:
        import tensorrt as trt

        self._stream = Stream()
        runtime = self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        scratch = 0
        for graph in GRAPH_NAMES:  # one engine's bytes in host memory at a time
            engine = runtime.deserialize_cuda_engine(self.engines.engine_path(graph).read_bytes())
            if engine is None:
                raise RefusionError(f"TensorRT could not deserialize {graph}.engine; rebuild with: "
                                    f"{self.engines.rebuild_command}")
            self._check_io(graph, engine)
            self._cuda_engines[graph] = engine
            scratch = max(scratch, _activation_bytes(engine))
        self._activations = DeviceBuffer(scratch, self._stream)
        for graph, engine in self._cuda_engines.items():
            self._contexts[graph] = []
            for index in range(engine.num_optimization_profiles):
                context = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
                context.set_device_memory(self._activations.ptr, self._activations.nbytes)
                if not context.set_optimization_profile_async(index, self._stream.handle):
                    raise RefusionError(f"TensorRT refused profile {index} of {graph}.engine; rebuild the engines.")
                self._contexts[graph].append(context)
        self._stream.synchronize()

    def _check_io(self, graph: GraphName, engine: tensorrt.ICudaEngine) -> None:
        """The engine's tensors and profiles must be the ones engines.json and refusion.json describe."""
        import tensorrt as trt

        found = {}
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            mode = "in" if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT else "out"
            row = from_trt(engine.get_tensor_dtype(name).name)
            found[name] = (mode, row.name if row else "?")
        spec = self.manifest.graphs[graph]
        expected = {t.name: ("in", t.dtype) for t in spec.inputs} | {t.name: ("out", t.dtype) for t in spec.outputs}
        profiles = len(self.engines.engines[graph].profiles)
        if found != expected or engine.num_optimization_profiles != profiles:
            diff = sorted(set(found.items()) ^ set(expected.items()))[:6]
            raise RefusionError(
                f"{graph}.engine does not match refusion.json / engines.json beside it (differences: {diff}, "
                f"profiles {engine.num_optimization_profiles} vs {profiles}); rebuild with: {self.engines.rebuild_command}"
            )

    def _deactivate(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        for buf in [*self._keys, *self._values, *self._io.values()]:
            buf.free()
        self._keys, self._values, self._io = [], [], {}
        self._contexts.clear()  # contexts before engines, engines before the runtime
        self._cuda_engines.clear()
        if self._activations is not None:
            self._activations.free()
            self._activations = None
        self._runtime = None
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    # -- KV cache ----------------------------------------------------------------------------
    @property
    def _token_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer."""
        return self.kv_bytes_per_token // (2 * self.manifest.num_layers)

    def _allocate_kv(self, capacity: int, slot: int) -> None:  # one slot (max_slots 1)
        for buf in self._keys + self._values:
            buf.free()
        n, size = self.manifest.num_layers, capacity * self._token_bytes
        self._keys = [DeviceBuffer(size, self._stream) for _ in range(n)]
        self._values = [DeviceBuffer(size, self._stream) for _ in range(n)]

    def _move_kv(self, src: int, dst: int, length: int, slot: int) -> None:
        t = self._token_bytes
        for buf in self._keys + self._values:
            buf.copy_within(src * t, dst * t, length * t)

    def kv_to_host(self, start: int, length: int) -> dict[str, np.ndarray]:
        """KV of tokens [start, start + length) per layer, on the host (for checks, not the loop).
        bfloat16 comes back as its raw uint16 bits."""
        self._require_active()
        self._check_range("KV read", start, length)
        m, t = self.manifest, self._token_bytes
        shape = (1, length, m.kv_heads, m.head_dim)
        host = dtype(m.dtype).numpy
        out = {}
        for i in range(m.num_layers):
            out[f"present.{i}.key"] = self._keys[i].copy_to_host(shape, host, start * t)
            out[f"present.{i}.value"] = self._values[i].copy_to_host(shape, host, start * t)
        return out

    def kv_from_host(self, start: int, past: dict[str, np.ndarray]) -> None:
        """Write a feed's past KV (`past_key_values.{i}.key|value`, [1, length, kv_heads, head_dim])
        into the cache at token `start`, all checked before any is written (for checks, not the loop)."""
        self._require_active()
        m = self.manifest
        host = dtype(m.dtype).numpy
        caches = {past_key_name(i): self._keys[i] for i in range(m.num_layers)}
        caches |= {past_value_name(i): self._values[i] for i in range(m.num_layers)}
        for name in caches:
            array = past[name]
            if array.dtype != host or array.shape[0] != 1 or array.shape[2:] != (m.kv_heads, m.head_dim):
                raise RefusionError(f"{name} must be {host} [1, length, {m.kv_heads}, {m.head_dim}]; "
                                    f"got {array.dtype} {list(array.shape)}.")
            self._check_range("KV upload", start, array.shape[1])
        for name, cache in caches.items():
            cache.copy_from_host(past[name], start * self._token_bytes)

    # -- forwards ----------------------------------------------------------------------------
    def _run(self, graph: GraphName, input_ids: np.ndarray, position_ids: np.ndarray,
             attention_mask: np.ndarray, past_length: int, write_at: int | None, slot: int) -> dict[str, np.ndarray]:
        seq = input_ids.shape[1]
        index = select_profile(list(self.engines.engines[graph].profiles), seq, past_length)
        if index is None:  # before any device work
            raise RefusionError(self._outside_message(graph, seq, past_length))
        context = self._contexts[graph][index]
        m, t = self.manifest, self._token_bytes
        for name, array in (("input_ids", input_ids), ("position_ids", position_ids),
                            ("attention_mask", attention_mask)):
            buf = self._buffer(name, array.nbytes)
            buf.copy_from_host(array)
            self._bind_input(context, name, buf.ptr, array.shape)
        kv_shape = (1, past_length, m.kv_heads, m.head_dim)
        for i in range(m.num_layers):  # past: the cache's first past_length tokens, in place
            self._bind_input(context, past_key_name(i), self._keys[i].ptr, kv_shape)
            self._bind_input(context, past_value_name(i), self._values[i].ptr, kv_shape)
        heads = {o.name: (_shape(o.axes, seq), dtype(o.dtype).numpy)
                 for o in m.graphs[graph].outputs if not o.name.startswith("present.")}
        for name, (shape, host) in heads.items():
            nbytes = int(np.prod(shape)) * host.itemsize
            self._bind_output(context, name, self._buffer(name, nbytes).ptr)
        staging = self._bind_presents(context, seq, write_at) if write_at is not None else None
        if not context.execute_async_v3(self._active_stream.handle):
            raise RefusionError(f"TensorRT failed to run the {graph} engine (seq {seq}, past {past_length}); "
                                "see the TensorRT log above.")
        if staging is not None and write_at is not None:
            buf, stride = staging
            for j, cache in enumerate(self._keys + self._values):
                buf.copy_to(cache, seq * t, src_offset=j * stride, dst_offset=write_at * t)
        return {name: self._io[name].copy_to_host(shape, host) for name, (shape, host) in heads.items()}

    def _bind_presents(self, context: tensorrt.IExecutionContext, seq: int, write_at: int) -> tuple[DeviceBuffer, int] | None:
        """Present KV straight into the cache at write_at; through an aligned staging buffer when
        that address is not 256-byte aligned (returned, to be copied in after the run)."""
        m, t = self.manifest, self._token_bytes
        caches = self._keys + self._values
        names = [f"present.{i}.key" for i in range(m.num_layers)] + [f"present.{i}.value" for i in range(m.num_layers)]
        if (write_at * t) % ALIGNMENT == 0:
            for name, cache in zip(names, caches):
                self._bind_output(context, name, cache.ptr + write_at * t)
            return None
        stride = -(-seq * t // ALIGNMENT) * ALIGNMENT
        buf = self._buffer("present staging", len(caches) * stride)
        for j, name in enumerate(names):
            self._bind_output(context, name, buf.ptr + j * stride)
        return buf, stride

    def _bind_input(self, context: tensorrt.IExecutionContext, name: str, ptr: int, shape: tuple[int, ...]) -> None:
        if not context.set_input_shape(name, shape):
            raise RefusionError(f"TensorRT refused shape {list(shape)} for {name}; it lies outside the engine's "
                                f"profile. Rebuild with: {self.engines.rebuild_command}")
        if not context.set_tensor_address(name, ptr):
            raise RefusionError(f"TensorRT refused the address of {name} (alignment {ptr % ALIGNMENT}).")

    def _bind_output(self, context: tensorrt.IExecutionContext, name: str, ptr: int) -> None:
        if not context.set_tensor_address(name, ptr):
            raise RefusionError(f"TensorRT refused the address of {name} (alignment {ptr % ALIGNMENT}).")

    def _buffer(self, name: str, nbytes: int) -> DeviceBuffer:
        """The named staging buffer, grown (never shrunk) to `nbytes`."""
        buf = self._io.get(name)
        if buf is None or buf.nbytes < nbytes:
            if buf is not None:
                self._active_stream.synchronize()  # the old buffer may still be read by queued work
                buf.free()
            buf = self._io[name] = DeviceBuffer(nbytes, self._stream)
        return buf

    @property
    def _active_stream(self) -> Stream:
        if self._stream is None:
            raise RefusionError(f"{self.name} runner is not active; call activate() first.")
        return self._stream

    def _outside_message(self, graph: GraphName, seq: int, past: int) -> str:
        profiles = self.engines.engines[graph].profiles
        spans = "; ".join(f"{p.name}: seq {p.seq[0]}..{p.seq[2]}, past {p.past[0]}..{p.past[2]}" for p in profiles)
        lim = self.limits
        return (
            f"a {graph} forward of {seq} tokens over {past} past tokens lies outside the engines' profiles ({spans}), "
            f"which come from --max-prompt {lim.max_prompt} --gen-length {lim.gen_length} --max-slots "
            f"{lim.max_slots} x --slot-size {lim.slot_size}. Raise the limit the request exceeds and rebuild: "
            f"{self.engines.rebuild_command}"
        )


def _shape(axes: tuple[str | int, ...], seq: int) -> tuple[int, ...]:
    """A head output's shape for this forward: batch 1, `seq` tokens, fixed trailing dims."""
    return tuple(1 if a == BATCH else seq if a == SEQ else int(a) for a in axes)


def _activation_bytes(engine: tensorrt.ICudaEngine) -> int:
    """Activation memory one context needs, over all profiles (the v2 query exists from TensorRT 10.1)."""
    size = getattr(engine, "device_memory_size_v2", None)
    return int(size if size is not None else engine.device_memory_size)

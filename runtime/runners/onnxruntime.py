"""onnxruntime Runners: CPU (the fallback everywhere) and CUDA (IO binding, KV stays on the device).

Both sessions are given the same memory-mapped weight views as initializers, so planner
and infiller share one copy of the weights in memory (and the OS page cache) instead of
each loading its own. KV past is bound as a view of the preallocated cache and present
KV is bound to its slot in the cache, so no KV is copied by the loop.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from refusion.runtime.contract import GRAPH_NAMES, GraphName, present_key_name, present_value_name
from refusion.runtime.errors import RefusionError
from refusion.runtime.manifest import ExportManifest
from refusion.runtime.runners.base import Runner
from refusion.runtime.weights import map_weights

_NP = {"float32": np.float32, "float16": np.float16}


def import_onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError as e:
        raise RefusionError(
            "the onnxruntime backend needs onnxruntime: pip install 'refusion-trt[ort]' "
            "(or '[ort-gpu]' for CUDA)."
        ) from e
    return onnxruntime


class OrtRunner(Runner):
    """onnxruntime on the CPU; `OrtCudaRunner` overrides only where device memory differs."""

    name = "ort-cpu"
    provider = "CPUExecutionProvider"

    def __init__(self, manifest: ExportManifest, threads: int | None = None):
        super().__init__(manifest)
        if manifest.dtype not in _NP:
            raise RefusionError(
                f"{manifest.path}: {manifest.dtype} graphs do not run on onnxruntime's CPU provider; "
                "re-export with --dtype fp32 or fp16, or use the TensorRT backend."
            )
        manifest.require_files(manifest.weights_file, *manifest.graph_files.values())
        self.threads = threads
        self.dtype = _NP[manifest.dtype]
        self.sessions: dict[GraphName, Any] = {}
        self._outputs: dict[GraphName, list[str]] = {}
        self._weights: dict[str, np.ndarray] = {}
        self._initializers: list[Any] = []
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []

    def _session_options(self) -> Any:
        ort = import_onnxruntime()
        opts = ort.SessionOptions()
        if self.threads:
            opts.intra_op_num_threads = self.threads
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # One weight copy for both sessions: hand them the same memory-mapped views.
        for name, array in self._weights.items():
            value = ort.OrtValue.ortvalue_from_numpy(array)
            self._initializers.append(value)  # must outlive the sessions
            opts.add_initializer(name, value)
        return opts

    def _activate(self) -> None:
        ort = import_onnxruntime()
        if self.provider not in ort.get_available_providers():
            raise RefusionError(
                f"onnxruntime here has no {self.provider} (available: {', '.join(ort.get_available_providers())}); "
                "pip install 'refusion-trt[ort-gpu]' on a CUDA machine, or use --backend ort-cpu."
            )
        self._weights = map_weights(self.manifest)
        for graph in GRAPH_NAMES:
            path = self.manifest.graph_path(graph)
            try:
                session = ort.InferenceSession(str(path), self._session_options(), providers=[self.provider])
            except Exception as e:  # onnxruntime raises its own exception types
                raise RefusionError(f"{path} could not be loaded by onnxruntime ({e}); re-run `refusion-export onnx`.") from e
            self.sessions[graph] = session
            self._outputs[graph] = [o.name for o in session.get_outputs() if not o.name.startswith("present.")]

    def _deactivate(self) -> None:
        self.sessions.clear()
        self._initializers.clear()
        self._weights = {}
        self.keys, self.values = [], []

    def _allocate_kv(self, capacity: int) -> None:
        m = self.manifest
        shape = (1, capacity, m.kv_heads, m.head_dim)
        self.keys = [np.zeros(shape, self.dtype) for _ in range(m.num_layers)]
        self.values = [np.zeros(shape, self.dtype) for _ in range(m.num_layers)]

    def _move_kv(self, src: int, dst: int, length: int) -> None:
        for buf in self.keys + self.values:
            buf[:, dst : dst + length] = buf[:, src : src + length]  # numpy handles overlap

    def _run(self, graph, input_ids, position_ids, attention_mask, past_length, write_at):
        session = self.sessions[graph]
        binding = session.io_binding()
        binding.bind_cpu_input("input_ids", input_ids)
        binding.bind_cpu_input("position_ids", position_ids)
        binding.bind_cpu_input("attention_mask", np.ascontiguousarray(attention_mask))
        seq = input_ids.shape[1]
        wanted = self._outputs[graph]
        for name in wanted:  # bound first, so they come first in get_outputs()
            binding.bind_output(name, "cpu")
        for i in range(self.manifest.num_layers):
            binding.bind_cpu_input(f"past_key_values.{i}.key", self.keys[i][:, :past_length])
            binding.bind_cpu_input(f"past_key_values.{i}.value", self.values[i][:, :past_length])
            if write_at is not None:
                self._bind_present(binding, present_key_name(i), self.keys[i], write_at, seq)
                self._bind_present(binding, present_value_name(i), self.values[i], write_at, seq)
        session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        return {name: outputs[j].numpy() for j, name in enumerate(wanted)}

    def _bind_present(self, binding: Any, name: str, buf: np.ndarray, start: int, seq: int) -> None:
        """Present KV lands directly in the cache at [start, start + seq)."""
        view = buf[:, start : start + seq]
        binding.bind_output(name, "cpu", 0, self.dtype, list(view.shape), view.ctypes.data)


class OrtCudaRunner(OrtRunner):
    """onnxruntime with CUDA: the KV cache lives in device buffers bound through IO binding,
    so past and present never cross to the host; only ids and probabilities come back.
    The weights are handed to both sessions from one host mapping; onnxruntime still uploads
    one device copy per session (TensorRT is the backend that shares them)."""

    name = "ort-cuda"
    provider = "CUDAExecutionProvider"

    def __init__(self, manifest: ExportManifest, threads: int | None = None):
        super().__init__(manifest, threads)
        self.device_keys: list[Any] = []
        self.device_values: list[Any] = []

    def _deactivate(self) -> None:
        for buf in self.device_keys + self.device_values:
            buf.free()
        self.device_keys, self.device_values = [], []
        super()._deactivate()

    @property
    def _token_bytes(self) -> int:
        return self.manifest.kv_heads * self.manifest.head_dim * np.dtype(self.dtype).itemsize

    def _allocate_kv(self, capacity: int) -> None:
        from refusion.runtime.runners.cuda import DeviceBuffer

        for buf in self.device_keys + self.device_values:
            buf.free()
        n = self.manifest.num_layers
        self.device_keys = [DeviceBuffer(capacity * self._token_bytes) for _ in range(n)]
        self.device_values = [DeviceBuffer(capacity * self._token_bytes) for _ in range(n)]

    def _move_kv(self, src: int, dst: int, length: int) -> None:
        t = self._token_bytes
        for buf in self.device_keys + self.device_values:
            buf.copy_within(src * t, dst * t, length * t)

    def _run(self, graph, input_ids, position_ids, attention_mask, past_length, write_at):
        session = self.sessions[graph]
        binding = session.io_binding()
        binding.bind_cpu_input("input_ids", input_ids)
        binding.bind_cpu_input("position_ids", position_ids)
        binding.bind_cpu_input("attention_mask", np.ascontiguousarray(attention_mask))
        wanted = self._outputs[graph]
        for name in wanted:
            binding.bind_output(name, "cpu")
        m, t, seq = self.manifest, self._token_bytes, input_ids.shape[1]
        for i in range(m.num_layers):
            for past, present, buf in (
                (f"past_key_values.{i}.key", present_key_name(i), self.device_keys[i]),
                (f"past_key_values.{i}.value", present_value_name(i), self.device_values[i]),
            ):
                binding.bind_input(past, "cuda", 0, self.dtype, [1, past_length, m.kv_heads, m.head_dim], buf.ptr)
                if write_at is not None:
                    binding.bind_output(present, "cuda", 0, self.dtype, [1, seq, m.kv_heads, m.head_dim],
                                        buf.ptr + write_at * t)
        session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        return {name: outputs[j].numpy() for j, name in enumerate(wanted)}

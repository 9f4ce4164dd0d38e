"""onnxruntime Runners: CPU (the fallback everywhere) and CUDA (IO binding, KV stays on the device).

One session of the infiller graph serves both roles, so the weights are resident once, prepacked
(docs/runtime.md, "Weights in memory"). On the CPU the past is fed as views of the KV cache and only
the new tokens' present KV is copied in; on CUDA, IO binding keeps past and present on the device.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import numpy as np

from refusion.runtime.core.contract import (
    GRAPH_NAMES,
    GraphName,
    kv_names,
    past_key_name,
    past_value_name,
    present_key_name,
    present_value_name,
)
from refusion.runtime.core.dtypes import dtype
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.runners.base import Runner, pack_rows
from refusion.runtime.runners.ort_session import import_onnxruntime, open_session

# onnxruntime's CPU provider has no bfloat16 MatMul.
ORT_DTYPES = ("float32", "float16")


class OrtRunner(Runner):
    """onnxruntime on the CPU; `OrtCudaRunner` overrides only where device memory differs.

    Holds `max_requests` KV regions (host arrays, grown on demand) and packs up to `max_batch`
    requests' forwards into one call as batch rows: each row's past is copied from its region
    into a [batch, longest past] tensor and padded, its mask keeps it to its own past and
    tokens. One row alone runs on views of its region, copying nothing."""

    name = "ort-cpu"
    provider = "CPUExecutionProvider"

    def __init__(self, manifest: ExportManifest, threads: int | None = None, low_memory: bool = False,
                 verify: bool = False, max_requests: int = 1, max_batch: int = 1):
        self.max_requests, self.max_batch = max_requests, max_batch
        super().__init__(manifest)
        if manifest.dtype not in ORT_DTYPES:
            raise RefusionError(
                f"{manifest.path}: {manifest.dtype} graphs do not run on onnxruntime's CPU provider; "
                "re-export with --dtype fp32 or fp16, or use the TensorRT backend."
            )
        manifest.check_files(verify, manifest.model_files)
        self.threads = threads
        self.low_memory = low_memory
        self.dtype = dtype(manifest.dtype).numpy.type
        self.sessions: dict[GraphName, Any] = {}
        self._outputs: dict[GraphName, list[str]] = {}
        self.keys: list[list[np.ndarray]] = [[] for _ in range(max_requests)]  # [region][layer]
        self.values: list[list[np.ndarray]] = [[] for _ in range(max_requests)]

    def _activate(self) -> None:
        ort = import_onnxruntime()
        if self.provider not in ort.get_available_providers():
            raise RefusionError(
                f"onnxruntime here has no {self.provider} (available: {', '.join(ort.get_available_providers())}); "
                "pip install 'refusion-trt[ort-gpu]' on a CUDA machine, or use --backend ort-cpu."
            )
        # One session serves both roles, as one TensorRT engine does: the infiller graph takes the planner's
        # inputs and computes every planner output too (its extra outputs are input_probs and the new tokens'
        # KV, which a planner forward leaves unread). So the weights are loaded, and prepacked, once.
        session = open_session(self.manifest, "infiller", [self.provider], self.threads, self.low_memory)
        for graph in GRAPH_NAMES:
            self.sessions[graph] = session
            self._outputs[graph] = [t.name for t in self.manifest.graphs[graph].outputs
                                    if not t.name.startswith("present.")]
        self._presents = [name(i) for i in range(self.manifest.num_layers) for name in (present_key_name, present_value_name)]

    def _deactivate(self) -> None:
        self.sessions.clear()
        self.keys = [[] for _ in range(self.max_requests)]
        self.values = [[] for _ in range(self.max_requests)]

    def _allocate_kv(self, capacity: int, region: int) -> None:
        m = self.manifest
        shape = (1, capacity, m.kv_heads, m.head_dim)
        self.keys[region] = [np.zeros(shape, self.dtype) for _ in range(m.num_layers)]
        self.values[region] = [np.zeros(shape, self.dtype) for _ in range(m.num_layers)]

    def _move_kv(self, src: int, dst: int, length: int, region: int) -> None:
        for buf in self.keys[region] + self.values[region]:
            buf[:, dst : dst + length] = buf[:, src : src + length]  # numpy handles overlap

    def _run(self, graph, input_ids, position_ids, attention_mask, past_length, write_at, region):
        feed = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": attention_mask}
        keys, values = self.keys[region], self.values[region]
        for i in range(self.manifest.num_layers):  # contiguous views of the cache: no copy
            feed[past_key_name(i)] = keys[i][:, :past_length]
            feed[past_value_name(i)] = values[i][:, :past_length]
        outputs = self._session_run(graph, feed, write_at is not None)
        if write_at is not None:  # only the new tokens' KV is copied into its region
            self._keep_present(outputs, 0, input_ids.shape[1], region, write_at)
        return {name: outputs[name] for name in self._outputs[graph]}

    def _run_batch(self, graph, rows):
        m, batch, packed = self.manifest, len(rows), pack_rows(rows)
        past = packed.past
        feed = {"input_ids": packed.input_ids, "position_ids": packed.position_ids,
                "attention_mask": packed.attention_mask}
        shape = (batch, past, m.kv_heads, m.head_dim)
        for i in range(m.num_layers):
            key, value = np.zeros(shape, self.dtype), np.zeros(shape, self.dtype)
            for b, r in enumerate(rows):
                key[b, : r.past] = self.keys[r.region][i][0, : r.past]
                value[b, : r.past] = self.values[r.region][i][0, : r.past]
            feed[past_key_name(i)], feed[past_value_name(i)] = key, value
        outputs = self._session_run(graph, feed, graph == "infiller")
        results = []
        for b, r in enumerate(rows):
            s = r.input_ids.shape[1]
            if r.write_at is not None:
                self._keep_present(outputs, b, s, r.region, r.write_at)
            results.append({name: outputs[name][b : b + 1, :s] for name in self._outputs[graph]})
        return results

    def _session_run(self, graph: GraphName, feed: dict[str, np.ndarray], presents: bool) -> dict[str, np.ndarray]:
        names = self._outputs[graph] + (self._presents if presents else [])
        return dict(zip(names, self.sessions[graph].run(names, feed)))

    def _keep_present(self, outputs: dict[str, np.ndarray], row: int, seq: int, region: int, write_at: int) -> None:
        """Row `row`'s first `seq` new tokens' KV into `region` at write_at."""
        for i in range(self.manifest.num_layers):
            self.keys[region][i][0, write_at : write_at + seq] = outputs[present_key_name(i)][row, :seq]
            self.values[region][i][0, write_at : write_at + seq] = outputs[present_value_name(i)][row, :seq]


class OrtCudaRunner(OrtRunner):
    """onnxruntime with CUDA: the KV cache lives in device buffers bound through IO binding,
    so past and present never cross to the host; only ids and probabilities come back.
    onnxruntime uploads one device copy of the weights per session, and there is one session
    (both roles, as on the CPU).

    `max_requests` KV regions (device buffers per layer, one region per request in flight), and up to
    `max_batch` rows per call as the CPU runner packs them: IO binding takes one contiguous
    [rows, past, H, D] tensor, so each row's past is gathered from its region into a batch buffer
    on the device, and present comes out as [rows, seq, H, D] into scratch, from which each row's
    tokens go to its region. The gather and scatter copies run on the runner's own stream, waited
    for once before and once after onnxruntime's run (which synchronizes its own stream on
    return). One row alone binds its region in place, as before."""

    name = "ort-cuda"
    provider = "CUDAExecutionProvider"
    device = "cuda"  # IO binding's device type for the KV buffers

    def __init__(self, manifest: ExportManifest, threads: int | None = None, low_memory: bool = False,
                 verify: bool = False, max_requests: int = 1, max_batch: int = 1):
        super().__init__(manifest, threads, low_memory, verify, max_requests, max_batch)
        self.device_keys: list[list[Any]] = [[] for _ in range(max_requests)]  # [region][layer] DeviceBuffer
        self.device_values: list[list[Any]] = [[] for _ in range(max_requests)]
        self._stream: Any = None  # cuda.Stream of the gathers and scatters, while active
        self._scratch: dict[str, Any] = {}  # "past", "present": grown on demand

    def _activate(self) -> None:
        from refusion.runtime.runners.cuda import Stream

        super()._activate()
        if self.max_batch > 1:  # only packed calls gather and scatter
            self._stream = Stream()

    def _deactivate(self) -> None:
        for buf in [*self._device_caches(), *self._scratch.values()]:
            buf.free()
        self.device_keys = [[] for _ in range(self.max_requests)]
        self.device_values = [[] for _ in range(self.max_requests)]
        self._scratch = {}
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        super()._deactivate()

    def _device_caches(self, region: int | None = None) -> list[Any]:
        """A region's K buffers then its V buffers, by layer (every region's when `region` is None)."""
        regions = range(self.max_requests) if region is None else (region,)
        return [buf for s in regions for buf in self.device_keys[s] + self.device_values[s]]

    @property
    def _token_bytes(self) -> int:
        return self.manifest.kv_heads * self.manifest.head_dim * np.dtype(self.dtype).itemsize

    def _allocate_kv(self, capacity: int, region: int) -> None:
        from refusion.runtime.runners.cuda import DeviceBuffer

        for buf in self._device_caches(region):
            buf.free()
        n = self.manifest.num_layers
        self.device_keys[region] = [DeviceBuffer(capacity * self._token_bytes) for _ in range(n)]
        self.device_values[region] = [DeviceBuffer(capacity * self._token_bytes) for _ in range(n)]

    def _move_kv(self, src: int, dst: int, length: int, region: int) -> None:
        t = self._token_bytes
        for buf in self._device_caches(region):
            buf.copy_within(src * t, dst * t, length * t)

    def _run(self, graph, input_ids, position_ids, attention_mask, past_length, write_at, region):
        m, t, seq = self.manifest, self._token_bytes, input_ids.shape[1]
        binding, wanted = self._binding(graph, input_ids, position_ids, attention_mask)
        kv = [m.kv_heads, m.head_dim]
        caches = self._device_caches(region)
        for name, buf in zip(self._past_names, caches):  # past and present as addresses inside the region
            binding.bind_input(name, self.device, 0, self.dtype, [1, past_length, *kv], buf.ptr)
        if write_at is not None:
            for name, buf in zip(self._presents_kv, caches):
                binding.bind_output(name, self.device, 0, self.dtype, [1, seq, *kv], buf.ptr + write_at * t)
        return self._run_bound(graph, binding, wanted)

    def _run_batch(self, graph, rows):
        m, t, batch, packed = self.manifest, self._token_bytes, len(rows), pack_rows(rows)
        seq, past, kv = packed.seq, packed.past, [m.kv_heads, m.head_dim]
        binding, wanted = self._binding(graph, packed.input_ids, packed.position_ids, packed.attention_mask)
        gathered, row_past = self._scratch_buffer("past", len(self._past_names) * batch * past * t), past * t
        for b, r in enumerate(rows):  # each row's past from its region, padded to the longest
            for j, cache in enumerate(self._device_caches(r.region)):
                cache.copy_to(gathered, r.past * t, dst_offset=(j * batch + b) * row_past, stream=self._stream)
        self._stream.synchronize()  # before onnxruntime reads them on its own stream
        for j, name in enumerate(self._past_names):
            binding.bind_input(name, self.device, 0, self.dtype, [batch, past, *kv],
                               gathered.ptr + j * batch * row_past)
        presents, row_present = None, seq * t
        if graph == "infiller":
            presents = self._scratch_buffer("present", len(self._presents_kv) * batch * row_present)
            for j, name in enumerate(self._presents_kv):
                binding.bind_output(name, self.device, 0, self.dtype, [batch, seq, *kv],
                                    presents.ptr + j * batch * row_present)
        outputs = self._run_bound(graph, binding, wanted)
        for b, r in enumerate(rows):  # each row's own tokens into its region
            if presents is not None and r.write_at is not None:
                for j, cache in enumerate(self._device_caches(r.region)):
                    presents.copy_to(cache, r.input_ids.shape[1] * t, src_offset=(j * batch + b) * row_present,
                                     dst_offset=r.write_at * t, stream=self._stream)
        self._stream.synchronize()  # the regions are whole before the next forward reads them
        return [{name: array[b : b + 1, : r.input_ids.shape[1]] for name, array in outputs.items()}
                for b, r in enumerate(rows)]

    def _binding(self, graph: GraphName, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray) -> tuple[Any, list[str]]:
        """A fresh IO binding with the feed on the host and the heads to come back to it."""
        binding = self.sessions[graph].io_binding()
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("position_ids", pos)
        binding.bind_cpu_input("attention_mask", np.ascontiguousarray(mask))
        wanted = self._outputs[graph]
        for name in wanted:  # bound first, so they come first in get_outputs()
            binding.bind_output(name, "cpu")
        return binding, wanted

    def _run_bound(self, graph: GraphName, binding: Any, wanted: list[str]) -> dict[str, np.ndarray]:
        self.sessions[graph].run_with_iobinding(binding)
        outputs = binding.get_outputs()
        return {name: outputs[j].numpy() for j, name in enumerate(wanted)}

    def _scratch_buffer(self, name: str, nbytes: int) -> Any:
        """The named device scratch, grown (never shrunk) to `nbytes`. Zeroed when allocated: padded past
        is masked, but 0 x NaN would still be NaN, so it must hold finite values (zeros or earlier KV)."""
        from refusion.runtime.runners.cuda import DeviceBuffer

        buf = self._scratch.get(name)
        if buf is None or buf.nbytes < nbytes:
            if buf is not None:
                buf.free()  # its copies were waited for (stream synchronized after each batch)
            buf = self._scratch[name] = DeviceBuffer(nbytes)
            buf.zero()
        return buf

    @cached_property  # names fixed by the export: not rebuilt per forward
    def _past_names(self) -> list[str]:
        return kv_names(self.manifest.num_layers, past=True)

    @cached_property
    def _presents_kv(self) -> list[str]:
        return kv_names(self.manifest.num_layers, past=False)

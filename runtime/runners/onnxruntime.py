"""onnxruntime Runners: CPU (the fallback everywhere) and CUDA (IO binding, KV stays on the device).

One session of the infiller graph serves both roles, so the weights are resident once, prepacked
(docs/runtime.md, "Weights in memory"). A forward of one request reads its past in place on both: on the CPU
as views of the region fed to a plain run, its new KV then copied into the region at write_at; on CUDA through
IO binding, the past bound as the region's first tokens and the present written by onnxruntime straight into
the device KV pool at write_at.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from refusion.runtime.core.contract import GRAPH_NAMES, GraphName
from refusion.runtime.core.dtypes import dtype
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.runners.base import Runner
from refusion.runtime.runners.kv_pool import DeviceKVPool, HostKVPool, KVPool, ScratchBuffers
from refusion.runtime.runners.ort_session import CUDA_INSTALL, CUDA_PROVIDER, build_info, configured_provider, import_onnxruntime, open_session
from refusion.runtime.runners.rows import RowFeed, pack_rows

# onnxruntime's CPU provider has no bfloat16 MatMul.
ORT_DTYPES = ("float32", "float16")


class OrtRunner(Runner):
    """onnxruntime on the CPU; `OrtCudaRunner` overrides only where device memory differs.

    Holds `max_requests` KV regions (host arrays, grown on demand) and packs up to `max_batch`
    requests' forwards into one call as batch rows: each row's past is copied from its region
    into a [batch, longest past] tensor and padded, its mask keeps it to its own past and
    tokens. One row alone reads its past in place and copies its new tokens' KV into the region."""

    name = "ort-cpu"
    provider = "CPUExecutionProvider"
    # each fed token costs its arithmetic here (40-57 us on the embedded model): guided forwards that verify and draft
    # 8 tokens ran 1.115-1.135x guided AR's tokens/s over the families, 16 (the block) 1.046-1.048x (docs/decoding.md)
    guided_lookahead: int | None = 8

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

    def _activate(self) -> None:
        ort = import_onnxruntime()
        if self.provider not in ort.get_available_providers():
            raise RefusionError(
                f"onnxruntime here has no {self.provider} (available: {', '.join(ort.get_available_providers())}); "
                f"on a CUDA machine {CUDA_INSTALL}; or use --backend ort-cpu."
            )
        # One session serves both roles, as one TensorRT engine does: the infiller graph takes the planner's
        # inputs and computes every planner output too (its extra outputs are input_probs and the new tokens'
        # KV, which a planner forward leaves unread). So the weights are loaded, and prepacked, once.
        session = open_session(self.manifest, "infiller", [configured_provider(self.provider, self.manifest.dtype)], self.threads,
                               self.low_memory)
        for graph in GRAPH_NAMES:
            self.sessions[graph] = session
            self._outputs[graph] = [t.name for t in self.manifest.graphs[graph].outputs
                                    if not t.name.startswith("present.")]
        self.kv = self._kv_pool()
        self._presents = self.kv.present_names

    def _kv_pool(self) -> KVPool:
        """The regions in host memory: a forward feeds a region's first tokens as views."""
        m = self.manifest
        return HostKVPool(m.num_layers, m.kv_heads, m.head_dim, self.dtype, self.max_requests)

    def _deactivate(self) -> None:
        self.sessions.clear()
        self.kv = None

    def _run(self, graph: GraphName, rows: list[RowFeed]) -> list[dict[str, np.ndarray]]:
        if len(rows) == 1:
            return [self._run_row(graph, rows[0])]
        return self._run_packed(graph, rows)

    def _run_row(self, graph: GraphName, row: RowFeed) -> dict[str, np.ndarray]:
        """The past fed as views of the region's first `past` tokens (no copy); the new tokens' KV copied
        into the region at write_at. On the CPU a plain run is cheaper than IO binding, even with the present bound
        in place in the region: binding ~20 tensors a call costs more than copying one forward's new KV (a
        1-token forward of the embedded model: 0.25 ms plain, 0.32 ms with a binding a call, 0.28 ms with one
        binding kept and rebound; the past's length changes every forward, so its inputs must be; docs/benchmark.md,
        "Where a CPU forward's time goes")."""
        past, write_at, kv = row.past, row.write_at, self._host_kv
        feed = self._feed(row.input_ids, row.position_ids, row.attention_mask, row.heads_at, row.vocab_mask)
        feed.update(zip(kv.past_names, kv.pasts(row.region, past)))
        heads, presents = self._session_run(graph, feed, write_at is not None)
        if write_at is not None:
            self._keep_present(graph, presents, row.region, write_at)
        return heads

    def _run_packed(self, graph: GraphName, rows: list[RowFeed]) -> list[dict[str, np.ndarray]]:
        """Rows of several requests in one call: each row's past copied from its region into one [rows, past, H,
        D] tensor per cache, padded; its new KV copied back into its region."""
        m, batch, packed, kv = self.manifest, len(rows), pack_rows(rows), self._host_kv
        past = packed.past
        feed = self._feed(packed.input_ids, packed.position_ids, packed.attention_mask, packed.heads, packed.vocab_mask)
        shape = (batch, past, m.kv_heads, m.head_dim)
        caches = np.zeros((kv.caches, *shape), self.dtype)
        for b, r in enumerate(rows):
            caches[:, b, : r.past] = kv.pasts(r.region, r.past)[:, 0]
        feed.update(zip(kv.past_names, caches))
        gathered = [r.past for r in rows if r.past]
        self._count_copies(graph, (len(gathered), self.kv_bytes_per_token * sum(gathered)))  # one copy a row
        heads, presents = self._session_run(graph, feed, graph == "infiller")
        for b, r in enumerate(rows):
            if r.write_at is not None:
                self._keep_present(graph, [p[b : b + 1, : r.input_ids.shape[1]] for p in presents], r.region,
                                   r.write_at)
        return [{name: array[b : b + 1, : r.head_count] for name, array in heads.items()} for b, r in enumerate(rows)]

    def _session_run(self, graph: GraphName, feed: dict[str, np.ndarray], presents: bool
                     ) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
        """The graph's heads by name, and with `presents` the new tokens' KV (present_names order)."""
        names = self._outputs[graph]
        with self._in_backend(graph):
            values = self.sessions[graph].run(names + self._presents if presents else names, feed)
        return dict(zip(names, values)), values[len(names):]

    def _keep_present(self, graph: GraphName, presents: list[np.ndarray], region: int, write_at: int) -> None:
        """A row's new tokens' KV ([1, seq, kv_heads, head_dim] a cache) into `region` at write_at: one copy."""
        self._count_copies(graph, (1, self.kv_bytes_per_token * presents[0].shape[1]))
        self._host_kv.write(region, write_at, presents)

    @property
    def _host_kv(self) -> HostKVPool:
        kv = self._kv
        assert isinstance(kv, HostKVPool)  # the CPU runner's own pool (OrtCudaRunner reads none of this)
        return kv


class OrtCudaRunner(OrtRunner):
    """onnxruntime with CUDA: every request's KV lives in the device KV pool, bound through IO binding,
    so past and present never cross to the host; only ids and probabilities come back. One session
    serves both roles, as on the CPU.

    Up to `max_batch` rows per call, packed as the CPU runner packs them: IO binding takes one contiguous
    [rows, past, H, D] tensor, so the pool gathers each row's past into a batch buffer and scatters each
    row's present back into its region, on the runner's own stream, waited for once before and once after
    onnxruntime's run (which synchronizes its own stream on return). One row alone binds its region in place."""

    name = "ort-cuda"
    provider = CUDA_PROVIDER  # TF32 off for fp32 exports (ort_session.configured_provider)
    guided_lookahead = None  # a GPU forward's extra tokens cost about nothing: a block
    device = "cuda"  # IO binding's device type for the KV buffers

    def __init__(self, manifest: ExportManifest, threads: int | None = None, low_memory: bool = False,
                 verify: bool = False, max_requests: int = 1, max_batch: int = 1):
        super().__init__(manifest, threads, low_memory, verify, max_requests, max_batch)
        self._scratch = ScratchBuffers()  # "past", "present" of packed calls
        self._stream: Any = None  # cuda.Stream of the gathers and scatters, while active

    def _activate(self) -> None:
        from refusion.runtime.runners.cuda import Stream

        check_onnxruntime_cuda()
        super()._activate()
        if self.max_batch > 1:  # only packed calls gather and scatter
            self._stream = Stream()

    def _kv_pool(self) -> KVPool:
        """The regions on the device, stream-less: each copy returns when done, so none can race onnxruntime's
        own stream."""
        m = self.manifest
        return DeviceKVPool(m.num_layers, m.kv_heads, m.head_dim, self.dtype, self.max_requests)

    def _deactivate(self) -> None:
        if self.kv is not None:
            self.kv.free()
        self._scratch.free()
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        super()._deactivate()

    @property
    def _kv(self) -> DeviceKVPool:
        kv = super()._kv
        assert isinstance(kv, DeviceKVPool)
        return kv

    def _run_row(self, graph: GraphName, row: RowFeed) -> dict[str, np.ndarray]:
        """Past bound as the region's first `past` tokens, present bound at write_at: both in place."""
        m, t, seq, write_at = self.manifest, self._kv.token_bytes, row.input_ids.shape[1], row.write_at
        binding, wanted = self._binding(graph, row.input_ids, row.position_ids, row.attention_mask, row.heads_at,
                                        row.vocab_mask)
        kv = [m.kv_heads, m.head_dim]
        caches = self._kv.addresses(row.region)
        for name, ptr in zip(self._kv.past_names, caches):
            binding.bind_input(name, self.device, 0, self.dtype, [1, row.past, *kv], ptr)
        if write_at is not None:
            for name, ptr in zip(self._kv.present_names, caches):
                binding.bind_output(name, self.device, 0, self.dtype, [1, seq, *kv], ptr + write_at * t)
        return self._run_bound(graph, binding, wanted)

    def _run_packed(self, graph: GraphName, rows: list[RowFeed]) -> list[dict[str, np.ndarray]]:
        m, t, batch, packed = self.manifest, self._kv.token_bytes, len(rows), pack_rows(rows)
        seq, past, kv = packed.seq, packed.past, [m.kv_heads, m.head_dim]
        binding, wanted = self._binding(graph, packed.input_ids, packed.position_ids, packed.attention_mask,
                                        packed.heads, packed.vocab_mask)
        stride = batch * past * t  # one cache's rows, each padded to the longest past
        gathered = self._scratch.get("past", self._kv.caches * stride, zeroed=True)
        self._count_copies(graph, self._kv.gather(rows, past, gathered, stride, self._stream))  # one copy a row
        self._stream.synchronize()  # before onnxruntime reads them on its own stream
        for j, name in enumerate(self._kv.past_names):
            binding.bind_input(name, self.device, 0, self.dtype, [batch, past, *kv], gathered.ptr + j * stride)
        presents, present_stride = None, batch * seq * t
        if graph == "infiller":
            presents = self._scratch.get("present", self._kv.caches * present_stride, zeroed=True)
            for j, name in enumerate(self._kv.present_names):
                binding.bind_output(name, self.device, 0, self.dtype, [batch, seq, *kv],
                                    presents.ptr + j * present_stride)
        outputs = self._run_bound(graph, binding, wanted)
        if presents is not None:
            self._count_copies(graph, self._kv.scatter(rows, seq, presents, present_stride, self._stream))
        self._stream.synchronize()  # the regions are whole before the next forward reads them
        return [{name: array[b : b + 1, : r.head_count] for name, array in outputs.items()}
                for b, r in enumerate(rows)]


    def _binding(self, graph: GraphName, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray,
                 heads: np.ndarray, vocab_mask: np.ndarray | None) -> tuple[Any, list[str]]:
        """A fresh IO binding with the feed on the host and the heads to come back to it."""
        binding = self.sessions[graph].io_binding()
        for name, array in self._feed(ids, pos, mask, heads, vocab_mask).items():
            binding.bind_cpu_input(name, array)
        wanted = self._outputs[graph]
        for name in wanted:  # bound first, so they come first in get_outputs()
            binding.bind_output(name, "cpu")
        return binding, wanted

    def _run_bound(self, graph: GraphName, binding: Any, wanted: list[str]) -> dict[str, np.ndarray]:
        with self._in_backend(graph):
            self.sessions[graph].run_with_iobinding(binding)
        outputs = binding.get_outputs()
        return {name: outputs[j].numpy() for j, name in enumerate(wanted)}


def check_onnxruntime_cuda() -> None:
    """onnxruntime-gpu's CUDA (its build info says which) against the driver, in one line; a CPU build
    records none."""
    from refusion.runtime.runners.cuda import require_driver

    package, cuda = build_info()
    built = re.match(r"(\d+)\.(\d+)", cuda or "")
    if built:
        require_driver(f"{package} (CUDA {built[0]})", (int(built[1]), int(built[2])),
                       f"install the onnxruntime-gpu of the driver's CUDA: {CUDA_INSTALL}")

"""The TensorRT Runner: one engine serving the planner and the infiller, on one CUDA stream, KV on the device.

Loading verifies engines.json (TensorRT version, GPU, the engine's size; its sha256 with `verify`), then
deserializes the engine from a read-only mapping of its file (no host copy; runners/trt_loader.py). The engine is
the infiller graph's with a profile per kind of forward (runtime/core/profiles.py), an execution context per
profile, all sharing one activation buffer (forwards are serialized on the stream). A forward binds its request's
KV region (runners/kv_pool.py) as past and writes present straight into it at `write_at`; only ids, positions and
the mask go up, and only the small heads come back. A planner forward's present goes to scratch apart from the
cache.

Several requests' forwards run in one execution on a profile whose batch range holds them: their pasts
gathered into one [rows, past, H, D] buffer, their presents scattered back (rows no batched profile holds,
prefills, run one at a time). The runner never cuts a forward: where no profile holds one (a prefill over a
cached prefix's KV), `chunk_bound` tells the scheduler the chunks a profile holds, and the scheduler cuts it
(runtime/decode/chunks.py). TensorRT wants 256-byte aligned addresses: present at an unaligned offset
goes through aligned staging (tiny test models only; real models' tokens are aligned). Once per (profile,
input shapes) the output shapes TensorRT infers are checked against the buffers bound for them. Needs
TensorRT >= 10.1 (`set_device_memory(ptr, size)`, `device_memory_size_v2`); docs/tensorrt.md has the details.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from refusion.runtime.core.contract import BATCH, HEADS, SEQ, GraphName, past_key_name
from refusion.runtime.core.dtypes import dtype, from_trt
from refusion.runtime.core.engines_manifest import ENGINE_GRAPH, EngineManifest
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.core.profiles import check_request, select_profile
from refusion.runtime.runners.base import Runner
from refusion.runtime.runners.cuda import DeviceBuffer, HostBuffer, Stream
from refusion.runtime.runners.kv_pool import ALIGNMENT, DeviceKVPool, ScratchBuffers, aligned
from refusion.runtime.runners.rows import PackedRows, RowFeed, pack_rows
from refusion.runtime.runners.trt_loader import current_target, deserialize_engine

if TYPE_CHECKING:
    import tensorrt

class TensorRTRunner(Runner):
    name = "trt"

    def __init__(self, manifest: ExportManifest, engines: EngineManifest, max_requests: int | None = None,
                 max_batch: int | None = None, verify: bool = False):
        """`max_batch`: rows one execution packs, at most the engine's --max-batch (the default);
        `max_requests`: requests held at once (a KV region each), at least max_batch (default: max_batch);
        `verify`: check the engine's sha256 at activation, not only its size (a full read of the file)."""
        self.max_batch, self.max_requests = batch_and_requests(engines, max_requests, max_batch)
        super().__init__(manifest)
        self.engines = engines
        self.verify = verify
        self.limits = engines.limits
        self._runtime: tensorrt.Runtime | None = None
        self._stream: Stream | None = None
        self._engine: tensorrt.ICudaEngine | None = None
        self._contexts: list[tensorrt.IExecutionContext] = []  # one per profile
        self._activations: DeviceBuffer | None = None
        self._empty: DeviceBuffer | None = None  # where empty tensors (a prefill's past) are bound
        self._shapes_checked: set[tuple[int, int, int, int]] = set()  # (profile, batch, seq, heads): none on past
        self._scratch: ScratchBuffers | None = None  # ids, positions, mask, heads, present staging, batch past
        self._host: HostBuffer | None = None  # the heads, on the host (pinned)
        self._embeds: HostBuffer | None = None  # a host table's rows for a forward, uploaded from there (pinned)

    @staticmethod
    def from_dir(path: str | Path, max_requests: int | None = None, max_batch: int | None = None,
                 verify: bool = False) -> TensorRTRunner:
        """Engines built by `refusion-export build` (the directory also holds refusion.json)."""
        engines = EngineManifest.load(path)
        return TensorRTRunner(ExportManifest.read(Path(path)), engines, max_requests, max_batch, verify)

    # -- requests ----------------------------------------------------------------------------
    @property
    def max_forward_tokens(self) -> int | None:
        return self.limits.prefill_chunk

    @property
    def decode_tokens(self) -> int:
        return self.limits.block_length

    def chunk_bound(self, graph: GraphName, seq: int, past: int, heads: int) -> int | None:
        """None where a profile holds the forward; else the longest chunk a profile that starts at one token holds
        over its whole range, [past, past + seq) (a prefill over a cached prefix: the decode profile's block, or the
        prefill profile's bound), so every chunk the scheduler cuts runs on it; 0 where none does."""
        profiles = list(self.engines.engine.profiles)
        if select_profile(profiles, graph, seq, past, 1, heads) is not None:
            return None
        return max((p.seq[2] for p in profiles
                    if p.graph == graph and p.seq[0] == 1 and p.past[0] <= past and past + seq <= p.past[2]), default=0)

    def check_request(self, prompt_length: int, needs: tuple[int, int, int] | None, mode: str) -> None:
        if needs is None:
            raise RefusionError(f"the {mode} strategy's forwards fit none of the TensorRT engine's profiles; "
                                "run it on onnxruntime (--backend ort-cpu or ort-cuda).")
        check_request(self.limits, prompt_length, *needs)

    # -- lifecycle ---------------------------------------------------------------------------
    def _activate(self) -> None:
        self.engines.verify_target(current_target())  # needs tensorrt; says how to install it
        self.engines.verify_file(digest=self.verify)  # every check before any deserialization
        try:
            self._load()
        except BaseException:
            self._deactivate()
            raise

    def _load(self) -> None:
        import tensorrt as trt

        self._stream = Stream()
        m = self.manifest
        self.kv = DeviceKVPool(m.num_layers, m.kv_heads, m.head_dim, dtype(m.dtype).numpy, self.max_requests,
                               self._stream)
        self._scratch = ScratchBuffers(self._stream)
        runtime = self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        engine = deserialize_engine(runtime, self.engines.engine_path)
        if engine is None:
            raise RefusionError(f"TensorRT could not deserialize {self.engines.engine.file}; rebuild with: "
                                f"{self.engines.rebuild_command}")
        self._check_io(engine)
        self._engine = engine
        self._activations = DeviceBuffer(engine.device_memory_size_v2, self._stream)  # one context, any profile
        self._empty = DeviceBuffer(ALIGNMENT, self._stream)
        for index, profile in enumerate(self.engines.engine.profiles):
            context = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
            context.set_device_memory(self._activations.ptr, self._activations.nbytes)
            try:  # the binding raises where the C++ API returns false
                context.set_optimization_profile_async(index, self._stream.handle)
            except RuntimeError as e:
                raise RefusionError(f"TensorRT refused profile {index} ({profile.name}) of {self.engines.engine.file} "
                                    f"({e}); rebuild with: {self.engines.rebuild_command}") from e
            self._contexts.append(context)
        self._stream.synchronize()

    def _check_io(self, engine: tensorrt.ICudaEngine) -> None:
        """The engine's tensors and profiles must be the ones engines.json and refusion.json describe."""
        import tensorrt as trt

        found = {}
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            mode = "in" if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT else "out"
            row = from_trt(engine.get_tensor_dtype(name).name)
            found[name] = (mode, row.name if row else "?")
        spec = self.manifest.graphs[ENGINE_GRAPH]
        expected = {t.name: ("in", t.dtype) for t in spec.inputs} | {t.name: ("out", t.dtype) for t in spec.outputs}
        profiles = len(self.engines.engine.profiles)
        if found != expected or engine.num_optimization_profiles != profiles:
            diff = sorted(set(found.items()) ^ set(expected.items()))[:6]
            raise RefusionError(
                f"{self.engines.engine.file} does not match refusion.json / engines.json beside it (differences: "
                f"{diff}, profiles {engine.num_optimization_profiles} vs {profiles}); rebuild with: "
                f"{self.engines.rebuild_command}"
            )
        self._check_profiles(engine)

    def _check_profiles(self, engine: tensorrt.ICudaEngine) -> None:
        """Each profile's ranges in the engine must be those engines.json records (the runner picks profiles by
        them; the manifest is not hashed, so an edit would surface only as refused shapes, later). The ids,
        the head positions and the first layer's past carry every free axis: batch, seq, heads and past."""
        spec = self.manifest.graphs[ENGINE_GRAPH]
        names = ("input_ids", "head_positions", past_key_name(0))
        for index, profile in enumerate(self.engines.engine.profiles):
            recorded = profile.shapes(spec)
            for name in names:
                built = tuple(tuple(int(d) for d in dims[:]) for dims in engine.get_tensor_profile_shape(name, index))
                if built != recorded[name]:
                    raise RefusionError(
                        f"{self.engines.engine.file}'s profile {index} ({profile.name}) takes {name} from "
                        f"{list(built[0])} to {list(built[2])} (opt {list(built[1])}), but engines.json records "
                        f"{list(recorded[name][0])} to {list(recorded[name][2])} (opt {list(recorded[name][1])}): "
                        f"engines.json was edited or belongs to another build. Rebuild with: "
                        f"{self.engines.rebuild_command}"
                    )

    def _deactivate(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        for held in (self.kv, self._scratch, self._host, self._embeds):
            if held is not None:
                held.free()
        self.kv, self._scratch, self._host, self._embeds = None, None, None, None
        self._contexts = []  # contexts before the engine, the engine before the runtime
        self._engine = None
        self._shapes_checked.clear()
        for own in (self._activations, self._empty):
            if own is not None:
                own.free()
        self._activations = self._empty = None
        self._runtime = None
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def layer_information(self, profile: int = 0) -> dict[str, Any]:
        """TensorRT's engine inspector over profile `profile`'s context as its last forward bound it (formats
        and precisions show only for bound shapes): every layer, as parsed JSON. For checks (tools/checks/gpu.py)."""
        import tensorrt as trt

        self._require_active()
        assert self._engine is not None
        inspector = self._engine.create_engine_inspector()
        inspector.execution_context = self._contexts[profile]
        info: dict[str, Any] = json.loads(inspector.get_engine_information(trt.LayerInformationFormat.JSON))
        return info

    # -- KV cache ----------------------------------------------------------------------------
    @property
    def _kv(self) -> DeviceKVPool:
        """The pool, typed as the device one this runner makes (it binds, gathers and scatters by address)."""
        kv = super()._kv
        assert isinstance(kv, DeviceKVPool)
        return kv

    # -- forwards ----------------------------------------------------------------------------
    def _run(self, graph: GraphName, rows: list[RowFeed]) -> list[dict[str, np.ndarray]]:
        """One row alone in place; several grouped by the profile each needs alone, packed up to that profile's
        batch range: the packed (seq, past) are one row's each, so the group's profile holds them."""
        if len(rows) == 1:
            return [self._run_row(graph, rows[0])]
        groups: dict[int, list[int]] = {}
        for i, row in enumerate(rows):  # every row checked before any device work
            groups.setdefault(self._profile(graph, row.input_ids.shape[1], row.past, row.head_count), []).append(i)
        out: dict[int, dict[str, np.ndarray]] = {}
        for index, members in groups.items():
            width = self.engines.engine.profiles[index].batch[2]
            for start in range(0, len(members), width):
                chunk = members[start : start + width]
                if len(chunk) == 1:
                    out[chunk[0]] = self._run_row(graph, rows[chunk[0]])
                else:
                    out.update(zip(chunk, self._run_packed(graph, index, [rows[i] for i in chunk])))
        return [out[i] for i in range(len(rows))]

    def _run_row(self, graph: GraphName, row: RowFeed) -> dict[str, np.ndarray]:
        """One request's forward: past bound in place in its region, present written straight into it."""
        ids, past, write_at, heads = row.input_ids, row.past, row.write_at, row.heads_at
        seq, count = ids.shape[1], heads.shape[1]
        index = self._profile(graph, seq, past, count)  # before any device work
        context = self._contexts[index]
        self._bind_feed(context, ids, row.position_ids, row.attention_mask, heads, row.vocab_mask)
        m, caches = self.manifest, self._kv.addresses(row.region)
        kv_shape = (1, past, m.kv_heads, m.head_dim)
        for name, cache in zip(self._kv.past_names, caches):  # the region's first `past` tokens, in place
            self._bind_input(context, name, cache, kv_shape)
        outputs = self._bind_heads(context, index, 1, seq, count)
        staging = self._bind_presents(context, seq, write_at, caches)
        with self._in_backend(graph):  # the stream's work is waited for when the heads come back
            self._execute(context, graph, 1, seq, past)
            if staging is not None and write_at is not None:  # every cache's new tokens: one copy
                buf, stride = staging
                self._count_copies(graph, self._kv.place(row.region, write_at, buf, seq, 0, stride))
            return self._fetch(graph, outputs)

    def _run_packed(self, graph: GraphName, index: int, rows: list[RowFeed]) -> list[dict[str, np.ndarray]]:
        """Rows of several requests in one execution on profile `index`: pasts gathered, presents scattered."""
        packed, batch = pack_rows(rows), len(rows)
        seq, past = packed.seq, packed.past
        context = self._contexts[index]
        self._bind_feed(context, packed.input_ids, packed.position_ids, packed.attention_mask, packed.heads,
                        packed.vocab_mask)
        self._gather_past(context, graph, rows, packed)
        heads = self._bind_heads(context, index, batch, seq, packed.heads.shape[1])
        buf, stride = self._bind_scratch_presents(context, batch * seq)
        with self._in_backend(graph):
            self._execute(context, graph, batch, seq, past)
            # each row's own tokens, one copy a row; padding and planner KV stay behind
            self._count_copies(graph, self._kv.scatter(rows, seq, buf, stride))
            outputs = self._fetch(graph, heads)
        return [{name: array[b : b + 1, : r.head_count] for name, array in outputs.items()}
                for b, r in enumerate(rows)]

    def _gather_past(self, context: tensorrt.IExecutionContext, graph: GraphName, rows: list[RowFeed],
                     packed: PackedRows) -> None:
        """Each row's past copied from its region into one [rows, past, H, D] buffer per cache, one copy a row
        for all of them (the pool's layout). The buffer is
        zeroed when allocated: a padded position is masked, but 0 x NaN would still be NaN, so padding must
        hold finite values (zeros, or KV an earlier gather left there)."""
        m, batch, past = self.manifest, len(rows), packed.past
        stride = aligned(batch * past * self._kv.token_bytes)
        buf = self._buffer("batch past", self._kv.caches * stride, zeroed=True)
        self._count_copies(graph, self._kv.gather(rows, past, buf, stride))  # one copy a row
        shape = (batch, past, m.kv_heads, m.head_dim)
        for j, name in enumerate(self._kv.past_names):
            self._bind_input(context, name, buf.ptr + j * stride, shape)

    def _profile(self, graph: GraphName, seq: int, past: int, heads: int) -> int:
        index = select_profile(list(self.engines.engine.profiles), graph, seq, past, 1, heads)
        if index is None:
            raise RefusionError(self._outside_message(graph, seq, past, heads))
        return index

    def _bind_feed(self, context: tensorrt.IExecutionContext, ids: np.ndarray, pos: np.ndarray,
                   mask: np.ndarray, heads: np.ndarray, vocab_mask: np.ndarray | None) -> None:
        for name, array in self._feed(ids, pos, mask, heads, vocab_mask).items():
            buf = self._buffer(name, array.nbytes)
            buf.copy_from_host(array)
            self._bind_input(context, name, buf.ptr, array.shape)

    def _bind_heads(self, context: tensorrt.IExecutionContext, index: int, batch: int, seq: int,
                    heads: int) -> dict[str, tuple[tuple[int, ...], Any]]:
        """Bind every output but present to its buffer; returns their (shape, host dtype). The output
        shapes TensorRT infers are checked once per (profile, batch, seq, heads): every output's axes are the
        batch, the new tokens, the head positions and fixed sizes (the contract's), so the past, which grows
        every step, changes none of them, and the set stays as small as the profiles' shapes."""
        m = self.manifest
        outputs = {o.name: (_shape(o.axes, seq, batch, heads), dtype(o.dtype).numpy)
                   for o in m.graphs[ENGINE_GRAPH].outputs}
        if (index, batch, seq, heads) not in self._shapes_checked:
            self._check_output_shapes(context, {name: shape for name, (shape, _) in outputs.items()})
            self._shapes_checked.add((index, batch, seq, heads))
        read = {name: out for name, out in outputs.items() if not name.startswith("present.")}
        for name, (shape, host) in read.items():  # a planner forward's input_probs too, never read back
            nbytes = int(np.prod(shape)) * host.itemsize
            self._bind_output(context, name, self._buffer(name, nbytes).ptr)
        return read

    def _execute(self, context: tensorrt.IExecutionContext, graph: GraphName, batch: int, seq: int, past: int) -> None:
        if not context.execute_async_v3(self._active_stream.handle):
            raise RefusionError(f"TensorRT failed to run a {graph} forward ({batch} row(s), seq {seq}, past {past}); "
                                "see the TensorRT log above.")

    def _fetch(self, graph: GraphName, heads: dict[str, tuple[tuple[int, ...], Any]]) -> dict[str, np.ndarray]:
        """The graph's heads on the host (not a planner's input_probs): each copied into one pinned buffer
        behind the forward on the stream, then one wait for all of them."""
        returned = [o.name for o in self.manifest.graphs[graph].outputs if o.name in heads]
        offsets, end = {}, 0
        for name in returned:
            shape, host = heads[name]
            offsets[name], end = end, end + -(-int(np.prod(shape)) * host.itemsize // 8) * 8  # 8-byte aligned
        pinned = self._pinned(end)
        for name in returned:
            shape, host = heads[name]
            self._io[name].copy_to_pinned(pinned, int(np.prod(shape)) * host.itemsize, dst_offset=offsets[name])
        self._active_stream.synchronize()
        return {name: pinned.array(*heads[name], offsets[name]) for name in returned}

    def _pinned(self, nbytes: int) -> HostBuffer:
        """The heads' pinned host buffer, grown (never shrunk) to `nbytes`."""
        self._host = self._grown(self._host, nbytes)
        return self._host

    def _embeds_out(self, ids: np.ndarray) -> np.ndarray:
        """A host table's rows go straight into pinned memory, grown to the largest forward's: their upload then
        runs on the stream without the driver's staging copy through pageable memory (a 2,176-token prefill of
        ReFusion-8B sends 17 MiB). Rewritten each forward: every forward waits for its stream (its heads) first."""
        assert self.embeddings is not None
        e = self.embeddings.embeddings
        shape, host = (*ids.shape, e.shape[1]), dtype(e.dtype).numpy
        self._embeds = self._grown(self._embeds, int(np.prod(shape)) * host.itemsize)
        return self._embeds.view(shape, host)

    def _grown(self, held: HostBuffer | None, nbytes: int) -> HostBuffer:
        """`held`, or a pinned buffer of `nbytes` in its place once the copies queued into or out of it are done."""
        if held is not None and held.nbytes >= nbytes:
            return held
        if held is not None:
            self._active_stream.synchronize()  # queued copies may still use the old one
            held.free()
        return HostBuffer(nbytes)

    def _bind_presents(self, context: tensorrt.IExecutionContext, seq: int, write_at: int | None,
                       caches: list[int]) -> tuple[DeviceBuffer, int] | None:
        """Present KV straight into the region's `caches` at write_at. Through an aligned staging buffer
        when that address is not 256-byte aligned (returned, to be copied in after the run), and for a
        planner forward (write_at None), whose present is discarded: the staging buffer is its
        scratch, apart from the cache, so it can overwrite nothing the loop reads."""
        t = self._kv.token_bytes
        if write_at is not None and (write_at * t) % ALIGNMENT == 0:
            for name, cache in zip(self._kv.present_names, caches):
                self._bind_output(context, name, cache + write_at * t)
            return None
        staging = self._bind_scratch_presents(context, seq)
        return staging if write_at is not None else None

    def _bind_scratch_presents(self, context: tensorrt.IExecutionContext, tokens: int) -> tuple[DeviceBuffer, int]:
        """Every present bound into the staging buffer, `tokens` tokens each at an aligned stride."""
        stride = aligned(tokens * self._kv.token_bytes)
        buf = self._buffer("present staging", self._kv.caches * stride)
        for j, name in enumerate(self._kv.present_names):
            self._bind_output(context, name, buf.ptr + j * stride)
        return buf, stride

    def _check_output_shapes(self, context: tensorrt.IExecutionContext, expected: dict[str, tuple[int, ...]]) -> None:
        """The shapes TensorRT infers for the outputs must be those of the buffers bound for them."""
        unspecified = context.infer_shapes()
        if unspecified:
            raise RefusionError(f"TensorRT cannot infer the engine's output shapes: {sorted(unspecified)} "
                                "lack input shapes. This is a bug in the runner's bindings; please report it.")
        got = {name: tuple(context.get_tensor_shape(name)[:]) for name in expected}  # Dims[:] is a tuple
        wrong = [f"{name}: engine {list(got[name])}, refusion.json {list(shape)}"
                 for name, shape in expected.items() if got[name] != shape]
        if wrong:
            raise RefusionError(f"{self.engines.engine.file} computes outputs of other shapes than its buffers are "
                                f"sized for ({'; '.join(wrong[:4])}); rebuild with: {self.engines.rebuild_command}")

    def _bind_input(self, context: tensorrt.IExecutionContext, name: str, ptr: int, shape: tuple[int, ...]) -> None:
        if not context.set_input_shape(name, shape):
            raise RefusionError(f"TensorRT refused shape {list(shape)} for {name}; it lies outside the engine's "
                                f"profile. Rebuild with: {self.engines.rebuild_command}")
        if 0 in shape:  # an empty tensor gets its own address, never one an output is written to
            assert self._empty is not None
            ptr = self._empty.ptr
        if not context.set_tensor_address(name, ptr):
            raise RefusionError(f"TensorRT refused the address of {name} (alignment {ptr % ALIGNMENT}).")

    def _bind_output(self, context: tensorrt.IExecutionContext, name: str, ptr: int) -> None:
        if not context.set_tensor_address(name, ptr):
            raise RefusionError(f"TensorRT refused the address of {name} (alignment {ptr % ALIGNMENT}).")

    def _buffer(self, name: str, nbytes: int, zeroed: bool = False) -> DeviceBuffer:
        return self._io.get(name, nbytes, zeroed)

    @property
    def _io(self) -> ScratchBuffers:
        if self._scratch is None:
            raise RefusionError(f"{self.name} runner is not active; call activate() first.")
        return self._scratch

    @property
    def _active_stream(self) -> Stream:
        if self._stream is None:
            raise RefusionError(f"{self.name} runner is not active; call activate() first.")
        return self._stream

    def _outside_message(self, graph: GraphName, seq: int, past: int, heads: int) -> str:
        profiles = [p for p in self.engines.engine.profiles if p.graph == graph]
        spans = "; ".join(f"{p.name}: seq {p.seq[0]}..{p.seq[2]}, past {p.past[0]}..{p.past[2]}, heads "
                          f"{p.head_range[0]}..{p.head_range[2]}" for p in profiles)
        lim = self.limits
        return (
            f"a {graph} forward of {seq} tokens over {past} past tokens lies outside the engine's {graph} profiles "
            f"({spans}; it computes {heads} heads), "
            f"which come from --max-prompt {lim.max_prompt} --gen-length {lim.gen_length} --max-slots "
            f"{lim.max_slots} x --slot-size {lim.slot_size}. Raise the limit the request exceeds and rebuild: "
            f"{self.engines.rebuild_command}"
        )


def _shape(axes: tuple[str | int, ...], seq: int, batch: int, heads: int) -> tuple[int, ...]:
    """An output's shape for this forward: `batch` rows, `seq` tokens, `heads` head positions, fixed trailing dims."""
    sizes: dict[str | int, int] = {BATCH: batch, SEQ: seq, HEADS: heads}
    return tuple(sizes[a] if a in sizes else int(a) for a in axes)


def batch_and_requests(engines: EngineManifest, max_requests: int | None, max_batch: int | None) -> tuple[int, int]:
    """(max_batch, max_requests) of a TensorRT runner over `engines`: the batch at most the engine's
    --max-batch (its default, or the regions if fewer), the regions at least the batch (default: the batch)."""
    for name, value in (("max_batch", max_batch), ("max_requests", max_requests)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise RefusionError(f"{name}={value!r} must be a positive integer.")
    built = engines.limits.max_batch
    batch = max_batch if max_batch is not None else min(built, max_requests or built)
    regions = max_requests if max_requests is not None else batch
    if batch > built:
        raise RefusionError(f"max_batch={batch} exceeds the engine's --max-batch {built}: its profiles take at most "
                            f"{built} rows. Lower max_batch, or rebuild with --max-batch {batch}: "
                            f"{engines.rebuild_command}")
    if regions < batch:
        raise RefusionError(f"max_requests={regions} is less than max_batch={batch}: a batch packs requests in flight; "
                            "raise max_requests or lower max_batch.")
    return batch, regions

"""The scheduler: one thread that owns the Runner and drives every request's step machine (the only driver).

Any thread may `submit` a Request; the scheduler thread alone touches the runner, so a Generator can be
shared by any number of threads. Each round it admits waiting requests into free KV regions (copying in the
longest cached prefix of each prompt from the prefix cache, when there is one), advances every
active request to its next forward (doing its KV moves and recording its commits on the way), then runs the
pending forwards graph by graph, up to the runner's `max_batch` to a call. With a `prefill_chunk` bound, a
longer forward (a prefill) runs as chunks of at most that many tokens, one a round (runtime/decode/chunks.py),
and no call feeds more tokens than the bound: other requests' forwards run between two chunks, and a request
waits behind no forward longer than the bound. A forward the runner cannot run in one execution (a TensorRT
prefill over a cached prefix) is cut the same way, to the runner's bound (Runner.chunk_bound): the scheduler
alone cuts forwards. A cancelled or expired request ends before its next forward
(or chunk) and frees its region at once; a request that fails fails alone. The thread is shared fairly: a request
whose steps took more than FAIR_SHARE_S of its CPU in a round (a costly guide's masks) sits out the rounds after,
while others are active, until they have had as much of it, so one request's guide work cannot slow every other
request's steps by its own cost.
(nano-vllm's engine/: scheduler, sequence, block manager, model runner, in one small loop.)
"""

from __future__ import annotations

import cProfile
import threading
import time
from collections import deque
from dataclasses import dataclass

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.signals import main_thread_signals
from refusion.runtime.decode.chunks import cut, merge
from refusion.runtime.decode.steps import Forward, KVMove, Outputs, PrefixKV
from refusion.runtime.prefix_cache import PrefixCache
from refusion.runtime.request import FinishReason, Request
from refusion.runtime.runners.base import Runner
from refusion.runtime.runners.rows import RowFeed

# CPU seconds of the scheduler thread a request's steps may take a round before it owes the others (its steps
# between forwards take well under 1 ms without a guide, and an ordinary guide's masks add 0.1 ms or less).
FAIR_SHARE_S = 0.010


@dataclass
class _Chunks:
    """A forward run as chunks: its chunks, and the outputs of those that have run."""

    forward: Forward
    chunks: list[Forward]
    outputs: list[Outputs]

    @property
    def next(self) -> Forward:
        return self.chunks[len(self.outputs)]


@dataclass
class SchedulerStats:
    rounds: int = 0
    busy_seconds: float = 0.0  # inside rounds: step machines, policy, masks, commits and the runner's calls


class Scheduler:
    def __init__(self, runner: Runner, prefix_cache: PrefixCache | None = None, prefill_chunk: int | None = None):
        """`prefix_cache`: where requests' prompt prefixes are looked up at admission and kept (None: off);
        `prefill_chunk`: the most tokens a call feeds (a longer forward runs as chunks; None: no bound)."""
        self.runner, self.prefix_cache, self.prefill_chunk = runner, prefix_cache, prefill_chunk
        self._chunks: dict[Request, _Chunks] = {}  # requests whose forward runs as chunks (this thread's alone)
        self._owed: dict[Request, float] = {}  # seconds of others' rounds a request sits out (this thread's alone)
        self.stats = SchedulerStats()
        # Rounds run under it while set (cProfile sees only the thread that enables it: this one).
        self.profiler: cProfile.Profile | None = None
        self._lock = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._active: list[Request] = []
        self._free_regions = list(range(runner.max_requests))[::-1]
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, request: Request) -> Request:
        with self._lock:
            if self._closed:
                raise RefusionError("this Generator is closed; load it again with Generator.from_dir(...).")
            self._waiting.append(request)
            if self._thread is None:  # started before it is seen: `alive` never sees it unstarted
                thread = threading.Thread(target=self._loop, name="refusion-scheduler", daemon=True)
                with main_thread_signals():
                    thread.start()
                self._thread = thread
            self._lock.notify_all()
        return request

    def close(self) -> None:
        """Cancel what is waiting or running, and stop the scheduler thread."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    @property
    def alive(self) -> bool:
        """The scheduler thread runs (or has not been needed yet): submitted requests will be answered."""
        thread = self._thread
        return not self._closed and (thread is None or thread.is_alive())

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._waiting) + len(self._active)

    @property
    def regions_in_use(self) -> int:
        """KV regions held by running requests (0 once every request has ended: nothing leaked)."""
        with self._lock:
            return self.runner.max_requests - len(self._free_regions)

    # -- the scheduler thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._closed or self._waiting or self._active)
                if self._closed:
                    break
                self._admit()
            try:
                self._timed_round()
            except Exception as e:  # noqa: BLE001 - a bug here must fail the requests, not leave them waiting
                for request in list(self._active):
                    self._finish(request, None, e)
        for request in [*self._active, *self._waiting]:
            self._finish(request, "cancelled")

    def _timed_round(self) -> None:
        profiler, t0 = self.profiler, time.perf_counter()
        if profiler is not None:
            profiler.enable()
        try:
            self._round()
        finally:
            if profiler is not None:
                profiler.disable()
            self.stats.rounds += 1
            self.stats.busy_seconds += time.perf_counter() - t0

    def _admit(self) -> None:
        """Waiting requests into free KV regions, in arrival order (under the lock); those cancelled
        or expired while waiting end at once."""
        now = time.monotonic()
        for request in [r for r in self._waiting if r.cancelled or (r.deadline is not None and now > r.deadline)]:
            self._finish(request, "cancelled" if request.cancelled else "timeout")
        while self._waiting and self._free_regions:
            request = self._waiting.popleft()
            request.region = self._free_regions.pop()
            request.started = time.perf_counter()
            self._active.append(request)
            try:
                self.runner.allocate_kv(request.capacity, request.region)
                request.start(self._cached_prefix(request))
            except Exception as e:  # noqa: BLE001 - the request fails alone, with its own error
                self._finish(request, None, e)

    def _cached_prefix(self, request: Request) -> int:
        """Copy the longest cached prefix of its prompt into its KV region; the tokens it covers."""
        if self.prefix_cache is None or not request.reuses_prefix:
            return 0
        t0 = time.perf_counter()
        cached = self.prefix_cache.load(request.prompt_ids, request.kv_region)
        request.runner_seconds += time.perf_counter() - t0
        return cached

    def _round(self) -> None:
        # Forwards of one graph and similar length go together: rows are padded to the longest,
        # so a 30-token prefill beside 1-token AR steps would cost 30 tokens a row.
        t0, active = time.perf_counter(), list(self._active)
        resting = [r for r in active if r in self._owed]
        if len(resting) == len(active):  # nobody else to give the thread to
            resting = []
        ready: dict[tuple[str, int], list[tuple[Request, Forward]]] = {}
        for request in active:
            if request in resting:
                self._ended(request)
                continue
            cpu = time.thread_time()
            try:
                forward = self._advance(request)
            except Exception as e:  # noqa: BLE001 - its own error, raised to its caller
                self._finish(request, None, e)
                continue
            over = time.thread_time() - cpu - FAIR_SHARE_S
            if over > 0 and request in self._active:
                self._owed[request] = self._owed.get(request, 0.0) + over
            if forward is not None:
                key = (forward.graph, forward.input_ids.shape[1].bit_length())
                ready.setdefault(key, []).append((request, forward))
        for (graph, _), group in sorted(ready.items()):
            width = self._width([forward for _, forward in group])
            for start in range(0, len(group), width):
                self._run(graph, group[start : start + width])
        elapsed = time.perf_counter() - t0
        for request in resting:  # repaid by the time the others had (gone once it ended)
            owed = self._owed.pop(request, None)
            if owed is not None and owed > elapsed:
                self._owed[request] = owed - elapsed

    def _width(self, forwards: list[Forward]) -> int:
        """Rows a call packs: up to the runner's max_batch, and within prefill_chunk tokens in all."""
        if self.prefill_chunk is None:
            return self.runner.max_batch
        longest = max(forward.input_ids.shape[1] for forward in forwards)
        return max(1, min(self.runner.max_batch, self.prefill_chunk // longest))

    def _advance(self, request: Request) -> Forward | None:
        """Run the request's steps up to its next forward (None when it has ended)."""
        if self._ended(request):
            return None
        chunks = self._chunks.get(request)
        if chunks is not None:  # its step machine waits for the whole forward's outputs
            return chunks.next
        while True:
            step = request.send(request.inbox)
            request.inbox = None
            if step is None:
                self._finish(request, None)
                return None
            if isinstance(step, Forward):
                return self._bounded(request, step)
            if isinstance(step, KVMove):
                t0 = time.perf_counter()
                self.runner.move_kv(step.src, step.dst, step.length, request.kv_region)
                request.runner_seconds += time.perf_counter() - t0
            elif isinstance(step, PrefixKV):
                if self.prefix_cache is not None:
                    t0 = time.perf_counter()
                    self.prefix_cache.store(step.token_ids, request.kv_region)
                    request.runner_seconds += time.perf_counter() - t0
            else:
                request.add_commit(step)
                if request.stop_reached:  # its answer ends at a stop sequence: nothing more to decode
                    self._finish(request, "stop")
                    return None

    def _ended(self, request: Request) -> bool:
        """Finish the request if it was cancelled or its deadline has passed."""
        if request.cancelled or (request.deadline is not None and time.monotonic() > request.deadline):
            self._finish(request, "cancelled" if request.cancelled else "timeout")
            return True
        return False

    def _bounded(self, request: Request, forward: Forward) -> Forward:
        """`forward`, or its first chunk where it is cut: past prefill_chunk, or where the runner does not run it in
        one execution (chunks.cut, the one place a forward is cut)."""
        chunks = cut(forward, self.prefill_chunk, self.runner)
        if len(chunks) == 1:
            return forward
        self._chunks[request] = _Chunks(forward, chunks, [])
        return chunks[0]

    def _run(self, graph: str, batch: list[tuple[Request, Forward]]) -> None:
        rows = [RowFeed.of(f, r.kv_region) for r, f in batch]
        t0 = time.perf_counter()
        try:
            outputs = self.runner.run_batch(graph, rows)  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - the requests of a failed forward fail with its error
            for request, _ in batch:
                self._finish(request, None, e)
            return
        seconds = time.perf_counter() - t0
        for (request, _), out in zip(batch, outputs):
            request.runner_seconds += seconds
            chunks = self._chunks.get(request)
            if chunks is None:
                request.inbox = out
                continue
            chunks.outputs.append(out)
            if len(chunks.outputs) == len(chunks.chunks):  # the whole forward has run: its outputs, as one
                del self._chunks[request]
                request.inbox = merge(chunks.forward, chunks.chunks, chunks.outputs)

    def _finish(self, request: Request, reason: FinishReason | None, error: BaseException | None = None) -> None:
        self._chunks.pop(request, None)
        self._owed.pop(request, None)
        with self._lock:
            if request in self._active:
                self._active.remove(request)
            if request in self._waiting:
                self._waiting.remove(request)
            if request.region is not None:
                self._free_regions.append(request.region)
                request.region = None
        request.finish(reason, error)

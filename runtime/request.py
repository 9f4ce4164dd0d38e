"""A `Request`: one generation in flight, and the thread-safe handle its caller holds.

It owns its state: prompt, decode params, step machine, commits, trace, KV region (while it
runs), deadline and cancel flag. The scheduler thread advances it and finishes it; any other
thread may wait for its result, iterate its settled text, or cancel it.

    req = gen.submit("sort: 3 1 2", chat=True, timeout_s=5)
    for piece in req: print(piece, end="")      # settled text as it commits
    req.result().finish_reason                   # "eos" | "length" | "stop" | "timeout" | "cancelled" | "dead_end"
                                                 # | "tool_calls" (an answer that called a function, then ended)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.decode import STRATEGIES
from refusion.runtime.decode.steps import Commit, DecodeTrace, Outputs, Step, StepMachine, Tokens
from refusion.runtime.options import RequestOptions
from refusion.runtime.structured.tools import cut_call, tool_calls
from refusion.runtime.text import Detokenize, SettledText

if TYPE_CHECKING:
    from refusion.runtime.decode.llada import DiffusionParams
    from refusion.runtime.params import DecodeParams
    from refusion.runtime.structured.tools import Tools

    Params = DecodeParams | DiffusionParams

FinishReason = Literal["eos", "length", "stop", "timeout", "cancelled", "dead_end", "tool_calls"]
_ids = itertools.count(1)


@dataclass
class GenerationStats:
    mode: str
    backend: str
    prompt_tokens: int
    tokens: int  # the answer's tokens, and the EOS or stop token that ended it
    forwards: dict[str, int]
    forward_count: int
    tokens_per_forward: float  # tokens / forwards
    tpf: float  # upstream's per-iteration TPF
    wall_seconds: float  # from the request's start on the scheduler to its end
    runner_seconds: float  # inside the runner (graphs and KV moves; a batched forward counts whole)
    loop_seconds: float  # everything else: policy, masks, bookkeeping, other requests' turns
    tokens_per_second: float
    branches: dict[str, int] = field(default_factory=dict)
    cached_prompt_tokens: int = 0  # prompt tokens whose KV the prefix cache gave (the rest were prefilled)

    @property
    def loop_share(self) -> float:
        return self.loop_seconds / self.wall_seconds if self.wall_seconds else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "loop_share": round(self.loop_share, 4)}


@dataclass
class GenerationResult:
    text: str  # the answer: settled text before the first EOS, or before the stop sequence that ended it
    # the answer's ids in position order: those of `text`, without the EOS or stop token that ended it (a token
    # a stop sequence begins inside stays); only the settled ones when it stopped early
    token_ids: list[int]
    prompt_ids: list[int]
    stats: GenerationStats
    commits: list[Commit]  # what became final at each loop iteration, in order
    finish_reason: FinishReason = "length"
    logprobs: list[float] | None = None  # with logprobs=True: each of token_ids' log-probability when drafted
    # with top_logprobs=N: each of token_ids' N most likely alternatives in that reading, (id, log-probability)
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None
    # with tools: the calls the answer made, OpenAI's way ({"id", "type": "function", "function": {"name",
    # "arguments"}}); `text` is then the answer's text outside them
    tool_calls: list[dict[str, Any]] | None = None

    @property
    def committed_ids(self) -> list[int]:
        """Every token committed, in position order: past the first EOS or a stop too, and across the holes
        `upstream_eos_drop` leaves. What upstream's `generate_refusion` returns (parity compares it)."""
        committed = {p: t for c in self.commits for p, t in zip(c.positions, c.token_ids)}
        return [committed[p] for p in sorted(committed)]

    @property
    def steps(self) -> list[int]:
        """For each token (position order), the loop iteration that committed it."""
        step = {p: c.step for c in self.commits for p in c.positions}
        return [step[p] for p in sorted(step)]


class Request:
    def __init__(self, tokens: Tokens, params: Params, detokenize: Detokenize | None = None, backend: str = "",
                 options: RequestOptions = RequestOptions(), tools: Tools | None = None):
        """A request of params.mode's strategy over `tokens`; its step machine is made when the scheduler
        starts it (`start`). `tools`: the functions its prompt offers, whose calls its result reads."""
        self.id = next(_ids)
        self.tokens, self.prompt_ids, self.params, self.options = tokens, tokens.prompt, params, options
        self.tools = tools
        self.trace = DecodeTrace()
        self._strategy = STRATEGIES[params.mode]
        self.capacity = self._strategy.kv_capacity(len(tokens.prompt), params)
        self.eos_id, self.backend = tokens.eos_id, backend
        timeout_s = options.timeout_s
        self.deadline = time.monotonic() + timeout_s if timeout_s is not None else None
        self.commits: list[Commit] = []
        self._steps: StepMachine | None = None
        self._detokenize = detokenize
        # where the answer stops, followed on the scheduler thread so the request ends there
        self._stops = (self._settled_text() if options.stop or options.stop_token_ids else None)
        self._cancelled = threading.Event()
        self._changed = threading.Condition()
        self._event_waiters = 0  # events() callers waiting on _changed for a commit; result() waits for the end
        self._listeners: list[Callable[[], None]] = []  # called on the scheduler thread at each change (asyncio)
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None
        # the scheduler's: only its thread touches these
        self.region: int | None = None  # its KV region on the runner while it runs
        self.inbox: Outputs | None = None  # its last forward's outputs, for the next step
        self.started = 0.0  # time.perf_counter() when the scheduler started it (a KV region taken)
        self.first_commit_at: float | None = None  # time.perf_counter() of its first commit (servers' TTFT)
        self.runner_seconds = 0.0
        self.cached_tokens = 0  # prompt tokens whose KV came from the prefix cache


    def _settled_text(self) -> SettledText:
        """A fresh reader of this request's settled text, ending where its answer stops."""
        return SettledText(len(self.prompt_ids), self.eos_id, self._detokenize, self.options.stop,
                           self.options.stop_token_ids)

    # -- the caller's side -------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop the request: it ends within one forward, its KV region is freed, and its result
        carries what had settled, with finish_reason "cancelled". Idempotent; no-op once done."""
        self._cancelled.set()
        with self._changed:
            self._changed.notify_all()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def done(self) -> bool:
        return self._result is not None or self._error is not None

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Wait for the end (at most `timeout` seconds); the request's own RefusionError if it failed."""
        with self._changed:
            if not self._changed.wait_for(lambda: self.done, timeout):
                raise RefusionError(f"request {self.id} has no result after {timeout} s; it goes on "
                                    "(cancel() stops it, or pass timeout_s when submitting).")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def events(self) -> Iterator[Commit]:
        """Each commit as it happens, from the first; ends when the request does."""
        seen = 0
        while True:
            with self._changed:
                self._event_waiters += 1
                try:
                    self._changed.wait_for(lambda: len(self.commits) > seen or self.done)
                finally:
                    self._event_waiters -= 1
                fresh, finished = self.commits[seen:], self.done
            seen += len(fresh)
            yield from fresh
            if finished and seen == len(self.commits):
                return

    @contextlib.contextmanager
    def _waking(self, event: asyncio.Event, end_only: bool = False) -> Iterator[bool]:
        """Within: the scheduler thread sets `event` on the running loop at each change, or at the end alone
        (`end_only`). Yields whether the request had already ended when the listener was added."""
        loop = asyncio.get_running_loop()

        def listener() -> None:
            if end_only and not self.done:
                return
            with contextlib.suppress(RuntimeError):  # the loop has closed: no one is waiting any more
                loop.call_soon_threadsafe(event.set)

        with self._changed:
            self._listeners.append(listener)
            ended = self.done
        try:
            yield ended
        finally:
            with self._changed:
                self._listeners.remove(listener)

    async def aevents(self) -> AsyncGenerator[Commit, None]:
        """`events()` for asyncio: each commit as it happens, awaited without blocking the event loop."""
        wake = asyncio.Event()
        with self._waking(wake):
            seen = 0
            while True:
                with self._changed:
                    fresh, finished = self.commits[seen:], self.done
                seen += len(fresh)
                for commit in fresh:
                    yield commit
                if finished:
                    return
                if not fresh:
                    await wake.wait()
                    wake.clear()

    async def aresult(self) -> GenerationResult:
        """`result()` for asyncio: awaits the end without blocking the event loop, which is woken once,
        at the end, not at each commit."""
        ended = asyncio.Event()
        with self._waking(ended, end_only=True) as already:
            if not already:
                await ended.wait()
        return self.result()

    def __iter__(self) -> Iterator[str]:
        """Settled text as it grows: every earlier position committed, up to the first EOS (not
        shown); never half a UTF-8 character. Raises the request's error, if it fails."""
        text = self._text_reader()
        for commit in self.events():
            piece = text.add(commit)
            if piece:
                yield piece
        yield from self._rest(text)

    async def __aiter__(self) -> AsyncIterator[str]:
        """Iteration over settled text for asyncio (`async for piece in request`), as `__iter__` gives it."""
        text = self._text_reader()
        async for commit in self.aevents():
            piece = text.add(commit)
            if piece:
                yield piece
        for piece in self._rest(text):
            yield piece

    def _text_reader(self) -> SettledText:
        if self._detokenize is None:
            raise RefusionError("this export carries no tokenizer, so there is no text to stream; use result().token_ids.")
        return self._settled_text()

    def _rest(self, text: SettledText) -> Iterator[str]:
        """Once it has ended: its error, or the text its result has beyond what `text` showed."""
        if self._error is not None:
            raise self._error
        # Slots dropped after an EOS may leave a gap in positions that the settled text never
        # crosses; the result (upstream's reading) joins what follows it: show that too.
        final = self.result().text
        if final.startswith(text.shown) and len(final) > len(text.shown):
            yield final[len(text.shown):]

    # -- the scheduler's side -----------------------------------------------------------------
    @property
    def kv_region(self) -> int:
        if self.region is None:
            raise RefusionError(f"request {self.id} holds no KV region (it is not running).")
        return self.region

    @property
    def reuses_prefix(self) -> bool:
        """Its strategy can start from a cached prompt prefix's KV."""
        return self._strategy.prefix_reuse

    def start(self, cached: int = 0) -> None:
        """Make its step machine, over a KV region whose first `cached` tokens already hold the prompt's KV."""
        self.cached_tokens = cached
        steps = self._strategy.steps if self.tokens.guide is None else self._strategy.guided
        if steps is None:
            raise RefusionError(f"mode {self.params.mode!r} follows no guide (structured output); use refusion or ar.", "mode")
        self._steps = steps(replace(self.tokens, cached=cached), self.params, self.trace)

    def send(self, outputs: Outputs | None) -> Step | None:
        """Advance the step machine to its next step (None when it is over)."""
        assert self._steps is not None, "the scheduler starts a request before advancing it"
        try:
            return self._steps.send(outputs)
        except StopIteration:
            return None

    def add_commit(self, commit: Commit) -> None:
        if self.first_commit_at is None:
            self.first_commit_at = time.perf_counter()
        with self._changed:
            self.commits.append(commit)
            if self._event_waiters:  # a result() waiter woken for each token would only wait again
                self._changed.notify_all()
            listeners = list(self._listeners)
        for listener in listeners:
            listener()
        if self._stops is not None:
            self._stops.add(commit)

    @property
    def stop_reached(self) -> bool:
        """Its settled text reached a stop sequence: it ends there, with finish_reason "stop"."""
        return self._stops is not None and self._stops.stopped

    def finish(self, reason: FinishReason | None, error: BaseException | None = None) -> None:
        """Settle the result (reason None: ran to its end, "eos" or "length") and wake every waiter."""
        if self._steps is not None:
            self._steps.close()
        with self._changed:
            if error is not None:
                self._error = error
            else:
                self._result = self._build_result(reason)
            self._changed.notify_all()
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def _build_result(self, reason: FinishReason | None) -> GenerationResult:
        committed = {p: t for c in self.commits for p, t in zip(c.positions, c.token_ids)}
        start = len(self.prompt_ids)
        if reason is None:  # ran to its end: every position decoded (upstream_eos_drop's holes joined over)
            positions = sorted(committed)
        else:  # stopped early: only what settled, the contiguous run from the prompt's end
            positions = list(itertools.takewhile(committed.__contains__, itertools.count(start)))
        # The answer's rule (the first EOS, stop strings, stop tokens) read once over the final ids, whatever
        # order they were committed in: the result, its stream and its usage agree.
        answer = SettledText(0, self.eos_id, self._detokenize, self.options.stop, self.options.stop_token_ids)
        answer.add(Commit(0, tuple(committed[p] for p in positions), tuple(range(len(positions))), "final"))
        token_ids = answer.settled
        if answer.stopped:
            reason = "stop"
        elif reason is None and self.trace.dead_end and not answer.ended:
            reason = "dead_end"  # the guide allowed no token where the answer stopped
        elif reason in (None, "stop"):
            reason = "eos" if answer.ended else "length"
        tokens = len(token_ids) + (answer.end_token is not None)  # with the EOS or stop token that ended it
        wall = time.perf_counter() - self.started if self.started else 0.0
        forwards = sum(self.trace.forwards.values())
        stats = GenerationStats(
            mode=self.params.mode, backend=self.backend, prompt_tokens=start, tokens=tokens,
            forwards=dict(self.trace.forwards), forward_count=forwards,
            tokens_per_forward=tokens / forwards if forwards else 0.0, tpf=self.trace.tpf,
            wall_seconds=wall, runner_seconds=self.runner_seconds, loop_seconds=wall - self.runner_seconds,
            tokens_per_second=tokens / wall if wall else 0.0, branches=dict(self.trace.branches),
            cached_prompt_tokens=self.cached_tokens,
        )
        if answer.stopped:
            text = answer.stop_text  # the stop sequence itself is not returned
        else:
            text = self._detokenize(token_ids) if self._detokenize else ""
        returned = positions[: len(token_ids)]
        logprobs = alternatives = None
        if self.options.logprobs:
            drafted = {p: lp for c in self.commits for p, lp in zip(c.positions, c.logprobs)}
            logprobs = [drafted[p] for p in returned]
        if self.options.top_logprobs:
            others = {p: a for c in self.commits for p, a in zip(c.positions, c.alternatives)}
            alternatives = [others[p] for p in returned]
        calls = None
        if self.tools is not None and self.tools.choice != "none":
            cut = reason in ("length", "timeout", "cancelled")
            text, calls = tool_calls(text, cut)
            if cut and not calls and self.tools.choice not in ("auto", "none"):  # its text can only be the call's
                text, calls = "", [cut_call(text)]
            if calls and reason == "eos":
                reason = "tool_calls"
        return GenerationResult(text, token_ids, self.prompt_ids, stats, list(self.commits), reason, logprobs,
                                alternatives, calls)

"""What every serving frontend shares, over one Generator: the request as frontends read it, admission
and the queue limit, the drain, the values the metrics report, answering a request to its end, and the
status of every error (serve/security.py holds the shared limits and the key).

A frontend (Triton's model, serve/triton/model.py; the OpenAI-compatible server, serve/openai/) only
translates: its wire format to a ServeRequest, a `Final` and the streamed pieces back to its responses, its
own way of noticing a client that went away. Per request: `admit()` (a refusal, or a place taken), then
`submit()` (it tokenizes: call it off the thread that receives requests, so a long prompt holds up no other),
then `respond()` from a thread or `answer()` from asyncio.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Generic, TypeVar

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.generator import Generator
from refusion.runtime.request import GenerationResult, Request

Handle = TypeVar("Handle")  # the frontend's own object for a request (Triton's InferenceRequest)


@dataclass(frozen=True)
class ServeRequest:
    prompt: str | None  # the text; or None, and one of messages and prompt_ids
    stream: bool = False
    chat: bool = False
    settings: dict[str, Any] = field(default_factory=dict)  # Generator.submit's keywords given (timeout_s among
    # them, a setting like the others); the rest: the export's
    messages: list[dict[str, str]] | None = None  # a conversation, through the export's chat template
    prompt_ids: list[int] | None = None  # token ids, fed as they are


@dataclass(frozen=True)
class Metrics:
    requests_in_flight: int  # admitted and not yet given their final response
    kv_regions_in_use: int  # KV regions held by running requests


SHUTTING_DOWN = "the server is shutting down; send the request to another instance."  # while it drains


class Status(Enum):
    """What kind of failure an error is, by its gRPC status name, with the HTTP status that says it."""

    INVALID_ARGUMENT = 400  # the request's fault: fix it
    RESOURCE_EXHAUSTED = 429  # the server is full: retry later or elsewhere
    UNAVAILABLE = 503  # the server is going down or cannot serve: retry elsewhere
    INTERNAL = 500  # a bug


@dataclass(frozen=True)
class Final:
    """How a request ended: its result, or the message its client gets and what kind of failure it is."""

    result: GenerationResult | None = None
    error: str = ""
    status: Status = Status.INVALID_ARGUMENT
    field: str | None = None  # the request's field the error refuses (RefusionError.field), where it refuses one

    @property
    def internal(self) -> bool:  # a bug, not the request's fault
        return self.status is Status.INTERNAL

    def coded(self) -> str:
        """The error with its status name in front: how it crosses a wire that carries only a message
        (Triton's responses; a gRPC stream's error_message)."""
        return f"{self.status.name}: {self.error}"


def decode(message: str) -> tuple[Status | None, str]:
    """A `Final.coded()` message back as (status, message); (None, message) when it carries no status."""
    name, sep, rest = message.partition(": ")
    status = Status.__members__.get(name) if sep else None
    return (status, rest) if status is not None else (None, message)


class Frontend(Generic[Handle]):
    """One Generator behind a request limit: `max_requests` running plus `max_queue` waiting. A request is
    live from `submit` until `respond` has handed over its final response."""

    def __init__(self, gen: Generator, max_queue: int,
                 on_end: Callable[[Request, Handle, Final], None] | None = None):
        """`on_end(request, handle, final)` is called once per submitted request when it has ended and given
        its place back, whether or not its client was still there (a frontend's metrics)."""
        self.gen, self.max_queue, self.on_end = gen, max_queue, on_end
        self.max_requests = gen.status().max_requests  # fixed when the runner is made
        self.limit = self.max_requests + max_queue
        self.drain_deadline: float | None = None  # time.time() at which what still runs is cancelled
        self._live: dict[Request, Handle] = {}
        self._admitted = 0  # admitted, not yet submitted
        self._lock = threading.Condition()
        self._closed = False
        self._releasing: set[asyncio.Task[None]] = set()  # answer()'s waits for requests whose client left

    def admit(self, count: int = 1) -> Final | None:
        """Take places for `count` new requests (all or none), or the refusal their client gets (retryable: the
        server is full or going down). Every admitted request must then be submitted, which gives its place back
        if it fails, or its place given back (`give_back`)."""
        with self._lock:
            refusal = self._refusal(count)
            if refusal is None:
                self._admitted += count
            return refusal

    def give_back(self, count: int) -> None:
        """Places admitted for requests that will not be submitted (another of their client's failed)."""
        with self._lock:
            self._admitted -= count
            self._lock.notify_all()

    def _refusal(self, count: int) -> Final | None:
        if self._closed or self.drain_deadline is not None:
            return Final(error=SHUTTING_DOWN, status=Status.UNAVAILABLE)
        held = len(self._live) + self._admitted
        if held + count > self.limit:
            return Final(error=f"the server holds {held} requests, its limit ({self.max_requests} running "
                               f"+ {self.max_queue} queued, --max-queue); retry later or add instances.",
                         status=Status.RESOURCE_EXHAUSTED)
        return None

    def submit(self, job: ServeRequest, handle: Handle) -> Request:
        """Start an admitted `job` (its bad settings or prompt raise here, a RefusionError); it is live until
        `respond` ends it."""
        try:
            # Tokenizing and submitting stay outside the lock that cancellation and final responses take.
            request = self.gen.submit(job.prompt, messages=job.messages, prompt_ids=job.prompt_ids, chat=job.chat,
                                      **job.settings)
        except BaseException:
            with self._lock:
                self._admitted -= 1
            raise
        with self._lock:
            self._admitted -= 1
            self._live[request] = handle
        return request

    def respond(self, request: Request, stream: bool, piece: Callable[[str], None],
                final: Callable[[Final], None]) -> None:
        """Answer `request` to its end: each piece of settled text when streaming, then its final, sent under
        the lock that `cancel_gone` takes (a frontend's handle may die with its final response)."""
        try:
            if stream:
                for text in request:
                    piece(text)
            outcome = Final(request.result())
        except Exception as e:  # noqa: BLE001 - the request's own error, or a bug: either way a final response
            outcome = _failed(e)
        self._release(request, lambda: final(outcome), outcome)

    async def answer(self, request: Request, stream: bool) -> AsyncGenerator[str | Final, None]:
        """`respond` for asyncio: each piece of settled text when streaming, then the Final. Closing the
        iterator before the Final (a client that went away) cancels the request; it gives its place back once
        it has ended, within a forward."""
        outcome: Final | None = None
        try:
            try:
                if stream:
                    async for text in request:
                        yield text
                outcome = Final(await request.aresult())
            except Exception as e:  # noqa: BLE001 - the request's own error, or a bug: either way a final response
                outcome = _failed(e)
            yield outcome
        finally:
            if outcome is not None and request.done:
                self._release(request, lambda: None, outcome)
            else:
                self.abandon(request)

    def abandon(self, request: Request) -> None:
        """Cancel a submitted request nobody will answer (from asyncio); it gives its place back once it has
        ended, within a forward."""
        request.cancel()
        # Awaited in a task of its own: the one abandoning it may itself be cancelled.
        task = asyncio.get_running_loop().create_task(self._release_at_end(request))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _release_at_end(self, request: Request) -> None:
        try:
            outcome = Final(await request.aresult())
        except Exception as e:  # noqa: BLE001 - as in answer()
            outcome = _failed(e)
        self._release(request, lambda: None, outcome)

    def _release(self, request: Request, final: Callable[[], None], outcome: Final) -> None:
        """Send the final response (under the lock that `cancel_gone` takes), give the request's place back,
        then tell `on_end`."""
        with self._lock:
            final()
            handle = self._live.pop(request, _GONE)
            self._lock.notify_all()
        if handle is not _GONE and self.on_end is not None:
            self.on_end(request, handle, outcome)

    def cancel_gone(self, gone: Callable[[Handle], bool]) -> None:
        """Cancel the requests whose handle says the client went away; every one once the drain's deadline
        has passed. Each ends within a forward, with its final response."""
        expired = self.drain_deadline is not None and time.time() > self.drain_deadline
        with self._lock:
            doomed = [request for request, handle in self._live.items() if expired or gone(handle)]
        for request in doomed:
            request.cancel()

    def drain(self, deadline: float) -> None:
        """Refuse new requests from now; cancel what still runs at `deadline` (time.time()). The first call wins."""
        if self.drain_deadline is None:
            self.drain_deadline = deadline

    def metrics(self) -> Metrics:
        with self._lock:
            held = len(self._live) + self._admitted
        return Metrics(held, self.gen.status().regions_in_use)

    def close(self, timeout_s: float) -> None:
        """Refuse new requests, cancel every live one and wait (at most `timeout_s`) for their final responses."""
        with self._lock:
            self._closed = True
            for request in self._live:
                request.cancel()
            self._lock.wait_for(lambda: not self._live, timeout=timeout_s)


_GONE: Any = object()  # a request no longer live


def _failed(error: Exception) -> Final:
    if isinstance(error, RefusionError):  # it failed alone (e.g. over a runner's limit), with its own error
        return Final(error=str(error), field=error.field)
    return Final(error=f"internal error: {type(error).__name__}: {error}", status=Status.INTERNAL)  # a bug

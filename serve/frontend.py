"""What every serving frontend shares, over one Generator: the request as frontends read it, admission
and the queue limit, the drain, the values the metrics report, and answering a request to its end.

A frontend (Triton's model, serve/triton/model.py) only translates: its wire format to a ServeRequest, a
`Final` and the streamed pieces back to its responses, its own way of noticing a client that went away.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.generator import Generator
from refusion.runtime.request import GenerationResult, Request

Handle = TypeVar("Handle")  # the frontend's own object for a request (Triton's InferenceRequest)


@dataclass(frozen=True)
class ServeRequest:
    prompt: str
    stream: bool = False
    chat: bool = False
    timeout_s: float | None = None
    settings: dict[str, Any] = field(default_factory=dict)  # decode settings given; the rest: the export's


@dataclass(frozen=True)
class Metrics:
    requests_in_flight: int  # submitted and not yet ended
    kv_regions_in_use: int  # KV regions held by running requests


@dataclass(frozen=True)
class Final:
    """How a request ended: its result, or the message its client gets."""

    result: GenerationResult | None = None
    error: str = ""
    internal: bool = False  # a bug, not the request's fault


class Frontend(Generic[Handle]):
    """One Generator behind a request limit: `max_requests` running plus `max_queue` waiting. A request is
    live from `submit` until `respond` has handed over its final response."""

    def __init__(self, gen: Generator, max_queue: int):
        self.gen, self.max_queue = gen, max_queue
        self.limit = gen.runner.max_requests + max_queue
        self.drain_deadline: float | None = None  # time.time() at which what still runs is cancelled
        self._live: dict[Request, Handle] = {}
        self._lock = threading.Condition()
        self._closed = False

    def refusal(self) -> str | None:
        """Why a new request is turned away now (retryable: the server is full or going down), else None.
        Only the thread that submits adds requests, so the answer holds until its next submit."""
        if self._closed or self.drain_deadline is not None:
            return "the server is shutting down; send the request to another instance."
        held = len(self._live)
        if held >= self.limit:
            return (f"the server holds {held} requests, its limit ({self.gen.runner.max_requests} running "
                    f"+ {self.max_queue} queued, --max-queue); retry later or add instances.")
        return None

    def submit(self, job: ServeRequest, handle: Handle) -> Request:
        """Start `job` (its bad settings raise here, a RefusionError); it is live until `respond` ends it."""
        # Tokenizing and submitting stay outside the lock that cancellation and final responses take.
        request = self.gen.submit(job.prompt, chat=job.chat, timeout_s=job.timeout_s, **job.settings)
        with self._lock:
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
        except RefusionError as e:  # it failed alone (e.g. over a runner's limit), with its own error
            outcome = Final(error=str(e))
        except Exception as e:  # noqa: BLE001 - a bug: the client still gets a final response
            outcome = Final(error=f"internal error: {type(e).__name__}: {e}", internal=True)
        with self._lock:
            final(outcome)
            self._live.pop(request, None)
            self._lock.notify_all()

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
        return Metrics(self.gen.scheduler.in_flight, self.gen.scheduler.regions_in_use)

    def close(self, timeout_s: float) -> None:
        """Refuse new requests, cancel every live one and wait (at most `timeout_s`) for their final responses."""
        self._closed = True
        with self._lock:
            for request in self._live:
                request.cancel()
            self._lock.wait_for(lambda: not self._live, timeout=timeout_s)

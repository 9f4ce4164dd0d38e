"""What every OpenAI route does with a request, apart from its own fields: its body read within the limits, its
jobs submitted through the frontend, its answers awaited until they end or their client goes away, and a runtime
refusal's message and field named as the client sent them. app.py's chat and completions routes and
responses_route.py's Responses route share them."""

from __future__ import annotations

import asyncio
import contextlib
import re
from dataclasses import dataclass, replace
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive

from refusion.runtime.core.errors import ContextLengthError, RefusionError
from refusion.runtime.core.settings import SETTINGS
from refusion.runtime.request import Request as Generation
from refusion.serve.frontend import Final, Frontend, ServeRequest, Status
from refusion.serve.openai.metrics import Arrival
from refusion.serve.openai.responses import ApiError
from refusion.serve.openai.schema import ApiRequest

DISCARD_FACTOR = 8  # a body over the limit is read and dropped up to this many times it, so its client sees the 413


@dataclass(frozen=True)
class AppConfig:
    model: str  # the name clients send as "model"
    max_body: int  # bytes of a request body
    body_timeout_s: float  # for the whole body to arrive after the headers
    api_key: str | None = None  # every path but /health needs `Authorization: Bearer KEY`
    allowed_hosts: frozenset[str] = frozenset()  # Host names taken beside IP addresses and localhost ("*": any)
    retry_after_s: int = 1  # what a 429 tells its client


def check_json(content_type: str | None) -> None:
    """A body declared JSON, or a 415: a web page can send a form or text/plain to any address without asking,
    but not application/json."""
    if (content_type or "").split(";", 1)[0].strip().lower() != "application/json":
        given = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        raise ApiError(415, f"the request has {given}; send the body as JSON with Content-Type: application/json "
                            "(curl: -H 'Content-Type: application/json').", code="unsupported_media_type")


async def read_body(http: Request, config: AppConfig) -> bytes:
    """The whole body, within the size limit (413) and the time limit (408)."""
    limit = config.max_body
    too_large = ApiError(413, f"the body is over {limit} bytes, the limit of this server (the longest prompt that fits "
                              "the model's positions, JSON-escaped, and the rest); send a shorter prompt.",
                         code="request_too_large")
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit * DISCARD_FACTOR:
        raise too_large  # not read at all: the connection closes after the answer

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in http.stream():
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            elif size > limit * DISCARD_FACTOR:
                break
        if size > limit:
            raise too_large
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), config.body_timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the body did not arrive within {config.body_timeout_s:g} s of the headers; send it "
                            "whole.", code="request_timeout") from None
    except ClientDisconnect:
        raise ApiError(400, "the client went away before its body arrived.") from None


def admit(frontend: Frontend[Arrival], places: int, config: AppConfig) -> None:
    """Take `places` in the frontend, or refuse: 429 with Retry-After when it is full, 503 when it is going down."""
    refusal = frontend.admit(places)
    if refusal is not None:
        full = refusal.status is Status.RESOURCE_EXHAUSTED
        raise ApiError(refusal.status.value, refusal.error, code="server_full" if full else "server_unavailable",
                       headers={"Retry-After": str(config.retry_after_s)} if full else {})


async def submit(frontend: Frontend[Arrival], api: ApiRequest, arrival: Arrival) -> list[Generation]:
    """Each job's n choices, in choice order, from the places `frontend.admit` took for them. Tokenized off the
    event loop, so that a long prompt holds up no other request. With n > 1 a job's first choice runs alone until
    its first commit (its prompt's KV is in the prefix cache by then) and the others copy that KV instead of
    prefilling it. If one fails to start, those started are cancelled and every place left is given back."""
    generations: list[Generation] = []
    places = api.choices
    try:
        for job in api.jobs:
            for choice in range(api.n):
                places -= 1  # a submit gives its place back itself if it fails
                generations.append(await run_in_threadpool(frontend.submit, _nth(job, choice), arrival))
                if choice == 0 and api.n > 1 and frontend.gen.status().prefix_cache is not None:
                    await _first_commit(generations[-1])
    except BaseException as e:
        frontend.give_back(places)
        for generation in generations:
            frontend.abandon(generation)
        if isinstance(e, RefusionError) and not isinstance(e, (ApiError, ContextLengthError)):
            raise RefusionError(*api.as_client(str(e), e.field)) from None  # named as the client sent it
        raise
    return generations


def _nth(job: ServeRequest, choice: int) -> ServeRequest:
    """A job's choice-th choice: with a seed, seed + choice, so that sampled choices differ yet repeat."""
    seed = job.settings.get("seed")
    if not choice or seed is None:
        return job
    return replace(job, settings={**job.settings, "seed": (seed + choice) % 2**64})


async def _first_commit(generation: Generation) -> None:
    """Until the request's first commit, or its end."""
    events = generation.aevents()
    try:
        await anext(events, None)
    finally:
        await events.aclose()


async def until_end_or_gone(frontend: Frontend[Arrival], generations: list[Generation],
                             receive: Receive) -> list[Final] | None:
    """Each request's Final, or None once their client has disconnected (the requests are cancelled then)."""
    answers = [frontend.answer(generation, stream=False) for generation in generations]
    endings = asyncio.gather(*(anext(answer) for answer in answers))
    gone = asyncio.ensure_future(_disconnect(receive))
    waited: list[asyncio.Future[Any]] = [endings, gone]
    try:
        await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not endings.done():
        endings.cancel()  # each answer's iterator cancels its request as it closes
        with contextlib.suppress(asyncio.CancelledError):
            await endings
    for answer in answers:
        await answer.aclose()
    if endings.cancelled():
        return None
    finals = [final for final in endings.result() if isinstance(final, Final)]
    assert len(finals) == len(answers), "a non-streaming answer yields only its Final"
    return finals


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


_FIELDS = {setting.name: setting.openai[0] for setting in SETTINGS if setting.openai}  # a setting's OpenAI name
_ROW = re.compile(r"[a-z_]+")  # a field's first name: the setting's row, before a `.sub` or an `[index]`


def as_sent(message: str, field: str | None) -> tuple[str, str | None]:
    """A runtime refusal's message and `param`, the field it refuses (RefusionError.field), both by the name the
    client sent it as (json_schema: guided_json); no param where it refuses no field."""
    if field is None:
        return message, None
    row = _ROW.match(field)
    name = row[0] if row else field
    sent = _FIELDS.get(name, name)
    return (sent + message[len(name):] if message.startswith(name) else message), sent + field[len(name):]

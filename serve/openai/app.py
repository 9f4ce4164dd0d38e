"""The OpenAI-compatible routes, a FastAPI app over serve/frontend.py's seam (one Generator).

    GET  /v1/models, /v1/models/{model}
    POST /v1/chat/completions, /v1/completions     (stream: server-sent events ending in `data: [DONE]`)
    POST /v1/responses                             (OpenAI's Responses API on the chat path: responses_route.py)
    GET  /health                                   (200 ready / 503 draining, with queue and KV state)
    GET  /metrics                                  (Prometheus text)

Every answer that is not a completion is OpenAI's error JSON with its HTTP status: a bad body or field 400
naming it, an unknown model or path 404, a body too large 413 or too slow 408, one that is not JSON 415, the
server full 429 with Retry-After, draining 503; a bug is a 500 whose body names only its type (the traceback
goes to the log). What a web page could send is refused: a Host header that names no host of this server (DNS
rebinding) and a body that is not declared JSON (a form); no CORS header is ever sent.
A request is read whole within the body limits before anything runs, and its client going away cancels it
(streaming or not): its KV region is free within a forward.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from refusion.runtime.core.errors import ContextLengthError, RefusionError
from refusion.runtime.core.export_manifest import MANIFEST_NAME
from refusion.runtime.request import GenerationResult
from refusion.runtime.request import Request as Generation
from refusion.runtime.structured.tools import before_calls
from refusion.runtime.text import covering
from refusion.serve.frontend import Final, Frontend
from refusion.serve.openai.exchange import AppConfig, admit, as_sent, check_json, read_body, submit, until_end_or_gone
from refusion.serve.openai.guards import HostCheck, KeyCheck
from refusion.serve.openai.metrics import CONTENT_TYPE, Arrival, ServerMetrics
from refusion.serve.openai.responses import ApiError, Reply, TokenText, answer_logprobs, error_body, sse, token_logprobs
from refusion.serve.openai.responses_route import create_response
from refusion.serve.openai.schema import CHAT, COMPLETIONS, ApiRequest, parse_json, read_request

log = logging.getLogger("refusion.serve.openai")



def create_app(frontend: Frontend[Arrival], metrics: ServerMetrics, config: AppConfig) -> FastAPI:
    app = FastAPI(title="refusion", docs_url=None, redoc_url=None, openapi_url=None)
    gen = frontend.gen
    if config.api_key is not None:
        app.add_middleware(KeyCheck, key=config.api_key, refused=lambda: metrics.refused.labels("401").inc())
    app.add_middleware(HostCheck, allowed=config.allowed_hosts, refused=lambda: metrics.refused.labels("400").inc())
    tokenizer = gen.tokenizer

    token_text = TokenText(tokenizer)  # an id's text, and its true bytes (chat logprobs' `bytes`)

    def detokenize(ids: list[int]) -> str:
        return tokenizer.decode(ids) if tokenizer is not None else ""  # the server refuses exports without one

    def refused(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
        metrics.refused.labels(str(status)).inc()
        return JSONResponse(body, status, headers)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> Response:
        return refused(e.status, e.body(), e.headers)

    @app.exception_handler(RefusionError)
    async def refusion_error(http: Request, e: RefusionError) -> Response:  # the runtime's refusal of a setting
        if isinstance(e, ContextLengthError):  # as OpenAI sends it: clients classify it by this code (and phrase)
            prompt = "messages" if http.url.path.endswith("/chat/completions") else "prompt"
            return refused(400, error_body(400, str(e), prompt, "context_length_exceeded"))
        message, param = as_sent(str(e), e.field)
        return refused(400, error_body(400, message, param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:
        message = (f"no route {request.method} {request.url.path}; the API is /v1/models, /v1/chat/completions, "
                   "/v1/completions, /v1/responses, /health, /metrics." if e.status_code in (404, 405) else str(e.detail))
        return refused(e.status_code, error_body(e.status_code, message), getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def bug(_: Request, e: Exception) -> Response:
        log.exception("internal error")
        return refused(500, error_body(500, f"internal error ({type(e).__name__}); the server's log has its traceback."))

    @app.get("/health")
    async def health() -> Response:
        m, now = frontend.metrics(), gen.status()
        status = ("failed" if not now.alive else "draining" if frontend.drain_deadline is not None else "ready")
        cache = now.prefix_cache
        body = {"status": status, "model": config.model,
                "requests_in_flight": m.requests_in_flight, "kv_regions_in_use": m.kv_regions_in_use,
                "kv_regions": now.max_requests, "max_queue": frontend.max_queue,
                "prefix_cache": {"blocks": cache.blocks, "bytes": cache.bytes,
                                 "hit_tokens": cache.hit_tokens} if cache is not None else None}
        return JSONResponse(body, 200 if status == "ready" else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    created = int((gen.manifest.path / MANIFEST_NAME).stat().st_mtime)  # when the export was written

    def model_card() -> dict[str, Any]:
        return {"id": config.model, "object": "model", "created": created, "owned_by": "refusion",
                "max_model_len": gen.manifest.max_positions}

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        if model != config.model:
            raise ApiError(404, f"the model {model!r} does not exist here; this server serves {config.model!r}.",
                           "model", "model_not_found")
        return JSONResponse(model_card())

    async def complete(endpoint: str, http: Request) -> Response:
        arrival = Arrival(endpoint)
        check_json(http.headers.get("content-type"))
        body = await read_body(http, config)
        # Parsed and checked off the event loop: linear in the body's size, which the limit bounds, but not free.
        api = await run_in_threadpool(lambda: read_request(endpoint, parse_json(body), config.model))
        if api.choices > frontend.limit:
            raise ApiError(400, f"the request asks for {api.choices} choices ({len(api.jobs)} prompt(s) x n={api.n}), "
                                f"more than the {frontend.limit} requests this server holds at once; ask for fewer.",
                           "n" if api.n > 1 else "prompt")
        admit(frontend, api.choices, config)
        generations = await submit(frontend, api, arrival)
        reply = Reply(endpoint, config.model, gen.manifest.fingerprint)
        if api.stream:
            return StreamingResponse(_events(frontend, generations, api, reply, detokenize, token_text),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        finals = await until_end_or_gone(frontend, generations, http.receive)
        if finals is None:
            return Response(status_code=499)  # nobody reads it
        failed = [final for final in finals if final.result is None]
        if failed:  # a request that fails alone (a guide over its budget) names its field, as a refusal does
            raise ApiError(failed[0].status.value, *as_sent(*api.as_client(failed[0].error, failed[0].field)))
        results = [final.result for final in finals if final.result is not None]
        logprobs = [answer_logprobs(r, token_text, reply.chat) for r in results] if api.logprobs else None
        return JSONResponse(reply.completion(results, logprobs, api.n, api.token_ids))

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request) -> Response:
        return await complete(CHAT, http)

    @app.post("/v1/completions")
    async def completions(http: Request) -> Response:
        return await complete(COMPLETIONS, http)

    @app.post("/v1/responses")
    async def responses(http: Request) -> Response:
        return await create_response(http, frontend, config, gen.manifest.fingerprint)

    return app


async def _events(frontend: Frontend[Arrival], generations: list[Generation], api: ApiRequest, reply: Reply,
                  detokenize: Callable[[list[int]], str], token_text: Callable[[int], str]) -> AsyncIterator[bytes]:
    """The stream: per choice (chat) the role, each piece of settled text (with its tokens' log-probabilities,
    when asked for), the finish reason; then (include_usage) the usage, then [DONE]. Choices' chunks interleave
    as they settle, each naming its index; an error after the stream began is an error event. Closed early (its
    client disconnected), every answer's iterator cancels its request."""
    usage = api.include_usage
    arrived: asyncio.Queue[tuple[int, str | Final | None]] = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        answers = frontend.answer(generation, stream=True)
        try:
            async for item in answers:
                arrived.put_nowait((index, item))
        finally:
            await answers.aclose()
            arrived.put_nowait((index, None))

    pumps = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    shown = [_StreamLogprobs(g, detokenize, token_text, reply.chat) if api.logprobs else None for g in generations]
    results: list[GenerationResult | None] = [None] * len(generations)
    settled, sent = [""] * len(generations), [""] * len(generations)  # with tools: the text read, the text shown
    try:
        if reply.chat:
            for index in range(len(generations)):
                yield sse(reply.chunk(first=True, include_usage=usage, index=index))
        running = len(generations)
        while running:
            index, item = await arrived.get()
            logprobs = shown[index]
            if item is None:
                running -= 1
            elif isinstance(item, str):
                if api.tool_calls:  # only text surely outside a call is shown as it settles; the calls come whole
                    settled[index] += item
                    item = before_calls(settled[index])[len(sent[index]):]
                    sent[index] += item
                if item:
                    yield sse(reply.chunk(item, include_usage=usage, index=index,
                                          logprobs=logprobs.piece(item) if logprobs else None))
            elif item.result is not None:
                results[index] = result = item.result
                if api.tool_calls:  # what was held back: the text after that shown (the answer's is stripped), calls
                    lead = sent[index].lstrip()
                    rest = result.text[len(lead):] if result.text.startswith(lead) else ""
                    if rest or result.tool_calls:
                        yield sse(reply.chunk(rest or None, include_usage=usage, index=index,
                                              tool_calls=result.tool_calls))
                yield sse(reply.chunk(finish_reason=result.finish_reason, include_usage=usage, index=index,
                                      token_ids=result.token_ids if api.token_ids else None,
                                      logprobs=logprobs.rest(result) if logprobs else None))
            else:
                yield sse(error_body(item.status.value, *as_sent(*api.as_client(item.error, item.field))))
        answered = [r for r in results if r is not None]
        if usage and len(answered) == len(results):
            yield sse(reply.usage_chunk(answered, api.n))
        yield sse("[DONE]")
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


class _StreamLogprobs:
    """The log-probabilities a choice's stream carries: each piece of text those of the tokens it completes,
    the closing chunk those of the tokens left (whose text a stop sequence or EOS held back)."""

    def __init__(self, generation: Generation, detokenize: Callable[[list[int]], str],
                 token_text: Callable[[int], str], chat: bool):
        self.generation, self.detokenize, self.token_text, self.chat = generation, detokenize, token_text, chat
        self.text, self.sent = "", 0

    def piece(self, text: str) -> Any:
        self.text += text
        drafted: dict[int, tuple[int, float, tuple[tuple[int, float], ...]]] = {}
        for commit in list(self.generation.commits):
            others = commit.alternatives or ((),) * len(commit.token_ids)
            drafted.update(zip(commit.positions, zip(commit.token_ids, commit.logprobs, others)))
        run = [drafted[p] for p in itertools.takewhile(drafted.__contains__,
                                                       itertools.count(len(self.generation.prompt_ids)))]
        ids = [token for token, _, _ in run]
        new = run[self.sent:covering(ids, self.text, self.detokenize)]
        offset = sum(len(self.token_text(t)) for t in ids[: self.sent])
        self.sent += len(new)
        alternatives = [a for _, _, a in new] if self.generation.options.top_logprobs else None
        return token_logprobs([t for t, _, _ in new], [lp for _, lp, _ in new], alternatives, self.token_text,
                              self.chat, offset)

    def rest(self, result: GenerationResult) -> Any:
        logprobs = answer_logprobs(result, self.token_text, self.chat, self.sent)
        self.sent = len(result.token_ids)
        return logprobs

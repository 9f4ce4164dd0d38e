"""POST /v1/responses: OpenAI's Responses API on the chat endpoint's path (app.py registers it).

The body is read within the same limits, read into the chat request it is (responses_request.py), admitted,
submitted and answered through the same frontend, with the same errors and metrics (endpoint "responses"), and
its client going away cancels it; only the shapes differ: a Response object, or its stream of events
(responses_reply.py). Errors name the fields by their Responses names.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from refusion.runtime.core.errors import ContextLengthError, RefusionError
from refusion.runtime.request import Request as Generation
from refusion.runtime.structured.tools import before_calls
from refusion.serve.frontend import Final, Frontend
from refusion.serve.openai.exchange import AppConfig, admit, as_sent, check_json, read_body, submit, until_end_or_gone
from refusion.serve.openai.metrics import Arrival
from refusion.serve.openai.responses import ApiError, Reply
from refusion.serve.openai.responses_reply import ResponseEvents, ResponseReply, sse_event
from refusion.serve.openai.responses_request import RESPONSES, ResponsesRequest, read_responses, renamed
from refusion.serve.openai.schema import parse_json


async def create_response(http: Request, frontend: Frontend[Arrival], config: AppConfig, fingerprint: str) -> Response:
    """The Response to `http`, or an ApiError (the app's handler sends it)."""
    arrival = Arrival(RESPONSES)
    check_json(http.headers.get("content-type"))
    body = await read_body(http, config)
    wanted = await run_in_threadpool(lambda: read_responses(parse_json(body), config.model))
    admit(frontend, 1, config)
    try:
        generations = await submit(frontend, wanted.api, arrival)
    except ApiError:
        raise
    except ContextLengthError as e:  # as OpenAI sends it: clients classify it by this code
        raise renamed(ApiError(400, str(e), "input", "context_length_exceeded")) from None
    except RefusionError as e:  # the runtime's refusal of a setting, named as the client sent it
        raise _failure(Final(error=str(e), field=e.field), wanted) from None
    reply = ResponseReply(Reply(RESPONSES, config.model, fingerprint), wanted.echo)
    if wanted.stream:
        return StreamingResponse(_events(frontend, generations[0], wanted, reply), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    finals = await until_end_or_gone(frontend, generations, http.receive)
    if finals is None:
        return Response(status_code=499)  # nobody reads it
    if finals[0].result is None:  # it failed alone (a guide over its budget): its field named, as a refusal's
        raise _failure(finals[0], wanted)
    return JSONResponse(reply.complete(finals[0].result))


def _failure(final: Final, wanted: ResponsesRequest) -> ApiError:
    """A runtime error as the ApiError its client gets, naming the field by its Responses name."""
    return renamed(ApiError(final.status.value, *as_sent(*wanted.api.as_client(final.error, final.field))),
                   wanted.sources)


async def _events(frontend: Frontend[Arrival], generation: Generation, wanted: ResponsesRequest,
                  reply: ResponseReply) -> AsyncIterator[bytes]:
    """The stream: response.created and in_progress, the message's text as it settles, then the message closed,
    each call and response.completed (or response.incomplete); a failure after the start is an error event and
    response.failed. With tools only text surely outside a call is shown as it settles (its leading blanks held:
    the answer's text is stripped), the rest with the calls at the end. Closed early (its client disconnected),
    the answer's iterator cancels the request."""
    events = ResponseEvents(reply)
    answers = frontend.answer(generation, stream=True)
    settled = sent = ""  # with tools: the text read, the text shown
    try:
        for event in events.opening():
            yield sse_event(event)
        async for item in answers:
            if isinstance(item, str):
                if wanted.api.tool_calls:
                    settled += item
                    item = before_calls(settled).lstrip()[len(sent):]
                sent += item
                for event in events.text(item) if item else ():
                    yield sse_event(event)
                continue
            if item.result is not None:
                text = item.result.text
                rest = text[len(sent):] if wanted.api.tool_calls and text.startswith(sent) else ""
                closing = events.closing(item.result, rest)
            else:
                error = _failure(item, wanted)
                closing = events.failed(error.status, error.message, error.param)
            for event in closing:
                yield sse_event(event)
    finally:
        await answers.aclose()

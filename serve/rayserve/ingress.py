"""The Ray Serve application's ingress: every HTTP request of the OpenAI API arrives here (Serve's proxy is the
listening socket), is checked as the single-process server checks it before its body (Host header, key), read
whole within the same body limits, and relayed (relay.py) to a replica the router picks by its prompt's prefix
(router.py). The replica's app answers it; this relays the answer back as it comes, a stream's events included.

    GET /health    the application's state: 200 ready (every replica running) or degraded (fewer, at least one),
                   503 unavailable (none) or draining; each replica's own /health beside it, with its id and
                   process id
    GET /metrics   every replica's metrics, labelled `replica`, and this ingress's refusals (replica="ingress")
    the rest       relayed: /v1/chat/completions, /v1/completions, /v1/responses, /v1/models; the answer
                   names its replica in the header X-Refusion-Replica

`drain` (`refusion-run serve --replicas` calls it on SIGTERM) refuses new requests with 503, as one server
draining does, and waits for those in flight to end. A replica that dies with requests on it is replaced by Serve;
the requests it held end with 503 and Retry-After (a stream that had begun, with an error event), never a hang; a
request no replica takes within `route_timeout_s` (none running) gets the same 503, and one beyond Serve's queue a
429 with Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any, cast

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, RequestCancelledError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from ray.serve.schema import ReplicaState
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from refusion.serve.frontend import SHUTTING_DOWN
from refusion.serve.openai.exchange import AppConfig, read_body
from refusion.serve.openai.guards import HostCheck, KeyCheck
from refusion.serve.openai.metrics import CONTENT_TYPE
from refusion.serve.openai.responses import ApiError, sse
from refusion.serve.rayserve.prefix_owners import replicas_of
from refusion.serve.rayserve.relay import Relayed, prompt_text
from refusion.serve.rayserve.replica import ACCEPTED
from refusion.serve.rayserve.router import PIN

log = logging.getLogger("refusion.serve.rayserve")

REPLICA_HEADER = b"x-refusion-replica"  # on every relayed answer: the replica that gave it
_ASK_S = 5.0  # for a replica's /health or /metrics


@dataclass(frozen=True)
class IngressConfig:
    app: AppConfig  # the model's name, the body's limits, the key, the Host names: as the single server's
    replica_deployment: str  # the replicas' deployment's name, in this application
    target_replicas: int  # replicas the application runs when whole (autoscaling: its minimum)
    max_requests: int  # relayed at once, every replica's places (running + queued); more are refused, 429
    route_timeout_s: float = 30.0  # for a replica to take a request (while none runs)


class _Gone(Exception):
    """The client went away."""


class OpenAIIngress:
    """Serve's ingress deployment (serve.ingress with `__serve_build_asgi_app__`): app.py's build_app binds it."""

    def __init__(self, replicas: DeploymentHandle, config: IngressConfig):
        self.replicas, self.config = replicas, config
        self.registry = CollectorRegistry()
        self.refused = Counter("refusion_requests_refused", "Requests refused before generating, by HTTP status",
                               ["status"], registry=self.registry)
        self.app_name = serve.get_replica_context().app_name
        self.relaying = 0  # requests relayed and not yet answered
        self.draining = False
        self.idle = asyncio.Event()  # set when the last request relayed is answered

    def __serve_build_asgi_app__(self) -> ASGIApp:
        app: ASGIApp = self._route
        c = self.config.app
        if c.api_key is not None:
            app = KeyCheck(app, c.api_key, lambda: self.refused.labels("401").inc())
        return HostCheck(app, c.allowed_hosts, lambda: self.refused.labels("400").inc())

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        if scope["method"] == "GET" and scope["path"] == "/health":
            response = await self._health()
        elif scope["method"] == "GET" and scope["path"] == "/metrics":
            response = Response(await self._metrics(), media_type=CONTENT_TYPE)
        else:
            try:
                return await self._relay(scope, receive, send)
            except ApiError as e:
                response = self._refusal(e)
        await response(scope, receive, send)

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests (503) and wait up to `timeout_s` for those in flight to end; how many still run."""
        self.draining = True
        if self.relaying:
            self.idle.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.idle.wait(), timeout_s)
        return self.relaying

    def _refusal(self, e: ApiError) -> Response:
        self.refused.labels(str(e.status)).inc()
        return JSONResponse(e.body(), e.status, e.headers)

    async def _relay(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.draining:  # as one server's frontend refuses while it drains
            raise ApiError(503, SHUTTING_DOWN, code="server_unavailable")
        body = await read_body(Request(scope, receive), self.config.app)
        prompt = await run_in_threadpool(prompt_text, body)  # linear in the body, which the limit bounds
        request = Relayed(scope["method"], scope["path"], scope["query_string"], tuple(scope["headers"]), body,
                          scope.get("client"), prompt)
        if self.relaying >= self.config.max_requests:
            raise ApiError(429, f"the replicas hold {self.relaying} requests, their limit (each its running requests "
                                "+ --max-queue); retry later or add replicas.", code="server_full",
                           headers={"Retry-After": "1"})
        self.relaying += 1
        gone = asyncio.ensure_future(_disconnect(receive))
        start: Message | None = None  # held until the body's first part: a replica lost before it is a clean 503
        sent = False
        call = None
        try:
            call = self._stream(request)
            messages = call.__aiter__()
            accepted = await _next(messages, gone, self.config.route_timeout_s)
            assert accepted is not None and accepted[0]["type"] == ACCEPTED, accepted
            replica = (REPLICA_HEADER, accepted[0]["replica"].encode())
            ended = False  # the answer's last part is sent: its client may go now, nothing is lost
            while (batch := await _next(messages, None if ended else gone)) is not None:
                for message in batch:
                    if message["type"] == "http.response.start":
                        start = {**message, "headers": [*message.get("headers", []), replica]}
                        continue
                    if not sent and start is not None:
                        await send(start)
                        sent = True
                    await send(message)
                    ended = message["type"] == "http.response.body" and not message.get("more_body", False)
            if not sent and start is not None:  # an answer without a body
                await send(start)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except _Gone:
            if call is not None:
                call.cancel()
        except (BackPressureError, RayActorError, RequestCancelledError, TimeoutError) as e:
            if call is not None:
                call.cancel()
            refusal = _retryable(e)
            if not sent:
                raise refusal from None
            self.refused.labels(str(refusal.status)).inc()
            if _is_stream(start):  # the stream's own way of saying it failed, as app.py's events do
                await send({"type": "http.response.body", "body": sse(refusal.body()), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception as e:  # noqa: BLE001 - a bug: as app.py, a 500 naming its type, the traceback to the log
            log.exception("internal error relaying a request")
            if call is not None:
                call.cancel()
            if not sent:
                raise ApiError(500, f"internal error ({type(e).__name__}); the server's log has its traceback.") from None
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.relaying -= 1
            if not self.relaying:
                self.idle.set()
            gone.cancel()

    def _stream(self, request: Relayed, replica: str | None = None) -> DeploymentResponseGenerator[list[Message]]:
        """The replicas' answer to `request` as it comes, in batches of messages (to one replica, by its id, if
        given)."""
        pin = {PIN: replica} if replica is not None else {}
        return cast(DeploymentResponseGenerator[list[Message]],
                    self.replicas.options(stream=True).relay.remote(request, **pin))

    async def _replica_ids(self) -> list[str]:
        """The replicas the router sends to; Serve makes the router on the first call through the handle."""
        if not replicas_of(self.app_name):
            await self._ask(None, "/health")
        return replicas_of(self.app_name)

    async def _ask(self, replica: str | None, path: str) -> Any:
        """A replica's own answer to GET `path` (the replica given by its id, or any): (status, body bytes, its
        process id), or None if it gave none. Not two at once: the calls made while answering one HTTP request share Serve's
        internal request id, by which its router hands a chosen replica to the call waiting for it."""
        request = Relayed("GET", path, b"", ((b"host", b"localhost"),), b"", None)
        parts: list[bytes] = []
        status, pid = None, None

        async def collect() -> None:
            nonlocal status, pid
            async for batch in self._stream(request, replica):
                for message in batch:
                    if message["type"] == ACCEPTED:
                        pid = message["pid"]
                    elif message["type"] == "http.response.start":
                        status = message["status"]
                    elif message["type"] == "http.response.body":
                        parts.append(message.get("body", b""))

        try:
            await asyncio.wait_for(collect(), _ASK_S)
        except (asyncio.TimeoutError, RayActorError, RequestCancelledError):
            return None
        return (status, b"".join(parts), pid) if status is not None else None

    async def _health(self) -> Response:
        running, app_status = await run_in_threadpool(self._serve_state)
        ids = await self._replica_ids()
        answers = [await self._ask(replica, "/health") for replica in ids]  # one by one: _ask says why
        each = [{"id": replica, **({**json.loads(answer[1]), "pid": answer[2]} if answer is not None
                                   else {"status": "unreachable"})} for replica, answer in zip(ids, answers)]
        target = self.config.target_replicas
        status = ("draining" if self.draining or app_status == "DELETING" else "unavailable" if running == 0
                  else "ready" if running >= target else "degraded")
        body = {"status": status, "model": self.config.app.model, "replicas_running": running,
                "replicas_target": target, "replicas": each}
        return JSONResponse(body, 200 if status in ("ready", "degraded") else 503)

    def _serve_state(self) -> tuple[int, str]:
        """Running replicas and the application's status, from Serve's controller."""
        app = serve.status().applications.get(self.app_name)
        if app is None:
            return 0, "NOT_STARTED"
        deployment = app.deployments.get(self.config.replica_deployment)
        running = deployment.replica_states.get(ReplicaState.RUNNING, 0) if deployment is not None else 0
        return running, str(app.status.value if hasattr(app.status, "value") else app.status)

    async def _metrics(self) -> bytes:
        ids = await self._replica_ids()
        answers = [await self._ask(replica, "/metrics") for replica in ids]
        texts = {replica: answer[1].decode() for replica, answer in zip(ids, answers) if answer is not None}
        texts["ingress"] = generate_latest(self.registry).decode()
        registry = CollectorRegistry()
        registry.register(_Merged(texts))
        return generate_latest(registry)


class _Merged:
    """Prometheus families from several registries' text, one family each, every sample labelled `replica`."""

    def __init__(self, texts: dict[str, str]):
        self.texts = texts

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        for replica, text in self.texts.items():
            for family in text_string_to_metric_families(text):
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                             family.unit))
                for sample in family.samples:
                    into.samples.append(sample._replace(labels={**sample.labels, "replica": replica}))
        return merged.values()


async def _next(messages: AsyncIterator[list[Message]], gone: asyncio.Future[None] | None,
                timeout_s: float | None = None) -> list[Message] | None:
    """The answer's next batch of messages (None at its end); _Gone once the client has gone (if `gone` is watched),
    TimeoutError past `timeout_s`."""
    step = asyncio.ensure_future(messages.__anext__())
    waited: set[asyncio.Future[Any]] = {step} if gone is None else {step, gone}
    done, _ = await asyncio.wait(waited, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    if step not in done:
        step.cancel()
        step.add_done_callback(lambda task: task.cancelled() or task.exception())  # its end is of no interest
        raise _Gone() if gone in done else TimeoutError()
    try:
        return step.result()
    except StopAsyncIteration:
        return None


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _retryable(error: Exception) -> ApiError:
    if isinstance(error, BackPressureError):
        return ApiError(429, "every replica is full and Serve's queue too (--max-queue); retry later or add "
                             "replicas.", code="server_full", headers={"Retry-After": "1"})
    if isinstance(error, TimeoutError):
        return ApiError(503, "no replica took the request in time (none is running); retry later.",
                        code="server_unavailable", headers={"Retry-After": "1"})
    log.warning("a replica was lost with a request on it: %s", error)
    return ApiError(503, "the replica serving this request stopped; retry it: Serve is replacing the replica.",
                    code="server_unavailable", headers={"Retry-After": "1"})


def _is_stream(start: Message | None) -> bool:
    headers = dict(start["headers"]) if start is not None else {}
    return headers.get(b"content-type", b"").startswith(b"text/event-stream")
